"""A tiny ASGI application for tests: it answers with what it was asked.

Served behind a node (``ringlimit node --app tests.sample_app:app``), as an
upstream (``uvicorn tests.sample_app:app``) and mounted in-process, it shows
that the whole request (method, path, query, headers, body) reached it.
"""

from __future__ import annotations

import json
from typing import Any


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    info = scope.get("state", {}).get("ringlimit", {})
    payload = json.dumps(
        {
            "app": "sample",
            "method": scope["method"],
            "path": scope["path"],
            "query": scope.get("query_string", b"").decode("latin-1"),
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]],
            "body": body.decode("latin-1"),
            "user": info.get("key"),
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 201,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"x-sample-app", b"yes"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
