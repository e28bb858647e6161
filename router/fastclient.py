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
connection, and never saw the request.
"""

from __future__ import annotations

import asyncio
from collections import deque

import httptools

from router.forward import Answer, NodeTimeout, Timeouts, Unreachable

_DROP = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server"}
)


class _Connection(asyncio.Protocol):
    __slots__ = (
        "body",
        "closed",
        "deadline",
        "head",
        "headers",
        "interim",
        "keep_alive",
        "parser",
        "received",
        "status",
        "timer",
        "transport",
        "waiter",
    )

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[None] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.status = 0
        self.keep_alive = True
        self.closed = False
        self.received = False
        self.head = False
        self.interim = False
        #: When the request under way times out (loop time), and the one timer that
        #: watches it (see :meth:`watch`).
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            # Bytes nobody asked for: this connection's framing can't be trusted.
            self.close()
            return
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(Unreachable(f"bad response: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(Unreachable("connection closed"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:
            self.interim = True  # 1xx (e.g. 100 Continue): the real answer follows
        elif self.head:
            # The parser cannot know the request was HEAD and would wait for the
            # body that content-length announces; the answer is complete, and
            # the connection is not reused.
            self.keep_alive = False
            waiter = self.waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            self.headers = []
            self.body = []
            self.status = 0
            return
        if self.head:
            return
        self.keep_alive = self.parser.should_keep_alive()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # client side
    def _fail(self, exc: Exception) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def start(
        self, payload: bytes, loop: asyncio.AbstractEventLoop, head: bool = False
    ) -> asyncio.Future[None]:
        self.headers = []
        self.body = []
        self.status = 0
        self.received = False
        self.head = head
        self.interim = False
        self.waiter = loop.create_future()
        assert self.transport is not None
        self.transport.write(payload)
        return self.waiter

    def watch(self, loop: asyncio.AbstractEventLoop, seconds: float) -> None:
        """Time out the request under way after ``seconds``. One timer per
        connection, not one per request: a timer that fires before the current
        request's deadline (it was started for an earlier request) waits again."""
        self.deadline = loop.time() + seconds
        if self.timer is None:
            self.timer = loop.call_at(self.deadline, self._check_deadline, loop)

    def _check_deadline(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        waiter = self.waiter
        if self.closed or waiter is None or waiter.done():
            return  # answered (or idle): the next request starts a timer again
        if loop.time() < self.deadline:
            self.timer = loop.call_at(self.deadline, self._check_deadline, loop)
            return
        _expire(self)

    def close(self) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


class _Pool:
    __slots__ = ("host", "host_header", "idle", "port")

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.host_header = f"{host}:{port}".encode()
        self.idle: deque[_Connection] = deque()


class FastForwarder:
    """Implements :class:`router.forward.Forwarder` for ``http://`` nodes."""

    def __init__(self, *, timeouts: Timeouts | None = None, max_idle: int = 256) -> None:
        self.timeouts = timeouts or Timeouts()
        self.max_idle = max_idle
        self._pools: dict[str, tuple[_Pool, str]] = {}
        self._bases: dict[str, tuple[_Pool, str]] = {}

    def _split(self, url: str) -> tuple[_Pool, str]:
        """``http://host:port/path?q`` -> (pool for host:port, ``/path?q``)."""
        if not url.startswith("http://"):
            raise Unreachable(f"only http:// is supported by the fast client: {url[:40]}")
        rest = url[7:]
        slash = rest.find("/")
        origin, path = (rest, "/") if slash < 0 else (rest[:slash], rest[slash:])
        found = self._pools.get(origin)
        if found is None:
            host, _, port = origin.rpartition(":")
            if not host:
                host, port = origin, "80"
            found = (_Pool(host.strip("[]"), int(port)), origin)
            self._pools[origin] = found
        return found[0], path

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
    def head(method: str, path: str, pool: _Pool) -> list[bytes]:
        """The start of a request to ``pool``: its request line and ``host``
        field; the caller adds its own fields and then :meth:`end`'s."""
        return [f"{method} {path} HTTP/1.1\r\nhost: ".encode(), pool.host_header, b"\r\n"]

    @staticmethod
    def end(method: str, body: bytes | None) -> list[bytes]:
        """What follows a request's fields: its length and body."""
        if body:
            return [b"content-length: %d\r\n\r\n" % len(body), body]
        return [b"content-length: 0\r\n\r\n" if method in ("POST", "PUT") else b"\r\n"]

    async def request(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes | None
    ) -> Answer:
        pool, path = self._split(url)
        lines = self.head(method, path, pool)
        for name, value in headers:
            lines.append(f"{name}: {value}\r\n".encode("latin-1"))
        lines += self.end(method, body)
        return await self.send(pool, b"".join(lines), method == "HEAD")

    async def send(self, pool: _Pool, payload: bytes, head: bool = False) -> Answer:
        """Send a whole request (``payload``, as :meth:`request` builds it) to
        ``pool`` and read its answer; ``head``: the request is a HEAD."""
        loop = asyncio.get_running_loop()
        idle = pool.idle
        for attempt in (0, 1):
            # An idle connection without a coroutine (the common case); else _acquire.
            connection = idle.pop() if idle else None
            if connection is not None and not connection.closed:
                reused = True
            else:
                connection, reused = await self._acquire(pool, loop)
            waiter = connection.start(payload, loop, head)
            connection.watch(loop, self.timeouts.total)
            try:
                await waiter
            except Unreachable:
                if reused and not connection.received and attempt == 0:
                    continue
                raise
            answer = Answer(
                connection.status,
                [(k, v) for k, v in connection.headers if k not in _DROP],
                b"".join(connection.body),
            )
            if connection.keep_alive and not connection.closed and len(pool.idle) < self.max_idle:
                pool.idle.append(connection)
            else:
                connection.close()
            return answer
        raise Unreachable("connection closed")  # pragma: no cover (loop always returns/raises)

    async def _acquire(
        self, pool: _Pool, loop: asyncio.AbstractEventLoop
    ) -> tuple[_Connection, bool]:
        idle = pool.idle
        while idle:
            connection = idle.pop()
            if not connection.closed:
                return connection, True
        try:
            _, protocol = await asyncio.wait_for(
                loop.create_connection(_Connection, pool.host, pool.port),
                timeout=self.timeouts.connect,
            )
        except (OSError, TimeoutError) as exc:
            raise Unreachable(f"cannot connect to {pool.host}:{pool.port}: {exc}") from None
        return protocol, False

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        return await self.request(
            "POST", url, [("content-type", "application/json"), *headers], payload
        )

    async def close(self) -> None:
        for pool, _ in self._pools.values():
            while pool.idle:
                pool.idle.pop().close()


def _expire(connection: _Connection) -> None:
    connection._fail(NodeTimeout("timed out"))
    connection.close()
