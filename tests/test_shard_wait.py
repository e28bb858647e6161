"""A request that waits for a crashed member's replicas (node/shard.py
``Shard._await_handoffs``) is woken by what it waits for, not by polling.

After a crash every request for the crashed member's keys waits until the
replicas' holders have sent their final transfers: thousands at once under
load. These tests step the event loop by hand (``asyncio.sleep(0)``), so "woken
at once" is a count of loop steps, not a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from node.clock import FrozenClock
from node.peers import Peers
from node.shard import HANDOFF_RECHECK, Shard
from node.shardcore import InFlight, NotOwner
from node.store import MemoryStore
from ring import Member, RingView
from tests.processes import free_port, wait_until
from tests.test_shard_core import RULE, config, owned_by

pytestmark = pytest.mark.anyio

#: Loop steps a woken waiter is given to finish (its wake-up and its return).
STEPS = 5


#: Where every member of these views is said to be: a port of 127.0.0.1 nothing
#: listens on (a pull asked there is refused at once).
NOWHERE = free_port()


def view(ids: list[str], epoch: int) -> RingView:
    return RingView.of([Member(i, f"http://127.0.0.1:{NOWHERE}") for i in ids], epoch=epoch)


@pytest.fixture
async def waiting() -> AsyncIterator[tuple[Shard, FrozenClock, str, asyncio.Task[bool]]]:
    """n1 of a ring where n0 crashed during n1's join: a key n0 owned waits
    for n2's final transfer (n2 holds n0's replicas), in a task."""
    timer = FrozenClock(0.0)
    fixed = config()
    peers = Peers()
    shard = Shard("n1", MemoryStore(), FrozenClock(), peers, lambda: fixed, timer=timer)
    v1, v2, v3 = view(["n0", "n2"], 1), view(["n0", "n1", "n2"], 2), view(["n1", "n2"], 3)
    shard.apply(v2, v1)
    shard.receive("n2", 2, [], True)
    shard.apply(v3, v2, ("n0",))
    key = next(k for k in owned_by(v3, "n1") if v1.owner_id(k) == "n0")
    task = asyncio.create_task(shard.admit(key, (RULE,)))
    try:
        for _ in range(STEPS):
            await asyncio.sleep(0)
        assert not task.done(), "the key did not wait for n2's final transfer"
        yield shard, timer, key, task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await peers.close()


async def test_a_final_mark_wakes_the_waiting_request_at_once(
    waiting: tuple[Shard, FrozenClock, str, asyncio.Task[bool]],
) -> None:
    shard, _, _, task = waiting
    shard.receive("n2", 3, [], True)  # n2's final mark under the crash's view
    for _ in range(STEPS):
        await asyncio.sleep(0)
    assert task.done(), "the request still waits (polling) after the mark came in"
    assert task.result() is True  # it waited, then was admitted


async def test_a_newer_view_wakes_the_waiting_request_at_once(
    waiting: tuple[Shard, FrozenClock, str, asyncio.Task[bool]],
) -> None:
    shard, _, key, task = waiting
    v3, v4 = view(["n1", "n2"], 3), view(["n2"], 4)
    assert v4.owner_id(key) == "n2"
    shard.apply(v4, v3)  # n1 left too: the key is n2's now
    for _ in range(STEPS):
        await asyncio.sleep(0)
    assert task.done(), "the request still waits after the view changed"
    with pytest.raises(NotOwner):
        task.result()


async def test_a_request_stops_waiting_once_every_deadline_has_passed(
    waiting: tuple[Shard, FrozenClock, str, asyncio.Task[bool]],
) -> None:
    """Nothing announces a deadline: the waiter looks again within HANDOFF_RECHECK."""
    shard, timer, _, task = waiting
    timer.advance(shard.handoff_wait + 1.0)
    assert await asyncio.wait_for(task, HANDOFF_RECHECK * 20) is True


async def test_a_waiting_request_cancelled_leaves_the_others_waiting(
    waiting: tuple[Shard, FrozenClock, str, asyncio.Task[bool]],
) -> None:
    """A client gone (its request cancelled) does not wake, or cancel, the rest."""
    shard, _, key, task = waiting
    other = asyncio.create_task(shard.admit(key, (RULE,)))
    for _ in range(STEPS):
        await asyncio.sleep(0)
    other.cancel()
    for _ in range(STEPS):
        await asyncio.sleep(0)
    assert other.cancelled()
    assert not task.done(), "the other request stopped waiting"
    shard.receive("n2", 3, [], True)
    for _ in range(STEPS):
        await asyncio.sleep(0)
    assert task.result() is True


async def test_news_that_does_not_end_the_wait_leaves_the_waiter_idle(
    waiting: tuple[Shard, FrozenClock, str, asyncio.Task[bool]],
) -> None:
    """Transfers that do not hold the key wake the waiter once each; then it waits
    for the next news or the deadline's timer, without a timer per news."""
    shard, _, _, task = waiting
    looks = 0
    holds = shard.core.holds

    def counted(key: str, rules: object) -> bool:
        nonlocal looks
        looks += 1
        return holds(key, rules)  # type: ignore[arg-type]

    shard.core.holds = counted  # type: ignore[method-assign]
    for _ in range(20):  # chunks of n2's transfer, none with this key: no mark yet
        shard.receive("n2", 3, [], False)
        for _ in range(STEPS):
            await asyncio.sleep(0)
        await asyncio.sleep(HANDOFF_RECHECK / 20)  # (spread: timers left would not coincide)
    assert not task.done()
    assert 20 <= looks <= 20 + STEPS  # one look per news (a waiter that spins: many more)
    looks = 0
    await asyncio.sleep(HANDOFF_RECHECK * 3)  # no news: the deadline's one timer
    assert looks <= 6, f"{looks} looks in {HANDOFF_RECHECK * 3} s without news"


async def test_a_late_pull_that_fails_wakes_the_waiting_request_at_once(
    waiting: tuple[Shard, FrozenClock, str, asyncio.Task[bool]],
) -> None:
    """Past the deadline, a pull from n2 that fails gives n2 up (no final mark is
    awaited any more): the request waiting for n2's mark is woken by that, not
    by the deadline's timer up to HANDOFF_RECHECK later."""
    shard, timer, _, task = waiting
    v1, v3 = view(["n0", "n2"], 1), view(["n1", "n2"], 3)
    pulled = next(k for k in owned_by(v3, "n1") if v1.owner_id(k) == "n2")  # n2's in v1
    timer.advance(shard.handoff_wait + 1.0)  # (the waiter's timer is still 0.5 s away)
    pull = asyncio.create_task(shard.admit(pulled, (RULE,)))
    await wait_until(lambda: shard.core.stats.pulls == 1, 5)
    await asyncio.sleep(0.01)  # (refused: it retries until its own deadline, then fails)
    timer.advance(shard.handoff_wait + 1.0)
    assert await asyncio.wait_for(pull, 5) is True
    assert shard.core.stats.pull_failures == 1
    for _ in range(STEPS):
        await asyncio.sleep(0)
    assert task.done(), "the request still waits after n2 was given up"
    assert task.result() is True


async def test_a_key_pulled_under_an_older_view_is_in_flight_to_a_newer_views_owner() -> None:
    """n1 pulls a key from n0 under epoch 2, and n0 has not answered yet when n2,
    the key's owner under epoch 3, asks n1 for it. n1 answers ``in_flight``
    (its pull may bring the state, which then goes with its final mark): "it
    has nothing" sent n2 on to n0, which had given the state up already, and
    n2 decided the key fresh (an independent review). A key n1 is not pulling
    gets its usual answer."""
    quiet: list[asyncio.StreamWriter] = []  # accepted and never answered

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        quiet.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    members = {i: Member(i, f"http://127.0.0.1:{port}") for i in ("n0", "n1", "n2")}

    def at(ids: list[str], epoch: int) -> RingView:
        return RingView.of([members[i] for i in ids], epoch=epoch)

    v1, v2, v3 = at(["n0"], 1), at(["n0", "n1"], 2), at(["n0", "n1", "n2"], 3)
    fixed = config()
    peers = Peers()
    shard = Shard("n1", MemoryStore(), FrozenClock(), peers, lambda: fixed, timer=FrozenClock(0.0))
    shard.apply(v2, v1)
    key, other = [k for k in owned_by(v2, "n1") if v3.owner_id(k) == "n2"][:2]
    task = asyncio.create_task(shard.admit(key, (RULE,)))
    try:
        await wait_until(lambda: bool(quiet), 5.0)  # the pull is on its way
        shard.apply(v3, v2)
        with pytest.raises(InFlight):
            shard.serve_pull([key], "n2", 3)
        assert shard.serve_pull([other], "n2", 3) == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await shard.close()
        await peers.close()
        for writer in quiet:
            writer.close()
        server.close()
        await server.wait_closed()
