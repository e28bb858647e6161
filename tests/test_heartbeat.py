"""The supervisor's ping of a worker (router/heartbeat.py), on a real socket pair.

The worker's end is read by the test (a worker whose loop runs nothing, as a
paused one) or echoed by :func:`answer_pings` on a real event loop. The
clock is the test's (``now`` values).
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from router.heartbeat import PING, Heartbeat, answer_pings


def pending(worker: socket.socket) -> bytes:
    """What the supervisor has sent the worker and it has not read."""
    worker.setblocking(False)
    try:
        return worker.recv(1024)
    except BlockingIOError:
        return b""


def until_answered(heartbeat: Heartbeat, now: float) -> None:
    for _ in range(200):  # at most 2 s of real time
        heartbeat.step(now)
        if heartbeat.answered_at == now:
            return
        time.sleep(0.01)
    raise AssertionError("the echo never arrived")


def test_a_worker_is_judged_only_once_it_answered_and_then_by_its_oldest_ping() -> None:
    ours, worker = socket.socketpair()
    with worker:
        heartbeat = Heartbeat(ours, interval=0.5, timeout=2.0)
        heartbeat.step(100.0)
        # Still starting (nothing echoed yet): never judged, however long.
        assert heartbeat.hung_for(1000.0) is None
        assert pending(worker) == PING
        worker.send(PING)
        until_answered(heartbeat, 100.1)
        for now in (100.6, 101.0, 101.5, 102.0):  # the loop's passes; the worker echoes nothing
            heartbeat.step(now)
        assert pending(worker) == PING  # one ping waits: no second is sent
        assert heartbeat.hung_for(102.5) is None
        assert heartbeat.hung_for(102.6) == 2.0
        # The supervisor did not run for a while (paused): the wait starts again.
        heartbeat.step(110.0)
        assert heartbeat.hung_for(111.9) is None
        assert heartbeat.hung_for(112.0) == 2.0
        # The late echo comes: alive again, and the next ping goes out at once
        # (the last was sent long ago), its wait from now.
        assert pending(worker) == b""
        worker.send(PING)
        until_answered(heartbeat, 110.5)
        assert pending(worker) == PING
        assert heartbeat.hung_for(112.4) is None
        assert heartbeat.hung_for(112.5) == 2.0
        heartbeat.close()


def test_a_worker_gone_leaves_its_pings_unanswered() -> None:
    ours, worker = socket.socketpair()
    heartbeat = Heartbeat(ours, interval=0.5, timeout=2.0)
    heartbeat.step(0.0)
    worker.send(pending(worker))
    until_answered(heartbeat, 0.1)
    worker.close()  # the process died (its exit is the supervisor's other rule)
    for step in range(6):
        heartbeat.step(0.5 + step * 0.5)
    assert heartbeat.hung_for(2.5) == 2.0
    heartbeat.close()


@pytest.mark.anyio
async def test_the_workers_event_loop_echoes_each_ping() -> None:
    ours, worker = socket.socketpair()
    answer_pings(worker, asyncio.get_running_loop())
    heartbeat = Heartbeat(ours, interval=0.5, timeout=2.0)
    answers = []
    for i in range(3):
        now = i * 1.0
        heartbeat.step(now)
        for _ in range(100):  # at most 1 s of the loop
            await asyncio.sleep(0.01)
            heartbeat.step(now)
            if heartbeat.answered_at == now:
                break
        answers.append(heartbeat.answered_at)
    assert answers == [0.0, 1.0, 2.0]
    heartbeat.close()  # the worker's reader stops at the end of the pair
    for _ in range(50):
        await asyncio.sleep(0.01)
    asyncio.get_running_loop().remove_reader(worker.fileno())  # (gone already: False)
    worker.close()
