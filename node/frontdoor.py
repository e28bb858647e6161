"""The front door of a router or node process: connection limits and timeouts.

uvicorn on its own closes a keep-alive connection 5 s after its last response,
but a connection that never sends a request, or sends its headers a byte at a
time, stays open for ever; enough of them use up the process's file
descriptors, and then every new connection fails. Here:

* **Header timeout.** A connection has ``header_timeout`` seconds, from when
  it opens or its last response ends, to send a request's complete headers;
  data trickling in does not extend it. Then it is closed (``408`` if it had
  started a request).
* **Header size.** More than ``max_header_bytes`` before the headers end is a
  ``431`` and a closed connection. It holds for a request pipelined behind
  one being served too, and for a chunked body's framing (the first chunk's
  line included) and trailers, which the parser buffers as it does headers
  (``431``).
* **Answers owed first.** A malformed (``400``) or oversized (``431``)
  request behind requests read whole (pipelined, or in the same read) is
  refused only after those are answered, in order; then the connection
  closes. Nothing more is read meanwhile (what comes is dropped).
* **Half-close.** A client that ends its side of the connection after its
  requests (``shutdown(SHUT_WR)``) gets the answers already given; a
  router's client gets those still being served too, then the connection
  closes (a node abandons them: see ``eof_received``). An idle connection,
  or one in the middle of a request, closes at once.
* **One Host.** An HTTP/1.1 request without a ``Host`` field, or any request
  with more than one, is a ``400`` (RFC 9112 section 3.2).
* **No protocol switch.** Neither process speaks WebSocket (``ws: none``): an
  ``Upgrade`` request is plain HTTP, and its connection closes after the
  answer (httptools parses nothing after an upgrade). One that declares a
  body is a ``400``: the parser would never deliver that body.
* **Answered early.** A request answered before its body has all arrived
  (a ``413`` from the declared length, a ``401``) keeps its connection: the
  rest of the body is read and dropped, and only then does the connection
  wait for its next request's headers (counting the rest as the next
  request's headers answered a valid request with a ``431``). The rest has
  ``body_timeout`` seconds from the answer, with no allowance per byte, and
  at most ``MAX_DRAIN`` bytes of body in all; past either, or when the
  client waits for a ``100 Continue`` it was never sent, the connection is
  closed (and nothing after it in the same read is served).
* **Body timeout.** A request's body must arrive within ``body_timeout``
  seconds of its headers, plus one second per ``MIN_BODY_RATE`` bytes
  received so far (Apache's mod_reqtimeout, ``body=10,MinRate=500``): a
  large upload at a working pace goes on, a body sent a byte at a time does
  not hold a connection (and a slot under the cap) for ever. Then it is
  closed, with a ``408`` if no answer has begun.
* **Connection cap.** At most ``max_connections`` connections are open. A
  new connection over the cap closes the connection that has waited longest
  for a request (an idle one never holds a slot a working client needs); when
  every connection is busy with a request, requests get ``503`` (uvicorn's
  ``limit_concurrency``) rather than a reset. The default cap leaves half of
  the descriptor limit (``ulimit -n``, raised to its hard limit at start) for
  the connections a process opens itself (router to nodes, node to upstream).
  A router that serves gRPC too (``--grpc-port``) splits its client half: a
  quarter for gRPC connections (:func:`grpc_connection_cap`, enforced by
  gRPC itself), the rest for HTTP, so neither port can take the descriptors
  the other, or the connections to nodes, need.

docs/configuration.md says what to raise in production.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import MethodType
from typing import Any

from node.asgi import RESPONSE_FIELDS
from node.failures import Failures
from node.headers import LEGACY_NAMES, settle_legacy
from node.inline import INLINE, start_inline
from node.unixsocket import peer_credentials

__all__ = [
    "GRPC_DRAIN",
    "KEEP_ALIVE",
    "REUSE_IDLE",
    "FrontDoor",
    "client_share",
    "grpc_connection_cap",
    "raise_fd_limit",
]

#: Descriptors kept for everything that is not a client connection (listening
#: sockets, logs, the event loop's own, connections to peers at rest).
RESERVED_FDS = 64
#: Bytes per second of a request body that extend its time (see the body timeout).
MIN_BODY_RATE = 500
#: Bytes of a request body (the decision API takes 1 MiB) past which a body
#: whose answer went out is no longer read and dropped: the connection is
#: closed instead of kept for the next request (Go's net/http reads up to
#: 256 KiB of an unread body for the same reason).
MAX_DRAIN = 4 * 1024 * 1024
#: Requests of one read started inline (node/inline.py) at most; those behind them
#: wait in uvicorn's pipeline and are served one per loop step, as every
#: pipelined request was before: a client that pipelines thousands of requests
#: in one read does not hold the loop (and every other connection) for all of
#: them at once. A router's batch (``--pipeline``) is at most 64.
MAX_INLINE_PER_READ = 64
#: Seconds an idle keep-alive connection is kept after a response (uvicorn's default).
KEEP_ALIVE = 5.0
#: Seconds a router serving gRPC keeps serving after its first SIGTERM/SIGINT,
#: its health saying NOT_SERVING (``--grpc-drain``, router/server.py): the
#: bootstrap in docs/envoy.md checks every 5 s and takes a router out after 2
#: failures (timeout 1 s), 11 s at worst; 15 s covers that with room, and the
#: stop after it fits in Kubernetes' default 30 s grace period.
GRPC_DRAIN = 15.0
#: Seconds ringlimit's own clients reuse an idle pooled connection to a router or
#: node (router -> node, node -> node, router and node control calls): less than
#: :data:`KEEP_ALIVE`. A client that reuses a connection as its server closes it
#: for idleness writes a request nothing will answer, and a POST (a decision, a
#: handoff, a view) cannot safely be sent again: the server may have read it. Idle
#: up to the server's own limit, such POSTs were lost (aiohttp and httpx
#: pools: tests/test_idle_reuse.py).
REUSE_IDLE = 4.0


@dataclass(frozen=True)
class FrontDoor:
    #: Seconds an idle keep-alive connection is kept after a response. At least
    #: 1 s above :data:`REUSE_IDLE`, or requests from the router and peers can meet a
    #: connection as it closes (see :meth:`reuse_warning`).
    keep_alive: float = KEEP_ALIVE
    #: Seconds a connection has to send a request's complete headers.
    header_timeout: float = 10.0
    #: Bytes a request's line and headers may take.
    max_header_bytes: int = 64 * 1024
    #: Open client connections at most (None: from the descriptor limit).
    max_connections: int | None = None
    #: Seconds a request's body has after its headers (plus 1 s per MIN_BODY_RATE bytes).
    body_timeout: float = 10.0
    #: The process serves gRPC too (a router's ``--grpc-port``): the default HTTP cap
    #: leaves the gRPC connections' cap out of the client half (:func:`grpc_connection_cap`
    #: of ``grpc_max_connections``, its ``--grpc-max-connections``).
    grpc: bool = False
    grpc_max_connections: int | None = None

    def __post_init__(self) -> None:
        for name in ("keep_alive", "header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not 0 < value <= 3600:
                raise ValueError(f"{name} must be above 0 and at most 3600 seconds")
        if not 1024 <= self.max_header_bytes <= 1 << 24:
            raise ValueError("max_header_bytes must be from 1024 to 16 MiB")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError("max_connections must be at least 1")

    def reuse_warning(self) -> str | None:
        """What to tell whoever set a keep-alive within 1 s of :data:`REUSE_IDLE`:
        ringlimit's own clients would then reuse connections this process is
        closing, and lose some of their POSTs (``None``: nothing to tell)."""
        # A second of margin: the server's time starts as its answer is written,
        # the client's once it has read it (and its event loop got to it).
        if self.keep_alive >= REUSE_IDLE + 1:
            return None
        return (
            f"--keep-alive {self.keep_alive:g} s is less than 1 s above the {REUSE_IDLE:g} s "
            "for which routers and nodes reuse an idle connection: a request of theirs can "
            f"meet this process closing that connection and be lost (keep it at "
            f"{REUSE_IDLE + 1:g} s or more)"
        )

    def connection_cap(self) -> int:
        """The cap in force: the configured one, or half the free descriptors (less
        the gRPC share, with ``grpc``)."""
        if self.max_connections is not None:
            return self.max_connections
        share = client_share()
        if self.grpc:
            # The gRPC cap in force, configured or not (a configured one was left
            # out of the sum: the two ports could take 3.8x the share, a review).
            return max(16, share - grpc_connection_cap(self.grpc_max_connections))
        return share

    def uvicorn_options(self, http: Any) -> dict[str, Any]:
        """``uvicorn.Config`` keyword arguments; ``http`` is the protocol in use."""
        cap = self.connection_cap()
        options: dict[str, Any] = {
            # Neither a router nor a node serves WebSockets: uvicorn's WebSocket
            # protocol would take an upgrade request's body as frames (and hold the
            # connection with no timer), and answer a handshake the app cannot
            # complete with a plain-text 403. An upgrade request is HTTP here.
            "ws": "none",
            "timeout_keep_alive": self.keep_alive,
            "h11_max_incomplete_event_size": self.max_header_bytes,
            "limit_concurrency": cap,
        }
        if isinstance(http, type):
            # Our protocol keeps its connections within the cap itself; uvicorn's
            # limit answers 503 only when all of them are busy (one over: the
            # connection being served counts itself).
            options["limit_concurrency"] = cap + 1
        return options


def client_share() -> int:
    """Descriptors for client connections: half of those the process does not
    keep for itself (``RESERVED_FDS``), at least 16; the other half is for the
    connections it opens (router to nodes, node to upstream)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, (soft - RESERVED_FDS) // 2)


def grpc_connection_cap(configured: int | None) -> int:
    """Open gRPC connections at most (a router's ``--grpc-max-connections``): the
    configured number, or a quarter of :func:`client_share`, at least 16. An
    Envoy opens a connection or two per worker thread to each router, so this
    is many Envoys' worth; the HTTP port's default cap is the rest of the share."""
    if configured is not None:
        return configured
    return max(16, client_share() // 4)


def raise_fd_limit() -> int:
    """Raise the soft descriptor limit to the hard one (what servers usually do);
    returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def _canned(status: int, reason: str, error: str, detail: str) -> bytes:
    body = json.dumps({"error": error, "detail": detail}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


_TIMEOUT = _canned(408, "Request Timeout", "request_timeout", "request headers took too long")
_BODY_TIMEOUT = _canned(
    408, "Request Timeout", "request_timeout", "the request body arrived too slowly"
)
_MALFORMED = _canned(
    400, "Bad Request", "invalid_http", "the request is not HTTP/1.1 this server can read"
)
_TOO_LARGE = _canned(
    431, "Request Header Fields Too Large", "headers_too_large", "request headers are too large"
)
_TRAILERS_TOO_LARGE = _canned(
    431,
    "Request Header Fields Too Large",
    "headers_too_large",
    "the chunked body's framing or trailers are too large",
)


def _refusal(status: int, error: str, detail: str, *fields: tuple[bytes, bytes]) -> Any:
    """An ASGI app answering every request with one JSON error (the front door's
    own refusals of a request whose headers were read; closes the connection)."""
    body = json.dumps({"error": error, "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *fields,
        (b"connection", b"close"),
    ]

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return refuse


#: The answer when every connection is busy (uvicorn's ``limit_concurrency``).
_over_capacity = _refusal(
    503,
    "over_capacity",
    "every connection this server accepts is busy with a request; retry shortly",
    (b"retry-after", b"1"),
)
#: The answer to an upgrade request with a body: the HTTP parser (httptools)
#: stops at an upgrade and never delivers the body, which the app would take
#: as empty.
_upgrade_with_body = _refusal(
    400,
    "upgrade_with_body",
    "this server does not switch protocols, and cannot read the body of a request "
    "that asks to (Connection: upgrade); send it without the Upgrade field",
)

#: The answer to an HTTP/1.1 request without a ``Host`` field, or to any request
#: with more than one (RFC 9112 section 3.2): which one the app would see is
#: not the client's to choose (with two, the last; with none, this server's own
#: address, as a router forwards it).
_bad_host = _refusal(
    400,
    "invalid_http",
    "a request must carry exactly one Host header field (RFC 9112 section 3.2; "
    "an HTTP/1.0 request may carry none)",
)

#: A transfer coding other than chunked (RFC 9112 6.1: "SHOULD respond with 501"):
#: the parser takes ``gzip, chunked`` apart as chunked and the app got the body
#: still gzipped, as if it were not.
_unknown_coding = _refusal(
    501,
    "unsupported_transfer_coding",
    "this server reads only the chunked transfer coding (send Content-Encoding for a "
    "compressed body)",
)
#: Transfer-Encoding in an HTTP/1.0 request: its framing is faulty (RFC 9112 6.1:
#: "MUST treat the message as if the framing is faulty"), and an HTTP/1.0 proxy
#: in front would have framed it otherwise.
_coding_in_http10 = _refusal(
    400,
    "invalid_http",
    "an HTTP/1.0 request cannot carry Transfer-Encoding (RFC 9112 section 6.1)",
)


def _coding_refusal(codings: bytes, version: str) -> Any:
    """The refusal of a request's Transfer-Encoding, or None when it is plain chunked."""
    if version == "1.0":
        return _coding_in_http10
    # (empty list elements are ignored: RFC 9110 5.6.1)
    if [c for c in (c.strip().lower() for c in codings.split(b",")) if c] != [b"chunked"]:
        return _unknown_coding
    return None


#: Checked response fields a server remembers (a node's differ by little: its
#: rate-limit fields, the date of the second, a few content types).
MAX_CHECKED_FIELDS = 4096
#: A field whose line is longer is checked each time, never remembered: the cache
#: is bounded in bytes (about MAX_CHECKED_FIELDS x 2 x this), not only in fields,
#: so an app or upstream that echoes a request's value (up to max_header_bytes)
#: cannot make it hold hundreds of megabytes.
MAX_CHECKED_LINE = 256
#: Fields whose values uvicorn's cycle reads (framing, keep-alive): never remembered.
_FRAMING_FIELDS = frozenset({b"content-length", b"transfer-encoding", b"connection"})


def checked_send(base: type) -> Callable[[Any, Any], Awaitable[None]]:
    """``send(cycle, message)``: uvicorn's ``RequestResponseCycle.send`` (``base``'s)
    with a response's fields checked once per distinct field, not once per response.

    uvicorn checks every field of every answer with two regular expressions
    and lower-cases its name; a node sends the same fields over and over (its
    rate-limit fields come from node/headers.py's cache, the date changes once
    a second), and those checks were a quarter of what limiting added to a
    proxied request (benchmarks/requestpath.py). Here a field that passed them
    is remembered with the line it became, and the next answer carrying it
    takes that line. The bytes written and the errors raised are uvicorn's;
    framing fields (``content-length`` and co.) are always read as uvicorn
    reads them, and anything but a response's start (or one with an access
    log to write) is uvicorn's own ``send``. One exception: an answer without a
    length to an HTTP/1.0 request, which uvicorn chunks, ends with the
    connection instead (:func:`_close_delimit`).
    """
    from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE, STATUS_LINE

    uvicorn_send = base.send  # type: ignore[attr-defined]
    #: (name, value) -> b"name: value\r\n", for this server's cycles.
    checked: dict[tuple[bytes, bytes], bytes] = {}

    def send(cycle: Any, message: Any) -> Awaitable[None]:
        if (
            message["type"] != "http.response.start"
            or cycle.response_started
            or cycle.access_log
            or cycle.disconnected
            or cycle.flow.write_paused
        ):
            if message["type"] == "http.response.start" and not cycle.response_started:
                added = _added_fields(cycle)
                if added:  # uvicorn's own send takes fields as pairs only
                    extra = [field for entry in reversed(added.values()) for field in entry.fields]
                    added.clear()
                    app, ours = settle_legacy(message.get("headers", ()), extra)
                    message = {**message, "headers": [*app, *ours]}
                if (
                    cycle.scope["http_version"] == "1.0"
                    and _unframed(cycle, message["status"])
                    and not any(map(_frames, (*cycle.default_headers, *message.get("headers", ()))))
                ):
                    _close_delimit(cycle)  # (before uvicorn's send, which would chunk it)
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                # The answer's last message: the cycle lets go of this method bound
                # to itself (the app holds its own). Held, every request's cycle,
                # scope and all on them were a reference cycle that only the
                # garbage collector freed: 9-14 objects a request
                # (tests/test_frontdoor_cycle.py counts them).
                cycle.__dict__.pop("send", None)
                if cycle.__dict__.pop(_CLOSE_DELIMITED, False):
                    # The body ends here: uvicorn's check of a declared length passes.
                    cycle.expected_content_length = len(message.get("body", b""))
            return uvicorn_send(cycle, message)  # type: ignore[no-any-return]
        return start(cycle, message)

    async def start(cycle: Any, message: Any) -> None:
        """uvicorn's ``send`` of a response's start (its status line and fields)."""
        cycle.response_started = True
        cycle.waiting_for_100_continue = False
        status_code = message["status"]
        content = [STATUS_LINE[status_code]]
        has_connection_close = False
        #: The app's own X-RateLimit-* fields: (where in content, field). Never
        #: remembered below, so an answer without them pays nothing for this.
        legacy: list[tuple[int, Any]] | None = None
        for field in (*cycle.default_headers, *message.get("headers", ())):
            try:
                line = checked.get(field)
            except TypeError:  # a list, or a bytearray in it: checked each time
                line = None
            if line is not None:
                content.append(line)
                continue
            name, value = field
            if HEADER_RE.search(name):
                raise RuntimeError("Invalid HTTP header name.")
            if HEADER_VALUE_RE.search(value):
                raise RuntimeError("Invalid HTTP header value.")
            name = name.lower()
            if name == b"content-length" and cycle.chunked_encoding is None:
                cycle.expected_content_length = int(value.decode())
                cycle.chunked_encoding = False
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                cycle.expected_content_length = 0
                cycle.chunked_encoding = True
            elif name == b"connection":
                connection = [token.lower().strip() for token in value.split(b",")]
                if b"close" in connection:
                    cycle.keep_alive = False
                    has_connection_close = True
            line = b"".join((name, b": ", value, b"\r\n"))
            if name in LEGACY_NAMES:
                if legacy is None:
                    legacy = []
                legacy.append((len(content), (name, value)))
            elif (
                name not in _FRAMING_FIELDS
                and type(field) is tuple
                and len(line) <= MAX_CHECKED_LINE
            ):
                if len(checked) >= MAX_CHECKED_FIELDS:
                    checked.clear()
                with contextlib.suppress(TypeError):  # (a bytearray in it)
                    checked[field] = line
            content.append(line)
        extensions = cycle.scope.get("extensions")  # _added_fields, inline
        if extensions:
            added = extensions.get(RESPONSE_FIELDS)
            if added:
                # The middleware's rate-limit fields (node/asgi.py RESPONSE_FIELDS),
                # checked when they were rendered (node/headers.py Rendered.lines).
                # The innermost middleware's first, as wrappers of send would add them.
                if legacy or len(added) > 1:
                    _settle_legacy_lines(content, legacy or [], added)
                else:  # one entry
                    for entry in added.values():
                        content.append(entry.lines)
                added.clear()  # the connection's next request starts with none
        unframed = _unframed(cycle, status_code)
        if unframed and cycle.scope["http_version"] == "1.0":
            _close_delimit(cycle)
            unframed = False
        if not has_connection_close and (
            not cycle.keep_alive or (cycle.more_body and _rest_not_drained(cycle.scope["headers"]))
        ):
            # (Answered early with more to come than is drained: the connection
            # closes after MAX_DRAIN. Said now; closed then, not now, or the
            # client still sending would get a reset before it read this.)
            content.append(b"connection: close\r\n")
        if unframed:
            # Neither content-length nor transfer-encoding specified
            cycle.chunked_encoding = True
            content.append(b"transfer-encoding: chunked\r\n")
        content.append(b"\r\n")
        cycle.transport.write(b"".join(content))

    return send


#: Marks a cycle whose answer's body ends where the connection closes.
_CLOSE_DELIMITED = "ringlimit_close_delimited"
#: What uvicorn is told an answer without a length may still hold (below its end).
_UNBOUNDED = 1 << 62


def _unframed(cycle: Any, status_code: int) -> bool:
    """Whether the answer starting on ``cycle`` has a body and, so far, no framing:
    uvicorn sends such an answer chunked."""
    return (
        cycle.chunked_encoding is None
        and cycle.scope["method"] != "HEAD"
        and status_code not in (204, 304)
    )


def _frames(field: Any) -> bool:
    """Whether uvicorn frames an answer by this field of its start, as its ``send``
    reads them: a ``Content-Length``, or ``Transfer-Encoding: chunked``."""
    name, value = field
    name = name.lower()
    return name == b"content-length" or (
        name == b"transfer-encoding" and value.lower() == b"chunked"
    )


def _close_delimit(cycle: Any) -> None:
    """An unframed answer to an HTTP/1.0 request ends where the connection closes
    (RFC 9112 6.3, the last rule), since an HTTP/1.0 client cannot read the
    chunked coding (RFC 9112 6.1: a server MUST NOT send it to one): uvicorn
    chunked it whatever the request's version, and a strict HTTP/1.0 client
    (``ab``) reads the chunks' framing as the body. The connection closes
    after it (uvicorn keeps no HTTP/1.0 connection alive; said here too, since
    the close is the body's end).

    Such a body that breaks off (an app that fails, an upstream that stops
    mid-answer) ends with the same close, and looks whole to its client: the
    price of HTTP/1.0's framing, where HTTP/1.1's last chunk is missing. The
    mark in the cycle's ``__dict__`` is what the last body message looks for;
    the other two values are what uvicorn's ``send`` reads meanwhile."""
    cycle.chunked_encoding = False
    cycle.keep_alive = False
    cycle.expected_content_length = _UNBOUNDED
    cycle.__dict__[_CLOSE_DELIMITED] = True


def _settle_legacy_lines(
    content: list[bytes], legacy: list[tuple[int, Any]], added: dict[object, Any]
) -> None:
    """Add ``added``'s fields to ``content`` when more than one set of
    ``X-RateLimit-*`` may meet: the app's own (at the ``legacy`` places) or
    nested middlewares'. One set is written, as node/headers.py's
    :func:`~node.headers.settle_legacy` chooses, each middleware settling with
    what is inside it, innermost first, as wrappers of ``send`` would."""
    fields: list[Any] = [field for _, field in legacy]
    for entry in reversed(added.values()):
        inside, ours = settle_legacy(fields, entry.fields)
        fields = inside + ours
    for at, _ in legacy:  # the app's that are kept are written again below, with ours
        content[at] = b""
    content.append(b"".join(b"%s: %s\r\n" % (n.lower(), v) for n, v in fields))


def _rest_not_drained(headers: list[tuple[bytes, bytes]]) -> bool:
    """An answer that starts before its request's body ended: the connection
    stays only if the rest is read and dropped, and a declared length past
    ``MAX_DRAIN`` will not be (the connection closes there: see ``on_body``).
    Said in the answer (``connection: close``): a client that pooled the
    connection (a router's) wrote its next request, another client's, on a
    connection about to close. (A chunked body's size is not known ahead: it is
    drained, or closed past the cap, unannounced.)"""
    for name, value in headers:
        if name == b"content-length":
            return not value.isdigit() or int(value) > MAX_DRAIN
    return False


def _added_fields(cycle: Any) -> dict[object, Any] | None:
    """The fields a middleware asked this server to add to ``cycle``'s answer
    (the :data:`~node.asgi.RESPONSE_FIELDS` extension), if any."""
    extensions = cycle.scope.get("extensions")
    return extensions.get(RESPONSE_FIELDS) if extensions else None


class _StopParsing(Exception):
    """Raised from a parser callback to stop parsing (an oversized request, or a
    connection closed from the callback: what follows in the read is dropped)."""


def _declares_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's (lowercased) fields announce a body."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0"):
            return True
    return False


class _QuietLogger:
    """uvicorn's logger for one server, with its warnings, and its errors that
    carry no traceback, at most one line per message every 10 s
    (node/failures.py): uvicorn warns on every request its parser refuses
    (``Invalid HTTP request received.``) and every request over its
    concurrency limit, so any client could make the server log a line per
    connection, and logs an error for every answer an app left unfinished
    (``ASGI callable returned without completing response.``: each answer an
    upstream broke off, which the node already reports, throttled). Those
    messages are fixed strings, so they are few kinds. An error with a
    traceback (an app that raised) is logged every time."""

    def __init__(self, logger: logging.Logger) -> None:
        self._logger = logger
        self._limit = Failures(logger)

    def warning(self, message: str, *args: Any) -> None:
        self._limit.warn(message, message, *args)

    def error(self, message: str, *args: Any, **options: Any) -> None:
        if options:
            self._logger.error(message, *args, **options)
        else:
            self._limit.warn(message, message, *args, level=logging.ERROR)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


#: The client address a request on a Unix socket is given (ASGI has none for it).
UNIX_PEER = ("127.0.0.1", 0)


def _unix_peer(transport: asyncio.BaseTransport) -> int | None:
    """The user id of the peer of a Unix-socket connection (None: not one)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None
    try:
        return peer_credentials(sock)[1]
    except OSError:
        return -1  # (closed already: nobody's)


def limited_protocol(base: type, front_door: FrontDoor, wrap: Any = None) -> type:
    """``base`` (uvicorn's httptools protocol) with the header timeout, header
    size limit and connection cap of ``front_door``. ``wrap(transport, loop)``,
    when given, wraps the transport (node/server.py coalesces writes)."""
    cap = front_door.connection_cap()
    header_timeout = front_door.header_timeout
    body_timeout = front_door.body_timeout
    max_header_bytes = front_door.max_header_bytes
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    send = checked_send(RequestResponseCycle)
    quiet = _QuietLogger(logging.getLogger("uvicorn.error"))
    # ``base``'s methods that run on every request, called directly: ``super()``
    # builds a proxy object and searches the classes for the name on each call
    # (four per request the router proxies: 2.7% of its instructions).
    methods: Any = base
    base_data_received = methods.data_received
    base_on_message_begin = methods.on_message_begin
    base_on_response_complete = methods.on_response_complete
    base_on_headers_complete = methods.on_headers_complete
    base_on_body = methods.on_body
    base_start_asgi_task = methods._start_asgi_task

    class LimitedProtocol(base):  # type: ignore[valid-type,misc]
        _waiting = False
        _waiting_since = 0.0
        #: From a request's first byte until its headers end (whether or not the
        #: connection waits: a request pipelined behind one being served does not).
        _in_head = False
        _header_bytes = 0
        #: A request's body may be under way (from the end of its headers to the
        #: end of the request), and the bytes read since the last read that
        #: carried any of its data: a chunked body's framing (the first chunk's
        #: line too: httptools reports a chunk's header only once its line has
        #: ended, so a line of endless extensions was never capped), and after
        #: the last chunk its trailers, which the parser buffers as it does
        #: headers. (A body of a declared length is all data: never counted.)
        _in_body = False
        _unframed = 0
        #: Reads so far (node/server.py's ``postpone`` tells a batch from a stream).
        _reads = 0
        _parsed_bytes = 0
        #: ``Host`` fields of the request being parsed (exactly one is valid).
        _hosts = 0
        #: The request's Transfer-Encoding fields, joined (b"": none).
        _codings = b""
        _header_timer: asyncio.TimerHandle | None = None
        #: While a request's body is arriving: when its headers ended, its bytes so
        #: far, and the timer that checks its pace.
        _body_since = 0.0
        _body_bytes = 0
        #: Body bytes of every request on the connection (never reset).
        _body_seen = 0
        _body_timer: asyncio.TimerHandle | None = None
        #: When a body answered before it arrived whole must have arrived.
        _drained_by = 0.0
        #: The app may be started inline (node/inline.py): read once per connection.
        _inline = False
        #: True while uvicorn's ``on_headers_complete`` runs for an inline app: the
        #: request it starts is held in ``_held`` until it is whole (started inline
        #: then) or the read ends without it (started in a task, as uvicorn does).
        _holding = False
        _held: tuple[Any, Any] | None = None
        #: Requests this read may still start inline (MAX_INLINE_PER_READ).
        _inline_left = 0
        #: Not None: the connection closes once the requests read are answered,
        #: after writing this (an error for a request behind them; b"": nothing).
        #: Nothing more is read meanwhile.
        _last_word: bytes | None = None
        #: A pipelined request dropped unstarted (see _drop_unfinished).
        _dropped: Any = None
        #: A half-closed connection's requests read whole are answered (see
        #: eof_received): the router's protocol sets it.
        answers_after_eof = False
        # uvicorn's, set in its __init__ (declared for the type checker).
        timeout_keep_alive_task: asyncio.TimerHandle | None
        app: Any
        limit_concurrency: int | None
        expect_100_continue: bool
        client: tuple[str, int] | None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self.logger = quiet
            #: What the RESPONSE_FIELDS extension (node/asgi.py) holds, one per
            #: connection: uvicorn starts a connection's next request only once the
            #: answer ahead is complete, and each answer's start empties it. (Each
            #: request gets its own ``extensions`` dict around it: a scope is the
            #: request's, and an app may write to it.)
            self._response_fields: dict[object, Any] = {}
            self._inline = (
                bool(getattr(self.app, INLINE, False)) and not self.config.reset_contextvars
            )
            super().connection_made(wrap(transport, self.loop) if wrap else transport)
            stranger = False
            if self.client is None and (unix := _unix_peer(transport)) is not None:
                # A peer on a Unix socket is on this host, as a loopback one is:
                # checked as one (the internal API without a token, the router's
                # key), where no address read as "not local". Only this user's
                # processes (and root) may be one (node/unixsocket.py).
                self.client = UNIX_PEER
                stranger = unix not in (os.getuid(), 0)
            self._wait_for_request()
            if stranger:
                self.transport.close()
            elif len(self.connections) > cap:
                self._make_room()

        def _make_room(self) -> None:
            """Close the connection that has waited longest for a request."""
            oldest = None
            for other in self.connections:
                if (
                    other is not self
                    and getattr(other, "_waiting", False)
                    and (oldest is None or other._waiting_since < oldest._waiting_since)
                ):
                    oldest = other
            if oldest is not None:
                oldest._close_waiting(None)

        def _wait_for_request(self) -> None:
            # One timer per connection, not one per request: it is started when
            # none is pending, and when it fires it looks at how long the
            # connection has been waiting *now* (see _headers_late).
            self._waiting = True
            self._waiting_since = self.loop.time()
            if not self._in_head:
                self._header_bytes = 0
            # (A request begun behind the one just answered keeps its count: its
            # bytes so far are headers too.)
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(header_timeout, self._headers_late)

        def _stop_waiting(self) -> None:
            """The headers ended (or the connection did)."""
            self._waiting = False
            self._in_head = False

        def _cancel_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self._waiting:
                return  # busy with a request: the next wait starts a timer again
            left = self._waiting_since + header_timeout - self.loop.time()
            if left > 0:
                # It has waited since a later request ended: not late yet.
                self._header_timer = self.loop.call_later(left, self._headers_late)
                return
            started = self._header_bytes or self._in_head
            self._close_waiting(_TIMEOUT if started else None)

        def _close_waiting(self, answer: bytes | None) -> None:
            """Close the connection, writing ``answer`` first if the client would
            read it as the answer to the request it concerns (see _may_answer).
            When the trouble is a request behind ones still owed their answers
            (a bad or oversized request pipelined, or in the read that carried
            them), those are answered first, in order, then ``answer``, then
            the connection closes (:meth:`_close_after_answers`): closing now
            lost their answers while the app still served them."""
            if answer is not None and self._answers_owed():
                self._drop_unfinished()
                self._close_after_answers(answer)
                return
            may_answer = answer is not None and self._may_answer()
            self._stop_waiting()
            self._cancel_timer()
            self.connections.discard(self)
            if not self.transport.is_closing():
                if may_answer:
                    self.transport.write(answer)  # type: ignore[arg-type]
                self.transport.close()

        def _answers_owed(self) -> bool:
            """Whether requests read whole are still owed their answers: the
            trouble at hand then concerns a later request (the message the
            parser is in, or one after those it read)."""
            if self.pipeline:
                return True
            cycle = self.cycle
            return cycle is not None and not cycle.response_complete and not cycle.more_body

        def _drop_unfinished(self) -> None:
            """The request the trouble is in, if its headers came whole and it waits
            in uvicorn's pipeline behind the one being served: it never starts
            (its body can never end: nothing more is read). Started, it held the
            connection until the body timeout and the promised answer never came
            (a review)."""
            cycle = self.cycle
            if cycle is None or not cycle.more_body:
                return
            for entry in list(self.pipeline):
                if entry[0] is cycle:
                    self.pipeline.remove(entry)
                    self._dropped = cycle

        def _close_after_answers(self, last: bytes) -> None:
            """Nothing more is read (what comes is dropped, not parsed: the parser
            may be mid-request, or failed); once every request ahead is answered,
            ``last`` is written and the connection closed (on_response_complete).
            Bounded by the requests ahead: each is served as any other (the
            app's own timeouts), and reading resumes only to drop bytes."""
            if self._last_word is None:
                self._last_word = last
            self._stop_waiting()
            self._cancel_timer()
            self._in_body = False
            # (It stays among the server's connections: a graceful shutdown waits
            # for it, and it counts under the cap, as a connection being served.)

        def _say_last_word(self) -> None:
            """Every answer owed is written: the last word (an error, or nothing after
            a half-close), and the connection closes."""
            last = self._last_word
            if not self.transport.is_closing():
                if last:
                    self.transport.write(last)  # type: ignore[arg-type]
                self.transport.close()

        def _may_answer(self) -> bool:
            """True unless an answer is owed to a request ahead of the trouble: one
            begun (``response_started``), or a request served while a later one's
            headers were arriving behind it or wait in the pipeline (an error
            written now would be read as that request's answer)."""
            cycle = self.cycle
            if cycle is None:
                return True
            if cycle.response_complete:
                # (Not while its body is drained: the client is still sending it.)
                return not getattr(cycle, "more_body", False)
            started = getattr(cycle, "response_started", True)
            return not started and not self._in_head and not self.pipeline

        def data_received(self, data: bytes) -> None:
            if self._last_word is not None:
                return  # closing once the answers owed are written: dropped unread
            self._reads += 1
            self._inline_left = MAX_INLINE_PER_READ
            if self._waiting or self._in_head:
                self._header_bytes += len(data)
            if self._in_body:
                self._chunk_data_received(data)
            else:
                base_data_received(self, data)
            held = self._held
            if held is not None:
                # Its headers came in this read, not its end (a body to come, an
                # upgrade): its task starts now, as uvicorn's would after this read.
                self._held = None
                if not self.transport.is_closing():
                    base_start_asgi_task(self, *held)
            if (self._waiting or self._in_head) and self._header_bytes > max_header_bytes:
                self._close_waiting(_TOO_LARGE)

        def _chunk_data_received(self, data: bytes) -> None:
            """A read while a body may be under way: past ``max_header_bytes`` of reads with
            none of the body's data (a chunk line's extensions, or trailers that
            never end: httptools joins a trailer's pieces as it does a header's,
            at a cost that grows with the square of its length) it is refused."""
            # (Body bytes of any request: a new one's count starts at 0 within this
            # read, and one the same size as the last compared equal: a chunked
            # upload the size of the one before it on the connection got a 431.)
            before = self._body_seen
            base_data_received(self, data)
            if not self._in_body or self.transport.is_closing():
                return  # the message ended in this read
            if self._body_seen != before:
                self._unframed = 0
                return
            self._unframed += len(data)
            if self._unframed > max_header_bytes:
                self._close_waiting(_TRAILERS_TOO_LARGE)

        def on_message_begin(self) -> None:
            self._parsed_bytes = 0
            self._hosts = 0
            self._codings = b""
            self._in_head = True
            if not self._waiting:
                # Behind a request being served or in the same read as one's end:
                # its headers count from here (the rest of that read is not counted).
                self._header_bytes = 0
            if self._inline and self.timeout_keep_alive_task is not None:
                # An answer written inline earlier in this read armed the keep-alive
                # timer (uvicorn's, cancelled only as a read begins), or marked the
                # connection idle (node/keepalive.py's): this request is not an idle
                # connection's, however long it is served.
                self._unset_keepalive_if_required()
            base_on_message_begin(self)

        def on_message_complete(self) -> None:
            # uvicorn's, inlined (no extra frame per request), plus the end of a drain.
            self._in_body = False
            cycle = self.cycle
            if cycle is None:
                return  # an upgrade as the connection's first request
            if cycle.response_complete:
                if cycle.more_body and not self.transport.is_closing():
                    # Answered before its body was whole: the drain is over.
                    cycle.more_body = False
                    self._wait_for_request()
                return
            if self.parser.should_upgrade() and self._should_upgrade():
                return
            cycle.more_body = False
            cycle.message_event.set()
            held = self._held
            if held is not None:
                # Whole: served now, in a task only if it has to wait (node/inline.py).
                self._held = None
                if not self.transport.is_closing():
                    start_inline(self.loop, held[0].run_asgi(held[1]), self.tasks)

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            # uvicorn's, but a request of an inline app waits for its end in _held
            # (from on_headers_complete only: a pipelined request whose turn came is
            # started from the answer before it, inside that app's ``send``). Not
            # started at all if the connection is closing by then: a request
            # behind an answer that closed it (parsed only after that answer, now
            # that the answer can be written during the read).
            if self._holding and self._inline_left:
                self._inline_left -= 1
                self._held = (cycle, app)
            else:
                base_start_asgi_task(self, cycle, app)

        def on_url(self, url: bytes) -> None:
            self._parsed_bytes += len(url)
            if self._parsed_bytes > max_header_bytes:
                self._too_large()
            self.url += url  # uvicorn's on_url, inline

        def on_header(self, name: bytes, value: bytes) -> None:
            # Headers that arrived whole in one read are measured as they are parsed
            # (counted inline: this runs for every field of every request).
            self._parsed_bytes += len(name) + len(value) + 4
            if self._parsed_bytes > max_header_bytes:
                self._too_large()
            # uvicorn's on_header (0.54), inline: no second call per field; and the
            # Host fields counted here, not in a second walk of the list.
            name = name.lower()
            if name == b"host":
                self._hosts += 1
            elif name == b"transfer-encoding":
                self._codings = self._codings + b"," + value if self._codings else value
            elif name == b"expect" and value.lower() == b"100-continue":
                self.expect_100_continue = True
            self.headers.append((name, value))

        def _too_large(self) -> None:
            self._oversized = True
            raise _StopParsing  # the parser stops; uvicorn calls send_400_response

        def send_400_response(self, msg: str) -> None:
            """What the HTTP parser cannot read gets a JSON error, like any bad input."""
            if self._last_word is not None:
                return  # (said already, after the answers owed)
            self._close_waiting(_TOO_LARGE if getattr(self, "_oversized", False) else _MALFORMED)

        def _await_body(self) -> None:
            self._body_since = self.loop.time()
            self._body_bytes = 0
            if self._body_timer is None:
                self._body_timer = self.loop.call_later(body_timeout, self._body_late)

        def _body_late(self) -> None:
            self._body_timer = None
            cycle = self.cycle
            if (
                cycle is None
                or not getattr(cycle, "more_body", False)  # (the router's ProxyCycle: no body)
                or self.transport.is_closing()
            ):
                return  # the body is whole (or the connection gone)
            if self.flow.read_paused or self.pipeline:
                # This server stopped reading (a request ahead is still being
                # answered, or the app has not taken what came): not the client's
                # time. The clock starts again (a 408 now would also land ahead
                # of the answer still owed).
                self._body_since = self.loop.time()
                self._body_timer = self.loop.call_later(body_timeout, self._body_late)
                return
            if cycle.response_complete:
                due = self._drained_by  # being drained: no allowance per byte
            else:
                due = self._body_since + body_timeout + self._body_bytes / MIN_BODY_RATE
            left = due - self.loop.time()
            if left > 0:
                self._body_timer = self.loop.call_later(left, self._body_late)
                return
            self._close_waiting(_BODY_TIMEOUT)

        def on_body(self, body: bytes) -> None:
            self._body_bytes += len(body)
            self._body_seen += len(body)
            if self._body_bytes > MAX_DRAIN and self.cycle.response_complete:
                self._close_waiting(None)  # answered long ago: not worth reading on
                raise _StopParsing  # nor a request behind it in this read
            base_on_body(self, body)

        def on_headers_complete(self) -> None:
            self._stop_waiting()
            # A body may follow: reads without any of its data are its framing from
            # here on, the first chunk's line included (see _in_body).
            self._in_body = True
            self._unframed = 0
            # Every request (a bodyless one is complete before the timer looks).
            self._await_body()
            limit = self.limit_concurrency
            upgrade = self.parser.should_upgrade()
            refusal = None
            if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
                # uvicorn would answer its own plain-text 503 here; every other
                # refusal of ours is JSON, so this one is too (same status).
                refusal = _over_capacity
            elif self._hosts != 1 and (self._hosts or self.parser.get_http_version() != "1.0"):
                refusal = _bad_host
            elif upgrade and _declares_body(self.headers):
                refusal = _upgrade_with_body
            elif self._codings:
                refusal = _coding_refusal(self._codings, self.parser.get_http_version())
            if refusal is None:
                self._holding = self._inline
                try:
                    base_on_headers_complete(self)
                finally:
                    self._holding = False
            else:
                app, self.app, self.limit_concurrency = self.app, refusal, None
                try:
                    base_on_headers_complete(self)
                finally:
                    self.app, self.limit_concurrency = app, limit
            cycle = self.cycle
            if type(cycle) is RequestResponseCycle:
                # Before its task's first step, which is when the app gets its ``send``.
                # (An attribute, not a subclass: a changed ``__class__`` slows every
                # attribute of the cycle down.)
                cycle.send = MethodType(send, cycle)  # type: ignore[method-assign]
                # uvicorn's scope has no extensions of its own.
                cycle.scope["extensions"] = {RESPONSE_FIELDS: self._response_fields}
                if upgrade:
                    # The parser reads nothing after an upgrade request (httptools
                    # stops there): the connection closes after its answer, and
                    # what the client sent behind it is not read.
                    cycle.keep_alive = False

        def _unsupported_upgrade_warning(self) -> None:
            """uvicorn logs two warnings per read after an upgrade request (the parser
            refuses every read): a client could fill the log. Handled above."""

        def on_response_complete(self) -> None:
            pipelined = bool(self.pipeline)
            base_on_response_complete(self)  # starts the next pipelined request's task
            if pipelined:
                # Its answer can leave with this one (node/server.py _CoalescedWrites).
                postpone = getattr(self.transport, "postpone", None)
                if postpone is not None:
                    postpone(self._reads)
            cycle = self.cycle
            if self.transport.is_closing():
                return
            done = cycle is None or (cycle.response_complete and not cycle.more_body)
            if (
                self._last_word is not None
                and not self.pipeline
                and (done or cycle is self._dropped)  # (a dropped one never runs)
            ):
                self._say_last_word()  # every request ahead is answered
                return
            if done:
                self._wait_for_request()
            elif cycle.response_complete:
                # Answered before its body arrived whole: the rest is read and
                # dropped (on_message_complete then waits for the next request).
                if self.expect_100_continue and not self._body_bytes:
                    # It waits for a 100 Continue before its body: that body may
                    # never come (Go closes such a connection too).
                    self._close_waiting(None)
                else:
                    self._drained_by = self.loop.time() + body_timeout
                    if self._body_timer is not None:
                        self._body_timer.cancel()
                    self._body_timer = self.loop.call_later(body_timeout, self._body_late)

        def eof_received(self) -> bool:
            """The client half-closed (``shutdown(SHUT_WR)``), or closed. uvicorn's
            returns None, on which the transport (asyncio's and uvloop's alike)
            closes itself: an answer already given but still in node/server.py's
            coalesced writes (they leave at the end of the loop step) was lost, so
            the close goes through our transport, which writes them first.

            With :attr:`answers_after_eof` (the router's), requests read whole
            are still answered, then the connection closes, as nginx does for
            what it serves itself; an idle connection, or one mid-request (that
            request can never end), closes at once. A node does not: a FIN is
            also how a client that gave up closes (a router past its timeout),
            and a request the node proxies to its ``--upstream`` is abandoned
            then (node/upstream.py), as nginx abandons a proxied request whose
            client closed, rather than holding the upstream connection for its
            whole timeout."""
            if self.answers_after_eof and self._answers_owed():
                self._close_after_answers(b"")
            else:
                self.transport.close()  # (ours: what is buffered leaves first)
            return True  # no more reads either way; closed by us, now or later

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_waiting()
            self._cancel_timer()
            if self._body_timer is not None:
                self._body_timer.cancel()
                self._body_timer = None
            super().connection_lost(exc)

    return LimitedProtocol
