"""ringlimit's pooled clients stop reusing an idle connection before its server
closes it (node/frontdoor.py ``REUSE_IDLE``, below ``KEEP_ALIVE``).

A server closes a keep-alive connection once it has been idle for its
keep-alive; a client that writes a request on it at that moment gets no
answer. aiohttp sends an idempotent request again, never a POST, and httpx
sends nothing again: the POST is lost. Against uvicorn, POSTs sent just as
its keep-alive ran out were lost through the router's aiohttp forwarder and
the nodes' httpx client alike (before this, they reused connections for 30 s
and 5 s: as long as a node keeps one, or longer).

The server here does on purpose what an idle close does by chance: it answers
each connection's first request and closes the connection, unanswered, when
another arrives on it. A client that reuses a connection idle for longer than
``REUSE_IDLE`` fails against it; one that opens a fresh connection succeeds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from node.config import ClusterConfig
from node.frontdoor import KEEP_ALIVE, REUSE_IDLE, FrontDoor
from node.peers import Peers
from node.upstream import UpstreamApp
from router.forward import AiohttpForwarder
from router.membership import Membership

pytestmark = pytest.mark.anyio

ANSWER = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


class OneAnswerPerConnection:
    """Answers the first request of a connection; closes it at the next one."""

    def __init__(self) -> None:
        self.connections = 0
        self.unanswered = 0

    @staticmethod
    async def _request(reader: asyncio.StreamReader) -> None:
        """Read one request, its body sized or chunked (the upstream app streams)."""
        head = await reader.readuntil(b"\r\n\r\n")
        fields = {}
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            fields[name.strip().lower()] = value.strip().lower()
        if fields.get(b"transfer-encoding") == b"chunked":
            while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
                await reader.readexactly(size + 2)
            await reader.readuntil(b"\r\n")
        else:
            await reader.readexactly(int(fields.get(b"content-length", b"0")))

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for answered in (False, True):
                await self._request(reader)
                if answered:
                    self.unanswered += 1
                    return  # the idle close, as this request arrives
                writer.write(ANSWER)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


@contextlib.asynccontextmanager
async def one_answer_per_connection() -> AsyncIterator[tuple[str, OneAnswerPerConnection]]:
    server = OneAnswerPerConnection()
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    port = listening.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        listening.close()


async def _upstream_post(app: UpstreamApp, url: str) -> int:
    """One POST through the node's upstream app; the status it answered."""
    del url  # (the app has its own)
    sent: list[dict[str, Any]] = []
    bodies = iter([{"type": "http.request", "body": b"{}", "more_body": False}])

    async def receive() -> dict[str, Any]:
        message = next(bodies, None)
        if message is None:
            # As an ASGI server: after the body, receive waits until the client
            # goes (this one stays); an immediate disconnect reads as its going.
            await asyncio.Event().wait()
        return message  # type: ignore[return-value]

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/orders",
        "raw_path": b"/v1/orders",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
    }
    await app(scope, receive, send)
    status: int = sent[0]["status"]
    return status


async def _twice_apart(
    name: str, post: Callable[[str], Awaitable[Any]], close: Callable[[], Awaitable[Any]]
) -> str | None:
    """Two requests ``REUSE_IDLE`` and a little apart; what went wrong, if anything."""
    async with one_answer_per_connection() as (url, server):
        try:
            await post(url)
            await asyncio.sleep(REUSE_IDLE + 0.3)
            try:
                answer = await post(url)
            except Exception as exc:  # the lost POST, as each client reports it
                return f"{name}: the second POST failed ({type(exc).__name__})"
            if answer == 502:
                return f"{name}: the second POST got a 502"
            if server.unanswered or server.connections != 2:
                return f"{name}: an idle connection was reused ({server.connections} opened)"
            return None
        finally:
            await close()


async def test_no_client_reuses_a_connection_its_server_may_be_closing() -> None:
    forwarder = AiohttpForwarder()
    # One each: closing a Peers closes both of its pools.
    replicas, transfers = Peers(), Peers()
    membership = Membership(ClusterConfig())
    upstream_app: UpstreamApp | None = None

    async def upstream_post(url: str) -> int:
        nonlocal upstream_app
        if upstream_app is None:
            upstream_app = UpstreamApp(url)
        return await _upstream_post(upstream_app, url)

    async def upstream_close() -> None:
        if upstream_app is not None:
            await upstream_app.close()

    clients: list[tuple[str, Callable[[str], Awaitable[Any]], Callable[[], Awaitable[Any]]]] = [
        (
            "router -> node (aiohttp, https nodes)",
            lambda url: forwarder.request("POST", url + "/v1/check", [], b"{}"),
            forwarder.close,
        ),
        (
            "node -> node replicas (aiohttp)",
            lambda url: replicas.replicate(url, {}),
            replicas.close,
        ),
        (
            "node -> node transfers (httpx)",
            lambda url: transfers.post(url, "/internal/import", {}),
            transfers.close,
        ),
        # A GET (httpx sends nothing again); the router's node reports share its limits.
        ("router -> node control (httpx)", membership.nodes.cluster, membership.close),
        ("node -> upstream (aiohttp)", upstream_post, upstream_close),
    ]
    # At once: the wait is the same for every client.
    problems = await asyncio.gather(*(_twice_apart(*client) for client in clients))
    assert [p for p in problems if p is not None] == []


def test_clients_give_up_idle_connections_before_servers_do() -> None:
    """The margin that makes the test above hold against a real router or node:
    its keep-alive, from when its answer is written, outlasts the clients' reuse,
    from when they have read that answer, by a second; a keep-alive set closer
    than that is warned of."""
    assert FrontDoor().reuse_warning() is None
    assert FrontDoor(keep_alive=REUSE_IDLE + 1).reuse_warning() is None
    said = FrontDoor(keep_alive=REUSE_IDLE + 0.9).reuse_warning()
    assert said is not None and f"{REUSE_IDLE + 1:g} s or more" in said
    assert KEEP_ALIVE >= REUSE_IDLE + 1


def test_up_passes_the_upstream_idle_time_to_its_nodes(tmp_path: Any) -> None:
    from router.cli import build_parser
    from router.supervisor import _node_argv

    args = build_parser().parse_args(
        ["up", "--upstream", "http://127.0.0.1:9", "--upstream-idle", "2.5"]
    )
    argv = _node_argv(args, ClusterConfig(), "n1", "127.0.0.1", 8001, tmp_path / "c.toml")
    assert argv[argv.index("--upstream-idle") + 1] == "2.5"
