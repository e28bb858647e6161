"""Coalescing concurrent calls into pipelined round trips, without a timer.

A call to a remote server costs a round trip and, in Python, much more in
the client's per-request machinery than in the server. When many calls are
in flight at once they can share round trips: :class:`RoundTrips` queues
each call and sends whatever is queued as one batch as soon as a round trip
is free. Nothing waits for a window: an idle client sends a lone call on the
next turn of the event loop (same latency as calling directly), and under
load every call that arrives while a round trip is in flight goes in the
next one, so batches grow exactly as fast as the server falls behind.

Each call keeps its own outcome: ``send`` answers one result per call, in
order, and a result that is an exception fails that call only. If ``send``
itself raises, every call of that batch fails with the exception. A call that
waits in the queue longer than ``queue_timeout`` fails with ``overloaded()``
then and there (one timer, for the oldest queued call), instead of waiting
for a slow round trip and being sent late; :meth:`fail_queued` fails every
queued call at once (a caller that has found the server down does not let
them try).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: Sends one batch; answers one result per item, in order (an exception fails one item).
Send = Callable[[list[T]], Awaitable[list[Any]]]


class RoundTrips(Generic[T]):
    """At most ``depth`` batches in flight; each at most ``max_batch`` calls.

    ``batches`` and ``calls`` count what was sent (their ratio is the mean
    batch size).
    """

    def __init__(
        self,
        send: Send[T],
        *,
        depth: int = 1,
        max_batch: int = 256,
        queue_timeout: float = 1.0,
        overloaded: Callable[[], BaseException] = lambda: TimeoutError("queued too long"),
    ) -> None:
        if depth < 1 or max_batch < 1:
            raise ValueError("depth and max_batch must be >= 1")
        if queue_timeout <= 0:
            raise ValueError("queue_timeout must be positive")
        self.send = send
        self.depth = depth
        self.max_batch = max_batch
        self.queue_timeout = queue_timeout
        self.overloaded = overloaded
        self._queue: deque[tuple[T, asyncio.Future[Any], float]] = deque()
        self._senders: set[asyncio.Task[None]] = set()
        #: Senders started and not yet finished (kept exact without awaiting anything).
        self._active = 0
        self._timer: asyncio.TimerHandle | None = None
        self._closed = False
        self.batches = 0
        self.calls = 0

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def call(self, item: T) -> Any:
        """``item``'s result, from the next round trip with room for it."""
        return await self.submit(item)

    def submit(self, item: T) -> asyncio.Future[Any]:
        """Queue ``item``; the future resolves with its result (several may share a batch)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        if self._closed:
            future.set_exception(RuntimeError("closed"))
            return future
        self._queue.append((item, future, loop.time()))
        if self._timer is None:
            self._timer = loop.call_at(loop.time() + self.queue_timeout, self._expire)
        if self._active < self.depth:
            # A task, not an inline send: calls queued in this same turn of the loop
            # (a gather, a batch) join the first round trip.
            self._active += 1
            task = loop.create_task(self._sender())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return future

    def fail_queued(self, exc: Callable[[], BaseException]) -> int:
        """Fail every queued (not yet sent) call with ``exc()``; answer how many."""
        failed = 0
        while self._queue:
            _, future, _ = self._queue.popleft()
            if not future.done():
                future.set_exception(exc())
                failed += 1
        return failed

    def _expire(self) -> None:
        """Fail the calls queued too long; then wait for the next oldest one's deadline."""
        self._timer = None
        queue = self._queue
        loop = asyncio.get_running_loop()
        expired_before = loop.time() - self.queue_timeout
        while queue and (queue[0][1].done() or queue[0][2] <= expired_before):
            _, future, _ = queue.popleft()
            if not future.done():
                future.set_exception(self.overloaded())
        if queue:
            self._timer = loop.call_at(queue[0][2] + self.queue_timeout, self._expire)

    async def close(self) -> None:
        """Fail what is queued, stop the round trips in flight (their calls fail)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.fail_queued(lambda: RuntimeError("closed"))
        senders = list(self._senders)
        for task in senders:
            task.cancel()
        if senders:
            await asyncio.gather(*senders, return_exceptions=True)

    # ------------------------------------------------------------------ sending

    def _take(self) -> tuple[list[T], list[asyncio.Future[Any]]]:
        items: list[T] = []
        futures: list[asyncio.Future[Any]] = []
        queue = self._queue
        while queue and len(items) < self.max_batch:
            item, future, _ = queue.popleft()
            if future.done():  # cancelled by its caller while queued: nothing to send
                continue
            items.append(item)
            futures.append(future)
        return items, futures

    async def _sender(self) -> None:
        """Send batches until the queue is empty (then this round-trip slot is free)."""
        try:
            await self._send_all()
        finally:
            # Synchronously with finding the queue empty: a call queued from now on
            # starts a sender of its own (a done callback would run a turn too late).
            self._active -= 1

    async def _send_all(self) -> None:
        while self._queue:
            items, futures = self._take()
            if not items:
                continue
            self.batches += 1
            self.calls += len(items)
            try:
                results = await self.send(items)
            except BaseException as exc:
                failure = exc
                if isinstance(exc, asyncio.CancelledError):
                    failure = RuntimeError("closed while in flight")
                for future in futures:
                    if not future.done():
                        future.set_exception(failure)
                if isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit):
                    raise
                continue
            if len(results) != len(futures):
                wrong = RuntimeError(f"send answered {len(results)} results for {len(futures)}")
                results = [wrong] * len(futures)
            for future, result in zip(futures, results, strict=True):
                if future.done():
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
