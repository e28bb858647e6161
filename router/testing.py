"""An in-process cluster: a router and N nodes wired through httpx, no sockets.

Every node is an ASGI app mounted on ``http://<id>.cluster`` in one
``httpx.AsyncClient``; the router forwards through that client, the nodes
hand state to each other through it, and the test talks to the router
through it. The clock is shared and injected, so a test can freeze and
advance time::

    async with InProcessCluster(3, config, clock=FrozenClock()) as cluster:
        response = await cluster.client.get("/", headers={"X-User-Id": "alice"})
        await cluster.add_node("n4")

Beyond joins, leaves and crashes it can restart the router (same state file,
or re-discovery from the nodes), restart a node (a fresh process: empty
store, fenced), take a node off the network without telling the router, and
mount a second router on the same nodes (a router with a stale view).
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

ROUTER_URL = "http://router.localhost"


def node_url(node_id: str) -> str:
    return f"http://{node_id}.localhost"


class InProcessCluster:
    def __init__(
        self,
        nodes: int,
        config: ClusterConfig,
        *,
        clock: Clock = system_clock,
        internal_token: str | None = None,
        node_options: dict[str, Any] | None = None,
        router_options: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.internal_token = internal_token
        self.node_options = node_options or {}
        self.router_options = router_options or {}
        self.nodes: dict[str, Node] = {}
        self._mounts: dict[str, httpx.AsyncBaseTransport] = {}
        self._transport = _Switch(self._mounts)
        self.client = httpx.AsyncClient(
            transport=self._transport, base_url=ROUTER_URL, timeout=10.0
        )
        for i in range(1, nodes + 1):
            self._make_node(f"n{i}")
        self.router: Router = self.new_router(
            ROUTER_URL, seeds=[Member(n, node_url(n)) for n in self.nodes]
        )

    def new_router(
        self, url: str, *, client: httpx.AsyncClient | None = None, **settings: Any
    ) -> Router:
        """A router on the same nodes, mounted at ``url`` (not started).

        ``settings`` override the RouterSettings (on top of ``router_options``);
        ``client`` is how it reaches the nodes (default: the shared network).
        """
        client = client or self.client
        options: dict[str, Any] = {
            "config": self.config,
            "internal_token": self.internal_token,
            "health_checks": False,
            "own_urls": (url,),
            **self.router_options,
            **settings,
        }
        router = create_router(
            RouterSettings(**options), forwarder=HttpxForwarder(client), client=client
        )
        self._mounts[url] = httpx.ASGITransport(app=router)  # type: ignore[arg-type]
        return router

    async def restart_router(self, **settings: Any) -> Router:
        """Stop the router and start a new one in its place (its memory is gone).

        With no ``seeds`` given it has none: it must recover the ring from its
        state file (``router_options["state_file"]``).
        """
        await self.router.close()
        settings.setdefault("seeds", [])
        self.router = self.new_router(ROUTER_URL, **settings)
        await self.router.start()
        return self.router

    def restart_node(self, node_id: str, **settings: Any) -> Node:
        """The node's process restarts: same id and url, empty store, fenced.

        The router is not told; it notices (the node is at epoch 0).
        """
        settings.setdefault("fenced", True)
        return self._make_node(node_id, **settings)

    def detached_client(self) -> httpx.AsyncClient:
        """A client on a copy of today's network: later take_down/bring_back calls
        do not affect it (the other side of a partition). The caller closes it."""
        return httpx.AsyncClient(
            transport=_Switch(dict(self._mounts)), base_url=ROUTER_URL, timeout=10.0
        )

    def take_down(self, node_id: str) -> None:
        """The node stops answering, and the router is not told (crash detection's job)."""
        self._mounts[node_url(node_id)] = _Down()

    def bring_back(self, node_id: str) -> None:
        """The node answers again, with whatever it held (the end of a partition)."""
        self._mounts[node_url(node_id)] = httpx.ASGITransport(
            app=self.nodes[node_id]  # type: ignore[arg-type]
        )

    def _make_node(self, node_id: str, **settings: Any) -> Node:
        node = create_app(
            NodeSettings(
                **{
                    "node_id": node_id,
                    "config": self.config,
                    "internal_token": self.internal_token,
                    **self.node_options,
                    **settings,
                }
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

    async def add_node(self, node_id: str, weight: int = 1, **settings: Any) -> Node:
        """Start a node (NodeSettings overrides in ``settings``) and join it."""
        node = self._make_node(node_id, **settings)
        await self.router.membership.join(Member(node_id, node_url(node_id), weight))
        return node

    async def remove_node(self, node_id: str, *, force: bool = False) -> None:
        """A graceful leave (the ring's last node only when ``force``d)."""
        await self.router.membership.leave(node_id, force=force)

    async def crash_node(self, node_id: str) -> None:
        """The node vanishes (its transport now fails) and the router drops it."""
        self.take_down(node_id)
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
