"""router.membership._cancel_within: a router's shutdown stops its tasks, bounded."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import pytest

from router.membership import _cancel_within

pytestmark = pytest.mark.anyio


async def _loses_one_cancellation(stopped: asyncio.Event) -> None:
    """As a task does whose cancellation Python 3.11's wait_for lost: it goes on."""
    with contextlib.suppress(asyncio.CancelledError):  # lost
        await asyncio.sleep(3600)
    try:
        await asyncio.sleep(3600)
    finally:
        stopped.set()


async def test_a_task_that_lost_its_cancellation_is_cancelled_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    stopped = asyncio.Event()
    task = asyncio.create_task(_loses_one_cancellation(stopped))
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.WARNING, logger="ringlimit.router"):
        await _cancel_within([task], 5.0, "test")
    assert task.cancelled() and stopped.is_set()
    assert loop.time() - started < 2.0  # the second cancellation, not the 5 s bound
    assert "did not stop" not in caplog.text


async def test_a_task_that_never_stops_is_left_after_the_bound(
    caplog: pytest.LogCaptureFixture,
) -> None:
    release = asyncio.Event()
    cancels = 0

    async def stops_when_released() -> None:
        nonlocal cancels
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                cancels += 1

    task = asyncio.create_task(stops_when_released())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        with caplog.at_level(logging.WARNING, logger="ringlimit.router"):
            await _cancel_within([task], 0.3, "test")
        took = loop.time() - started
        await asyncio.sleep(0)  # the task takes the last cancellation
        assert not task.done()
        assert 0.3 <= took < 2.0, took  # waited out the bound, and no longer
        assert cancels == 2, cancels  # cancelled at once, and again at the bound
        assert "1 test task(s) did not stop within 0.3 s" in caplog.text
    finally:
        release.set()
        await asyncio.wait_for(task, timeout=5.0)


async def test_a_task_cleaning_up_is_not_cancelled_again_within_a_second() -> None:
    """A task's own cleanup after its cancellation (closing a gRPC channel) takes
    its time: a second cancellation before RECANCEL_AFTER would cut it short."""
    cleaned = asyncio.Event()

    async def cleans_up_slowly() -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            await asyncio.sleep(0.5)  # cancelled again here, the cleanup is lost
            cleaned.set()

    task = asyncio.create_task(cleans_up_slowly())
    await asyncio.sleep(0)
    await _cancel_within([task], 5.0, "test")
    assert task.done() and cleaned.is_set()
