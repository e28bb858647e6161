"""``ringlimit bench``: the formatting (pure functions, default run) and a smoke run.

The smoke run starts every configuration for real (seconds each), so it is
marked ``benchmark`` and excluded from the default run:
``python -m pytest -m benchmark tests/test_bench.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks import bench, deployments, loadgen, measure
from benchmarks import report as reporting
from benchmarks.deployments import ROWS
from router import processes
from tests.processes import free_port, wait_for

ROOT = Path(__file__).resolve().parent.parent


def _run(rps: float, *, p99: float = 10.0, router: float | None = 100.0, requests: int = 1000):
    cpu = {"nodes": 80.0}
    if router is not None:
        cpu["router"] = router
    return {
        "load": {
            "rps": rps,
            "p50_ms": p99 / 4,
            "p99_ms": p99,
            "allowed": requests,
            "denied": 0,
            "status_errors": 0,
            "socket_errors": 0,
        },
        "cpu_us_per_request": cpu,
        "decisions_per_request": 1,
    }


def _report() -> dict:
    rows = {
        "direct": reporting.summarise_row("direct", [_run(20_000, router=None), _run(18_000)]),
        "sticky": reporting.summarise_row(
            "sticky", [_run(10_800, router=60.0), _run(9_600, router=60.0)]
        ),
        "redis": reporting.summarise_row("redis", [_run(4_000, p99=30), _run(4_000, p99=30)]),
        "slowapi": reporting.summarise_row("slowapi", [_run(2_000), _run(2_000)]),
    }
    batch = [_run(2_200), _run(2_000)]
    for run in batch:
        run["decisions_per_request"] = 100
    rows["api_batch"] = reporting.summarise_row("api_batch", batch)
    rows["direct"]["limited"] = False
    reporting.add_ratios(rows)
    return {
        "meta": {
            "command": "ringlimit bench",
            "date": "2026-01-01 00:00 UTC",
            "python": "3.11",
            "cpus": 2,
            "tool": "wrk",
            "connections": 50,
            "users": 10_000,
            "nodes": 2,
            "repeats": 2,
            "duration": 5.0,
        },
        "rows": rows,
        "exactness": {
            "sticky": reporting.check_exactness(
                "sticky", {"allowed": 500, "denied": 9_000}, 1, 100, 5
            ),
            "round_robin": reporting.check_exactness(
                "round_robin", {"allowed": 1_000, "denied": 9_000}, 2, 100, 5
            ),
        },
        "engine": {
            "medians": {"token_bucket": 900_000.0, "limits:fixed_window": 150_000.0},
            "ratios": [
                {
                    "ours": "token_bucket",
                    "theirs": "limits:fixed_window",
                    "target": 5.0,
                    "ratio": 6.0,
                },
                {
                    "ours": "fixed_window",
                    "theirs": "limits:fixed_window",
                    "target": 1.0,
                    "ratio": 2.0,
                },
            ],
        },
        "memory": {
            "keys": 1_000_000,
            "bytes_per_key": 190.0,
            "node_rss_bytes_per_key": 145.0,
            "detail": "x",
        },
        "handoff": {"keys": 1_000_000, "seconds": 4.0, "complete": True, "detail": "y"},
        "notes": ["a note"],
    }


def test_medians_and_per_round_ratios() -> None:
    assert reporting.median([3.0, None, 1.0, 2.0]) == 2.0
    assert reporting.median([None]) is None
    # Per-round ratios, not the ratio of medians: rounds measured side by side pair up.
    assert reporting.round_ratios([10, 20, 30], [5, 5, 30]) == 2.0
    assert reporting.round_ratios([1.0], [0.0]) is None
    summary = reporting.summarise_row("sticky", [_run(9_000), _run(7_000), _run(8_000)])
    assert summary["rps"] == 8_000
    assert summary["cpu_us"] == {"router": 100.0, "nodes": 80.0}
    assert summary["cpu_total_us"] == 180.0
    assert summary["allowed"] == 3_000


def test_ratios_against_rows_1_and_3() -> None:
    rows = _report()["rows"]
    assert rows["sticky"]["vs_direct"] == pytest.approx((10.8 / 20 + 9.6 / 18) / 2)
    assert rows["sticky"]["vs_redis"] == pytest.approx(2.55)
    assert rows["redis"]["vs_redis"] == 1.0
    assert rows["api_batch"]["decisions_per_s"] == 210_000


def test_exactness_checks() -> None:
    exact = reporting.check_exactness("sticky", {"allowed": 500, "denied": 2_000}, 1, 100, 5)
    assert exact["ok"] and exact["expected"] == 500
    over = reporting.check_exactness("redis", {"allowed": 501, "denied": 2_000}, 1, 100, 5)
    assert not over["ok"] and over["note"] == "WRONG"
    few = reporting.check_exactness("redis", {"allowed": 500, "denied": 100}, 1, 100, 5)
    assert not few["ok"] and few["note"] == "too few requests"
    rr = reporting.check_exactness("round_robin", {"allowed": 900, "denied": 9_000}, 2, 100, 5)
    assert rr["ok"] and rr["max_expected"] == 1_000 and "1.80x" in rr["note"]


def test_targets_pass_and_short() -> None:
    report = _report()
    targets = {t.name: t for t in reporting.targets(report)}
    # Without row 1l, no target at equal load.
    assert not any("straight from wrk" in name for name in targets)
    floor = targets["router+sticky req/s vs direct-to-node floor"]
    assert floor.ok  # 0.54x >= 0.5x
    assert targets["router CPU / node CPU per forwarded request"].measured == 0.75
    assert targets["node CPU per limited, proxied request vs the direct floor's"].measured == 1.0
    assert targets["sticky vs Redis, p99 latency (ratio)"].ok
    assert targets["decision API, batches of 100: decisions/s in the slowest round"].ok
    assert targets["engine: token_bucket vs limits:fixed_window"].ok
    assert not any(name.startswith("engine: fixed_window") for name in targets)  # no 1x targets
    # A real node's RSS is the measure when there is one (the store estimate is not).
    assert targets["node RSS per token-bucket key at 1,000,000 keys"].measured == 145.0
    assert targets["node RSS per token-bucket key at 1,000,000 keys"].ok
    assert targets["handoff of 1,000,000 keys, node A -> B"].ok
    assert targets["exactness, sticky: allowed == users x limit"].ok
    # Round-robin local over-admits by design: reported in the table, not a target.
    assert not any("round_robin" in name for name in targets)
    # Row 1l: the node's limiter at the floor's load, against the floor's 80 us.
    limited = [_run(15_000, router=None), _run(14_000, router=None)]
    for run in limited:
        run["cpu_us_per_request"]["nodes"] = 112.0
    report["rows"]["direct_limited"] = reporting.summarise_row("direct_limited", limited)
    at_equal_load = {t.name: t for t in reporting.targets(report)}[
        "node CPU per limited request vs the floor's, both straight from wrk (equal load)"
    ]
    assert at_equal_load.measured == pytest.approx(1.4) and not at_equal_load.ok
    slow = _report()
    slow["handoff"]["complete"] = False
    slow["memory"]["node_rss_bytes_per_key"] = 151.0
    short = {t.name: t for t in reporting.targets(slow)}
    assert short["handoff of 1,000,000 keys, node A -> B"].ok is None
    assert short["node RSS per token-bucket key at 1,000,000 keys"].ok is False
    del slow["memory"]["node_rss_bytes_per_key"]
    estimate = {t.name: t for t in reporting.targets(slow)}
    assert estimate["memory per token-bucket key at 1,000,000 keys (store estimate)"].ok is False


def test_table_markdown_and_json() -> None:
    report = _report()
    lines = reporting.table_lines(report)
    assert lines[0].startswith("| configuration | req/s | decisions/s | p50 ms | p99 ms |")
    assert len(lines) == 2 + len(report["rows"])
    assert all(line.count("|") == lines[0].count("|") for line in lines)
    direct = next(line for line in lines if line.startswith("| 1 direct"))
    assert "- (off)" in direct and "| 1.00x |" in direct
    sticky = next(line for line in lines if line.startswith("| 2 router"))
    assert "500 (500) ok" in sticky and "2.55x" in sticky
    text = reporting.markdown(report)
    assert text.startswith("# Benchmark results")
    assert "## Targets" in text and "| pass |" in text and "SHORT" not in text
    assert "## Engine" in text and "* a note" in text
    targets = [t.to_dict() for t in reporting.targets(report)]
    json.dumps({"report": report, "targets": targets})  # all of it serialisable
    assert {t["pass"] for t in targets} == {True}


def test_target_lines_format() -> None:
    lines = reporting.target_lines(
        [
            reporting.Target("ratio", 0.3, 0.4),
            reporting.Target("seconds", 12.34, 10.0, at_most=True, unit=" s", detail="d"),
            reporting.Target("rate", 123_456.0, 100_000, unit="/s"),
        ]
    )
    assert lines[2] == "| ratio | 0.30x | >= 0.4x | SHORT |"
    assert lines[3] == "| seconds | 12.3 s (d) | <= 10 s | SHORT |"
    assert lines[4] == "| rate | 123,456/s | >= 100,000/s | pass |"


def test_settings_and_rows_option() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    quick = bench.settings_from(parser.parse_args(["--quick"]))
    assert quick.duration == 2.0 and quick.repeats == 1 and quick.handoff_keys == 100_000
    full = bench.settings_from(parser.parse_args(["--duration", "3", "--rows", "sticky,redis"]))
    assert full.duration == 3.0 and full.repeats == 3 and full.rows == ("sticky", "redis")
    with pytest.raises(ValueError, match="unknown row"):
        bench.settings_from(parser.parse_args(["--rows", "nope"]))
    for empty in (",", ""):  # every row ran (a tester)
        with pytest.raises(ValueError, match="names no row"):
            bench.settings_from(parser.parse_args(["--rows", empty]))
    assert "[[rules]]" in deployments.cluster_toml(quick)


@pytest.mark.parametrize(
    "argv",
    [
        ["--duration", "inf"],
        ["--duration", "nan"],
        ["--duration", "0"],
        ["--repeats", "0"],
        ["--connections", "0"],
        ["--users", "-1"],
        ["--nodes", "0"],
        ["--engine-seconds", "nan"],
        ["--handoff-keys", "-1"],
        ["--memory-keys", "0"],
        ["--users", "1" + "0" * 400],  # (an OverflowError traceback in isfinite)
    ],
)
def test_a_number_out_of_range_is_refused_before_anything_starts(argv: list[str]) -> None:
    """0 quietly became the default ("or default": --duration 0 ran 5 s rounds),
    inf and NaN were a traceback after the clusters had started, and 0
    connections or users were refused by wrk alone (found by an exploratory
    tester)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(ValueError, match=f"^{argv[0]} .*: must be from "):
        bench.settings_from(parser.parse_args(argv))


def test_an_empty_scale_is_refused_before_anything_starts() -> None:
    """``--scale ''`` was taken for no --scale, and ran the whole benchmark (a
    tester). A subprocess with a timeout: a regression fails, not runs for minutes."""
    argv = [sys.executable, "-m", "router", "bench", "--scale", ""]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 2, done.stderr
    assert "--scale '': expected distinct worker counts" in done.stderr, done.stderr


def test_the_report_names_the_command_with_every_option_it_had() -> None:
    """It said `ringlimit bench --quick` of a run of two rows with the Envoy
    step skipped: read as the whole benchmark."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--rows", "sticky,direct", "--skip-envoy"])
    assert bench.command_line(args) == "ringlimit bench --quick --rows sticky,direct --skip-envoy"
    assert bench.command_line(parser.parse_args(["--json", "x.json"])) == "ringlimit bench"
    again = parser.parse_args(["--duration", "3", "--rows", "sticky, redis"])
    assert bench.command_line(again) == "ringlimit bench --duration 3 --rows 'sticky, redis'"


def test_load_generator_pieces() -> None:
    line = (
        'noise\nRINGLIMIT_BENCH {"requests":100,"duration_us":2000000,"p50_us":1500,'
        '"p99_us":9000,"mean_us":2000.0,"status_errors":3,"socket_errors":0,'
        '"allowed":97,"denied":3,"other":0}\n'
    )
    result = loadgen.parse_marked(line, "wrk")
    assert result.rps == 50 and result.p99_ms == 9 and result.denied == 3
    with pytest.raises(RuntimeError):
        loadgen.parse_marked("nothing", "wrk")
    load = loadgen.Load("http://127.0.0.1:1/v1/check", mode="batch", users=5, batch=3)
    requests = loadgen.build_requests(load, random.Random(1))
    assert len(requests) == 1024
    head, _, body = requests[0].partition(b"\r\n\r\n")
    assert b"POST /v1/check HTTP/1.1" in head
    assert len(json.loads(body)["checks"]) == 3
    assert measure.cpu_seconds([os.getpid()]) > 0


def test_the_hot_rows_send_one_user_their_share() -> None:
    load = loadgen.Load("http://127.0.0.1:1/hot/x", users=700, prefix="w", hot_share=0.3)
    requests = loadgen.build_requests(load, random.Random(1))
    hot = [r for r in requests if b"X-User-Id: whot\r\n" in r]
    assert len(hot) / len(requests) == pytest.approx(0.3)
    assert loadgen._script_args(load)[-1] == "0.3"
    assert not {"hot_off", "hot_on"} & set(deployments.DEFAULT_ROWS)
    assert "owner" in deployments.ROLES


def test_envoy_row_summary_and_table() -> None:
    from benchmarks import envoy

    def one(calls_per_s: float, router: float) -> dict[str, object]:
        return {
            "calls_per_s": calls_per_s,
            "p50_ms": 2.0,
            "p99_ms": 9.0,
            "errors": 0,
            "cpu_us_per_call": {"router": router, "nodes": 50.0},
        }

    runs = {"sticky": [one(900, 300), one(1100, 200)], "redis": [one(600, 400), one(500, 500)]}
    summary = envoy.summarise(runs, {"sticky": 500, "redis": 500})
    assert summary["rows"]["sticky"]["calls_per_s"] == 1000
    assert summary["rows"]["redis"]["cpu_us_per_call"]["router"] == 450
    # The ratio is the median of per-round ratios (900/600, 1100/500), not of medians.
    assert summary["sticky_vs_redis"] == pytest.approx((1.5 + 2.2) / 2)
    table = "\n".join(envoy.lines(summary))
    assert "| sticky | 1,000 | 2.00 | 9.00 | 250 | 50 | - | 0 | 500 (500) |" in table
    assert "sticky vs Redis, ShouldRateLimit calls/s: 1.85x" in table


@pytest.mark.benchmark
@pytest.mark.timeout(900)
def test_bench_quick_smoke(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    out = tmp_path / "bench.json"
    md = tmp_path / "bench.md"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "router", "bench", "--quick", "--duration", "1"),
            *("--json", str(out), "--markdown", str(md), "--no-progress"),
            *("--handoff-keys", "20000", "--memory-keys", "20000", "--engine-seconds", "1"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=850,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert list(report["rows"]) == list(ROWS)
    for row in report["rows"].values():
        assert row["rps"] > 0, row
    assert set(report["exactness"]) == set(ROWS) - {"direct"}
    assert report["handoff"]["complete"]
    assert report["engine"]["ratios"] and report["memory"]["bytes_per_key"] > 0
    envoy = report["envoy"]
    assert all(row["calls_per_s"] > 0 and row["errors"] == 0 for row in envoy["rows"].values())
    assert {row["tight_ok"] for row in envoy["rows"].values()} == {envoy["tight_expected"]}
    assert {t["name"] for t in report["targets"]} >= {
        "router+sticky req/s vs direct-to-node floor",
        "decision API, batches of 100: decisions/s in the slowest round",
    }
    assert "| configuration |" in done.stdout and md.read_text().startswith("# Benchmark")


def _scale_run(rps: float, router_cpu: float, seconds: float = 2.0) -> dict:
    return {
        "load": {"rps": rps, "p99_ms": 10.0, "seconds": seconds},
        "cpu_seconds": {"router": router_cpu, "nodes": 1.0},
        "cpu_us_per_request": {"router": 50.0, "nodes": 40.0},
    }


def test_scale_option_summary_and_table() -> None:
    from benchmarks import scale

    assert scale.parse_scale("1,2,4") == [1, 2, 4]
    assert scale.parse_scale(str(scale.MAX_SCALE)) == [scale.MAX_SCALE]
    for bad in ("", "0", "1,1", "a", str(scale.MAX_SCALE + 1)):
        with pytest.raises(ValueError, match="--scale"):
            scale.parse_scale(bad)
    exact = reporting.check_exactness("sticky", {"allowed": 500, "denied": 2000}, 1, 100, 5)
    rows = [
        scale.summarise(1, "sticky", [_scale_run(1000, 1.0), _scale_run(1200, 1.2)], exact),
        scale.summarise(2, "sticky", [_scale_run(2000, 3.0), _scale_run(2400, 3.0)], exact),
        scale.summarise(1, "redis", [_scale_run(800, 1.0)], exact),
        scale.summarise(2, "redis", [_scale_run(800, 1.0)], exact),
    ]
    scale.add_speedups(rows)
    sticky2 = rows[1]
    assert (sticky2["routers"], sticky2["nodes"]) == (2, 4)
    assert sticky2["rps"] == 2200 and sticky2["vs_smallest_k"] == pytest.approx(2.0)
    # Router CPU: 3 s over 2 s of run, shared by 2 workers = 75% of a core each.
    assert sticky2["cpu_pct_per_process"]["router"] == pytest.approx(75.0)
    # Nodes: 1 s over 2 s for 4 nodes = 12.5% each.
    assert sticky2["cpu_pct_per_process"]["nodes"] == pytest.approx(12.5)
    assert rows[3]["vs_smallest_k"] == pytest.approx(1.0)
    table = "\n".join(scale.scale_lines({"rows": rows}))
    assert "| 2 | 2 + 4 | sticky | 2,200 | 10.00 | 2.00x | 75 | 12 | - | 500 (500) ok |" in table


@pytest.mark.timeout(120)
def test_bench_scale_1_smoke(tmp_path: Path) -> None:
    """``--scale 1``: one router worker and two nodes, sticky and Redis, briefly;
    placed in tiers (``--pin``) where the machine can."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    pin = len(os.sched_getaffinity(0)) >= 2 and shutil.which("taskset") is not None
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "router", "bench", "--quick", "--scale", "1"),
            *("--duration", "1", "--json", str(out), "--no-progress"),
            *(["--pin"] if pin else []),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    whole = json.loads(out.read_text())
    report = whole["scale"]
    assert [(r["k"], r["mode"]) for r in report["rows"]] == [(1, "sticky"), (1, "redis")]
    if pin:
        tiers = whole["meta"]["placement"]
        for row in report["rows"]:  # each role ran on its tier's CPUs
            assert row["cpus"]["router"] == tiers["front"], (row["cpus"], tiers)
            assert row["cpus"]["nodes"] == tiers["back"], (row["cpus"], tiers)
        assert report["rows"][1]["cpus"]["redis"] == tiers["back"]
        assert ", pinned: load generator and routers on CPU" in done.stdout
    for row in report["rows"]:
        assert row["rps"] > 0 and row["cpu_pct_per_process"]["router"] > 0, row
        assert row["tight"]["allowed"] <= row["tight"]["expected"], row
    assert "| K | routers + nodes |" in done.stdout


def test_the_batch_target_holds_only_when_every_round_reaches_it() -> None:
    """A median over the goal is not enough: the slowest round decides (issue 15:
    "stable across three rounds")."""
    report = _report()
    batch = [_run(2_600), _run(2_500), _run(1_900)]
    for run in batch:
        run["decisions_per_request"] = 100
    report["rows"]["api_batch"] = reporting.summarise_row("api_batch", batch)
    name = "decision API, batches of 100: decisions/s in the slowest round"
    target = {t.name: t for t in reporting.targets(report)}[name]
    assert report["rows"]["api_batch"]["decisions_per_s"] == 250_000
    assert target.measured == 190_000 and not target.ok


def run_alone(module: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python -m module argv...`` from the repository, which must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


@pytest.mark.timeout(120)
def test_the_handoff_step_runs_alone() -> None:
    """``python -m benchmarks.handoff``: the bench's handoff step on its own (to
    compare two commits side by side), every key arriving, twice."""
    done = run_alone("benchmarks.handoff", "--keys", "3000", "--runs", "2")
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2, done.stdout
    assert all("3,000 of 3,000 keys arrived" in line for line in lines), done.stdout


def test_the_batch_path_runs_alone() -> None:
    """``python -m benchmarks.batchpath``: a node's batch path in process, as the
    docs measure it side by side."""
    done = run_alone("benchmarks.batchpath", "--batches", "5", "--rounds", "2")
    assert "ns per decision (fastest of 2 rounds" in done.stdout, done.stdout


def test_the_batch_route_runs_alone() -> None:
    """``python -m benchmarks.batchroute``: a router's batch path in process (split,
    forward, merge), as the docs measure it side by side (the script checks that
    every batch is answered 200 with a result per check)."""
    done = run_alone("benchmarks.batchroute", "--batches", "5", "--rounds", "2")
    assert "ns per decision (fastest of 2 rounds" in done.stdout, done.stdout


def test_the_forward_path_runs_alone() -> None:
    """``python -m benchmarks.forwardpath``: the router's sticky forwarding in
    process, as the docs measure it side by side (on both event loops, plain and
    pipelined: every answer must be the node's 200)."""
    for extra in (("--loop", "uvloop"), ("--loop", "asyncio", "--pipeline", "4")):
        done = run_alone("benchmarks.forwardpath", "--requests", "400", "--rounds", "2", *extra)
        assert "ns per forward (fastest of 2 rounds" in done.stdout, done.stdout


def test_the_request_path_runs_alone() -> None:
    """``python -m benchmarks.requestpath``: a node's proxied requests in process,
    limiter off, on (direct) and on behind a router, each answered 200 (with the
    rate-limit fields exactly when limiting: the script checks)."""
    done = run_alone(
        "benchmarks.requestpath", "--requests", "300", "--rounds", "2", "--users", "500"
    )
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["off", "direct", "routed"], done.stdout
    assert all("ns per request (fastest of 2 rounds" in line for line in lines), done.stdout


def test_the_loop_calls_run_alone() -> None:
    """``python -m benchmarks.loopcalls``: the event loop's per-request calls
    that docs/performance.md quotes, each a positive figure on the node's loop."""
    done = run_alone("benchmarks.loopcalls", "--calls", "2000")
    lines = done.stdout.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "asyncio.get_running_loop()",
        "an attribute read",
        "call_later + cancel",
        "call_soon, and the callback run",
    ], done.stdout
    for line in lines:
        ns = re.search(r": ([\d,]+) ns per call \((uvloop|asyncio)\)$", line)
        assert ns is not None and int(ns.group(1).replace(",", "")) > 0, line


def test_the_join_direction_runs_alone() -> None:
    """``python -m benchmarks.handoff --join``: B joins A; every moved key arrives,
    and A keeps them as B's replicas."""
    done = run_alone("benchmarks.handoff", "--join", "--keys", "3000")
    line = done.stdout.strip().splitlines()[-1]
    moved = re.search(r"([\d,]+) of \1 moved keys arrived", line)
    assert moved is not None, line
    assert f"A keeps {moved.group(1)} of them for B" in line, line


def test_the_envoy_floor_server_answers_ok_and_stops() -> None:
    """``python -m benchmarks.envoy floor``: gRPC's own cost per call, which
    docs/envoy.md compares the router's with, is measured against a server
    that answers OK; ``load`` against it counts every call OK."""
    from benchmarks import envoy

    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.envoy", "floor", "--port", str(port)], cwd=ROOT
    )
    try:
        assert wait_for(lambda: _accepts(port) or server.poll() is not None, timeout=30.0)
        assert server.poll() is None, "the floor server exited before it answered"
        result = envoy.load(port, 0.5, 4, 10, "user")
        assert result["calls"] > 0 and result["ok"] == result["calls"], result
        assert result["errors"] == 0
    finally:
        server.terminate()
        try:
            code = server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()  # never left running past the test
            server.wait()
            raise
    assert code == 0  # it stops on SIGTERM, cleanly


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_compare_reads_each_benchmarks_figures_and_pairs_them() -> None:
    """benchmarks/compare.py: the series every path benchmark prints, callgrind's
    total, and the table of two sides' runs (medians, paired ratios, and each
    series against the first)."""
    from benchmarks import compare

    printed = (
        "off: 27,881 ns per request (fastest of 5 rounds; median 28,043)\n"
        "direct: 38,378 ns per request (fastest of 5 rounds; median 38,583)\n"
    )
    assert compare.parse(printed) == {"off": 27_881.0, "direct": 38_378.0}
    assert compare.parse("81,008 ns per forward (fastest of 1 rounds; median 81,008)") == {
        "forward": 81_008.0
    }
    with pytest.raises(compare.CompareError, match="no 'ns per' figure"):
        compare.parse("Traceback (most recent call last): ...")
    assert compare.collected("==1== Events    : Ir\n==1== Collected : 8595938374\n") == 8595938374
    a = [{"off": 100.0, "direct": 140.0}, {"off": 110.0, "direct": 150.0}]
    b = [{"off": 100.0, "direct": 130.0}, {"off": 121.0, "direct": 150.0}]
    lines = compare.summary(a, b)
    assert lines[2] == "| off | 105 | 110 | 1.050x | 1.000-1.100x |"
    assert lines[3] == "| direct | 145 | 140 | 0.964x | 0.929-1.000x |"
    # direct/off per run: A 1.400 and 1.364; B 1.300 and 1.240.
    assert lines[4] == "direct/off: A 1.382x, B 1.270x (medians of runs)"
    # An older revision without a series: only the series both sides printed.
    newer = [{**run, "routed": 1.0} for run in b]
    assert compare.summary(a, newer) == lines
    with pytest.raises(compare.CompareError, match="no series in common"):
        compare.summary([{"forward": 1.0}], [{"off": 1.0}])


@pytest.mark.skipif(shutil.which("git") is None, reason="git exports the revision")
def test_compare_runs_two_versions_side_by_side() -> None:
    """``python -m benchmarks.compare HEAD -- requestpath ...``: HEAD exported
    with git archive, this checkout as it is, one pair; a revision git does
    not know and a missing benchmark are one line each."""
    done = run_alone(
        "benchmarks.compare",
        "HEAD",
        "--pairs",
        "1",
        "--",
        "requestpath",
        "--requests",
        "200",
        "--rounds",
        "1",
        "--users",
        "200",
        "--modes",
        "off,direct",
    )
    assert "A = HEAD, B = .: requestpath" in done.stdout, done.stdout
    # Side A is HEAD as git has it, in a folder of its own.
    from benchmarks import compare

    with tempfile.TemporaryDirectory() as scratch:
        tree = compare.export("HEAD", Path(scratch) / "a")
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", "HEAD:benchmarks/requestpath.py"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
        assert (tree / "benchmarks" / "requestpath.py").read_text() == shown
        assert not (tree / ".git").exists()
    assert re.search(r"^\| off \| [\d,]+ \| [\d,]+ \| [\d.]+x \|", done.stdout, re.M), done.stdout
    assert re.search(r"^direct/off: A [\d.]+x, B [\d.]+x", done.stdout, re.M), done.stdout
    for argv, said in (
        (["no-such-revision", "--", "requestpath"], "compare: git archive no-such-revision:"),
        (["HEAD"], "give the benchmark after --"),
    ):
        failed = subprocess.run(
            [sys.executable, "-m", "benchmarks.compare", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert failed.returncode == 2 and said in failed.stderr, failed.stderr
        assert "Traceback" not in failed.stderr, failed.stderr


def test_the_run_folder_leaves_a_long_tmpdir_for_tmp_when_a_socket_would_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node's Unix socket in the run folder must fit the kernel's 107 bytes:
    under a TMPDIR too long for it the folder is made in /tmp (the nodes of the
    Unix-socket rows failed to start), and under a short one where it was."""
    from node.unixsocket import MAX_PATH_BYTES

    long = tmp_path / ("t" * 100)
    long.mkdir()
    short = Path(tempfile.mkdtemp(prefix="rl", dir="/tmp"))  # (tmp_path is long itself)
    made = [short]
    try:
        for tmpdir, where in ((long, Path("/tmp")), (short, short)):
            monkeypatch.setattr(tempfile, "tempdir", str(tmpdir))
            workdir = bench.make_workdir()
            made.append(workdir)
            assert workdir.parent == where and workdir.is_dir()
            assert len(os.fsencode(workdir / "s12.sock")) <= MAX_PATH_BYTES
        assert list(long.iterdir()) == []  # (the first try there was removed)
    finally:
        for workdir in reversed(made):
            workdir.rmdir()


def test_pin_splits_the_cpus_into_a_front_and_a_back_tier() -> None:
    """The load generators and routers in the front (the lower half, rounded up),
    nodes, redis-server and the applications of the comparison rows in the back."""
    from benchmarks.placement import BACK, FRONT, Placement
    from router.processes import ringlimit_argv

    assert Placement.split({0, 1}) == Placement(frozenset({0}), frozenset({1}))
    assert Placement.split({4, 2, 7}) == Placement(frozenset({2, 4}), frozenset({7}))
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        Placement.split({3})
    placement = Placement.split(range(16))
    assert placement.front == frozenset(range(8)) and placement.back == frozenset(range(8, 16))
    cases = {
        FRONT: [
            ringlimit_argv("router", "--port", "1"),
            ["wrk", "-t1", "http://127.0.0.1:1/"],
            [sys.executable, "-m", "benchmarks.loadgen", "http://127.0.0.1:1/"],
            [sys.executable, "-m", "benchmarks.envoy", "load", "--port", "1"],
        ],
        BACK: [
            ringlimit_argv("node", "--id", "n1"),
            ["/usr/bin/redis-server", "--port", "1"],
            [sys.executable, "-m", "uvicorn", "benchmarks.slowapi_app:app"],
        ],
    }
    for tier, argvs in cases.items():
        for argv in argvs:
            assert placement.tier(argv) == tier, argv
    assert placement.to_dict() == {FRONT: list(range(8)), BACK: list(range(8, 16))}


def test_a_pinned_run_starts_each_child_on_its_tiers_cpus(tmp_path: Path) -> None:
    """What ``bench --pin`` starts runs where its tier says (a node in the back,
    anything else in the front), under its own pid, and the load generator's
    process too."""
    from benchmarks.placement import Placement, pinned_argv

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    placement = Placement(frozenset(cpus[:1]), frozenset(cpus[1:2]))
    procs = deployments.Processes(tmp_path, placement)
    show = "import os; print(os.getpid(), sorted(os.sched_getaffinity(0)), flush=True)"
    try:
        # A back-tier argv ("-m router node") and a front one, both printing their CPUs.
        back = procs.start("back", [sys.executable, "-c", show, "-m", "router", "node"])
        front = procs.start("front", [sys.executable, "-c", show])
        wait_for(lambda: all(procs.log_tail(n).strip() for n in ("back", "front")), 10)
    finally:
        procs.stop_all()
    assert procs.log_tail("back").strip() == f"{back} {cpus[1:2]}"
    assert procs.log_tail("front").strip() == f"{front} {cpus[:1]}"
    done = subprocess.run(
        pinned_argv(frozenset(cpus[:1]), [sys.executable, "-c", show]),
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split(" ", 1)[1].strip() == str(cpus[:1])
    assert pinned_argv(None, ["wrk", "-t1"]) == ["wrk", "-t1"]


def test_pin_is_refused_with_one_cpu_or_without_taskset(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.settings_from(parser.parse_args(["--quick"])).placement is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    scaled = bench.settings_from(parser.parse_args(["--pin", "--scale", "1,2"])).placement
    assert scaled is not None and scaled.to_dict() == {"front": [0, 1], "back": [2, 3]}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(ValueError, match="at least 2 CPUs"):
        bench.settings_from(parser.parse_args(["--pin", "--quick"]))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert bench.settings_from(parser.parse_args(["--pin", "--quick"])).placement is not None
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(ValueError, match="needs taskset"):
        bench.settings_from(parser.parse_args(["--pin", "--quick"]))


def test_the_report_says_where_a_pinned_run_placed_its_processes() -> None:
    report = _report()
    report["meta"]["placement"] = None
    assert "pinned" not in reporting.markdown(report)
    report["meta"]["placement"] = {"front": [0, 1], "back": [2, 3]}
    assert (
        "pinned: load generator and routers on CPU 0,1, nodes, Redis and applications on CPU 2,3"
        in reporting.markdown(report)
    )


def test_nodecpu_reports_user_and_system_time_of_both_rows() -> None:
    """``python -m benchmarks.nodecpu`` (docs/performance.md's table of a node's
    CPU per request): a line per row and load, every process it started stopped."""
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.nodecpu", "--connections", "2", "--duration", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("-c2 ")]
    assert [line.split()[1] for line in rows] == ["direct_limited", "sticky_unix"], done.stdout
    for line in rows:
        user, system = re.search(r"\(user +([\d.]+), sys +([\d.]+)\)", line).groups()
        assert float(user) > 0 and float(system) >= 0, line
    assert "router" in rows[1] and "router" not in rows[0]


@pytest.mark.parametrize(
    "argv", [["--connections", "0"], ["--connections", "x"], ["--duration", "0"]]
)
def test_nodecpu_refuses_bad_numbers_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from benchmarks import nodecpu

    assert nodecpu.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m benchmarks.nodecpu: ") and err.count("\n") == 1, err


def test_the_bench_picks_its_childrens_ports_below_the_ephemeral_range() -> None:
    """A port the kernel picks (``bind(0)``) is in its ephemeral range, where an
    outgoing connection of anything on the machine can take it before the
    child binds it: ``test_bench_scale_1_smoke`` failed once among other
    tests. The bench picks below that range, and a block it hands out to a
    caller that keeps track is not handed out again."""
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    start, end = processes.below_ephemeral(3)
    assert end + 3 <= low or (start, end) == (20_000, 60_000)
    procs = deployments.Processes(Path(tempfile.gettempdir()))
    ports = [procs.port() for _ in range(50)]
    assert all(start <= port < low for port in ports) and len(set(ports)) == 50, ports
    handed: set[int] = set()
    blocks = [processes.free_block(3, avoid=handed) for _ in range(5)]
    assert len(handed) == 15 and all(port in handed for b in blocks for port in range(b, b + 3))
    with pytest.raises(RuntimeError, match="no 3 free ports"):
        processes.free_block(3, within=(start, start + 30), avoid=set(range(start, start + 31)))
