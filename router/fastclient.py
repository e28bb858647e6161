"""A minimal pooled HTTP/1.1 client for the forwarding hot path.

The router does one thing per request: send it to a node on a kept-alive
connection and read the whole answer back. General-purpose clients spend
most of their time on what this path never needs (cookie jars, redirects,
tracing hooks, per-request timeout objects, header multidicts), so this
client does only that: ``asyncio.Protocol`` connections, the ``httptools``
response parser (the same C parser uvicorn uses for requests), one idle
pool per origin. Plain ``http://`` only: nodes are reached over a private
network; use :class:`router.forward.AiohttpForwarder` for TLS to nodes.

A request that fails on a *reused* connection before any byte of the answer
arrived is retried once on a fresh connection: the node closed an idle
connection, and never saw the request. Any other request whose connection
closes after it was written fails with :class:`router.forward.AnswerLost`:
the node may have decided it (and passed it to the application).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque

import httptools

from node.hopbyhop import NO_CONTENT, without_options
from node.unixsocket import CheckedSocket, file_identity, peer_credentials
from router.forward import (
    MAX_ANSWER,
    NOT_RELAYED,
    Answer,
    AnswerLost,
    AnswerTooLarge,
    NodeTimeout,
    Timeouts,
    Unreachable,
)


class _NeverProcessed(Unreachable):
    """A pipelined request behind an answer that closed the connection: the node
    processes nothing after such an answer (RFC 9112 9.6), so it is sent again."""


class _TooLarge(Exception):
    """Raised in the parser's body callback: stops reading an answer past the cap."""


class _HeadAnswered(Exception):
    """Raised in the parser's head callback once a HEAD's answer is settled: stops
    the parser at the end of the head (it would take what follows for the body
    that the answer's length announces; httptools ignores what the callback
    returns, so it cannot be told to skip the body as llhttp can)."""


class _Exchange:
    """One request on a connection, waiting for its answer."""

    __slots__ = ("deadline", "head", "uncapped", "waiter")

    def __init__(
        self, waiter: asyncio.Future[Answer], head: bool, deadline: float, uncapped: bool
    ) -> None:
        self.waiter = waiter
        self.head = head
        self.deadline = deadline
        #: Its answer may pass the forwarder's ``max_answer`` (``post_json``'s).
        self.uncapped = uncapped


class _Connection(asyncio.Protocol):
    """One kept-alive connection to a node, with its requests in flight in order.

    Without pipelining one request is in flight at a time. With it (see
    :class:`FastForwarder`), requests sent in the same event-loop step leave
    in one write and are answered in order: ``pending`` holds them oldest
    first, and each complete answer settles the oldest.
    """

    __slots__ = (
        "body",
        "closed",
        "connection",
        "fields",
        "headers",
        "idle_at",
        "interim",
        "keep_alive",
        "length",
        "loop",
        "max_answer",
        "out",
        "parser",
        "pending",
        "pool",
        "received",
        "reused",
        "sized",
        "status",
        "taken",
        "timer",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        #: The loop it runs on: a request on it reads it here, not from
        #: ``asyncio.get_running_loop()``, which makes a ``getpid`` system call
        #: (CPython 3.11; 3.12 dropped it).
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.pending: deque[_Exchange] = deque()
        #: Requests of this event-loop step, not written yet (pipelining only).
        self.out: list[bytes] = []
        self.pool: _Pool | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        #: Bytes of the answer's body so far, and how many an answer may have
        #: (the forwarder's ``max_answer``) unless its exchange is uncapped.
        self.taken = 0
        self.max_answer = MAX_ANSWER
        self.status = 0
        #: The answer's ``connection`` values and ``content-length`` (dropped from
        #: ``headers``), until it is settled.
        self.connection: list[bytes] | None = None
        self.length: bytes | None = None
        #: How many fields the answer has (more after its body: trailers, dropped).
        self.fields = 0
        #: The answer's framing is settled (see :class:`router.forward.Answer`).
        self.sized = False
        self.keep_alive = True
        self.closed = False
        #: Any byte arrived since the connection was (re)used for the requests in flight.
        self.received = False
        #: It was taken from the idle pool (so the node may have closed it meanwhile).
        self.reused = False
        #: Its pool's reap count when it was last put back idle (see ``_Pool.reaps``).
        self.idle_at = 0
        self.interim = False
        #: The one timer that watches the oldest request's deadline (see :meth:`watch`).
        self.timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if self.pool is not None:
            self.pool.open += 1

    def data_received(self, data: bytes) -> None:
        if not self.pending:
            # Bytes nobody asked for: this connection's framing can't be trusted.
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _HeadAnswered):
                # A HEAD's answer ended with its head, and its parser (stopped
                # there, waiting for a body) with it: a fresh one reads the next
                # answer. Unless this read went on past the head: bytes a node
                # should not have sent (the body, to a HEAD), which would be taken
                # for the next answer, in this read or the next ones.
                if self.closed or not self._ends_with_the_head(data):
                    self.close()
                else:
                    self.parser = httptools.HttpResponseParser(self)
                return
            if isinstance(exc.__context__, _TooLarge):
                # The oldest has its answer, only too large to hold; those behind
                # it were sent and may have been decided too: not sent again.
                self.body = []
                oldest = self.pending.popleft() if self.pending else None
                if oldest is not None and not oldest.waiter.done():
                    oldest.waiter.set_exception(AnswerTooLarge(self.max_answer))
                self._fail(AnswerLost("an answer ahead of it was too large to hold"))
            else:
                # Something answered what was sent: the node may have decided it.
                self._fail(AnswerLost(f"bad response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        pool = self.pool
        if pool is not None:
            pool.open -= 1
            if not self.pending:
                # Closed while idle (the node's keep-alive ran out, or the node is
                # gone): out of the pool now, not when a request next looks there,
                # which for a node that left the ring is never.
                pool.forget(self)
        # Queued for this step's write and never written: the last ones in flight.
        unsent = min(len(self.out), len(self.pending))
        self.out = []
        for _ in range(unsent):
            exchange = self.pending.pop()
            if not exchange.waiter.done():
                exchange.waiter.set_exception(_NeverProcessed("the connection closed"))
        # Written: the node may have read them, decided and passed them on before
        # it closed (a node killed as it answered), so they are not sent again.
        # (A reused connection that got no byte back is the exception: send.)
        self._fail(AnswerLost("the connection closed before the answer"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        # The fields an answer keeps, kept as they are parsed (not filtered again later).
        name = name.lower()
        if name not in NOT_RELAYED:
            self.headers.append((name, value))
        elif name == b"content-length":
            self.length = value
        elif name == b"connection":
            self.connection = [value] if self.connection is None else [*self.connection, value]

    def on_headers_complete(self) -> None:
        self.status = status = self.parser.get_status_code()
        if status < 200:
            self.interim = True  # 1xx (e.g. 100 Continue): the real answer follows
            return
        if self.connection is not None:
            self.headers = without_options(self.headers, self.connection)
        head = bool(self.pending) and self.pending[0].head
        # A HEAD's length is the node's (that of the content it would have sent);
        # a 204 or a 304 is given none (router/forward.py Answer).
        self.sized = head or status in NO_CONTENT
        if head and self.length is not None:
            self.headers.append((b"content-length", self.length))
        self.fields = len(self.headers)
        if head:
            # The parser cannot know the request was HEAD and would wait for the
            # body that content-length announces: the answer is complete, and the
            # parser is stopped here and replaced (data_received). The connection
            # is kept as after any answer (never pipelined: see FastForwarder.send,
            # so nothing is in flight behind it).
            self.keep_alive = self._kept_after_head()
            self._settle()
            raise _HeadAnswered

    def _kept_after_head(self) -> bool:
        """The node keeps the connection after this HEAD's answer: llhttp's rule
        (RFC 9112 9.3), without its wait for the end of a body that has no length
        (``should_keep_alive`` is false for an answer with neither a length nor
        chunks, which for a HEAD's is no reason to close)."""
        options = {
            token.strip().lower() for value in self.connection or () for token in value.split(b",")
        }
        if b"close" in options:
            return False
        return self.parser.get_http_version() == "1.1" or b"keep-alive" in options

    @staticmethod
    def _ends_with_the_head(data: bytes) -> bool:
        """``data``, a read in which a HEAD's answer's head ended, ends with it.

        The parser stopped at the head's end but does not say where that was. A
        head ends at its first blank line (llhttp requires CRLFs), so the head
        ends the read if the read's only ``CRLF CRLF`` ends it and the read does
        not start with a CR or an LF (which may finish a blank line begun in the
        read before). Otherwise (bytes after the head, or perhaps: a 1xx answer
        ahead of it in the same read) the connection is not trusted with another
        answer: it is closed."""
        end = data.find(b"\r\n\r\n")
        return end >= 0 and end == len(data) - 4 and data[0] not in b"\r\n"

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.taken += len(body)
        if self.taken > self.max_answer:
            self._past_the_cap()

    def _past_the_cap(self) -> None:
        pending = self.pending
        if not pending or not pending[0].uncapped:
            raise _TooLarge  # (a bound on memory: without it, an endless answer)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            self.headers = []
            self.body = []
            self.taken = 0
            self.status = 0
            self.connection = self.length = None
            return
        if not self.pending:
            return  # (a HEAD's answer never gets here: settled when its head ended)
        self.keep_alive = self.parser.should_keep_alive()
        self._settle()
        if not self.keep_alive and self.pending:
            # The node closes after that answer and processes nothing after it
            # (RFC 9112 9.6): the rest never reached it.
            self._fail(_NeverProcessed("the node closed the connection"))
            self.close()

    def _settle(self) -> None:
        """The oldest request has its answer."""
        exchange = self.pending.popleft()
        headers = self.headers
        if len(headers) != self.fields:
            del headers[self.fields :]  # trailers: not relayed (RFC 9110 6.5.1)
        answer = Answer(self.status, headers, b"".join(self.body), self.sized)
        self.connection = self.length = None  # (also a trailer's): not the next answer's
        self.headers = []
        self.body = []
        self.taken = 0
        self.status = 0
        if not exchange.waiter.done():
            exchange.waiter.set_result(answer)
        if not self.pending:
            self.received = False
            pool = self.pool
            if pool is not None:
                pool.release(self)

    # client side
    def _fail(self, exc: Exception) -> None:
        """Every request in flight fails with ``exc`` (one connection, one fate)."""
        pending, self.pending = self.pending, deque()
        for exchange in pending:
            if not exchange.waiter.done():
                exchange.waiter.set_exception(exc)

    def start(
        self,
        payload: bytes,
        loop: asyncio.AbstractEventLoop,
        head: bool,
        seconds: float,
        capped: bool = True,
    ) -> asyncio.Future[Answer]:
        """Send a request now (its answer: the future)."""
        waiter = self._enqueue(loop, head, seconds, capped)
        if self.writable():
            self.transport.write(payload)  # type: ignore[union-attr]
        else:
            self._unsent()
        return waiter

    def add(
        self,
        payload: bytes,
        loop: asyncio.AbstractEventLoop,
        seconds: float,
        capped: bool = True,
    ) -> asyncio.Future[Answer]:
        """Queue a request for this step's write (:meth:`flush`)."""
        self.out.append(payload)
        return self._enqueue(loop, False, seconds, capped)

    def _enqueue(
        self, loop: asyncio.AbstractEventLoop, head: bool, seconds: float, capped: bool
    ) -> asyncio.Future[Answer]:
        waiter: asyncio.Future[Answer] = loop.create_future()
        self.pending.append(_Exchange(waiter, head, loop.time() + seconds, not capped))
        if self.timer is None:
            self.timer = loop.call_at(self.pending[0].deadline, self._check_deadline, loop)
        return waiter

    def flush(self) -> None:
        """Write the requests queued in this step, in one write."""
        out, self.out = self.out, []
        pool = self.pool
        if pool is not None:
            if pool.filling is self:
                pool.filling = None
            if out:
                counts = pool.pipelined
                counts["writes"] += 1
                counts["requests"] += len(out)
        if not out:
            return
        if self.writable():
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))  # type: ignore[union-attr]
        else:
            self._unsent()

    def writable(self) -> bool:
        """Open at both ends, as far as the loop knows.

        A node that died (kill -9) resets its connections; the event loop
        closes the transport at once but tells the protocol
        (``connection_lost``) a step later. A write in between raises
        (uvloop) or is dropped, so it is checked, not attempted."""
        transport = self.transport
        return not self.closed and transport is not None and not transport.is_closing()

    def _unsent(self) -> None:
        """The requests in flight were never written (a closing connection takes
        none): each fails as never processed, so it is sent again elsewhere."""
        self.closed = True
        pool = self.pool
        if pool is not None and pool.filling is self:
            pool.filling = None
        self._fail(_NeverProcessed("the connection closed before the request was sent"))
        self.close()

    def _check_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        """One timer per connection, not one per request: it looks at the oldest
        request in flight *now* and waits again if that one is not late yet.
        The oldest late: every request in flight times out with it (they were
        sent; the answers behind it cannot be told apart without it)."""
        self.timer = None
        if self.closed or not self.pending:
            return  # answered (or idle): the next request starts a timer again
        deadline = self.pending[0].deadline
        if loop.time() < deadline:
            self.timer = loop.call_at(deadline, self._check_deadline, loop)
            return
        self._fail(NodeTimeout("timed out"))
        self.close()

    def close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


#: ``name: value`` of a field given as its (name, value) pair.
_FIELD = b": "

#: A request :meth:`FastForwarder.begin` sent: its connection and its answer's future.
Begun = tuple[_Connection, "asyncio.Future[Answer]"]

#: Pools (one per node address) kept before those without a connection are dropped.
MAX_POOLS = 1024
#: An idle connection is closed after about this long (seconds: between 3/4 of it
#: and all of it). A node closes its own idle connections sooner (its keep-alive,
#: 5 s by default): one idle longer is to a node that died without closing it (its
#: host lost, a partition), and would otherwise hold a file descriptor for the
#: router's life, up to ``max_idle`` per node, every replaced node's on top of the last.
IDLE_TIMEOUT = 60.0
#: Reaps per ``IDLE_TIMEOUT``: a connection idle through this many is closed.
REAPS = 4


def _origin_and_path(url: str) -> tuple[str, str]:
    """``http://host:port/path?q`` -> (``host:port``, ``/path?q``)."""
    if not url.startswith("http://"):
        raise Unreachable(f"only http:// is supported by the fast client: {url[:40]}")
    rest = url[7:]
    slash = rest.find("/")
    return (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])


class _Pool:
    __slots__ = (
        "dropped",
        "filling",
        "host",
        "host_header",
        "idle",
        "max_idle",
        "open",
        "origin",
        "pipelined",
        "port",
        "reaps",
    )

    def __init__(
        self, host: str, port: int, max_idle: int, pipelined: dict[str, int], origin: str = ""
    ) -> None:
        self.host = host
        self.port = port
        #: Its key among the forwarder's pools (``host:port`` as the URLs spell it).
        self.origin = origin
        self.host_header = f"{host}:{port}".encode()
        self.idle: deque[_Connection] = deque()
        self.max_idle = max_idle
        #: The connection taking this event-loop step's requests (pipelining only).
        self.filling: _Connection | None = None
        #: The forwarder's counts of pipelined writes and the requests they carried.
        self.pipelined = pipelined
        #: Connections open to the node (idle or in use).
        self.open = 0
        #: No longer the forwarder's pool for its address (see ``_forget_unused``).
        self.dropped = False
        #: Reaps of idle connections so far (a count, not a clock: a connection put
        #: back notes it with no call on the request's path).
        self.reaps = 0

    def release(self, connection: _Connection) -> None:
        """A connection with nothing in flight: kept for reuse, or closed."""
        if (
            connection.keep_alive
            and not connection.closed
            and not self.dropped
            and len(self.idle) < self.max_idle
        ):
            connection.idle_at = self.reaps
            self.idle.append(connection)
        else:
            connection.close()

    def reap(self) -> None:
        """Close the connections idle through :data:`REAPS` reaps (the oldest are
        first: connections are reused last in, first out)."""
        self.reaps += 1
        idle = self.idle
        while idle and idle[0].idle_at <= self.reaps - REAPS:
            idle.popleft().close()

    def forget(self, connection: _Connection) -> None:
        """``connection`` closed: it leaves the idle connections, if it was one."""
        with contextlib.suppress(ValueError):
            self.idle.remove(connection)

    def unused(self) -> bool:
        """No connection is open, idle or in use (one may be connecting)."""
        return not self.open and self.filling is None


class FastForwarder:
    """Implements :class:`router.forward.Forwarder` for ``http://`` nodes.

    ``pipeline`` > 1 sends the requests for one node made in the same
    event-loop step on one connection, in one write, up to ``pipeline`` of
    them (HTTP/1.1 pipelining; the node answers them in order): one write
    and one read where there were ``pipeline`` of each, on the router and on
    the node. The price is head-of-line waiting: a request behind a slow one
    on the same connection waits for it, and a connection's requests time
    out together. So it suits nodes whose application answers quickly and
    evenly (the embedded app, the decision API); it is off by default.
    HEAD requests are never pipelined (their answers cannot be framed
    without knowing them to be HEAD).
    """

    def __init__(
        self,
        *,
        timeouts: Timeouts | None = None,
        max_idle: int = 256,
        pipeline: int = 1,
        idle_timeout: float = IDLE_TIMEOUT,
        max_answer: int = MAX_ANSWER,
    ) -> None:
        if pipeline < 1:
            raise ValueError("pipeline must be at least 1")
        self.timeouts = timeouts or Timeouts()
        #: Bytes of an answer held at most (:class:`router.forward.AnswerTooLarge`).
        self.max_answer = max_answer
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        #: The timer that closes connections idle past ``idle_timeout`` (set while
        #: there are pools: started by the first).
        self._reaper: asyncio.TimerHandle | None = None
        self.pipeline = pipeline
        self._pools: dict[str, tuple[_Pool, str]] = {}
        self._bases: dict[str, tuple[_Pool, str]] = {}
        #: Origins (``host:port``) reached through a Unix socket (:meth:`through`):
        #: what their pools' new connections go through (``_connect``).
        self._sockets: dict[str, CheckedSocket] = {}
        #: Pipelined writes to nodes and the requests they carried (requests per
        #: write: how well pipelining batches; router metrics).
        self.pipelined = {"writes": 0, "requests": 0}

    def _split(self, url: str) -> tuple[_Pool, str]:
        """``http://host:port/path?q`` -> (pool for host:port, ``/path?q``)."""
        origin, path = _origin_and_path(url)
        found = self._pools.get(origin)
        if found is None:
            if len(self._pools) >= MAX_POOLS:
                self._forget_unused()
            host, _, port = origin.rpartition(":")
            if not host:
                host, port = origin, "80"
            pool = _Pool(host.strip("[]"), int(port), self.max_idle, self.pipelined, origin)
            found = (pool, origin)
            self._pools[origin] = found
            if self._reaper is None:
                self._reap_later()
        return found[0], path

    def through(self, url: str, checked: CheckedSocket | None) -> None:
        """Reach the node at ``url`` through a Unix socket (as router/localsockets.py
        checked it), or over TCP again (None). Connections already open stay as
        they are; new ones follow (``_connect``)."""
        origin, _ = _origin_and_path(url)
        if checked is None:
            self._sockets.pop(origin, None)
            return
        if len(self._sockets) >= MAX_POOLS and origin not in self._sockets:
            self._sockets.clear()
        self._sockets[origin] = checked

    def socket_of(self, url: str) -> str | None:
        """The Unix socket new connections to the node at ``url`` go through (None: TCP)."""
        if not url.startswith("http://"):
            return None
        checked = self._sockets.get(_origin_and_path(url)[0])
        return None if checked is None else checked.path

    def _reap_later(self) -> None:
        self._reaper = asyncio.get_running_loop().call_later(self.idle_timeout / REAPS, self._reap)

    def _reap(self) -> None:
        """Close connections idle past ``idle_timeout`` (no request pays for this:
        a timer, :data:`REAPS` times per timeout, while there are pools)."""
        for pool, _ in self._pools.values():
            pool.reap()
        self._reaper = None
        if self._pools:
            self._reap_later()

    def _forget_unused(self) -> None:
        """Drop the pools that hold no open connection: the nodes a router has
        talked to over its life (each restart of a node on a new address is a
        new one) do not pile up. A pool dropped while its first connection was
        being made serves that request, then closes the connection (it is not
        kept where no request would find it)."""
        kept: dict[str, tuple[_Pool, str]] = {}
        for origin, found in self._pools.items():
            if found[0].unused():
                found[0].dropped = True
            else:
                kept[origin] = found
        self._pools = kept
        self._bases.clear()

    def base(self, url: str) -> tuple[_Pool, str]:
        """A node's base URL as (its pool, the path in front of every request path):
        ``request(m, url + p, ...)`` requests ``prefix + p`` on that pool, for any
        ``p`` that starts with ``/``. Remembered per URL (nodes are few)."""
        found = self._bases.get(url)
        if found is None:
            if len(self._bases) >= 1024:
                self._bases.clear()
            pool, path = self._split(url + "/")
            found = self._bases[url] = (pool, path[:-1])
        return found

    @staticmethod
    def payload(
        method: bytes,
        target: bytes,
        pool: _Pool,
        fields: list[tuple[bytes, bytes]],
        body: bytes | None,
        host: bytes | None = None,
    ) -> bytes:
        """A whole request to ``pool``: its request line (``target``: the path and
        query as they are sent), ``host`` (the node's unless given: a proxied
        request keeps its client's), ``fields``, its length and body; built in
        one join (a forward's request is made of the client's bytes)."""
        pieces = [
            method,
            b" ",
            target,
            b" HTTP/1.1\r\nhost: ",
            pool.host_header if host is None else host,
            b"\r\n",
        ]
        if fields:
            # Each field joined in C (``b": ".join`` of its pair), not a loop of bytecode.
            pieces += (b"\r\n".join(map(_FIELD.join, fields)), b"\r\n")
        if body:
            pieces += (b"content-length: %d\r\n\r\n" % len(body), body)
        else:
            pieces.append(b"content-length: 0\r\n\r\n" if method in (b"POST", b"PUT") else b"\r\n")
        return b"".join(pieces)

    async def request(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        capped: bool = True,
    ) -> Answer:
        pool, path = self._split(url)
        fields = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        # A ``host`` among them is the request's (a proxied request's client's),
        # written once in its place.
        host = next((v for k, v in fields if k.lower() == b"host"), None)
        if host is not None:
            fields = [field for field in fields if field[0].lower() != b"host"]
        payload = self.payload(method.encode(), path.encode(), pool, fields, body, host)
        return await self.send(pool, payload, method == "HEAD", capped)

    def begin(
        self, pool: _Pool, payload: bytes, head: bool = False, capped: bool = True
    ) -> Begun | None:
        """Send a request to ``pool`` now if it goes without waiting (on the
        connection taking this event-loop step's requests when pipelining, or on
        an idle one), and do not wait for its answer: the connection and its
        answer's future, to give :meth:`send` (``begun``), which reads the answer
        as for any request it sent itself (the retry on a fresh connection
        included). None, and nothing sent, when a connection is to be made
        first (:meth:`send` makes it).

        What lets a caller forward the common request without a coroutine of
        its own (router/app.py ``Router.forward_now``)."""
        return self._begin(pool, payload, head, capped, 0)

    def _begin(
        self, pool: _Pool, payload: bytes, head: bool, capped: bool, attempt: int
    ) -> Begun | None:
        """:meth:`begin`, for :meth:`send`'s ``attempt`` (the second goes on a fresh
        connection: the idle ones may have been closed by the node as the first
        one was)."""
        seconds = self.timeouts.total
        pipelined = self.pipeline > 1 and not head
        if pipelined:
            # One still filling takes a second attempt only if it was not reused
            # (the batch sent again joins one).
            filling = pool.filling
            if attempt and filling is not None and filling.reused:
                filling = None
            if (
                filling is not None
                and not filling.closed  # (it may still be connecting: no transport yet)
                and len(filling.pending) < self.pipeline
            ):
                return filling, filling.add(payload, filling.loop, seconds, capped)
        # An idle connection (the common case).
        taken = self._idle(pool) if attempt == 0 else None
        if taken is None:
            return None
        loop = taken.loop
        if not pipelined:
            return taken, taken.start(payload, loop, head, seconds, capped)
        # Requests made in this step join it, and leave in one write (flush).
        pool.filling = taken
        waiter = taken.add(payload, loop, seconds, capped)
        loop.call_soon(taken.flush)
        return taken, waiter

    @staticmethod
    def _idle(pool: _Pool) -> _Connection | None:
        """A writable idle connection of ``pool``, taken (last in, first out: the
        most recently used is the least likely to have been closed by the node);
        those found closing are dropped on the way."""
        idle = pool.idle
        taken = idle.pop() if idle else None
        while taken is not None and not taken.writable():
            taken = idle.pop() if idle else None
        if taken is not None:
            taken.reused = True
        return taken

    async def send(
        self,
        pool: _Pool,
        payload: bytes,
        head: bool = False,
        capped: bool = True,
        begun: Begun | None = None,
    ) -> Answer:
        """Send a whole request (``payload``, as :meth:`request` builds it) to
        ``pool`` and read its answer; ``head``: the request is a HEAD;
        ``capped``: its answer's body may have ``max_answer`` bytes at most;
        ``begun``: its first attempt, already sent by :meth:`begin`.

        A request that fails on a *reused* connection before any byte came
        back on it is sent once more on a fresh connection: the node closed an
        idle connection, and never saw the request.
        """
        loop = asyncio.get_running_loop()
        pipelined = self.pipeline > 1 and not head
        for attempt in (0, 1):
            if begun is None:
                begun = self._begin(pool, payload, head, capped, attempt)
            if begun is not None:
                connection, waiter = begun
                begun = None
            elif pipelined:
                # Requests made while this one connects join it (see flush).
                connection = _Connection(loop)
                connection.pool = pool
                pool.filling = connection
                waiter = connection.add(payload, loop, self.timeouts.total, capped)
                try:
                    await self._connect(pool, loop, connection)
                except Unreachable:
                    pass  # the waiter has it too
                except asyncio.CancelledError:
                    # Nobody else writes what joined it: sent again elsewhere.
                    waiter.cancel()
                    connection.closed = True
                    if pool.filling is connection:
                        pool.filling = None
                    connection._fail(_NeverProcessed("the connecting request left"))
                    connection.close()
                    raise
                else:
                    connection.flush()
            else:
                connection = await self._connect(pool, loop, _Connection(loop))
                waiter = connection.start(payload, loop, head, self.timeouts.total, capped)
            reused = connection.reused
            try:
                return await waiter
            except (Unreachable, AnswerLost) as exc:
                unseen = isinstance(exc, _NeverProcessed) or (reused and not connection.received)
                if unseen and attempt == 0:
                    continue
                raise
        raise Unreachable("connection closed")  # pragma: no cover (loop always returns/raises)

    async def _connect(
        self, pool: _Pool, loop: asyncio.AbstractEventLoop, connection: _Connection
    ) -> _Connection:
        """Connect ``connection`` to ``pool``'s node; ``Unreachable`` (for every
        request already waiting on it too) when that fails."""
        connection.pool = pool
        connection.max_answer = self.max_answer
        unix = self._sockets.get(pool.origin)
        if unix is not None:
            connected = await self._through_socket(loop, unix)
            if connected is not None:
                try:
                    await loop.create_unix_connection(lambda: connection, sock=connected)
                except BaseException as exc:
                    connected.close()
                    if not isinstance(exc, OSError):
                        raise
                else:
                    return connection
            # Over TCP, as the URL says, until the socket is checked again: the
            # node may have stopped listening on it, not at its URL.
            if self._sockets.get(pool.origin) is unix:
                del self._sockets[pool.origin]
        try:
            await asyncio.wait_for(
                loop.create_connection(lambda: connection, pool.host, pool.port),
                timeout=self.timeouts.connect,
            )
        except (OSError, TimeoutError) as exc:
            failure = Unreachable(f"cannot connect to {pool.host}:{pool.port}: {exc}")
            connection.closed = True
            if pool.filling is connection:
                pool.filling = None
            connection._fail(failure)
            raise failure from None
        return connection

    async def _through_socket(
        self, loop: asyncio.AbstractEventLoop, unix: CheckedSocket
    ) -> socket.socket | None:
        """A connection to ``unix`` if it still reaches the process that was checked
        there: the file at the path is the one checked (a node started again on
        the path, or another one, made a new file), and the process listening
        there is the one that answered the check (``SO_PEERCRED``, the pid of
        the listener: no file or name stands between). None otherwise, or if it
        cannot be made."""
        connected = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connected.setblocking(False)
        try:
            if file_identity(unix.path) != unix.identity:
                raise FileNotFoundError(unix.path)
            await asyncio.wait_for(
                loop.sock_connect(connected, unix.path), timeout=self.timeouts.connect
            )
            if peer_credentials(connected)[0] != unix.pid:
                raise ConnectionRefusedError(unix.path)
        except BaseException as exc:
            connected.close()
            if isinstance(exc, OSError | TimeoutError):
                return None
            raise
        return connected

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        return await self.request(
            "POST", url, [("content-type", "application/json"), *headers], payload, False
        )

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        for pool, _ in self._pools.values():
            while pool.idle:
                pool.idle.pop().close()
