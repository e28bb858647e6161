"""A router reaches its members over the scheme each has: ``http://`` through
the fast client, ``https://`` through aiohttp, whatever its seeds were
(router/forward.py ``SchemeForwarder``).

It chose one client at start, from its seeds: a router started without
``https://`` seeds (a ``--workers`` follower, a restart from ``--state-file``,
members added later) answered every request for an ``https://`` member with
"only http:// is supported by the fast client", and under an ``open`` rule
admitted all of it (found by an exploratory tester).

A TCP server on 127.0.0.1 records the first bytes of each connection: a TLS
handshake starts with 0x16, an HTTP request with its method.
"""

from __future__ import annotations

import asyncio

import pytest

from router.app import RouterSettings, node_forwarder
from router.forward import AiohttpForwarder, AnswerLost, NodeTimeout, Timeouts, Unreachable

pytestmark = pytest.mark.anyio


async def test_a_routers_forwarder_speaks_each_members_scheme() -> None:
    firsts: list[bytes] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(1)
        firsts.append(first)
        if first == b"G":
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    forwarder = node_forwarder(RouterSettings(timeouts=Timeouts(connect=2.0, total=5.0)))
    try:
        plain = await forwarder.request("GET", f"http://127.0.0.1:{port}/x", [], None)
        assert (plain.status, plain.body) == (200, b"ok")
        with pytest.raises((Unreachable, NodeTimeout)) as failed:
            await forwarder.request("GET", f"https://127.0.0.1:{port}/x", [], None)
        assert "only http://" not in str(failed.value)
        # The https request reached the member as a TLS handshake.
        assert firsts == [b"G", b"\x16"], firsts
        assert forwarder.pipelined == {"writes": 0, "requests": 0}
    finally:
        await forwarder.close()
        server.close()
        await server.wait_closed()


async def test_a_reset_after_the_member_read_the_request_is_not_unreachable() -> None:
    """aiohttp (the https:// members' client) says ClientOSError for a connection
    reset after the member read the request, as for one never made; both were
    Unreachable, which a round-robin router sends to the next node and an open
    rule fails over: the request decided twice, run twice by the application
    (found by a review). A reset after the request is AnswerLost (may have been
    decided: never sent again); a connection refused is still Unreachable."""
    import socket
    import struct

    received: list[bytes] = []

    async def read_then_reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        received.append(await reader.readuntil(b"\r\n\r\n"))
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, not FIN

    server = await asyncio.start_server(read_then_reset, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    with socket.socket() as spare:
        spare.bind(("127.0.0.1", 0))
        closed = spare.getsockname()[1]  # bound, not listening: refused
        forwarder = AiohttpForwarder(timeouts=Timeouts(connect=2.0, total=5.0))
        try:
            with pytest.raises(AnswerLost):
                await forwarder.post_json(f"http://127.0.0.1:{port}/v1/check", b"{}", [])
            assert received and received[0].startswith(b"POST /v1/check")
            with pytest.raises(Unreachable):
                await forwarder.post_json(f"http://127.0.0.1:{closed}/v1/check", b"{}", [])
        finally:
            await forwarder.close()
            server.close()
            await server.wait_closed()
