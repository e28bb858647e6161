"""The keep-alive timer of the router's and the node's HTTP protocol."""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["lazy_keep_alive"]

#: A keep-alive timer this late (seconds) fired after the process was held; it
#: looks again STALL_RECHECK seconds later, once the loop has read what came.
STALL = 0.25
STALL_RECHECK = 0.01


def lazy_keep_alive(base: type) -> type:
    """``base`` (uvicorn's httptools protocol) with one keep-alive timer per
    connection instead of one per response.

    uvicorn arms a timer (``call_later``) as each response ends and cancels it
    when the next request's bytes arrive: a timer made and dropped per request,
    a measurable part of a forward's cost. Here the end of a response notes the
    time and arms a timer only if none is pending; when it fires it looks at
    the connection *now*: busy (bytes came since), it is done, and the next
    response arms it again; idle for less than ``timeout_keep_alive``, it waits
    for the rest; idle for that long, the connection closes, as uvicorn's would.
    """

    class LazyKeepAlive(base):  # type: ignore[valid-type,misc]
        # uvicorn's, set in its __init__ (declared for the type checker).
        loop: asyncio.AbstractEventLoop
        transport: Any
        flow: Any
        pipeline: Any
        server_state: Any
        timeout_keep_alive: float
        timeout_keep_alive_task: asyncio.TimerHandle | None
        #: Since when the connection has waited for a request after a response.
        _idle_since: float | None = None

        def _unset_keepalive_if_required(self) -> None:
            self._idle_since = None  # bytes arrived: not idle (the timer sees it)

        def on_response_complete(self) -> None:
            # uvicorn's, but for how the keep-alive timeout is armed.
            self.server_state.total_requests += 1
            if self.transport.is_closing():
                return
            self._idle_since = None
            self.flow.resume_reading()
            if self.pipeline:
                cycle, app = self.pipeline.pop()
                self._start_asgi_task(cycle, app)
                return
            self._idle_since = self.loop.time()
            if self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self._keep_alive_due
                )

        def _keep_alive_due(self, looked_again: bool = False) -> None:
            self.timeout_keep_alive_task = None
            since = self._idle_since
            if since is None:
                return  # busy with a request: its response arms the timer again
            left = since + self.timeout_keep_alive - self.loop.time()
            if left > 0:
                self.timeout_keep_alive_task = self.loop.call_later(left, self._keep_alive_due)
                return
            if not looked_again and -left > STALL:
                # Due long ago: the process was held (SIGSTOP, a long collection),
                # and a request sent meanwhile may be waiting unread: a stopped
                # epoll_wait returns EINTR, and libuv then runs the due timers
                # before it polls again, so the connection was closed with the
                # request in it and the client got a reset (an exploratory tester:
                # a decision-API call on a warm connection across a 6 s SIGSTOP of
                # the router). Look again once the loop has polled.
                self.timeout_keep_alive_task = self.loop.call_later(
                    STALL_RECHECK, self._keep_alive_due, True
                )
                return
            self.timeout_keep_alive_handler()

        def connection_lost(self, exc: Exception | None) -> None:
            super().connection_lost(exc)
            task = self.timeout_keep_alive_task
            if task is not None:
                task.cancel()
                self.timeout_keep_alive_task = None

    return LazyKeepAlive
