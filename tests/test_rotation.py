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
