"""Small raw-ASGI helpers for the hot path (no Request/Response objects)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any

from ring.errors import encodable

if TYPE_CHECKING:
    from starlette.applications import Starlette

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]

#: An extension (``scope["extensions"]``) of a node's front door
#: (node/frontdoor.py): a dict of node/headers.py's ``Rendered`` fields, keyed
#: by whoever added them (each RateLimitMiddleware: nested ones add theirs),
#: which the server adds to the request's response start, whatever the app
#: sends, and then empties. RateLimitMiddleware puts an
#: allowed request's rate-limit fields there instead of wrapping ``send``: no
#: wrapper per request, and the server writes lines checked once per distinct
#: entry instead of looking each field up on every response. Under any other
#: server the middleware wraps ``send`` as usual. The fields go on whatever
#: answer the server writes for the request, its own 500 for an app that
#: failed before answering included (the request was counted).
RESPONSE_FIELDS = "ringlimit.response_fields"


#: One encoder for every answer: ``json.dumps`` with a non-default argument builds
#: a new ``JSONEncoder`` per call, which was a tenth of the echo app's cost.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def dumps(data: Any) -> bytes:
    return _ENCODER.encode(data).encode()


async def send_json(
    send: Send,
    status: int,
    body: Any,
    headers: Iterable[tuple[bytes, bytes]] = (),
    content_type: bytes = b"application/json",
) -> None:
    await send_json_bytes(send, status, dumps(body), headers, content_type)


async def send_json_bytes(
    send: Send,
    status: int,
    payload: bytes,
    headers: Iterable[tuple[bytes, bytes]] = (),
    content_type: bytes = b"application/json",
) -> None:
    """:func:`send_json` of a body already encoded (a node's answer, relayed)."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def drain(receive: Receive) -> None:
    """Consume a request body an application will not use, before it answers
    (the echo app: the body is the client's to send whole). A refusal does not
    drain: it answers at once, and the server drops or drains the rest."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return


async def read_all(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None once it passes ``limit`` bytes.

    The rest is not read: the caller answers at once, and the server deals
    with what the client still sends (a node's or router's front door reads
    and drops a bounded rest, or closes; uvicorn drops it). Read here, a
    body sent on and on held its request for as long as its sender liked,
    and reading on after the last part waited for a disconnect."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


def error_body(error: str, detail: str, **extra: Any) -> dict[str, Any]:
    """An error answer's JSON body. The detail is made :func:`encodable`: it
    often quotes an exception that quotes client text, and one lone surrogate
    in it made the whole answer fail to encode (a plain-text 500)."""
    return {"error": error, "detail": encodable(detail), **extra}


def invalid_detail(what: str, exc: Exception) -> str:
    """What an internal body failed on, in words (at most 200 characters): a
    KeyError's text is the bare field name (``'from'``), which says nothing."""
    if isinstance(exc, KeyError) and exc.args:
        return f"bad {what}: missing field {exc.args[0]!r}"[:200]
    return encodable(f"bad {what}: {exc}"[:200])


#: What ``OPTIONS *`` (a question about the server, not a resource) is told.
ALLOW = b"GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS"


async def odd_target(scope: Scope, receive: Receive, send: Send) -> None:
    """Answer a request whose target is not a path (``OPTIONS *``, ``CONNECT
    host:port``, ...): nothing behind this server can take it, so it is never
    routed. ``OPTIONS *`` gets 204 with the methods; anything else 400 (its
    body unread, as any refusal: the server drops what the client sends)."""
    if scope["method"] == "OPTIONS" and scope["path"] == "*":
        await send(
            {
                "type": "http.response.start",
                "status": 204,
                "headers": [(b"allow", ALLOW), (b"content-length", b"0")],
            }
        )
        await send({"type": "http.response.body", "body": b""})
        return
    await send_json(
        send,
        400,
        error_body("invalid_target", "the request target must be a path starting with /"),
    )


def control_app(routes: list[Any], lifespan: Any) -> Starlette:
    """The Starlette app of a process's control endpoints (a node's, a router's):
    Starlette's 404 and 405 answered as JSON, and no redirect for a trailing
    slash. Starlette answers ``/admin/ring/`` with a 307 to ``/admin/ring``, before
    any token check and with a Location built from the client's Host header; now
    it is the JSON 404 any unknown path gets."""
    from starlette.applications import Starlette

    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=json_http_errors())
    app.router.redirect_slashes = False
    return app


def json_http_errors() -> dict[Any, Any]:
    """Starlette ``exception_handlers`` that answer its own 404 and 405 (an unknown
    path or method on a control endpoint) with a JSON error body like every other
    4xx, instead of Starlette's plain text."""
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse

    names = {404: "not_found", 405: "method_not_allowed"}

    async def handler(request: Any, exc: Exception) -> Any:
        assert isinstance(exc, HTTPException)
        return JSONResponse(
            error_body(names.get(exc.status_code, "http_error"), exc.detail),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    return {HTTPException: handler}
