"""What a router keeps per node id or rule stays bounded: nodes that come
and go under new ids (pods, an autoscaled group) leave nothing behind in a
router that follows, nor in one that led (in-process clusters)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from node.clock import FrozenClock
from ring import Member
from router.health import Health
from router.testing import ROUTER_URL, InProcessCluster, node_url
from tests.processes import wait_until
from tests.test_followers import SECOND
from tests.test_rebalancing import make_config

pytestmark = pytest.mark.anyio


async def test_a_follower_keeps_health_only_for_the_members_of_its_view() -> None:
    """Node ids churn on the leader (a new node joins, an old one leaves, five
    times); the follower adopts each view, and its health entries are the
    view's members, not every id it ever saw."""
    async with InProcessCluster(2, make_config(), clock=FrozenClock()) as cluster:
        second = cluster.new_router(SECOND, seeds=[], leader_url=ROUTER_URL, follow_interval=0.05)
        await second.start()
        try:
            leader = cluster.router.membership
            old = "n1"
            for i in range(5):
                await cluster.add_node(f"pod-{i}")
                await cluster.remove_node(old)
                old = f"pod-{i}"
                await wait_until(lambda: second.membership.view.epoch == leader.view.epoch)
            assert set(second.membership.health) == set(second.membership.view.ids)
            assert set(leader.health) == set(leader.view.ids)
            assert len(second.membership.view) == 2
        finally:
            await second.close()


async def test_a_departed_nodes_outage_does_not_leave_the_backend_degraded() -> None:
    """A router that led recorded a node's Redis outage (as its probes do), then
    followed; the new leader removes that node. Adopting the view drops the
    entry, so backend_degraded (which keeps round-robin routing sticky) does
    not stay true for good."""
    async with InProcessCluster(2, make_config(), clock=FrozenClock()) as cluster:
        second = cluster.new_router(SECOND, seeds=[], leader_url=ROUTER_URL, follow_interval=0.05)
        await second.start()
        try:
            membership = second.membership
            membership.health["n2"] = Health(backend_available=False)
            assert membership.backend_degraded
            await cluster.remove_node("n2")
            await wait_until(lambda: "n2" not in membership.view)
            assert "n2" not in membership.health
            assert not membership.backend_degraded
        finally:
            await second.close()


async def test_finished_repair_waits_leave() -> None:
    """A follower waits for the leader to repair a node that answered with an
    old epoch; the finished wait is not kept per node id."""
    async with InProcessCluster(2, make_config(), clock=FrozenClock()) as cluster:
        second = cluster.new_router(SECOND, seeds=[], leader_url=ROUTER_URL, follow_interval=0.05)
        await second.start()
        try:
            membership = second.membership
            for i in range(3):
                # An id the view does not know: nothing to wait for, the wait ends.
                await membership.refresh_node(Member(f"gone-{i}", node_url(f"gone-{i}")), 0)
            assert not membership._awaiting_repair
        finally:
            await second.close()


async def test_hot_key_rates_of_rules_no_longer_in_force_are_dropped() -> None:
    """A router counts each key's rate per leasing rule (up to 4,096 keys each);
    rules renamed at runtime (PUT /admin/rules) leave theirs behind no longer:
    the first request under a new rule drops the rates of rules not in force."""
    async with InProcessCluster(2, make_config(), clock=FrozenClock()) as cluster:
        router = cluster.router
        owner = router.membership.view.members[0]
        for version in range(1, 6):
            rules = [{"name": f"api-v{version}", "rate": "100/second", "lease": "auto"}]
            answer = await cluster.client.put(f"{ROUTER_URL}/admin/rules", json={"rules": rules})
            assert answer.status_code == 200, answer.text
            rule = router.config.rule_map[f"api-v{version}"]
            for i in range(50):
                router.leases.note(rule, f"user-{i}", owner, 1, float(version), True)
            assert set(router.leases._hot) == {f"api-v{version}"}


async def test_a_node_keeps_no_series_or_table_of_rules_renamed_away() -> None:
    """Rules renamed at runtime (PUT /admin/rules, pushed to the nodes): a node's
    /metrics shows a departed rule's counts one scrape more, then not; its
    store keeps no table of it once the sweep emptied it."""
    async with InProcessCluster(1, make_config(), clock=FrozenClock()) as cluster:
        node = cluster.nodes["n1"]
        for version in range(1, 5):
            rules = [{"name": f"api-v{version}", "rate": "100/second", "paths": ["/*"]}]
            answer = await cluster.client.put(f"{ROUTER_URL}/admin/rules", json={"rules": rules})
            assert answer.status_code == 200, answer.text
            await wait_until(lambda v=version: f"api-v{v}" in node.authority.config.rule_map)
            for user in ("alice", "bob"):
                reply = await cluster.client.get(f"{ROUTER_URL}/x", headers={"X-User-Id": user})
                assert reply.status_code == 200
            text = (await cluster.client.get(f"{node_url('n1')}/metrics")).text
            named = {
                line.split('rule="')[1].split('"')[0]
                for line in text.splitlines()
                if line.startswith("ringlimit_decisions_total{")
            }
            # This version's rule, and the last one's for one more scrape.
            assert named == {f"api-v{version}", f"api-v{version - 1}"} - {"api-v0"}
        node.store.sweep(float("inf"), budget=None)
        node.store.forget_rules(node.authority.config.rule_map)
        assert set(node.store._tables) <= {"api-v4"}


async def test_a_crashed_member_whose_url_serves_another_node_is_forgotten(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A member removed as crashed is probed every health round so that it can
    rejoin when it answers again. When its address came to serve another node
    (a pod's IP reused, a port taken by a node under a new id), /healthz still
    answered 200: every round took it for the crashed member back, logged
    "answers again" and tried a join that the readiness gate refused
    (wrong_node), for as long as the other node ran (a real router: 2 lines and
    2 failed joins a second with two such members). Answered as another node,
    it is forgotten instead: its process is gone for good."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        membership = cluster.router.membership
        await cluster.crash_node("n3")
        assert "n3" in membership.removed
        # Another node now answers at n3's address.
        other = cluster._make_node("pod-7")
        cluster._mounts[node_url("n3")] = cluster._mounts.pop(node_url("pod-7"))
        assert other.settings.node_id == "pod-7"
        with caplog.at_level("WARNING", logger="ringlimit.router"):
            for _ in range(3):
                await membership.check_health()
                await asyncio.sleep(0.01)  # a rejoin runs in the background
        assert "n3" not in membership.removed
        assert "answers again" not in caplog.text
        assert [m.id for m in membership.view] == ["n1", "n2"]


class _CountingDown(httpx.AsyncBaseTransport):
    """A host that refuses every connection, and counts the attempts."""

    def __init__(self) -> None:
        self.requests = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.requests += 1
        raise httpx.ConnectError("node is down", request=request)


async def test_a_member_removed_long_ago_is_no_longer_probed_and_can_register_again() -> None:
    """A router probed every member it removed as crashed (up to 256) every
    health round for as long as it ran: a node that died for good cost a
    probe, and a connect timeout, each round forever (the soak tester's
    finding). Past --forget-removed-after it is forgotten: no probe reaches
    its address again. Restarted then without --join, the router no longer
    looks for it; registering (what --join does) brings it back."""
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options={"forget_removed_after": 0.3}
    ) as cluster:
        membership = cluster.router.membership
        await cluster.crash_node("n3")
        down = cluster._mounts[node_url("n3")] = _CountingDown()
        await membership.check_health()
        assert down.requests >= 1 and "n3" in membership.removed
        await asyncio.sleep(0.35)
        await membership.check_health()
        assert "n3" not in membership.removed
        probed = down.requests
        for _ in range(3):
            await membership.check_health()
        assert down.requests == probed
        cluster.restart_node("n3")
        await membership.check_health()
        await asyncio.sleep(0.05)  # a rejoin would run in the background
        assert "n3" not in membership.view
        await membership.join(Member("n3", node_url("n3")))
        assert membership.view.ids == ("n1", "n2", "n3")


async def test_a_member_restarted_without_join_soon_after_its_removal_rejoins() -> None:
    """What a node restarted without --join relies on, kept: within the first
    minute after its removal it is probed every round and rejoins."""
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        membership = cluster.router.membership
        await cluster.crash_node("n3")
        await membership.check_health()
        cluster.restart_node("n3")
        await membership.check_health()
        await wait_until(lambda: "n3" in membership.view)
        assert "n3" not in membership.removed
