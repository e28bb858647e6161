"""Routers that follow a leading router (the workers of ``ringlimit router
--workers N`` without etcd) never change the ring, and report the leader's
membership events as they are (issue 12). In-process; the etcd forms are in
tests/test_coordinator.py."""

from __future__ import annotations

import asyncio

import pytest

from node.clock import FrozenClock
from ring import Member
from router.app import Router
from router.membership import MembershipError
from router.testing import ROUTER_URL, InProcessCluster, node_url
from tests.processes import wait_until
from tests.test_rebalancing import make_config

pytestmark = pytest.mark.anyio

SECOND = "http://router2.localhost"


async def follower(cluster: InProcessCluster) -> Router:
    router = cluster.new_router(SECOND, seeds=[], leader_url=ROUTER_URL, follow_interval=0.05)
    await router.start()
    assert router.membership.view == cluster.router.membership.view
    return router


async def test_a_follower_leaves_a_restarted_node_to_the_leader() -> None:
    """A node restarted (epoch 0) refuses a follower's request: the follower
    neither crashes nor rejoins it (that would make epochs the leader does not
    know); it waits for the leader's health loop, which repairs the node."""
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        second = await follower(cluster)
        try:
            leader = cluster.router.membership
            user = next(f"user-{i}" for i in range(100) if cluster.owner(f"user-{i}") == "n2")
            cluster.restart_node("n2")
            request = asyncio.create_task(
                cluster.client.get(f"{SECOND}/api", headers={"X-User-Id": user})
            )
            await asyncio.sleep(0.3)
            # Nobody changed the ring: not the follower, not (yet) the leader.
            assert leader.view.epoch == second.membership.view.epoch == 1
            assert second.membership.crashes == 0
            for node_id in ("n1", "n3"):
                shard = cluster.nodes[node_id].shard
                assert shard is not None and shard.epoch == 1
            # The leader's health loop finds it at epoch 0: crash, then rejoin.
            await leader.check_health()
            await leader.settle()
            assert leader.crashes == 1 and "n2" in leader.view
            response = await asyncio.wait_for(request, timeout=10.0)
            assert response.status_code == 200, response.text
            # The follower polls the leader (every 0.05 s): the request may have been
            # answered under the crash's view (epoch 2) before it read the rejoin's
            # (CI, two busy workers). It catches up; it never makes a view itself.
            await wait_until(lambda: second.membership.view == leader.view, 5.0)
            assert second.membership.crashes == 0
        finally:
            await second.close()


async def test_a_follower_refuses_to_change_the_ring_itself() -> None:
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        second = await follower(cluster)
        try:
            membership = second.membership
            cluster._make_node("n4")
            for change in (
                membership.join(Member("n4", node_url("n4"))),
                membership.leave("n1"),
                membership.crash("n1"),
                membership.push_config(membership.config),
            ):
                with pytest.raises(MembershipError) as refused:
                    await change
                assert refused.value.error == "not_leader"
                assert ROUTER_URL in refused.value.detail
            # Through its admin API the change is the leader's.
            response = await cluster.client.post(
                f"{SECOND}/admin/nodes", json={"id": "n4", "url": node_url("n4")}
            )
            assert response.status_code == 200, response.text
            assert response.headers["x-ringlimit-leader"] == ROUTER_URL
            assert "n4" in cluster.router.membership.view
        finally:
            await second.close()


async def test_every_router_reports_a_crash_as_a_crash() -> None:
    """``ringlimit up`` reads /admin/ring through the shared port and may reach
    any worker: a follower reports the leader's events, so a node removed as
    crashed is "crashed" (not "left") whoever answers."""
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        second = await follower(cluster)
        try:
            await cluster.crash_node("n2")
            await cluster.remove_node("n3")
            leader = cluster.router.membership
            for _ in range(200):
                if second.membership.view.epoch == leader.view.epoch:
                    break
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # one more poll: the events of that epoch
            rings = [
                (await cluster.client.get(f"{url}/admin/ring")).json()
                for url in (ROUTER_URL, SECOND)
            ]
            assert rings[0]["events"] == rings[1]["events"]
            kinds = {(e["node"], e["epoch"]): e["kind"] for e in rings[1]["events"]}
            assert kinds[("n2", 2)] == "crashed"
            assert kinds[("n3", 3)] == "left"
        finally:
            await second.close()


async def test_a_follower_learning_a_view_from_a_node_still_shows_the_leaders_events() -> None:
    """A follower may learn a view from a node's refusal before it polls the
    leader: it records no event of its own (it cannot tell a crash from a
    leave); the next poll brings the leader's."""
    async with InProcessCluster(3, make_config(), clock=FrozenClock()) as cluster:
        second = cluster.new_router(SECOND, seeds=[], leader_url=ROUTER_URL, follow_interval=3600)
        await second.start()
        try:
            await cluster.crash_node("n2")
            leader = cluster.router.membership
            await second.membership.catch_up(leader.view.epoch, node_url("n1"))
            assert second.membership.view == leader.view
            assert all(e.kind != "left" for e in second.membership.events.events)
            assert await second.membership.follow_once(ROUTER_URL, {}) is False
            assert list(second.membership.events.events) == list(leader.events.events)
        finally:
            await second.close()
