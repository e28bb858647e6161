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
