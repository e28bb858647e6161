"""router/rotation.py: round-robin past nodes that cannot be reached (a frozen clock)."""

from __future__ import annotations

from node.clock import FrozenClock
from ring import Member
from router.rotation import Rotation

MEMBERS = tuple(Member(f"n{i}", f"http://n{i}") for i in (1, 2, 3))


def picks(rotation: Rotation, n: int) -> list[str]:
    return [rotation.next(MEMBERS).id for _ in range(n)]


def test_turns_go_round_and_skip_a_failed_member_for_a_while() -> None:
    clock = FrozenClock()
    rotation = Rotation(clock, skip_for=2.0)
    assert picks(rotation, 6) == ["n1", "n2", "n3"] * 2
    assert rotation.failed(MEMBERS[1], MEMBERS)  # n1 and n3 remain
    assert set(picks(rotation, 30)) == {"n1", "n3"}
    clock.advance(2.0)
    assert set(picks(rotation, 6)) == {"n1", "n2", "n3"}  # tried again


def test_when_every_member_failed_there_is_nowhere_else_to_go() -> None:
    clock = FrozenClock()
    rotation = Rotation(clock, skip_for=2.0)
    assert rotation.failed(MEMBERS[0], MEMBERS)
    assert rotation.failed(MEMBERS[1], MEMBERS)
    assert not rotation.failed(MEMBERS[2], MEMBERS)  # its on_error answers
    assert len(picks(rotation, 3)) == 3  # still a member to send to
    clock.advance(2.0)
    assert rotation.failed(MEMBERS[0], MEMBERS)  # the others' time is up
    assert rotation._down.keys() == {"n1"}  # bounded: the expired are gone


def test_a_search_passes_each_member_once_within_its_budget() -> None:
    """A request's search past unreachable nodes is bounded by the members and by
    time (not by the ring change's MAX_ATTEMPTS): the budget it is given (the
    router's refusal time), counted from its first pass."""
    clock = FrozenClock()
    rotation = Rotation(clock, skip_for=2.0, search_for=5.0)
    search = rotation.search()
    assert not search.over()  # not begun: no time runs
    clock.advance(10.0)
    assert search.again(3) and search.again(3)  # its time starts at the first pass
    assert not search.again(3)  # as many passes as members: none left to try
    search = rotation.search()
    assert search.again(10)
    clock.advance(4.99)
    assert search.again(10) and not search.over()
    clock.advance(0.01)
    assert search.over() and not search.again(10)  # 5 s on: the rules' on_error answers


def test_a_member_that_failed_is_skipped_until_its_time_is_up() -> None:
    clock = FrozenClock()
    rotation = Rotation(clock, skip_for=2.0)
    assert rotation.failed(MEMBERS[0], MEMBERS)
    assert rotation.skipped(MEMBERS[0]) and not rotation.skipped(MEMBERS[1])
    clock.advance(2.0)
    assert not rotation.skipped(MEMBERS[0])
