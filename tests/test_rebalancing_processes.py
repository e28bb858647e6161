"""Rebalancing with real processes on 127.0.0.1: the issue's acceptance tests.

A router and nodes run as separate processes (``python -m router ...``, the
``ringlimit`` command) started through the ``procs`` fixture, which always
stops them. Nodes start with ``--join`` and no rule flags: the router pushes
its rules and policies.

The rule is ``api=10/minute`` with the sliding log: within one minute no user
may ever be admitted more than 10 times, and each test lasts well under a
minute, so "within one period" holds for the whole test. A fixed population
of 200 users sends paced requests concurrently (each user one request at a
time, until clearly over quota) while the ring changes. For each user we
count 200s (admitted) against 429s (denied); ``excess`` is the sum over users
of admissions beyond 20. Every loop and wait is bounded.

The load generator uses aiohttp rather than httpx: on this 2-CPU machine an
``httpx.AsyncClient`` drove 70-100 requests/s against the cluster and aiohttp
about 780 (the router uses aiohttp to forward for the same reason, see
router/forward.py). httpx is used for the admin calls.

Run: ``pytest -m integration tests/test_rebalancing_processes.py -v -s``
(``-s`` prints the measured figures that docs/rebalancing.md quotes).
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from ring import RingView
from tests.processes import Proc, Procs, free_port, wait_for, wait_healthy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

LIMIT = 10
RULE = ["--rule", f"api={LIMIT}/minute", "--algorithm", "sliding_log"]
USERS = [f"user-{i}" for i in range(200)]
#: Requests per user: LIMIT admitted and a few denied ("clearly over quota").
PER_USER = LIMIT + 4


# --------------------------------------------------------------------------- load


@dataclass
class Sent:
    at: float  # monotonic time the answer arrived
    status: int
    node: str | None
    degraded: bool


@dataclass
class Load:
    """Paced concurrent traffic: every user sends PER_USER requests, one at a time."""

    routers: list[str]
    users: list[str] = field(default_factory=lambda: list(USERS))
    #: The path each user requests (default /api).
    paths: dict[str, str] = field(default_factory=dict)
    per_user: int = PER_USER
    pace: float = 0.2
    log: dict[str, list[Sent]] = field(default_factory=dict)
    done = 0
    errors = 0

    @property
    def total(self) -> int:
        return len(self.users) * self.per_user

    @property
    def progress(self) -> float:
        return self.done / self.total

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=64)
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def user(index: int, name: str) -> None:
                sent = self.log.setdefault(name, [])
                # Spread the users' start over one pace so the load is even.
                await asyncio.sleep(self.pace * index / len(self.users))
                for i in range(self.per_user):
                    router = self.routers[(index + i) % len(self.routers)]
                    try:
                        path = self.paths.get(name, "/api")
                        async with session.get(
                            f"{router}{path}", headers={"X-User-Id": name}
                        ) as response:
                            await response.read()
                            sent.append(
                                Sent(
                                    time.monotonic(),
                                    response.status,
                                    response.headers.get("x-ringlimit-node"),
                                    "x-ringlimit-degraded" in response.headers,
                                )
                            )
                    except (aiohttp.ClientError, TimeoutError):
                        self.errors += 1
                    self.done += 1
                    await asyncio.sleep(self.pace)

            await asyncio.gather(*(user(i, u) for i, u in enumerate(self.users)))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)
        thread.start()
        return thread

    # -- measurements

    def allowed(self, user: str) -> int:
        return sum(1 for s in self.log.get(user, []) if s.status == 200)

    def excess(self) -> int:
        return sum(max(0, self.allowed(u) - LIMIT) for u in self.users)

    def over(self) -> dict[str, int]:
        return {u: n for u in self.users if (n := self.allowed(u)) > LIMIT}

    def statuses(self) -> Counter[int]:
        return Counter(s.status for sent in self.log.values() for s in sent)

    def nodes(self, user: str) -> list[str]:
        """The nodes that answered ``user``, in order, repeats collapsed."""
        seen: list[str] = []
        for s in self.log.get(user, []):
            if s.node and (not seen or seen[-1] != s.node):
                seen.append(s.node)
        return seen


def finish(thread: threading.Thread, load: Load, timeout: float = 40.0) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"load did not finish in {timeout}s ({load.progress:.0%})"


# --------------------------------------------------------------------------- cluster


def admin_ring(router: str) -> dict[str, Any]:
    response = httpx.get(f"{router}/admin/ring", timeout=5.0)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def view_of(ring: dict[str, Any]) -> RingView:
    nodes = [{k: n[k] for k in ("id", "url", "weight")} for n in ring["nodes"]]
    return RingView.from_dict({"epoch": ring["epoch"], "nodes": nodes})


def ring_ids(router: str, *, active: bool = True) -> list[str]:
    """Ids in the router's ring: active members only, or any state (joining, leaving)."""
    try:
        ring = admin_ring(router)
    except httpx.HTTPError:
        return []
    return [n["id"] for n in ring["nodes"] if not active or n["state"] == "active"]


def gone(router: str, node_id: str) -> bool:
    """The node is out of the ring altogether (not merely leaving)."""
    try:
        return node_id not in [n["id"] for n in admin_ring(router)["nodes"]]
    except httpx.HTTPError:
        return False


@dataclass
class Cluster:
    router: str
    router_proc: Proc
    nodes: dict[str, Proc]
    urls: dict[str, str]


def start_cluster(
    procs: Procs,
    router_flags: list[str],
    *,
    join: tuple[str, ...] = ("n1", "n2", "n3"),
    spare: tuple[str, ...] = (),
    port: int | None = None,
) -> Cluster:
    """A router, nodes that join it (``--join``, no rule flags) and spare nodes
    (``--fenced``, not joined), all started at once; returns when the joining
    nodes are in the ring and the spares answer."""
    t0 = time.monotonic()
    port = port or free_port()
    router = f"http://127.0.0.1:{port}"
    router_proc = procs.start("router", ["router", "--port", str(port), *router_flags])
    started: dict[str, tuple[Proc, str]] = {}
    for node_id in (*join, *spare):
        node_port = free_port()
        flags = ["--join", router] if node_id in join else ["--fenced"]
        argv = ["node", "--id", node_id, "--port", str(node_port), *flags]
        started[node_id] = (procs.start(node_id, argv), f"http://127.0.0.1:{node_port}")
    wait_healthy(router, router_proc, require_ok=False)
    t1 = time.monotonic()
    for proc, url in started.values():
        wait_healthy(url, proc)
    t2 = time.monotonic()
    assert wait_for(lambda: set(join) <= set(ring_ids(router)), timeout=20.0), ring_ids(router)
    report(
        "startup",
        router_s=round(t1 - t0, 2),
        nodes_s=round(t2 - t0, 2),
        ring_s=round(time.monotonic() - t0, 2),
    )
    return Cluster(
        router,
        router_proc,
        {node_id: proc for node_id, (proc, _) in started.items()},
        {node_id: url for node_id, (_, url) in started.items()},
    )


def kill_all(procs: Procs) -> None:
    """Fast teardown (the fixture still stops anything left on failure)."""
    for proc in procs.started:
        proc.kill9()


def add_node(router: str, node_id: str, url: str) -> float:
    """``ringlimit nodes add``: join through the admin API; returns how long it took."""
    started = time.monotonic()
    response = httpx.post(f"{router}/admin/nodes", json={"id": node_id, "url": url}, timeout=30.0)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def report(title: str, **figures: object) -> None:
    print(f"\n[{title}] " + " ".join(f"{k}={v}" for k, v in figures.items()))


# --------------------------------------------------------------------------- join + leave


@dataclass
class JoinLeave:
    load: Load
    v1: RingView
    v2: RingView
    v3: RingView
    routers: list[str]

    @property
    def joined(self) -> list[str]:
        return [u for u in USERS if self.v1.owner_id(u) != self.v2.owner_id(u)]

    @property
    def left(self) -> list[str]:
        return [u for u in USERS if self.v2.owner_id(u) != self.v3.owner_id(u)]


def join_then_leave(procs: Procs, policy: str, *, second_router: bool = False) -> JoinLeave:
    """Traffic; n4 joins at 30% of it, n2 leaves gracefully (SIGTERM) at 55%.

    n4's process is started (fenced) beforehand and joins through the admin
    API, so the join happens under load rather than waiting on a process
    start. With ``second_router`` a second router, seeded with the first three
    nodes and never told of either change, takes every other request.
    """
    cluster = start_cluster(procs, [*RULE, "--rebalance-policy", policy], spare=("n4",))
    router = cluster.router
    v1 = view_of(admin_ring(router))
    routers = [router]
    if second_router:
        seeds = [arg for m in v1 for arg in ("--node", f"{m.id}={m.url}")]
        # Its own health checks are slowed down: it learns only from the nodes.
        _, second = procs.router(None, *RULE, *seeds, "--health-interval", "30")
        assert view_of(admin_ring(second)) == v1
        routers.append(second)
    load = Load(routers)
    started = time.monotonic()
    thread = load.start()
    assert wait_for(lambda: load.progress >= 0.3, timeout=20.0)
    join_took = add_node(router, "n4", cluster.urls["n4"])
    v2 = view_of(admin_ring(router))
    assert wait_for(lambda: load.progress >= 0.55, timeout=20.0)
    leave_started = time.monotonic()
    n2 = cluster.nodes["n2"]
    n2.popen.send_signal(signal.SIGTERM)  # graceful leave, then exit
    assert wait_for(lambda: gone(router, "n2"), timeout=10.0, interval=0.01)
    leave_took = time.monotonic() - leave_started
    v3 = view_of(admin_ring(router))
    finish(thread, load)
    elapsed = time.monotonic() - started
    assert wait_for(lambda: not n2.alive(), timeout=10.0)
    report(
        f"join+leave {policy}{' 2 routers' if second_router else ''}",
        join_s=round(join_took, 3),
        leave_s=round(leave_took, 3),
        load_s=round(elapsed, 2),
        n2_exit=n2.popen.returncode,
    )
    assert elapsed < 60.0, "the whole scenario must fit in one period"
    assert n2.popen.returncode == 0
    return JoinLeave(load, v1, v2, v3, routers)


def test_join_then_graceful_leave_under_load_admits_nobody_twice(procs: Procs) -> None:
    run = join_then_leave(procs, "handoff")
    load = run.load
    assert [m.id for m in run.v2] == ["n1", "n2", "n3", "n4"]
    assert [m.id for m in run.v3] == ["n1", "n3", "n4"]
    assert run.v3.epoch == run.v2.epoch + 1 == run.v1.epoch + 2
    joined, left = run.joined, run.left
    assert joined and left
    statuses = load.statuses()
    report(
        "join+leave handoff",
        users=len(USERS),
        requests=load.total,
        moved_on_join=len(joined),
        moved_on_leave=len(left),
        excess=load.excess(),
        statuses=dict(statuses),
        errors=load.errors,
    )
    kill_all(procs)
    # Every moved user really changed node: answered by its old owner, then its new one.
    for user in joined:
        assert load.nodes(user) == [run.v1.owner_id(user), "n4"], (user, load.nodes(user))
    for user in left:
        assert load.nodes(user) == ["n2", run.v3.owner_id(user)], (user, load.nodes(user))
    assert load.errors == 0
    assert set(statuses) <= {200, 429}, statuses
    assert load.excess() == 0, load.over()
    # And no false denials: everyone got exactly the limit.
    assert all(load.allowed(u) == LIMIT for u in USERS)


def test_join_then_leave_with_reset_policy_over_admits(procs: Procs) -> None:
    """The same measurement with handoff switched off: it must see the excess."""
    run = join_then_leave(procs, "reset")
    load = run.load
    moved = set(run.joined) | set(run.left)
    report(
        "join+leave reset",
        moved=len(moved),
        excess=load.excess(),
        users_over=len(load.over()),
        max_allowed=max(load.allowed(u) for u in USERS),
        statuses=dict(load.statuses()),
    )
    kill_all(procs)
    assert load.excess() > 0
    assert set(load.over()) <= moved


def test_a_stale_router_never_double_counts(procs: Procs) -> None:
    """Two routers share the nodes (each user alternates between them); the
    second is never told of the join or the leave."""
    run = join_then_leave(procs, "handoff", second_router=True)
    load = run.load
    first, second = run.routers
    final = admin_ring(first)["epoch"]
    caught_up = admin_ring(second)["epoch"]
    statuses = load.statuses()
    degraded = sum(1 for sent in load.log.values() for s in sent if s.degraded)
    report(
        "stale router",
        excess=load.excess(),
        statuses=dict(statuses),
        degraded=degraded,
        first_router_epoch=final,
        second_router_epoch=caught_up,
    )
    kill_all(procs)
    assert load.errors == 0
    assert load.excess() == 0, load.over()
    assert degraded == 0
    assert set(statuses) <= {200, 429}, statuses
    # The second router caught up from the nodes' refusals.
    assert caught_up == final


# --------------------------------------------------------------------------- kill -9

CRASH_CONFIG = f"""
[policies]
crash = "reset"
replication_interval = {{replication}}

[[rules]]
name = "replicated"
rate = "{LIMIT}/minute"
algorithm = "sliding_log"
on_error = "closed"
crash_policy = "replica"
paths = ["/replica/*"]

[[rules]]
name = "conservative"
rate = "{LIMIT}/minute"
algorithm = "sliding_log"
on_error = "closed"
crash_policy = "conservative"
paths = ["/conservative/*"]
"""


def test_kill_9_under_load(procs: Procs, tmp_path: Path) -> None:
    """One node is killed under load. Half the users are limited by a rule with
    the replica crash policy, half by one with the conservative policy (crash
    policies are per rule), so one kill measures both."""
    interval, threshold, probe_timeout, replication = 0.2, 3, 0.2, 0.1
    config = tmp_path / "cluster.toml"
    config.write_text(CRASH_CONFIG.format(replication=replication))
    cluster = start_cluster(
        procs,
        [
            "--config",
            str(config),
            "--health-interval",
            str(interval),
            "--failure-threshold",
            str(threshold),
            "--health-timeout",
            str(probe_timeout),
        ],
    )
    router = cluster.router
    v1 = view_of(admin_ring(router))
    policy = {u: ("replica" if i % 2 == 0 else "conservative") for i, u in enumerate(USERS)}
    load = Load([router], paths={u: f"/{p}/api" for u, p in policy.items()})
    thread = load.start()
    assert wait_for(lambda: load.progress >= 0.4, timeout=20.0)
    cluster.nodes["n2"].kill9()
    killed = time.monotonic()
    assert wait_for(lambda: gone(router, "n2"), timeout=10.0, interval=0.01)
    detected = time.monotonic() - killed
    finish(thread, load)
    kill_all(procs)

    # Detection: `threshold` failed probes, one per interval (a killed process
    # refuses connections at once; a hung one costs up to the probe timeout),
    # then one push; plus 1 s of scheduling slack on a loaded test machine.
    bound = threshold * (interval + probe_timeout) + 1.0
    affected = [u for u in USERS if v1.owner_id(u) == "n2"]
    replica_users = [u for u in affected if policy[u] == "replica"]
    conservative_users = [u for u in affected if policy[u] == "conservative"]
    # Replica bound: what n2 admitted for the key in its last replication
    # interval, plus the time the round takes to land (here: 2 intervals).
    window = 2 * replication
    recent = {
        u: sum(
            1
            for s in load.log[u]
            if s.node == "n2" and s.status == 200 and killed - window <= s.at <= killed + 0.05
        )
        for u in replica_users
    }

    def excess(users: list[str]) -> int:
        return sum(max(0, load.allowed(u) - LIMIT) for u in users)

    def false_denials(users: list[str]) -> int:
        count = 0
        for u in users:
            admitted = 0
            for s in load.log[u]:
                if s.status == 200:
                    admitted += 1
                elif s.status == 429 and admitted < LIMIT:
                    count += 1
        return count

    statuses = load.statuses()
    report(
        "kill -9",
        detection_s=round(detected, 3),
        detection_bound_s=round(bound, 3),
        affected_users=len(affected),
        replica_excess=excess(replica_users),
        replica_bound=sum(recent.values()),
        conservative_excess=excess(conservative_users),
        conservative_false_denials=false_denials(conservative_users),
        replica_false_denials=false_denials(replica_users),
        unavailable_503=statuses.get(503, 0),
        statuses=dict(statuses),
    )
    assert detected <= bound, f"detection took {detected:.2f}s (bound {bound:.2f}s)"
    assert load.errors == 0
    assert set(statuses) <= {200, 429, 503}, statuses
    assert set(load.over()) <= set(replica_users)
    for user in replica_users:
        assert load.allowed(user) - LIMIT <= recent[user], (user, load.log[user])
    assert excess(conservative_users) == 0


# --------------------------------------------------------------------------- router restart


def test_router_restart_keeps_ring_and_counters(procs: Procs, tmp_path: Path) -> None:
    """kill -9 the router twice: it comes back from its state file, then (state
    file gone) by re-discovery from one seed node. No counter moves."""
    state = str(tmp_path / "ring.json")
    port = free_port()
    cluster = start_cluster(procs, [*RULE, "--state-file", state], port=port)
    router = cluster.router
    before = admin_ring(router)
    loads = [Load([router], per_user=3, pace=0.01)]
    finish(loads[-1].start(), loads[-1])

    cluster.router_proc.kill9()
    started = time.monotonic()
    _, router = procs.router(port, *RULE, "--state-file", state, healthy=True)
    from_file = time.monotonic() - started
    assert admin_ring(router) == before
    loads.append(Load([router], per_user=3, pace=0.01))
    finish(loads[-1].start(), loads[-1])

    procs.started[-1].kill9()
    Path(state).unlink()
    seed = next(n for n in before["nodes"] if n["id"] == "n1")
    started = time.monotonic()
    _, router = procs.router(port, *RULE, "--node", f"n1={seed['url']}", healthy=True)
    rediscovered = time.monotonic() - started
    assert admin_ring(router) == before
    loads.append(Load([router], per_user=LIMIT, pace=0.01))
    finish(loads[-1].start(), loads[-1])
    kill_all(procs)
    allowed = [sum(load.allowed(u) for u in USERS) for load in loads]
    report(
        "router restart",
        epoch=before["epoch"],
        allowed_per_phase=allowed,
        restart_from_state_file_s=round(from_file, 2),
        restart_by_rediscovery_s=round(rediscovered, 2),
        errors=sum(load.errors for load in loads),
    )
    assert all(load.errors == 0 for load in loads)
    assert allowed[:2] == [3 * len(USERS), 3 * len(USERS)]
    # Every counter survived both restarts: exactly what is left of each quota.
    assert all(loads[2].allowed(u) == LIMIT - 6 for u in USERS)
    assert all(load.statuses().keys() <= {200, 429} for load in loads)
