"""The router's HTTP protocol: uvicorn's, with a shorter way through for the proxy.

Every proxied request without a body (a GET, a HEAD, a DELETE: nearly all
of a rate-limited API's traffic) is read by uvicorn's httptools protocol as
usual, then served by :class:`ProxyCycle` instead of uvicorn's
``RequestResponseCycle``: the same :meth:`router.app.Router.proxy` (so every
refusal, retry, failover and timeout behaves as it does on any other
request), with a lighter ASGI ``receive``/``send`` pair underneath. The
answer leaves in one write without uvicorn's per-field checks: its fields
are the node's, already parsed by the forwarding client's HTTP parser
(which refuses control characters in them), or the router's own.

Measured side by side (``ringlimit bench``, docs/architecture.md): what a
request costs the router is mostly what surrounds the forward, and uvicorn's
cycle (an ``asyncio.Event``, two ASGI messages, a regular-expression check
per response field) is a fair part of it.

Everything else (requests with a body, the decision API, admin, health,
metrics, upgrades, ``Expect: 100-continue``, a server at its connection
cap) takes uvicorn's own path. This relies on uvicorn's internals: the
version is pinned below the next minor release (pyproject.toml).
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from functools import partial
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from node.server import _CoalescedWrites

if TYPE_CHECKING:
    from router.app import Router, _Flight

log = logging.getLogger("ringlimit.router")

__all__ = [
    "AnswerWrites",
    "ProxyCycle",
    "direct_proxy_protocol",
    "has_dot_segment",
]

#: The router's own endpoints (router/app.py dispatches them; everything else is
#: proxied, except ``/internal``, which is never reachable through the front door).
CONTROL_PATHS = frozenset({"/healthz", "/metrics", "/v1/check"})
ADMIN_PREFIX = "/admin/"
_NOT_PROXIED = (ADMIN_PREFIX, "/internal")


def has_dot_segment(path: str) -> bool:
    """Whether ``path`` (decoded) has a ``.`` or ``..`` segment (RFC 3986 5.2.4): the
    router refuses it (400), since "/x/../internal" passes its /internal check and
    something on the way to the node could resolve it."""
    if "/." not in path:
        return False  # every request's path: one substring search in C
    return any(segment in (".", "..") for segment in path.split("/"))


_EMPTY_REQUEST = {"type": "http.request", "body": b"", "more_body": False}
_DISCONNECT = {"type": "http.disconnect"}
_INTERNAL_ERROR_BODY = json.dumps(
    {"error": "internal_error", "detail": "the router failed to answer this request"}
).encode()
_INTERNAL_ERROR = (
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s"
    % (len(_INTERNAL_ERROR_BODY), _INTERNAL_ERROR_BODY)
)


class _NoWait:
    """uvicorn's protocol sets the cycle's ``message_event`` as the request's body
    arrives or the connection goes; a request without a body never waits on it."""

    __slots__ = ()

    def set(self) -> None:
        return None

    def clear(self) -> None:
        return None


_NO_WAIT = _NoWait()


class ProxyCycle:
    """One proxied request without a body, and its answer.

    Has what uvicorn's protocol reads and writes on its current cycle
    (``response_complete``, ``disconnected``, ``keep_alive``, ``more_body``,
    ``body``, ``message_event``, ``run_asgi``), so client pipelining,
    keep-alive, a lost connection and a graceful shutdown work as with
    uvicorn's own cycle.

    The common request is served without a task (:meth:`begin`): sent to its
    node at once, answered from a callback of its answer's future. While it is
    in flight so, the cycle stands in the server's set of tasks for it
    (``server_state.tasks``, which uvicorn only counts, for
    ``limit_concurrency``, and cancels when a graceful shutdown runs out of
    time: :meth:`cancel`), so both see it as they see a request in a task.
    Anything else (and whatever such a request turns into: a retry, a
    failover, a wait) goes on in uvicorn's task, :meth:`run_asgi`.
    """

    __slots__ = (
        "app",
        "body",
        "disconnected",
        "flight",
        "flow",
        "headers",
        "keep_alive",
        "message_event",
        "more_body",
        "on_response",
        "protocol",
        "response_complete",
        "response_started",
        "resume",
        "scope",
        "status",
        "transport",
    )

    #: Set by :meth:`begin` (not before: only a request begun there reads them):
    #: the app, and the request in flight without a task until it is answered.
    app: Router
    flight: _Flight | None

    def __init__(self, protocol: Any, scope: dict[str, Any], keep_alive: bool) -> None:
        self.protocol = protocol
        self.scope = scope
        self.transport = protocol.transport
        self.flow = protocol.flow
        self.on_response = protocol.on_response_complete
        self.keep_alive = keep_alive
        self.disconnected = False
        self.response_started = False
        self.response_complete = False
        self.more_body = True
        self.body = bytearray()
        self.message_event = _NO_WAIT
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        #: What the task does (:meth:`run_asgi`): set when the request is not (or no
        #: longer) served without one; None: ``app.proxy`` from the start.
        self.resume: Callable[[], Awaitable[None]] | None = None

    def begin(self, app: Router) -> bool:
        """Serve the request without a task if it is the common one
        (``app.forward_now``): True, and it is in flight (or answered). False:
        a task is to serve it, from ``resume`` (set here when
        ``app.forward_now`` began it) or from the start.

        An exception here is the request's, not the server's (as in
        :meth:`run_asgi`): a 500 (True: nothing left to do)."""
        self.app = app
        try:
            now = app.forward_now(self)
        except Exception:
            self._failed()
            self.on_response = _nothing
            return True
        if now is None:
            return False
        if callable(now):
            self.resume = now
            return False
        self.flight = now
        self.protocol.tasks.add(self)  # (see the class: counted, and cancelled, as a task)
        now.waiter.add_done_callback(self._answered)
        return True

    def _answered(self, waiter: asyncio.Future[Any]) -> None:
        """The answer's future of the request :meth:`begin` sent is done: it is
        relayed (``app.answered_now``), or the request goes on in a task, as
        uvicorn starts one (so counted, and cancelled at shutdown, as any)."""
        flight = self.flight
        if flight is None:
            return  # cancelled (the server's graceful shutdown ran out of time)
        self.flight = None
        protocol = self.protocol
        try:
            resume = self.app.answered_now(self, flight)
        except Exception:
            self._failed()
            self.on_response = _nothing
        else:
            if resume is None:
                self._ended()
                self.on_response = _nothing  # (as at the end of run_asgi)
            else:
                self.resume = resume
                protocol.start_task(self, self.app)
        protocol.tasks.discard(self)

    def cancel(self, msg: Any = None) -> bool:
        """The server's graceful shutdown ran out of time with this request in
        flight without a task (uvicorn cancels what is in ``server_state.tasks``):
        what a task's cancellation does (:meth:`run_asgi`), a 500 if nothing was
        sent yet and the connection closed, and the answer's future cancelled
        (the node's answer, when it comes, is dropped)."""
        flight = self.flight
        if flight is None:
            return False
        self.flight = None
        flight.waiter.cancel()
        self._fail()
        self.on_response = _nothing
        # Not at once: uvicorn is going through the set.
        self.protocol.loop.call_soon(self.protocol.tasks.discard, self)
        return True

    async def run_asgi(self, app: Router) -> None:
        """The task uvicorn's protocol starts (and starts again for a pipelined
        request): ``resume`` (:meth:`begin` left it there), else ``app.proxy``."""
        try:
            resume = self.resume
            if resume is None:
                await app.proxy(self.scope, self.receive, self.send)
            else:
                await resume()
        except asyncio.CancelledError:
            self._fail()  # the server's graceful shutdown ran out of time
            raise
        except Exception:
            self._failed()
        else:
            self._ended()
        finally:
            self.on_response = _nothing
            # (``resume`` holds this cycle's own methods: a reference cycle,
            # otherwise, that only the garbage collector would free.)
            self.resume = None

    def _failed(self) -> None:
        """Proxying the request raised (a bug): said in the log, and :meth:`_fail`."""
        log.exception("proxying %s %s failed", self.scope["method"], self.scope["path"])
        self._fail()

    def _ended(self) -> None:
        """Proxying the request ended: a 500 if it was not answered (a bug)."""
        if not self.response_complete and not self.disconnected:
            log.error("no whole answer to %s %s", self.scope["method"], self.scope["path"])
            self._fail()

    def _fail(self) -> None:
        """A 500 if nothing was sent yet, and the connection closed (as uvicorn does):
        the requests pipelined behind this one are not answered."""
        if not self.response_started and not self.transport.is_closing():
            self.transport.write(_INTERNAL_ERROR)
        self.transport.close()

    async def receive(self) -> dict[str, Any]:
        if self.disconnected or self.response_complete:
            return _DISCONNECT
        return _EMPTY_REQUEST

    async def send(self, message: MutableMapping[str, Any]) -> None:
        """ASGI ``send``: the fields are kept until the body, then both leave at once."""
        if message["type"] == "http.response.start":
            if self.response_started:
                raise RuntimeError("the response has started already")
            self.response_started = True
            self.status = message["status"]
            self.headers = list(message.get("headers", ()))
            return
        if not self.response_started or self.response_complete:
            raise RuntimeError(f"unexpected ASGI message {message['type']!r}")
        body = message.get("body", b"")
        if message.get("more_body", False):
            # The router's answers are whole; should one ever stream, it is buffered.
            self.body += body
            return
        if self.body:
            body = bytes(self.body) + body
            self.body = bytearray()
        await self.answer(self.status, self.headers, body)

    async def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        """Write a whole answer in one write (``headers`` without ``content-length``
        get one) and end the request as uvicorn's cycle ends it."""
        sized = False
        for name, value in headers:
            if name == b"content-length":
                sized = True
            elif name == b"connection" and b"close" in [
                token.strip() for token in value.lower().split(b",")
            ]:
                self.keep_alive = False
        await self.relay(status, headers, body, sized)

    async def relay(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, sized: bool = False
    ) -> None:
        """:meth:`answer` for ``headers`` known to hold no ``connection``: a node's
        answer, whose forwarder dropped it (router/forward.py), with the router's
        own fields. ``sized``: ``headers`` settle the answer's length (the
        forwarder's ``Answer.sized``, or a ``content-length`` among them); otherwise
        it is given that of ``body``."""
        while self.flow.write_paused and not self.disconnected:
            await self.flow.drain()  # (until it takes writes again, or is lost)
        self.relay_now(status, headers, body, sized)  # (so: now)

    def relay_now(
        self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, sized: bool = False
    ) -> Callable[[], Awaitable[None]] | None:
        """:meth:`relay` at once (None) unless the client's connection is not
        taking writes (flow control): then nothing is done, and what is returned
        relays it, to await. No coroutine for an answer that leaves now: the
        callback path (:meth:`begin`) has none to await it in."""
        if self.flow.write_paused and not self.disconnected:
            return partial(self.relay, status, headers, body, sized)
        self.response_started = True
        if self.disconnected:
            self.response_complete = True
            return None
        protocol = self.protocol
        defaults = protocol.server_state.default_headers
        written = protocol.defaults_written
        if written[0] is not defaults:
            written = protocol.defaults_written = (
                defaults,
                b"".join([b"%s: %s\r\n" % field for field in defaults]),
            )
        content = [STATUS_LINE[status], written[1]]
        if headers:
            # Each field joined in C (``b": ".join`` of its pair), not a loop of
            # bytecode per field: a node's answer has seven or more.
            content += (b"\r\n".join(map(_FIELD.join, headers)), b"\r\n")
        if not sized:
            content.append(b"content-length: %d\r\n" % len(body))
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        content.append(b"\r\n")
        if self.scope["method"] != "HEAD":
            content.append(body)
        transport = self.transport
        if type(transport) is AnswerWrites:
            transport.write_answer(b"".join(content), bool(self.protocol.pipeline))
        else:
            transport.write(b"".join(content))
        self.response_complete = True
        if not self.keep_alive:
            self.transport.close()
        self.on_response()
        return None


#: ``name: value`` of a field given as its (name, value) pair.
_FIELD = b": "


def _nothing() -> None:
    return None


class AnswerWrites(_CoalescedWrites):
    """The router's client transport: node/server.py's coalesced writes (what
    uvicorn's own cycle writes in two parts leaves in one), and whole answers of
    :class:`ProxyCycle` written at once when nothing is to leave with them.

    An answer already whole gains nothing from waiting for the end of the
    event-loop step, and costs a callback there. It waits only behind what is
    buffered (order) or when a client's pipelined request waits behind it (its
    answer may leave with this one, see ``postpone``)."""

    __slots__ = ()

    def write_answer(self, data: bytes, more: bool) -> None:
        """Write a whole answer; ``more``: pipelined requests wait behind it."""
        if more or self._buffer:
            self.write(data)
        else:
            self._transport.write(data)


def direct_proxy_protocol(base: type) -> type:
    """``base`` (uvicorn's httptools protocol, with the front door's limits) that
    serves proxied requests without a body through :class:`ProxyCycle`."""

    class DirectProxyProtocol(base):  # type: ignore[valid-type,misc]
        # uvicorn's, set in its __init__ (declared for the type checker).
        app: Any
        parser: Any
        url: bytes
        headers: list[tuple[bytes, bytes]]
        scope: Any
        cycle: Any
        flow: Any
        pipeline: Any
        expect_100_continue: bool
        root_path: str
        _hosts: int  # (node/frontdoor.py's)
        #: The server's default fields (``date``, ``server``) last written, and as
        #: bytes: uvicorn replaces their list (a new date) once a second, so a
        #: connection joins them once a second, not on every answer. (The list is
        #: held: ``is`` cannot match another one.)
        defaults_written: tuple[Any, bytes] = (None, b"")
        #: A client that half-closes after its requests gets their answers (the
        #: router abandons no forward when its client closes, so nothing is held
        #: longer for it: node/frontdoor.py ``eof_received``).
        answers_after_eof = True

        #: uvicorn's: a task for ``cycle`` (where a ProxyCycle goes on, when it does).
        start_task = base._start_asgi_task  # type: ignore[attr-defined]

        def _start_asgi_task(self, cycle: Any, app: Any) -> None:
            # uvicorn's (a request read, or a pipelined one whose turn came), but a
            # proxied request is served without a task when it can be.
            if type(cycle) is ProxyCycle and app.forwards_now and cycle.begin(app):
                return
            self.start_task(cycle, app)

        def on_headers_complete(self) -> None:
            parser = self.parser
            url = self.url
            if (
                url[:1] != b"/"
                or self.expect_100_continue
                or self.root_path
                or parser.should_upgrade()
                or self._hosts != 1  # (counted by the front door: its 400, or HTTP/1.0's none)
                or not getattr(self.app, "direct_proxy", False)
            ):
                super().on_headers_complete()
                return
            for name, _ in self.headers:
                if name == b"content-length" or name == b"transfer-encoding":
                    super().on_headers_complete()  # a body: uvicorn's cycle reads it
                    return
            limit = self.limit_concurrency
            if limit is not None and (len(self.connections) >= limit or len(self.tasks) >= limit):
                super().on_headers_complete()  # over capacity: the front door's 503
                return
            parsed = httptools.parse_url(url)
            raw_path = parsed.path
            path = raw_path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
            if path in CONTROL_PATHS or path.startswith(_NOT_PROXIED) or has_dot_segment(path):
                super().on_headers_complete()  # the app answers (or refuses) these
                return
            self._stop_waiting()
            scope = self.scope
            scope["method"] = parser.get_method().decode("ascii")
            http_version = parser.get_http_version()
            if http_version != "1.1":
                scope["http_version"] = http_version
            scope["path"] = path
            scope["raw_path"] = raw_path
            scope["query_string"] = parsed.query or b""
            cycle = ProxyCycle(self, scope, http_version != "1.0" and parser.should_keep_alive())
            existing = self.cycle
            self.cycle = cycle
            if existing is None or existing.response_complete:
                self._start_asgi_task(cycle, self.app)
            else:
                # A client's pipelined request waits for the one before it (as in uvicorn).
                self.flow.pause_reading()
                self.pipeline.appendleft((cycle, self.app))

    return DirectProxyProtocol
