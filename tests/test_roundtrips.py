"""RoundTrips: calls queued while a round trip is in flight share the next one.

The "server" here is an in-process function the test controls step by step
(an asyncio.Event per round trip), so batch boundaries are deterministic.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from node.roundtrips import RoundTrips


class Server:
    """Answers each batch when the test releases it; records every batch."""

    def __init__(self, *, hold: bool = True) -> None:
        self.batches: list[list[Any]] = []
        self.hold = hold
        self.release = asyncio.Event()
        self.fail_with: BaseException | None = None

    async def send(self, items: list[Any]) -> list[Any]:
        self.batches.append(list(items))
        if self.hold:
            await self.release.wait()
            self.release.clear()
        if self.fail_with is not None:
            raise self.fail_with
        return [ValueError(f"bad {x}") if x == "bad" else f"ok {x}" for x in items]


def test_one_round_trip_in_flight_and_the_queue_goes_next() -> None:
    async def scenario() -> None:
        server = Server()
        trips: RoundTrips[Any] = RoundTrips(server.send)
        first = trips.submit(0)
        await asyncio.sleep(0)  # the first round trip leaves alone
        assert server.batches == [[0]]
        later = [trips.submit(i) for i in range(1, 6)]
        await asyncio.sleep(0.01)
        assert server.batches == [[0]], "a second round trip left while one was in flight"
        server.release.set()
        assert await first == "ok 0"
        for _ in range(100):
            if len(server.batches) == 2:
                break
            await asyncio.sleep(0.001)
        assert server.batches == [[0], [1, 2, 3, 4, 5]]
        server.release.set()
        assert await asyncio.gather(*later) == [f"ok {i}" for i in range(1, 6)]
        assert (trips.batches, trips.calls) == (2, 6)

    asyncio.run(scenario())


def test_calls_of_one_turn_share_the_first_round_trip_and_batches_are_bounded() -> None:
    async def scenario() -> None:
        server = Server(hold=False)
        trips: RoundTrips[Any] = RoundTrips(server.send, max_batch=4)
        results = await asyncio.gather(*(trips.call(i) for i in range(10)))
        assert results == [f"ok {i}" for i in range(10)]
        assert server.batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

    asyncio.run(scenario())


def test_depth_two_sends_a_second_round_trip_while_one_is_in_flight() -> None:
    async def scenario() -> None:
        server = Server()
        trips: RoundTrips[Any] = RoundTrips(server.send, depth=2)
        a = trips.submit("a")
        await asyncio.sleep(0)
        b = trips.submit("b")
        await asyncio.sleep(0)
        assert server.batches == [["a"], ["b"]]
        c = trips.submit("c")
        await asyncio.sleep(0.01)
        assert len(server.batches) == 2
        for _ in range(3):
            server.release.set()
            await asyncio.sleep(0.005)
        assert await asyncio.gather(a, b, c) == ["ok a", "ok b", "ok c"]

    asyncio.run(scenario())


def test_an_error_result_fails_its_call_only() -> None:
    async def scenario() -> None:
        server = Server(hold=False)
        trips: RoundTrips[Any] = RoundTrips(server.send)
        results = await asyncio.gather(
            trips.call("x"), trips.call("bad"), trips.call("y"), return_exceptions=True
        )
        assert results[0] == "ok x" and results[2] == "ok y"
        assert isinstance(results[1], ValueError)
        assert len(server.batches) == 1

    asyncio.run(scenario())


def test_a_failed_round_trip_fails_its_calls_and_the_next_one_is_tried() -> None:
    async def scenario() -> None:
        server = Server(hold=False)
        server.fail_with = ConnectionError("gone")
        trips: RoundTrips[Any] = RoundTrips(server.send)
        results = await asyncio.gather(*(trips.call(i) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, ConnectionError) for r in results)
        server.fail_with = None
        assert await trips.call("again") == "ok again"

    asyncio.run(scenario())


def test_fail_queued_fails_what_was_not_sent() -> None:
    async def scenario() -> None:
        server = Server()
        trips: RoundTrips[Any] = RoundTrips(server.send)
        sent = trips.submit("sent")
        await asyncio.sleep(0)
        queued = [trips.submit(i) for i in range(4)]
        assert trips.fail_queued(lambda: RuntimeError("down")) == 4
        assert trips.queued == 0
        for future in queued:
            with pytest.raises(RuntimeError, match="down"):
                await future
        server.release.set()
        assert await sent == "ok sent"
        assert server.batches == [["sent"]]

    asyncio.run(scenario())


def test_calls_queued_too_long_fail_as_overloaded_and_are_not_sent() -> None:
    async def scenario() -> None:
        server = Server()
        trips: RoundTrips[Any] = RoundTrips(
            server.send, queue_timeout=0.05, overloaded=lambda: TimeoutError("overloaded")
        )
        first = trips.submit("first")
        await asyncio.sleep(0)
        late = trips.submit("late")
        await asyncio.sleep(0.1)
        fresh = trips.submit("fresh")
        server.release.set()
        assert await first == "ok first"
        with pytest.raises(TimeoutError, match="overloaded"):
            await late
        await asyncio.sleep(0.01)
        server.release.set()
        assert await fresh == "ok fresh"
        assert server.batches == [["first"], ["fresh"]]

    asyncio.run(scenario())


def test_a_cancelled_call_is_not_sent_and_close_fails_the_rest() -> None:
    async def scenario() -> None:
        server = Server()
        trips: RoundTrips[Any] = RoundTrips(server.send)
        in_flight = trips.submit("in flight")
        await asyncio.sleep(0)
        cancelled = trips.submit("cancelled")
        cancelled.cancel()
        queued = trips.submit("queued")
        started = time.monotonic()
        await trips.close()
        assert time.monotonic() - started < 1.0
        with pytest.raises(RuntimeError, match="closed"):
            await in_flight
        with pytest.raises(RuntimeError, match="closed"):
            await queued
        assert server.batches == [["in flight"]]
        with pytest.raises(RuntimeError, match="closed"):
            await trips.submit("after close")

    asyncio.run(scenario())


def test_bad_settings_are_refused() -> None:
    async def send(items: list[Any]) -> list[Any]:
        return items

    with pytest.raises(ValueError):
        RoundTrips(send, depth=0)
    with pytest.raises(ValueError):
        RoundTrips(send, max_batch=0)
    with pytest.raises(ValueError):
        RoundTrips(send, queue_timeout=0)


@pytest.mark.parametrize("fail", [False, True])
def test_a_call_right_after_a_round_trip_ends_is_sent_at_once(fail: bool) -> None:
    """The caller of a finished round trip runs before the sender's task is reaped."""

    async def scenario() -> None:
        server = Server(hold=False)
        server.fail_with = ConnectionError("gone") if fail else None
        # A stalled call would fail as overloaded after 0.3 s (no wait_for here: its
        # extra task would hide the race).
        trips: RoundTrips[Any] = RoundTrips(server.send, queue_timeout=0.3)
        for i in range(5):
            started = time.monotonic()
            call = trips.call(i)
            if fail:
                with pytest.raises(ConnectionError):
                    await call
            else:
                assert await call == f"ok {i}"
            assert time.monotonic() - started < 0.2
        assert len(server.batches) == 5

    asyncio.run(scenario())
