"""router/coalesce.py's Merger: batches for one node that meet on the way leave together."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from node.config import Limits
from router.coalesce import Merger
from router.decisions import merged_batch

pytestmark = pytest.mark.anyio


class Node:
    """A fake node: each request waits until released, answers item * 10."""

    def __init__(self) -> None:
        self.requests: list[list[Any]] = []
        self.gates: list[asyncio.Event] = []
        self.fail = False

    async def send(self, node: Any, items: list[Any], extras: list[Any] | None) -> list[Any]:
        self.requests.append(list(items))
        gate = asyncio.Event()
        self.gates.append(gate)
        await gate.wait()
        if self.fail:
            raise RuntimeError("node down")
        return [item * 10 for item in items]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_an_idle_node_gets_each_batch_at_once() -> None:
    node = Node()
    merger = Merger(node.send, max_items=100, max_in_flight=2)
    first = asyncio.create_task(merger.submit("n1", [1, 2]))
    second = asyncio.create_task(merger.submit("n1", [3]))
    await _settle()
    assert node.requests == [[1, 2], [3]]  # two under way: nothing waits
    for gate in node.gates:
        gate.set()
    assert await first == [10, 20]
    assert await second == [30]


async def test_batches_that_wait_leave_as_one_request_and_get_their_own_results() -> None:
    node = Node()
    merger = Merger(node.send, max_items=100, max_in_flight=1)
    first = asyncio.create_task(merger.submit("n1", [1]))
    await _settle()
    waiting = [asyncio.create_task(merger.submit("n1", [i, i + 1])) for i in (2, 4, 6)]
    other_node = asyncio.create_task(merger.submit("n2", [9]))
    await _settle()
    assert node.requests == [[1], [9]]
    node.gates[0].set()
    assert await first == [10]
    await _settle()
    assert node.requests[2] == [2, 3, 4, 5, 6, 7]  # merged, in order
    node.gates[2].set()
    assert [await t for t in waiting] == [[20, 30], [40, 50], [60, 70]]
    node.gates[1].set()
    assert await other_node == [90]
    assert (merger.requests, merger.batches) == (3, 5)


async def test_a_merged_request_holds_at_most_max_items() -> None:
    node = Node()
    merger = Merger(node.send, max_items=4, max_in_flight=1)
    first = asyncio.create_task(merger.submit("n1", [0]))
    await _settle()
    waiting = [asyncio.create_task(merger.submit("n1", [i, i])) for i in (1, 2, 3)]
    await _settle()
    node.gates[0].set()
    await first
    await _settle()
    assert node.requests[1] == [1, 1, 2, 2]
    node.gates[1].set()
    await _settle()
    assert node.requests[2] == [3, 3]
    node.gates[2].set()
    assert [await t for t in waiting] == [[10, 10], [20, 20], [30, 30]]


async def test_every_waiter_hears_of_a_failed_request() -> None:
    node = Node()
    merger = Merger(node.send, max_items=100, max_in_flight=1)
    first = asyncio.create_task(merger.submit("n1", [1]))
    await _settle()
    waiting = [asyncio.create_task(merger.submit("n1", [i])) for i in (2, 3)]
    await _settle()
    node.fail = True
    node.gates[0].set()
    with pytest.raises(RuntimeError):
        await first
    await _settle()
    node.gates[1].set()
    for task in waiting:
        with pytest.raises(RuntimeError):
            await task
    assert not merger._queues  # nothing left behind


def test_a_merged_request_fits_the_nodes_limits() -> None:
    assert merged_batch(Limits()) <= Limits().max_batch
    # Long keys: fewer checks a request, so the body stays under max_body.
    limits = Limits(max_key_length=4096, max_body=1 << 20)
    assert merged_batch(limits) * (12 * 4096) < limits.max_body
    assert merged_batch(Limits(max_key_length=4096, max_body=1000)) == 1


async def test_extras_travel_with_their_items() -> None:
    node = Node()
    seen: list[Any] = []
    send = node.send

    async def record(target: Any, items: list[Any], extras: list[Any] | None) -> list[Any]:
        seen.append(extras)
        return await send(target, items, extras)

    merger = Merger(record, max_items=100, max_in_flight=1)
    first = asyncio.create_task(merger.submit("n1", [1], ["a"]))
    await _settle()
    waiting = [
        asyncio.create_task(merger.submit("n1", [2, 3], ["b", "c"])),
        asyncio.create_task(merger.submit("n1", [4])),
    ]
    await _settle()
    node.gates[0].set()
    await first
    await _settle()
    assert seen == [["a"], ["b", "c", None]]
    node.gates[1].set()
    assert [await t for t in waiting] == [[20, 30], [40]]
