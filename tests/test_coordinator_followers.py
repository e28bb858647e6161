"""Routers of an etcd cluster that do not lead never change the ring on their
own, build every change on the view they adopted, and report crashes as
crashes (issue 12). etcd is the real server the ``etcd_endpoint`` fixture starts."""

from __future__ import annotations

import asyncio

import pytest

from node.clock import FrozenClock
from ring import Member
from router.app import Router
from router.membership import Membership, MembershipError
from router.testing import ROUTER_URL, InProcessCluster, node_url
from tests.processes import wait_until
from tests.test_coordinator import (
    SECOND,
    commit_unsettled_join,
    coordinator,
    leading_cluster,
    options,
    stop_coordination,
)
from tests.test_rebalancing import make_config

pytestmark = [pytest.mark.anyio, pytest.mark.etcd]


def quiet(endpoint: str, url: str) -> dict[str, object]:
    """A router of the etcd cluster whose health loop never runs by itself
    (the test runs its rounds), so that only the test's calls change the ring."""
    return {**options(endpoint, url), "health_interval": 3600.0}


async def test_a_change_is_built_on_the_adopted_view_not_on_an_unsettled_record(
    etcd_endpoint: str,
) -> None:
    """etcd holds record N (a change under way, unsettled): a router still on
    view N-1 has seen N's revision, but a change it builds from N-1 must not be
    committed over N (N would never be carried out, and N+1 would be built on
    a view that is not the last)."""
    async with leading_cluster(etcd_endpoint) as cluster:
        membership = cluster.router.membership
        etcd = coordinator(etcd_endpoint)
        await etcd.connect()
        try:
            pending = await commit_unsettled_join(cluster, etcd)
            cluster._make_node("n5")
            await wait_until(lambda: membership.log.highest >= 2)  # the watch saw it
            assert membership.view.epoch == 1  # unsettled: not adopted
            with pytest.raises(MembershipError) as refused:
                await membership.join(Member("n5", node_url("n5")))
            assert refused.value.error == "ring_changed"
            stored = await etcd.load()
            assert stored is not None and stored.view == pending
        finally:
            await etcd.close()


async def routers(
    cluster: InProcessCluster, endpoint: str
) -> tuple[Router, Membership, Membership, str]:
    """A second router on the same etcd: (it, the leader, the follower, the
    follower's URL)."""
    second = cluster.new_router(SECOND, seeds=[], **quiet(endpoint, SECOND))
    await second.start()
    first, other = cluster.router.membership, second.membership
    await wait_until(lambda: first.leading != other.leading)
    await wait_until(lambda: other.view == first.view)
    if first.leading:
        return second, first, other, SECOND
    return second, other, first, ROUTER_URL


async def test_a_router_that_does_not_lead_leaves_a_restarted_node_to_the_leader(
    etcd_endpoint: str,
) -> None:
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=quiet(etcd_endpoint, ROUTER_URL)
    ) as cluster:
        second, leader, follower, base = await routers(cluster, etcd_endpoint)
        try:
            user = next(f"user-{i}" for i in range(100) if cluster.owner(f"user-{i}") == "n2")
            cluster.restart_node("n2")
            request = asyncio.create_task(
                cluster.client.get(f"{base}/api", headers={"X-User-Id": user})
            )
            await asyncio.sleep(0.3)
            assert follower.crashes == 0
            assert leader.view.epoch == follower.view.epoch == 1
            record = await leader.coordinator.load()  # type: ignore[union-attr]
            assert record is not None and record.view.epoch == 1
            # The leader's health loop repairs it: crash, then rejoin.
            await leader.check_health()
            await leader.settle()
            assert leader.crashes == 1 and "n2" in leader.view
            response = await asyncio.wait_for(request, timeout=10.0)
            assert response.status_code == 200, response.text
            assert follower.crashes == 0
        finally:
            await second.close()


async def test_a_crash_learnt_from_a_node_is_a_crash_once_etcd_says_so(
    etcd_endpoint: str,
) -> None:
    """A router that does not lead may adopt a view from a node's refusal before
    its watch brings the record (a node does not say who crashed): the record's
    crash list then relabels the event, so every router reports "crashed"."""
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=quiet(etcd_endpoint, ROUTER_URL)
    ) as cluster:
        second, leader, follower, _ = await routers(cluster, etcd_endpoint)
        try:
            await stop_coordination(follower)  # its watch is late
            cluster.take_down("n2")
            await leader.crash("n2")
            await follower.catch_up(leader.view.epoch, node_url("n1"))
            assert follower.view == leader.view
            record = await leader.coordinator.load()  # type: ignore[union-attr]
            assert record is not None and record.view == leader.view
            follower._take(record)  # the watch's delivery
            kinds = {(e.node, e.epoch): e.kind for e in follower.events.events}
            assert kinds[("n2", 2)] == "crashed"
            assert {(e.node, e.epoch): e.kind for e in leader.events.events}[("n2", 2)] == (
                "crashed"
            )
        finally:
            await second.close()
