"""A uvicorn protocol class served on 127.0.0.1 inside the test's event loop.

For tests of the front door's and the router's protocol subclasses over real
sockets, without a server process (tests/test_frontdoor.py,
tests/test_router_keepalive.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from uvicorn.server import ServerState


@contextlib.asynccontextmanager
async def serving(
    protocol: type, app: Any, **options: Any
) -> AsyncIterator[tuple[int, ServerState]]:
    """``protocol`` serving ``app`` on a free port: (the port, uvicorn's server
    state); closed on exit. ``options`` go to ``uvicorn.Config``."""
    config = uvicorn.Config(app, lifespan="off", log_level="error", **options)
    config.load()
    state = ServerState()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: protocol(config=config, server_state=state, app_state={}, _loop=loop),
        "127.0.0.1",
        0,
    )
    try:
        yield server.sockets[0].getsockname()[1], state
    finally:
        server.close()
