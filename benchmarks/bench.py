"""``ringlimit bench``: every deployment side by side, under the same load, on 127.0.0.1.

Rows (all started by this command, all stopped by it, also on Ctrl-C):

1. ``direct``       one node, limiter off (no rules): what one HTTP hop costs, the floor;
2. ``sticky``       router -> nodes, sticky routing, in-memory limiter (ringlimit);
3. ``redis``        router -> nodes (round-robin), every decision in one Redis (Lua),
                    the best version of that design: hiredis, and concurrent checks
                    coalesced into pipelined EVALSHA round trips (``--redis-pipeline on``);
   ``redis_naive``  the same, one EVALSHA round trip per check (``--redis-pipeline off``);
4. ``round_robin``  router -> nodes, round-robin, local limiters (reference only: each
                    node counts alone, so a user gets up to N times the limit);
5. ``slowapi``      what a Python user would deploy instead: Starlette + slowapi/limits
                    with Redis storage, one uvicorn process with two workers (the OS
                    spreads connections over them: round-robin without a router hop);
6. the decision API through the sticky router: single checks with coalescing on
   (``api_single``) and off (``api_single_nc``, a second router over the same
   nodes), and batches of 100 (``api_batch``).

Load: wrk with ``benchmarks/wrk_users.lua`` when installed, else the built-in
generator (``benchmarks/loadgen.py``); users drawn uniformly from a fixed
population (``--users``). Every row runs ``--repeats`` times, rounds interleaved
(alternating order), and the table gives medians; ratios are medians of
per-round ratios (this machine is shared and noisy: ratios measured side by
side matter, absolute numbers drift). CPU per request is each process's
``utime + stime`` from ``/proc/<pid>/stat`` (children included) across the run,
divided by the requests answered.

Exactness: a second, short run per row against a tight rule (``--tight-limit``
per hour, ``--tight-users`` fresh users, many requests each) must allow exactly
users x limit.

Then: the engine benchmark (``benchmarks.engine``: ours vs ``limits``), bytes
per token-bucket key at ``--memory-keys`` keys, and a handoff: ``--handoff-keys``
token-bucket states on node A, moved to node B by removing A gracefully.

``--quick`` shrinks everything (about a minute); the default takes a few minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.loadgen import Load, LoadResult, wrk_available
from benchmarks.loadgen import run as run_load

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MARKDOWN = Path(__file__).resolve().with_name("results.md")

#: The rows, in table order: key -> label.
ROWS: dict[str, str] = {
    "direct": "1 direct to one node, limiter off (floor)",
    "sticky": "2 router -> nodes, sticky, in-memory",
    "redis": "3 router -> nodes, Redis (Lua), pipelined",
    "redis_naive": "3b router -> nodes, Redis (Lua), one round trip per check",
    "round_robin": "4 router -> nodes, round-robin local (ref.)",
    "slowapi": "5 slowapi/limits + Redis, 2 workers",
    "api_single": "6a decision API, single, coalesced",
    "api_single_nc": "6b decision API, single, not coalesced",
    "api_batch": "6c decision API, batches of 100",
    # The cost of extra replicas (crash policy replica, rule `replicas = N`): not in
    # the default run; `ringlimit bench --rows sticky,sticky_r2,sticky_r3`.
    "sticky_r2": "2b router -> nodes, sticky, replicas = 2",
    "sticky_r3": "2c router -> nodes, sticky, replicas = 3",
}
#: Rows run when --rows is not given.
DEFAULT_ROWS = tuple(k for k in ROWS if k not in ("sticky_r2", "sticky_r3"))
ROLES = ("router", "nodes", "redis")
BATCH = 100


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Processes:
    """Everything the benchmark starts; :meth:`stop_all` stops it (routers before nodes)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[tuple[str, subprocess.Popen[bytes], Any]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (closed in stop_all)
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches us, and we stop them in order
        )
        self.started.append((name, popen, log))
        return popen.pid

    def ringlimit(self, name: str, *args: str) -> int:
        return self.start(name, [sys.executable, "-m", "router", *args])

    def failed(self) -> str | None:
        for name, popen, _ in self.started:
            if popen.poll() is not None:
                return f"{name} exited with code {popen.returncode}: {self.log_tail(name)}"
        return None

    def log_tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-1500:] if path.exists() else ""

    def stop(self, names: Sequence[str] | None = None, timeout: float = 10.0) -> None:
        chosen = [p for p in reversed(self.started) if names is None or p[0] in names]
        for _, popen, _ in chosen:
            if popen.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, popen, log in chosen:
            try:
                popen.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                popen.kill()
                popen.wait()
            log.close()
        self.started = [p for p in self.started if p not in chosen]

    def stop_all(self) -> None:
        self.stop(None)


def one_line(exc: BaseException, limit: int = 400) -> str:
    """A failure as one line: what failed, with the tail of any output folded in."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def wait_http(url: str, procs: Processes, timeout: float = 30.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            problem = procs.failed()
            if problem:
                raise RuntimeError(problem)
            with contextlib.suppress(httpx.HTTPError):
                if client.get(url).status_code == 200:
                    return
            time.sleep(0.05)
    raise RuntimeError(f"{url} not ready within {timeout:g}s")


def wait_redis(port: int, procs: Processes, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        problem = procs.failed()
        if problem:
            raise RuntimeError(problem)
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(64).startswith(b"+PONG"):
                return
        time.sleep(0.05)
    raise RuntimeError(f"redis-server on port {port} not ready within {timeout:g}s")


# --------------------------------------------------------------------------- CPU


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime in seconds) of a process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds used so far by ``pids`` and all their descendants (uvicorn workers)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                stats[int(entry)] = found
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, seen, todo = 0.0, set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


# --------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: float, enabled: bool = True) -> None:
        self.total = max(total, 1e-9)
        self.done = 0.0
        self.label = ""
        self.step_started = time.monotonic()
        self.step_expected = 0.0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if enabled and self.tty:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()

    def _fraction(self) -> float:
        within = min(time.monotonic() - self.step_started, self.step_expected)
        return min(1.0, (self.done + within) / self.total)

    def _draw(self) -> None:
        fraction = self._fraction()
        width = 30
        filled = int(fraction * width)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r[{bar}] {fraction * 100:3.0f}% {self.label[:60]:<60}")
        sys.stderr.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._draw()

    @contextlib.contextmanager
    def step(self, label: str, expected: float) -> Iterator[None]:
        self.label, self.step_started, self.step_expected = label, time.monotonic(), expected
        if self.enabled:
            if self.tty:
                self._draw()
            else:
                print(f"  [{self._fraction() * 100:3.0f}%] {label}", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            self.done += expected
            self.step_expected = 0.0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()


# --------------------------------------------------------------------------- the deployments


@dataclass
class Row:
    key: str
    url: str
    mode: str  # proxy | single | batch
    roles: dict[str, list[int]]  # role -> pids
    tight_url: str
    #: How many times users x limit the tight run may allow (round-robin local: N).
    tight_factor: int = 1
    decisions_per_request: int = 1
    limited: bool = True


@dataclass
class Settings:
    duration: float = 5.0
    warmup: float = 1.0
    repeats: int = 3
    connections: int = 50
    users: int = 10_000
    nodes: int = 2
    load_rate: str = "1000/second"
    tight_limit: int = 5
    tight_users: int = 100
    tight_duration: float = 2.0
    coalesce_window_us: float = 300.0
    engine_seconds: float = 20.0
    engine_keys: int = 10_000
    engine_hits: int = 10
    memory_keys: int = 1_000_000
    handoff_keys: int = 1_000_000
    tool: str = "auto"
    rows: tuple[str, ...] = DEFAULT_ROWS
    #: The clusters' crash policy; None: ringlimit's default (replica: replication on).
    crash_policy: str | None = None
    #: The Envoy row (benchmarks/envoy.py): ShouldRateLimit over gRPC, sticky vs Redis.
    envoy: bool = True


def cluster_toml(settings: Settings, replicas: int = 1) -> str:
    """The rules every ringlimit process of the benchmark runs with (``replicas``:
    copies of each ``bench`` state on successors, for the replica-cost rows)."""
    if replicas != 1:
        return cluster_toml(Settings(**{**settings.__dict__, "crash_policy": "replica"})).replace(
            'paths = ["/load/*"]\n', f'paths = ["/load/*"]\nreplicas = {replicas}\n', 1
        )
    return (
        f'[[rules]]\nname = "bench"\nrate = "{settings.load_rate}"\npaths = ["/load/*"]\n\n'
        f'[[rules]]\nname = "tight"\nrate = "{settings.tight_limit}/hour"\n'
        'paths = ["/tight/*"]\n\n'
        # A slow refill: a handoff state stays distinguishable from a fresh one (and so is
        # neither evicted nor skipped by the export) for hours after one request.
        '[[rules]]\nname = "handoff"\nrate = "100/day"\npaths = ["/handoff/*"]\n'
    ) + (f'\n[policies]\ncrash = "{settings.crash_policy}"\n' if settings.crash_policy else "")


def start_nodes(
    procs: Processes, prefix: str, count: int, cfg: Path, *extra: str
) -> tuple[list[int], list[str], list[str]]:
    """``count`` fenced nodes ``<prefix>1..``: their pids, the router's ``--node``
    seed flags, and their /healthz URLs (to wait on)."""
    pids: list[int] = []
    seeds: list[str] = []
    health: list[str] = []
    for i in range(1, count + 1):
        port = free_port()
        node_id = f"{prefix}{i}"
        pids.append(
            procs.ringlimit(
                node_id,
                "node",
                *("--id", node_id, "--port", str(port), "--fenced"),
                *("--config", str(cfg), *extra),
            )
        )
        seeds += ["--node", f"{node_id}=http://127.0.0.1:{port}"]
        health.append(f"http://127.0.0.1:{port}/healthz")
    return pids, seeds, health


def start_rows(procs: Processes, settings: Settings, workdir: Path) -> dict[str, Row]:
    """Start every deployment the chosen rows need; answer how to load each row."""
    cfg = workdir / "cluster.toml"
    cfg.write_text(cluster_toml(settings))
    empty = workdir / "empty.toml"
    empty.write_text("")
    wanted = set(settings.rows)
    rows: dict[str, Row] = {}
    ready: list[str] = []
    redis_pid, redis_url = 0, ""

    def nodes(prefix: str, *extra: str) -> tuple[list[int], list[str]]:
        pids, seeds, health = start_nodes(procs, prefix, settings.nodes, cfg, *extra)
        ready.extend(health)
        return pids, seeds

    def router(name: str, seeds: list[str], *extra: str) -> tuple[int, str]:
        port = free_port()
        pid = procs.ringlimit(
            name,
            "router",
            *("--port", str(port), "--config", str(cfg), "--no-health-checks"),
            *seeds,
            *extra,
        )
        url = f"http://127.0.0.1:{port}"
        ready.append(f"{url}/healthz")
        return pid, url

    if wanted & {"redis", "redis_naive", "slowapi"}:
        port = free_port()
        redis_pid = procs.start(
            "redis",
            [
                *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),
            ],
        )
        wait_redis(port, procs)
        redis_url = f"redis://127.0.0.1:{port}"
    if "direct" in wanted:
        port = free_port()
        # No rules at all (--config of an empty file; flags add none): the limiter is off.
        pid = procs.ringlimit(
            "direct", "node", "--id", "d1", "--port", str(port), "--config", str(empty)
        )
        url = f"http://127.0.0.1:{port}"
        ready.append(f"{url}/healthz")
        rows["direct"] = Row(
            "direct", f"{url}/load/x", "proxy", {"nodes": [pid]}, "", limited=False
        )
    if wanted & {"sticky", "api_single", "api_single_nc", "api_batch"}:
        node_pids, seeds = nodes("s")
        rpid, rurl = router(
            "router-sticky", seeds, "--coalesce-window", str(settings.coalesce_window_us)
        )
        roles = {"router": [rpid], "nodes": node_pids}
        rows["sticky"] = Row("sticky", f"{rurl}/load/x", "proxy", roles, f"{rurl}/tight/x")
        rows["api_single"] = Row(
            "api_single", f"{rurl}/v1/check", "single", roles, f"{rurl}/v1/check"
        )
        rows["api_batch"] = Row(
            "api_batch",
            f"{rurl}/v1/check",
            "batch",
            roles,
            f"{rurl}/v1/check",
            decisions_per_request=BATCH,
        )
        if "api_single_nc" in wanted:
            # A second router over the same nodes (it adopts their ring), coalescing off.
            npid, nurl = router("router-nocoalesce", seeds, "--coalesce-window", "0")
            rows["api_single_nc"] = Row(
                "api_single_nc",
                f"{nurl}/v1/check",
                "single",
                {"router": [npid], "nodes": node_pids},
                f"{nurl}/v1/check",
            )
    for replicas, key in ((2, "sticky_r2"), (3, "sticky_r3")):
        if key not in wanted:
            continue
        replica_cfg = workdir / f"cluster-r{replicas}.toml"
        replica_cfg.write_text(cluster_toml(settings, replicas))
        node_pids, seeds = nodes(f"p{replicas}-", "--config", str(replica_cfg))
        rpid, rurl = router(f"router-r{replicas}", seeds, "--config", str(replica_cfg))
        rows[key] = Row(
            key,
            f"{rurl}/load/x",
            "proxy",
            {"router": [rpid], "nodes": node_pids},
            f"{rurl}/tight/x",
        )
    for key, prefix, pipeline, db in (("redis", "r", "on", 0), ("redis_naive", "q", "off", 2)):
        if key not in wanted:
            continue
        node_pids, seeds = nodes(
            prefix,
            *("--backend", "redis", "--redis-url", f"{redis_url}/{db}"),
            *("--redis-pipeline", pipeline),
        )
        rpid, rurl = router(f"router-{key}", seeds, "--backend", "redis")
        rows[key] = Row(
            key,
            f"{rurl}/load/x",
            "proxy",
            {"router": [rpid], "nodes": node_pids, "redis": [redis_pid]},
            f"{rurl}/tight/x",
        )
    if "round_robin" in wanted:
        node_pids, seeds = nodes("l", "--balance", "round-robin")
        rpid, rurl = router("router-rr", seeds, "--balance", "round-robin")
        rows["round_robin"] = Row(
            "round_robin",
            f"{rurl}/load/x",
            "proxy",
            {"router": [rpid], "nodes": node_pids},
            f"{rurl}/tight/x",
            tight_factor=settings.nodes,
        )
    if "slowapi" in wanted:
        port = free_port()
        pid = procs.start(
            "slowapi",
            [
                *(sys.executable, "-m", "uvicorn", "benchmarks.slowapi_app:app"),
                *("--host", "127.0.0.1", "--port", str(port), "--workers", "2"),
                *("--no-access-log", "--log-level", "warning"),
                *_uvicorn_fast_flags(),
            ],
            env={
                "RINGLIMIT_BENCH_REDIS": f"{redis_url}/1",
                "RINGLIMIT_BENCH_LOAD_RATE": settings.load_rate,
                "RINGLIMIT_BENCH_TIGHT_RATE": f"{settings.tight_limit}/hour",
            },
        )
        url = f"http://127.0.0.1:{port}"
        ready.append(f"{url}/healthz")
        rows["slowapi"] = Row(
            "slowapi",
            f"{url}/load/x",
            "proxy",
            {"nodes": [pid], "redis": [redis_pid]},
            f"{url}/tight/x",
        )
    for url in ready:
        wait_http(url, procs)
    return {key: rows[key] for key in ROWS if key in rows and key in wanted}


def _uvicorn_fast_flags() -> list[str]:
    flags = []
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401

        flags += ["--loop", "uvloop"]
    with contextlib.suppress(ImportError):
        import httptools  # noqa: F401

        flags += ["--http", "httptools"]
    return flags


# --------------------------------------------------------------------------- measuring


@dataclass
class Run:
    """One timed run of one row."""

    load: LoadResult
    cpu: dict[str, float]  # role -> CPU seconds during the run
    decisions_per_request: int = 1

    @property
    def rps(self) -> float:
        return self.load.rps

    def cpu_us_per_request(self, role: str) -> float | None:
        if role not in self.cpu or not self.load.requests:
            return None
        return self.cpu[role] / self.load.requests * 1e6

    def to_dict(self) -> dict[str, Any]:
        return {
            "load": self.load.to_dict(),
            "cpu_seconds": self.cpu,
            "cpu_us_per_request": {r: self.cpu_us_per_request(r) for r in self.cpu},
        }


def measure(row: Row, load: Load, tool: str) -> Run:
    before = {role: cpu_seconds(pids) for role, pids in row.roles.items()}
    result = run_load(load, tool)
    after = {role: cpu_seconds(pids) for role, pids in row.roles.items()}
    if not load.count and row.limited:
        # Answers not read (cheaper for the load generator): every status >= 400 is a 429.
        result.allowed = result.requests - result.status_errors
        result.denied = result.status_errors
    return Run(result, {r: after[r] - before[r] for r in before}, row.decisions_per_request)


def row_load(row: Row, settings: Settings, prefix: str, duration: float) -> Load:
    return Load(
        url=row.url,
        mode=row.mode,
        users=settings.users,
        prefix=prefix,
        rule="bench",
        count=row.mode != "proxy",
        batch=BATCH,
        duration=duration,
        connections=settings.connections,
    )


def tight_load(row: Row, settings: Settings, prefix: str) -> Load:
    return Load(
        url=row.tight_url,
        mode=row.mode,
        users=settings.tight_users,
        prefix=prefix,
        rule="tight",
        count=True,
        batch=BATCH,
        duration=settings.tight_duration,
        connections=settings.connections,
    )


# --------------------------------------------------------------------------- summaries (pure)


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarise_row(key: str, runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the rounds of one row (``runs``: :meth:`Run.to_dict` values)."""
    loads = [r["load"] for r in runs]
    per = [r.get("decisions_per_request", 1) for r in runs]
    cpu = {
        role: median([r["cpu_us_per_request"].get(role) for r in runs])
        for role in ROLES
        if any(role in r["cpu_us_per_request"] for r in runs)
    }
    total = None
    if cpu:
        totals = [sum(v for v in r["cpu_us_per_request"].values() if v is not None) for r in runs]
        total = median(totals)
    return {
        "key": key,
        "label": ROWS.get(key, key),
        "rounds": len(runs),
        "rps": median([x["rps"] for x in loads]),
        "rps_runs": [x["rps"] for x in loads],
        "decisions_per_s": median([x["rps"] * d for x, d in zip(loads, per, strict=True)]),
        "p50_ms": median([x["p50_ms"] for x in loads]),
        "p99_ms": median([x["p99_ms"] for x in loads]),
        "cpu_us": cpu,
        "cpu_total_us": total,
        "allowed": sum(x["allowed"] for x in loads),
        "denied": sum(x["denied"] for x in loads),
        "errors": sum(x["status_errors"] + x["socket_errors"] for x in loads),
    }


def round_ratios(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Median of per-round ratios a[i] / b[i] (rows measured side by side in a round)."""
    pairs = [x / y for x, y in zip(a, b, strict=False) if y]
    return statistics.median(pairs) if pairs else None


def add_ratios(rows: dict[str, dict[str, Any]]) -> None:
    for reference, name in (("direct", "vs_direct"), ("redis", "vs_redis")):
        ref = rows.get(reference)
        for row in rows.values():
            row[name] = round_ratios(row["rps_runs"], ref["rps_runs"]) if ref is not None else None


def check_exactness(
    key: str, result: dict[str, Any], factor: int, users: int, limit: int
) -> dict[str, Any]:
    """Does a tight run agree with the rule? ``result``: the tight run's LoadResult dict."""
    expected = users * limit
    allowed = int(result["allowed"])
    decided = allowed + int(result["denied"])
    enough = decided >= 3 * expected
    if factor == 1:
        ok = allowed == expected and enough
        note = "exact" if ok else ("too few requests" if not enough else "WRONG")
    else:
        ok = expected <= allowed <= factor * expected and enough
        note = f"{allowed / expected:.2f}x the limit (each of {factor} nodes counts alone)"
    return {
        "key": key,
        "allowed": allowed,
        "denied": int(result["denied"]),
        "expected": expected,
        "max_expected": expected * factor,
        "ok": ok,
        "note": note,
    }


@dataclass
class Target:
    name: str
    measured: float | None
    goal: float
    at_most: bool = False
    unit: str = "x"
    detail: str = ""

    @property
    def ok(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured <= self.goal if self.at_most else self.measured >= self.goal

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "measured": self.measured,
            "goal": self.goal,
            "at_most": self.at_most,
            "unit": self.unit,
            "detail": self.detail,
            "pass": self.ok,
        }


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def targets(report: dict[str, Any]) -> list[Target]:
    rows: dict[str, dict[str, Any]] = report.get("rows", {})
    out: list[Target] = []
    sticky, redis, direct = rows.get("sticky"), rows.get("redis"), rows.get("direct")
    if sticky and direct:
        # Goals of the second performance step (issue 15): sticky >= 0.5x the floor,
        # router <= 0.8x the node's CPU, node <= 1.3x the floor's CPU per request.
        out.append(Target("router+sticky req/s vs direct-to-node floor", sticky["vs_direct"], 0.5))
        floor_cpu = direct["cpu_us"].get("nodes")
        out.append(
            Target(
                "node CPU per limited, proxied request vs the direct floor's",
                _div(sticky["cpu_us"].get("nodes"), floor_cpu),
                1.3,
                at_most=True,
                detail=f"{_fmt(sticky['cpu_us'].get('nodes'))} vs {_fmt(floor_cpu)} us",
            )
        )
    if sticky:
        cpu = sticky["cpu_us"]
        out.append(
            Target(
                "router CPU / node CPU per forwarded request",
                _div(cpu.get("router"), cpu.get("nodes")),
                0.8,
                at_most=True,
                detail=f"{_fmt(cpu.get('router'))} vs {_fmt(cpu.get('nodes'))} us",
            )
        )
    if sticky and redis:
        out.append(Target("sticky vs Redis baseline, req/s", sticky["vs_redis"], 1.25))
        out.append(
            Target(
                "sticky vs Redis, total CPU per request (ratio)",
                _div(sticky["cpu_total_us"], redis["cpu_total_us"]),
                1.0,
                at_most=True,
                detail=f"{_fmt(sticky['cpu_total_us'])} vs {_fmt(redis['cpu_total_us'])} us",
            )
        )
        out.append(
            Target(
                "sticky vs Redis, p99 latency (ratio)",
                _div(sticky["p99_ms"], redis["p99_ms"]),
                1.0,
                at_most=True,
                detail=f"{_fmt(sticky['p99_ms'], 1)} vs {_fmt(redis['p99_ms'], 1)} ms",
            )
        )
    if sticky and rows.get("slowapi"):
        out.append(
            Target(
                "sticky vs slowapi/limits + Redis, req/s",
                round_ratios(sticky["rps_runs"], rows["slowapi"]["rps_runs"]),
                1.5,
            )
        )
    if rows.get("api_batch"):
        out.append(
            Target(
                "decision API, batches of 100: decisions/s",
                rows["api_batch"]["decisions_per_s"],
                200_000,
                unit="/s",
            )
        )
    if rows.get("api_single") and rows.get("api_single_nc"):
        out.append(
            Target(
                "single checks: coalesced vs not, decisions/s",
                round_ratios(rows["api_single"]["rps_runs"], rows["api_single_nc"]["rps_runs"]),
                1.1,
            )
        )
    for comparison in report.get("engine", {}).get("ratios", []):
        if comparison["target"] > 1.0:
            out.append(
                Target(
                    f"engine: {comparison['ours']} vs {comparison['theirs']}",
                    comparison["ratio"],
                    comparison["target"],
                )
            )
    memory = report.get("memory")
    if memory:
        # A real node's RSS when the handoff run measured it; else the store's estimate.
        rss = memory.get("node_rss_bytes_per_key")
        out.append(
            Target(
                f"node RSS per token-bucket key at {memory['keys']:,} keys"
                if rss is not None
                else f"memory per token-bucket key at {memory['keys']:,} keys (store estimate)",
                rss if rss is not None else memory["bytes_per_key"],
                150.0,
                at_most=True,
                unit=" B",
                detail=memory.get("detail", ""),
            )
        )
    handoff = report.get("handoff")
    if handoff:
        out.append(
            Target(
                f"handoff of {handoff['keys']:,} keys, node A -> B",
                handoff["seconds"] if handoff.get("complete") else None,
                5.0,
                at_most=True,
                unit=" s",
                detail=handoff.get("detail", ""),
            )
        )
    for check in report.get("exactness", {}).values():
        if check["max_expected"] == check["expected"]:
            out.append(
                Target(
                    f"exactness, {check['key']}: allowed == users x limit",
                    float(check["allowed"]) if check["ok"] else None,
                    float(check["expected"]),
                    unit="",
                    detail=check["note"]
                    if check["ok"]
                    else f"{check['allowed']:,} allowed: " + check["note"],
                )
            )
    return out


def _fmt(value: float | None, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table_lines(report: dict[str, Any]) -> list[str]:
    """The table as markdown rows (also printed as is)."""
    head = (
        "| configuration | req/s | decisions/s | p50 ms | p99 ms | router us/req | nodes us/req "
        "| redis us/req | allowed / denied | tight rule: allowed (expected) | vs 1 | vs 3 |"
    )
    lines = [head, "|" + "---|" * 12]
    exact = report.get("exactness", {})
    for key, row in report["rows"].items():
        cpu = row["cpu_us"]
        check = exact.get(key)
        if check is None:
            tight = "-"
        elif check["max_expected"] == check["expected"]:
            tight = (
                f"{check['allowed']:,} ({check['expected']:,}) {'ok' if check['ok'] else 'WRONG'}"
            )
        else:
            tight = f"{check['allowed']:,} ({check['expected']:,}; {check['note']})"
        limited = row.get("limited", True)
        lines.append(
            "| "
            + " | ".join(
                [
                    row["label"],
                    _fmt(row["rps"]),
                    _fmt(row["decisions_per_s"]) if limited else "- (off)",
                    _fmt(row["p50_ms"], 2),
                    _fmt(row["p99_ms"], 2),
                    _fmt(cpu.get("router")),
                    _fmt(cpu.get("nodes")),
                    _fmt(cpu.get("redis")),
                    f"{row['allowed']:,} / {row['denied']:,}" if limited else "- (off)",
                    tight,
                    _ratio(row.get("vs_direct")),
                    _ratio(row.get("vs_redis")),
                ]
            )
            + " |"
        )
    return lines


def target_lines(items: Sequence[Target]) -> list[str]:
    lines = ["| target | measured | goal | result |", "|---|---|---|---|"]
    for t in items:
        if t.unit == "x":
            measured, goal = _ratio(t.measured), f"{'<=' if t.at_most else '>='} {t.goal:g}x"
        elif t.unit == "":
            measured, goal = _fmt(t.measured), f"== {t.goal:,.0f}"
        else:
            digits = 1 if t.unit == " s" or t.unit == " B" else 0
            measured = _fmt(t.measured, digits) + t.unit if t.measured is not None else "-"
            goal = f"{'<=' if t.at_most else '>='} {t.goal:,g}{t.unit}"
        if t.detail:
            measured += f" ({t.detail})"
        result = "pass" if t.ok else "SHORT"
        lines.append(f"| {t.name} | {measured} | {goal} | {result} |")
    return lines


def engine_lines(engine: dict[str, Any]) -> list[str]:
    lines = ["| engine | decisions/s |", "|---|---|"]
    for name, value in engine.get("medians", {}).items():
        lines.append(f"| {name} | {_fmt(value)} |")
    return lines


def markdown(report: dict[str, Any]) -> str:
    meta = report["meta"]
    parts = [
        "# Benchmark results",
        "",
        f"Generated by `{meta['command']}` on {meta['date']}: Python {meta['python']}, "
        f"{meta['cpus']} CPUs, load by {meta['tool']} ({meta['connections']} connections, "
        f"{meta['users']:,} users), {meta['nodes']} nodes per cluster, {meta['repeats']} "
        f"interleaved rounds of {meta['duration']:g} s per row (medians). Ratios are medians "
        "of per-round ratios against row 1 (direct) and row 3 (Redis, pipelined: the best "
        "version of the Redis design).",
        "",
        *table_lines(report),
        "",
        "## Targets",
        "",
        *target_lines(targets(report)),
    ]
    if report.get("envoy"):
        from benchmarks.envoy import lines as envoy_lines

        parts += [
            "",
            "## Envoy's rate limit service (gRPC ShouldRateLimit, one descriptor per call)",
            "",
            *envoy_lines(report["envoy"]),
        ]
    if report.get("engine", {}).get("medians"):
        parts += ["", "## Engine (in-process, one rule)", "", *engine_lines(report["engine"])]
    if report.get("notes"):
        parts += ["", "## Notes", ""] + [f"* {n}" for n in report["notes"]]
    return "\n".join(parts) + "\n"


# --------------------------------------------------------------------------- engine, memory


def run_engine(settings: Settings) -> dict[str, Any]:
    from benchmarks import engine

    keys = engine.make_keys(settings.engine_keys)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        runs = engine.measure_throughput(
            keys,
            settings.engine_hits,
            settings.engine_seconds,
            min_rounds=1 if settings.engine_seconds < 5 else 3,
            max_rounds=15,
        )
    medians = {name: statistics.median(v) for name, v in runs.items()}
    ratios = []
    for ours, theirs, target in engine.COMPARISONS:
        per_round = [a / b for a, b in zip(runs[ours], runs[theirs], strict=True)]
        ratios.append(
            {
                "ours": ours,
                "theirs": theirs,
                "target": target,
                "ratio": statistics.median(per_round),
                "per_round": per_round,
            }
        )
    return {"medians": medians, "ratios": ratios, "keys": settings.engine_keys}


def run_memory(n: int) -> dict[str, Any]:
    """Bytes per token-bucket key in a node's store (tracemalloc), key string included."""
    from benchmarks import engine

    keys = engine.make_keys(n)
    key_bytes = statistics.mean(sys.getsizeof(k) for k in keys[:1000])
    store_bytes = engine.measure_memory("token_bucket", keys)
    return {
        "keys": n,
        "store_bytes_per_key": store_bytes,
        "key_string_bytes": key_bytes,
        "bytes_per_key": store_bytes + key_bytes,
    }


# --------------------------------------------------------------------------- handoff


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_handoff(procs: Processes, workdir: Path, n: int) -> dict[str, Any]:
    """Fill node A with ``n`` token-bucket states, then remove A: all of them move to B.

    The router is seeded with A and B; the states are created through A's own
    decision API (batches of 1000) for keys A owns, so removing A gracefully
    (``DELETE /admin/nodes/A``) hands every one of them to B in one transfer.
    Timed: the DELETE, which returns once A has delivered everything.
    """
    import httpx

    from ring import Member, RingView

    cfg = workdir / "cluster.toml"
    ports = {"A": free_port(), "B": free_port()}
    pids = {
        node: procs.ringlimit(
            f"handoff-{node}",
            "node",
            *("--id", node, "--port", str(port), "--fenced", "--config", str(cfg)),
        )
        for node, port in ports.items()
    }
    urls = {node: f"http://127.0.0.1:{port}" for node, port in ports.items()}
    for url in urls.values():
        wait_http(f"{url}/healthz", procs)
    rport = free_port()
    procs.ringlimit(
        "handoff-router",
        "router",
        *("--port", str(rport), "--config", str(cfg), "--no-health-checks"),
        *("--node", f"A={urls['A']}", "--node", f"B={urls['B']}"),
    )
    router = f"http://127.0.0.1:{rport}"
    wait_http(f"{router}/healthz", procs)
    view = RingView.of([Member("A", urls["A"]), Member("B", urls["B"])], epoch=1)
    keys: list[str] = []
    i = 0
    while len(keys) < n:
        key = f"h{i}"
        if view.owner_id(key) == "A":
            keys.append(key)
        i += 1
    batches = [
        json.dumps({"checks": [{"key": k, "rule": "handoff"} for k in keys[j : j + 1000]]})
        for j in range(0, n, 1000)
    ]
    rss_before = _rss(pids["A"])
    fill_started = time.perf_counter()
    with httpx.Client(timeout=60.0) as client:

        def post(body: str) -> None:
            answer = client.post(
                f"{urls['A']}/v1/check", content=body, headers={"content-type": "application/json"}
            )
            answer.raise_for_status()

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(post, batches))
        fill_seconds = time.perf_counter() - fill_started
        held = client.get(f"{urls['A']}/healthz").json()["keys"]
        # Start from a quiet cluster: A streams replicas of what it decides to its
        # successor (the default crash policy, "replica"); let B catch up first.
        settle_started = time.perf_counter()
        previous = -1
        while time.perf_counter() - settle_started < 120:
            replicas = client.get(f"{urls['B']}/internal/status").json().get("replicas", {})
            count = int(replicas.get("A", 0))
            if count >= held or count == previous:
                break
            previous = count
            time.sleep(0.5)
        settle_seconds = time.perf_counter() - settle_started
        # Once A is quiet: its periodic sweep (every second) has given freed heap
        # pages back (node.memory), so RSS is what the states really hold.
        time.sleep(1.5)
        rss_after = _rss(pids["A"])
        started = time.perf_counter()
        answer = client.delete(f"{router}/admin/nodes/A", timeout=120.0)
        seconds = time.perf_counter() - started
        status_b = client.get(f"{urls['B']}/internal/status").json()
        status_a = client.get(f"{urls['A']}/internal/status").json()
    received = int(status_b.get("stats", {}).get("keys_received", 0))
    transfer = float(status_a.get("stats", {}).get("last_transfer_seconds", 0.0))
    complete = answer.status_code == 200 and received >= held == n
    detail = (
        f"{received:,} of {held:,} keys arrived"
        + ("" if answer.status_code == 200 else f"; router answered {answer.status_code}")
        + f"; A's own transfer took {transfer:.1f} s"
    )
    procs.stop(["handoff-router", "handoff-A", "handoff-B"])
    log_a = workdir / "handoff-A.log"
    failures = log_a.read_text(errors="replace").count("failed") if log_a.exists() else 0
    if failures:
        detail += f"; A logged {failures} failed transfer(s) (peer timeout)"
    return {
        "keys": n,
        "held_by_a": held,
        "received_by_b": received,
        "seconds": seconds,
        "complete": complete,
        "fill_seconds": fill_seconds,
        "settle_seconds": settle_seconds,
        "node_rss_bytes_per_key": (rss_after - rss_before) / n if n else None,
        "detail": detail,
        "sender_failures": failures,
    }


# --------------------------------------------------------------------------- the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration", type=float, help="seconds per timed run (default 5; --quick: 2)"
    )
    parser.add_argument("--connections", type=int, default=50, help="concurrent connections")
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 3; --quick: 1)")
    parser.add_argument("--json", metavar="OUT", help="also write every number to OUT")
    parser.add_argument(
        "--markdown",
        metavar="OUT",
        help=f"write the markdown report here (default: {DEFAULT_MARKDOWN.relative_to(ROOT)} "
        "unless --quick; '-' for none)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a fast, rough run (about a minute): short runs, one round, 100k keys for "
        "memory and handoff, a short engine run; does not overwrite the default markdown",
    )
    parser.add_argument("--users", type=int, default=10_000, help="user population (default 10000)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes per cluster (default 2)")
    parser.add_argument(
        "--loadgen",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="wrk when installed (auto), or the built-in Python generator",
    )
    parser.add_argument(
        "--rows", help=f"comma-separated subset of: {', '.join(ROWS)} (default: all)"
    )
    parser.add_argument("--handoff-keys", type=int, help="default 1000000 (--quick: 100000)")
    parser.add_argument("--memory-keys", type=int, help="default 1000000 (--quick: 100000)")
    parser.add_argument("--engine-seconds", type=float, help="default 20 (--quick: 2)")
    parser.add_argument(
        "--crash-policy",
        choices=["replica", "conservative", "reset"],
        help="the ringlimit clusters' crash policy (default: ringlimit's own, replica, which "
        "streams every changed state to a second node)",
    )
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-envoy", action="store_true", help="no ShouldRateLimit (gRPC) row")
    parser.add_argument("--skip-handoff", action="store_true")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--scale",
        metavar="K,K,...",
        help="only the scaling runs (benchmarks/scale.py): for each K, K router workers and 2K "
        "nodes, sticky vs Redis, e.g. --scale 1,2,4",
    )


def settings_from(args: argparse.Namespace) -> Settings:
    quick = bool(args.quick)
    settings = Settings(
        duration=args.duration or (2.0 if quick else 5.0),
        warmup=0.5 if quick else 1.0,
        repeats=args.repeats or (1 if quick else 3),
        connections=args.connections,
        users=args.users,
        nodes=args.nodes,
        tight_duration=1.0 if quick else 2.0,
        engine_seconds=args.engine_seconds or (2.0 if quick else 20.0),
        engine_keys=2_000 if quick else 10_000,
        engine_hits=3 if quick else 10,
        memory_keys=0
        if args.skip_engine
        else (args.memory_keys or (100_000 if quick else 1_000_000)),
        handoff_keys=0
        if args.skip_handoff
        else (args.handoff_keys or (100_000 if quick else 1_000_000)),
        tool=args.loadgen,
        crash_policy=args.crash_policy,
        envoy=not getattr(args, "skip_envoy", False),
    )
    if args.rows:
        chosen = tuple(r.strip() for r in args.rows.split(",") if r.strip())
        unknown = [r for r in chosen if r not in ROWS]
        if unknown:
            raise ValueError(
                f"--rows: unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}"
            )
        settings.rows = chosen
    if args.skip_engine:
        settings.engine_seconds = 0
    if settings.duration < 1:
        raise ValueError("--duration must be at least 1 second")
    return settings


def missing_extras(settings: Settings) -> list[str]:
    """The ``bench`` extra's modules this run needs and cannot import."""
    import importlib.util

    needed = []
    if settings.engine_seconds:
        needed.append("limits")
    if "slowapi" in settings.rows:
        needed += ["limits", "slowapi"]
    return [m for m in dict.fromkeys(needed) if importlib.util.find_spec(m) is None]


def run(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    missing = [] if getattr(args, "scale", None) else missing_extras(settings)
    if missing:
        raise ValueError(
            f"the benchmark needs {' and '.join(missing)}: pip install 'ringlimit[bench]'"
        )
    tool = settings.tool
    if tool == "wrk" and not wrk_available():
        raise ValueError("--loadgen wrk: wrk is not installed")
    tool_name = "wrk" if tool == "wrk" or (tool == "auto" and wrk_available()) else "python"
    needs_redis = bool(set(settings.rows) & {"redis", "redis_naive", "slowapi"}) or settings.envoy
    if needs_redis and not _have("redis-server"):
        raise ValueError("redis-server is not on the PATH (needed by the redis and slowapi rows)")
    if getattr(args, "scale", None):
        from benchmarks.scale import run_command

        return run_command(args, settings, tool_name)
    quick = bool(args.quick)
    markdown_path: Path | None
    if args.markdown == "-":
        markdown_path = None
    elif args.markdown:
        markdown_path = Path(args.markdown)
    elif quick:
        markdown_path = None
    else:
        # Outside a source checkout (an installed wheel) the report goes to the
        # working directory, not into site-packages.
        in_checkout = (ROOT / "pyproject.toml").exists()
        markdown_path = DEFAULT_MARKDOWN if in_checkout else Path("ringlimit-bench.md")

    # A SIGTERM stops us like Ctrl-C: through the finally below, which stops everything.
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    workdir = Path(tempfile.mkdtemp(prefix="ringlimit-bench-"))
    procs = Processes(workdir)
    rows_n = len(settings.rows)
    tight_n = len([r for r in settings.rows if r != "direct"])
    total = (
        rows_n * (settings.warmup + 1)
        + settings.repeats * rows_n * (settings.duration + 0.5)
        + tight_n * (settings.tight_duration + 0.5)
        + 8
        + settings.engine_seconds * 1.3
        + settings.memory_keys / 100_000
        + settings.handoff_keys / 40_000
        + (settings.repeats * 2 * (settings.duration + 1) + 12 if settings.envoy else 0)
    )
    progress = Progress(total, enabled=not args.no_progress)
    started = time.time()
    report: dict[str, Any] = {
        "meta": {
            "command": "ringlimit bench" + (" --quick" if quick else ""),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "tool": tool_name,
            "connections": settings.connections,
            "users": settings.users,
            "nodes": settings.nodes,
            "repeats": settings.repeats,
            "duration": settings.duration,
            "load_rate": settings.load_rate,
            "crash_policy": settings.crash_policy or "replica (ringlimit's default)",
            "tight": f"{settings.tight_limit}/hour x {settings.tight_users} users",
            "loadavg_before": _loadavg(),
            "hiredis": _hiredis(),
        },
        "rows": {},
        "runs": {},
        "exactness": {},
        "notes": [],
    }
    try:
        with progress.step("starting processes", 8):
            rows = start_rows(procs, settings, workdir)
        runs: dict[str, list[Run]] = {key: [] for key in rows}
        for key, row in rows.items():
            with progress.step(f"warm-up: {key}", settings.warmup + 1):
                run_load(row_load(row, settings, "w", settings.warmup), tool)
        order = list(rows)
        for r in range(settings.repeats):
            for key in order if r % 2 == 0 else order[::-1]:
                with progress.step(
                    f"round {r + 1}/{settings.repeats}: {key}", settings.duration + 0.5
                ):
                    runs[key].append(
                        measure(
                            rows[key], row_load(rows[key], settings, "w", settings.duration), tool
                        )
                    )
        for key, row in rows.items():
            if not row.limited:
                continue
            with progress.step(f"exactness: {key}", settings.tight_duration + 0.5):
                result = run_load(tight_load(row, settings, f"t{key}-"), tool)
            report["exactness"][key] = check_exactness(
                key, result.to_dict(), row.tight_factor, settings.tight_users, settings.tight_limit
            )
        procs.stop_all()
        for key, row_runs in runs.items():
            dicts = []
            for one in row_runs:
                d = one.to_dict()
                d["decisions_per_request"] = one.decisions_per_request
                dicts.append(d)
            report["runs"][key] = dicts
            summary = summarise_row(key, dicts)
            summary["limited"] = rows[key].limited
            report["rows"][key] = summary
        add_ratios(report["rows"])
        if settings.envoy:
            from benchmarks.envoy import run_envoy

            with progress.step(
                "envoy: ShouldRateLimit, sticky vs Redis",
                settings.repeats * 2 * (settings.duration + 1) + 12,
            ):
                report["envoy"] = run_envoy(settings, procs, workdir)
        if settings.engine_seconds > 0:
            with progress.step("engine: ours vs limits", settings.engine_seconds * 1.3):
                report["engine"] = run_engine(settings)
        if settings.memory_keys:
            with progress.step(
                f"memory at {settings.memory_keys:,} keys", settings.memory_keys / 100_000
            ):
                report["memory"] = run_memory(settings.memory_keys)
        if settings.handoff_keys:
            with progress.step(
                f"handoff of {settings.handoff_keys:,} keys", settings.handoff_keys / 40_000
            ):
                report["handoff"] = run_handoff(procs, workdir, settings.handoff_keys)
            if report.get("memory") and report["handoff"].get("node_rss_bytes_per_key"):
                report["memory"]["node_rss_bytes_per_key"] = report["handoff"][
                    "node_rss_bytes_per_key"
                ]
                report["memory"]["detail"] = (
                    f"store {report['memory']['store_bytes_per_key']:.0f} + key string "
                    f"{report['memory']['key_string_bytes']:.0f}; a real node's RSS grew "
                    f"{report['handoff']['node_rss_bytes_per_key']:.0f} B/key"
                )
    except KeyboardInterrupt:
        progress.close()
        print("\nringlimit bench: interrupted; stopping everything it started", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # a process that would not start, a load generator that failed
        progress.close()
        print(f"ringlimit bench: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)
    report["meta"]["seconds"] = time.time() - started
    report["meta"]["loadavg_after"] = _loadavg()
    report["notes"] += default_notes(report)
    report["targets"] = [t.to_dict() for t in targets(report)]
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    if markdown_path is not None:
        markdown_path.write_text(markdown(report))
        print(f"wrote {markdown_path}")
    return 0


def default_notes(report: dict[str, Any]) -> list[str]:
    meta = report["meta"]
    notes = [
        f"Rules: `bench` = {meta['load_rate']} per user (token bucket; the load rows), "
        f"`tight` = {meta['tight']} (the exactness runs: fresh users, many requests each).",
        "Row 5 runs `benchmarks/slowapi_app.py` as one uvicorn process with 2 workers "
        "(slowapi's default fixed window, Redis storage); its CPU is in the nodes column.",
        f"Crash policy of the ringlimit clusters: {meta['crash_policy']}"
        + (
            " - a sticky node streams every changed state to a second node every 0.1 s, "
            "which costs node CPU in rows 2 and 6 (the Redis and round-robin nodes have no "
            "shard and replicate nothing)."
            if meta["crash_policy"].startswith("replica")
            else "."
        ),
        "Routers run with `--no-health-checks` (no background probes during the runs); "
        "nodes and routers otherwise use the defaults of `ringlimit node` / `ringlimit router`.",
        f"The machine's load average was {meta['loadavg_before']} before and "
        f"{meta.get('loadavg_after', '?')} after the run (other work shares the machine).",
    ]
    redis, naive = report["rows"].get("redis"), report["rows"].get("redis_naive")
    if redis and naive:
        notes.append(
            "Redis rows: the nodes parse replies with "
            + (f"hiredis {meta['hiredis']}" if meta.get("hiredis") else "redis-py's Python parser")
            + "; row 3 coalesces concurrent checks into pipelined EVALSHA round trips "
            f"(median per-round ratio vs row 3b: "
            f"{_ratio(round_ratios(redis['rps_runs'], naive['rps_runs']))} req/s), "
            "row 3b sends one EVALSHA round trip per check."
        )
    handoff = report.get("handoff")
    if handoff:
        notes.append(
            f"Handoff: {handoff['keys']:,} states created on node A through its decision API "
            f"in {handoff['fill_seconds']:.1f} s; `DELETE /admin/nodes/A` on the router returned "
            f"after {handoff['seconds']:.2f} s ({handoff['detail']})."
        )
    return notes


def print_report(report: dict[str, Any]) -> None:
    meta = report["meta"]
    print(
        f"\nringlimit bench: {meta['repeats']} round(s) x {meta['duration']:g} s per row, "
        f"{meta['tool']}, {meta['connections']} connections, {meta['users']:,} users, "
        f"{meta['nodes']} nodes; took {meta['seconds']:.0f} s\n"
    )
    for line in table_lines(report):
        print(line)
    if report.get("envoy"):
        from benchmarks.envoy import lines as envoy_lines

        print()
        for line in envoy_lines(report["envoy"]):
            print(line)
    if report.get("engine", {}).get("medians"):
        print()
        for line in engine_lines(report["engine"]):
            print(line)
    print()
    for line in target_lines(targets(report)):
        print(line)
    print()
    for note in report["notes"]:
        print(f"* {note}")


def _have(binary: str) -> bool:
    import shutil

    return shutil.which(binary) is not None


def _hiredis() -> str | None:
    """hiredis's version when redis-py parses replies with it (as the nodes will)."""
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return None
    if not HIREDIS_AVAILABLE:
        return None
    import hiredis

    return str(hiredis.__version__)


def _loadavg() -> str:
    with contextlib.suppress(OSError), open("/proc/loadavg", encoding="ascii") as f:
        return " ".join(f.read().split()[:3])
    return "?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
