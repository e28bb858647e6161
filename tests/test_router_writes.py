"""The router's client transport (router/protocol.py ``AnswerWrites``): a whole
answer leaves at once unless something must leave before it or with it, and
answers never overtake what was written before them."""

from __future__ import annotations

import asyncio

import pytest

from router.protocol import AnswerWrites

pytestmark = pytest.mark.anyio


class Recorder:
    """A transport that keeps each write it is given."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_an_answer_alone_leaves_at_once() -> None:
    real = Recorder()
    writes = AnswerWrites(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    writes.write_answer(b"one", more=False)
    assert real.writes == [b"one"]  # not at the end of the step: now
    assert not writes.is_closing()
    real.closed = True
    assert writes.is_closing()


async def test_an_answer_waits_behind_what_is_buffered_and_for_pipelined_requests() -> None:
    real = Recorder()
    writes = AnswerWrites(real, asyncio.get_running_loop())  # type: ignore[arg-type]
    writes.write(b"head+")  # uvicorn's cycle: a response in two writes
    writes.write_answer(b"two", more=False)
    assert real.writes == []
    await asyncio.sleep(0)
    assert real.writes == [b"head+two"]  # in order, in one write
    writes.write_answer(b"three", more=True)  # a pipelined request waits behind it
    assert real.writes == [b"head+two"]
    await asyncio.sleep(0)
    assert real.writes == [b"head+two", b"three"]
