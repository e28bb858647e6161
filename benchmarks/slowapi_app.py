"""What a Python user would deploy instead of ringlimit: Starlette + slowapi + Redis.

``ringlimit bench`` runs it as one uvicorn process with two workers (the OS
spreads the benchmark's connections over them; both count in one Redis, so a
user's limit is exact across workers), the same shape as two ringlimit nodes
behind round-robin but without a router hop::

    RINGLIMIT_BENCH_REDIS=redis://127.0.0.1:6379/1 \\
        uvicorn benchmarks.slowapi_app:app --workers 2 --no-access-log

The routes mirror the ringlimit benchmark cluster's: ``/load/...`` under the
generous rule, ``/tight/...`` under the tight one (the exactness check), the
user id taken from ``X-User-Id``, limit headers on, slowapi's default
fixed-window strategy (the cheapest ``limits`` offers).
"""

from __future__ import annotations

import os

from slowapi import Limiter, _rate_limit_exceeded_handler
from slowapi.errors import RateLimitExceeded
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

REDIS_URL = os.environ.get("RINGLIMIT_BENCH_REDIS", "redis://127.0.0.1:6379/1")
#: ``limits`` notation ("1000/second"); the bench passes the same rates as the cluster's.
LOAD_RATE = os.environ.get("RINGLIMIT_BENCH_LOAD_RATE", "1000/second")
TIGHT_RATE = os.environ.get("RINGLIMIT_BENCH_TIGHT_RATE", "5/hour")


def user_id(request: Request) -> str:
    return request.headers.get("x-user-id") or (request.client.host if request.client else "-")


limiter = Limiter(key_func=user_id, storage_uri=REDIS_URL, headers_enabled=True)


def _echo(request: Request) -> JSONResponse:
    return JSONResponse(
        {
            "node": "slowapi",
            "user": request.headers.get("x-user-id"),
            "method": request.method,
            "path": request.url.path,
        }
    )


@limiter.limit(LOAD_RATE)
async def load(request: Request) -> JSONResponse:
    return _echo(request)


@limiter.limit(TIGHT_RATE)
async def tight(request: Request) -> JSONResponse:
    return _echo(request)


async def healthz(request: Request) -> JSONResponse:
    return JSONResponse({"status": "ok"})


app = Starlette(
    routes=[
        Route("/healthz", healthz),
        Route("/load/{rest:path}", load),
        Route("/tight/{rest:path}", tight),
    ]
)
app.state.limiter = limiter
app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)  # type: ignore[arg-type]
