"""Reliability, in process: leases, the removal budget, joins that cannot block
crash removal, returning members and replicas on several successors.

Like tests/test_rebalancing.py (whose helpers these tests share), everything
runs in one event loop on frozen clocks: the states' clock and, for leases,
the nodes' monotonic clock, which the tests advance past a lease by hand.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from node.clock import FrozenClock
from node.config import ClusterConfig, Policies, ScopedRule
from node.rules import Rule
from ring import Member
from router.membership import MembershipError
from router.testing import InProcessCluster, node_url
from tests.test_rebalancing import (
    LIMIT,
    PERIOD,
    USERS,
    Tally,
    exhaust,
    exhaust_and_replicate,
    make_config,
    send,
)

pytestmark = [pytest.mark.anyio, pytest.mark.reliability]


async def leased(cluster: InProcessCluster) -> FrozenClock:
    """Turn leases on as a router with health checks does, on a frozen monotonic clock."""
    monotonic = FrozenClock(0.0)
    for node in cluster.nodes.values():
        assert node.shard is not None
        node.shard.monotonic = monotonic
    membership = cluster.router.membership
    membership.leasing = True
    await membership.push_config(membership.config)
    await membership.check_health()
    return monotonic


# --------------------------------------------------------------------------- leases


async def test_a_node_whose_lease_ran_out_decides_nothing() -> None:
    config = make_config(on_error="closed")
    options = {"health_interval": 1.0, "health_timeout": 0.5, "failure_threshold": 3}
    async with InProcessCluster(3, config, clock=FrozenClock(), router_options=options) as cluster:
        monotonic = await leased(cluster)
        lease = cluster.router.membership.lease_seconds
        assert lease == pytest.approx(4.5)
        tally = Tally()
        await send(cluster.client, tally, USERS, 3)
        assert sum(tally.allowed.values()) == 3 * len(USERS) and tally.other == Counter()
        stored = {n: len(node.store) for n, node in cluster.nodes.items()}
        # The router that renews the leases stops (another router, or this one
        # with leasing switched off: it grants none on demand either): past the
        # lease the nodes refuse, and the closed rule answers 503, deciding nothing.
        cluster.router.membership.leasing = False
        monotonic.advance(lease + 0.01)
        during = Tally()
        await send(cluster.client, during, USERS, 1)
        assert during.other == Counter({503: len(USERS)})
        refused = sum(
            node.metrics.errors.labels("lease_expired")._value.get()
            for node in cluster.nodes.values()
        )
        assert refused == len(USERS)  # counted on the proxy path too
        assert {n: len(node.store) for n, node in cluster.nodes.items()} == stored
        response = await cluster.client.post("/v1/check", json={"key": USERS[0], "rule": "api"})
        assert response.status_code == 503
        assert response.json()["reason"] == "owner_unreachable"
        # One probe round renews every lease (a lapsed one is granted at once).
        cluster.router.membership.leasing = True
        await cluster.router.membership.check_health()
        await send(cluster.client, tally, USERS, 1)
        assert sum(tally.allowed.values()) == 4 * len(USERS)
        assert cluster.router.membership.stats["lease_renewals"] >= 6


@pytest.mark.parametrize("path", ["proxy", "decision API"])
async def test_a_renewing_router_back_from_a_pause_renews_a_lapsed_lease_on_demand(
    path: str,
) -> None:
    """The router that renews the leases was paused past them: its members are
    healthy, but each request queued meanwhile was answered by its rules'
    on_error until the next probe round, an open rule's admitted uncounted
    (an exploratory tester, with real processes: exhausted users admitted again
    after a 2-3 s SIGSTOP of the router). The refusal now makes the router renew
    that member's lease at once (one renewal for concurrent requests) and send
    the request again: decided and counted, no over-admission."""
    options = {"health_interval": 1.0, "health_timeout": 0.5, "failure_threshold": 3}
    async with InProcessCluster(3, make_config(), clock=FrozenClock(), router_options=options) as (
        cluster
    ):
        monotonic = await leased(cluster)
        membership = cluster.router.membership
        await exhaust(cluster)  # every user's whole quota (an open rule)
        renewals = membership.stats["lease_renewals"]
        monotonic.advance(membership.lease_seconds + 0.01)  # the pause: every lease lapsed
        if path == "proxy":
            after = Tally()
            await send(cluster.client, after, USERS, 1)
            assert after.other == Counter() and sum(after.allowed.values()) == 0, after.over()
            assert sum(after.denied.values()) == len(USERS)
        else:
            checks = [{"key": user, "rule": "api"} for user in USERS]
            answer = await cluster.client.post("/v1/check", json={"checks": checks})
            results = answer.json()["results"]
            assert [r["allowed"] for r in results] == [False] * len(USERS), results
            assert all("reason" not in r for r in results), results
        refused = sum(
            node.metrics.errors.labels("lease_expired")._value.get()
            for node in cluster.nodes.values()
        )
        assert 1 <= refused <= len(USERS)
        # One renewal per member, however many requests its refusals sent back.
        assert membership.stats["lease_renewals"] - renewals == len(cluster.nodes)


async def test_no_lease_is_renewed_on_demand_for_a_member_being_removed() -> None:
    """A member decided for removal (in ``removing``; condemned only once its task
    runs) gets no lease from a request's on-demand renewal: the removal waits out
    the leases granted so far, and a grant after that plan would outlast it (a
    review). The request is answered by the rule's on_error (open: admitted,
    uncounted), as before on-demand renewals."""
    options = {"health_interval": 1.0, "health_timeout": 0.5, "failure_threshold": 3}
    async with InProcessCluster(3, make_config(), clock=FrozenClock(), router_options=options) as (
        cluster
    ):
        monotonic = await leased(cluster)
        membership = cluster.router.membership
        await exhaust(cluster)
        user = USERS[0]
        victim = cluster.owner(user)
        held = asyncio.get_running_loop().create_future()  # its removal's task, not run yet
        membership.monitor.removing[victim] = held  # type: ignore[assignment]
        try:
            renewals = membership.stats["lease_renewals"]
            monotonic.advance(membership.lease_seconds + 0.01)
            answer = await cluster.client.get("/api", headers={"X-User-Id": user})
            assert answer.status_code == 200, answer.text  # on_error (open), not a 429
            assert answer.headers["x-ringlimit-degraded"] == "owner-unreachable"
            assert membership.stats["lease_renewals"] == renewals
        finally:
            membership.monitor.removing.pop(victim, None)
            held.cancel()


async def test_on_demand_renewals_of_one_member_are_started_at_most_once_per_interval() -> None:
    """A member whose lease keeps lapsing (a renewal that did not hold: its clock
    jumped, or it lost the grant again) gets at most one on-demand renewal per
    ``every`` seconds: a flood of its refusals is answered by on_error meanwhile,
    not by a renewal each (a round trip per request to a member in trouble)."""
    options = {"health_interval": 1.0, "health_timeout": 0.5, "failure_threshold": 3}
    async with InProcessCluster(3, make_config(), clock=FrozenClock(), router_options=options) as (
        cluster
    ):
        monotonic = await leased(cluster)
        membership = cluster.router.membership
        member = membership.view.member("n1")
        renewals = membership.stats["lease_renewals"]
        monotonic.advance(membership.lease_seconds + 0.01)  # lapsed
        assert await membership.renew_lapsed(member, every=3600.0)
        assert membership.stats["lease_renewals"] == renewals + 1
        monotonic.advance(membership.lease_seconds + 0.01)  # lapsed again at once
        assert not await membership.renew_lapsed(member, every=3600.0)  # throttled
        assert membership.stats["lease_renewals"] == renewals + 1
        # Another member is not held back by n1's renewal...
        assert await membership.renew_lapsed(membership.view.member("n2"), every=3600.0)
        assert membership.stats["lease_renewals"] == renewals + 2
        # ... and once the interval is over (here: none), n1 is renewed again.
        assert await membership.renew_lapsed(member, every=0.0)
        assert membership.stats["lease_renewals"] == renewals + 3
        # What a member's renewals were remembered by goes when it leaves the ring
        # (kept, one entry per member id ever renewed, for as long as the router ran).
        await cluster.remove_node("n2")
        assert "n2" not in membership._renewed_at and "n2" not in membership._renewing
        assert "n1" in membership._renewed_at


async def test_a_leased_node_failing_probes_is_removed_only_after_its_lease() -> None:
    options = {"health_interval": 1.0, "health_timeout": 0.5, "failure_threshold": 1}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        await leased(cluster)
        membership = cluster.router.membership
        cluster.take_down("n2")
        await membership.check_health()
        # Due (one failure), but its lease may still run: deferred, not removed.
        assert "n2" in membership.view
        assert membership.stats["deferred_lease"] == 1
        # Time passes beyond the lease of the last offer n2 made (loop time cannot be
        # advanced by hand: the offer is moved back instead).
        health = membership.health["n2"]
        health.offered_at -= 2 * membership.lease_seconds
        health.lease_until = health.offered_at
        await membership.check_health()
        assert "n2" not in membership.view
        assert membership.stats["removed_crashed"] == 1


async def test_a_partition_with_two_routers_decides_no_key_twice_under_leases() -> None:
    """The case docs/rebalancing.md bounds by one quota per key without leases
    (tests/test_rebalancing.py measures it): a second router still reaches a node
    the first one removed. With leases the node stopped deciding before the first
    router removed it, so the second router finds it refusing, learns the newer
    view from the other members, and nobody is admitted twice."""
    # A long lease: it must outlast the traffic below in real time, until the
    # test moves the clocks past it.
    options = {"failure_threshold": 1, "lease": 60.0}
    async with InProcessCluster(
        3, make_config(crash="replica"), clock=FrozenClock(), router_options=options
    ) as cluster:
        for node in cluster.nodes.values():
            node.store.dirty = set()
        seeds = [Member(n, node_url(n)) for n in cluster.nodes]
        other_side = cluster.detached_client()
        second = cluster.new_router("http://router2.localhost", client=other_side, seeds=seeds)
        await second.start()
        try:
            monotonic = await leased(cluster)
            tally = Tally()
            await send(cluster.client, tally, USERS, LIMIT // 2)
            for node in cluster.nodes.values():
                assert node.shard is not None
                await node.shard.replicate_once()
            membership = cluster.router.membership
            # {router, n1, n3} | {router2, n2}: n2 hears from no router granting leases.
            cluster.take_down("n2")
            await membership.check_health()
            assert "n2" in membership.view  # its lease may still run
            monotonic.advance(membership.lease_seconds + 0.01)
            health = membership.health["n2"]
            health.offered_at -= 2 * membership.lease_seconds
            health.lease_until = health.offered_at
            await membership.check_health()
            assert "n2" not in membership.view
            await asyncio.gather(
                send(cluster.client, tally, USERS, LIMIT),
                send(cluster.client, tally, USERS, LIMIT, base="http://router2.localhost"),
            )
            assert tally.other == Counter()
            assert tally.excess() == 0, tally.over()
            assert second.membership.view == membership.view
        finally:
            await second.close()
            await other_side.aclose()


# --------------------------------------------------------------------------- removal budget


async def test_a_router_that_reaches_no_node_keeps_the_ring_and_every_counter() -> None:
    """A cluster-wide blip (every probe fails at once): no removal, no lost counter."""
    options = {"failure_threshold": 1}
    config = make_config(on_error="closed")
    async with InProcessCluster(3, config, clock=FrozenClock(), router_options=options) as cluster:
        tally = await exhaust_and_replicate(cluster)
        membership = cluster.router.membership
        epoch = membership.view.epoch
        for node_id in cluster.nodes:
            cluster.take_down(node_id)
        for _ in range(5):
            await membership.check_health()
        assert membership.view.epoch == epoch and len(membership.view) == 3
        assert membership.suspect_self and membership.stats["self_suspected"] == 1
        assert membership.stats["deferred_quorum"] == 15
        metrics = (await cluster.client.get("/metrics")).text
        assert "ringlimit_router_suspect_self 1.0" in metrics
        assert 'ringlimit_router_membership_total{kind="deferred_quorum"} 15.0' in metrics
        for node_id in cluster.nodes:
            cluster.bring_back(node_id)
        await membership.check_health()
        assert not membership.suspect_self
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()


async def test_crash_removals_are_one_per_interval() -> None:
    options = {"failure_threshold": 1, "removal_interval": 3600.0}
    async with InProcessCluster(
        5, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        membership = cluster.router.membership
        cluster.take_down("n1")
        cluster.take_down("n2")
        await membership.check_health()
        await membership.check_health()
        assert [m for m in ("n1", "n2") if m not in membership.view] == ["n1"]
        assert membership.stats["deferred_rate"] >= 2


# --------------------------------------------------------------------------- joins


async def test_a_join_that_cannot_become_ready_never_delays_a_crash_removal() -> None:
    options = {"failure_threshold": 1, "ready_timeout": 30.0}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        membership = cluster.router.membership
        loop = asyncio.get_running_loop()
        joins = [
            asyncio.create_task(
                cluster.client.post("/admin/nodes", json={"id": f"x{i}", "url": f"http://x{i}.bad"})
            )
            for i in range(3)
        ]
        await asyncio.sleep(0.05)
        assert len(membership.joining) == 3
        cluster.take_down("n2")
        started = loop.time()
        await asyncio.wait_for(membership.check_health(), timeout=5.0)
        assert "n2" not in membership.view
        assert loop.time() - started < 1.0
        for join in joins:
            join.cancel()
        await asyncio.gather(*joins, return_exceptions=True)


async def test_a_join_that_never_becomes_ready_fails_on_its_own() -> None:
    options = {"ready_timeout": 0.3}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        epoch = cluster.router.membership.view.epoch
        response = await cluster.client.post(
            "/admin/nodes", json={"id": "x1", "url": "http://x1.bad"}
        )
        assert response.status_code == 504
        assert response.json()["error"] == "not_ready"
        assert cluster.router.membership.view.epoch == epoch
        assert cluster.router.membership.joining == {}


@pytest.mark.parametrize(
    ("url", "answer", "up_front"),
    [
        (node_url("n2"), "node 'n2'", "url_in_use"),
        ("http://router.localhost", "not a node", "url_is_router"),
    ],
)
async def test_a_join_at_a_url_that_answers_as_someone_else_is_refused(
    url: str, answer: str, up_front: str
) -> None:
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        epoch = cluster.router.membership.view.epoch
        # The admin API refuses a URL it knows is taken before any round trip ...
        response = await cluster.client.post("/admin/nodes", json={"id": "n9", "url": url})
        assert response.status_code == 409
        assert response.json()["error"] == up_front
        # ... and readiness refuses whatever answers as someone else.
        with pytest.raises(MembershipError) as refused:
            await cluster.router.membership.join(Member("n9", url))
        assert refused.value.status == 409 and refused.value.error == "wrong_node"
        assert answer in refused.value.detail
        assert cluster.router.membership.view.epoch == epoch


async def test_a_join_at_a_web_server_is_refused_at_once_or_says_what_it_answered() -> None:
    """A URL whose server answers /healthz 404 is no node starting (a node answers
    200 from its start): refused at once as wrong_node. It was waited on for the
    whole readiness timeout, then said not to answer (an exploratory tester). A
    5xx may be a proxy ahead of a node still starting: waited on, and named."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def busy(request: object) -> PlainTextResponse:
        return PlainTextResponse("upstream starting", status_code=503)

    options = {"ready_timeout": 0.5}
    async with InProcessCluster(
        2, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        cluster._mounts["http://www.localhost"] = httpx.ASGITransport(app=Starlette())
        proxy = Starlette(routes=[Route("/healthz", busy)])
        cluster._mounts["http://proxy.localhost"] = httpx.ASGITransport(app=proxy)
        epoch = cluster.router.membership.view.epoch
        loop = asyncio.get_running_loop()
        started = loop.time()
        web = await cluster.client.post(
            "/admin/nodes", json={"id": "w1", "url": "http://www.localhost"}
        )
        assert loop.time() - started < 0.4, "waited for the readiness timeout"
        assert web.status_code == 409 and web.json()["error"] == "wrong_node", web.text
        assert "answers /healthz with HTTP 404: not a ringlimit node" in web.json()["detail"]
        waited = await cluster.client.post(
            "/admin/nodes", json={"id": "p1", "url": "http://proxy.localhost"}
        )
        assert waited.status_code == 504 and waited.json()["error"] == "not_ready"
        assert waited.json()["detail"].endswith("(its last answer: HTTP 503)"), waited.text
        assert cluster.router.membership.view.epoch == epoch
        assert cluster.router.membership.joining == {}


@pytest.mark.parametrize(
    ("balance", "sticky", "said"),
    [
        ("round-robin", True, "start the node with --backend redis"),
        ("sticky", False, "owns no keys"),
    ],
    ids=["round-robin-router", "sticky-router"],
)
async def test_a_router_refuses_a_node_of_another_backend(
    balance: str, sticky: bool, said: str
) -> None:
    """A router started with --backend redis (round-robin) and nodes without it
    (each limiting on its own, refusing keys it does not own): requests were
    refused 421 and retried, and one in 256 ran out of attempts as 503
    ring_changing on a steady ring, nothing logged (an exploratory tester). The
    other way round, a sticky router took a node started with --backend redis
    (no shard): its handoffs were refused (409) and its users' counts lost when
    it left, 102 admitted over the limit (a day's-end tester). Such a join is
    refused now, naming the fix; a node of the router's kind joins."""
    config = make_config().with_(balance=balance)
    async with InProcessCluster(
        2, config, clock=FrozenClock(), node_options={"sticky": not sticky}
    ) as cluster:
        cluster._make_node("x1", sticky=sticky)
        refused = await cluster.client.post(
            "/admin/nodes", json={"id": "x1", "url": node_url("x1")}
        )
        assert refused.status_code == 409 and refused.json()["error"] == "wrong_backend"
        assert said in refused.json()["detail"]
        assert "x1" not in cluster.router.membership.view
        cluster._make_node("x2", sticky=not sticky)
        joined = await cluster.client.post("/admin/nodes", json={"id": "x2", "url": node_url("x2")})
        assert joined.status_code == 200, joined.text
        assert "x2" in cluster.router.membership.view


def test_which_nodes_a_router_refuses_follows_its_backend_and_balance() -> None:
    """Only a router that routes by owner with in-memory state refuses a node
    that owns no keys: one of a Redis cluster routing by owner (a file's
    backend = "redis" with balance = "sticky") takes its nodes, which own none
    (the review: every node of such a cluster was refused). A round-robin router
    refuses one that owns its keys. A node that does not say is refused by none."""
    from router.nodeclient import _not_for

    member = Member("n9", node_url("n9"))
    for health, round_robin, owner_routed, refused in [
        ({"sticky": False}, False, True, True),  # memory, sticky: a Redis node
        ({"sticky": False}, False, False, False),  # redis, sticky: its own nodes
        ({"sticky": True}, True, False, True),  # round-robin: a sticky node
        ({"sticky": False}, True, False, False),
        ({}, True, False, False),  # an earlier version's node
        ({}, False, True, False),
    ]:
        error = _not_for(member, health, round_robin, owner_routed, None)
        assert (error is not None) == refused, (health, round_robin, owner_routed)


async def test_the_same_registration_twice_at_once_is_one_join() -> None:
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        cluster._make_node("n4")
        member = Member("n4", node_url("n4"))
        membership = cluster.router.membership
        views = await asyncio.gather(membership.join(member), membership.join(member))
        assert views[0] == views[1] == membership.view
        assert "n4" in membership.view and membership.view.epoch == 2


class Paused(httpx.AsyncBaseTransport):
    """A node paused (SIGSTOP) after it was reached: a view push it receives is
    answered only once it resumes; its probes time out, unless ``answers_probes``
    (a newcomer that passed its readiness check just before the pause)."""

    def __init__(self, real: httpx.AsyncBaseTransport, *, answers_probes: bool = False) -> None:
        self.real = real
        self.answers_probes = answers_probes
        self.pushed = asyncio.Event()
        self._resumed = asyncio.Event()

    def resume(self) -> None:
        self._resumed.set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "PUT" and request.url.path == "/internal/cluster":
            self.pushed.set()
            await self._resumed.wait()
        elif not self.answers_probes and not self._resumed.is_set():
            raise httpx.ReadTimeout("node is paused", request=request)
        return await self.real.handle_async_request(request)


def pause(cluster: InProcessCluster, node_id: str, *, answers_probes: bool = False) -> Paused:
    paused = Paused(cluster._mounts[node_url(node_id)], answers_probes=answers_probes)
    cluster._mounts[node_url(node_id)] = paused
    return paused


async def test_a_change_under_way_never_stops_renewals_nor_delays_a_crash_removal() -> None:
    """A join's pushes hold the membership lock: the health loop keeps renewing
    every lease meanwhile (else the whole cluster's leases lapse), and a crash
    removal it decides does not wait for the change. Here the member removed is
    paused in the middle of the join's push: its push (which would wait for the
    push timeout, 30 s by default) is abandoned once its removal is decided (its
    lease has ended: it decides nothing), the join completes without it, and
    the removal follows at once."""
    options = {"failure_threshold": 1}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        await leased(cluster)
        membership = cluster.router.membership
        loop = asyncio.get_running_loop()
        cluster._make_node("n4")
        paused = pause(cluster, "n2")
        join = asyncio.create_task(membership.join(Member("n4", node_url("n4"))))
        await asyncio.wait_for(paused.pushed.wait(), timeout=2.0)
        assert membership.lock.locked()  # the join is pushing its view
        membership.health["n2"].lease_until = float("-inf")  # its lease is over
        renewals = membership.stats["lease_renewals"]
        started = loop.time()
        await asyncio.wait_for(membership.check_health(), timeout=2.0)
        assert loop.time() - started < 1.0
        assert membership.stats["lease_renewals"] >= renewals + 2  # n1 and n3
        assert "n2" not in membership.view
        await asyncio.wait_for(join, timeout=2.0)
        assert sorted(membership.view.ids) == ["n1", "n3", "n4"]
        assert membership.crashes == 1  # one removal, not two
        assert membership.stats["removed_crashed"] == 1
        # Epochs: 1 the seeds, 2 the join, 3 the removal; none reused.
        assert membership.view.epoch == 3
        paused.resume()


async def test_a_join_not_yet_committed_yields_to_a_crash_removal() -> None:
    """A newcomer that passed readiness but does not answer its first push keeps
    the lock (up to the readiness timeout): a crash removal decided meanwhile
    goes first, and the join, which committed nothing, retries after it."""
    options = {"failure_threshold": 1, "ready_timeout": 30.0}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        await leased(cluster)
        membership = cluster.router.membership
        loop = asyncio.get_running_loop()
        cluster._make_node("n4")
        paused = pause(cluster, "n4", answers_probes=True)
        join = asyncio.create_task(membership.join(Member("n4", node_url("n4"))))
        await asyncio.wait_for(paused.pushed.wait(), timeout=2.0)
        cluster.take_down("n2")
        membership.health["n2"].lease_until = float("-inf")
        started = loop.time()
        await asyncio.wait_for(membership.check_health(), timeout=2.0)
        assert loop.time() - started < 1.0
        assert "n2" not in membership.view and "n4" not in membership.view
        assert membership.view.epoch == 2
        paused.resume()
        await asyncio.wait_for(join, timeout=5.0)
        assert sorted(membership.view.ids) == ["n1", "n3", "n4"]
        assert membership.view.epoch == 3


async def test_a_blip_during_a_join_removes_no_majority() -> None:
    """Most old members miss a join's view (a blip of the router's network): the
    join completes, nobody is removed (the removal budget's quorum), and the
    missed view reaches them through the health loop once they answer."""
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        tally = await exhaust(cluster)
        membership = cluster.router.membership
        cluster._make_node("n4")
        cluster.take_down("n1")
        cluster.take_down("n2")
        await membership.join(Member("n4", node_url("n4")))
        view = membership.view
        assert sorted(view.ids) == ["n1", "n2", "n3", "n4"]
        assert membership.crashes == 0
        assert membership.stats["deferred_quorum"] == 2
        cluster.bring_back("n1")
        cluster.bring_back("n2")
        await membership.check_health()
        await membership.settle()
        for node_id in ("n1", "n2", "n3", "n4"):
            shard = cluster.nodes[node_id].shard
            assert shard is not None and shard.epoch == view.epoch, node_id
        await send(cluster.client, tally, USERS, 2)
        assert tally.excess() == 0, tally.over()


async def test_a_member_that_misses_a_view_is_removed_only_after_its_lease() -> None:
    """One member fails the push of a committed join (alive but failing, or
    paused): it is removed as crashed, but only once the lease it may still hold
    has certainly ended, and it is granted no renewal meanwhile."""
    options = {"lease": 0.4}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        await leased(cluster)
        membership = cluster.router.membership
        loop = asyncio.get_running_loop()
        lease_until = membership.health["n1"].lease_until
        assert lease_until > loop.time()
        cluster._make_node("n4")
        cluster.take_down("n1")
        await membership.join(Member("n4", node_url("n4")))
        assert loop.time() >= lease_until
        assert "n1" not in membership.view and "n4" in membership.view
        assert membership.stats["deferred_lease"] == 1


# --------------------------------------------------------------------------- returning members


async def test_a_member_back_from_a_pause_merges_with_what_its_successor_decided() -> None:
    """While n1 was away its successor admitted from a stale replica; n1's own states
    are more restrictive and win the merge, so nobody is admitted twice afterwards."""
    options = {"failure_threshold": 1}
    async with InProcessCluster(
        3, make_config(crash="replica"), clock=FrozenClock(), router_options=options
    ) as cluster:
        for node in cluster.nodes.values():
            node.store.dirty = set()
        membership = cluster.router.membership
        users = [u for u in USERS if membership.view.owner_id(u) == "n1"]
        tally = Tally()
        await send(cluster.client, tally, users, LIMIT // 2)
        for node in cluster.nodes.values():
            assert node.shard is not None
            await node.shard.replicate_once()
        # n1 admits the other half, but pauses before replicating it.
        await send(cluster.client, tally, users, LIMIT // 2)
        cluster.take_down("n1")
        await membership.check_health()
        assert "n1" not in membership.view
        # Its successors decide from the replicas: two more each, within the
        # replica bound (what n1 admitted since its last replication round).
        await send(cluster.client, tally, users, 2)
        assert tally.excess() == 2 * len(users)
        cluster.bring_back("n1")
        await membership.check_health()
        await membership.settle()
        assert "n1" in membership.view
        # Handed back and merged: n1's exhausted states win over the successors'
        # (which still had 8 left each), so nobody is admitted again in the period.
        before = sum(tally.allowed.values())
        await send(cluster.client, tally, users, 3)
        assert tally.other == Counter()
        assert sum(tally.allowed.values()) == before


# --------------------------------------------------------------------------- replicas


def two_replicas() -> ClusterConfig:
    rule = Rule("api", LIMIT, PERIOD, algorithm="sliding_log", replicas=2)
    return ClusterConfig(rules=(ScopedRule(rule),), policies=Policies(crash="replica"))


@pytest.mark.parametrize("replicas", [1, 2])
async def test_two_adjacent_members_lost_together(replicas: int) -> None:
    """A key's owner and its first successor crash together: with two replicas the
    second successor still has the key's history; with one it starts fresh."""
    config = two_replicas() if replicas == 2 else make_config(crash="replica")
    async with InProcessCluster(5, config, clock=FrozenClock()) as cluster:
        tally = await exhaust_and_replicate(cluster)
        membership = cluster.router.membership
        view = membership.view
        owner, successor = (m.id for m in view.successors(USERS[0], 2))
        users = [u for u in USERS if [m.id for m in view.successors(u, 2)] in ([owner, successor],)]
        assert users  # else "admitted == 0" below would hold vacuously
        cluster.take_down(owner)
        cluster.take_down(successor)
        # The owner is removed first (the harder order: its keys go to the
        # successor, which is dead too), then the successor.
        await membership.crash(owner)
        await membership.crash(successor)
        extra = Tally()
        await send(cluster.client, extra, users, 2)
        assert extra.other == Counter()
        admitted = sum(extra.allowed.values())
        if replicas == 2:
            assert admitted == 0
        else:
            assert admitted == 2 * len(users)  # what a second replica is for
        del tally


async def test_replicas_above_the_maximum_are_refused() -> None:
    with pytest.raises(ValueError, match="replicas"):
        Rule("api", 1, 1.0, replicas=4)
    with pytest.raises(ValueError, match="replicas"):
        Rule("api", 1, 1.0, replicas=0)
    assert Rule.from_dict(Rule("api", 1, 1.0, replicas=2).to_dict()).replicas == 2


async def test_a_late_transfer_of_keys_that_moved_on_is_passed_to_their_owner() -> None:
    """A hand-back from an older view reaches a node that no longer owns some keys:
    it passes those on instead of keeping states nobody will ask it for."""
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        tally = await exhaust(cluster)
        old_view = cluster.router.membership.view
        await cluster.add_node("n4")
        new_view = cluster.router.membership.view
        moved_users = [u for u in USERS if new_view.owner_id(u) == "n4"]
        assert moved_users
        # n1 receives, from "nobody", an old-epoch transfer of exhausted states of
        # keys now owned by n4, after n4 dropped them.
        records = []
        source = cluster.nodes["n4"]
        now = cluster.clock()
        records = source.store.export(now, lambda k: k in moved_users, remove=True)
        shard = cluster.nodes["n1"].shard
        assert shard is not None
        shard.receive("ghost", old_view.epoch, records, False)
        await asyncio.sleep(0)
        for _ in range(50):
            if not shard._tasks:
                break
            await asyncio.sleep(0.01)
        await send(cluster.client, tally, moved_users, 2)
        assert tally.excess() == 0, tally.over()


async def test_the_in_process_network_is_what_these_tests_assume() -> None:
    """The harness behaves as the tests above rely on: a node's URL answers as
    that node (readiness checks the id), the router's URL answers as no node
    (the ``url_is_router`` case), ``take_down`` makes a node unreachable (a
    connection error, as a crash) and ``bring_back`` restores it with what it
    held; a host nobody mounted is unreachable, never another node."""
    async with InProcessCluster(2, make_config(), clock=FrozenClock()) as cluster:
        client = cluster.client
        answer = await client.get(f"{node_url('n1')}/healthz")
        assert answer.status_code == 200 and answer.json()["node"] == "n1"
        assert (await client.get(f"{node_url('n2')}/healthz")).json()["node"] == "n2"
        assert "node" not in (await client.get("/healthz")).json()
        cluster.take_down("n1")
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{node_url('n1')}/healthz")
        assert (await client.get(f"{node_url('n2')}/healthz")).status_code == 200
        cluster.bring_back("n1")
        assert (await client.get(f"{node_url('n1')}/healthz")).json()["node"] == "n1"
        with pytest.raises(httpx.ConnectError):
            await client.get(f"{node_url('n3')}/healthz")


async def test_a_newcomers_lease_renewed_while_its_join_settles_is_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The health loop renews the members of the adopted view, a newcomer's too,
    while its join settles (with etcd, a write). The router's record of the
    newcomer's lease is the renewed one: the join's own record, written after,
    replaced it with the older bound of the join's first grant, and a removal
    could then come before the lease the node held had ended (an independent
    review)."""
    config = make_config(on_error="closed")
    async with InProcessCluster(3, config, clock=FrozenClock()) as cluster:
        await leased(cluster)
        membership = cluster.router.membership
        settle = membership._settle
        renewed_at: list[float] = []

        async def settle_while_probed(committed: object) -> None:
            await settle(committed)  # type: ignore[arg-type]
            renewed_at.append(asyncio.get_running_loop().time())
            await membership.check_health()  # a round of the health loop meanwhile

        monkeypatch.setattr(membership, "_settle", settle_while_probed)
        cluster._make_node("n4")
        await membership.join(Member("n4", node_url("n4")))
        (probed,) = renewed_at
        health = membership.health["n4"]
        assert health.state == "active"
        assert health.offered_at >= probed, "the renewal during the join was forgotten"


@pytest.mark.parametrize("then", ["removed_and_rejoined", "kept_by_a_newer_view"])
async def test_a_member_withheld_at_a_take_over_is_leased_again_once_its_record_is_passed(
    then: str,
) -> None:
    """A member a take-over withheld its lease from (a newer etcd record removed
    it: router/membership.py ``_take_lead``) is withheld only until a view of
    that record's epoch or newer is adopted: removed, a process joining again
    under its id is leased; kept by a newer view (it rejoined meanwhile), it is
    leased. Before, the take-over cleared the list only when it ended without
    an error, then only for ids out of the adopted view: such a member got no
    lease for the rest of the term, its users answered by on_error (two
    independent reviews)."""
    config = make_config(on_error="closed")
    async with InProcessCluster(3, config, clock=FrozenClock()) as cluster:
        await leased(cluster)
        membership = cluster.router.membership
        membership.withheld = frozenset({"n2"})
        membership._withheld_for = membership.view.epoch + 1
        lease = cluster.nodes["n2"].shard.lease  # type: ignore[union-attr]
        if then == "removed_and_rejoined":
            await cluster.remove_node("n2")
            assert membership.withheld == frozenset()
            cluster.take_down("n2")
            cluster._make_node("n2")
            await membership.join(Member("n2", node_url("n2")))
            lease = cluster.nodes["n2"].shard.lease  # type: ignore[union-attr]
        else:
            await cluster.add_node("n4")
            assert membership.withheld == frozenset()
            lease.until = float("-inf")
            await membership.check_health()
        assert lease.required and lease.until > float("-inf")
