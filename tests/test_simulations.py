"""Simulations: golden output, the properties each policy must show, determinism.

Regenerate the golden file after an intended change of the output with
``UPDATE_GOLDEN=1 python -m pytest tests/test_simulations.py -k golden``
(and bump ``SCHEMA_VERSION`` if a field changed meaning).
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.algorithms import REGISTRY
from node.lease import DEFAULT_DRIFT, lease_bound
from ring import diff as ring_diff
from simulations import SCHEMA_VERSION, ScenarioError, load_scenario, parse_scenario, simulate
from simulations.arrivals import generate, user_name
from simulations.cli import SCENARIO_DIR, main
from simulations.modes import run_mode
from simulations.report import dumps, format_report, stable
from simulations.scenario import expand_with_detection
from simulations.timeline import build_timeline

GOLDEN = Path(__file__).parent / "golden" / "tiny.json"
ALGORITHMS = ["token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window"]


def make(**sections: Any) -> dict[str, Any]:
    """A small scenario document; keyword arguments replace whole sections."""
    doc: dict[str, Any] = {
        "scenario": {"name": "t", "duration": 30, "seed": 3},
        "cluster": {"nodes": 4},
        "users": {"count": 60, "popularity": "zipf", "exponent": 0.8},
        "arrivals": {"rate": 400},
        "rules": [{"limit": "20/5s"}],
    }
    doc.update(sections)
    return doc


def run(doc: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    return simulate(parse_scenario(doc), **kwargs).report


# --------------------------------------------------------------------------- golden


def test_golden_report_of_the_tiny_scenario() -> None:
    report = simulate(load_scenario(SCENARIO_DIR / "tiny.toml")).report
    got = json.loads(dumps(stable(report)))
    assert "run" not in got and got["schema_version"] == SCHEMA_VERSION
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(dumps(got), encoding="utf-8")
    want = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert got == want


def test_every_bundled_scenario_is_valid() -> None:
    names = sorted(p.stem for p in SCENARIO_DIR.glob("*.toml"))
    for required in ("tiny", "scale_out", "scale_in", "crash", "rolling_restart", "hot_user"):
        assert required in names
    assert "large_10m" in names and "large_50" in names
    for path in SCENARIO_DIR.glob("*.toml"):
        load_scenario(path)
    big = load_scenario(SCENARIO_DIR / "large_10m.toml")
    assert big.users.count == 1_000_000
    assert big.arrivals.rate * big.duration == 10_000_000
    assert len(load_scenario(SCENARIO_DIR / "large_50.toml").nodes) == 50


# --------------------------------------------------------------------------- properties

JOIN_LEAVE = [
    {"at": 8.3, "type": "join", "node": "n5"},
    {"at": 15.1, "type": "leave", "node": "n2"},
    {"at": 21.7, "type": "join", "node": "n6", "weight": 2},
    {"at": 25.2, "type": "restart", "node": "n3", "downtime": 1.5},
]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_handoff_never_over_admits_on_join_and_graceful_leave(algorithm: str) -> None:
    report = run(make(rules=[{"limit": "20/5s", "algorithm": algorithm}], events=JOIN_LEAVE))
    handoff = report["modes"]["handoff"]
    assert handoff["over_admission"]["total"] == 0
    assert handoff["false_denials"]["total"] == 0
    assert handoff["mismatches"] == 0
    for event in handoff["events"]:
        assert (event["over_admission"], event["false_denials"], event["mismatches"]) == (0, 0, 0)
        assert event["time_to_agree_s"] == 0.0
    assert sum(e["states_transferred"] for e in handoff["events"]) > 0
    # The same moves without handoff do over-admit: the scenario exercises heavy moved keys.
    assert report["modes"]["reset"]["over_admission"]["total"] > 0


def test_handoff_on_multiple_rules() -> None:
    rules = [
        {"limit": "10/second", "algorithm": "sliding_window", "name": "burst"},
        {"limit": "60/minute", "algorithm": "fixed_window", "name": "minute"},
    ]
    report = run(make(rules=rules, events=JOIN_LEAVE))
    assert report["modes"]["handoff"]["mismatches"] == 0
    assert report["modes"]["reset"]["over_admission"]["total"] > 0


def test_the_reference_agrees_with_itself() -> None:
    scenario = parse_scenario(make(events=JOIN_LEAVE))
    result = simulate(scenario)
    ref = result.report["modes"]["global"]
    assert ref["over_admission"]["total"] == ref["false_denials"]["total"] == 0
    assert ref["over_admission"]["per_window"] == ref["false_denials"]["per_window"] == 0
    assert ref["mismatches"] == 0
    assert ref["allowed"] == result.report["totals"]["reference_allowed"]
    # An independent second run of the exact limiter decides every arrival the same way.
    again = run_mode("global", result.timeline, result.arrivals)
    assert np.array_equal(again.allowed, result.results["global"].allowed)
    assert 0 < again.allowed.sum() < len(again.allowed)


@pytest.mark.parametrize("algorithm", ["fixed_window", "token_bucket"])
@pytest.mark.parametrize("nodes", [2, 3, 5])
def test_round_robin_over_admits_about_n_minus_one_quotas(algorithm: str, nodes: int) -> None:
    # 20 users at 50 req/s each against 5/s: every user exceeds the quota on every node.
    doc = make(
        cluster={"nodes": nodes},
        users={"count": 20, "popularity": "uniform"},
        arrivals={"rate": 1000},
        rules=[{"limit": "5/second", "algorithm": algorithm}],
        modes={"run": ["round_robin"]},
    )
    report = run(doc)
    assert report["totals"]["users_throttled"] == 20
    over = report["modes"]["round_robin"]["over_admission"]
    ratio = over["total"] / report["totals"]["reference_allowed"]
    assert ratio == pytest.approx(nodes - 1, rel=0.08)
    assert over["users"] == 20


@pytest.mark.parametrize("nodes", [3, 4, 9, 19])
def test_keys_moved_on_join_and_leave_are_near_the_ideal_share(nodes: int) -> None:
    doc = make(
        cluster={"nodes": nodes},
        users={"count": 20_000, "popularity": "uniform"},
        events=[
            {"at": 5, "type": "join", "node": "new"},
            {"at": 10, "type": "leave", "node": "n1"},
        ],
    )
    scenario = parse_scenario(doc)
    timeline = build_timeline(scenario)
    join, leave = timeline.changes
    assert join.ideal_fraction == pytest.approx(1 / (nodes + 1))
    assert leave.ideal_fraction == pytest.approx(1 / (nodes + 1))  # N+1 members then
    for change in (join, leave):
        assert change.moved_fraction == pytest.approx(change.ideal_fraction, rel=0.2)
        assert change.moved_elsewhere == 0  # equal weights: only the changed member's keys
    # The simulator's count is the ring's own diff over the same users.
    names = timeline.names
    epochs = timeline.epochs
    assert join.keys_moved == len(ring_diff(epochs[0].view, epochs[1].view, names))


def test_reset_on_a_join_over_admits_heavy_users() -> None:
    doc = make(
        users={"count": 30, "popularity": "zipf", "exponent": 1.2},
        events=[{"at": 12.5, "type": "join", "node": "n5"}],
    )
    report = run(doc)
    reset = report["modes"]["reset"]
    assert reset["events"][0]["over_admission"] > 0
    assert reset["over_admission"]["total"] == reset["events"][0]["over_admission"]
    worst = reset["over_admission"]["worst_user"]
    # At most one extra quota (burst 20) per moved key, per change.
    assert 0 < worst["count"] <= 20
    assert report["modes"]["handoff"]["over_admission"]["total"] == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_conservative_crash_never_over_admits(algorithm: str) -> None:
    doc = make(
        rules=[{"limit": "20/5s", "algorithm": algorithm}],
        events=[
            {"at": 10.3, "type": "crash", "node": "n2"},
            {"at": 17.7, "type": "join", "node": "n5"},
            {"at": 22, "type": "restart", "node": "n3", "graceful": False, "downtime": 2},
        ],
    )
    report = run(doc)
    cons = report["modes"]["conservative"]
    assert cons["over_admission"]["total"] == 0
    assert all(e["over_admission"] == 0 for e in cons["events"])
    # (per_window may be > 0: a key that starts exhausted admits later than the
    # reference, so some window can see more admissions than the reference's.)
    assert cons["events"][0]["conservative_keys"] > 0
    assert 0 < cons["events"][0]["conservative_used"] <= cons["events"][0]["conservative_keys"]
    assert cons["false_denials"]["total"] > 0  # the price: false denials instead
    # ...while the same crash under reset does over-admit.
    assert report["modes"]["handoff"]["events"][0]["over_admission"] > 0


@pytest.mark.parametrize(
    ("rule", "fresh_at"),
    [
        # Exhausted at 10.3 in the window [10, 15): it still counts, weighted, until
        # the end of the next window.
        ({"limit": "3/5s", "algorithm": "sliding_window"}, 20.0),
        # 10 tokens at 0.2/s: empty at 10.3, full again 50 s later (after the run).
        ({"limit": "1/5s", "algorithm": "token_bucket", "burst": 10}, 60.3),
        ({"limit": "1/5s", "algorithm": "gcra", "burst": 10}, 60.3),
    ],
    ids=["sliding_window", "token_bucket-burst", "gcra-burst"],
)
def test_conservative_exhaustion_lasts_until_the_state_refills_as_on_the_node(
    rule: dict[str, Any], fresh_at: float
) -> None:
    """The node (node/shard.py ``_exhaust``) starts a crashed member's key exhausted
    while that exhausted state is not yet fresh, which here is longer than a period.
    The simulation used to end it at ``at + period``: keys first asked in between got
    a fresh quota. Every verdict on the crashed member's keys is replayed here with
    the engine, starting each key as the node does."""
    crash_at = 10.3
    doc = make(
        users={"count": 600, "popularity": "uniform"},
        arrivals={"rate": 150},
        rules=[rule],
        events=[{"at": crash_at, "type": "crash", "node": "n2"}],
    )
    result = simulate(parse_scenario(doc))
    (spec,) = result.scenario.rules
    algorithm = REGISTRY[spec.algorithm]
    exhausted, _ = algorithm.decide(None, crash_at, spec, spec.capacity)
    assert algorithm.fresh_at(exhausted, spec) == pytest.approx(fresh_at)
    assert fresh_at > crash_at + spec.period
    lost = result.timeline.epochs[0].owners == result.timeline.node_index("n2")
    times, users = result.arrivals.times, result.arrivals.users
    after = np.flatnonzero((times >= crash_at) & lost[users])
    cost = result.scenario.arrivals.cost

    def replay(until: float) -> tuple[list[bool], dict[int, float]]:
        """Verdicts on the lost keys when an untouched key starts exhausted until ``until``."""
        first: dict[int, float] = {}
        states: dict[int, Any] = {}
        verdicts = []
        for i in after.tolist():
            user, now = int(users[i]), float(times[i])
            if user not in first:
                first[user] = now
                states[user] = exhausted if now < until else None  # nothing was handed over
            states[user], decision = algorithm.decide(states[user], now, spec, cost)
            verdicts.append(decision.allowed)
        return verdicts, first

    expected, first = replay(fresh_at)
    assert replay(crash_at + spec.period)[0] != expected  # the scenario tells them apart
    assert result.results["conservative"].allowed[after].tolist() == expected
    event = result.report["modes"]["conservative"]["events"][0]
    assert event["conservative_keys"] == int(lost.sum())
    assert event["conservative_used"] == sum(t < fresh_at for t in first.values())


def test_replica_excess_is_bounded_by_the_last_interval() -> None:
    interval = 0.5
    crash_at = 10.3  # 0.3 s after the last replication tick
    doc = make(
        users={"count": 40, "popularity": "zipf", "exponent": 1.0},
        arrivals={"rate": 800},
        modes={"run": ["replica", "handoff"], "replication_interval": interval},
        events=[{"at": crash_at, "type": "crash", "node": "n2"}],
    )
    result = simulate(parse_scenario(doc))
    crash = result.report["modes"]["replica"]["events"][0]
    assert crash["replicas_promoted"] > 0
    # Lost updates: what the crashed node admitted since its last tick.
    arrivals, timeline = result.arrivals, result.timeline
    ref = result.results["global"].allowed
    crashed = timeline.node_index("n2")
    owned = timeline.epochs[0].owners[arrivals.users] == crashed
    last_tick = 10.0
    in_gap = (arrivals.times >= last_tick) & (arrivals.times < crash_at)
    lost = int((ref & owned & in_gap).sum())
    assert lost > 0
    assert crash["over_admission"] <= lost
    # Without replicas the same crash costs much more.
    assert result.report["modes"]["handoff"]["events"][0]["over_admission"] > lost


# --------------------------------------------------------------------------- determinism


def test_same_seed_same_report_and_different_seed_different_arrivals() -> None:
    doc = make(arrivals={"rate": 300, "process": "bursty", "burst_factor": 6}, events=JOIN_LEAVE)
    scenario = parse_scenario(doc)
    a = simulate(scenario)
    b = simulate(scenario)
    assert dumps(stable(a.report)) == dumps(stable(b.report))
    c = simulate(scenario, seed=scenario.seed + 1)
    assert c.report["scenario"]["seed"] == scenario.seed + 1
    assert len(c.arrivals) != len(a.arrivals) or not np.array_equal(
        c.arrivals.times, a.arrivals.times
    )
    assert stable(c.report) != stable(a.report)
    again = generate(scenario)
    assert np.array_equal(again.times, a.arrivals.times)
    assert np.array_equal(again.users, a.arrivals.users)


def test_parallel_full_and_subset_runs_agree() -> None:
    scenario = load_scenario(SCENARIO_DIR / "tiny.toml")
    serial = stable(simulate(scenario, jobs=1).report)
    assert stable(simulate(scenario, jobs=2).report) == serial
    # Deciding every arrival in every sticky mode gives the same report as deciding
    # only those of users some change moves.
    assert stable(simulate(scenario, jobs=1, full=True).report) == serial


def test_every_fork_of_a_parallel_run_is_made_by_its_main_thread() -> None:
    """A pool retiring its workers (``maxtasksperchild``) forks their
    replacements from a thread of its own while the main one runs on: a child
    forked so can inherit a lock held by another thread and deadlock (CPython
    warns of such forks from 3.12). The modes' pool did, six times a run."""
    forks: list[bool] = []
    recording = [True]

    def record() -> None:
        if recording[0]:
            forks.append(threading.current_thread() is threading.main_thread())

    os.register_at_fork(before=record)  # (no way to unregister: it stops recording)
    try:
        simulate(load_scenario(SCENARIO_DIR / "tiny.toml"), jobs=2)
    finally:
        recording[0] = False
    assert len(forks) >= 2, "the run forked no workers"
    assert all(forks), f"{forks.count(False)} of {len(forks)} forks made by another thread"


def test_arrivals_follow_the_scenario() -> None:
    doc = make(
        scenario={"name": "t", "duration": 20, "seed": 1},
        users={
            "count": 1000,
            "popularity": "zipf",
            "exponent": 1.1,
            "hot_users": 2,
            "hot_share": 0.25,
        },
        arrivals={"rate": 2000},
    )
    arrivals = generate(parse_scenario(doc))
    assert len(arrivals) == pytest.approx(40_000, rel=0.05)
    assert np.all(np.diff(arrivals.times) >= 0)
    assert arrivals.times[0] >= 0 and arrivals.times[-1] < 20
    counts = np.bincount(arrivals.users, minlength=1000)
    # Hot users get their share on top of their Zipf share; the tail is much colder.
    assert counts[:2].sum() / len(arrivals) > 0.25
    assert counts[0] > 20 * counts[100:].mean()
    bursty = make(
        arrivals={"rate": 2000, "process": "bursty", "burst_factor": 20, "burst_fraction": 0.1}
    )
    b = generate(parse_scenario(bursty))
    per_second = np.bincount(b.times.astype(int))
    assert per_second.max() > 3 * np.median(per_second)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("change", "key", "problem"),
    [
        (lambda d: d["users"].update(count=0), "users.count", "must be >= 1"),
        (lambda d: d["users"].update(popularity="pareto"), "users.popularity", "must be one of"),
        (lambda d: d["arrivals"].update(rate="fast"), "arrivals.rate", "must be a number"),
        (
            lambda d: d["rules"][0].update(limit="100/fortnight"),
            "rules[0].limit",
            "unknown time unit",
        ),
        (
            lambda d: d["rules"][0].update(algorithm="magic"),
            "rules[0].algorithm",
            "unknown algorithm",
        ),
        (
            lambda d: d["scenario"].update(duration="soon"),
            "scenario.duration",
            "cannot read duration",
        ),
        (lambda d: d["cluster"].update(nodes=["a", "a"]), "cluster.nodes[1]", "duplicate"),
        (
            lambda d: d.update(events=[{"at": 1, "type": "leave", "node": "zz"}]),
            "events[0].node",
            "not a member",
        ),
        (
            lambda d: d.update(events=[{"at": 1, "type": "join", "node": "n1"}]),
            "events[0].node",
            "already a member",
        ),
        (
            lambda d: d.update(events=[{"at": 99, "type": "crash", "node": "n1"}]),
            "events[0].at",
            "before the end",
        ),
        (
            lambda d: d.update(events=[{"at": 1, "type": "explode", "node": "n1"}]),
            "events[0].type",
            "must be one of",
        ),
        (
            lambda d: d.update(events=[{"at": 1, "type": "crash", "node": "n1", "weight": 2}]),
            "events[0].weight",
            "unknown key",
        ),
        (lambda d: d["users"].update(hot_share=0.5), "users.hot_users", "must be >= 1"),
        (lambda d: d.update(modes={"run": ["sticky"]}), "modes.run[0]", "unknown mode"),
        (
            lambda d: d.update(
                modes={"run": ["leases"]}, rules=[{"limit": "5/s"}, {"limit": "9/m"}]
            ),
            "modes.run",
            "exactly one rule",
        ),
        (
            lambda d: d.update(
                rules=[{"limit": "5/s", "algorithm": "sliding_log", "lease": "auto"}]
            ),
            "rules[0].lease",
            "not supported",
        ),
        (lambda d: d.update(extra=1), "extra", "unknown key"),
        (
            lambda d: d.update(modes={"replication_interval": 0.000001}),
            "modes.replication_interval",
            "must be between 0.001 and 60 s",
        ),
    ],
)
def test_validation_names_file_key_and_problem(change: Any, key: str, problem: str) -> None:
    doc = copy.deepcopy(make())
    change(doc)
    with pytest.raises(ScenarioError) as err:
        parse_scenario(doc, source="scenarios/bad.toml")
    message = str(err.value)
    assert message.startswith(f"scenarios/bad.toml: {key}: "), message
    assert problem in message


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1d", 86400.0), ("2 days", 172800.0), ("1m", 60.0), ("90 mins", 5400.0), ("1hr", 3600.0)],
)
def test_scenario_durations_take_the_cluster_configs_units(text: str, seconds: float) -> None:
    """A scenario's "1d" was refused ("use ms, s, min or h") where the cluster
    config's periods take it ("use ms, s, m, h or d"): one reader, one meaning."""
    from node.rules import parse_period

    doc = make(scenario={"name": "t", "duration": text}, arrivals={"rate": 0.01})
    assert parse_scenario(doc).duration == seconds == parse_period(text)


def test_replication_rounds_are_capped_before_the_run() -> None:
    """A 1 ms replication interval over 20 h (72 million rounds) ran for hours:
    refused up front, naming the interval and scenario.duration, as too many
    arrivals are."""
    quiet = {"name": "t", "duration": "20h"}
    doc = make(scenario=quiet, arrivals={"rate": 0.01}, modes={"replication_interval": "1ms"})
    # The default run (replica among its modes) is refused once the modes are
    # settled (ringlimit simulate asks check_rounds, or with_modes for --modes)...
    with pytest.raises(ScenarioError) as err:
        parse_scenario(doc, source="x.toml").check_rounds()
    message = str(err.value)
    assert message.startswith("mode replica: modes.replication_interval: 0.001 s over scenario")
    assert "72,000,000 replication rounds of up to 4 nodes, 288,000,000 rounds x nodes" in message
    assert "; at most 20,000,000 (each costs time)" in message
    # ... a run that names replica at parse time ...
    doc["modes"]["run"] = ["handoff", "replica"]
    with pytest.raises(ScenarioError, match=r"^x\.toml: modes\.replication_interval: 0\.001"):
        parse_scenario(doc, source="x.toml")
    # ... and without the replica mode nothing replicates: the same file runs,
    # with modes.run as with --modes (which was refused for replica's rounds).
    doc["modes"]["run"] = ["handoff"]
    scenario = parse_scenario(doc)
    scenario.check_rounds()
    del doc["modes"]["run"]
    parse_scenario(doc).with_modes(("handoff",)).check_rounds()
    with pytest.raises(ScenarioError, match=r"mode replica: modes.replication_interval: "):
        scenario.with_modes(("replica",))


@pytest.mark.timeout(60)
def test_probe_rounds_are_capped_before_the_replay() -> None:
    """1 ms probes over a 5,001 s run with a pause: the replay took about a
    minute at load time (a 2 h run, no output for minutes); refused up front."""
    probes = make(
        scenario={"name": "t", "duration": 5001},
        cluster={"nodes": 3},
        arrivals={"rate": 0.01},
        detection={"health_interval": "1ms", "health_timeout": "1ms"},
        events=[{"at": 10, "type": "pause", "node": "n2", "duration": "1h"}],
    )
    with pytest.raises(ScenarioError) as err:
        parse_scenario(probes, source="x.toml")
    message = str(err.value)
    assert message.startswith("x.toml: detection.health_interval: 0.001 s over scenario.duration")
    assert "5,001,000 probe rounds of up to 4 nodes" in message
    # No pause, no partition: no probe rounds are replayed, nothing to cap.
    parse_scenario({**probes, "events": []})


def test_removing_the_last_member_is_refused() -> None:
    doc = make(
        cluster={"nodes": ["a", "b"]},
        events=[
            {"at": 1, "type": "leave", "node": "a"},
            {"at": 2, "type": "crash", "node": "b"},
        ],
    )
    with pytest.raises(ScenarioError, match=r"events\[1\]\.node: .*leave the ring empty"):
        parse_scenario(doc)


def test_load_scenario_reports_toml_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[scenario\nname = 1\n")
    with pytest.raises(ScenarioError, match=r"bad\.toml: not valid TOML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="no such scenario file"):
        load_scenario(tmp_path / "missing.toml")


# --------------------------------------------------------------------------- CLI and output


def test_cli_writes_table_json_and_plots(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.json"
    plots = tmp_path / "plots"
    assert main(["tiny", "--json", str(out), "--plots", str(plots), "--seed", "11", "--quiet"]) == 0
    table = capsys.readouterr().out
    for mode in ("global", "handoff", "reset", "conservative", "replica", "round_robin"):
        assert mode in table
    report = json.loads(out.read_text())
    assert report["schema_version"] == SCHEMA_VERSION
    assert report["scenario"]["seed"] == 11
    assert report["run"]["decisions_per_s"] > 0
    names = sorted(p.name for p in plots.glob("*.png"))
    assert {"timeline.png", "load.png", "over_admission.png"} <= set(names)
    assert len([n for n in names if n.startswith("event_")]) == len(report["events"])


def test_cli_rejects_a_bad_scenario(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[scenario]\nname = "x"\nduration = "1s"\n')
    assert main([str(bad), "--quiet"]) == 2
    assert "bad.toml: cluster: missing required table" in capsys.readouterr().err


def test_report_schema_fields() -> None:
    report = simulate(load_scenario(SCENARIO_DIR / "tiny.toml")).report
    assert set(report) == {
        "schema_version",
        "scenario",
        "totals",
        "events",
        "detection",
        "modes",
        "timeline",
        "event_windows",
        "run",
    }
    assert report["detection"] is None  # no pause: failure detection is not replayed
    n_buckets = len(report["timeline"]["requests"])
    assert sum(report["timeline"]["requests"]) == report["totals"]["requests"]
    for mode, data in report["modes"].items():
        assert len(report["timeline"]["allowed"][mode]) == n_buckets
        assert sum(report["timeline"]["allowed"][mode]) == data["allowed"]
        assert len(data["events"]) == len(report["events"])
        assert set(data["policy"]) == {"join", "leave", "crash", "return"}
        assert data["unavailable"] == {"requests": 0, "admitted": 0, "denied": 0, "no_nodes": 0}
        charged = data["baseline"]["over_admission"] + sum(
            e["over_admission"] for e in data["events"]
        )
        assert charged >= data["over_admission"]["total"]
        assert data["over_admission"]["per_window"] >= data["over_admission"]["total"]
    worst = report["modes"]["round_robin"]["over_admission"]["worst_user"]
    assert worst["user"] == user_name(int(worst["user"].split("-")[1]))
    assert "over-admit" in format_report(report)


# --------------------------------------------------------------------------- pauses and detection


def _blip(**overrides: Any) -> dict[str, Any]:
    """The bundled blip scenario (issue 17), with some settings replaced."""
    import tomllib

    with (SCENARIO_DIR / "blip.toml").open("rb") as fh:
        doc = tomllib.load(fh)
    for key, value in overrides.items():
        table, _, name = key.partition("__")
        doc.setdefault(table, {})[name] = value
    return doc


STICKY = ("handoff", "reset", "conservative", "replica")


def test_a_cluster_wide_blip_under_the_removal_budget_keeps_every_counter() -> None:
    result = simulate(parse_scenario(_blip()))
    report = result.report
    detection = report["detection"]
    assert detection["budget"] is True
    # Nobody answers: the router suspects itself and removes no one.
    assert detection["removals"] == 0 and report["events"] == []
    assert detection["suspect_self_rounds"] > 0 and detection["deferred"]["quorum"] > 0
    users = report["totals"]["users"]
    assert report["totals"]["users_throttled"] == users  # every user spent the quota
    outages = detection["outages"]
    assert len(outages) == 3
    for outage in outages:
        assert outage["removed_s"] is None
        # Its lease ran out during the 12 s: it decides again from the first round after.
        assert 52.0 <= outage["resumed_s"] <= 52.0 + 1.5
    resumed = max(o["resumed_s"] for o in outages)
    after = result.arrivals.times >= resumed
    ref = result.results["global"].allowed
    for mode in STICKY:
        data = report["modes"][mode]
        assert data["over_admission"]["total"] == 0, mode
        assert data["over_admission"]["per_window"] == 0, mode
        # on_error = closed: the blip's requests were denied, and counted as such.
        down = data["unavailable"]
        assert down["requests"] > 100 and down["denied"] == down["requests"]
        assert down["admitted"] == down["no_nodes"] == 0
        # Counters kept: after the blip every decision is the reference's.
        assert np.array_equal(result.results[mode].allowed[after], ref[after]), mode


def test_the_same_blip_without_the_budget_loses_every_counter() -> None:
    doc = _blip(detection__budget=False, modes__returning="discard")
    report = run(doc)
    detection = report["detection"]
    # The router before the budget removed every member (the ring went empty), and
    # each came back as a new member that threw away what it held.
    assert detection["removals"] == 3 and detection["rejoins"] == 3
    kinds = [(e["type"], e["cause"]) for e in report["events"]]
    assert kinds == [("crash", "probe")] * 3 + [("join", "return")] * 3
    assert report["events"][2]["members_after"] == 0
    users = report["totals"]["users"]
    quota = 10
    for mode in ("handoff", "replica", "conservative"):
        data = report["modes"][mode]
        # About one fresh quota per user: nearly all 30 x 10.
        assert data["over_admission"]["total"] >= 0.9 * users * quota, mode
        assert data["unavailable"]["no_nodes"] > 0
        assert sum(e.get("states_discarded", 0) for e in data["events"]) > 0
    # Handing back instead recovers what the last-but-one returners held.
    back = run(_blip(detection__budget=False))
    for mode in ("replica", "conservative"):
        assert back["modes"][mode]["over_admission"]["total"] == 0
    assert (
        back["modes"]["handoff"]["over_admission"]["total"]
        < report["modes"]["handoff"]["over_admission"]["total"]
    )


def _pause_one(returning: str) -> dict[str, Any]:
    scenario = load_scenario(SCENARIO_DIR / "pause_one.toml", [f"modes.returning={returning}"])
    return simulate(scenario).report


def test_one_long_pause_is_removed_within_the_budget_and_hands_back_its_states() -> None:
    back, discard = _pause_one("hand_back"), _pause_one("discard")
    for report in (back, discard):
        detection = report["detection"]
        assert detection["removals"] == 1 and detection["rejoins"] == 1
        (outage,) = detection["outages"]
        # Removed after f failed probes *and* after its lease bound, then back at the
        # first probe round after the pause.
        lease_end = outage["last_answer_s"] + detection["lease_s"] * 1.01
        assert outage["removed_s"] >= lease_end
        assert detection["deferred"]["lease"] >= 1
        assert outage["end_s"] <= outage["rejoined_s"] <= outage["end_s"] + 1.5
        assert [(e["type"], e["cause"]) for e in report["events"]] == [
            ("crash", "probe"),
            ("join", "return"),
        ]
    handed = back["modes"]["handoff"]["events"][1]
    assert handed["states_handed_back"] > 0 and handed["states_discarded"] == 0
    assert discard["modes"]["handoff"]["events"][1]["states_discarded"] > 0
    # Crash policy reset: what was admitted while it was away is lost either way, but
    # discarding its states on return gives every one of its users a fresh quota.
    kept = back["modes"]["handoff"]["over_admission"]["total"]
    lost = discard["modes"]["handoff"]["over_admission"]["total"]
    assert 0 < kept < lost / 2
    # The replica held everything: nothing lost in either case.
    assert back["modes"]["replica"]["over_admission"]["total"] == 0
    assert back["scenario"]["returning"] == "hand_back"
    assert back["modes"]["handoff"]["policy"]["return"] == "hand_back"
    assert discard["modes"]["handoff"]["policy"]["return"] == "discard"


def test_on_error_open_admits_a_paused_nodes_keys_unlimited() -> None:
    doc = _blip(detection__budget=True)
    doc["rules"][0]["on_error"] = "open"
    report = run(doc)
    for mode in STICKY:
        data = report["modes"][mode]
        down = data["unavailable"]
        assert down["requests"] > 0 and down["admitted"] == down["requests"]
        # Every one of them was over the quota: each is an over-admission.
        assert data["over_admission"]["total"] == down["admitted"]


def test_pauses_of_scenarios_decide_the_same_in_full_and_subset_runs() -> None:
    scenario = load_scenario(SCENARIO_DIR / "pause_one.toml")
    assert stable(simulate(scenario, full=True).report) == stable(simulate(scenario).report)


@st.composite
def _pause_runs(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(2, 7))
    nodes = [f"n{i}" for i in range(1, n + 1)]
    events = []
    for _ in range(draw(st.integers(1, 4))):
        paused = draw(st.lists(st.sampled_from(nodes), min_size=1, max_size=n, unique=True))
        events.append(
            {
                "at": draw(st.floats(0.5, 50.0)),
                "type": "pause",
                "nodes": paused,
                "duration": draw(st.floats(0.5, 25.0)),
            }
        )
    detection = {
        "health_interval": draw(st.sampled_from([0.2, 0.5, 1.0])),
        "failure_threshold": draw(st.integers(1, 4)),
        "health_timeout": draw(st.sampled_from([0.1, 0.5])),
        "removal_quorum": draw(st.sampled_from([0.0, 0.3, 0.5, 0.66])),
    }
    if draw(st.booleans()):
        detection["removal_interval"] = draw(st.sampled_from([0.0, 1.0, 10.0]))
    doc = make(
        scenario={"name": "p", "duration": 80, "seed": 1},
        cluster={"nodes": nodes},
        events=events,
        detection=detection,
    )
    return doc


@given(_pause_runs())
@settings(max_examples=60)
def test_the_expansion_never_removes_beyond_the_budget(doc: dict[str, Any]) -> None:
    try:
        scenario = parse_scenario(doc)
    except ScenarioError as exc:
        # Overlapping pauses of one node, and pauses of a node that is not a member
        # (removed and not back yet) are refused.
        assert "already paused" in str(exc) or "nothing to pause" in str(exc)
        return
    spec = scenario.detection
    changes, found = expand_with_detection(
        scenario.events, {x.id: x.weight for x in scenario.nodes}, spec, scenario.duration
    )
    assert found is not None
    pauses = [(node, ev.at, ev.at + ev.duration) for ev in scenario.events for node in ev.nodes]

    def paused_at(node: str, t: float) -> bool:
        return any(p == node and lo <= t < hi for p, lo, hi in pauses)

    members = {x.id for x in scenario.nodes}
    last_removal = -math.inf
    outage_of = {(o.node, o.removed_at): o for o in found.outages if o.removed_at is not None}
    for change in changes:
        if change.kind == "join":
            assert change.node not in members
            members.add(change.node)
            continue
        assert change.cause == "probe"
        size = len(members)
        # Most of the ring answered the round (probed one timeout before the decision)...
        answering = sum(not paused_at(m, change.at - spec.health_timeout) for m in members)
        assert answering > spec.removal_quorum * size
        # ... the ring left holds more than the quorum of today's members ...
        assert size - 1 > spec.removal_quorum * size
        # ... at most one removal per interval (and never two in one round) ...
        assert change.at - last_removal >= max(spec.removal_interval, 1e-9)
        last_removal = change.at
        # ... and only once every lease the router granted it has ended.
        outage = outage_of[(change.node, change.at)]
        assert outage.last_answer is not None
        assert change.at >= lease_bound(outage.last_answer, spec.lease, DEFAULT_DRIFT)
        assert change.at >= outage.last_answer + spec.failure_threshold * spec.health_interval
        members.remove(change.node)
    assert len(members) >= 1
    # A paused member the budget kept decides again once its pause is over.
    for outage in found.outages:
        if outage.removed_at is None and outage.resume is not None:
            assert outage.resume >= outage.end


def test_cli_set_overrides_a_setting(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["blip", "--quiet", "--set", "detection.budget=false"]) == 0
    table = capsys.readouterr().out
    assert "detection (no budget): 3 removal(s), 3 return(s)" in table
    assert "crash n3 (probes)" in table and "join n1 (returns)" in table
    assert main(["blip", "--quiet", "--set", "budget=false"]) == 2
    assert "--set 'budget=false': expected TABLE.KEY=VALUE" in capsys.readouterr().err
    assert main(["blip", "--quiet", "--set", "modes.returning=keep"]) == 2
    assert "modes.returning: must be one of hand_back, discard" in capsys.readouterr().err


@pytest.mark.parametrize("modes", [",,,", ""])
def test_modes_that_name_no_mode_are_refused(
    modes: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--modes ,,,`` ran the global reference alone and exited 0 (a tester)."""
    assert main(["tiny", "--quiet", "--modes", modes]) == 2
    assert f"--modes {modes!r} names no mode; expected global" in capsys.readouterr().err


def test_a_scenario_that_asks_for_more_arrivals_than_memory_holds_is_one_line() -> None:
    """rate 1e8 for 100 s asked for 1e10 arrivals (about 120 GB): a MemoryError
    traceback, or a pool that hung, where a line was due."""
    with pytest.raises(ScenarioError, match=r"10,000,000,000 arrivals; at most 50,000,000"):
        load_scenario(SCENARIO_DIR / "large_10m.toml", ["arrivals.rate=100000000"])
    assert load_scenario(SCENARIO_DIR / "large_10m.toml").arrivals.rate == 100_000


@pytest.mark.parametrize("buffered", [False, True])
@pytest.mark.parametrize("command", [["-m", "simulations"], ["-m", "router", "simulate"]])
def test_list_to_a_reader_gone_is_no_traceback(command: list[str], buffered: bool) -> None:
    """``python -m simulations --list | head -2`` printed a BrokenPipeError
    traceback; it now ends as ``ringlimit`` does (exit 1, quietly), whether
    stdout is buffered (the error then comes at the flush) or not."""
    env = dict(os.environ)
    env.pop("PYTHONUNBUFFERED", None)
    if not buffered:
        env["PYTHONUNBUFFERED"] = "1"
    root = Path(__file__).resolve().parent.parent
    with subprocess.Popen(
        [sys.executable, *command, "--list"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # gone before the first line (the start takes longer)
        err = proc.stderr.read().decode()
        code = proc.wait(timeout=60)
    assert err == "" and code == 1, (code, err)
