"""Running a router process."""

from __future__ import annotations

import socket

import uvicorn

from node.server import uvicorn_options
from router.app import Router


def serve_router(
    router: Router, *, host: str, port: int, sockets: list[socket.socket] | None = None
) -> None:
    """Serve on ``host:port``, or on ``sockets`` already bound (router/workers.py)."""
    config = uvicorn.Config(router, host=host, port=port, **uvicorn_options())
    uvicorn.Server(config).run(sockets=sockets)
