"""``ringlimit bench --scale 1,2,4``: does the router tier scale with its workers?

For each K: a sticky cluster (``ringlimit router --workers K`` over 2K
in-memory nodes) and the Redis baseline (``--workers K`` over 2K Redis-backed
nodes, round-robin, one ``redis-server`` shared by every K), loaded side by
side with ``K x --connections`` connections, rounds interleaved. Reported per
K and deployment: req/s, p99, each process's CPU (% of one core, from
``/proc``: router workers, nodes, Redis) and req/s against K = 1; and a tight
run per deployment that must allow exactly users x limit.

The claim it measures (issue 12 / issue 15 item 7): sticky throughput grows
with K (>= 3.5x at K = 4 against K = 1) while the Redis baseline stalls at one
Redis core. That needs a machine with at least 4K cores (16 for K = 4): on a
smaller one every process shares the same few cores and req/s stays flat.
With ``--pin`` the load generator and the router workers run on one half of
the CPUs, the nodes and Redis on the other (benchmarks/placement.py), and
each row records the CPUs its roles were allowed (:func:`cpus_of`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench import one_line
from benchmarks.deployments import (
    BENCH_REDIS_TIMEOUT,
    Processes,
    Row,
    Settings,
    cluster_toml,
    start_nodes,
    wait_http,
    wait_redis,
)
from benchmarks.loadgen import run as run_load
from benchmarks.measure import measure, row_load, tight_load
from benchmarks.report import check_exactness, median, placed

MODES = ("sticky", "redis")


#: The largest K: K router workers and 2K nodes (the bench's --nodes cap, 64).
MAX_SCALE = 32


def parse_scale(text: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (each K from 1 to :data:`MAX_SCALE`, no repeats)."""
    try:
        scales = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--scale {text!r}: expected worker counts such as 1,2,4") from None
    if (
        not scales
        or any(not 1 <= k <= MAX_SCALE for k in scales)
        or len(set(scales)) != len(scales)
    ):
        raise ValueError(
            f"--scale {text!r}: expected distinct worker counts from 1 to {MAX_SCALE}, e.g. 1,2,4"
        )
    return scales


def _wait_all_workers(url: str, procs: Processes, name: str, timeout: float = 60.0) -> None:
    """Ready when 10 answers in a row, each on a new connection (so from any
    worker), say the ring has nodes: every worker has learnt the view."""
    deadline = time.monotonic() + timeout
    streak = 0
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=1.0, limits=limits) as client:
        while time.monotonic() < deadline:
            problem = procs.failed()
            if problem:
                raise RuntimeError(problem)
            try:
                ok = client.get(f"{url}/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            streak = streak + 1 if ok else 0
            if streak >= 10:
                return
            time.sleep(0.02 if ok else 0.1)
    raise RuntimeError(
        f"the workers at {url} were not all ready within {timeout:g}s: {procs.log_tail(name)}"
    )


def start_scale(
    procs: Processes, settings: Settings, workdir: Path, k: int, redis_url: str, redis_pid: int
) -> dict[str, Row]:
    """The sticky and Redis deployments with K router workers and 2K nodes each."""
    cfg = workdir / "cluster.toml"
    cfg.write_text(cluster_toml(settings))
    rows: dict[str, Row] = {}
    for mode in MODES:
        extra = (
            [
                *("--backend", "redis", "--redis-url", f"{redis_url}/0"),
                *("--redis-timeout", str(BENCH_REDIS_TIMEOUT)),
            ]
            if mode == "redis"
            else []
        )
        pids, seeds, ready = start_nodes(procs, f"k{k}{mode[0]}", 2 * k, cfg, *extra)
        for url in ready:
            wait_http(url, procs)
        port = procs.port()
        name = f"k{k}-router-{mode}"
        router_pid = procs.ringlimit(
            name,
            "router",
            *("--port", str(port), "--workers", str(k), "--config", str(cfg)),
            "--no-health-checks",
            *(["--backend", "redis"] if mode == "redis" else []),
            *seeds,
        )
        url = f"http://127.0.0.1:{port}"
        _wait_all_workers(url, procs, name)
        roles = {"router": [router_pid], "nodes": pids}
        if mode == "redis":
            roles["redis"] = [redis_pid]
        rows[mode] = Row(mode, f"{url}/load/x", "proxy", roles, f"{url}/tight/x")
    return rows


def run_scale(
    settings: Settings, scales: Sequence[int], tool: str, procs: Processes, workdir: Path
) -> dict[str, Any]:
    """Every K in turn (its processes stopped before the next); the JSON section."""
    port = procs.port()
    redis_pid = procs.start(
        "scale-redis",
        [
            *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no"),
        ],
    )
    wait_redis(port, procs)
    redis_url = f"redis://127.0.0.1:{port}"
    out: list[dict[str, Any]] = []
    base_connections = settings.connections
    try:
        for k in scales:
            names_before = set(procs.names())
            rows = start_scale(procs, settings, workdir, k, redis_url, redis_pid)
            at_k = replace(settings, connections=base_connections * k)
            for row in rows.values():
                run_load(row_load(row, at_k, f"w{k}-", settings.warmup), tool)
            runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in rows}
            for r in range(settings.repeats):
                for mode in MODES if r % 2 == 0 else MODES[::-1]:
                    one = measure(
                        rows[mode], row_load(rows[mode], at_k, f"s{k}-", at_k.duration), tool
                    )
                    runs[mode].append(one.to_dict())
            for mode, row in rows.items():
                tight = run_load(tight_load(row, at_k, f"t{k}{mode}-"), tool)
                exact = check_exactness(
                    mode, tight.to_dict(), 1, settings.tight_users, settings.tight_limit
                )
                out.append({**summarise(k, mode, runs[mode], exact), "cpus": cpus_of(row)})
            procs.stop([name for name in procs.names() if name not in names_before])
    finally:
        with contextlib.suppress(Exception):
            procs.stop(["scale-redis"])
    add_speedups(out)
    return {"scales": list(scales), "connections_per_k": base_connections, "rows": out}


def cpus_of(row: Row) -> dict[str, list[int]]:
    """The CPUs each role's processes may run on, as the kernel has it (a pinned
    run's placement as it took effect; every CPU unpinned)."""
    seen: dict[str, list[int]] = {}
    for role, pids in row.roles.items():
        cpus: set[int] = set()
        for pid in pids:
            with contextlib.suppress(OSError):  # (exited: the run reports it)
                cpus |= os.sched_getaffinity(pid)
        seen[role] = sorted(cpus)
    return seen


def summarise(
    k: int, mode: str, runs: Sequence[dict[str, Any]], exact: dict[str, Any]
) -> dict[str, Any]:
    """Medians over the rounds of one deployment at one K (pure)."""
    counts = {"router": k, "nodes": 2 * k, "redis": 1}
    cpu_pct: dict[str, float | None] = {}
    for role, count in counts.items():
        shares = [
            r["cpu_seconds"][role] / r["load"]["seconds"] / count * 100
            for r in runs
            if role in r["cpu_seconds"] and r["load"]["seconds"] > 0
        ]
        if shares:
            cpu_pct[role] = median(shares)
    return {
        "k": k,
        "mode": mode,
        "routers": k,
        "nodes": 2 * k,
        "rps": median([r["load"]["rps"] for r in runs]),
        "p99_ms": median([r["load"]["p99_ms"] for r in runs]),
        "cpu_pct_per_process": cpu_pct,
        "cpu_us_per_request": {
            role: median([r["cpu_us_per_request"].get(role) for r in runs])
            for role in runs[0]["cpu_us_per_request"]
        }
        if runs
        else {},
        "tight": exact,
    }


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """Each row's req/s against the same deployment's at the smallest K (pure)."""
    for mode in MODES:
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        base = min(mine, key=lambda r: r["k"])["rps"]
        for row in mine:
            row["vs_smallest_k"] = row["rps"] / base if base and row["rps"] is not None else None


def _f(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def scale_lines(scale: dict[str, Any]) -> list[str]:
    """The scaling table, markdown (printed as is)."""
    lines = [
        "| K | routers + nodes | deployment | req/s | p99 ms | vs smallest K "
        "| router %CPU / worker | node %CPU / node | Redis %CPU | tight: allowed (expected) |",
        "|" + "---|" * 10,
    ]
    for row in scale["rows"]:
        cpu = row["cpu_pct_per_process"]
        tight = row["tight"]
        speedup = row.get("vs_smallest_k")
        lines.append(
            "| "
            + " | ".join(
                [
                    str(row["k"]),
                    f"{row['routers']} + {row['nodes']}",
                    row["mode"],
                    _f(row["rps"]),
                    _f(row["p99_ms"], 2),
                    "-" if speedup is None else f"{speedup:.2f}x",
                    _f(cpu.get("router")),
                    _f(cpu.get("nodes")),
                    _f(cpu.get("redis")),
                    f"{tight['allowed']:,} ({tight['expected']:,}) "
                    + ("ok" if tight["ok"] else tight["note"]),
                ]
            )
            + " |"
        )
    return lines


def run_command(args: argparse.Namespace, settings: Settings, tool: str) -> int:
    """``ringlimit bench --scale ...``: only the scaling runs; a table, and JSON on request."""
    scales = parse_scale(args.scale)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    workdir = Path(tempfile.mkdtemp(prefix="ringlimit-scale-"))
    procs = Processes(workdir, settings.placement)
    started = time.time()
    try:
        scale = run_scale(settings, scales, tool, procs, workdir)
    except KeyboardInterrupt:
        print("\nringlimit bench: interrupted; stopping everything it started", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        print(f"ringlimit bench --scale: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "meta": {
            "command": "ringlimit bench --scale " + ",".join(map(str, scales)),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "placement": None if settings.placement is None else settings.placement.to_dict(),
            "tool": tool,
            "repeats": settings.repeats,
            "duration": settings.duration,
            "users": settings.users,
            "seconds": time.time() - started,
        },
        "scale": scale,
    }
    print(
        f"\nringlimit bench --scale: {settings.repeats} round(s) x {settings.duration:g} s per "
        f"deployment, {tool}, {settings.connections} connections per router worker, "
        f"{os.cpu_count()} CPUs{placed(report['meta'])}; took {report['meta']['seconds']:.0f} s\n"
    )
    for line in scale_lines(scale):
        print(line)
    cpus = os.cpu_count() or 1
    if cpus < 4 * max(scales):
        print(
            f"\n* {cpus} CPUs: K = {max(scales)} needs about {4 * max(scales)} cores (K routers, "
            "2K nodes, the load generator) to show scaling; here every process shares the same "
            "cores, so req/s cannot grow with K."
        )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    # Fewer requests than planned (a loaded machine) is not a failure; admitting more is.
    over = [r for r in scale["rows"] if r["tight"]["allowed"] > r["tight"]["expected"]]
    for row in over:
        print(f"ringlimit bench --scale: K={row['k']} {row['mode']} admitted over the limit")
    return 1 if over else 0
