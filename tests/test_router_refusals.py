"""How long the router keeps sending a request, or a check, that nodes refuse
because the ring is changing (router/forward.py ``MAX_ATTEMPTS`` and
``Timeouts.refusals``): long enough to ride out the refusals a repair causes,
bounded in sends and in time, and then a 503 ``ring_changing`` with Retry-After.

The owner is a real node behind a gate that refuses (421, the node's own epoch,
as a node whose view the router has not caught up with) the first ``refusals``
requests it sees, in process.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from node.app import Node
from node.asgi import send_json
from node.clock import FrozenClock
from router.forward import MAX_ATTEMPTS, Timeouts
from router.testing import InProcessCluster, node_url
from tests.test_rebalancing import make_config

pytestmark = pytest.mark.anyio


class RefusingGate:
    """An ASGI app in front of ``node``: refuses its first ``refusals`` requests,
    each after ``delay`` seconds."""

    def __init__(self, node: Node, refusals: int, delay: float = 0.0) -> None:
        self.node = node
        self.refusals = refusals
        self.delay = delay
        self.seen = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"].startswith("/internal"):
            await self.node(scope, receive, send)  # type: ignore[arg-type]
            return
        self.seen += 1
        if self.seen > self.refusals:
            await self.node(scope, receive, send)  # type: ignore[arg-type]
            return
        if self.delay:
            await asyncio.sleep(self.delay)
        epoch = self.node.shard.epoch if self.node.shard is not None else 0
        await send_json(
            send,
            421,
            {"error": "not_owner", "epoch": epoch},
            [(b"x-ringlimit-epoch", str(epoch).encode())],
        )


def gate(cluster: InProcessCluster, refusals: int, delay: float = 0.0) -> RefusingGate:
    gated = RefusingGate(cluster.nodes["n1"], refusals, delay)
    cluster._mounts[node_url("n1")] = httpx.ASGITransport(app=gated)  # type: ignore[arg-type]
    return gated


async def proxied(cluster: InProcessCluster) -> httpx.Response:
    return await cluster.client.get("/api", headers={"X-User-Id": "alice"})


async def checked(cluster: InProcessCluster) -> httpx.Response:
    return await cluster.client.post("/v1/check", json={"key": "alice", "rule": "api"})


@pytest.mark.parametrize("send", [proxied, checked], ids=["proxied", "check"])
async def test_five_refusals_are_ridden_out(send: Any) -> None:
    """Five refusals: what a router that follows can meet while a restarted
    node is repaired (crash, then rejoin). Four attempts answered 503."""
    async with InProcessCluster(1, make_config(), clock=FrozenClock()) as cluster:
        gated = gate(cluster, refusals=5)
        response = await send(cluster)
        assert response.status_code == 200, response.text
        assert gated.seen == 6


@pytest.mark.parametrize("send", [proxied, checked], ids=["proxied", "check"])
async def test_endless_refusals_end_in_ring_changing_after_max_attempts(send: Any) -> None:
    async with InProcessCluster(1, make_config(), clock=FrozenClock()) as cluster:
        gated = gate(cluster, refusals=10**6)
        response = await send(cluster)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "ring_changing"
        assert gated.seen == MAX_ATTEMPTS
        # Both say when to try again (the decision API's answer said nothing).
        assert response.headers["retry-after"] == "1"


@pytest.mark.parametrize("send", [proxied, checked], ids=["proxied", "check"])
async def test_refusals_stop_once_their_time_is_spent(send: Any) -> None:
    """Each refusal here takes 0.2 s: past ``Timeouts.refusals`` (0.5 s) the
    router sends nothing more, whatever attempts remain: three sends (0, 0.2,
    0.4 s), not eight. (Wall time: a budget of 0.015 s with no delay lost its
    second send to a loaded CI machine's pause.)"""
    options = {"timeouts": Timeouts(refusals=0.5)}
    async with InProcessCluster(
        1, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        gated = gate(cluster, refusals=10**6, delay=0.2)
        response = await send(cluster)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "ring_changing"
        # At least two (the first send takes 0.2 s of the 0.5), at most three.
        assert 2 <= gated.seen <= 3 < MAX_ATTEMPTS, gated.seen
