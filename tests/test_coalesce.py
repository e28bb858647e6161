"""Coalescing concurrent single checks into per-node batches."""

from __future__ import annotations

import asyncio
import time

import pytest

from node.clock import FrozenClock
from node.config import ClusterConfig
from router.coalesce import Coalescer
from router.testing import InProcessCluster
from tests.real_cluster import metric

pytestmark = pytest.mark.anyio


async def test_concurrent_items_for_one_node_leave_as_one_batch() -> None:
    sent: list[tuple[str, list[int]]] = []

    async def send(node: str, items: list[int]) -> list[int]:
        sent.append((node, list(items)))
        return [i * 10 for i in items]

    coalescer = Coalescer(send, window=0.01)
    futures = [coalescer.submit("a" if i % 2 else "b", i) for i in range(10)]
    results = await asyncio.gather(*futures)
    assert results == [i * 10 for i in range(10)]
    assert sorted(node for node, _ in sent) == ["a", "b"]
    assert coalescer.batches == 2 and coalescer.items == 10


async def test_a_lone_item_waits_no_longer_than_the_window() -> None:
    async def send(node: str, items: list[int]) -> list[int]:
        return items

    coalescer = Coalescer(send, window=0.002)
    started = time.perf_counter()
    assert await coalescer.submit("a", 7) == 7
    assert time.perf_counter() - started < 0.5  # the window, plus a loaded machine's slack


async def test_a_full_batch_leaves_before_the_window_ends() -> None:
    async def send(node: str, items: list[int]) -> list[int]:
        return items

    coalescer = Coalescer(send, window=60.0, max_batch=4)
    results = await asyncio.wait_for(
        asyncio.gather(*(coalescer.submit("a", i) for i in range(4))), timeout=5
    )
    assert results == [0, 1, 2, 3]


async def test_a_failed_batch_fails_every_waiter() -> None:
    async def send(node: str, items: list[int]) -> list[int]:
        raise RuntimeError("node gone")

    coalescer = Coalescer(send, window=0.001)
    futures = [coalescer.submit("a", i) for i in range(3)]
    for future in futures:
        with pytest.raises(RuntimeError):
            await future


@pytest.mark.parametrize("window", [0.0, 0.005])
async def test_router_singles_are_coalesced_and_answered_exactly(window: float) -> None:
    config = ClusterConfig.from_dict({"rules": [{"name": "api", "rate": "3/minute"}]})
    cluster = InProcessCluster(3, config, clock=FrozenClock())
    cluster.router.settings.coalesce_window = window
    async with cluster:
        if window == 0.0:
            cluster.router.coalescer = None
        users = [f"user-{i}" for i in range(12)]
        asked = [u for u in users for _ in range(4)]
        responses = await asyncio.gather(
            *(cluster.client.post("/v1/check", json={"key": u}) for u in asked)
        )
        allowed: dict[str, int] = {}
        for user, response in zip(asked, responses, strict=True):
            assert response.status_code == 200
            body = response.json()
            assert body["node"] == cluster.owner(user)
            allowed[user] = allowed.get(user, 0) + body["allowed"]
        # Each user gets exactly 3 of 4, whatever the batching.
        assert allowed == dict.fromkeys(users, 3)
        text = (await cluster.client.get("/metrics")).text
        if cluster.router.coalescer is not None:
            assert cluster.router.coalescer.items == 48
            assert cluster.router.coalescer.batches < 48
            # What an operator tunes --coalesce-window by: checks per batch.
            assert metric(text, "ringlimit_router_coalesced_total", kind="checks") == 48
            batches = metric(text, "ringlimit_router_coalesced_total", kind="batches")
            assert batches == cluster.router.coalescer.batches
        else:
            assert "ringlimit_router_coalesced_total{" not in text


async def test_coalesced_singles_stay_within_the_nodes_batch_limit() -> None:
    """Singles coalesced for one node leave in batches the node accepts: at most
    ``limits.max_batch`` checks (and few enough for ``max_body``). Before, the
    coalescer held up to 256 whatever the limits, and with ``max_batch = 5`` a
    burst of 20 concurrent singles was one batch the node refused (413
    batch_too_large): each of the 20 callers got a 502 ``node_error``."""
    config = ClusterConfig.from_dict(
        {"rules": [{"name": "api", "rate": "100/minute"}], "limits": {"max_batch": 5}}
    )
    async with InProcessCluster(
        1, config, clock=FrozenClock(), router_options={"coalesce_window": 0.05}
    ) as cluster:
        responses = await asyncio.gather(
            *(cluster.client.post("/v1/check", json={"key": f"u{i}"}) for i in range(20))
        )
        assert [r.status_code for r in responses] == [200] * 20, responses[0].text
        assert all(r.json()["allowed"] for r in responses)
        coalescer = cluster.router.coalescer
        assert coalescer is not None and coalescer.items == 20 and coalescer.batches >= 4
        # Limits changed at runtime (new rules and limits pushed to the cluster) are
        # followed too.
        await cluster.router.membership.change_config(
            ClusterConfig.from_dict(
                {"rules": [{"name": "api", "rate": "100/minute"}], "limits": {"max_batch": 3}}
            )
        )
        responses = await asyncio.gather(
            *(cluster.client.post("/v1/check", json={"key": f"u{i}"}) for i in range(20))
        )
        assert [r.status_code for r in responses] == [200] * 20, responses[0].text


async def test_a_rule_its_owner_does_not_know_yet_fails_only_its_own_checks() -> None:
    """Between a rules change reaching the router and its push reaching the node,
    a check on the new rule is one the node refuses (404 unknown_rule), before
    deciding anything. Coalesced with other callers' checks, it failed them all:
    20 of 20 answered 502. The batch is sent again split by rules: the other
    callers are decided, the new rule's check alone says node_error."""
    config = ClusterConfig.from_dict({"rules": [{"name": "api", "rate": "100/minute"}]})
    async with InProcessCluster(
        1, config, clock=FrozenClock(), router_options={"coalesce_window": 0.05}
    ) as cluster:
        # The router has the new rule; the node does not have it yet.
        cluster.router.membership.config = ClusterConfig.from_dict(
            {"rules": [{"name": "api", "rate": "100/minute"}, {"name": "new", "rate": "5/minute"}]}
        )
        bodies = [{"key": f"u{i}", "rule": "api"} for i in range(19)] + [
            {"key": "v", "rule": "new"}
        ]
        responses = await asyncio.gather(
            *(cluster.client.post("/v1/check", json=body) for body in bodies)
        )
        coalescer = cluster.router.coalescer
        assert coalescer is not None and coalescer.batches < 20  # they did leave together
        assert [r.status_code for r in responses[:19]] == [200] * 19, responses[0].text
        assert all(r.json()["allowed"] for r in responses[:19])
        assert responses[19].status_code == 502
        assert responses[19].json()["error"] == "node_error"
        # A batch of one client, likewise: its other checks are decided.
        batch = await cluster.client.post("/v1/check", json={"checks": bodies[18:]})
        assert batch.status_code == 200
        first, second = batch.json()["results"]
        assert first["allowed"] and second["error"] == "node_error"
