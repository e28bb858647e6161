"""The Envoy row of ``ringlimit bench``: ShouldRateLimit calls per second, sticky vs Redis.

Two clusters are started side by side, each a router serving Envoy's
RateLimitService (``--grpc-port``, ``--envoy-config``) in front of the same
number of nodes: in-memory sticky nodes, and nodes deciding in a Redis
(``--backend redis``, round-robin). A load generator in its own process
(``python -m benchmarks.envoy load``: grpc.aio, the same generated protos a
gateway uses) keeps ``concurrency`` calls in flight, one descriptor per call
over a user population; rounds alternate between the clusters and the CPU
of every process is read from /proc around each run. An exactness run then
sends a tight limit many calls per fresh user and counts the OK answers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.deployments import Processes, Settings

ENVOY_YAML = """\
domain: bench
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1000}
  - key: tight
    rate_limit: {unit: hour, requests_per_unit: 5}
"""
TIGHT_USERS = 100
TIGHT_LIMIT = 5


# --------------------------------------------------------------------------- the load generator


async def _drive(
    port: int, seconds: float, concurrency: int, users: int, key: str
) -> dict[str, Any]:
    import grpc
    from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    entry = ratelimit_pb2.RateLimitDescriptor.Entry
    requests = [
        rls_pb2.RateLimitRequest(
            domain="bench",
            descriptors=[
                ratelimit_pb2.RateLimitDescriptor(entries=[entry(key=key, value=f"u{i}")])
            ],
        )
        for i in range(users)
    ]
    ok = over = errors = 0
    latencies: list[float] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit
        rng = random.Random(7)
        deadline = time.perf_counter() + seconds
        tight = key == "tight"
        order = [r for r in requests for _ in range(TIGHT_LIMIT * 3)] if tight else []
        rng.shuffle(order)

        async def worker(w: int) -> None:
            nonlocal ok, over, errors
            i = w
            while True:
                if tight:
                    if i >= len(order):
                        return
                    req = order[i]
                    i += concurrency
                else:
                    if time.perf_counter() >= deadline:
                        return
                    req = requests[rng.randrange(users)]
                started = time.perf_counter()
                try:
                    answer = await call(req, timeout=10)
                except grpc.aio.AioRpcError:
                    errors += 1
                    continue
                latencies.append(time.perf_counter() - started)
                if answer.overall_code == rls_pb2.RateLimitResponse.OK:
                    ok += 1
                else:
                    over += 1

        began = time.perf_counter()
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
        elapsed = time.perf_counter() - began
    latencies.sort()

    def pct(p: float) -> float:
        return (
            latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 if latencies else 0
        )

    return {
        "calls": ok + over,
        "seconds": elapsed,
        "calls_per_s": (ok + over) / elapsed if elapsed else 0.0,
        "p50_ms": pct(0.5),
        "p99_ms": pct(0.99),
        "ok": ok,
        "over_limit": over,
        "errors": errors,
    }


def load(
    port: int,
    seconds: float,
    concurrency: int,
    users: int,
    key: str,
    cpus: frozenset[int] | None = None,
) -> dict[str, Any]:
    """Run the generator in its own process (it must not share a core's time with
    us), on ``cpus`` if given (``bench --pin``)."""
    from benchmarks.placement import pinned_argv

    argv = [sys.executable, "-m", "benchmarks.envoy", "load", "--port", str(port)]
    argv += ["--seconds", str(seconds), "--concurrency", str(concurrency)]
    argv += ["--users", str(users), "--key", key]
    done = subprocess.run(
        pinned_argv(cpus, argv),
        capture_output=True,
        text=True,
        timeout=seconds + 120,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"envoy load generator failed: {done.stderr[-800:]}")
    return dict(json.loads(done.stdout))


# --------------------------------------------------------------------------- the row


def run_envoy(settings: Settings, procs: Processes, workdir: Path) -> dict[str, Any]:
    """Two clusters behind the gRPC service (sticky, Redis), loaded in interleaved
    rounds, then an exactness run each; stopped before returning."""
    from benchmarks.measure import cpu_seconds

    clusters, names = _start_clusters(settings, procs, workdir)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in clusters}
    drive = partial(load, cpus=settings.front_cpus())
    try:
        for cluster in clusters.values():  # warm-up
            drive(cluster["port"], settings.warmup, settings.connections, settings.users, "user")
        order = list(clusters)
        for r in range(settings.repeats):
            for name in order if r % 2 == 0 else order[::-1]:
                cluster = clusters[name]
                before = {role: cpu_seconds(p) for role, p in cluster["roles"].items()}
                result = drive(
                    cluster["port"], settings.duration, settings.connections, settings.users, "user"
                )
                after = {role: cpu_seconds(p) for role, p in cluster["roles"].items()}
                result["cpu_us_per_call"] = {
                    role: (after[role] - before[role]) / result["calls"] * 1e6
                    if result["calls"]
                    else None
                    for role in before
                }
                runs[name].append(result)
        exactness = {
            name: drive(cluster["port"], 0, settings.connections, TIGHT_USERS, "tight")["ok"]
            for name, cluster in clusters.items()
        }
    finally:
        procs.stop([f"envoy-router-{n}" for n in clusters])  # routers before their nodes
        procs.stop(names)
    return summarise(runs, exactness)


def _start_clusters(
    settings: Settings, procs: Processes, workdir: Path
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """One redis-server, then the sticky and the Redis-backed cluster, each a
    router serving gRPC over its nodes: {name: {port, roles}}, and the process names."""
    from benchmarks.deployments import wait_http, wait_redis

    names: list[str] = []
    envoy_file = workdir / "envoy.yaml"
    envoy_file.write_text(ENVOY_YAML)
    empty = workdir / "envoy-empty.toml"
    empty.write_text("")
    redis_port = procs.port()
    redis_pid = procs.start(
        "envoy-redis",
        [
            *("redis-server", "--port", str(redis_port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no"),
        ],
    )
    wait_redis(redis_port, procs)
    clusters: dict[str, dict[str, Any]] = {}
    names.append("envoy-redis")
    for name, extra in (
        ("sticky", []),
        ("redis", ["--backend", "redis", "--redis-url", f"redis://127.0.0.1:{redis_port}/2"]),
    ):
        node_pids, seeds = [], []
        for i in range(1, settings.nodes + 1):
            port = procs.port()
            node_id = f"e{name[0]}{i}"
            names.append(node_id)
            node_pids.append(
                procs.ringlimit(
                    node_id,
                    "node",
                    *("--id", node_id, "--port", str(port), "--fenced", "--config", str(empty)),
                    *extra,
                )
            )
            seeds += ["--node", f"{node_id}=http://127.0.0.1:{port}"]
            wait_http(f"http://127.0.0.1:{port}/healthz", procs)
        http_port, grpc_port = procs.port(), procs.port()
        names.append(f"envoy-router-{name}")
        router_pid = procs.ringlimit(
            f"envoy-router-{name}",
            "router",
            *("--port", str(http_port), "--config", str(empty), "--no-health-checks"),
            *("--grpc-port", str(grpc_port), "--envoy-config", str(envoy_file)),
            *("--grpc-drain", "0"),  # stopped at once after a run
            *seeds,
            *(["--backend", "redis"] if name == "redis" else []),
        )
        wait_http(f"http://127.0.0.1:{http_port}/healthz", procs)
        roles = {"router": [router_pid], "nodes": node_pids}
        if name == "redis":
            roles["redis"] = [redis_pid]
        clusters[name] = {"port": grpc_port, "roles": roles}
    return clusters, names


def summarise(runs: dict[str, list[dict[str, Any]]], exactness: dict[str, int]) -> dict[str, Any]:
    """Medians per cluster and the per-round sticky/Redis ratio (pure)."""

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    rows: dict[str, Any] = {}
    for name, results in runs.items():
        rows[name] = {
            "calls_per_s": med([r["calls_per_s"] for r in results]),
            "p50_ms": med([r["p50_ms"] for r in results]),
            "p99_ms": med([r["p99_ms"] for r in results]),
            "errors": sum(r["errors"] for r in results),
            "cpu_us_per_call": {
                role: med([r["cpu_us_per_call"].get(role) for r in results])
                for role in results[0]["cpu_us_per_call"]
            }
            if results
            else {},
            "tight_ok": exactness.get(name),
        }
    ratios = [
        s["calls_per_s"] / r["calls_per_s"]
        for s, r in zip(runs.get("sticky", []), runs.get("redis", []), strict=False)
        if r["calls_per_s"]
    ]
    return {
        "rows": rows,
        "sticky_vs_redis": statistics.median(ratios) if ratios else None,
        "tight_expected": TIGHT_USERS * TIGHT_LIMIT,
    }


def lines(envoy: dict[str, Any]) -> list[str]:
    """The markdown table of the Envoy row."""

    def fmt(value: float | None, digits: int = 0) -> str:
        return "-" if value is None else f"{value:,.{digits}f}"

    out = [
        "| cluster | ShouldRateLimit calls/s | p50 ms | p99 ms | router us/call | "
        "nodes us/call | redis us/call | errors | tight: OK (expected) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in envoy["rows"].items():
        cpu = row["cpu_us_per_call"]
        out.append(
            f"| {name} | {fmt(row['calls_per_s'])} | {fmt(row['p50_ms'], 2)} | "
            f"{fmt(row['p99_ms'], 2)} | {fmt(cpu.get('router'))} | {fmt(cpu.get('nodes'))} | "
            f"{fmt(cpu.get('redis'))} | {row['errors']} | {row['tight_ok']} "
            f"({envoy['tight_expected']}) |"
        )
    ratio = envoy.get("sticky_vs_redis")
    out += ["", f"sticky vs Redis, ShouldRateLimit calls/s: {fmt(ratio, 2)}x (median of rounds)"]
    return out


async def serve_floor(port: int) -> None:
    """A RateLimitService that answers OK and does nothing else, on ``port`` until
    cancelled: gRPC's own cost per call (the floor of the router's), measured by
    running ``load`` against it (docs/envoy.md)."""
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    from router.envoy import start_grpc

    ok = rls_pb2.RateLimitResponse(overall_code=rls_pb2.RateLimitResponse.OK)

    class Floor(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
        async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
            return ok

    # Set up as the router's own service is (and refused as it is if the port is taken).
    server, _ = await start_grpc(Floor(), "127.0.0.1", port)
    try:
        await server.wait_for_termination()
    finally:
        await server.stop(None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.envoy",
        description="load: the load generator; floor: a do-nothing RateLimitService "
        "(gRPC's own cost per call) until interrupted",
    )
    parser.add_argument("command", choices=["load", "floor"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--users", type=int, default=10_000)
    parser.add_argument("--key", default="user")
    args = parser.parse_args(argv)
    if args.command == "floor":
        import signal

        import uvloop  # the loop a router serves gRPC on (node/server.py)

        signal.signal(signal.SIGTERM, signal.default_int_handler)
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(serve_floor(args.port))
        return 0
    result = asyncio.run(_drive(args.port, args.seconds, args.concurrency, args.users, args.key))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
