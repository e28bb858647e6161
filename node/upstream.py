"""What a node serves behind its limiter: an echo app, an upstream, or the user's app."""

from __future__ import annotations

import importlib
from typing import Any

import aiohttp

from node.asgi import ASGIApp, Receive, Scope, Send, drain, dumps, send_json
from node.config import UPSTREAM_IDLE
from node.hopbyhop import HOP_BY_HOP, NO_CONTENT, passed_on
from node.identity import header_text

#: Request fields not passed to the upstream: hop-by-hop ones, and those aiohttp
#: sets for the request it makes.
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length"}
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

    return echo


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


class UpstreamApp:
    """Forward each request to an upstream HTTP service (streaming both bodies)."""

    def __init__(
        self, url: str, *, timeout: float = 30.0, idle_timeout: float = UPSTREAM_IDLE
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=2.0)
        #: How long an idle connection is reused: below the upstream's keep-alive,
        #: or a request written as the upstream closes it gets no answer. aiohttp
        #: sends an idempotent request again then, never a POST: that one is a 502.
        self.idle_timeout = idle_timeout
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=self.timeout,
                connector=aiohttp.TCPConnector(
                    limit=256, ttl_dns_cache=300, keepalive_timeout=self.idle_timeout
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        target = self.url + scope.get("raw_path", scope["path"].encode()).decode("latin-1")
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")
        # header_text: valid UTF-8 stays UTF-8, which aiohttp writes back byte for byte.
        fields = scope["headers"]
        headers = [
            (k.decode("latin-1"), header_text(v))
            for k, v in passed_on(fields, NOT_FORWARDED)
            if not k.startswith(b"x-ringlimit-")
        ]

        async def body() -> Any:
            while True:
                message = await receive()
                chunk = message.get("body", b"")
                if chunk:
                    yield chunk
                if not message.get("more_body"):
                    return

        # A request that came without a body goes without one: a streamed body
        # is sent chunked, and some servers refuse a GET with a chunked body.
        framed = any(
            k == b"transfer-encoding" or (k == b"content-length" and v.strip() != b"0")
            for k, v in fields
        )
        try:
            async with self._client().request(
                scope["method"],
                target,
                headers=headers,
                data=body() if framed else None,
                allow_redirects=False,
            ) as response:
                out = passed_on(
                    [(k.lower(), v) for k, v in response.raw_headers],
                    NOT_RELAYED_NO_CONTENT if response.status in NO_CONTENT else NOT_RELAYED,
                )
                await send(
                    {"type": "http.response.start", "status": response.status, "headers": out}
                )
                async for chunk in response.content.iter_chunked(65536):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except (aiohttp.ClientError, TimeoutError) as exc:
            payload = dumps(
                {"error": "upstream_unavailable", "detail": f"{type(exc).__name__} from upstream"}
            )
            await send(
                {
                    "type": "http.response.start",
                    "status": 502,
                    "headers": [(b"content-type", b"application/json")],
                }
            )
            await send({"type": "http.response.body", "body": payload})
