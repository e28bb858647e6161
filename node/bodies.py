"""Reading a request's body within a limit (the I/O half of node/wire.py's
endpoints: wire.py decodes what this reads, and does no I/O itself)."""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request

from node.wire import ApiError


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refusing (413) as soon as it passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, "body_too_large", f"body is {declared} bytes; at most {limit}")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise ApiError(413, "body_too_large", f"body is over {limit} bytes")
            chunks.append(chunk)
    except ClientDisconnect:
        # Nobody is left to read the answer; an error of the endpoint's own keeps
        # it from uvicorn's "Exception in ASGI application" traceback (a router
        # killed with a lease request on its way: an exploratory tester).
        raise ApiError(400, "incomplete_body", "the client left before its body ended") from None
    return b"".join(chunks)
