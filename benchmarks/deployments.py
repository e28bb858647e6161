"""The deployments ``ringlimit bench`` compares, started as real processes on 127.0.0.1.

What each row of the table is (ROWS), the rules every ringlimit process runs
(:func:`cluster_toml`), and :func:`start_rows`, which starts what the chosen
rows need (nodes, routers, one redis-server, slowapi under uvicorn) and waits
until each answers. :class:`Processes` keeps every child it started so the
command stops them all, routers before nodes, also on Ctrl-C; starting,
waiting and stopping are router/processes.py's.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.placement import Placement
from router.processes import (
    ChildProcess,
    NotReady,
    free_block,
    http_probe,
    redis_probe,
    ringlimit_argv,
    stop_all,
    wait_ready,
)

__all__ = [
    "BATCH",
    "DEFAULT_ROWS",
    "HOT_SHARE",
    "OPTIONAL_ROWS",
    "ROLES",
    "ROOT",
    "ROWS",
    "Processes",
    "Row",
    "Settings",
    "cluster_toml",
    "start_nodes",
    "start_rows",
    "wait_http",
    "wait_redis",
]

ROOT = Path(__file__).resolve().parent.parent

#: The rows, in table order: key -> label.
ROWS: dict[str, str] = {
    "direct": "1 direct to one node, limiter off (floor)",
    # The same node with the rules on, wrk still straight to it: the limiter's own
    # cost at the floor's load. A node behind the router runs at a fraction of that
    # load, where every request costs more CPU, limited or not (docs/architecture.md).
    "direct_limited": "1l direct to one node, limiter on (no router)",
    "sticky": "2 router -> nodes, sticky, in-memory",
    # The same nodes behind a second router that pipelines (router --pipeline).
    "sticky_pipe": "2p router -> nodes, sticky, pipelined (--pipeline 16)",
    # The same nodes behind a third router that reaches them through their Unix
    # sockets (node --unix-socket); the routers above use TCP (--no-unix-sockets).
    "sticky_unix": "2u router -> nodes, sticky, Unix sockets",
    # Both: not in the default run; `ringlimit bench --rows direct,sticky_unix,sticky_pipe_unix`.
    "sticky_pipe_unix": "2pu router -> nodes, sticky, pipelined, Unix sockets",
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
    # One user sends 30% of the requests, over its limit (docs/hotkeys.md): quota
    # leases off and on. Not in the default run; `ringlimit bench --rows hot_off,hot_on`.
    "hot_off": "7a router -> nodes, one user 30%, leases off",
    "hot_on": "7b router -> nodes, one user 30%, leases on",
}
#: The decision API's rows (served by the sticky rows' first router).
API_ROWS = ("api_single", "api_single_nc", "api_batch")
#: The flag of the routers that reach the nodes over TCP even where a node
#: offers a Unix socket (every router but ``sticky_unix``'s).
TCP_ONLY = "--no-unix-sockets"
#: The pipelined row's ``router --pipeline``.
PIPELINE = 16
#: Rows of the sticky nodes behind a router of their own: its flags.
PROXY_ROWS: dict[str, tuple[str, ...]] = {
    "sticky_pipe": ("--pipeline", str(PIPELINE), TCP_ONLY),
    "sticky_unix": (),
    "sticky_pipe_unix": ("--pipeline", str(PIPELINE)),
}
#: Rows run when --rows is not given.
OPTIONAL_ROWS = ("sticky_pipe_unix", "sticky_r2", "sticky_r3", "hot_off", "hot_on")
DEFAULT_ROWS = tuple(k for k in ROWS if k not in OPTIONAL_ROWS)
#: ``owner``: the node that owns the hot user (hot rows; also counted in ``nodes``).
ROLES = ("router", "nodes", "redis", "owner")
#: The Redis nodes' --redis-timeout in the bench (the default is 0.1 s): on a
#: saturated machine a reply can take longer, and the node then decides on its
#: local fallback (an open rule counts per node: the exactness run admitted 959
#: of 500 once, on a loaded 2-core machine). The bench measures throughput, not
#: failover, and a timeout that is not reached costs nothing.
BENCH_REDIS_TIMEOUT = 2.0
#: The hot rows' share of requests from one user, and that user's rule.
HOT_SHARE = 0.3
HOT_RATE = "1000/minute"
BATCH = 100


# --------------------------------------------------------------------------- processes


class Processes:
    """Everything the benchmark starts; :meth:`stop_all` stops it (routers before nodes).

    Each child leads its own session: a Ctrl-C in the terminal reaches the
    benchmark alone, which then stops its children in order. Output goes to
    ``<workdir>/<name>.log``.
    """

    def __init__(self, workdir: Path, placement: Placement | None = None) -> None:
        self.workdir = workdir
        #: Where each child runs (by its tier), None: where the kernel likes.
        self.placement = placement
        self.started: list[ChildProcess] = []
        #: Ports handed to children, which may not have bound them yet.
        self.ports: set[int] = set()

    def port(self) -> int:
        """A port for a child: free now, below the kernel's ephemeral range (no
        outgoing connection takes it before the child binds it), and not one
        this run handed out already (:func:`router.processes.free_block`)."""
        return free_block(1, avoid=self.ports)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        child = ChildProcess(
            name,
            argv if self.placement is None else self.placement.pinned(argv),
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            log=self.workdir / f"{name}.log",
            new_session=True,
        )
        self.started.append(child)
        return child.pid

    def ringlimit(self, name: str, *args: str) -> int:
        return self.start(name, ringlimit_argv(*args))

    def names(self) -> list[str]:
        return [child.name for child in self.started]

    def failed(self) -> str | None:
        """The first child that exited, with the tail of its output, else None."""
        for child in self.started:
            if not child.alive():
                return f"{child.name} {child.exit_text()}: {self.log_tail(child.name)}"
        return None

    def log_tail(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-1500:] if path.exists() else ""

    def stop(self, names: Sequence[str] | None = None, timeout: float = 10.0) -> None:
        """Stop the children named (all when None), the last started first."""
        chosen = [c for c in reversed(self.started) if names is None or c.name in names]
        stop_all(chosen, timeout, signal.SIGTERM)
        self.started = [c for c in self.started if c not in chosen]

    def stop_all(self) -> None:
        self.stop(None)


def wait_http(url: str, procs: Processes, timeout: float = 30.0) -> None:
    """Until ``GET url`` answers 200; RuntimeError if a child exits or time runs out."""
    with httpx.Client(timeout=1.0) as client:
        try:
            wait_ready(http_probe(client, url), timeout=timeout, failed=procs.failed)
        except NotReady as exc:
            raise RuntimeError(_not_ready(exc, url, timeout)) from None


def wait_redis(port: int, procs: Processes, timeout: float = 15.0) -> None:
    """Until redis-server on ``port`` answers PING; RuntimeError as :func:`wait_http`."""
    try:
        wait_ready(redis_probe(port), timeout=timeout, failed=procs.failed)
    except NotReady as exc:
        raise RuntimeError(_not_ready(exc, f"redis-server on port {port}", timeout)) from None


def _not_ready(exc: NotReady, what: str, timeout: float) -> str:
    timed_out = str(exc).startswith("not ready within")
    return f"{what} not ready within {timeout:g}s" if timed_out else str(exc)


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
    #: proxy rows: the share of requests from one hot user (benchmarks/loadgen.py)
    hot_share: float = 0.0


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
    #: Each process on its tier's CPUs (benchmarks/placement.py, ``--pin``); None: unpinned.
    placement: Placement | None = None

    def front_cpus(self) -> frozenset[int] | None:
        """The load generators' CPUs: the front tier's, when the run is pinned."""
        return None if self.placement is None else self.placement.front


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
    procs: Processes,
    prefix: str,
    count: int,
    cfg: Path,
    *extra: str,
    sockets_in: Path | None = None,
) -> tuple[list[int], list[str], list[str]]:
    """``count`` fenced nodes ``<prefix>1..``: their pids, the router's ``--node``
    seed flags, and their /healthz URLs (to wait on); each on a Unix socket
    ``<node id>.sock`` in ``sockets_in`` too, if given."""
    pids: list[int] = []
    seeds: list[str] = []
    health: list[str] = []
    for i in range(1, count + 1):
        port = procs.port()
        node_id = f"{prefix}{i}"
        socket = () if sockets_in is None else ("--unix-socket", f"{sockets_in}/{node_id}.sock")
        pids.append(
            procs.ringlimit(
                node_id,
                "node",
                *("--id", node_id, "--port", str(port), "--fenced"),
                *("--config", str(cfg), *extra),
                *socket,
            )
        )
        seeds += ["--node", f"{node_id}=http://127.0.0.1:{port}"]
        health.append(f"http://127.0.0.1:{port}/healthz")
    return pids, seeds, health


def start_rows(procs: Processes, settings: Settings, workdir: Path) -> dict[str, Row]:
    """Start every deployment the chosen rows need; answer how to load each row."""
    wanted = set(settings.rows)
    starter = _Starter(procs, settings, workdir)
    rows: dict[str, Row] = {}
    if wanted & {"redis", "redis_naive", "slowapi"}:
        starter.start_redis()
    if "direct" in wanted:
        rows["direct"] = starter.direct()
    if "direct_limited" in wanted:
        rows["direct_limited"] = starter.direct_limited()
    if wanted & {"sticky", *PROXY_ROWS, *API_ROWS}:
        rows.update(starter.sticky(wanted))
    for replicas, key in ((2, "sticky_r2"), (3, "sticky_r3")):
        if key in wanted:
            rows[key] = starter.sticky_replicas(key, replicas)
    for key, prefix, pipeline, db in (("redis", "r", "on", 0), ("redis_naive", "q", "off", 2)):
        if key in wanted:
            rows[key] = starter.redis(key, prefix, pipeline, db)
    if "round_robin" in wanted:
        rows["round_robin"] = starter.round_robin()
    if "slowapi" in wanted:
        rows["slowapi"] = starter.slowapi()
    for key, lease in (("hot_off", "off"), ("hot_on", "auto")):
        if key in wanted:
            rows[key] = starter.hot(key, lease)
    for url in starter.ready:
        wait_http(url, procs)
    return {key: rows[key] for key in ROWS if key in rows and key in wanted}


class _Starter:
    """What :func:`start_rows` shares between the rows: the processes, the rules
    file, the one redis-server, and the URLs to wait on once all are started
    (started together, they get ready side by side)."""

    def __init__(self, procs: Processes, settings: Settings, workdir: Path) -> None:
        self.procs = procs
        self.settings = settings
        self.workdir = workdir
        self.cfg = workdir / "cluster.toml"
        self.cfg.write_text(cluster_toml(settings))
        self.ready: list[str] = []
        self.redis_pid = 0
        self.redis_url = ""

    def nodes(
        self, prefix: str, *extra: str, sockets_in: Path | None = None
    ) -> tuple[list[int], list[str]]:
        pids, seeds, health = start_nodes(
            self.procs, prefix, self.settings.nodes, self.cfg, *extra, sockets_in=sockets_in
        )
        self.ready.extend(health)
        return pids, seeds

    def router(self, name: str, seeds: list[str], *extra: str) -> tuple[int, str]:
        port = self.procs.port()
        pid = self.procs.ringlimit(
            name,
            "router",
            *("--port", str(port), "--config", str(self.cfg), "--no-health-checks"),
            *seeds,
            *extra,
        )
        url = f"http://127.0.0.1:{port}"
        self.ready.append(f"{url}/healthz")
        return pid, url

    def start_redis(self) -> None:
        port = self.procs.port()
        self.redis_pid = self.procs.start(
            "redis",
            [
                *("redis-server", "--port", str(port), "--bind", "127.0.0.1"),
                *("--save", "", "--appendonly", "no"),
            ],
        )
        wait_redis(port, self.procs)
        self.redis_url = f"redis://127.0.0.1:{port}"

    def direct(self) -> Row:
        empty = self.workdir / "empty.toml"
        empty.write_text("")
        port = self.procs.port()
        # No rules at all (--config of an empty file; flags add none): the limiter is off.
        pid = self.procs.ringlimit(
            "direct", "node", "--id", "d1", "--port", str(port), "--config", str(empty)
        )
        url = f"http://127.0.0.1:{port}"
        self.ready.append(f"{url}/healthz")
        return Row("direct", f"{url}/load/x", "proxy", {"nodes": [pid]}, "", limited=False)

    def direct_limited(self) -> Row:
        port = self.procs.port()
        # The bench's rules, no ring: the node decides every user itself (X-User-Id).
        pid = self.procs.ringlimit(
            "direct-limited", "node", "--id", "l1", "--port", str(port), "--config", str(self.cfg)
        )
        url = f"http://127.0.0.1:{port}"
        self.ready.append(f"{url}/healthz")
        return Row("direct_limited", f"{url}/load/x", "proxy", {"nodes": [pid]}, f"{url}/tight/x")

    def sticky(self, wanted: set[str]) -> dict[str, Row]:
        """The sticky cluster, the decision API rows through its router, and the
        ``wanted`` rows of :data:`PROXY_ROWS` through routers of their own."""
        # Each node on a Unix socket too: the rows that use them have their own
        # routers, every other one goes over TCP as it always did.
        unix = any(TCP_ONLY not in flags for key, flags in PROXY_ROWS.items() if key in wanted)
        node_pids, seeds = self.nodes("s", sockets_in=self.workdir if unix else None)
        rpid, rurl = self.router(
            "router-sticky",
            seeds,
            *("--coalesce-window", str(self.settings.coalesce_window_us)),
            TCP_ONLY,
        )
        roles = {"router": [rpid], "nodes": node_pids}
        check = f"{rurl}/v1/check"
        rows = {
            "sticky": Row("sticky", f"{rurl}/load/x", "proxy", roles, f"{rurl}/tight/x"),
            "api_single": Row("api_single", check, "single", roles, check),
            "api_batch": Row(
                "api_batch", check, "batch", roles, check, decisions_per_request=BATCH
            ),
        }
        # Other routers over the same nodes (each adopts their ring), a setting apart.
        for key, flags in PROXY_ROWS.items():
            if key in wanted:
                rows[key] = self._second_router(
                    key, "/load/x", "/tight/x", node_pids, seeds, *flags
                )
        if "api_single_nc" in wanted:
            check = "/v1/check"
            rows["api_single_nc"] = self._second_router(
                "api_single_nc", check, check, node_pids, seeds, "--coalesce-window", "0", TCP_ONLY
            )
        return rows

    def _second_router(
        self, key: str, path: str, tight: str, node_pids: list[int], seeds: list[str], *flags: str
    ) -> Row:
        """A row served by another router over the sticky nodes, with ``flags``."""
        pid, url = self.router(f"router-{key}", seeds, *flags)
        mode = "single" if path == "/v1/check" else "proxy"
        return Row(key, url + path, mode, {"router": [pid], "nodes": node_pids}, url + tight)

    def sticky_replicas(self, key: str, replicas: int) -> Row:
        replica_cfg = self.workdir / f"cluster-r{replicas}.toml"
        replica_cfg.write_text(cluster_toml(self.settings, replicas))
        node_pids, seeds = self.nodes(f"p{replicas}-", "--config", str(replica_cfg))
        rpid, rurl = self.router(f"router-r{replicas}", seeds, "--config", str(replica_cfg))
        roles = {"router": [rpid], "nodes": node_pids}
        return Row(key, f"{rurl}/load/x", "proxy", roles, f"{rurl}/tight/x")

    def hot(self, key: str, lease: str) -> Row:
        """A sticky cluster whose ``/hot/*`` rule leases (or not); its ``owner`` role
        is the node that owns the hot user of the measured runs (``whot``)."""
        from ring import RingView

        cfg = self.workdir / f"cluster-{key}.toml"
        cfg.write_text(
            cluster_toml(self.settings)
            + f'\n[[rules]]\nname = "hot"\nrate = "{HOT_RATE}"\npaths = ["/hot/*"]\n'
            + f'lease = "{lease}"\n'
        )
        prefix = "hn" if lease == "auto" else "hf"
        node_pids, seeds = self.nodes(prefix, "--config", str(cfg))
        rpid, rurl = self.router(f"router-{key}", seeds, "--config", str(cfg))
        members = [seed.split("=", 1) for seed in seeds if seed != "--node"]
        view = RingView.from_dict(
            {"epoch": 1, "nodes": [{"id": i, "url": u, "weight": 1} for i, u in members]}
        )
        owner = view.owner_id("whot")
        owner_pid = node_pids[[i for i, _ in members].index(owner)]
        roles = {"router": [rpid], "nodes": node_pids, "owner": [owner_pid]}
        return Row(key, f"{rurl}/hot/x", "proxy", roles, f"{rurl}/tight/x", hot_share=HOT_SHARE)

    def redis(self, key: str, prefix: str, pipeline: str, db: int) -> Row:
        node_pids, seeds = self.nodes(
            prefix,
            *("--backend", "redis", "--redis-url", f"{self.redis_url}/{db}"),
            *("--redis-pipeline", pipeline),
            *("--redis-timeout", str(BENCH_REDIS_TIMEOUT)),
        )
        rpid, rurl = self.router(f"router-{key}", seeds, "--backend", "redis")
        roles = {"router": [rpid], "nodes": node_pids, "redis": [self.redis_pid]}
        return Row(key, f"{rurl}/load/x", "proxy", roles, f"{rurl}/tight/x")

    def round_robin(self) -> Row:
        node_pids, seeds = self.nodes("l", "--balance", "round-robin")
        rpid, rurl = self.router("router-rr", seeds, "--balance", "round-robin")
        return Row(
            "round_robin",
            f"{rurl}/load/x",
            "proxy",
            {"router": [rpid], "nodes": node_pids},
            f"{rurl}/tight/x",
            tight_factor=self.settings.nodes,
        )

    def slowapi(self) -> Row:
        port = self.procs.port()
        pid = self.procs.start(
            "slowapi",
            [
                *(sys.executable, "-m", "uvicorn", "benchmarks.slowapi_app:app"),
                *("--host", "127.0.0.1", "--port", str(port), "--workers", "2"),
                *("--no-access-log", "--log-level", "warning"),
                *_uvicorn_fast_flags(),
            ],
            env={
                "RINGLIMIT_BENCH_REDIS": f"{self.redis_url}/1",
                "RINGLIMIT_BENCH_LOAD_RATE": self.settings.load_rate,
                "RINGLIMIT_BENCH_TIGHT_RATE": f"{self.settings.tight_limit}/hour",
            },
        )
        url = f"http://127.0.0.1:{port}"
        self.ready.append(f"{url}/healthz")
        roles = {"nodes": [pid], "redis": [self.redis_pid]}
        return Row("slowapi", f"{url}/load/x", "proxy", roles, f"{url}/tight/x")


def _uvicorn_fast_flags() -> list[str]:
    flags = []
    with contextlib.suppress(ImportError):
        import uvloop  # noqa: F401

        flags += ["--loop", "uvloop"]
    with contextlib.suppress(ImportError):
        import httptools  # noqa: F401

        flags += ["--http", "httptools"]
    return flags
