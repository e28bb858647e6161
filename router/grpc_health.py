"""gRPC health checking (``grpc.health.v1.Health``) beside Envoy's rate limit service.

Envoy's active health checks of a gRPC cluster (``grpc_health_check``) and
Kubernetes' gRPC probes ask ``Health/Check``; without the service they got
UNIMPLEMENTED, which both read as unhealthy, so a router serving Envoy could
only be checked over its HTTP port. The status is the router's ``/healthz``:
``SERVING`` while its ring has a node (a call can be decided), ``NOT_SERVING``
with none, and from the moment the router begins to stop, so a gateway moves
its calls to another router before this one refuses them.

The service needs no token (a probe rarely carries one, and the answer holds
nothing but the status); ``RINGLIMIT_API_TOKEN`` still guards
``ShouldRateLimit``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

#: Seconds between two looks at the status for a ``Watch`` stream.
WATCH_EVERY = 1.0

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class RouterHealth(health_pb2_grpc.HealthServicer):
    """``Health/Check`` and ``Health/Watch`` from ``can_decide`` (read on every
    call: the status follows the ring without being told of its changes), for
    ``services`` ("" is the server as a whole)."""

    def __init__(
        self,
        can_decide: Callable[[], bool],
        services: Iterable[str],
        watch_every: float = WATCH_EVERY,
    ) -> None:
        self.can_decide = can_decide
        self.services = frozenset({"", *services})
        self.watch_every = watch_every
        self._stopped = asyncio.Event()

    def stop(self) -> None:
        """NOT_SERVING from now on, said at once to every ``Watch`` (not at its next
        look: the router's grace for calls in flight is about that long)."""
        self._stopped.set()

    @property
    def stopping(self) -> bool:
        return self._stopped.is_set()

    def status(self, service: str) -> int:
        if service not in self.services:
            return SERVICE_UNKNOWN
        return SERVING if not self.stopping and self.can_decide() else NOT_SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        status = self.status(request.service)
        if status == SERVICE_UNKNOWN:
            # The protocol's answer for a service the server does not know.
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        """The status now, then each change (an unknown service is SERVICE_UNKNOWN and
        stays open, as the protocol says). Ends when the caller cancels, or once
        it has said NOT_SERVING for a router that stops."""
        last = None
        while True:
            status = self.status(request.service)
            if status != last:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            if self.stopping:
                return  # said NOT_SERVING: the stream ends, as the server does
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopped.wait(), self.watch_every)


def add_health(health: RouterHealth, server: grpc.aio.Server) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
