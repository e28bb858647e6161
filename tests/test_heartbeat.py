"""The supervisor's probe of a worker (router/heartbeat.py), on real sockets.

A listening socket whose owner never accepts is exactly what a paused or hung
worker leaves the supervisor: the kernel completes the connection into its
backlog and nothing ever answers. The clock is the test's (``now`` values).
"""

from __future__ import annotations

import socket
import time

from router.heartbeat import PROBE, Heartbeat


def answer_one(listener: socket.socket) -> bytes:
    """Accept the probe waiting in the backlog and answer it as a worker would."""
    conn, _ = listener.accept()
    with conn:
        conn.settimeout(2.0)
        request = conn.recv(1024)
        conn.sendall(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
    return request


def until_answered(heartbeat: Heartbeat, now: float) -> None:
    for _ in range(200):  # at most 2 s of real time
        heartbeat.step(now)
        if heartbeat.answered_at == now:
            return
        time.sleep(0.01)
    raise AssertionError("the answer never arrived")


def test_a_worker_is_judged_only_once_it_answered_and_then_by_its_oldest_probe() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        heartbeat = Heartbeat(listener.getsockname(), interval=0.5, timeout=2.0)
        heartbeat.step(100.0)  # the first probe waits in the backlog
        # Still starting (nothing answered yet): never judged, however long.
        assert heartbeat.hung_for(1000.0) is None
        assert answer_one(listener) == PROBE
        until_answered(heartbeat, 100.1)  # any status proves the loop runs
        heartbeat.step(100.6)  # the next probe: nobody accepts it
        heartbeat.step(101.0)
        heartbeat.step(102.0)  # no second probe while one waits: the wait is the first's
        assert heartbeat.hung_for(102.5) is None
        assert heartbeat.hung_for(102.6) == 2.0
        # The supervisor itself was paused: the wait starts again when it resumes.
        heartbeat.forgive(110.0)
        assert heartbeat.hung_for(111.9) is None
        assert heartbeat.hung_for(112.0) == 2.0
        # The late answer comes: alive again.
        answer_one(listener)
        until_answered(heartbeat, 112.1)
        assert heartbeat.hung_for(114.0) is None  # the next probe, sent at 112.1, is young
        # Started again: not judged until the new process answers.
        heartbeat.step(112.7)
        heartbeat.restart()
        heartbeat.step(113.0)
        assert heartbeat.hung_for(200.0) is None
        heartbeat.close()


def test_a_probe_that_cannot_connect_counts_as_unanswered() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        heartbeat = Heartbeat(listener.getsockname(), interval=0.5, timeout=2.0)
        heartbeat.step(0.0)
        answer_one(listener)
        until_answered(heartbeat, 0.1)
        address = listener.getsockname()
    # The socket is gone (nothing listens): every connect fails.
    heartbeat = Heartbeat(address, interval=0.5, timeout=2.0)
    heartbeat.answered_at = 0.5
    for step in range(6):
        heartbeat.step(1.0 + step * 0.5)
    assert heartbeat.hung_for(3.0) == 2.0
