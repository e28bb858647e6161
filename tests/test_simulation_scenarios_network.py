"""The ``[network]`` scenario table and the partition, paused-node and slow-handoff scenarios.

Validation errors name the file, the key and the problem, as for the other
tables; a scenario without the table reports exactly what it did before (no
``network`` key anywhere); the bundled scenarios show what docs/simulations.md
says they show.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from simulations import ScenarioError, load_scenario, parse_scenario, simulate
from simulations.arrivals import generate
from simulations.modes import run_mode
from simulations.network import SimNetwork, from_spec
from simulations.sticky import StickyMode
from simulations.timeline import build_timeline

SCENARIOS = Path(__file__).resolve().parent.parent / "simulations" / "scenarios"


def make(**extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "scenario": {"name": "t", "duration": 30, "seed": 3},
        "cluster": {"nodes": 4},
        "users": {"count": 60, "popularity": "zipf", "exponent": 0.8},
        "arrivals": {"rate": 400},
        "rules": [{"limit": "20/5s"}],
        "events": [{"at": 15.1, "type": "leave", "node": "n2"}],
    }
    doc.update(extra)
    return doc


def over_admitted(doc: dict[str, Any], mode: str) -> tuple[int, StickyMode]:
    sc = parse_scenario(doc)
    timeline, arrivals = build_timeline(sc), generate(sc)
    reference = run_mode("global", timeline, arrivals)
    sticky = StickyMode(mode, timeline, arrivals, full=True)
    result = sticky.run()
    n = sc.users.count
    got = np.bincount(arrivals.users[result.allowed], minlength=n)
    want = np.bincount(arrivals.users[reference.allowed], minlength=n)
    return int(np.clip(got - want, 0, None).sum()), sticky


# --------------------------------------------------------------------------- validation


def partition(**fields: Any) -> dict[str, Any]:
    return {"partitions": [{"at": 5, "until": 12, "groups": [["n3"]], **fields}]}


@pytest.mark.parametrize(
    ("network", "key", "problem"),
    [
        ({"delay": "-1s"}, "network.delay", "cannot read duration"),
        ({"delay": "2min"}, "network.delay", "must be <= 60s"),
        ({"jitter": "true"}, "network.jitter", "cannot read duration"),
        ({"loss": 1.5}, "network.loss", "must be <= 1"),
        ({"lag": 1}, "network.lag", "unknown key"),
        ({"partitions": {"at": 1}}, "network.partitions", "must be an array"),
        (partition(until=5), "network.partitions[0].until", "must be after at"),
        (partition(at=40), "network.partitions[0].at", "before the end of the run"),
        (partition(groups=[]), "network.partitions[0].groups", "non-empty array"),
        (partition(groups=[[]]), "network.partitions[0].groups[0]", "non-empty array"),
        (partition(groups=[["router"]]), "network.partitions[0].groups[0][0]", "router"),
        (partition(groups=[["n3"], ["n3"]]), "network.partitions[0].groups[1][0]", "two groups"),
        (partition(groups=[["n9"]]), "network.partitions[0].groups", "not a member"),
        (partition(side=1), "network.partitions[0].side", "unknown key"),
        (
            {
                "partitions": [
                    *partition()["partitions"],
                    {"at": 10, "until": 14, "groups": [["n1"]]},
                ]
            },
            "network.partitions[1].at",
            "overlaps network.partitions[0]",
        ),
    ],
)
def test_network_validation_names_file_key_and_problem(
    network: dict[str, Any], key: str, problem: str
) -> None:
    with pytest.raises(ScenarioError) as err:
        parse_scenario(make(network=network), source="scenarios/bad.toml")
    message = str(err.value)
    assert message.startswith(f"scenarios/bad.toml: {key}: "), message
    assert problem in message


def test_a_partition_and_a_pause_of_one_node_at_once_are_refused() -> None:
    doc = make(
        events=[{"at": 8, "type": "pause", "node": "n3", "duration": 2}],
        network=partition(),
    )
    with pytest.raises(ScenarioError, match=r"already paused"):
        parse_scenario(doc, source="bad.toml")


def test_the_leases_mode_refuses_a_network_table() -> None:
    """The lease simulation sends nothing through the simulated network, and a
    partition is a pause for the router, which it does not model either."""
    doc = make(network=partition(), modes={"run": ["handoff", "leases"]})
    with pytest.raises(ScenarioError, match=r"modes.run: mode leases: .*\[network\] table"):
        parse_scenario(doc, source="bad.toml")
    with pytest.raises(ScenarioError, match=r"mode leases"):
        parse_scenario(make(network={"delay": "1s"})).with_modes(("leases",))


def test_lease_auto_with_a_network_table_says_the_leases_mode_is_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``lease = "auto"`` adds the leases mode to the default run; with a
    [network] table it was dropped without a word (exit 0, no leases row),
    and ``--modes leases`` said why without naming --modes."""
    from simulations.cli import main

    doc = make(network={"delay": "1ms"}, rules=[{"limit": "20/5s", "lease": "auto"}])
    scenario = parse_scenario(doc, source="x.toml")
    assert "leases" not in scenario.modes
    assert scenario.notes == (
        "x.toml: rules[0].lease = 'auto': the leases mode is left out: "
        "the lease simulation does not model the [network] table",
    )
    assert scenario.with_modes(("handoff",)).notes == ()  # --modes decides what runs
    path = tmp_path / "x.toml"
    path.write_text(
        "[scenario]\nname = 't'\nduration = 5\n[cluster]\nnodes = 3\n[users]\ncount = 20\n"
        "[arrivals]\nrate = 50\n[[rules]]\nlimit = '20/5s'\nlease = 'auto'\n"
        "[network]\ndelay = '1ms'\n"
    )
    assert main([str(path), "--quiet"]) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        f"ringlimit simulate: {path}: rules[0].lease = 'auto': the leases mode is left out: "
        "the lease simulation does not model the [network] table\n"
    )
    assert "\nleases " not in captured.out
    assert main([str(path), "--quiet", "--modes", "leases"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringlimit simulate: --modes: mode leases: "), err
    assert len(err.splitlines()) == 1


def test_a_scenario_without_the_table_reports_no_network() -> None:
    report = simulate(parse_scenario(make())).report
    assert "network" not in report["scenario"]
    assert all("network" not in mode for mode in report["modes"].values())
    with_table = simulate(parse_scenario(make(network={}))).report
    assert with_table["scenario"]["network"] == {
        "delay_s": 0.0,
        "jitter_s": 0.0,
        "loss": 0.0,
        "partitions": [],
    }
    assert with_table["modes"]["handoff"]["network"]["messages_lost"] == 0
    # An instant, lossless network decides exactly as no table.
    for mode in report["modes"]:
        a, b = report["modes"][mode], with_table["modes"][mode]
        assert a["allowed"] == b["allowed"] and a["events"] == b["events"]


# --------------------------------------------------------------------------- the network


def test_splits_cut_groups_apart_for_their_time_only() -> None:
    network = SimNetwork()
    network.split(10.0, 20.0, [frozenset({"a", "b"}), frozenset({"c"})])
    assert network.reachable("a", "b", 15.0)
    assert not network.reachable("a", "c", 15.0)
    assert not network.reachable("a", "d", 15.0)  # d is with the unlisted rest
    assert network.reachable("d", "e", 15.0)
    assert network.reachable("a", "c", 20.0) and network.reachable("a", "c", 9.9)
    assert network.reachable("a", "c")  # no time: only the static cuts


def test_loss_and_jitter_draws_depend_only_on_the_message() -> None:
    sc = parse_scenario(make(network={"delay": "0.5s", "jitter": "1s", "loss": 0.5}))
    a, b = from_spec(sc.network, 3, 0.0), from_spec(sc.network, 3, 0.0)
    draws = [a.draw("loss", "n1", "n2", object(), t / 10) for t in range(200)]
    assert draws == [b.draw("loss", "n1", "n2", object(), t / 10) for t in range(200)]
    assert 0.35 < sum(d < 0.5 for d in draws) / len(draws) < 0.65
    assert from_spec(sc.network, 4, 0.0).draw("loss", "n1", "n2", 0, 1.0) != a.draw(
        "loss", "n1", "n2", 0, 1.0
    )


def test_lost_transfers_are_pulled_and_lost_replicas_over_admit() -> None:
    """Losing every transfer of a leave costs nothing: the new owners pull each
    key on its first request from the leaving member (reachable: only the
    POST was lost). Losing every replica batch before a crash costs what the
    crashed node admitted since the start."""
    assert over_admitted(make(network={"loss": 0.0}), "handoff")[0] == 0
    over, mode = over_admitted(make(network={"loss": 1.0}), "handoff")
    assert mode.network.lost > 0 and over == 0
    assert sum(c.stats.pulls for c in mode.all_cores) > 0
    crash = [{"at": 15.1, "type": "crash", "node": "n2"}]
    kept, _ = over_admitted(make(events=crash, network={"loss": 0.0}), "replica")
    lost, mode = over_admitted(make(events=crash, network={"loss": 1.0}), "replica")
    assert mode.network.lost > 0 and lost > kept


def test_a_paused_node_is_cut_off_from_everyone_while_it_is_stopped() -> None:
    doc = make(events=[{"at": 10, "type": "pause", "node": "n2", "duration": 2}])
    _, mode = over_admitted(doc, "replica")
    assert mode.network.lost > 0  # replica batches sent to n2 while it was stopped
    assert not mode.network.reachable("n1", "n2", 11.0)
    assert mode.network.reachable("n1", "n2", 12.0)


def test_a_network_scenario_decides_the_same_in_full_and_subset_runs() -> None:
    sc = load_scenario(SCENARIOS / "slow_handoff.toml").with_modes(("handoff", "replica"))
    sc = parse_scenario(
        {**copy.deepcopy(dict(sc.raw)), "users": {"count": 500}, "arrivals": {"rate": 300}}
    )
    subset = simulate(sc).report
    full = simulate(sc, full=True).report
    for mode in ("handoff", "replica"):
        assert subset["modes"][mode]["allowed"] == full["modes"][mode]["allowed"]
        assert subset["modes"][mode]["events"] == full["modes"][mode]["events"]


# --------------------------------------------------------------------------- the scenarios


def test_partition_scenario() -> None:
    report = simulate(load_scenario(SCENARIOS / "partition.toml")).report
    (outage,) = report["detection"]["outages"]
    assert outage["node"] == "n3" and outage["source_event"] == -1  # network.partitions[0]
    assert outage["removed_s"] is not None and outage["removed_s"] < outage["end_s"]
    assert outage["rejoined_s"] is not None and outage["rejoined_s"] >= outage["end_s"]
    modes = report["modes"]
    assert modes["replica"]["over_admission"]["total"] == 0
    assert modes["conservative"]["over_admission"]["total"] == 0
    # n3's users restart from nothing on the other side under reset
    assert modes["reset"]["over_admission"]["total"] > modes["handoff"]["over_admission"]["total"]
    assert modes["handoff"]["over_admission"]["total"] > 0


def test_paused_node_scenario_the_lease_keeps_it_from_deciding() -> None:
    report = simulate(load_scenario(SCENARIOS / "paused_node.toml")).report
    (outage,) = report["detection"]["outages"]
    lease = report["scenario"]["detection"]["lease_s"]
    assert outage["end_s"] - outage["start_s"] > lease
    # It never decides again as the member it was: its lease ran out while it
    # was stopped, and the router removed it only once the lease was over.
    assert outage["resumed_s"] is None
    assert outage["removed_s"] >= outage["last_answer_s"] + lease
    assert report["detection"]["deferred"]["lease"] >= 1
    assert report["modes"]["replica"]["over_admission"]["total"] == 0
    # With a lease, nothing is decided twice: the keys are denied (closed) meanwhile.
    assert report["modes"]["replica"]["unavailable"]["denied"] > 0


def test_slow_handoff_scenario_pulls_and_stays_exact() -> None:
    report = simulate(load_scenario(SCENARIOS / "slow_handoff.toml")).report
    for mode in ("handoff", "conservative", "replica"):
        entry = report["modes"][mode]
        assert entry["over_admission"]["total"] == 0, mode
        assert entry["false_denials"]["total"] == 0, mode
        assert entry["network"]["pulls"] > 0 and entry["network"]["messages_lost"] == 0
    assert report["modes"]["reset"]["over_admission"]["total"] > 0
