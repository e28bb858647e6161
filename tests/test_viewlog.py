"""The view log (router/viewlog.py): membership transitions without sockets.

The async driver (router/membership.py) carries out these plans; here they
are checked as data: the epochs, the push order, the history kept for nodes
that miss a push, and the handling of changes that half-failed.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ring import Member, RingView
from router.viewlog import MAX_REMOVED, Change, MembershipError, ViewLog

KEYS = [f"key-{i}" for i in range(400)]


def member(member_id: str, port: int = 0) -> Member:
    return Member(member_id, f"http://127.0.0.1:{9000 + port}")


def started(*ids: str) -> ViewLog:
    return ViewLog(RingView.of([member(i) for i in ids], epoch=1))


def carry(log: ViewLog, change: Change) -> None:
    """What the driver does once a change's pushes went out: remember, bury, adopt."""
    log.remember(change.previous, change.crashed)
    for member_id in change.crashed:
        log.bury(change.previous.member(member_id))
    log.adopt(change.view)


def owners(view: RingView) -> dict[str, str | None]:
    return {k: (view.owner_id(k) if len(view) else None) for k in KEYS}


def view_steps(change: Change) -> dict[str, int]:
    """For each member, the index of the step that pushes it the new view."""
    steps: dict[str, int] = {}
    for index, push in enumerate(change.pushes):
        if push.view == change.view:
            for m in push.members:
                steps.setdefault(m.id, index)
    return steps


def losers_before_gainers(change: Change) -> None:
    """Every live member that loses a key takes the view before any member that only gains."""
    before, after = owners(change.previous), owners(change.view)
    lose = {before[k] for k in KEYS if before[k] != after[k] and before[k] is not None}
    gain = {after[k] for k in KEYS if before[k] != after[k] and after[k] is not None}
    lose -= set(change.crashed)
    only_gain = gain - lose
    steps = view_steps(change)
    for loser in lose:
        for gainer in only_gain:
            assert steps[loser] < steps[gainer], (loser, gainer, change.pushes)
    # Everyone in the new view (and a leaving member) gets it.
    assert set(change.view.ids) | lose <= set(steps)


# ---------------------------------------------------------------------- transitions


def test_a_join_welcomes_the_newcomer_then_pushes_losers_then_gainers() -> None:
    log = started("n1", "n2")
    welcome = log.welcome(member("n3"))
    assert welcome.view == log.view and welcome.previous is None
    assert welcome.role == "config" and not welcome.tolerate and welcome.ready
    assert welcome.crashed == ()
    change = log.join(member("n3"))
    assert change.view.epoch == 2 and change.view.ids == ("n1", "n2", "n3")
    assert [p.role for p in change.pushes] == ["losers", "gainers"]
    assert [m.id for m in change.pushes[0].members] == ["n1", "n2"]
    assert [m.id for m in change.pushes[1].members] == ["n3"]
    assert all(p.previous == log.view and p.tolerate for p in change.pushes)
    losers_before_gainers(change)


def test_a_leave_pushes_the_leaver_first_and_does_not_tolerate_its_failure() -> None:
    log = started("n1", "n2", "n3")
    change = log.leave("n2")
    assert change.view.ids == ("n1", "n3") and change.view.epoch == 2
    first, then = change.pushes
    assert [m.id for m in first.members] == ["n2"] and not first.tolerate
    assert [m.id for m in then.members] == ["n1", "n3"] and then.tolerate
    losers_before_gainers(change)


def test_a_crash_folded_into_a_leave_is_one_change_from_the_same_view() -> None:
    """n3's removal is decided while n2 leaves: one change from the view before
    the leave, without either; the leaver first (it holds what it was handing
    to n3), then the rest; n3 crashed (its policy applies) and told after."""
    log = started("n1", "n2", "n3")
    leave = log.leave("n2")
    folded = log.fold_crashes(leave, ["n3"])
    assert folded is not None
    assert folded.previous == leave.previous and folded.view.ids == ("n1",)
    assert folded.view.epoch == 3 and folded.crashed == ("n3",)
    first, then = folded.pushes
    assert [m.id for m in first.members] == ["n2"] and not first.tolerate
    assert first.previous == leave.previous and first.crashed == ("n3",)
    assert [m.id for m in then.members] == ["n1"] and then.crashed == ("n3",)
    (notify,) = folded.afterwards
    assert [m.id for m in notify.members] == ["n3"] and notify.role == "notify"
    carry(log, folded)
    assert log.view == folded.view and "n3" in log.removed and "n2" not in log.removed
    assert log.next_view(log.view).epoch == 4  # epoch 2 (the leave's) is never reused


def test_a_second_crash_folds_into_the_folded_leave_with_the_first() -> None:
    """n4 is condemned while n2 delivers under the view that folded n3 in: one
    more change from the view before the leave, without n2, n3 and n4, both
    crashed (their policy applies) and told after. Folded once only, n4 waited
    out the leaver's delivery to it (15 s), and the leaver was taken for crashed
    (an exploratory tester)."""
    log = started("n1", "n2", "n3", "n4", "n5")
    leave = log.leave("n2")
    first = log.fold_crashes(leave, ["n3"])
    assert first is not None
    second = log.fold_crashes(first, ["n4"])
    assert second is not None
    assert second.previous == leave.previous and second.view.ids == ("n1", "n5")
    assert second.crashed == ("n3", "n4") and second.view.epoch == 4
    losers, gainers = second.pushes
    assert [m.id for m in losers.members] == ["n2"] and losers.crashed == ("n3", "n4")
    assert [m.id for m in gainers.members] == ["n1", "n5"]
    (notify,) = second.afterwards
    assert [m.id for m in notify.members] == ["n3", "n4"]


def test_a_crash_is_not_folded_into_a_leave_when_no_member_would_be_left() -> None:
    """Two members, one leaving and the other condemned (a removal quorum of 0):
    folded, the ring would be empty, the leaver's states dropped and its leave
    answered 200, past the refusal of the last node's leave (an independent
    review). The removal waits for the leave instead, as before folding."""
    log = started("n1", "n2")
    leave = log.leave("n1")
    assert log.fold_crashes(leave, ["n2"]) is None
    assert log.next_view(log.view).epoch == 3  # no epoch spent on it


def test_the_last_member_leaves_only_when_forced() -> None:
    log = started("n1")
    with pytest.raises(MembershipError) as info:
        log.leave("n1")
    assert info.value.status == 409 and info.value.error == "last_node"
    assert "force=true" in info.value.detail
    assert log.leave("n1", force=True).view.ids == ()


def test_leaving_an_unknown_member_is_a_404() -> None:
    with pytest.raises(MembershipError) as info:
        started("n1").leave("n9")
    assert info.value.status == 404 and info.value.error == "unknown_node"


def test_a_crash_tells_the_survivors_then_the_crashed_member_afterwards() -> None:
    log = started("n1", "n2", "n3")
    change = log.crash("n2")
    assert change is not None
    assert change.crashed == ("n2",)
    (push,) = change.pushes
    assert [m.id for m in push.members] == ["n1", "n3"] and push.crashed == ("n2",)
    (notify,) = change.afterwards
    assert [m.id for m in notify.members] == ["n2"] and notify.view == change.view
    carry(log, change)
    assert "n2" in log.removed and log.view.epoch == 2
    assert log.crash("n2") is None  # already gone: nothing to do


def test_a_removed_member_rejoins_as_new_and_hands_back_what_it_held() -> None:
    log = started("n1", "n2", "n3")
    crash = log.crash("n3")
    assert crash is not None
    carry(log, crash)
    assert log.welcome(member("n3")).crashed == ("n3",)
    carry(log, log.join(member("n3")))
    assert "n3" not in log.removed and log.view.epoch == 3


def test_a_restart_is_a_crash_then_a_join() -> None:
    log = started("n1", "n2")
    assert log.registered(member("n2"))
    assert not log.registered(member("n3"))
    with pytest.raises(MembershipError) as info:
        log.registered(member("n2", port=7))
    assert info.value.error == "already_member"
    assert log.lost_state(member("n2"), 0) and not log.lost_state(member("n2"), 1)


def test_a_replacement_keeps_the_id_with_a_new_url() -> None:
    log = started("n1", "n2")
    change = log.join(member("n2", port=5))
    assert change.view.member("n2").url.endswith(":9005")
    assert len(change.view) == 2


def test_a_refresh_sends_the_nodes_previous_view_and_every_crash_it_missed() -> None:
    log = started("n1", "n2", "n3", "n4")
    v1 = log.view
    first = log.crash("n3")
    assert first is not None
    carry(log, first)
    second = log.crash("n4")
    assert second is not None
    carry(log, second)
    push = log.refresh(member("n1"), 1)
    assert push.view == log.view and push.previous == v1
    assert push.crashed == ("n3", "n4")
    assert log.refresh(member("n1"), 2).crashed == ("n4",)
    assert log.refresh(member("n1"), 99).previous is None


def test_roll_forward_welcomes_newcomers_then_losers_then_gainers() -> None:
    log = ViewLog()
    previous = RingView.of([member("n1")], epoch=4)
    view = RingView.of([member("n1"), member("n2")], epoch=5)
    change = log.roll_forward(view, previous, ())
    assert change.welcome is not None
    assert [m.id for m in change.welcome.members] == ["n2"] and change.welcome.view == previous
    assert [p.role for p in change.pushes] == ["losers", "gainers"]
    assert log.highest == 5
    losers_before_gainers(change)
    first = log.roll_forward(RingView.of([member("n1")], epoch=1), None, ())
    assert first.previous == RingView.empty()


def test_epochs_go_above_views_that_were_pushed_but_never_adopted() -> None:
    log = started("n1", "n2", "n3")
    abandoned = log.leave("n2")  # the leaver did not take it: not adopted
    crash = log.crash("n2")
    assert crash is not None and crash.view.epoch == abandoned.view.epoch + 1
    log.saw(10)  # another router, or etcd
    assert log.join(member("n4")).view.epoch == 11


def test_history_and_removed_members_are_bounded() -> None:
    log = ViewLog()
    for i in range(MAX_REMOVED + 5):
        log.bury(member(f"n{i}"))
    assert len(log.removed) == MAX_REMOVED and "n0" not in log.removed
    log = started("n1", "n2")
    for i in range(3, 60):
        carry(log, log.join(member(f"n{i}")))
        left = log.crash(f"n{i}")
        assert left is not None
        carry(log, left)
    assert len(log.history) <= 32 and len(log.crashed_at) <= 32


# ---------------------------------------------------------------------- half-failed changes


def test_unresponsive_members_wait_for_their_leases() -> None:
    log = started("n1", "n2", "n3")
    plan = log.unresponsive(["n2", "n2", "n9"], quorum=0.5, lease_until={"n2": 12.5}, now=10.0)
    assert plan.crash == ("n2",) and not plan.defer_quorum and plan.wait == 2.5
    assert log.unresponsive(["n2"], quorum=0.5, lease_until={"n2": 9.0}, now=10.0).wait == 0.0
    assert log.unresponsive([], quorum=0.5, lease_until={}, now=0.0).crash == ()


def test_too_many_unresponsive_members_make_the_router_suspect_itself() -> None:
    log = started("n1", "n2", "n3")
    plan = log.unresponsive(["n2", "n3"], quorum=0.5, lease_until={}, now=0.0)
    assert plan.defer_quorum and plan.crash == ("n2", "n3")
    # An operator's leave is not budgeted.
    forced = log.unresponsive(["n2", "n3"], quorum=0.5, lease_until={}, now=0.0, budgeted=False)
    assert not forced.defer_quorum


# ---------------------------------------------------------------------- properties

IDS = [f"n{i}" for i in range(1, 7)]

operations = st.lists(
    st.tuples(
        st.sampled_from(["join", "leave", "crash", "replace", "saw"]),
        st.sampled_from(IDS),
        st.sets(st.sampled_from(IDS), max_size=3),  # members whose push fails
        st.integers(min_value=0, max_value=3),
    ),
    max_size=30,
)


def step(log: ViewLog, op: str, target: str, failing: set[str], extra: int) -> list[Change]:
    """One operation the way the driver carries it out; returns every plan made."""
    plans: list[Change] = []
    if op == "saw":
        log.saw(log.highest + extra)
        return plans
    if op in ("join", "replace"):
        if op == "join" and target in log.view:
            return plans
        if op == "replace" and target not in log.view:
            return plans
        change = log.join(member(target, port=extra if op == "replace" else 0))
    elif op == "leave":
        if target not in log.view:
            return plans
        change = log.leave(target, force=True)  # a node leaving by itself
        if target in failing:  # the leaver did not take it: a crash instead
            plans.append(change)
            crash = log.crash(target)
            assert crash is not None
            plans.append(crash)
            carry(log, crash)
            return plans
    else:
        maybe = log.crash(target)
        if maybe is None:
            return plans
        change = maybe
    plans.append(change)
    losers_before_gainers(change)
    carry(log, change)
    # Half-failed: adopted, then the members that did not take it are crashed.
    failed = [m for m in sorted(failing) if m in change.view and m not in change.crashed]
    plan = log.unresponsive(failed, quorum=0.0, lease_until={}, now=0.0)
    for member_id in plan.crash:
        crash = log.crash(member_id)
        if crash is not None:
            plans.append(crash)
            carry(log, crash)
    return plans


@settings(max_examples=150, deadline=None)
@given(st.sets(st.sampled_from(IDS), min_size=1, max_size=4), operations)
def test_epochs_strictly_increase_and_are_never_reused(
    seed: set[str], ops: list[tuple[str, str, set[str], int]]
) -> None:
    log = started(*sorted(seed))
    made = [log.view.epoch]
    adopted = [log.view.epoch]
    for op, target, failing, extra in ops:
        before = log.view.epoch
        for change in step(log, op, target, failing, extra):
            made.append(change.view.epoch)
        assert log.view.epoch >= before
        if log.view.epoch != before:
            adopted.append(log.view.epoch)
        assert log.highest >= log.view.epoch
    assert made == sorted(made) and len(made) == len(set(made))
    assert adopted == sorted(adopted) and len(adopted) == len(set(adopted))


@settings(max_examples=100, deadline=None)
@given(st.sets(st.sampled_from(IDS), min_size=1, max_size=5), st.sampled_from(IDS))
def test_every_plan_orders_losers_before_gainers(seed: set[str], target: str) -> None:
    log = started(*sorted(seed))
    if target in log.view:
        losers_before_gainers(log.leave(target, force=True))
        crash = started(*sorted(seed)).crash(target)
        assert crash is not None
        losers_before_gainers(crash)
    else:
        losers_before_gainers(log.join(member(target)))
