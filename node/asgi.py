"""Small raw-ASGI helpers for the hot path (no Request/Response objects)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
RawHeaders = list[tuple[bytes, bytes]]


def dumps(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode()


async def send_json(
    send: Send,
    status: int,
    body: Any,
    headers: Iterable[tuple[bytes, bytes]] = (),
    content_type: bytes = b"application/json",
) -> None:
    payload = dumps(body)
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
    """Consume a request body we will not use, so the connection stays reusable."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return


def error_body(error: str, detail: str, **extra: Any) -> dict[str, Any]:
    return {"error": error, "detail": detail, **extra}
