"""The forwarding client against a scripted HTTP/1.1 server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import threading
from collections.abc import AsyncIterator

import pytest
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.fastclient import MAX_POOLS, FastForwarder
from router.forward import Answer, AnswerLost, NodeTimeout, Timeouts, Unreachable
from tests.processes import wait_until
from tests.streaming_app import app as streaming_app
from tests.uvicorn_serving import serving

pytestmark = pytest.mark.anyio


#: Answers to HEAD by path (each in one write); ``/head/split`` and
#: ``/head/body-in-parts`` are written in two (see ``Scripted.handle``).
HEAD_ANSWERS = {
    b"/head/chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
    b"/head/unsized": b"HTTP/1.1 200 OK\r\nx-a: 1\r\n\r\n",
    b"/head/304": b'HTTP/1.1 304 Not Modified\r\netag: "e"\r\n\r\n',
    b"/head/close": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nconnection: close\r\n\r\n",
    # A node that sends what it should not after a HEAD's head: its body, in
    # the same write, or a second answer (whose blank line ends the read).
    b"/head/body": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
    b"/head/chunk": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    b"/head/twice": b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n" * 2,
}


async def read_head(reader: asyncio.StreamReader) -> bytes | None:
    """A scripted node's read of a request, up to the end of its head at least
    (None: the connection closed first)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await reader.read(4096)
        if not chunk:
            return None
        data += chunk
    return data


class Scripted:
    """Answers by path; records every request line it saw, and counts connections."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.connections = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        #: Bytes this connection sends ahead of its next answer (``/head/body-in-parts``).
        owed = b""
        try:
            while True:
                data = await read_head(reader)
                if data is None:
                    return
                line = data.split(b"\r\n")[0]
                self.seen.append(line)
                writer.write(owed)
                owed = b""
                path = line.split(b" ")[1]
                if path in HEAD_ANSWERS:
                    writer.write(HEAD_ANSWERS[path])
                    if b"close" in HEAD_ANSWERS[path]:
                        await writer.drain()
                        return
                elif path == b"/head/split":
                    # One head in two reads (the client's parser sees it in parts).
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
                    await writer.drain()
                    await asyncio.sleep(0.05)
                    writer.write(b"ngth: 5\r\n\r\n")
                elif path == b"/head/body-in-parts":
                    # A body after a HEAD's head, the rest of it written ahead of
                    # the next answer: taken for that answer's start, if the
                    # connection were used again.
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhel")
                    owed = b"lo"
                elif line.startswith(b"HEAD"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n")
                elif b"/continue" in line:
                    writer.write(
                        b"HTTP/1.1 100 Continue\r\n\r\n"
                        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                    )
                elif b"/slow" in line:
                    await asyncio.sleep(0.5)
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nslow")
                elif b"/chunked" in line:
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
                    )
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-a: 1\r\n\r\nhello")
                await writer.drain()
        except (asyncio.CancelledError, ConnectionError):
            return
        finally:
            writer.close()


@pytest.fixture
async def server() -> AsyncIterator[tuple[Scripted, str]]:
    scripted = Scripted()
    srv = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield scripted, f"http://127.0.0.1:{port}"
    finally:
        srv.close()


async def test_plain_chunked_and_reuse(server: tuple[Scripted, str]) -> None:
    scripted, url = server
    client = FastForwarder()
    first = await client.request("GET", url + "/a?q=1", [("x-user-id", "u")], None)
    assert (first.status, first.body) == (200, b"hello")
    assert (b"x-a", b"1") in first.headers
    chunked = await client.request("GET", url + "/chunked", [], None)
    assert chunked.body == b"abcde"
    await client.request("POST", url + "/b", [], b"payload")
    assert scripted.seen[0] == b"GET /a?q=1 HTTP/1.1"
    await client.close()


async def test_head_does_not_wait_for_a_body(server: tuple[Scripted, str]) -> None:
    _, url = server
    client = FastForwarder(timeouts=Timeouts(total=5.0))
    answer = await asyncio.wait_for(client.request("HEAD", url + "/x", [], None), 2.0)
    assert (answer.status, answer.body) == (200, b"")
    after = await client.request("GET", url + "/x", [], None)
    assert after.body == b"hello"
    await client.close()


def _length(answer: Answer) -> bytes | None:
    return next((v for k, v in answer.headers if k == b"content-length"), None)


async def test_heads_keep_their_connection(server: tuple[Scripted, str]) -> None:
    """HEADs and a GET after them on one connection, each with its own answer.
    Each HEAD closed its connection (the parser, not knowing the request was
    HEAD, would have waited for the body the length announced): a router fed
    HEADs (uptime monitors, link checkers) left a TIME_WAIT socket to a node per
    request."""
    scripted, url = server
    client = FastForwarder(timeouts=Timeouts(total=5.0))
    try:
        pool, _ = client.base(url)
        kept = None
        for path, status, length in [
            ("/x", 200, b"5"),
            ("/x", 200, b"5"),
            ("/head/chunked", 200, None),
            ("/head/unsized", 200, None),
            ("/head/304", 304, None),
            ("/head/split", 200, b"5"),
            ("/x", 200, b"5"),
        ]:
            answer = await asyncio.wait_for(client.request("HEAD", url + path, [], None), 2.0)
            assert (answer.status, answer.body, answer.sized) == (status, b"", True), path
            assert _length(answer) == length, path  # the node's: what a GET would get
            assert len(pool.idle) == 1 and pool.open == 1, path
            kept = kept or pool.idle[0]
            assert pool.idle[0] is kept, path
        after = await client.request("GET", url + "/x", [], None)
        assert (after.status, after.body, _length(after)) == (200, b"hello", None)
        assert (b"x-a", b"1") in after.headers
        assert scripted.connections == 1 and pool.idle[0] is kept
    finally:
        await client.close()


@pytest.mark.parametrize(
    "path", ["/head/body", "/head/chunk", "/head/twice", "/head/body-in-parts", "/head/close"]
)
async def test_a_head_answer_with_bytes_after_it_closes_its_connection(
    server: tuple[Scripted, str], path: str
) -> None:
    """A node that sends bytes after a HEAD's head (its body, a second answer)
    is not trusted with the next request on that connection: what follows
    the head would be taken for (the start of) the next answer. The HEAD is
    answered, the connection closed, and the next request gets its own answer
    on a new one. So is a HEAD answered with ``connection: close``."""
    scripted, url = server
    client = FastForwarder(timeouts=Timeouts(total=5.0))
    try:
        pool, _ = client.base(url)
        assert (await client.request("GET", url + "/x", [], None)).body == b"hello"
        answer = await asyncio.wait_for(client.request("HEAD", url + path, [], None), 2.0)
        assert (answer.status, answer.body, answer.sized) == (200, b"", True)
        assert _length(answer) == (None if path == "/head/chunk" else b"5")
        for _ in range(3):
            after = await client.request("GET", url + "/x", [], None)
            assert (after.status, after.body) == (200, b"hello")
        assert scripted.connections == 2 and pool.open == 1
    finally:
        await client.close()


@pytest.mark.parametrize("protocol", [HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
async def test_heads_to_uvicorn_keep_their_connection(protocol: type) -> None:
    """The same against uvicorn serving an application that sends a body to
    HEADs too (uvicorn drops it, keeping the length)."""
    client = FastForwarder(timeouts=Timeouts(total=5.0))
    try:
        async with serving(protocol, streaming_app) as (port, state):
            url = f"http://127.0.0.1:{port}"
            pool, _ = client.base(url)
            kept = None
            for _ in range(4):
                answer = await asyncio.wait_for(
                    client.request("HEAD", url + "/bytes/7", [], None), 2.0
                )
                assert (answer.status, answer.body, _length(answer)) == (200, b"", b"7")
                assert len(pool.idle) == 1 and pool.open == 1
                kept = kept or pool.idle[0]
                assert pool.idle[0] is kept
            after = await client.request("GET", url + "/bytes/7", [], None)
            assert (after.status, after.body) == (200, b"x" * 7)
            assert pool.idle[0] is kept and pool.open == 1 and len(state.connections) == 1
    finally:
        await client.close()


async def test_an_interim_100_is_not_taken_for_the_answer(server: tuple[Scripted, str]) -> None:
    _, url = server
    client = FastForwarder()
    answer = await client.request("POST", url + "/continue", [], b"x")
    assert (answer.status, answer.body) == (200, b"ok")
    # The next request on the pooled connection gets its own answer, not a leftover.
    assert (await client.request("GET", url + "/next", [], None)).body == b"hello"
    await client.close()


async def test_a_timeout_is_not_retried_and_is_not_unreachable(
    server: tuple[Scripted, str],
) -> None:
    scripted, url = server
    client = FastForwarder(timeouts=Timeouts(total=0.2))
    await client.request("GET", url + "/warm", [], None)  # a pooled connection to reuse
    with pytest.raises(NodeTimeout):
        await client.request("GET", url + "/slow", [], None)
    await asyncio.sleep(0.6)
    assert [line for line in scripted.seen if b"/slow" in line] == [b"GET /slow HTTP/1.1"]
    assert (await client.request("GET", url + "/x", [], None)).body == b"hello"
    await client.close()


async def test_a_closed_port_is_unreachable() -> None:
    client = FastForwarder(timeouts=Timeouts(connect=0.5, total=1.0))
    with pytest.raises(Unreachable):
        await client.request("GET", "http://127.0.0.1:9/x", [], None)
    await client.close()


def _reset_every_connection(listener: socket.socket, stop: threading.Event) -> None:
    """A node that dies as it accepts: every connection is reset (RST) at once."""
    while not stop.is_set():
        try:
            accepted, _ = listener.accept()
        except OSError:  # the accept timed out: look at ``stop`` again
            continue
        accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        accepted.close()


@pytest.mark.parametrize(
    "anyio_backend",
    [
        pytest.param("asyncio", id="asyncio"),
        pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    ],
)
@pytest.mark.parametrize("pipeline", [1, 16])
async def test_a_connection_reset_before_the_request_is_written(pipeline: int) -> None:
    """A node killed with -9 while the router connects to it: the connection
    is made, then reset, sometimes before the request is written. The
    request is Unreachable (the router's policy for a dead owner applies)
    when it was not written, AnswerLost when it was (a node that read it and
    died as it answered cannot be told apart: not sent again), never an
    error from writing to a closed transport: under uvloop that raised, 4
    times in 50 here, and the router answered 500."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.05)
    stop = threading.Event()
    thread = threading.Thread(target=_reset_every_connection, args=(listener, stop))
    thread.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    client = FastForwarder(pipeline=pipeline, timeouts=Timeouts(connect=0.5, total=1.0))
    try:
        for i in range(150):
            with pytest.raises((Unreachable, AnswerLost)):
                await client.request("GET", f"{url}/{i}", [], None)
    finally:
        stop.set()
        thread.join()
        listener.close()
        await client.close()


async def test_idle_connections_a_node_closes_leave_the_pool() -> None:
    """A node that closes its idle connections (its keep-alive ran out, or it
    stopped) takes them out of the router's pool at once: for a node that left
    the ring no request ever comes to take them out."""
    writers: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while await reader.readuntil(b"\r\n\r\n"):
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    client = FastForwarder()
    try:
        answers = await asyncio.gather(
            *(client.request("GET", url + "/", [], None) for _ in range(3))
        )
        assert [a.status for a in answers] == [200, 200, 200]
        pool, _ = client.base(url)
        assert len(pool.idle) == 3
        for writer in writers:
            writer.close()
        for _ in range(200):  # bounded: 2 s
            if not pool.idle:
                break
            await asyncio.sleep(0.01)
        assert not pool.idle
        # The pool still serves: a new connection is made.
        assert (await client.request("GET", url + "/", [], None)).status == 200
    finally:
        await client.close()
        srv.close()
        await srv.wait_closed()


async def test_pools_of_nodes_long_gone_do_not_pile_up(server: tuple[Scripted, str]) -> None:
    """Every address a node ever had is a pool; past MAX_POOLS, those holding no
    open connection are dropped. A pool whose connections are all in use (a
    busy node) is kept, and its connections go back to it."""
    scripted, url = server
    client = FastForwarder()
    try:
        assert (await client.request("GET", url + "/a", [], None)).status == 200
        live, _ = client.base(url)
        # Three requests in flight: every connection of the pool is in use.
        busy = [
            asyncio.create_task(client.request("GET", url + "/slow", [], None)) for _ in range(3)
        ]
        for _ in range(200):  # bounded: 2 s
            if len(scripted.seen) == 4:
                break
            await asyncio.sleep(0.01)
        assert not live.idle and live.open == 3
        for i in range(MAX_POOLS + 10):
            client.base(f"http://10.0.{i // 250}.{i % 250}:9000")
        assert len(client._pools) <= MAX_POOLS
        assert [a.status for a in await asyncio.gather(*busy)] == [200, 200, 200]
        assert client.base(url)[0] is live and len(live.idle) == 3
        assert (await client.request("GET", url + "/b", [], None)).status == 200
    finally:
        await client.close()


async def test_a_pool_dropped_while_connecting_closes_its_connection(
    server: tuple[Scripted, str],
) -> None:
    """A pool dropped while its first connection was being made (no connection
    open yet) serves that request, then closes the connection rather than
    keeping it where no request would look."""
    _, url = server
    client = FastForwarder()
    try:
        pool, _ = client.base(url)
        pool.dropped = True  # as _forget_unused marks it
        answer = await client.request("GET", url + "/a", [], None)
        assert answer.status == 200 and not pool.idle
        for _ in range(200):  # bounded: 2 s
            if not pool.open:
                break
            await asyncio.sleep(0.01)
        assert pool.open == 0
    finally:
        await client.close()


async def test_a_connection_idle_past_its_timeout_is_closed(server: tuple[Scripted, str]) -> None:
    """A node that died without closing its connections (its host lost, a
    partition) left them idle in the pool for the router's life, a file
    descriptor each, up to max_idle per node, every replaced node's on top of
    the last: nothing closed an idle connection but the node. Closed after
    ``idle_timeout`` now (a live node closes its own sooner: its keep-alive)."""
    _, url = server
    client = FastForwarder(idle_timeout=0.2)
    try:
        answer = await client.request("GET", url + "/a", [], None)
        assert answer.status == 200
        (pool, _) = next(iter(client._pools.values()))
        assert len(pool.idle) == 1 and pool.open == 1
        await wait_until(lambda: pool.open == 0, seconds=2.0)
        assert len(pool.idle) == 0 and pool.open == 0
        # The pool still serves: a new connection.
        assert (await client.request("GET", url + "/b", [], None)).status == 200
    finally:
        await client.close()
    assert client._reaper is None


async def test_a_request_sent_again_goes_on_a_fresh_connection() -> None:
    """A request that found its reused connection closed by the node (no byte
    back) is sent once more: on a fresh connection, not another idle one, which
    the node may have closed as well (two idle connections, both closed by the
    node as a request arrives on them: the retry took the second and lost)."""
    from tests.test_idle_reuse import one_answer_per_connection

    async with one_answer_per_connection() as (url, server):
        forwarder = FastForwarder()
        try:
            first = await asyncio.gather(
                *(forwarder.request("GET", f"{url}/a", [], None) for _ in range(2))
            )
            assert [a.status for a in first] == [200, 200] and server.connections == 2
            again = await forwarder.request("GET", f"{url}/b", [], None)
            assert again.status == 200
            assert (server.connections, server.unanswered) == (3, 1)
        finally:
            await forwarder.close()
