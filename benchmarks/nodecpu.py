"""A node's CPU per request, user and system time apart, straight from the load
generator and behind a router, at several loads.

Behind a router a node spends about twice the floor's CPU on a request, while
in process its path costs 1.3x (``benchmarks.requestpath``). This says where
the difference is: the bench's row 1l (one node with the bench's rules, loaded
straight) and row 2u (two nodes behind a router, over Unix sockets), each
loaded with ``C`` connections for each ``C`` of ``--connections``, the nodes'
``utime`` and ``stime`` (``/proc/PID/stat``) and voluntary context switches
(``/proc/PID/status``: the times a node slept, waiting for work) read around
every run. A few connections leave the machine idle between requests: what a
request costs then is mostly what waking up for it costs. The nodes' figures
are per request served (all nodes' CPU over all requests, as the bench's).

Run: ``python -m benchmarks.nodecpu [--connections 2,8,50] [--duration 6]
[--pin]`` (``--pin``: as ``ringlimit bench --pin``, benchmarks/placement.py).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

from benchmarks.bench import make_workdir
from benchmarks.deployments import Processes, Row, Settings, start_rows
from benchmarks.loadgen import Load
from benchmarks.loadgen import run as run_load
from benchmarks.placement import Placement

ROWS = ("direct_limited", "sticky_unix")
_TICKS = os.sysconf("SC_CLK_TCK")


def process_times(pid: int) -> tuple[float, float, int]:
    """(user seconds, system seconds, voluntary context switches) of ``pid`` so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
        switches = next(
            int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt_switches:")
        )
    # fields[0] is field 3 (state): utime is field 14, stime 15.
    return int(fields[11]) / _TICKS, int(fields[12]) / _TICKS, switches


def measure(row: Row, connections: int, settings: Settings, prefix: str) -> dict[str, float]:
    """One run of ``row``: requests per second, and per request the nodes' user and
    system microseconds and voluntary switches (and the router's CPU, if any)."""
    pids = {role: list(found) for role, found in row.roles.items()}
    before = {pid: process_times(pid) for found in pids.values() for pid in found}
    load = Load(
        url=row.url,
        users=settings.users,
        prefix=prefix,
        duration=settings.duration,
        connections=connections,
        cpus=settings.front_cpus(),
    )
    result = run_load(load, settings.tool)
    after = {pid: process_times(pid) for pid in before}
    requests = max(result.requests, 1)

    def per_request(role: str, index: int, scale: float = 1e6) -> float:
        total = sum(after[pid][index] - before[pid][index] for pid in pids.get(role, ()))
        return total / requests * scale

    return {
        "rps": result.rps,
        "nodes_user_us": per_request("nodes", 0),
        "nodes_sys_us": per_request("nodes", 1),
        "nodes_switches": per_request("nodes", 2, 1.0),
        "router_us": per_request("router", 0) + per_request("router", 1),
    }


def line(connections: int, key: str, m: dict[str, float]) -> str:
    nodes = m["nodes_user_us"] + m["nodes_sys_us"]
    router = f", router {m['router_us']:.1f} us" if m["router_us"] else ""
    return (
        f"-c{connections:<3} {key:15} {m['rps']:9,.0f} req/s  nodes {nodes:6.1f} us "
        f"(user {m['nodes_user_us']:5.1f}, sys {m['nodes_sys_us']:4.1f}), "
        f"{m['nodes_switches']:.3f} sleeps/request{router}"
    )


def run(connections: Sequence[int], settings: Settings) -> list[str]:
    """Start rows 1l and 2u, load each at every count of ``connections``, stop them."""
    workdir = make_workdir()
    procs = Processes(workdir, settings.placement)
    lines = []
    try:
        rows = start_rows(procs, settings, workdir)
        for key, row in rows.items():  # warm-up: the stores filled, the code paths hot
            run_load(
                Load(url=row.url, users=settings.users, prefix=f"w{key}-", duration=1.0),
                settings.tool,
            )
        for i, count in enumerate(connections):
            for key, row in rows.items():
                lines.append(line(count, key, measure(row, count, settings, f"m{i}{key}-")))
                print(lines[-1], flush=True)
    finally:
        procs.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.nodecpu",
        description="A node's CPU per request, user and system apart, straight from the "
        "load generator (row 1l) and behind a router (row 2u), at several loads.",
    )
    parser.add_argument("--connections", default="2,8,50", help="comma-separated (2,8,50)")
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per run (6)")
    parser.add_argument("--pin", action="store_true", help="as ringlimit bench --pin")
    args = parser.parse_args(argv)
    try:
        counts = [int(c) for c in args.connections.split(",") if c.strip()]
        if not counts or min(counts) < 1 or not 1 <= args.duration <= 3600:
            raise ValueError
        placement = Placement.of_this_process() if args.pin else None
    except ValueError as exc:
        problem = str(exc) or "--connections: counts of 1 or more; --duration: 1 to 3600 s"
        print(f"python -m benchmarks.nodecpu: {problem}", file=sys.stderr)
        return 2
    settings = Settings(rows=ROWS, duration=args.duration, placement=placement)
    try:
        run(counts, settings)
    except KeyboardInterrupt:
        return 130
    except RuntimeError as exc:  # a process that would not start, a load generator that failed
        print(f"python -m benchmarks.nodecpu: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
