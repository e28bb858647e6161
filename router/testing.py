"""An in-process cluster: a router and N nodes wired through httpx, no sockets.

Every node is an ASGI app mounted on ``http://<id>.cluster`` in one
``httpx.AsyncClient``; the router forwards through that client, the nodes
hand state to each other through it, and the test talks to the router
through it. The clock is shared and injected, so a test can freeze and
advance time::

    async with InProcessCluster(3, config, clock=FrozenClock()) as cluster:
        response = await cluster.client.get("/", headers={"X-User-Id": "alice"})
        await cluster.add_node("n4")
"""

from __future__ import annotations

from types import TracebackType
from typing import Any

import httpx

from node.app import Node, NodeSettings, create_app
from node.clock import Clock, system_clock
from node.config import ClusterConfig
from node.peers import Peers
from ring import Member
from router.app import Router, RouterSettings, create_router
from router.forward import HttpxForwarder

ROUTER_URL = "http://router.cluster"


def node_url(node_id: str) -> str:
    return f"http://{node_id}.cluster"


class InProcessCluster:
    def __init__(
        self,
        nodes: int,
        config: ClusterConfig,
        *,
        clock: Clock = system_clock,
        internal_token: str | None = None,
        node_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.internal_token = internal_token
        self.node_options = node_options or {}
        self.nodes: dict[str, Node] = {}
        self._mounts: dict[str, httpx.AsyncBaseTransport] = {}
        self._transport = _Switch(self._mounts)
        self.client = httpx.AsyncClient(
            transport=self._transport, base_url=ROUTER_URL, timeout=10.0
        )
        for i in range(1, nodes + 1):
            self._make_node(f"n{i}")
        self.router: Router = create_router(
            RouterSettings(
                config=config,
                seeds=[Member(n, node_url(n)) for n in self.nodes],
                internal_token=internal_token,
                health_checks=False,
            ),
            forwarder=HttpxForwarder(self.client),
            client=self.client,
        )
        self._mounts[ROUTER_URL] = httpx.ASGITransport(app=self.router)  # type: ignore[arg-type]

    def _make_node(self, node_id: str) -> Node:
        node = create_app(
            NodeSettings(
                node_id=node_id,
                config=self.config,
                internal_token=self.internal_token,
                **self.node_options,
            ),
            clock=self.clock,
            peers=Peers(token=self.internal_token, client=self.client),
        )
        self.nodes[node_id] = node
        self._mounts[node_url(node_id)] = httpx.ASGITransport(app=node)  # type: ignore[arg-type]
        return node

    async def __aenter__(self) -> InProcessCluster:
        await self.router.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.router.close()
        await self.client.aclose()

    async def add_node(self, node_id: str, weight: int = 1) -> Node:
        node = self._make_node(node_id)
        await self.router.membership.join(Member(node_id, node_url(node_id), weight))
        return node

    async def remove_node(self, node_id: str) -> None:
        await self.router.membership.leave(node_id)

    async def crash_node(self, node_id: str) -> None:
        """The node vanishes (its transport now fails) and the router drops it."""
        self._mounts[node_url(node_id)] = _Down()
        await self.router.membership.crash(node_id)

    def owner(self, key: str) -> str:
        return self.router.membership.view.owner_id(key)


class _Switch(httpx.AsyncBaseTransport):
    """Dispatch by scheme://host to the mounted transports (mutable at runtime)."""

    def __init__(self, mounts: dict[str, httpx.AsyncBaseTransport]) -> None:
        self.mounts = mounts

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        origin = f"{request.url.scheme}://{request.url.host}"
        transport = self.mounts.get(origin)
        if transport is None:
            raise httpx.ConnectError(f"no such host {origin}", request=request)
        return await transport.handle_async_request(request)


class _Down(httpx.AsyncBaseTransport):
    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("node is down", request=request)
