"""A node's ``--upstream`` (node/upstream.py ``UpstreamApp``) against real
servers on 127.0.0.1: what reaches the upstream (a body's framing and bytes, the
path and query as the client sent them) and what the client gets when the
upstream's answer has large fields, breaks off or is late.

The upstreams are wsgiref, which Django's runserver builds on and which reads a
body by its ``Content-Length`` only, and a scripted asyncio server that records
each request as it arrived (whole or cut off) and answers by path with exact
bytes. The node's side is ``UpstreamApp`` behind the node's own front door
(uvicorn's httptools protocol with node/frontdoor.py's limits) in the test's
event loop, or a real node process where the flags or the limiter matter.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import threading
import time
import wsgiref.simple_server
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from node.frontdoor import FrontDoor, limited_protocol
from node.upstream import UpstreamApp
from tests.processes import Procs, procs  # noqa: F401 (fixture)
from tests.uvicorn_serving import serving

pytestmark = pytest.mark.anyio

#: Fields of an answer past aiohttp's defaults (128 fields, 8190 bytes a field).
MANY = b"".join(b"x-f-%d: %d\r\n" % (i, i) for i in range(300))
#: A field within the node's 64 KiB, and one past it.
WIDE = b"x-wide: " + b"w" * (60 * 1024) + b"\r\n"
TOO_WIDE = b"x-wide: " + b"w" * (65 * 1024) + b"\r\n"

#: Path -> the whole answer the scripted upstream sends (the echo of the body otherwise).
ANSWERS = {
    b"/many": b"HTTP/1.1 200 OK\r\n" + MANY + b"content-length: 2\r\n\r\nok",
    b"/wide": b"HTTP/1.1 200 OK\r\n" + WIDE + b"content-length: 2\r\n\r\nok",
    b"/too-wide": b"HTTP/1.1 200 OK\r\n" + TOO_WIDE + b"content-length: 2\r\n\r\nok",
    b"/broken": b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nabc",
    b"/broken-chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n",
    b"/chunked": b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
    b"6\r\nhello \r\n5\r\nworld\r\n0\r\n\r\n",
    # A status HTTP does not define (LinkedIn's 999), which aiohttp reads.
    b"/odd-status": b"HTTP/1.1 999 Request denied\r\ncontent-length: 2\r\n\r\nok",
    # A protocol switch nobody asked for (RFC 9110 15.2.2 forbids it).
    b"/switch": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\n"
    b"connection: upgrade\r\n\r\n",
    # An upstream that is itself a ringlimit cluster, refusing.
    b"/ringlimit-fields": b"HTTP/1.1 503 Service Unavailable\r\n"
    b"x-ringlimit-unavailable: lease\r\nx-ringlimit-node: n7\r\ncontent-length: 2\r\n\r\nno",
}
#: Paths after whose answer the upstream closes the connection (mid-body).
CLOSING = {b"/broken", b"/broken-chunked"}
#: A path the upstream answers only after this many seconds (or when stopped).
SLOW, SLOW_SECONDS = b"/slow", 10.0
#: A path the upstream never answers: it waits (at most SLOW_SECONDS) for the
#: node to close the connection, and notes it (``Scripted.dropped``).
HOLD = b"/hold"


@dataclass
class Received:
    """One request as it reached the upstream."""

    head: bytes
    body: bytes
    #: The body arrived to its end (its declared length, or its last chunk).
    whole: bool

    @property
    def target(self) -> bytes:
        return self.head.split(b" ", 2)[1]

    def field(self, name: bytes) -> bytes | None:
        for line in self.head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name:
                return value.strip()
        return None


class Scripted:
    """An HTTP/1.1 upstream that records every request and answers by path."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        #: Set as a request's head arrives, and as it has been read (whole or not).
        self.head_seen = asyncio.Event()
        self.arrived = asyncio.Event()
        #: Set when the node closed a connection whose request waited (HOLD).
        self.dropped = asyncio.Event()
        self._tasks: set[asyncio.Task[Any]] = set()

    @staticmethod
    async def _chunked(reader: asyncio.StreamReader, body: bytearray) -> bool:
        """Read a chunked body into ``body``; whether its last chunk came."""
        for _ in range(100_000):
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # (aiohttp sends no trailers)
                return True
            body += await reader.readexactly(size)
            await reader.readexactly(2)
        return False

    async def _body(self, reader: asyncio.StreamReader, head: bytes) -> tuple[bytes, bool]:
        received = Received(head, b"", False)
        body = bytearray()
        try:
            if received.field(b"transfer-encoding") == b"chunked":
                whole = await self._chunked(reader, body)
                return bytes(body), whole
            body += await reader.readexactly(int(received.field(b"content-length") or b"0"))
            return bytes(body), True
        except asyncio.IncompleteReadError as exc:
            return bytes(body + exc.partial), False

    async def _answer(
        self, request: Received, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Answer ``request``; whether the connection goes on."""
        path = request.target.split(b"?")[0]
        if path == HOLD:
            with contextlib.suppress(TimeoutError):
                if await asyncio.wait_for(reader.read(1), SLOW_SECONDS) == b"":
                    self.dropped.set()
            return False
        if path == SLOW:
            await asyncio.sleep(SLOW_SECONDS)
        answer = ANSWERS.get(path)
        if answer is None:
            answer = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (
                len(request.body),
                request.body,
            )
        writer.write(answer)
        await writer.drain()
        return path not in CLOSING

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            for _ in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                self.head_seen.set()
                body, whole = await self._body(reader, head)
                self.received.append(Received(head, body, whole))
                self.arrived.set()
                if not whole or not await self._answer(self.received[-1], reader, writer):
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            return  # (cancelled: by stop, which awaits it)
        finally:
            writer.close()
            self._tasks.discard(task)

    async def stop(self) -> None:
        """End every connection still served (a slow answer's included)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


@contextlib.asynccontextmanager
async def scripted() -> AsyncIterator[tuple[Scripted, str]]:
    server = Scripted()
    listening = await asyncio.start_server(server.serve, "127.0.0.1", 0)
    try:
        yield server, f"http://127.0.0.1:{listening.sockets[0].getsockname()[1]}"
    finally:
        listening.close()
        await server.stop()


@contextlib.asynccontextmanager
async def node_front(upstream: str, **options: Any) -> AsyncIterator[int]:
    """``UpstreamApp(upstream)`` behind the node's front door: its port."""
    async with node_front_app(upstream, **options) as (port, _):
        yield port


@contextlib.asynccontextmanager
async def node_front_app(upstream: str, **options: Any) -> AsyncIterator[tuple[int, UpstreamApp]]:
    """:func:`node_front`, with the app (its ``stats``)."""
    app = UpstreamApp(upstream, **options)
    protocol = limited_protocol(HttpToolsProtocol, FrontDoor())
    try:
        async with serving(protocol, app, ws="none") as (port, _):
            yield port, app
    finally:
        await app.close()


async def exchange(port: int, request: bytes, seconds: float = 5.0) -> bytes:
    """Everything the server sends back for ``request`` until it closes (the
    requests here say ``Connection: close``)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        return await asyncio.wait_for(reader.read(), seconds)
    finally:
        writer.close()


def request(method: str, target: bytes, fields: bytes = b"", body: bytes = b"") -> bytes:
    return b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n%s\r\n%s" % (
        method.encode(),
        target,
        fields,
        body,
    )


def read_by_wsgiref(body: bytes) -> bytes:
    """What :func:`wsgiref_echo`'s app answers when it read ``body``."""
    return json.dumps({"read": len(body), "sha256": hashlib.sha256(body).hexdigest()}).encode()


@contextlib.contextmanager
def wsgiref_echo() -> Iterator[str]:
    """wsgiref serving an app that reads the body as Django does (``CONTENT_LENGTH``
    bytes of ``wsgi.input``) and answers how much it read and what."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        payload = read_by_wsgiref(body)
        start_response("200 OK", [("Content-Type", "application/json")])
        return [payload]

    with wsgi_serving(app) as url:
        yield url


@contextlib.contextmanager
def wsgi_serving(app: Any) -> Iterator[str]:
    """wsgiref serving the WSGI ``app`` on 127.0.0.1 from a thread: its URL."""

    class Quiet(wsgiref.simple_server.WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    server = wsgiref.simple_server.make_server("127.0.0.1", 0, app, handler_class=Quiet)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def recorded(*names: str) -> Iterator[list[logging.LogRecord]]:
    """The records ``names``' loggers emit meanwhile (uvicorn's do not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.DEBUG)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        yield records
    finally:
        for logger in loggers:
            logger.removeHandler(handler)


# 1. The body: sized when the client sized it, never cut off unnoticed.


async def test_a_sized_body_reaches_an_upstream_that_reads_content_length_only() -> None:
    """wsgiref saw an empty body, without an error, for every request: the node
    sent each chunked, without the Content-Length wsgiref reads by."""
    body = bytes(range(256)) * 1024  # 256 KiB: several reads on the node's side
    with wsgiref_echo() as url:
        async with node_front(url) as port:
            small = await exchange(port, request("POST", b"/s", b"Content-Length: 5\r\n", b"hello"))
            large = await exchange(
                port, request("POST", b"/l", b"Content-Length: %d\r\n" % len(body), body)
            )
    assert small.endswith(read_by_wsgiref(b"hello")), small
    assert large.endswith(read_by_wsgiref(body)), large


async def test_the_framing_the_client_chose_is_the_one_the_upstream_gets() -> None:
    """Sized goes sized (no ``transfer-encoding``); chunked goes chunked."""
    async with scripted() as (upstream, url), node_front(url) as port:
        await exchange(port, request("PUT", b"/sized", b"Content-Length: 3\r\n", b"abc"))
        chunked = b"Transfer-Encoding: chunked\r\n"
        await exchange(
            port, request("PUT", b"/chunked", chunked, b"2\r\nab\r\n1\r\nc\r\n0\r\n\r\n")
        )
    sized, streamed = upstream.received
    assert (sized.field(b"content-length"), sized.field(b"transfer-encoding")) == (b"3", None)
    assert (streamed.field(b"content-length"), streamed.field(b"transfer-encoding")) == (
        None,
        b"chunked",
    )
    assert sized.body == streamed.body == b"abc" and sized.whole and streamed.whole


@pytest.mark.parametrize(
    "framing, sent",
    [(b"Content-Length: 10\r\n", b"abc"), (b"Transfer-Encoding: chunked\r\n", b"3\r\nabc\r\n")],
    ids=["sized", "chunked"],
)
async def test_a_body_its_client_abandons_never_reaches_the_upstream_whole(
    framing: bytes, sent: bytes
) -> None:
    """The client sends 3 bytes and goes. Before: the node ended the body there,
    and the upstream took ``abc`` as a whole (chunked) request. Now the node
    closes the upstream connection: nothing arrives whole, nothing waits."""
    async with scripted() as (upstream, url), node_front_app(url) as (port, app):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(request("POST", b"/cut", framing, sent))
            await asyncio.wait_for(upstream.head_seen.wait(), 3)
        finally:
            writer.close()
        await asyncio.wait_for(upstream.arrived.wait(), 3)
        for _ in range(100):  # the node's side ends a moment later
            if app.stats.abandoned:
                break
            await asyncio.sleep(0.02)
    assert [r.whole for r in upstream.received] == [False]
    assert upstream.received[0].body in (b"", b"abc")
    # The client's going, not the upstream's failure (any client could raise that).
    assert (app.stats.abandoned, app.stats.unavailable) == (1, 0)


async def test_a_body_longer_than_declared_is_not_sent_on() -> None:
    """A server that passes more body than the request declared (none of
    uvicorn's parsers does) must not make the node write the excess to the
    upstream, where it would be read as the start of the next request."""
    parts = iter([b"0123456789", b"XX"])

    async def receive() -> dict[str, Any]:
        part = next(parts, None)
        if part is None:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": part, "more_body": part != b"XX"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/over",
        "raw_path": b"/over",
        "query_string": b"",
        "headers": [(b"content-length", b"10")],
    }
    async with scripted() as (upstream, url):
        app = UpstreamApp(url)
        try:
            await asyncio.wait_for(app(scope, receive, send), 5)
        finally:
            await app.close()
        await asyncio.wait_for(upstream.arrived.wait(), 3)
    assert [r.body for r in upstream.received] == [b"0123456789"]
    assert sent[0]["status"] == 502  # (the excess was noticed, not dropped unsaid)


async def test_a_real_node_sends_a_posted_body_to_wsgiref(procs: Procs) -> None:  # noqa: F811
    """The reported case end to end: a node process (limiter and all) in front
    of wsgiref, a POST with a JSON body, as httpx sends it (sized)."""
    body = json.dumps({"order": 42, "items": ["a", "b"]}).encode()
    with wsgiref_echo() as url:
        _, node = await asyncio.to_thread(procs.node, "n1", None, "--upstream", url)
        async with httpx.AsyncClient(base_url=node, timeout=5) as client:
            answer = await client.post("/orders", content=body, headers={"x-user-id": "u1"})
    assert answer.status_code == 200 and answer.content == read_by_wsgiref(body)


# 2. The path and query, byte for byte.


@pytest.mark.parametrize(
    "target",
    [
        b"/p%3A%40%3B?redirect=https%3A%2F%2Fexample.com%2Fcb%3Fx%3D1&s=%zz",
        b"/a%2Fb/%7Euser;v=1?q=a+b%20c&q=%E2%82%AC&sig=abc%3D%3D",
        b"/x/./y/../z?",
    ],
    ids=["reported", "escapes", "dot-segments"],
)
async def test_the_path_and_query_arrive_as_the_client_sent_them(target: bytes) -> None:
    """A signed URL or an HMAC over the query fails on any re-encoding: yarl
    decoded ``%3A`` and ``%2F`` and quoted ``%zz`` as ``%25zz``."""
    async with scripted() as (upstream, url), node_front(url + "/base/") as port:
        answer = await exchange(port, request("GET", target))
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
    expected = b"/base" + (target[:-1] if target.endswith(b"?") else target)
    assert [r.target for r in upstream.received] == [expected]


# 3. An answer that breaks off after it began.


@pytest.mark.parametrize("path", [b"/broken", b"/broken-chunked"])
async def test_an_answer_that_breaks_off_is_cut_off_for_the_client_with_one_line(
    path: bytes,
) -> None:
    """The upstream declares 100 bytes (or chunks), sends 3 and closes. Before,
    the node tried to start a 502 after its 200 had gone out: uvicorn logged a
    RuntimeError traceback. Now one warning, and the client's connection closes
    with the answer short (never a complete answer, nor a second head)."""
    async with scripted() as (_, url), node_front(url) as port:
        with recorded("uvicorn.error", "ringlimit.node") as records:
            answer = await exchange(port, request("GET", path))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and b"HTTP/1.1" not in body
    assert body == b"abc" if path == b"/broken" else body == b"3\r\nabc\r\n"
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    warned = [r.getMessage() for r in records if r.name == "ringlimit.node"]
    assert len(warned) == 1 and "broke off" in warned[0], warned


# 4. Answers with many or long fields.


async def test_answer_fields_up_to_the_front_doors_64_kib_are_relayed() -> None:
    """300 fields, and one of 60 KiB, were each ``502 upstream_unavailable
    ClientResponseError`` (aiohttp's 128 fields, 8190 bytes a field). Past
    64 KiB a field is still refused, as the node refuses such a request."""
    async with scripted() as (_, url), node_front(url) as port:
        many = await exchange(port, request("GET", b"/many"))
        wide = await exchange(port, request("GET", b"/wide"))
        too_wide = await exchange(port, request("GET", b"/too-wide"))
    assert many.startswith(b"HTTP/1.1 200 ") and MANY in many and many.endswith(b"\r\n\r\nok")
    assert wide.startswith(b"HTTP/1.1 200 ") and WIDE in wide and wide.endswith(b"\r\n\r\nok")
    assert too_wide.startswith(b"HTTP/1.1 502 ") and b"upstream_unavailable" in too_wide
    # Saying what was wrong: "ClientResponseError from upstream" said nothing (a tester).
    detail = json.loads(too_wide.partition(b"\r\n\r\n")[2])["detail"]
    assert detail.startswith("the upstream's answer cannot be read: "), detail
    assert "Got more than 65536 bytes" in detail and "www" not in detail, detail


# 5. --upstream-timeout.


async def test_upstream_timeout_is_a_node_flag(procs: Procs) -> None:  # noqa: F811
    """The timeout was 30 s, fixed. A node with ``--upstream-timeout 0.5``
    answers a slow upstream's request 502 within about that, and serves the next."""
    async with scripted() as (_, url):
        argv = ["--upstream", url, "--upstream-timeout", "0.5"]
        _, node = await asyncio.to_thread(procs.node, "n1", None, *argv)
        async with httpx.AsyncClient(base_url=node, timeout=5) as client:
            began = time.monotonic()
            slow = await client.get(SLOW.decode(), headers={"x-user-id": "u1"})
            waited = time.monotonic() - began
            quick = await client.post("/echo", content=b"hi", headers={"x-user-id": "u1"})
    assert slow.status_code == 502 and slow.json()["error"] == "upstream_unavailable"
    assert 0.4 < waited < 2.0, waited
    assert quick.status_code == 200 and quick.content == b"hi"


async def test_an_http_10_client_gets_a_chunked_upstream_answer_as_its_bytes(
    procs: Procs,  # noqa: F811
) -> None:
    """The upstream answers chunked; a node relays it without a length, which
    uvicorn chunked for any client. An HTTP/1.0 client cannot read chunks
    (RFC 9112 6.1): it gets the bytes, then the connection's close, even when it
    asked to keep the connection; an HTTP/1.1 client still gets them chunked."""
    async with scripted() as (_, url):
        _, node = await asyncio.to_thread(procs.node, "n1", None, "--upstream", url)
        port = int(node.rsplit(":", 1)[1])
        old = await exchange(
            port, b"GET /chunked HTTP/1.0\r\nX-User-Id: u\r\nConnection: keep-alive\r\n\r\n"
        )
        new = await exchange(port, request("GET", b"/chunked", b"X-User-Id: u\r\n"))
    head, _, body = old.partition(b"\r\n\r\n")
    fields = head.lower().split(b"\r\n")
    assert fields[0] == b"http/1.1 200 ok" and body == b"hello world", old
    assert b"connection: close" in fields and b"ratelimit-policy" in head
    assert not [f for f in fields if f.startswith((b"transfer-encoding", b"content-length"))]
    head, _, body = new.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower().split(b"\r\n")
    assert dechunked(body) == b"hello world", new


def dechunked(body: bytes) -> bytes:
    """A chunked body's bytes (however the relay cut them), with its last chunk."""
    out = b""
    while True:
        size, _, body = body.partition(b"\r\n")
        data, end, body = (
            body[: int(size, 16)],
            body[int(size, 16) :][:2],
            body[int(size, 16) + 2 :],
        )
        assert end == b"\r\n"
        if not data:
            assert body == b""
            return out
        out += data


def test_up_passes_the_upstream_timeout_to_its_nodes(tmp_path: Any) -> None:
    from node.config import UPSTREAM_TIMEOUT, ClusterConfig
    from router.cli import build_parser
    from router.supervisor import _node_argv

    parser = build_parser()
    args = parser.parse_args(
        ["up", "--upstream", "http://127.0.0.1:9", "--upstream-timeout", "7.5"]
    )
    argv = _node_argv(args, ClusterConfig(), "n1", "127.0.0.1", 8001, tmp_path / "c.toml")
    assert argv[argv.index("--upstream-timeout") + 1] == "7.5"
    node = parser.parse_args(["node", "--id", "n1", "--port", "1"])
    assert node.upstream_timeout == UPSTREAM_TIMEOUT


# 6. The client's going, Expect, statuses HTTP does not define.


async def test_a_client_that_goes_away_stops_the_upstreams_request() -> None:
    """uvicorn's send does nothing once the client is gone, and the node never
    asked whether it was: a request a router had given up on ran to the
    upstream timeout (30 s), holding one of the pool's connections, and other
    users' requests queued behind such ones. Now the upstream's connection is
    closed as the client's is, and the request counted as abandoned."""
    async with scripted() as (upstream, url), node_front_app(url) as (port, app):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.wait_for(upstream.head_seen.wait(), 5)
        writer.close()
        began = time.monotonic()
        await asyncio.wait_for(upstream.dropped.wait(), 5)
        assert time.monotonic() - began < 2.0
        for _ in range(100):  # the node's side of it ends a moment later
            if app.stats.abandoned:
                break
            await asyncio.sleep(0.02)
        assert app.stats.abandoned == 1 and app.stats.unavailable == 0
        # And an answer read to its end is not abandoned.
        answer = await exchange(port, request("POST", b"/echo", b"content-length: 2\r\n", b"hi"))
        assert answer.endswith(b"\r\n\r\nhi") and app.stats.abandoned == 1


async def test_an_upload_that_expects_100_continue_reaches_an_upstream_that_sends_none() -> None:
    """The node passed ``Expect: 100-continue`` on: aiohttp waited for the
    upstream's own 100 before sending the body, an upstream that sends none
    (Python's http.server) waited for the body, and the upload was a 502 after
    the whole upstream timeout (curl sends it with every body over 1 MiB).
    The node's server answers the client's 100 itself; the upstream gets the
    body, without the field."""
    body = b"x" * 100_000
    async with scripted() as (upstream, url), node_front(url, timeout=3.0) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                b"Expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body)
            )
            began = time.monotonic()
            go_on = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert go_on.startswith(b"HTTP/1.1 100 "), go_on
            writer.write(body)
            answer = await asyncio.wait_for(reader.read(), 5)
            waited = time.monotonic() - began
        finally:
            writer.close()
    assert answer.startswith(b"HTTP/1.1 200 ") and answer.endswith(body), answer[:200]
    assert waited < 2.0, waited
    assert upstream.received[-1].field(b"expect") is None


@pytest.mark.parametrize(
    ("path", "detail"),
    [
        (b"/odd-status", "the upstream answered status 999, outside 200-599"),
        (b"/switch", "the upstream answered status 101 as its final answer, outside 200-599"),
    ],
)
async def test_a_status_http_does_not_define_is_a_502_not_a_traceback(
    path: bytes, detail: str
) -> None:
    """aiohttp reads any three digits; the node's server writes 100-599 only:
    a status of 999 was a KeyError traceback and a connection closed without
    an answer, for every request (behind a router, a 504 node_timeout). A final
    101 (a switch no client asked for) was relayed as a 101 with a chunked body,
    the connection then serving HTTP on (an exploratory tester)."""
    async with scripted() as (_, url), node_front_app(url) as (port, app):
        with recorded("uvicorn.error", "ringlimit.node") as records:
            answer = await exchange(port, request("GET", path))
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502 "), answer
    assert json.loads(body) == {"error": "upstream_unavailable", "detail": detail}
    assert not [r for r in records if r.exc_info], [r.getMessage() for r in records]
    assert app.stats.invalid == 1


async def test_an_upstream_that_answers_nothing_is_counted_and_said_once() -> None:
    """A refused upstream made every request a 502 with no log line and no
    metric: now one warning per 10 s (saying how many since) and
    ringlimit_upstream_unavailable_total."""
    async with node_front_app("http://127.0.0.1:9") as (port, app):
        with recorded("ringlimit.node") as records:
            answers = [await exchange(port, request("GET", b"/x")) for _ in range(3)]
    assert all(a.startswith(b"HTTP/1.1 502 ") for a in answers)
    assert app.stats.unavailable == 3
    warned = [r.getMessage() for r in records if r.name == "ringlimit.node"]
    assert len(warned) == 1 and "did not answer GET /x" in warned[0], warned


async def test_answers_the_upstream_breaks_off_log_one_line_not_one_each() -> None:
    """uvicorn logged ``ASGI callable returned without completing response.``
    for each answer an upstream broke off, beside the node's own throttled
    warning: a flood when an upstream keeps dying. Now once per 10 s too."""
    async with scripted() as (_, url), node_front_app(url) as (port, app):
        with recorded("uvicorn.error", "ringlimit.node") as records:
            for _ in range(5):
                await exchange(port, request("GET", b"/broken"))
    assert app.stats.broke_off == 5
    lines = [r.getMessage() for r in records]
    assert len([m for m in lines if "without completing" in m]) == 1, lines
    assert len([m for m in lines if "broke off" in m]) == 1, lines


async def test_a_nodes_metrics_count_what_went_wrong_with_its_upstream() -> None:
    from node.app import NodeSettings, create_app
    from node.config import ClusterConfig

    app = UpstreamApp("http://127.0.0.1:9")
    node = create_app(NodeSettings(node_id="n1", config=ClusterConfig()), app=app)
    app.stats.unavailable, app.stats.abandoned = 2, 1
    transport = httpx.ASGITransport(app=node, client=("127.0.0.1", 4000))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        text = (await client.get("/metrics")).text
    await app.close()
    assert "ringlimit_upstream_unavailable_total 2.0" in text, text
    assert "ringlimit_upstream_abandoned_total 1.0" in text
    assert "ringlimit_upstream_broke_off_total 0.0" in text


async def test_an_upstreams_own_ringlimit_fields_are_not_relayed() -> None:
    """An upstream that is itself a ringlimit cluster answers its 503s with
    x-ringlimit-unavailable: relayed, this node's router took it for this
    node's refusal and sent the request again to another node, which called
    the application a second time (found by a review)."""
    async with scripted() as (_, url), node_front(url) as port:
        answer = await exchange(port, request("GET", b"/ringlimit-fields"))
    head = answer.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 503 ") and answer.endswith(b"no")
    assert b"x-ringlimit-" not in head, head
