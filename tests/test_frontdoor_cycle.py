"""The front door's ``send`` (node/frontdoor.py ``checked_send``) writes what
uvicorn's own writes: the same bytes for every answer, the same errors for bad
fields, the same framing and keep-alive, whether a field is new or remembered.

Each case goes through uvicorn's httptools protocol twice on a transport that
records its writes: plain, and with the front door's limits (and its cycle).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

from node.frontdoor import FrontDoor, limited_protocol

DEFAULTS = [(b"date", b"Fri, 27 Nov 2026 18:00:00 GMT"), (b"server", b"uvicorn")]


class Recorder:
    """A transport that keeps what is written to it."""

    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 80)}.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def answering(start: dict[str, Any], body: bytes) -> Any:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send(start)
        await send({"type": "http.response.body", "body": body})

    return app


async def serve(
    protocol_class: type, app: Any, requests: bytes, times: int, *, access_log: bool = False
) -> tuple[bytes, bool]:
    """Everything written answering ``requests`` ``times`` times on one connection
    (with uvicorn's access log on or off)."""
    config = uvicorn.Config(app, lifespan="off", log_level="critical", access_log=access_log)
    config.load()
    state = ServerState()
    state.default_headers = list(DEFAULTS)
    loop = asyncio.get_running_loop()
    protocol = protocol_class(config=config, server_state=state, app_state={}, _loop=loop)
    transport = Recorder()
    protocol.connection_made(transport)
    for _ in range(times):
        protocol.data_received(requests)
        for _ in range(20):
            await asyncio.sleep(0)
    protocol.connection_lost(None)
    return transport.out, transport.closed


GET = b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n"
HEAD = b"HEAD /x HTTP/1.1\r\nHost: a\r\n\r\n"
CASES = {
    "rate-limit fields": (
        GET,
        200,
        [
            (b"content-type", b"application/json"),
            (b"content-length", b"2"),
            (b"ratelimit-policy", b'"bench";q=1000;w=1'),
            (b"ratelimit", b'"bench";r=999;t=1'),
            (b"X-RateLimit-Limit", b"1000"),
        ],
        b"{}",
    ),
    "lists and a bytearray": (
        GET,
        200,
        [[b"content-length", b"2"], [b"x-a", b"1"], (b"x-b", bytearray(b"2"))],
        b"{}",
    ),
    "no length: chunked": (GET, 200, [(b"content-type", b"text/plain")], b"hi"),
    "connection close": (
        GET,
        200,
        [(b"content-length", b"2"), (b"Connection", b"Close")],
        b"{}",
    ),
    "head": (HEAD, 200, [(b"content-type", b"text/plain")], b""),
    "no content": (GET, 204, [(b"x-a", b"1")], b""),
    "transfer-encoding": (
        GET,
        200,
        [(b"transfer-encoding", b"chunked")],
        b"ok",
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_cycle_writes_what_uvicorns_writes(case: str) -> None:
    request, status, headers, body = CASES[case]
    start = {"type": "http.response.start", "status": status, "headers": headers}
    app = answering(start, body)

    async def both() -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        front = limited_protocol(HttpToolsProtocol, FrontDoor())
        # Three answers each: the first checks the fields, the others remember them.
        return await serve(HttpToolsProtocol, app, request, 3), await serve(front, app, request, 3)

    plain, checked = asyncio.run(both())
    assert checked == plain
    assert plain[0].count(b"HTTP/1.1 ") >= 1


@pytest.mark.parametrize(
    ("field", "error"),
    [
        ((b"bad name", b"1"), "Invalid HTTP header name."),
        ((b"x-a", b"1\r\nx-b: 2"), "Invalid HTTP header value."),
    ],
)
def test_a_bad_field_is_refused_every_time(field: tuple[bytes, bytes], error: str) -> None:
    """A bad field fails the answer (uvicorn's error, then its 500), and is never
    remembered: the second answer carrying it fails too."""
    errors: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [field]})
        except RuntimeError as exc:
            errors.append(str(exc))
            raise

    async def both() -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        front = limited_protocol(HttpToolsProtocol, FrontDoor())
        return await serve(HttpToolsProtocol, app, GET, 2), await serve(front, app, GET, 2)

    plain, checked = asyncio.run(both())
    assert checked == plain
    assert errors == [error] * len(errors) and len(errors) >= 2


def test_the_front_door_serves_with_its_send() -> None:
    """The app gets the front door's ``send`` (not uvicorn's) on uvicorn's cycle."""
    seen: list[type] = []
    sends: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        seen.append(type(send.__self__))
        sends.append(send)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def once() -> None:
        await serve(limited_protocol(HttpToolsProtocol, FrontDoor()), app, GET, 1)

    asyncio.run(once())
    assert len(seen) == 1
    assert seen[0] is RequestResponseCycle
    assert sends[0].__func__ is not RequestResponseCycle.send


def test_long_fields_are_not_remembered() -> None:
    """An app that echoes a request's value (up to the header limit) into its answer
    must not make the remembered fields grow with it: 600 answers with a distinct
    32 KB field each leave well under what they would hold (~38 MB) once served."""
    import gc
    import tracemalloc

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        echo = dict(scope["headers"])[b"x-echo"]
        headers = [(b"content-length", b"2"), (b"x-echo", echo)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    front = limited_protocol(HttpToolsProtocol, FrontDoor())

    async def run() -> int:
        config = uvicorn.Config(app, lifespan="off", log_level="critical", access_log=False)
        config.load()
        state = ServerState()
        loop = asyncio.get_running_loop()
        tracemalloc.start()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for i in range(600):
            protocol = front(config=config, server_state=state, app_state={}, _loop=loop)
            transport = Recorder()
            protocol.connection_made(transport)
            value = b"%06d" % i + b"a" * 32_000
            protocol.data_received(b"GET / HTTP/1.1\r\nHost: a\r\nX-Echo: " + value + b"\r\n\r\n")
            for _ in range(20):
                await asyncio.sleep(0)
            assert transport.out.startswith(b"HTTP/1.1 200 ")
            protocol.connection_lost(None)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        return kept

    assert asyncio.run(run()) < 4_000_000


@pytest.mark.parametrize("mode", ["off", "direct"])
def test_a_served_request_leaves_no_garbage_for_the_collector(mode: str) -> None:
    """A node's request, served through its real protocol (benchmarks/requestpath.py's
    fake transport), is freed by reference counting. The front door's ``send``,
    bound to its cycle and kept on it, made every request's cycle, scope and
    all they held a reference cycle: 9 (limiter off) to 14 (on) objects a
    request for the garbage collector."""
    import gc
    from functools import partial
    from operator import getitem

    from benchmarks import requestpath
    from node.app import NodeSettings, create_app
    from node.config import ClusterConfig

    box = [1_000_000.0]
    config = requestpath.bench_config() if mode == "direct" else ClusterConfig()
    node = create_app(NodeSettings(node_id="x", config=config), clock=partial(getitem, box, 0))
    payloads = requestpath.requests([f"user:{i}" for i in range(100)], routed=False)

    async def garbage(requests: int) -> int:
        """Objects only the collector frees, of a connection serving ``requests``."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            answers = await requestpath.drive(node, payloads, box, requests)
            gc.collect()
            assert all(b" 200 OK" in answer for answer in answers)
            return len(gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            if enabled:
                gc.enable()

    async def main() -> list[float]:
        await requestpath.drive(node, payloads, box, 200)  # warm: caches, first states
        few, many = await garbage(100), await garbage(600)
        # What a connection leaves once (its protocol, the server's config) cancels out.
        return [(many - few) / 500]

    per_request = requestpath.run(main())[0]
    assert per_request < 0.05, per_request


def limited(
    start: dict[str, Any],
    body: bytes,
    *,
    legacy: bool = True,
    paths: tuple[str, ...] = (),
    rule: tuple[str, str] = ("api", "2/minute"),
    app: Any = None,
) -> Any:
    """``answering(start, body)`` (or ``app``) behind RateLimitMiddleware (``rule``:
    its name and rate, ``2/minute`` by default; one user, a frozen clock; on
    ``paths`` only, if given): two answers allowed, then 429s."""
    from node.authority import Authority
    from node.config import ClusterConfig
    from node.middleware import RateLimitMiddleware

    config = ClusterConfig.from_dict(
        {
            "rules": [
                {"name": rule[0], "rate": rule[1], **({"paths": list(paths)} if paths else {})}
            ],
            "identity": {"source": "header", "name": "X-User"},
            "headers": {"legacy": legacy},
        }
    )
    clock = lambda: 1_000_000.0  # noqa: E731
    authority = Authority.in_memory(config, clock=clock)
    return RateLimitMiddleware(
        app or answering(start, body), authority=authority, trust_router=False, wall_clock=clock
    )


LIMITED_GET = b"GET /x HTTP/1.1\r\nHost: a\r\nX-User: u1\r\n\r\n"
LIMITED_HEAD = b"HEAD /x HTTP/1.1\r\nHost: a\r\nX-User: u1\r\n\r\n"
#: Answered, then closed: the fields go before uvicorn's ``connection: close``.
LIMITED_CLOSE = b"GET /x HTTP/1.1\r\nHost: a\r\nX-User: u1\r\nConnection: close\r\n\r\n"
LIMITED_HTTP10 = b"GET /x HTTP/1.0\r\nHost: a\r\nX-User: u1\r\n\r\n"


@pytest.mark.parametrize("legacy", [True, False])
@pytest.mark.parametrize("access_log", [False, True])
@pytest.mark.parametrize(
    ("request_bytes", "headers", "body"),
    [
        (LIMITED_GET, [(b"content-type", b"text/plain"), (b"content-length", b"2")], b"ok"),
        (LIMITED_GET, [(b"Content-Type", b"text/plain")], b"chunked"),
        (LIMITED_HEAD, [(b"content-length", b"2")], b""),
        (LIMITED_GET, [[b"x-list", b"1"], (b"content-length", b"2")], b"ok"),
        (LIMITED_CLOSE, [(b"content-length", b"2")], b"ok"),
        # (An HTTP/1.0 answer without a length is not chunked, as uvicorn's is: below.)
        (LIMITED_HTTP10, [(b"content-type", b"text/plain"), (b"content-length", b"2")], b"ok"),
    ],
    ids=["length", "chunked", "head", "list-field", "connection-close", "http-1.0"],
)
def test_a_limited_answer_under_the_front_door_is_uvicorns_byte_for_byte(
    legacy: bool, access_log: bool, request_bytes: bytes, headers: list[Any], body: bytes
) -> None:
    """Under a node's front door RateLimitMiddleware hands its fields to the
    server (the ``ringlimit.response_fields`` extension, written as lines
    checked once) instead of wrapping ``send``; under plain uvicorn it wraps
    ``send``. Allowed answers, a 429 and the keep-alive after it: the same
    bytes either way, with the access log on too (the front door then
    answers through uvicorn's own ``send``, with the fields as pairs)."""
    start = {"type": "http.response.start", "status": 200, "headers": headers}

    async def both() -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        front = limited_protocol(HttpToolsProtocol, FrontDoor())
        return (
            await serve(
                HttpToolsProtocol,
                limited(start, body, legacy=legacy),
                request_bytes,
                3,
                access_log=access_log,
            ),
            await serve(
                front, limited(start, body, legacy=legacy), request_bytes, 3, access_log=access_log
            ),
        )

    plain, checked = asyncio.run(both())
    assert checked == plain
    answers = plain[0].split(b"HTTP/1.1 ")[1:]
    if request_bytes in (LIMITED_CLOSE, LIMITED_HTTP10):
        assert [a[:3] for a in answers] == [b"200"]  # and the connection closed
        assert plain[1] and b"\r\nconnection: close\r\n" in answers[0]
    else:
        assert [a[:3] for a in answers] == [b"200", b"200", b"429"]
    assert all(b"\r\nratelimit: " in a for a in answers)
    assert all((b"\r\nx-ratelimit-remaining: " in a) == legacy for a in answers)


LIMITED_HTTP10_KEPT = b"GET /x HTTP/1.0\r\nHost: a\r\nX-User: u1\r\nConnection: keep-alive\r\n\r\n"


def in_parts(start: dict[str, Any], parts: list[bytes]) -> Any:
    """An app that answers ``start`` and then each of ``parts`` as a message of its own."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send(start)
        for i, part in enumerate(parts):
            await send(
                {"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1}
            )

    return app


@pytest.mark.parametrize("limiter", [True, False], ids=["limited", "plain app"])
@pytest.mark.parametrize("access_log", [False, True])
@pytest.mark.parametrize(
    "request_bytes", [LIMITED_HTTP10, LIMITED_HTTP10_KEPT], ids=["1.0", "1.0 keep-alive"]
)
@pytest.mark.parametrize(
    ("parts", "fields"),
    [
        ([b"hello ", b"", b"world"], []),
        ([b"hello world"], []),
        ([b""], []),
        ([b"hello ", b"world"], [(b"Transfer-Encoding", b"gzip")]),  # a coding, not a framing
    ],
    ids=["3 parts", "1", "empty", "gzip coding"],
)
def test_an_http_10_client_gets_an_answer_without_a_length_unchunked_then_the_close(
    limiter: bool,
    access_log: bool,
    request_bytes: bytes,
    parts: list[bytes],
    fields: list[tuple[bytes, bytes]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An HTTP/1.0 client cannot read the chunked coding (RFC 9112 6.1: a server
    MUST NOT send it to one): an answer of unknown length goes to it as its
    bytes, ended by the connection's close (RFC 9112 6.3), which uvicorn makes
    after any HTTP/1.0 answer, asked to keep the connection or not. uvicorn
    chunked it (curl reads that anyway; ``ab`` does not). A transfer coding
    other than chunked does not frame it. Both of the front door's ways
    to write an answer's start (its own; uvicorn's, with the access log on)."""
    start = {"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"1"), *fields]}
    app = in_parts(start, parts)
    app = limited(start, b"", app=app) if limiter else app
    # uvicorn's cycle logs what the app's send raised (it closes the connection too:
    # the same bytes out), "Response content shorter than Content-Length" for one.
    errors: list[Any] = []
    monkeypatch.setattr(
        logging.getLogger("uvicorn.error"), "error", lambda *a, **k: errors.append(a)
    )

    async def once() -> tuple[bytes, bool]:
        door = limited_protocol(HttpToolsProtocol, FrontDoor())
        return await serve(door, app, request_bytes, 1, access_log=access_log)

    out, closed = asyncio.run(once())
    head, _, body = out.partition(b"\r\n\r\n")
    written = head.lower().split(b"\r\n")[1:]
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and closed
    assert body == b"".join(parts)
    assert b"connection: close" in written and b"x-a: 1" in written
    framing = [f for f in written if f.startswith((b"transfer-encoding", b"content-length"))]
    assert framing == [b"%s: %s" % (n.lower(), v) for n, v in fields]
    assert (b'ratelimit: "api";r=1;t=30' in written) == limiter
    assert errors == []


@pytest.mark.parametrize(
    ("request_bytes", "status", "headers"),
    [
        (LIMITED_GET, 200, []),  # HTTP/1.1: chunked
        (LIMITED_HTTP10, 200, [(b"content-length", b"11")]),
        (LIMITED_HTTP10, 200, [(b"transfer-encoding", b"chunked")]),  # the app's own choice
        (LIMITED_HTTP10.replace(b"GET", b"HEAD"), 200, []),
        (LIMITED_HTTP10, 204, []),
        (LIMITED_HTTP10, 304, []),
    ],
    ids=["1.1", "1.0 length", "1.0 app's chunked", "1.0 head", "1.0 204", "1.0 304"],
)
@pytest.mark.parametrize("access_log", [False, True])
def test_every_other_answer_is_framed_as_uvicorn_frames_it(
    request_bytes: bytes, status: int, headers: list[Any], access_log: bool
) -> None:
    """Only an HTTP/1.0 request's answer that has a body and no framing of its
    own is written to its close: the rest, byte for byte as uvicorn writes them
    (two requests sent: the HTTP/1.0 cases close after the first answer)."""
    start = {"type": "http.response.start", "status": status, "headers": headers}
    body = b"" if status in (204, 304) else b"hello world"

    async def both() -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        front = limited_protocol(HttpToolsProtocol, FrontDoor())
        app = answering(start, body)
        return (
            await serve(HttpToolsProtocol, app, request_bytes, 2, access_log=access_log),
            await serve(front, app, request_bytes, 2, access_log=access_log),
        )

    plain, checked = asyncio.run(both())
    assert checked == plain


def test_under_the_front_door_the_middleware_hands_its_fields_over_unwrapped() -> None:
    """The app behind RateLimitMiddleware gets the front door's own ``send``
    (no wrapper per request), and the allowed request's fields wait in the
    ``ringlimit.response_fields`` extension. Under plain uvicorn there is no
    such extension, and ``send`` is wrapped."""
    from node.asgi import RESPONSE_FIELDS
    from node.headers import Rendered

    def watched(seen: list[tuple[str, list[type]]]) -> Any:
        middleware = limited({"type": "http.response.start", "status": 200, "headers": []}, b"")
        inner = middleware.app

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            added = scope.get("extensions", {}).get(RESPONSE_FIELDS)
            seen.append((send.__name__, [type(entry) for entry in (added or {}).values()]))
            await inner(scope, receive, send)

        middleware.app = app
        return middleware

    front: list[tuple[str, list[type]]] = []
    plain: list[tuple[str, list[type]]] = []

    async def both() -> None:
        door = limited_protocol(HttpToolsProtocol, FrontDoor())
        await serve(door, watched(front), LIMITED_GET, 3)
        await serve(HttpToolsProtocol, watched(plain), LIMITED_GET, 3)

    asyncio.run(both())
    # Two allowed of three each (2/minute): the denied one never reaches the app.
    assert front == [("send", [Rendered])] * 2
    assert plain == [("send_with_headers", [])] * 2


def test_an_app_that_fails_after_an_allowed_decision_gets_uvicorns_500_with_the_fields() -> None:
    """The fields go on whatever answer the front door writes for the request,
    its own 500 included: the request was counted, and the client learns
    where its quota stands. The connection still closes as uvicorn closes it."""
    middleware = limited({}, b"")

    async def failing(scope: dict[str, Any], receive: Any, send: Any) -> None:
        raise RuntimeError("the app failed")

    middleware.app = failing

    async def once() -> tuple[bytes, bool]:
        door = limited_protocol(HttpToolsProtocol, FrontDoor())
        return await serve(door, middleware, LIMITED_GET, 3)

    out, closed = asyncio.run(once())
    assert out.startswith(b"HTTP/1.1 500 ")
    assert b'\r\nratelimit: "api";r=1;t=30\r\n' in out
    assert b"\r\nconnection: close\r\n" in out and closed


def test_a_connections_next_request_does_not_inherit_the_fields_of_the_last() -> None:
    """The front door keeps one extension per connection (no allocation per
    request) and empties it with each answer: a request nobody limits, behind a
    limited one on the same connection (pipelined in one write, then alone),
    gets no rate-limit fields, as under plain uvicorn."""
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    limited_get = b"GET /limited HTTP/1.1\r\nHost: a\r\nX-User: u1\r\n\r\n"
    free_get = b"GET /free HTTP/1.1\r\nHost: a\r\nX-User: u1\r\n\r\n"

    async def both() -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        door = limited_protocol(HttpToolsProtocol, FrontDoor())
        app = limited(start, b"ok", paths=("/limited",))
        plain_app = limited(start, b"ok", paths=("/limited",))
        return (
            await serve(HttpToolsProtocol, plain_app, limited_get + free_get, 2),
            await serve(door, app, limited_get + free_get, 2),
        )

    plain, checked = asyncio.run(both())
    assert checked == plain
    answers = checked[0].split(b"HTTP/1.1 ")[1:]
    assert [b"\r\nratelimit: " in a for a in answers] == [True, False, True, False]


def test_nested_middlewares_both_add_their_fields_in_the_order_wrappers_would() -> None:
    """A user's app with its own RateLimitMiddleware, served behind a node's:
    each adds its fields (the extension is keyed by middleware), innermost
    first, the same bytes as under plain uvicorn, where each wraps ``send``."""
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}

    def nested() -> Any:
        return limited(start, b"", rule=("outer", "9/minute"), app=limited(start, b"ok"))

    async def both() -> tuple[tuple[bytes, bool], tuple[bytes, bool]]:
        door = limited_protocol(HttpToolsProtocol, FrontDoor())
        return (
            await serve(HttpToolsProtocol, nested(), LIMITED_GET, 1),
            await serve(door, nested(), LIMITED_GET, 1),
        )

    plain, checked = asyncio.run(both())
    assert checked == plain
    policies = [line for line in plain[0].split(b"\r\n") if line.startswith(b"ratelimit-policy")]
    assert policies == [b'ratelimit-policy: "api";q=2;w=60', b'ratelimit-policy: "outer";q=9;w=60']


def test_the_front_door_inlines_uvicorns_on_header_as_it_is() -> None:
    """node/frontdoor.py's on_header does what uvicorn's does, inline (one call per
    request field instead of two). A uvicorn release that changes its on_header
    must be read again: this fails until the copy is checked."""
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(HttpToolsProtocol.on_header))
    assert source == (
        "def on_header(self, name: bytes, value: bytes) -> None:\n"
        "    name = name.lower()\n"
        '    if name == b"expect" and value.lower() == b"100-continue":\n'
        "        self.expect_100_continue = True\n"
        "    self.headers.append((name, value))\n"
    )
