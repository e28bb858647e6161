"""What a node serves behind its limiter: an echo app, an upstream, or the user's app."""

from __future__ import annotations

import asyncio
import importlib
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import yarl

from node.asgi import ASGIApp, RawHeaders, Receive, Scope, Send, drain, dumps, send_json
from node.config import UPSTREAM_IDLE, UPSTREAM_TIMEOUT
from node.failures import Failures
from node.frontdoor import FrontDoor
from node.headers import DEGRADED_HEADER
from node.hopbyhop import HOP_BY_HOP, NO_CONTENT, passed_on
from node.identity import header_text
from node.inline import inline_app
from node.peers import one_line

log = logging.getLogger("ringlimit.node")

#: Request fields not passed to the upstream: hop-by-hop ones, those aiohttp
#: sets for the request it makes (a declared length is set again: see
#: :func:`declared_length`), and ``Expect``: the node's server answers a
#: client's ``100-continue`` itself, once the body is asked for; passed on,
#: aiohttp waited for the upstream's own ``100 Continue`` before it sent the
#: body, and an upstream that sends none (Python's http.server) never got it:
#: a 502 after the whole timeout, for every upload curl makes over 1 MiB.
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
#: Bytes the upstream's status line, and any one field of its answer, may take:
#: as many as the node's front door takes of a request's whole head. aiohttp's
#: default, 8190, made a longer field (a large cookie, a CSP) an opaque 502.
ANSWER_FIELD_BYTES = FrontDoor.max_header_bytes
#: Fields an upstream's answer may have. aiohttp's default, 128, made an answer
#: with more an opaque 502. aiohttp bounds the count and each field, not their
#: sum: with both at the front door's figure an answer's head could hold a
#: gigabyte, so the count is what real answers need with room to spare (an
#: answer's head: 64 MiB at most).
ANSWER_FIELDS = 1024
#: The upstream's fields not passed back: hop-by-hop ones, and ``date`` and
#: ``server``, which the node's server sets (twice each otherwise; nginx hides
#: the upstream's too). Its ``content-length`` is kept: the body is relayed as
#: it came, byte for byte.
NOT_RELAYED = HOP_BY_HOP | {b"date", b"server"}
#: An answer without content (204, 304) loses its length too: uvicorn would wait
#: for that many bytes of body (a 304 may announce one, RFC 9110 8.6).
NOT_RELAYED_NO_CONTENT = NOT_RELAYED | {b"content-length"}


def echo_app(node_id: str) -> ASGIApp:
    """The default application: answers JSON naming the node, the user and the path.

    It lets the quick start show limiting and stickiness without any other service.
    """

    async def echo(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        await drain(receive)
        info = scope.get("state", {}).get("ringlimit", {})
        await send_json(
            send,
            200,
            {
                "node": node_id,
                "user": info.get("key"),
                "method": scope["method"],
                "path": scope["path"],
            },
        )

    return inline_app(echo)  # (it never needs a task: node/inline.py)


def load_app(spec: str) -> ASGIApp:
    """Import ``module:attribute`` (e.g. ``myproject.asgi:app``)."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"--app {spec!r}: expected 'module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"--app {spec!r}: cannot import {module_name!r}: {exc}") from None
    app = module
    for part in attribute.split("."):
        try:
            app = getattr(app, part)
        except AttributeError:
            raise ValueError(f"--app {spec!r}: {module_name!r} has no {attribute!r}") from None
    if not callable(app):
        raise ValueError(f"--app {spec!r}: {attribute!r} is not an ASGI application")
    return app  # type: ignore[return-value]


class BodyMismatch(Exception):
    """A request's body did not end at the length it declared: its client went
    away before the end, or its server passed on more.

    Raised in the body aiohttp is sending, which then closes that connection to
    the upstream instead of ending the request: the upstream never takes a cut
    chunked body as whole, nor waits for bytes that will not come (and reads
    whatever comes next on the connection as them)."""


def declared_length(fields: RawHeaders) -> int | None:
    """The length of the body a request declared: ``None`` when it came chunked,
    ``0`` when it declared none. Sent on as it came: a body streamed without a
    length goes chunked, which servers that read ``Content-Length`` only
    (Python's wsgiref, under Django's runserver) take as empty, without an error.

    (The front door's parser refuses a malformed or doubled length, and one
    given with ``Transfer-Encoding``; such a request goes chunked here.)"""
    length = 0
    for name, value in fields:
        if name == b"transfer-encoding":
            return None
        if name == b"content-length":
            if not value.strip().isdigit():
                return None
            length = int(value)
    return length


async def request_body(
    receive: Receive,
    length: int | None,
    read: asyncio.Event | None = None,
    gone: asyncio.Event | None = None,
) -> AsyncIterator[bytes]:
    """The client's body as it arrives, ``length`` bytes (``None``: as many as
    come, chunked); :class:`BodyMismatch` when it does not end there. ``read``
    is set once the whole body is read (``receive`` then only says whether
    the client went away); ``gone`` when the client went away before its end."""
    sent = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect: the client went
            if gone is not None:
                gone.set()
            raise BodyMismatch(f"the client went away after {sent} bytes of its body")
        chunk = message.get("body", b"")
        sent += len(chunk)
        if length is not None and sent > length:
            raise BodyMismatch(f"{sent} bytes of a body declared as {length}")
        if chunk:
            yield chunk
        if not message.get("more_body"):
            if length is not None and sent != length:
                raise BodyMismatch(f"{sent} bytes of a body declared as {length}")
            if read is not None:
                read.set()
            return


@dataclass
class UpstreamStats:
    """What went wrong with the upstream, by kind (``/metrics``: ringlimit_upstream_*)."""

    #: Requests it did not answer: refused, unresolvable, TLS, or the timeout
    #: before the answer began (502 upstream_unavailable).
    unavailable: int = 0
    #: Answers it broke off after they began (the client's connection is closed).
    broke_off: int = 0
    #: Answers HTTP cannot relay: a status outside 100-599, or a final 1xx (502).
    invalid: int = 0
    #: Requests whose client went away before the answer ended: the upstream's
    #: request was stopped, not left to run to the timeout.
    abandoned: int = 0


#: The help of each ``ringlimit_upstream_*_total`` counter.
UPSTREAM_METRICS = {
    "unavailable": "Requests the upstream did not answer (refused, unresolvable, TLS, "
    "timed out before the answer began): 502 upstream_unavailable.",
    "broke_off": "Upstream answers that broke off after they began.",
    "invalid": "Upstream answers with a status outside 100-599, or a final 1xx (a 101): 502.",
    "abandoned": "Requests whose client went away before the answer ended: the "
    "upstream request was stopped.",
}


class UpstreamApp:
    """Forward each request to an upstream HTTP service (streaming both bodies)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = UPSTREAM_TIMEOUT,
        idle_timeout: float = UPSTREAM_IDLE,
    ) -> None:
        self.url = url.rstrip("/")
        #: The URL as yarl encodes it (once); each request's path and query are
        #: added to it as they came.
        self._base = str(yarl.URL(self.url))
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=2.0)
        #: How long an idle connection is reused: below the upstream's keep-alive,
        #: or a request written as the upstream closes it gets no answer. aiohttp
        #: sends an idempotent request again then, never a POST: that one is a 502.
        self.idle_timeout = idle_timeout
        self._session: aiohttp.ClientSession | None = None
        #: Answers that broke off after they began, and requests the upstream did
        #: not answer: a warning each, at most one every 10 s per kind (an
        #: upstream that keeps dying must not flood the log).
        self._broken = Failures(log)
        self.stats = UpstreamStats()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                connector=aiohttp.TCPConnector(
                    limit=256, ttl_dns_cache=300, keepalive_timeout=self.idle_timeout
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                max_line_size=ANSWER_FIELD_BYTES,
                max_field_size=ANSWER_FIELD_BYTES,
                max_headers=ANSWER_FIELDS,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def target(self, scope: Scope) -> yarl.URL:
        """The upstream's URL for a request: its path and query exactly as the
        client sent them. A str URL goes through yarl, which decodes and quotes
        again (``%3A`` became ``:``, ``%zz`` became ``%25zz``, dot segments were
        resolved), and a signed URL or an HMAC over the query no longer matched.
        (The front door takes only ASCII in a request's target.)"""
        target = self._base + (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        return yarl.URL(target, encoded=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The exchange with the upstream, stopped if the client goes away first.

        uvicorn's ``send`` does nothing once the client is gone, so an exchange
        left alone ran to the upstream's timeout (30 s): a slow upstream held a
        connection of the pool for each request a router had long given up on,
        other users' requests queued behind them, and a download the client
        dropped was read to its end. Once the request's body is read, its
        ``receive`` says when the client goes (as Starlette's streaming answers
        listen for it), and the exchange is cancelled: aiohttp closes that
        upstream connection, which the upstream sees as the client's going.
        """
        if scope["type"] != "http":
            return
        body_read = asyncio.Event()
        answered = asyncio.Event()
        left = asyncio.Event()  # the client went away while its body was being read
        exchange = asyncio.ensure_future(
            self._exchange(scope, receive, send, body_read, answered, left)
        )
        gone = asyncio.ensure_future(_client_gone(receive, body_read))
        try:
            await asyncio.wait((exchange, gone), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            exchange.cancel()
            gone.cancel()
            await asyncio.gather(exchange, gone, return_exceptions=True)
            raise
        gone.cancel()
        if not exchange.done() and not answered.is_set():
            exchange.cancel()
            self.stats.abandoned += 1
            # Until it has let go of its upstream connection; without raising its
            # CancelledError, which is not this task's (a cancellation of this
            # task meanwhile is raised here, as it must be).
            await asyncio.wait((exchange,))
            if not exchange.cancelled() and exchange.exception() is not None:
                log.debug("an abandoned upstream exchange ended with %r", exchange.exception())
            return
        await exchange  # (its own errors are raised here, as they were)

    async def _exchange(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        body_read: asyncio.Event,
        answered: asyncio.Event,
        left: asyncio.Event,
    ) -> None:
        """One request's exchange; ``answered`` is set as its answer's last
        message goes (from then on, a ``http.disconnect`` is the answer's end)."""
        # header_text: valid UTF-8 stays UTF-8, which aiohttp writes back byte for byte.
        fields = scope["headers"]
        # ringlimit's fields stay in the cluster, except the node's mark of a request
        # its usual limiter did not decide (the middleware drops a client's), taken
        # apart from the hop-by-hop filter: a client's "Connection:
        # X-Ringlimit-Degraded" stripped the node's own mark before the application.
        headers = [
            (k.decode("latin-1"), header_text(v))
            for k, v in passed_on(fields, NOT_FORWARDED)
            if not k.startswith(b"x-ringlimit-")
        ]
        headers += [
            (k.decode("latin-1"), header_text(v)) for k, v in fields if k == DEGRADED_HEADER
        ]
        # The upstream gets its own Host (as nginx sends it); the client's goes in
        # X-Forwarded-Host, unless a proxy ahead set one, for the absolute URLs and
        # redirects an application builds.
        host = forwarded_host = None
        for name, value in fields:
            if name == b"host":
                host = value
            elif name == b"x-forwarded-host":
                forwarded_host = value
        if host is not None and forwarded_host is None:
            headers.append(("X-Forwarded-Host", header_text(host)))
        # A request that came without a body goes without one (some servers
        # refuse a GET with an empty chunked body); one that came sized goes
        # sized (aiohttp does not chunk a body given a Content-Length).
        length = declared_length(fields)
        if length:
            headers.append(("Content-Length", str(length)))
        elif length == 0:
            body_read.set()  # (None: chunked, read as it comes)
        started = False
        try:
            async with self._client().request(
                scope["method"],
                self.target(scope),
                headers=headers,
                data=None if length == 0 else request_body(receive, length, body_read, left),
                allow_redirects=False,
            ) as response:
                if not 200 <= response.status <= 599:
                    # aiohttp reads any three digits; HTTP defines 100-599, and the
                    # node's server can write no other status line (a traceback and
                    # a connection closed without an answer, for each request).
                    # aiohttp passes over interim answers (100, 103) but returns a
                    # 101 as final: relayed, a switch nobody asked for (no Upgrade
                    # is passed on) left the client reading HTTP as another protocol.
                    self.stats.invalid += 1
                    final = " as its final answer" if response.status < 200 else ""
                    detail = (
                        f"the upstream answered status {response.status}{final}, outside 200-599"
                    )
                    answered.set()
                    await _unavailable(send, detail)
                    return
                out = [
                    field
                    for field in passed_on(
                        [(k.lower(), v) for k, v in response.raw_headers],
                        NOT_RELAYED_NO_CONTENT if response.status in NO_CONTENT else NOT_RELAYED,
                    )
                    # ringlimit's own fields are the node's to say: an upstream that
                    # is itself a ringlimit cluster answers 503s with
                    # x-ringlimit-unavailable, which this node's router would take
                    # for this node's and send the request again elsewhere.
                    if not field[0].startswith(b"x-ringlimit-")
                ]
                await send(
                    {"type": "http.response.start", "status": response.status, "headers": out}
                )
                started = True
                async for chunk in response.content.iter_chunked(65536):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                answered.set()
                await send({"type": "http.response.body", "body": b""})
        except (aiohttp.ClientError, TimeoutError) as exc:
            if left.is_set():
                # The client went away mid-upload: the upstream's connection was
                # closed for it (the body is never taken as whole), not a failure
                # of the upstream's (any client could raise that count at will).
                self.stats.abandoned += 1
            elif started:
                self.stats.broke_off += 1
                self._broke_off(scope, exc)
            else:
                self.stats.unavailable += 1
                self._broken.warn(
                    "upstream_unavailable",
                    "the upstream did not answer %s %s (%s): 502",
                    scope["method"],
                    scope["path"],
                    type(exc).__name__,
                )
                answered.set()
                await _unavailable(send, _what_failed(exc))

    def _broke_off(self, scope: Scope, exc: BaseException) -> None:
        """The answer broke off after it began (the upstream closed mid-body, or
        the timeout ran out): no second start can follow the first. Returning
        with the answer unfinished makes uvicorn close the client's connection
        (and log that it did), so the client sees an answer cut short, never a
        complete one that is wrong."""
        self._broken.warn(
            "upstream_broke_off",
            "the upstream's answer to %s %s broke off after it began (%s): "
            "the client's connection is closed",
            scope["method"],
            scope["path"],
            type(exc).__name__,
        )


def _what_failed(exc: BaseException) -> str:
    """A 502's detail: what went wrong with the upstream, in aiohttp's words where
    it has them. "ClientResponseError from upstream" was all it said of a field
    past 64 KiB, a 204 with a body or two Content-Lengths alike (a tester)."""
    if isinstance(exc, TimeoutError):
        return "the upstream did not answer within --upstream-timeout"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "the upstream closed the connection before it answered"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return f"cannot connect to the upstream ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, aiohttp.ClientResponseError) and exc.message:
        # Without the bytes aiohttp quotes: the upstream's fields are not the client's.
        message = re.split(r":? b['\"]", str(exc.message), maxsplit=1)[0]
        return f"the upstream's answer cannot be read: {one_line(message, 200)}"
    return f"{type(exc).__name__} from upstream"


async def _client_gone(receive: Receive, body_read: asyncio.Event) -> None:
    """Returns when the client goes away (or the answer is complete: uvicorn's
    ``receive`` says ``http.disconnect`` for both), once the body is read."""
    await body_read.wait()
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unavailable(send: Send, detail: str) -> None:
    """``502 upstream_unavailable``, saying what went wrong (not the upstream's address)."""
    payload = dumps({"error": "upstream_unavailable", "detail": detail})
    await send(
        {
            "type": "http.response.start",
            "status": 502,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
