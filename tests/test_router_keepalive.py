"""The router's and the node's keep-alive timer (node/keepalive.py ``lazy_keep_alive``): one
timer per connection, armed when none is pending, instead of uvicorn's one per
response; an idle connection must still close after ``timeout_keep_alive``
seconds, and one whose requests keep coming must not.

uvicorn's protocol with the lazy timer, served on 127.0.0.1 in process, with
an application that answers at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from node.keepalive import lazy_keep_alive
from tests.uvicorn_serving import serving

pytestmark = pytest.mark.anyio

KEEP_ALIVE = 1.0
REQUEST = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def _answer(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    return head + await asyncio.wait_for(reader.readexactly(2), 5)


async def _closed_within(reader: asyncio.StreamReader, seconds: float) -> bool:
    try:
        return await asyncio.wait_for(reader.read(1), seconds) == b""
    except TimeoutError:
        return False


async def test_an_idle_connection_closes_and_a_busy_one_stays_open() -> None:
    """Requests every 0.6 s keep a connection open past the 1 s keep-alive (a
    timer armed by the first answer finds it busy or idle for less than 1 s);
    then, idle, it closes about 1 s after its last answer."""
    protocol = lazy_keep_alive(HttpToolsProtocol)
    loop = asyncio.get_running_loop()
    async with serving(protocol, _app, timeout_keep_alive=int(KEEP_ALIVE)) as (port, state):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):
                writer.write(REQUEST)
                assert (await _answer(reader)).startswith(b"HTTP/1.1 200 ")
                assert not await _closed_within(reader, 0.6 * KEEP_ALIVE)
            # 1.8 s since the first answer, still open; now idle: closed after ~1 s.
            idle_from = loop.time()
            assert await _closed_within(reader, 5.0)
            assert loop.time() - idle_from >= 0.3 * KEEP_ALIVE
        finally:
            writer.close()
        # A connection that never sends a request after its answer closes as well.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(REQUEST)
            await _answer(reader)
            assert await _closed_within(reader, 5.0)
        finally:
            writer.close()
        assert state.total_requests == 4
