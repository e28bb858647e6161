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

The load generator and the cluster helpers live in tests/real_cluster.py.

Run: ``pytest -m integration tests/test_rebalancing_processes.py -v -s``
(``-s`` prints the measured figures that docs/rebalancing.md quotes).
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from node.lease import DEFAULT_DRIFT
from ring import RingView
from tests.processes import Procs, free_port, wait_for
from tests.real_cluster import (
    LIMIT,
    USERS,
    Load,
    add_node,
    admin_ring,
    finish,
    gone,
    kill_all,
    report,
    start_cluster,
    view_of,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

RULE = ["--rule", f"api={LIMIT}/minute", "--algorithm", "sliding_log"]


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
    # and the end of the lease granted with the last probe n2 answered (by
    # default the detection time, plus 1% drift: router/removal.py), then one
    # push; plus 1 s of scheduling slack on a loaded test machine.
    detection = threshold * (interval + probe_timeout)
    bound = detection + detection * (1 + DEFAULT_DRIFT) + 1.0
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
    # The membership events are the process's own history, not the ring's.
    before = admin_ring(router)
    del before["events"]
    loads = [Load([router], per_user=3, pace=0.01)]
    finish(loads[-1].start(), loads[-1])

    cluster.router_proc.kill9()
    started = time.monotonic()
    _, router = procs.router(port, *RULE, "--state-file", state, healthy=True)
    from_file = time.monotonic() - started
    assert {k: v for k, v in admin_ring(router).items() if k != "events"} == before
    loads.append(Load([router], per_user=3, pace=0.01))
    finish(loads[-1].start(), loads[-1])

    procs.started[-1].kill9()
    Path(state).unlink()
    seed = next(n for n in before["nodes"] if n["id"] == "n1")
    started = time.monotonic()
    _, router = procs.router(port, *RULE, "--node", f"n1={seed['url']}", healthy=True)
    rediscovered = time.monotonic() - started
    assert {k: v for k, v in admin_ring(router).items() if k != "events"} == before
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
