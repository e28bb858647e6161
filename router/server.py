"""Running a router process.

The router starts (recovers or builds its ring, which may mean waiting for
seed nodes) before uvicorn serves, rather than in uvicorn's lifespan: a start
that cannot succeed (no seed answers, an unreadable state file) is an
expected failure that must end in one line, and uvicorn reports lifespan
failures as tracebacks.
"""

from __future__ import annotations

import asyncio
import logging
import socket

import uvicorn

from node.frontdoor import FrontDoor, limited_protocol, raise_fd_limit
from node.keepalive import lazy_keep_alive
from node.server import SignalServer, _run, uvicorn_options
from router.app import Router
from router.heartbeat import answer_pings
from router.protocol import AnswerWrites, ProxyCycle, direct_proxy_protocol

log = logging.getLogger("ringlimit.router")


class RouterServer(SignalServer):
    """The router's uvicorn server: what a forced exit leaves in flight is answered.

    A second SIGTERM (``force_exit``) ends uvicorn's shutdown without cancelling
    its tasks; ``asyncio.run`` cancels those later, and each answers its client
    500 (router/protocol.py ``ProxyCycle.run_asgi``). A request in flight
    without a task (``ProxyCycle.begin``) stands in the server's tasks as its
    cycle, which nothing would cancel: its client got the connection closed
    without a byte, where a client that retries on an empty answer from a
    kept-alive connection may send it again. Cancelled here, it gets the 500."""

    def __init__(self, config: uvicorn.Config, router: Router | None = None) -> None:
        super().__init__(config, _stop, role="router")
        self.router = router
        #: The end of the drain (:meth:`drain`), while one is under way.
        self._drain: asyncio.TimerHandle | None = None

    def drain(self) -> bool:
        """On the first SIGTERM/SIGINT of a router serving gRPC: say it is stopping
        (gRPC health ``NOT_SERVING``, ``/healthz`` 503) and go on serving both
        ports for ``--grpc-drain`` seconds, so Envoy's health checks move its
        calls to another router before this one refuses them; then stop. Before,
        health said NOT_SERVING and the server stopped at the same moment: with
        20 callers, 14,479 calls in the second after SIGTERM were UNAVAILABLE.

        A signal during the drain cuts it short (the stop begins at once; one
        more exits at once). Returns whether the signal was taken so."""
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
            log.warning("drain cut short: stopping")
            self.should_exit = True
            return True
        router = self.router
        if self.should_exit or router is None or router.grpc_server is None:
            return False
        if not len(router.membership.view):
            return False  # health says NOT_SERVING already (no nodes): nothing to move
        seconds = router.settings.grpc_drain
        if seconds <= 0:
            return False
        router.begin_stop()
        log.warning(
            "stopping in %g s: health says NOT_SERVING meanwhile, calls are still served "
            "(--grpc-drain; SIGTERM or Ctrl-C again to stop now)",
            seconds,
        )
        self._drain = asyncio.get_running_loop().call_later(seconds, self._drained)
        return True

    def _exit_now(self) -> None:
        """SIGHUP: a stop without more, a drain under way included (its timer
        left armed, the next SIGTERM was taken for a cut short, not forced)."""
        if self._drain is not None:
            self._drain.cancel()
            self._drain = None
        super()._exit_now()

    def _drained(self) -> None:
        self._drain = None
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        left = [t for t in self.server_state.tasks if type(t) is ProxyCycle]
        for cycle in left:
            cycle.cancel(msg="the server was made to exit at once")
        if left:
            await asyncio.sleep(0)  # (their 500s written before the loop ends)


def router_server(
    router: Router, *, host: str, port: int, front_door: FrontDoor | None = None
) -> uvicorn.Server:
    """The uvicorn server of ``router``: the hot-path options, the front door's
    limits, and the direct proxy path, keep-alive timer and answer writes of
    router/protocol.py."""
    options = {**uvicorn_options(front_door), "lifespan": "off"}
    if isinstance(options["http"], type):
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        options["http"] = direct_proxy_protocol(
            limited_protocol(
                lazy_keep_alive(HttpToolsProtocol),
                front_door or FrontDoor(),
                wrap=AnswerWrites,
            )
        )
    return RouterServer(uvicorn.Config(router, host=host, port=port, **options), router)


def _stop(server: uvicorn.Server) -> None:
    """SIGTERM or SIGINT: the drain of a router serving gRPC (:meth:`RouterServer.drain`),
    else stop serving, then close the router (leader key resigned, gRPC calls in
    flight given their grace); a second one: at once."""
    if isinstance(server, RouterServer) and server.drain():
        return
    if server.should_exit:
        server.force_exit = True
    server.should_exit = True


def serve_router(
    router: Router,
    *,
    host: str,
    port: int,
    sockets: list[socket.socket] | None = None,
    front_door: FrontDoor | None = None,
    ping: socket.socket | None = None,
) -> None:
    """Serve on ``host:port``, or on ``sockets`` already bound (router/workers.py);
    raises MembershipError if the router cannot start. ``ping``: a worker's end
    of its socket pair with the supervisor, echoed from the event loop once the
    router has started, until the process ends (router/heartbeat.py)."""
    raise_fd_limit()
    server = router_server(router, host=host, port=port, front_door=front_door)

    async def main() -> None:
        await router.start()
        if ping is not None:
            answer_pings(ping, asyncio.get_running_loop())
        try:
            await server.serve(sockets=sockets)
        finally:
            await router.close()

    _run(main())
