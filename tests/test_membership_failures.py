"""Membership changes that fail half-way move forward; epochs are never reused."""

from __future__ import annotations

import pytest

from node.clock import FrozenClock
from node.config import ClusterConfig
from router.testing import InProcessCluster

pytestmark = pytest.mark.anyio

CONFIG = ClusterConfig.from_dict(
    {"rules": [{"name": "api", "rate": "5/minute"}], "policies": {"crash": "replica"}}
)


async def test_a_join_while_a_member_is_unreachable_does_not_wedge_the_ring() -> None:
    async with InProcessCluster(3, CONFIG, clock=FrozenClock()) as cluster:
        cluster.take_down("n3")
        await cluster.add_node("n4")
        membership = cluster.router.membership
        # n3 did not take the new view: it was removed as crashed, under a newer epoch.
        assert set(membership.view.ids) == {"n1", "n2", "n4"}
        epochs = {node_id: cluster.nodes[node_id].shard.epoch for node_id in ("n1", "n2", "n4")}
        assert set(epochs.values()) == {membership.view.epoch}
        statuses = []
        for i in range(60):
            response = await cluster.client.get("/x", headers={"X-User-Id": f"user-{i}"})
            statuses.append(response.status_code)
        assert statuses == [200] * 60


async def test_epochs_only_grow_across_changes() -> None:
    async with InProcessCluster(3, CONFIG, clock=FrozenClock()) as cluster:
        membership = cluster.router.membership
        seen = [membership.view.epoch]
        await cluster.add_node("n4")
        seen.append(membership.view.epoch)
        await cluster.remove_node("n2")
        seen.append(membership.view.epoch)
        await cluster.crash_node("n1")
        seen.append(membership.view.epoch)
        assert seen == sorted(set(seen)), seen


async def test_a_node_that_missed_a_crash_still_promotes_its_replicas() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, CONFIG, clock=clock) as cluster:
        users = [f"user-{i}" for i in range(40)]
        for user in users:
            for _ in range(5):
                await cluster.client.get("/x", headers={"X-User-Id": user})
        for node in cluster.nodes.values():
            assert node.shard is not None
            await node.shard.replicate_once()
        victim = "n1"
        heirs = {
            u: cluster.router.membership.view.successors(u, 2)[1].id
            for u in users
            if cluster.owner(u) == victim
        }
        assert heirs, "some users must be owned by the victim"
        missing = next(iter(set(heirs.values())))
        # The heir misses the crash push, then is brought up to date later.
        cluster.take_down(missing)
        await cluster.crash_node(victim)
        cluster.bring_back(missing)
        node_epoch = cluster.nodes[missing].shard.epoch
        member = cluster.router.membership.view.member(missing)
        await cluster.router.membership.refresh_node(member, node_epoch)
        admitted = 0
        for user, heir in heirs.items():
            if heir != missing:
                continue
            response = await cluster.client.get("/x", headers={"X-User-Id": user})
            admitted += response.status_code == 200
        assert admitted == 0, "replicas of the crashed node must be promoted on the heir"
