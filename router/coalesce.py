"""Coalescing concurrent single checks into batches, per node.

A decision-API check costs the node little; the HTTP exchange around it
costs much more. When many clients send single checks at once, the router
holds each one for at most ``window`` seconds (a few hundred microseconds)
and sends everything that arrived for the same node as one batch. Under low
concurrency a batch of one leaves at the end of the window, so the added
latency is bounded by ``window``; under load the batches grow and the
per-check cost falls.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

#: sends one batch to one node; returns one result per item, in order.
SendBatch = Callable[[str, list[Any]], Awaitable[list[Any]]]
#: the merger's: sends ``items`` (and ``extras``, one per item or None) to a node
#: named by any hashable value (a ring member); one result per item, in order.
SendTo = Callable[[Any, list[Any], list[Any] | None], Awaitable[list[Any]]]
_Group = tuple[list[Any], list[Any] | None, "asyncio.Future[list[Any]]"]


class _Pending:
    __slots__ = ("futures", "items", "timer")

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.futures: list[asyncio.Future[Any]] = []
        self.timer: asyncio.TimerHandle | None = None


class Coalescer:
    def __init__(self, send: SendBatch, *, window: float = 0.0003, max_batch: int = 256) -> None:
        self.send = send
        self.window = window
        self.max_batch = max_batch
        self._pending: dict[str, _Pending] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.items = 0

    def submit(self, node: str, item: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        pending = self._pending.get(node)
        if pending is None:
            pending = self._pending[node] = _Pending()
            pending.timer = loop.call_later(self.window, self._flush, node)
        future: asyncio.Future[Any] = loop.create_future()
        pending.items.append(item)
        pending.futures.append(future)
        if len(pending.items) >= self.max_batch:
            self._flush(node)
        return future

    def _flush(self, node: str) -> None:
        pending = self._pending.pop(node, None)
        if pending is None:
            return
        if pending.timer is not None:
            pending.timer.cancel()
        task = asyncio.get_running_loop().create_task(self._deliver(node, pending))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _deliver(self, node: str, pending: _Pending) -> None:
        self.batches += 1
        self.items += len(pending.items)
        try:
            results = await self.send(node, pending.items)
        except Exception as exc:  # every waiter must hear about the failure
            for future in pending.futures:
                if not future.done():
                    future.set_exception(exc)
            return
        for future, result in zip(pending.futures, results, strict=True):
            if not future.done():
                future.set_result(result)


class _Queue:
    __slots__ = ("in_flight", "size", "waiting")

    def __init__(self) -> None:
        self.in_flight = 0
        self.size = 0
        self.waiting: list[_Group] = []


class Merger:
    """Batches for the same node that meet on the way leave as one request (group commit).

    A batch for a node with fewer than ``max_in_flight`` requests under way
    leaves at once: a router under light load adds no latency. Otherwise it
    waits, and when a request to that node comes back, everything waiting for
    it leaves together (up to ``max_items`` items a request). Under load each
    node request then carries several clients' batches, and what a request
    costs whatever its size (the HTTP exchange, on the router and on the node)
    is paid once for all of them.

    ``send(node, items, extras)`` returns one result per item, in order; each
    caller of :meth:`submit` gets the results of its own items. ``extras``
    travel with the items (one per item, or None for none).
    """

    def __init__(self, send: SendTo, *, max_items: int, max_in_flight: int = 2) -> None:
        self.send = send
        self.max_items = max_items
        self.max_in_flight = max_in_flight
        self._queues: dict[Any, _Queue] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        #: Requests sent, and batches submitted (their ratio: how much was merged).
        self.requests = 0
        self.batches = 0

    async def submit(
        self, node: Any, items: list[Any], extras: list[Any] | None = None
    ) -> list[Any]:
        self.batches += 1
        queue = self._queues.get(node)
        if queue is None:
            queue = self._queues[node] = _Queue()
        if queue.in_flight < self.max_in_flight and not queue.waiting:
            queue.in_flight += 1
            self.requests += 1
            try:
                return await self.send(node, items, extras)
            finally:
                queue.in_flight -= 1
                self._next(node, queue)
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        queue.waiting.append((items, extras, future))
        queue.size += len(items)
        return await future

    def _next(self, node: Any, queue: _Queue) -> None:
        """Send what waits for ``node`` as one request (or a few, by ``max_items``)."""
        while queue.waiting and queue.in_flight < self.max_in_flight:
            taken: list[_Group] = []
            size = 0
            for group in queue.waiting:
                if taken and size + len(group[0]) > self.max_items:
                    break
                taken.append(group)
                size += len(group[0])
            del queue.waiting[: len(taken)]
            queue.size -= size
            queue.in_flight += 1
            self.requests += 1
            task = asyncio.get_running_loop().create_task(self._deliver(node, queue, taken))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if not queue.waiting and not queue.in_flight and self._queues.get(node) is queue:
            del self._queues[node]

    async def _deliver(
        self,
        node: Any,
        queue: _Queue,
        taken: list[_Group],
    ) -> None:
        items: list[Any] = []
        extras: list[Any] | None = None
        if any(extra is not None for _, extra, _ in taken):
            extras = []
        for group, extra, _ in taken:
            items += group
            if extras is not None:
                extras += [None] * len(group) if extra is None else extra
        try:
            results = await self.send(node, items, extras)
        except Exception as exc:  # every waiter must hear about the failure
            for _, _, future in taken:
                if not future.done():
                    future.set_exception(exc)
            return
        except BaseException:
            for _, _, future in taken:
                future.cancel()
            raise
        finally:
            queue.in_flight -= 1
            self._next(node, queue)
        start = 0
        for group, _, future in taken:
            end = start + len(group)
            if not future.done():
                future.set_result(results[start:end])
            start = end
