"""The removal budget (router/removal.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.removal import RemovalBudget

THREE = ["n1", "n2", "n3"]


def test_one_dead_member_of_three_is_removed() -> None:
    plan = RemovalBudget(interval=5.0).plan(10.0, THREE, {"n2"}, ["n2"], {})
    assert plan.remove == ("n2",) and not plan.suspect_self


def test_a_router_that_reaches_none_suspects_itself_and_removes_nobody() -> None:
    plan = RemovalBudget(interval=5.0).plan(10.0, THREE, set(THREE), THREE, {})
    assert plan.remove == () and plan.suspect_self
    assert plan.deferred == dict.fromkeys(THREE, "quorum")


def test_two_of_three_unreachable_is_a_minority_answering() -> None:
    plan = RemovalBudget(interval=5.0).plan(10.0, THREE, {"n1", "n2"}, ["n1", "n2"], {})
    assert plan.remove == () and plan.suspect_self


def test_a_two_member_ring_never_shrinks_on_probes_alone() -> None:
    plan = RemovalBudget(interval=5.0).plan(10.0, ["n1", "n2"], {"n2"}, ["n2"], {})
    assert plan.remove == ()
    assert plan.deferred == {"n2": "quorum"}


def test_a_lower_quorum_lets_a_two_member_ring_shrink() -> None:
    plan = RemovalBudget(interval=5.0, quorum=0.0).plan(10.0, ["n1", "n2"], {"n2"}, ["n2"], {})
    assert plan.remove == ("n2",)


def test_one_removal_per_interval() -> None:
    budget = RemovalBudget(interval=5.0)
    members = ["n1", "n2", "n3", "n4", "n5"]
    plan = budget.plan(10.0, members, {"n1", "n2"}, ["n1", "n2"], {})
    assert plan.remove == ("n1",) and plan.deferred == {"n2": "rate"}
    budget.removed(10.0)
    left = members[1:]
    assert budget.plan(14.9, left, {"n2"}, ["n2"], {}).deferred == {"n2": "rate"}
    assert budget.plan(15.0, left, {"n2"}, ["n2"], {}).remove == ("n2",)


def test_removal_waits_for_the_lease() -> None:
    budget = RemovalBudget(interval=0.0)
    plan = budget.plan(10.0, THREE, {"n2"}, ["n2"], {"n2": 10.5})
    assert plan.remove == () and plan.deferred == {"n2": "lease"}
    assert budget.plan(10.5, THREE, {"n2"}, ["n2"], {"n2": 10.5}).remove == ("n2",)


@pytest.mark.parametrize("quorum", [-0.1, 1.0, 2.0])
def test_quorum_is_a_fraction_below_one(quorum: float) -> None:
    with pytest.raises(ValueError, match="quorum"):
        RemovalBudget(interval=1.0, quorum=quorum)


@given(
    size=st.integers(1, 9),
    rounds=st.lists(
        st.tuples(st.floats(0.0, 3.0), st.sets(st.integers(0, 8))), min_size=1, max_size=30
    ),
    quorum=st.sampled_from([0.0, 0.5, 0.66]),
)
def test_the_budget_holds_over_any_failure_pattern(
    size: int, rounds: list[tuple[float, set[int]]], quorum: float
) -> None:
    """Never more than one removal per interval, never a removal while at most
    ``quorum`` answer, and the ring never shrinks to ``quorum`` of its size."""
    budget = RemovalBudget(interval=1.0, quorum=quorum)
    members = [f"n{i}" for i in range(size)]
    now = 0.0
    removals: list[float] = []
    for gap, down in rounds:
        now += gap
        unreachable = {m for i, m in enumerate(members) if i in down}
        plan = budget.plan(now, members, unreachable, sorted(unreachable), {})
        assert len(plan.remove) <= 1
        if plan.remove:
            reachable = len(members) - len(unreachable)
            assert reachable > quorum * len(members)
            assert len(members) - 1 > quorum * len(members)
            assert not removals or now - removals[-1] >= 1.0
            removals.append(now)
            budget.removed(now)
            members = [m for m in members if m not in plan.remove]
        assert members
