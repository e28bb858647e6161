"""The lease simulation (simulations/quota.py) on the hot-user scenario and per algorithm.

The figures docs/hotkeys.md quotes come from these runs: the hot user's owner
goes from ~1.83x the mean load to <= 1.2x with leases, nothing is
over-admitted, and every user's false denials stay within the bound.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from node.quota import LeasePolicy
from node.rules import Rule
from simulations import load_scenario
from simulations.cli import SCENARIO_DIR
from simulations.quota import main, simulate_leases

HOT = SCENARIO_DIR / "hot_user.toml"


def test_hot_user_leases_bring_the_owner_load_down_exactly() -> None:
    report = simulate_leases(load_scenario(HOT))
    load = report["owner_load_max_over_mean"]
    assert load["sticky"] == pytest.approx(1.83, abs=0.01)
    assert load["leases_off"] == load["sticky"]
    assert load["leases_on"] <= 1.2
    on, off = report["leases_on"], report["leases_off"]
    assert on["over_admission"] == 0 and off["over_admission"] == 0
    assert on["users_above_bound"] == 0
    assert on["false_denials"] <= on["false_denial_bound"] + off["false_denials"]
    assert on["leases"] > 0 and on["local_denials"] > 0


def test_hot_user_steady_state_false_denials_within_the_bound() -> None:
    report = simulate_leases(replace(load_scenario(HOT), events=()))
    assert report["owner_load_max_over_mean"]["leases_on"] <= 1.2
    on = report["leases_on"]
    assert on["over_admission"] == 0 and on["users_above_bound"] == 0
    assert on["false_denials"] <= on["false_denial_bound"]
    assert report["leases_off"]["false_denials"] == 0


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra", "fixed_window", "sliding_window"])
def test_every_leased_algorithm_is_exact_in_the_simulation(algorithm: str) -> None:
    base = load_scenario(HOT)
    rule = Rule("r", 600, 60.0, algorithm, burst=100)
    scenario = replace(base, rules=(rule,), duration=20.0, events=())
    report = simulate_leases(scenario, LeasePolicy("auto", threshold=20.0, ttl=2.0))
    on = report["leases_on"]
    assert on["leases"] > 0
    assert on["over_admission"] == 0
    assert on["users_above_bound"] == 0


def test_main_prints_the_report(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main([str(HOT), "--steady"]) == 0
    assert '"leases_on"' in capsys.readouterr().out


def test_main_refuses_what_it_cannot_run_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/hotkeys.md tells an operator to run ``python -m simulations.quota
    SCENARIO.toml [--steady]``. Before, a missing file, ``--help`` or a mistyped
    option ended in a traceback (``--help`` was read as a scenario's file name)."""
    assert main(["--help"]) == 0
    assert "usage: python -m simulations.quota" in capsys.readouterr().out
    for argv in ([str(tmp_path / "missing.toml")], [str(HOT), "--stedy"]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


def test_the_leases_mode_runs_beside_the_others_in_ringlimit_simulate() -> None:
    from simulations.runner import simulate

    scenario = load_scenario(HOT)
    assert scenario.rules[0].lease == "auto" and "leases" in scenario.modes
    report = simulate(scenario, jobs=1).report
    leases, sticky = report["modes"]["leases"], report["modes"]["conservative"]
    assert leases["over_admission"]["total"] == 0
    assert sticky["load"]["requests_max_over_mean"] == pytest.approx(1.83, abs=0.01)
    assert leases["load"]["requests_max_over_mean"] <= 1.2
    # the same run as simulate_leases: its false denials, within its bound
    direct = simulate_leases(scenario)["leases_on"]
    assert leases["false_denials"]["total"] == direct["false_denials"]
    assert direct["users_above_bound"] == 0
    assert [e["policy"] for e in leases["events"]] == ["handoff", "conservative"]
    assert leases["events"][1]["leases_revoked"] >= 0
    # off by default: a scenario whose rule does not lease runs the six modes
    assert "leases" not in load_scenario(SCENARIO_DIR / "tiny.toml").modes
