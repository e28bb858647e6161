"""An ASGI application whose answers are as large as asked (tests of the
router's ``--max-answer``: tests/test_answer_cap.py).

``/bytes/N``: N bytes, with their length. ``/stream``: 64 KiB chunks, without a
length, until 256 MiB (an answer that, to a router holding whole answers,
might as well never end), yielding to the loop between chunks as an
application streaming a file does.
"""

from __future__ import annotations

import asyncio
from typing import Any

CHUNK = b"x" * 65536
STREAM_CHUNKS = 4096


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path.startswith("/bytes/"):
        size = int(path.rpartition("/")[2])
        headers = [(b"content-length", str(size).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"x" * size})
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for _ in range(STREAM_CHUNKS):
        await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await asyncio.sleep(0)
    await send({"type": "http.response.body", "body": b""})
