"""Running a router process."""

from __future__ import annotations

import uvicorn

from node.server import uvicorn_options
from router.app import Router


def serve_router(router: Router, *, host: str, port: int) -> None:
    config = uvicorn.Config(router, host=host, port=port, **uvicorn_options())
    uvicorn.Server(config).run()
