"""The shard's authority core (node/shardcore.py), without an event loop.

Every test drives :class:`ShardCore` objects by hand: views, messages and time
go in as arguments, decisions and messages come out as data, and the tests
carry the messages between cores through a list. The properties at the end
run random sequences of views, checks and deliveries over 2-4 cores.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.config import ClusterConfig, Policies, ScopedRule
from node.lease import Lease
from node.rules import Rule
from node.shardcore import (
    AwaitHandoffs,
    InFlight,
    LeaseExpired,
    NoLongerMember,
    NotOwner,
    Pull,
    ShardCore,
    StaleEpoch,
    Transfer,
)
from node.store import MemoryStore
from ring import Member, RingView

NOW = 1_000_000.0
LIMIT = 1_000_000
RULE = Rule("api", LIMIT, 3600.0, algorithm="fixed_window")
KEYS = [f"user-{i}" for i in range(40)]
IDS = ["n0", "n1", "n2", "n3"]


def config(crash: str = "replica", rebalance: str = "handoff", rule: Rule = RULE) -> ClusterConfig:
    return ClusterConfig(
        rules=(ScopedRule(rule),), policies=Policies(rebalance=rebalance, crash=crash)
    )


def view(ids: list[str], epoch: int) -> RingView:
    return RingView.of([Member(i, f"http://{i}:8000") for i in ids], epoch=epoch)


def core(node_id: str, cfg: ClusterConfig | None = None, **kwargs: object) -> ShardCore:
    fixed = cfg if cfg is not None else config()
    return ShardCore(node_id, MemoryStore(), lambda: fixed, **kwargs)  # type: ignore[arg-type]


def decide(c: ShardCore, key: str, now: float = NOW, rule: Rule = RULE) -> int:
    """Consume one unit of ``key`` at ``c``; the count it has reached there."""
    verdict = c.store.check(key, (rule,), now)
    assert verdict.allowed
    return rule.limit - verdict.decision.remaining


def owned_by(v: RingView, node_id: str) -> list[str]:
    return [k for k in KEYS if v.owner_id(k) == node_id]


def join_after_one_decision(a: ShardCore) -> tuple[RingView, RingView, list[str], Transfer]:
    """``a`` (n0) alone decides every key once, then n1 joins: the two views, the
    keys that move to n1, and ``a``'s transfer of them."""
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    a.apply(v1, None, (), NOW, 0.0)
    for key in KEYS:
        decide(a, key)
    moved = owned_by(v2, "n1")
    a.apply(v2, v1, (), NOW, 0.0)
    (transfer,) = a.transfers(NOW)
    return v1, v2, moved, transfer


# --------------------------------------------------------------------------- fencing


def test_a_standalone_core_decides_every_key() -> None:
    c = core("n0")
    for key in KEYS:
        c.check_owner(key)
    assert c.epoch == 0


def test_a_key_is_decided_only_by_its_owner_under_the_newest_view() -> None:
    v = view(["n0", "n1"], 1)
    c = core("n0")
    assert c.apply(v, None, (), NOW, 0.0) == 0
    for key in KEYS:
        if v.owner_id(key) == "n0":
            c.check_owner(key)
        else:
            with pytest.raises(NotOwner) as caught:
                c.check_owner(key)
            assert (caught.value.owner, caught.value.epoch) == ("n1", 1)


def test_an_empty_ring_owns_nothing_and_an_older_view_is_ignored() -> None:
    c = core("n0")
    assert c.apply(view(["n0"], 2), None, (), NOW, 0.0) == 0
    assert c.apply(view(["n1"], 1), None, (), NOW, 0.0) is None
    assert c.epoch == 2
    c.apply(RingView.empty(3), None, (), NOW, 0.0)
    with pytest.raises(NotOwner) as caught:
        c.check_owner("user-1")
    assert caught.value.owner is None


def test_the_lease_is_checked_on_the_time_given() -> None:
    c = core("n0", lease=Lease(required=True))
    c.apply(view(["n0"], 1), None, (), NOW, 0.0)
    with pytest.raises(LeaseExpired):
        c.may_decide("user-1", 0.0)
    token = c.lease.offer(10.0)
    c.lease.grant(token, 5.0, 10.0)
    c.may_decide("user-1", 14.9)
    with pytest.raises(LeaseExpired):
        c.may_decide("user-1", 15.0)


# --------------------------------------------------------------------------- handoff


def test_a_view_takes_moved_states_out_at_once_and_transfers_them_with_a_final_mark() -> None:
    a, b = core("n0"), core("n1")
    v1, v2, moved, transfer = join_after_one_decision(a)
    assert not any(a.holds(k, (RULE,)) for k in moved)
    assert (transfer.to, transfer.epoch, transfer.final) == ("n1", 2, True)
    assert sorted(r[2] for r in transfer.records) == sorted(moved)
    assert transfer.payload()["from"] == "n0"
    # While it travels, a pull for those keys must wait for it.
    with pytest.raises(InFlight):
        a.serve_pull(moved[:1], "n1", 2, NOW)
    b.apply(v2, v1, (), NOW, 0.0)
    assert b.awaits("n0")
    received = b.receive("n0", 2, transfer.records, True, (), NOW)
    a.delivered(transfer)
    assert (received.taken, received.dropped, received.forwards) == (len(moved), 0, [])
    assert not b.awaits("n0")
    assert all(decide(b, k) == 2 for k in moved)
    assert a.stats.keys_sent == b.stats.keys_received == len(moved)
    assert a.in_flight == {}
    assert a.serve_pull(moved[:1], "n1", 2, NOW) == []  # landed: nothing to wait for


def test_in_flight_states_are_known_per_transfer_until_each_lands() -> None:
    """Two transfers to one member on their way at once (a second view before the
    first landed): a pull waits for a key of the one still travelling only. (The
    second carries copies of the first's states too: :meth:`ShardCore._flying_copies`.)"""
    v1, v2, v3 = view(["n0", "n2"], 1), view(["n0", "n1", "n2"], 2), view(["n1", "n2"], 3)
    a = core("n0")
    a.apply(v1, None, (), NOW, 0.0)
    for key in KEYS:
        if v1.owner_id(key) == "n0":
            decide(a, key)
    a.apply(v2, v1, (), NOW, 0.0)
    first = next(t for t in a.transfers(NOW) if t.to == "n1")
    one = first.records[0][2]
    with pytest.raises(InFlight):  # a pull now: the keys in flight are collected
        a.serve_pull([one], "n1", 2, NOW)
    a.apply(v3, v2, (), NOW, 0.0)  # n0 leaves: the rest of its keys
    second = next(t for t in a.transfers(NOW) if t.to == "n1")
    firsts = {r[2] for r in first.records}
    assert firsts <= {r[2] for r in second.records}
    two = next(r[2] for r in second.records if r[2] not in firsts)
    for key in (one, two):
        with pytest.raises(InFlight):
            a.serve_pull([key], "n1", 3, NOW)
    a.delivered(second)
    assert a.serve_pull([two], "n1", 3, NOW) == []
    with pytest.raises(InFlight):
        a.serve_pull([one], "n1", 3, NOW)
    a.abandon(first)
    assert "n1" not in a.in_flight and a.serve_pull([one], "n1", 3, NOW) == []


def test_a_transfer_that_partly_landed_keeps_the_rest_for_pulls() -> None:
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    a = core("n0")
    a.apply(v1, None, (), NOW, 0.0)
    for key in KEYS:
        decide(a, key)
    a.apply(v2, v1, (), NOW, 0.0)
    (transfer,) = a.transfers(NOW)
    done, rest = transfer.records[:3], transfer.records[3:]
    a.partly_delivered(transfer, done, rest, NOW)
    assert a.in_flight == {} and a.stats.keys_sent == 3
    assert a.serve_pull([done[0][2]], "n1", 2, NOW) == []  # landed at n1
    pulled = a.serve_pull([rest[0][2]], "n1", 2, NOW)  # kept in the outbox
    assert [r[2] for r in pulled] == [rest[0][2]]


def test_a_final_mark_that_arrives_before_its_view_is_remembered() -> None:
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    b = core("n1")
    b.receive("n0", 2, [], True, (), NOW)
    b.apply(v2, v1, (), NOW, 0.0)
    assert not b.awaits("n0")


def test_a_miss_pulls_from_the_previous_owner_once() -> None:
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    a, b = core("n0"), core("n1")
    a.apply(v1, None, (), NOW, 0.0)
    key = owned_by(v2, "n1")[0]
    decide(a, key)
    b.apply(v2, v1, (), NOW, 0.0)
    step = b.inherit(key, (RULE,), 1.0)
    assert step == Pull("n0", "http://n0:8000", key, 2, "n1")
    # The previous owner has not seen epoch 2 yet: the puller must wait.
    with pytest.raises(StaleEpoch):
        a.serve_pull([key], "n1", 2, NOW)
    a.apply(v2, v1, (), NOW, 0.0)
    (transfer,) = a.transfers(NOW)
    a.undelivered(transfer, NOW)  # failed: kept in the outbox for pulls
    records = a.serve_pull([key], "n1", 2, NOW)
    assert [r[2] for r in records] == [key]
    b.start_pull(step)
    b.take_pulled(records, NOW)
    b.pull_done(step)
    assert decide(b, key) == 2
    assert b.inherit(key, (RULE,), 1.0) is None  # never twice under one view
    assert b.stats.pulls == 1


def test_a_handoff_past_its_deadline_is_given_up_only_when_a_pull_fails() -> None:
    """Past the deadline the previous owner is still asked (its delivery may
    have failed while it holds the states for pulls); a pull it does not
    answer gives up on it, and its keys are decided on what is here."""
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    b = core("n1", handoff_wait=5.0)
    b.apply(v2, v1, (), NOW, 100.0)
    first, second = owned_by(v2, "n1")[:2]
    assert b.inherit(first, (RULE,), 104.0) == Pull("n0", "http://n0:8000", first, 2, "n1")
    late = b.inherit(first, (RULE,), 105.5)
    assert late == Pull("n0", "http://n0:8000", first, 2, "n1", late=True)
    assert late is not None and b.awaits("n0")
    b.start_pull(late)
    b.take_pulled([], NOW)  # it answered (nothing for that key): still waited for
    b.pull_done(late)
    assert b.awaits("n0")
    again = b.inherit(second, (RULE,), 106.0)
    assert isinstance(again, Pull) and again.late
    b.start_pull(again)
    b.pull_failed(again)  # no answer, past the deadline: given up
    b.pull_done(again)
    assert not b.awaits("n0")
    assert b.inherit(owned_by(v2, "n1")[2], (RULE,), 106.0) is None


def test_what_a_handoff_remembered_per_key_goes_once_it_has_settled() -> None:
    """The keys pulled (and referred) while a handoff into this node was under way
    matter only while some member's final mark is awaited: they stayed until the
    next view, however long the ring stayed as it was (every key first asked
    about in the handoff's window: 1,000 here, kept after its final mark came).
    Now they go when the last awaited mark comes, or the last awaited member is
    given up."""
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    keys = [k for k in (f"user-{i}" for i in range(3000)) if v2.owner_id(k) == "n1"][:1000]
    for give_up in (False, True):
        b = core("n1", handoff_wait=5.0)
        b.apply(v2, v1, (), NOW, 0.0)
        for key in keys:
            step = b.inherit(key, (RULE,), 1.0)
            assert isinstance(step, Pull)
            b.start_pull(step)
            b.take_pulled([], NOW)
            b.refer(step, ["n2"])  # (not awaited: no referral is kept)
            b.pull_done(step)
        assert len(b.pulled) == len(keys)
        b.referred["user-x"] = ("n0", frozenset())  # as a referral still unanswered
        if give_up:
            late = b.inherit("user-y", (RULE,), 6.0)
            assert isinstance(late, Pull) and late.late
            b.start_pull(late)
            b.pull_failed(late)
            b.pull_done(late)
        else:
            b.receive("n0", 2, [], True, (), NOW)
        assert not b.pending
        assert (len(b.pulled), len(b.referred)) == (0, 0), give_up


def test_a_failed_final_mark_is_owed_and_sent_with_what_is_left() -> None:
    """A final mark that did not land is sent again at the next transfers(),
    even once pulls have emptied the outbox: the receiver waits for it."""
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    a = core("n0")
    a.apply(v1, None, (), NOW, 0.0)
    key = owned_by(v2, "n1")[0]
    decide(a, key)
    a.apply(v2, v1, (), NOW, 0.0)
    (transfer,) = a.transfers(NOW)
    a.undelivered(transfer, NOW)
    assert a.owes_handoff() and a.undelivered_states() == 1
    assert [r[2] for r in a.serve_pull([key], "n1", 2, NOW)] == [key]
    assert a.owes_handoff() and a.undelivered_states() == 0
    (again,) = a.transfers(NOW)
    assert again.final and again.to == "n1" and again.records == []
    a.delivered(again)
    assert not a.owes_handoff() and a.transfers(NOW) == []


def test_a_key_owned_before_an_unsettled_handoff_is_pulled_from_its_first_owner() -> None:
    """n1 joined (epoch 2) and n0's handoff has not landed when n2 joins (epoch
    3). Under epoch 2 n1 owned the key already, but its state is with n0: n1
    pulls it from n0, not deciding it on nothing."""
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    v3 = view(["n0", "n1", "n2"], 3)
    b = core("n1")
    b.apply(v2, v1, (), NOW, 0.0)
    assert b.awaits("n0")
    b.apply(v3, v2, (), NOW, 0.0)
    key = next(k for k in owned_by(v2, "n1") if v3.owner_id(k) == "n1")
    assert b.inherit(key, (RULE,), 1.0) == Pull("n0", "http://n0:8000", key, 3, "n1")
    # Settled (n0's final mark came): the next view looks back one view only.
    b.receive("n0", 3, [], True, (), NOW)
    b.receive("n2", 3, [], True, (), NOW)
    v4 = view(["n0", "n1", "n2", "n3"], 4)
    b.apply(v4, v3, (), NOW, 0.0)
    assert b.sources == [v3]


def failed_handoff_then_a_join() -> tuple[ShardCore, ShardCore, ShardCore, RingView, RingView, str]:
    """n0 decided a key 5 times, then n1 joined (epoch 2) and n0's handoff to it
    failed; the key, n1's now, goes to n2 when n2 joins (epoch 3, not applied
    yet). The three cores, epochs 2 and 3's views, and the key."""
    v1, v2, v3 = view(["n0"], 1), view(["n0", "n1"], 2), view(["n0", "n1", "n2"], 3)
    a, b, c = core("n0"), core("n1"), core("n2")
    a.apply(v1, None, (), NOW, 0.0)
    key = next(k for k in KEYS if v2.owner_id(k) == "n1" and v3.owner_id(k) == "n2")
    for _ in range(5):
        decide(a, key)
    a.apply(v2, v1, (), NOW, 0.0)
    (failed,) = a.transfers(NOW)
    a.undelivered(failed, NOW)
    b.apply(v2, v1, (), NOW, 0.0)
    return a, b, c, v2, v3, key


def test_a_key_that_moved_on_before_its_handoff_landed_is_pulled_where_it_is() -> None:
    """n0's handoff to n1 (epoch 2) failed; n2 joins (epoch 3) and takes a key
    n1 never had: its state is in n0's outbox, now for n2. n2 asks n1, the key's
    previous owner, which has nothing but names n0, from which it still looked
    for that key; n2 pulls it there. Before, n1's empty answer ended the search
    and n2 decided the key on a fresh state (count 1, not 6)."""
    a, b, c, v2, v3, key = failed_handoff_then_a_join()
    for member in (a, b, c):
        member.apply(v3, v2, (), NOW, 0.0)
    (travelling,) = [t for t in a.transfers(NOW) if t.to == "n2"]
    assert [r[2] for r in travelling.records] == [key]
    step = c.inherit(key, (RULE,), 1.0)
    assert step == Pull("n1", "http://n1:8000", key, 3, "n2")
    assert b.serve_pull([key], "n2", 3, NOW) == []
    assert b.earlier_owners([key]) == ["n0"]
    c.start_pull(step)
    c.take_pulled([], NOW)
    c.refer(step, ["n0"])
    c.pull_done(step)
    again = c.inherit(key, (RULE,), 1.0)
    assert again == Pull("n0", "http://n0:8000", key, 3, "n2")
    with pytest.raises(InFlight):  # on its way to n2: wait for it
        a.serve_pull([key], "n2", 3, NOW)
    a.undelivered(travelling, NOW)  # failed again: back in the outbox for pulls
    assert again is not None
    c.start_pull(again)
    c.take_pulled(a.serve_pull([key], "n2", 3, NOW), NOW)
    c.pull_done(again)
    assert c.inherit(key, (RULE,), 1.0) is None
    assert decide(c, key) == 6


def test_a_redelivery_in_flight_when_the_key_moves_on_goes_with_the_final_mark() -> None:
    """n0's handoff to n1 failed and its redelivery is on its way (epoch 2) when
    n2 joins (epoch 3) and takes the key. n0's states for n2 at that moment did
    not include it (it is in flight to n1), so its final mark to n2 said
    nothing more comes, and n2 decided the key on a fresh state (count 1, not
    6); the redelivery then landed at n1, which passed it on to n2, merged
    after the decisions. A copy of the state in flight now goes to n2 with the
    final mark, and the flight's landing, passed on, is merged: never twice."""
    a, b, c, v2, v3, key = failed_handoff_then_a_join()
    (redelivery,) = a.transfers(NOW)  # the background redelivery, on its way
    assert [r[2] for r in redelivery.records] == [key]
    for member in (a, b, c):
        member.apply(v3, v2, (), NOW, 0.0)
    for transfer in a.transfers(NOW) + b.transfers(NOW):
        if transfer.to == "n2":
            c.receive(transfer.sender, transfer.epoch, transfer.records, transfer.final, (), NOW)
    assert c.pending == {}
    assert decide(c, key) == 6
    # The flight lands at n1 after all, which passes the state on to n2: merged.
    landed = b.receive("n0", 2, redelivery.records, True, (), NOW)
    a.delivered(redelivery)
    (forward,) = landed.forwards
    c.receive(forward.sender, forward.epoch, forward.records, forward.final, (), NOW)
    assert decide(c, key) == 7


def test_a_state_in_flight_to_a_member_that_lost_it_comes_back_to_its_new_owner() -> None:
    """n0's redelivery to n1 is on its way when n1 leaves (epoch 3) and the key
    is n0's again: n0 decides it from a copy of the state in flight, not fresh
    (count 6, not 1); the flight, landed and passed back, is merged."""
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    v3 = view(["n0"], 3)
    a = core("n0")
    a.apply(v1, None, (), NOW, 0.0)
    key = next(k for k in KEYS if v2.owner_id(k) == "n1")
    for _ in range(5):
        decide(a, key)
    a.apply(v2, v1, (), NOW, 0.0)
    (flight,) = a.transfers(NOW)  # on its way to n1
    a.apply(v3, v2, (), NOW, 0.0)
    assert a.holds(key, (RULE,))
    assert decide(a, key) == 6
    a.delivered(flight)
    a.receive("n1", 2, flight.records, False, (), NOW)  # passed back by n1: merged
    assert decide(a, key) == 7


LIMITED = Rule("api", 5, 3600.0, algorithm="fixed_window")


def spent_then_joined(a: ShardCore, b: ShardCore, owner_after: str) -> tuple[RingView, str]:
    """n0 (``a``) alone spends 5 of :data:`LIMITED` for a key that n1's join
    (epoch 2, which ``a`` and ``b`` apply) takes, and that ``owner_after``
    owns once n2 joins too (epoch 3, returned with the key)."""
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    v3 = view(["n0", "n1", "n2"], 3)
    a.apply(v1, None, (), NOW, 0.0)
    key = next(k for k in KEYS if v2.owner_id(k) == "n1" and v3.owner_id(k) == owner_after)
    for _ in range(5):
        decide(a, key, rule=LIMITED)
    a.apply(v2, v1, (), NOW, 0.0)
    b.apply(v2, v1, (), NOW, 0.0)
    return v3, key


def carry(senders: list[ShardCore], cores: dict[str, ShardCore]) -> None:
    """Each sender's transfers, received by their members."""
    for sender in senders:
        for t in sender.transfers(NOW):
            cores[t.to].receive(t.sender, t.epoch, t.records, t.final, (), NOW)
            sender.delivered(t)


def test_a_flight_to_a_member_that_keeps_its_keys_goes_again_with_the_next_mark() -> None:
    """n0's delivery to n1 (epoch 2) is on its way when n2 joins (epoch 3) and n1
    keeps the key. n0's epoch-3 final mark to n1, a POST of its own, may land
    first: it carries a copy of the state in flight, so n1, no longer waiting
    for n0, decides the key from it (denied: 5 of 5 spent), not fresh. Before,
    only keys whose owner changed were copied, and n1 admitted 5 more before
    the flight landed (an independent review). The flight's landing is merged."""
    cfg = config(rule=LIMITED)
    a, b = core("n0", cfg), core("n1", cfg)
    v3, key = spent_then_joined(a, b, "n1")
    v2 = a.view
    assert v2 is not None
    (flight,) = a.transfers(NOW)  # on its way to n1
    a.apply(v3, v2, (), NOW, 0.0)
    b.apply(v3, v2, (), NOW, 0.0)
    (mark,) = [t for t in a.transfers(NOW) if t.to == "n1"]
    assert mark.final and [r[2] for r in mark.records] == [key]
    b.receive(mark.sender, mark.epoch, mark.records, mark.final, (), NOW)
    assert not b.awaits("n0") and b.inherit(key, (LIMITED,), 1.0) is None
    assert not b.store.check(key, (LIMITED,), NOW).allowed
    # The flight is copied: its failure would put nothing back in the outbox.
    assert any(records is flight.records for records in a.copied)
    b.receive(flight.sender, flight.epoch, flight.records, flight.final, (), NOW)
    a.delivered(flight)
    assert not a.copied
    assert not b.store.check(key, (LIMITED,), NOW).allowed


def test_a_member_that_left_refuses_a_late_transfer_and_its_sender_keeps_it() -> None:
    """n0's redelivery to n1 (epoch 2) reaches n1 after n1 left (epoch 3: the
    leaver gets its view first). n1 no longer hands anything off, so it
    refuses the transfer; n0 keeps the state, and its epoch-3 final mark takes
    it to the key's new owner, which denies the user at 5 of 5. Before, n1 took
    it into its store for good, n0 counted it delivered, and the new owner
    admitted 5 more (an independent review)."""
    cfg = config(rule=LIMITED)
    v1, v2, v3 = view(["n0", "n2"], 1), view(["n0", "n1", "n2"], 2), view(["n0", "n2"], 3)
    cores = {i: core(i, cfg) for i in ("n0", "n1", "n2")}
    a, b, c = cores["n0"], cores["n1"], cores["n2"]
    a.apply(v1, None, (), NOW, 0.0)
    c.apply(v1, None, (), NOW, 0.0)
    key = next(k for k in KEYS if v1.owner_id(k) == "n0" and v2.owner_id(k) == "n1")
    for _ in range(5):
        decide(a, key, rule=LIMITED)
    for member in (a, b, c):
        member.apply(v2, v1, (), NOW, 0.0)
    (first,) = [t for t in a.transfers(NOW) if t.to == "n1"]
    a.undelivered(first, NOW)  # a hiccup: kept, sent again in the background
    (redelivery,) = [t for t in a.transfers(NOW) if t.to == "n1"]
    b.apply(v3, v2, (), NOW, 0.0)  # the leaver first
    carry([b], cores)
    with pytest.raises(NoLongerMember):
        b.receive("n0", 2, redelivery.records, True, (), NOW)
    a.undelivered(redelivery, NOW)  # refused: back in n0's outbox
    assert not b.holds(key, (LIMITED,))
    for member in (a, c):
        member.apply(v3, v2, (), NOW, 0.0)
    carry([a, c], cores)
    owner = cores[v3.owner_id(key)]
    assert owner.pending == {} and owner.holds(key, (LIMITED,))
    assert not owner.store.check(key, (LIMITED,), NOW).allowed


def test_a_state_passed_on_is_in_flight_and_goes_with_the_next_mark() -> None:
    """n0 passes a late hand-back's state on to its owner n1 (epoch 2, no final
    mark). n1 leaves (epoch 3) before it lands and refuses it then. The state
    was in flight at n0's view change, so n0's epoch-3 final mark to the key's
    new owner n2 carries a copy: n2 denies the user at 5 of 5. Before, forwards
    were not known as in flight, the refusal put the state back in n0's outbox
    after its marks had gone, and n2 admitted the user again (an independent
    review)."""
    cfg = config(rule=LIMITED)
    v1 = view(["n0", "n1", "n2", "n3"], 1)
    v2, v3 = view(["n0", "n1", "n2"], 2), view(["n0", "n2"], 3)
    key = next(
        k
        for k in (f"u{i}" for i in range(400))
        if v1.owner_id(k) == "n3" and v2.owner_id(k) == "n1" and v3.owner_id(k) == "n2"
    )
    n3 = core("n3", cfg)
    n3.apply(v1, None, (), NOW, 0.0)
    for _ in range(5):
        decide(n3, key, rule=LIMITED)
    late = n3.store.export(NOW)  # n3's hand-back, of epoch 1
    cores = {i: core(i, cfg) for i in ("n0", "n1", "n2")}
    a, b, c = cores["n0"], cores["n1"], cores["n2"]
    for member in cores.values():
        member.apply(v2, v1, (), NOW, 0.0)
    carry(list(cores.values()), cores)
    (forward,) = a.receive("n3", 1, late, True, (), NOW).forwards
    assert forward.to == "n1" and not forward.final
    with pytest.raises(InFlight):
        a.serve_pull([key], "n1", 2, NOW)
    for member in (b, a, c):  # n1 leaves: the leaver first
        member.apply(v3, v2, (), NOW, 0.0)
    carry([b, a], cores)
    with pytest.raises(NoLongerMember):
        b.receive(forward.sender, forward.epoch, forward.records, False, (), NOW)
    a.undelivered(forward, NOW)
    assert c.pending == {} and a.outbox.get("n2", []) == [] and not a.in_flight
    assert not c.store.check(key, (LIMITED,), NOW).allowed


def test_a_state_back_from_the_outbox_does_not_spare_the_pull_of_a_newer_one() -> None:
    """n0's handoff to n1 landed, but its answer was lost: n0 keeps the states
    in its outbox (at 2 of 5), while n1 decides the user to 5 of 5. n1 leaves,
    and the key is n0's again: n0 takes the outbox's copy back into its store,
    yet still pulls the key from n1 (whose final mark it awaits) rather than
    decide on the copy, which missed n1's decisions. Before, holding the copy
    was enough, and n0 admitted 3 more (the first review's suspicion, here
    reproduced)."""
    cfg = config(rule=LIMITED)
    v1, v2, v3 = view(["n0"], 1), view(["n0", "n1"], 2), view(["n0"], 3)
    a, b = core("n0", cfg), core("n1", cfg)
    a.apply(v1, None, (), NOW, 0.0)
    key = next(k for k in KEYS if v2.owner_id(k) == "n1")
    for _ in range(2):
        decide(a, key, rule=LIMITED)
    a.apply(v2, v1, (), NOW, 0.0)
    b.apply(v2, v1, (), NOW, 0.0)
    (handoff,) = a.transfers(NOW)
    b.receive(handoff.sender, handoff.epoch, handoff.records, handoff.final, (), NOW)
    a.undelivered(handoff, NOW)  # it landed; its answer did not
    for _ in range(3):
        decide(b, key, rule=LIMITED)
    b.apply(v3, v2, (), NOW, 0.0)  # the leaver first
    (leaving,) = b.transfers(NOW)  # on its way to n0
    a.apply(v3, v2, (), NOW, 0.0)
    assert a.holds(key, (LIMITED,)) and a.awaits("n1")
    pull = a.inherit(key, (LIMITED,), 1.0)
    assert isinstance(pull, Pull) and pull.owner == "n1"
    with pytest.raises(InFlight):
        b.serve_pull([key], "n0", 3, NOW)
    a.receive(leaving.sender, leaving.epoch, leaving.records, leaving.final, (), NOW)
    assert not a.store.check(key, (LIMITED,), NOW).allowed


def test_a_pull_answered_after_the_key_moved_on_goes_with_the_final_mark() -> None:
    """n1 pulls a key from n0 under epoch 2 (n0's handoff failed); n0 gives the
    state up, and before the answer arrives n2 joins (epoch 3) and takes the
    key. The answer's state goes to n2 in n1's epoch-3 final mark (the driver
    holds the marks until its pulls end), not into n1's store, where it stayed
    while n2 admitted 5 more for a user at 5 of 5 (an independent review)."""
    cfg = config(rule=LIMITED)
    cores = {i: core(i, cfg) for i in ("n0", "n1", "n2")}
    a, b, c = cores["n0"], cores["n1"], cores["n2"]
    v3, key = spent_then_joined(a, b, "n2")
    v2 = a.view
    assert v2 is not None
    (handoff,) = a.transfers(NOW)
    a.undelivered(handoff, NOW)  # kept for pulls
    pull = b.inherit(key, (LIMITED,), 1.0)
    assert isinstance(pull, Pull) and pull.owner == "n0"
    answer = a.serve_pull([key], "n1", 2, NOW)
    assert [r[2] for r in answer] == [key]
    for member in (a, b, c):
        member.apply(v3, v2, (), NOW, 0.0)
    assert b.take_pulled(answer, NOW, pull.epoch)  # for n2 now
    b.pull_done(pull)
    assert not b.holds(key, (LIMITED,))
    carry([a, b], cores)
    assert c.pending == {} and c.holds(key, (LIMITED,))
    assert not c.store.check(key, (LIMITED,), NOW).allowed


def test_a_streamed_handoff_brings_a_keys_states_under_every_rule_together() -> None:
    """A handoff is exported rule by rule and sent in chunks: sliced in order,
    one key's state under one rule landed in a chunk before its state under
    the other, and the new owner, holding a state of the key, decided it with
    the other rule fresh: a user at 5 of 5 per day was admitted 5 more while
    the next chunk travelled (an independent review). Each key's states now
    travel in one chunk."""
    per_second = Rule("per_second", 10, 1.0, algorithm="fixed_window")
    per_day = Rule("per_day", 5, 86400.0, algorithm="fixed_window")
    fixed = ClusterConfig(
        rules=(ScopedRule(per_second), ScopedRule(per_day)),
        policies=Policies(rebalance="handoff", crash="replica"),
    )
    rules = (per_second, per_day)
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    a, b = core("n0", fixed), core("n1", fixed)
    a.apply(v1, None, (), NOW, 0.0)
    moving = [k for k in (f"u{i}" for i in range(200)) if v2.owner_id(k) == "n1"]
    for k in moving:  # many users on the per-second rule alone
        assert a.store.check(k, (per_second,), NOW).allowed
    spent = moving[:5]
    for k in spent:
        for _ in range(5):
            assert a.store.check(k, rules, NOW).allowed
    a.apply(v2, v1, (), NOW, 0.0)
    b.apply(v2, v1, (), NOW, 0.0)
    (transfer,) = a.transfers(NOW)
    sent: dict[str, set[str]] = {}
    for record in transfer.records:
        sent.setdefault(record[2], set()).add(record[0])
    chunks = transfer.chunks(len(moving) // 2)
    assert len(chunks) > 1
    by_name = {rule.name: rule for rule in rules}
    for chunk in chunks:
        b.receive(chunk.sender, chunk.epoch, chunk.records, chunk.final, (), NOW)
        for k in {r[2] for r in chunk.records}:
            assert all(b.store.get(by_name[name], k) is not None for name in sent[k]), k
            if k in spent:
                assert b.inherit(k, rules, 1.0) is None
                assert not b.store.check(k, rules, NOW + 2).allowed
    assert sorted(r for c in chunks for r in c.records) == sorted(transfer.records)
    single = Transfer(
        "n0", "n1", "u", 2, [r for r in transfer.records if r[0] == "per_second"], True
    )
    assert single.chunks(10)[0].records == single.records[:10]  # sliced in order


def test_a_flight_is_copied_once_however_many_views_come_before_it_lands() -> None:
    """Each view's change copies the states in flight into its final marks
    (:meth:`ShardCore._flying_copies`); a flight copied once is in its copy's
    flight, so later views copy only that (an independent review: copied again,
    four joins with nothing landing sent 10k, 13k, 25k, 50k states)."""
    a = core("n0")
    views = [view(IDS[: n + 1], n + 1) for n in range(4)]
    a.apply(views[0], None, (), NOW, 0.0)
    for key in KEYS:
        decide(a, key)
    sent: list[int] = []
    for previous, current in itertools.pairwise(views):
        a.apply(current, previous, (), NOW, 0.0)
        sent.append(sum(len(t.records) for t in a.transfers(NOW)))  # none lands
    assert sent[0] > 0 and all(n <= len(KEYS) for n in sent), sent


def test_a_crash_folded_into_a_leave_sends_every_state_in_flight_with_the_mark() -> None:
    """n1 leaves (epoch 4) while n2 is paused: its transfers to n0 and to n2 are
    on their way when n2's removal is folded into the leave (epoch 5, from the
    same previous view: router/viewlog.py ``fold_crashes``). n1's transfer of
    epoch 5 to n0 carries copies of both flights (the one to n2, whose keys are
    n0's now, and the one to n0, which may not have landed), with its final
    mark: n0, waiting for n1 under epoch 5, decides every key from n1's states
    (before, the flight to n2 stayed with n1, and n0 decided its keys fresh)."""
    v3 = view(["n0", "n1", "n2"], 3)
    v4, v5 = view(["n0", "n2"], 4), view(["n0"], 5)
    a, b = core("n0"), core("n1")
    a.apply(v3, None, (), NOW, 0.0)
    b.apply(v3, None, (), NOW, 0.0)
    mine = owned_by(v3, "n1")
    for key in mine:
        for _ in range(5):
            decide(b, key)
    b.apply(v4, v3, (), NOW, 0.0)
    flights = b.transfers(NOW)  # to n0 and to the paused n2, never landing
    assert {t.to for t in flights} == {"n0", "n2"} and all(t.records for t in flights)
    a.apply(v5, v3, ("n2",), NOW, 0.0)
    assert a.pending.keys() == {"n1"}
    b.apply(v5, v3, ("n2",), NOW, 0.0)
    (transfer,) = b.transfers(NOW)
    assert transfer.to == "n0" and transfer.final and transfer.epoch == 5
    assert sorted(r[2] for r in transfer.records) == sorted(mine)
    a.receive("n1", 5, transfer.records, True, (), NOW)
    assert a.pending == {}
    for key in mine:
        assert decide(a, key) == 6
    # The flight to n0 lands after all: merged, never counted twice.
    (to_a,) = [t for t in flights if t.to == "n0"]
    a.receive("n1", 4, to_a.records, True, (), NOW)
    assert all(decide(a, key) == 7 for key in owned_by(v4, "n0") if key in mine)


def test_a_crash_folded_into_a_leave_covers_what_the_leave_already_brought_it() -> None:
    """n1's leave (epoch 4) brought some of its keys to n2, and n2 took them; its
    transfer to n0 was still on its way when n2, paused, was folded into the
    leave (epoch 5, from epoch 3: router/viewlog.py ``fold_crashes``). The keys
    that landed at n2 are no longer in flight to copy, and under epoch 3 they
    were n1's, not n2's: a conservative rule's new owner decided them fresh
    (an independent review: 10 of 10 exhausted users admitted again). The crash
    is also remembered under the view n1 left by, and sent with its final mark:
    they start exhausted, as when the crash was removed after the leave."""
    rule = Rule("api", 5, 3600.0, algorithm="fixed_window")
    cfg = config(crash="conservative", rule=rule)
    v3, v4, v5 = view(["n0", "n1", "n2"], 3), view(["n0", "n2"], 4), view(["n0"], 5)
    a, b, c = core("n0", cfg), core("n1", cfg), core("n2", cfg)
    for member in (a, b, c):
        member.apply(v3, None, (), NOW, 0.0)
    for key in owned_by(v3, "n1"):
        for _ in range(5):
            decide(b, key, rule=rule)
    b.apply(v4, v3, (), NOW, 0.0)  # n1 leaves
    flights = b.transfers(NOW)
    (to_c,) = [t for t in flights if t.to == "n2"]
    c.receive("n1", 4, to_c.records, True, (), NOW)  # landed at n2, which then pauses
    b.delivered(to_c)
    landed = [r[2] for r in to_c.records]
    assert landed
    a.apply(v5, v3, ("n2",), NOW, 0.0)
    b.apply(v5, v3, ("n2",), NOW, 0.0)  # the fold
    for transfer in b.transfers(NOW):
        a.receive("n1", transfer.epoch, transfer.records, transfer.final, transfer.crashes, NOW)
    assert a.pending == {}
    for key in landed:
        assert a.inherit(key, (rule,), 10.0) is None
        a.conservative(key, (rule,), NOW)
        assert not a.store.check(key, (rule,), NOW).allowed, key


def test_only_a_view_that_skips_the_leave_is_taken_for_a_fold() -> None:
    """A node that left (epoch 4) and is sent a later view built on the one it
    left by (a crash after its leave, not folded into it) copies only what moved
    and remembers that crash once, under the view it is given as previous."""
    rule = Rule("api", 5, 3600.0, algorithm="fixed_window")
    cfg = config(crash="conservative", rule=rule)
    v3, v4, v5 = view(["n0", "n1", "n2"], 3), view(["n0", "n2"], 4), view(["n0"], 5)
    b = core("n1", cfg)
    b.apply(v3, None, (), NOW, 0.0)
    b.apply(v4, v3, (), NOW, 0.0)
    b.apply(v5, v4, ("n2",), NOW, 0.0)
    assert [(c.view.epoch, c.crashed) for c in b.crashes] == [(4, frozenset({"n2"}))]


def test_a_folded_leaves_old_flight_failing_owes_nothing_more() -> None:
    """The leave's flight to the paused n2 fails for good while the folded view's
    delivery runs: its states were copied into that delivery already, and put
    back in the outbox as well they made the leaving node's push answer 503
    handoff_incomplete (an independent review: 0 states undelivered became 10),
    which the router takes for a crash of a node whose states all landed."""
    v3, v4, v5 = view(["n0", "n1", "n2"], 3), view(["n0", "n2"], 4), view(["n0"], 5)
    b = core("n1")
    b.apply(v3, None, (), NOW, 0.0)
    for key in owned_by(v3, "n1"):
        decide(b, key)
    b.apply(v4, v3, (), NOW, 0.0)
    old = b.transfers(NOW)
    b.apply(v5, v3, ("n2",), NOW, 0.0)
    new = b.transfers(NOW)
    b.undelivered(next(t for t in old if t.to == "n2"), NOW)  # its third try timed out
    for transfer in new:
        b.delivered(transfer)
    assert b.undelivered_states() == 0
    assert b.copied == [t.records for t in old if t.to == "n0"]  # landing is forgotten
    b.delivered(next(t for t in old if t.to == "n0"))
    assert b.copied == [] and b.in_flight == {}


def test_a_crash_folded_into_a_leave_gets_the_leavers_replicas_of_its_keys() -> None:
    """n2 leaves (epoch 4) while n3, whose keys n2 holds replicas of, pauses; n3's
    removal is folded into the leave (epoch 5, from epoch 3). n2 let its
    replicas go at the leave, and the users whose only copy it held started
    afresh on their new owner (an exploratory tester, default crash policy:
    8 of 26 users of the paused node admitted a second quota). It keeps them
    through its leave, and sends them to the new owners with its final marks."""
    v3 = view(["n0", "n1", "n2", "n3"], 3)
    v4, v5 = view(["n0", "n1", "n3"], 4), view(["n0", "n1"], 5)
    cores = {i: core(i) for i in ("n0", "n1", "n2", "n3")}
    for c in cores.values():
        c.apply(v3, None, (), NOW, 0.0)
    keys = [k for k in owned_by(v3, "n3") if v3.successors(k, 2)[1].id == "n2"]
    assert keys
    for key in keys:
        decide(cores["n3"], key)
    for batch in cores["n3"].replica_batches(NOW):
        cores[batch.to].receive_replicas("n3", batch.records, NOW)
    leaver = cores["n2"]
    leaver.apply(v4, v3, (), NOW, 0.0)  # the leave
    leaver.transfers(NOW)  # (its own states on their way)
    leaver.apply(v5, v3, ("n3",), NOW, 0.0)  # the fold
    for i in ("n0", "n1"):
        cores[i].apply(v5, v3, ("n3",), NOW, 0.0)
    for transfer in leaver.transfers(NOW):
        cores[transfer.to].receive(
            "n2", transfer.epoch, transfer.records, transfer.final, transfer.crashes, NOW
        )
    for key in keys:
        owner = cores[v5.owner_id(key)]
        assert owner.inherit(key, (RULE,), 10.0) is None
        assert decide(owner, key) == 2, key  # the replica's 1, not a fresh quota


def test_replicas_kept_through_a_leave_are_dropped_when_the_node_rejoins() -> None:
    """Kept for a fold while the node is out, they are of that time once it is
    back: the origins replicate to it afresh (every state is dirty on a view
    change), and a stale copy promoted later would be a wrong state."""
    v1, v2, v3 = view(["n0", "n1"], 1), view(["n0"], 2), view(["n0", "n1"], 3)
    a, b = core("n0"), core("n1")
    for c in (a, b):
        c.apply(v1, None, (), NOW, 0.0)
    for key in owned_by(v1, "n0"):
        decide(a, key)
    (batch,) = a.replica_batches(NOW)
    b.receive_replicas("n0", batch.records, NOW)
    b.apply(v2, v1, (), NOW, 0.0)  # n1 leaves
    assert "n0" in b.replicas  # kept through the leave
    b.apply(v3, v2, (), NOW, 0.0)  # n1 back
    assert b.replicas == {} and b.replica_seen == {}


def test_a_crashed_members_key_waits_for_the_replicas_of_its_holders() -> None:
    """n0 dies during n1's join and is removed as crashed (epoch 3): a key of
    n0's that n1 owns now comes from n0's replica holder's final transfer."""
    v1, v2 = view(["n0", "n2"], 1), view(["n0", "n1", "n2"], 2)
    v3 = view(["n1", "n2"], 3)
    b = core("n1")
    b.apply(v2, v1, (), NOW, 0.0)
    b.receive("n2", 2, [], True, (), NOW)
    assert b.pending.keys() == {"n0"}
    b.apply(v3, v2, ("n0",), NOW, 0.0)
    key = next(k for k in owned_by(v3, "n1") if v1.owner_id(k) == "n0")
    assert b.inherit(key, (RULE,), 1.0) == AwaitHandoffs(key)
    assert b.inherit(key, (RULE,), 6.0) is None  # past every deadline
    b.receive("n2", 3, [], True, (), NOW)
    assert b.inherit(key, (RULE,), 1.0) is None  # nobody awaited any more


def test_a_late_transfer_from_an_older_view_is_passed_on() -> None:
    v2, v3 = view(["n0", "n1"], 2), view(["n0", "n1", "n2"], 3)
    b = core("n1")
    b.apply(v3, v2, (), NOW, 0.0)
    lost = [k for k in KEYS if v3.owner_id(k) == "n2"]
    mine = [k for k in KEYS if v3.owner_id(k) == "n1"]
    source = core("n0")
    for key in lost + mine:
        decide(source, key)
    records = source.store.export(NOW)
    received = b.receive("n0", 2, records, False, (), NOW)
    assert received.taken == len(mine)
    (forward,) = received.forwards
    assert (forward.to, forward.final, forward.epoch) == ("n2", False, 3)
    assert sorted(r[2] for r in forward.records) == sorted(lost)


def test_reset_rebalancing_drops_what_moved() -> None:
    v1, v2 = view(["n0"], 1), view(["n0", "n1"], 2)
    a = core("n0", config(rebalance="reset"))
    a.apply(v1, None, (), NOW, 0.0)
    for key in KEYS:
        decide(a, key)
    a.apply(v2, v1, (), NOW, 0.0)
    assert a.stats.keys_dropped == len(owned_by(v2, "n1"))
    assert [t.records for t in a.transfers(NOW)] == [[]]  # only the final mark


# --------------------------------------------------------------------------- crashes


def test_a_crashed_members_keys_start_exhausted_under_the_conservative_policy() -> None:
    rule = Rule("api", 10, 60.0, algorithm="sliding_window")
    cfg = config(crash="conservative", rule=rule)
    v1, v2 = view(["n0", "n1"], 1), view(["n0"], 2)
    a = core("n0", cfg)
    a.apply(v1, None, (), NOW, 0.0)
    a.apply(v2, v1, ["n1"], NOW, 0.0)
    assert a.pending == {}  # a crashed member is not waited for
    key = owned_by(v1, "n1")[0]
    a.conservative(key, (rule,), NOW + 1)
    assert not a.store.check(key, (rule,), NOW + 1).allowed
    (crash,) = a.crashes
    # It ends when the exhausted state is fresh again (two periods: sliding window).
    assert crash.until == NOW + 120.0
    # New owners learn of it with the states they get.
    a.apply(view(["n0", "n2"], 3), v2, (), NOW + 1, 0.0)
    (transfer,) = a.transfers(NOW + 1)
    assert transfer.crashes == (crash,)
    assert transfer.payload()["crashes"] == [crash.to_wire(NOW + 1)]


def test_replicas_go_to_the_successor_and_are_promoted_when_the_owner_crashes() -> None:
    v1, v2 = view(["n0", "n1"], 1), view(["n1"], 2)
    a, b = core("n0"), core("n1")
    for c in (a, b):
        c.apply(v1, None, (), NOW, 0.0)
    keys = owned_by(v1, "n0")
    for key in keys:
        decide(a, key)
    (batch,) = a.replica_batches(NOW)
    assert batch.to == "n1" and sorted(r[2] for r in batch.records) == sorted(keys)
    assert b.receive_replicas("n0", batch.records, NOW) == len(keys)
    assert a.replica_batches(NOW) == []  # nothing changed since
    b.apply(v2, v1, ["n0"], NOW, 0.0)
    assert b.stats.replicas_promoted == len(keys)
    assert all(decide(b, k) == 2 for k in keys)


def test_a_replica_round_that_arrives_after_a_newer_one_is_dropped() -> None:
    """Round 1's batch timed out at the sender (its keys went again in round 2)
    and reached the successor after round 2: applied, it put older states over
    newer ones, and a crash of the origin promoted them."""
    v1 = view(["n0", "n1"], 1)
    a = core("n0", incarnation=7)
    b = core("n1")
    for c in (a, b):
        c.apply(v1, None, (), NOW, 0.0)
    key = owned_by(v1, "n0")[0]
    decide(a, key)
    (old,) = a.replica_batches(NOW)
    a.replicas_failed(old.records)  # timed out: sent again in the next round
    decide(a, key)
    (new,) = a.replica_batches(NOW)
    assert (old.round, new.round) == ((7, 1), (7, 2))
    assert new.payload()["round"] == [7, 2]
    assert b.receive_replicas("n0", new.records, NOW, new.round) == 1
    assert b.receive_replicas("n0", old.records, NOW, old.round) == 0  # late: dropped
    assert b.stats.replicas_stale == 1
    assert b.replicas["n0"].get(RULE, key) == a.store.get(RULE, key)  # the newer copy
    # A restarted origin (another incarnation) numbers its rounds afresh.
    restarted = core("n0", incarnation=8)
    restarted.apply(v1, None, (), NOW, 0.0)
    decide(restarted, key)
    (first,) = restarted.replica_batches(NOW)
    assert first.round == (8, 1)
    assert b.receive_replicas("n0", first.records, NOW, first.round) == 1


@pytest.mark.parametrize("crash", ["replica", "conservative"])
def test_a_joiner_that_crashes_before_it_replicated_gives_no_fresh_quota(crash: str) -> None:
    """The joiner defers replicating what it was handed while its view settles;
    the sender keeps those states as the joiner's replicas, so a crash of the
    joiner right after the join starts nobody over (a whole quota, before)."""
    a, b = core("n0", config(crash)), core("n1", config(crash))
    _, v2, moved, transfer = join_after_one_decision(a)
    v3 = view(["n0"], 3)
    b.receive("n0", 2, transfer.records, True, (), NOW)  # b's view is still settling
    a.delivered(transfer)
    assert not any(a.holds(k, (RULE,)) for k in moved)
    assert b.replica_batches(NOW) == []  # nothing replicated from b yet
    if crash == "replica":
        assert sorted(a.replicas["n1"].keys()) == sorted(moved)
    else:
        assert a.replicas == {}  # no replication, no copies: the crash is remembered
    a.apply(v3, v2, ["n1"], NOW, 0.0)
    for key in moved:
        if crash == "replica":
            assert decide(a, key) == 2  # the one decision before the join counts
        else:
            a.conservative(key, (RULE,), NOW)  # what admitting the key does
            assert a.store.check(key, (RULE,), NOW).allowed is False  # starts exhausted


def test_kept_copies_never_overwrite_a_newer_replica() -> None:
    """Leftovers of a failed handoff sit in the outbox; a later view change keeps
    them as copies too. Merged with what their owner replicated since (the more
    restrictive wins), they never undo its decisions (replaced, they did: 2
    counted of 6 after the owner's crash)."""
    a, b = core("n0"), core("n1")
    v1, v2, moved, transfer = join_after_one_decision(a)
    v3, v4 = view(["n0", "n1", "n2"], 3), view(["n0", "n2"], 4)
    a.undelivered(transfer, NOW)  # the push failed: its records stay in the outbox
    b.apply(v2, v1, (), NOW, 0.0)
    for key in moved:  # past its handoff deadline, n1 decides on fresh states
        for _ in range(5):
            decide(b, key)
    for batch in b.replica_batches(NOW):
        a.receive_replicas("n1", batch.records, NOW)
    a.apply(v3, v2, (), NOW, 0.0)  # n2 joins: the leftovers are kept as copies again
    a.apply(v4, v3, ["n1"], NOW, 0.0)  # n1 crashes before its next round
    taken_back = [k for k in moved if v4.owner_id(k) == "n0"]
    assert taken_back
    assert all(decide(a, k) == 6 for k in taken_back)


def test_replicas_held_are_capped_at_the_stores_max_keys() -> None:
    """A node capped at --max-keys held its peers' replicas without any cap (a
    soak tester's finding). Now every origin's replicas together stay within
    the cap: copies of new keys past it are dropped and counted, those held are
    kept up to date, and a crash of the owner promotes what is held; the
    dropped keys start over at their new owner (as under ``reset``)."""
    v1, v2 = view(["n0", "n1", "n2"], 1), view(["n1", "n2"], 2)
    a, c = core("n0"), core("n2")
    for origin in (a, c):
        origin.apply(v1, None, (), NOW, 0.0)
        for key in owned_by(v1, origin.id):
            decide(origin, key)
    (from_c,) = [batch for batch in c.replica_batches(NOW) if batch.to == "n1"]
    (from_a,) = [batch for batch in a.replica_batches(NOW) if batch.to == "n1"]
    # Room for n2's copies and one of n0's.
    cap = len(from_c.records) + 1
    b = ShardCore("n1", MemoryStore(max_keys=cap), lambda: config())
    b.apply(v1, None, (), NOW, 0.0)
    assert b.receive_replicas("n2", from_c.records, NOW) == cap - 1
    assert b.receive_replicas("n0", from_a.records, NOW) == 1
    assert sum(len(r) for r in b.replicas.values()) == cap
    assert b.stats.replicas_dropped == len(from_a.records) - 1
    held = b.replicas["n0"].keys()
    for key in owned_by(v1, "n0"):
        decide(a, key)  # a second decision: the copies held follow it
    for batch in a.replica_batches(NOW):
        if batch.to == "n1":
            b.receive_replicas("n0", batch.records, NOW)
    assert sum(len(r) for r in b.replicas.values()) == cap
    b.apply(v2, v1, ["n0"], NOW, 0.0)
    taken_over = [k for k in owned_by(v1, "n0") if v2.owner_id(k) == "n1"]
    counts = {key: decide(b, key) for key in taken_over}
    assert counts == {key: 3 if key in held else 1 for key in taken_over}
    assert set(counts.values()) == {1, 3}  # both held and dropped copies among them


def test_replicas_of_a_rule_no_longer_in_force_are_dropped_by_the_sweep() -> None:
    """The primary store keeps a departed rule's states for its return; a
    replica of one is never promoted (a crash takes the rules in force only),
    yet it was held until it refilled (an hour here). The sweep drops them."""
    rules = [config()]
    v1 = view(["n0", "n1"], 1)
    a = core("n0")
    b = ShardCore("n1", MemoryStore(), lambda: rules[0])
    for each in (a, b):
        each.apply(v1, None, (), NOW, 0.0)
    for key in owned_by(v1, "n0"):
        decide(a, key)
    (batch,) = a.replica_batches(NOW)
    assert b.receive_replicas("n0", batch.records, NOW) > 0
    rules[0] = config(rule=Rule("renamed", LIMIT, 3600.0, algorithm="fixed_window"))
    b.sweep_replicas(NOW + 1)
    assert len(b.replicas["n0"]) == 0


@pytest.mark.parametrize("on_error", ["open", "closed"])
def test_the_conservative_policy_writes_no_state_past_max_keys(on_error: str) -> None:
    """A crashed member's keys start exhausted (crash policy conservative): each
    one that came in wrote a state, past --max-keys (a soak tester's finding:
    a node capped at 2 held 26). Within the cap now; past it such a key is
    decided as any new key of a full store, ``store_full``."""
    rule = Rule("api", LIMIT, 3600.0, algorithm="fixed_window", on_error=on_error)
    a = ShardCore("n0", MemoryStore(max_keys=2), lambda: config("conservative", rule=rule))
    v1, v2 = view(["n0", "n1"], 1), view(["n0"], 2)
    a.apply(v1, None, (), NOW, 0.0)
    a.apply(v2, v1, ["n1"], NOW, 0.0)
    moved = owned_by(v1, "n1")
    assert len(moved) > 2
    verdicts = []
    for key in moved:
        a.conservative(key, (rule,), NOW)
        verdicts.append(a.store.check(key, (rule,), NOW))
    assert len(a.store) == 2 and a.stats.conservative_keys == 2
    assert [v.allowed for v in verdicts[:2]] == [False, False]  # exhausted
    assert {v.decision.reason for v in verdicts[2:]} == {"store_full"}
    assert {v.allowed for v in verdicts[2:]} == {on_error == "open"}


def test_a_member_removed_as_crashed_but_alive_hands_everything_back() -> None:
    v1, v2 = view(["n0", "n1"], 1), view(["n1"], 2)
    a = core("n0", lease=Lease(required=True, until=1e9))
    a.apply(v1, None, (), NOW, 0.0)
    keys = owned_by(v1, "n0")
    for key in keys:
        decide(a, key)
    assert a.apply(v2, v1, ["n0"], NOW, 0.0) == len(keys)
    assert not a.lease.valid(0.0)
    assert len(a.store) == 0
    (transfer,) = a.transfers(NOW)
    assert transfer.to == "n1" and transfer.final
    assert sorted(r[2] for r in transfer.records) == sorted(keys)


# --------------------------------------------------------------------------- properties


@dataclass
class Cluster:
    """Cores exchanging the core's messages through a list; one shared frozen time.

    ``elapsed`` never moves, so no handoff deadline passes: every state must
    follow its key. A pull is served at once when it can be; when it cannot,
    the cluster does what the real puller waits for (the router pushes the
    view to the previous owner first; the transfer in flight lands).
    """

    cores: dict[str, ShardCore]
    net: list[Transfer] = field(default_factory=list)
    views: list[RingView] = field(default_factory=list)
    admitted: dict[str, int] = field(default_factory=dict)
    #: (key, epoch) -> the core that decided it under that epoch.
    deciders: dict[tuple[str, int], str] = field(default_factory=dict)
    #: (core, key) -> the epoch of the view under which the state left it.
    left: dict[tuple[str, str], int] = field(default_factory=dict)

    def push(self, node_id: str) -> None:
        """The router's newest view reaches ``node_id``; it hands off at once."""
        c = self.cores[node_id]
        newest = self.views[-1]
        before = c.store.keys()
        c.apply(newest, self.views[-2] if len(self.views) > 1 else None, (), NOW, 0.0)
        for key in before - c.store.keys():
            self.left[(node_id, key)] = newest.epoch
        self.net.extend(c.transfers(NOW))

    def deliver(self, index: int) -> None:
        transfer = self.net.pop(index % len(self.net))
        target = self.cores[transfer.to]
        received = target.receive(
            transfer.sender, transfer.epoch, transfer.records, transfer.final, (), NOW
        )
        self.cores[transfer.sender].delivered(transfer)
        self.net.extend(received.forwards)

    def pull(self, puller: ShardCore, pull: Pull) -> None:
        owner = self.cores[pull.owner]
        puller.start_pull(pull)
        while puller.awaits(pull.owner):
            try:
                records = owner.serve_pull([pull.key], pull.to, pull.epoch, NOW)
            except StaleEpoch:
                self.push(pull.owner)
                continue
            except InFlight:
                index = next(
                    i
                    for i, t in enumerate(self.net)
                    if t.sender == pull.owner and t.to == pull.to and t.final
                )
                self.deliver(index)
                continue
            puller.take_pulled(records, NOW)
            break
        puller.pull_done(pull)

    def check(self, node_id: str, key: str) -> None:
        c = self.cores[node_id]
        try:
            c.check_owner(key)
        except NotOwner:
            return
        step = c.inherit(key, (RULE,), 0.0)
        assert not (isinstance(step, Pull) and step.late)  # no time passes here
        if isinstance(step, Pull):
            self.pull(c, step)
            c.check_owner(key)  # a pull never changes this core's view
        count = decide(c, key)
        self.admitted[key] = self.admitted.get(key, 0) + 1
        # The state followed the key: every earlier admission is counted here.
        assert count == self.admitted[key], (key, node_id)
        decider = self.deciders.setdefault((key, c.epoch), node_id)
        assert decider == node_id, f"{key} decided by {decider} and {node_id} at {c.epoch}"
        handed_off = self.left.get((node_id, key))
        if handed_off is not None:
            # A handed-off state is decided by its old owner only under a newer
            # view that gave the key back.
            assert c.epoch > handed_off


member_sets = st.lists(st.sampled_from(IDS), min_size=1, max_size=4, unique=True)
checks = st.tuples(st.just("check"), st.sampled_from(IDS), st.sampled_from(KEYS[:12]))
steps = st.lists(
    st.one_of(
        st.tuples(st.just("view"), member_sets),
        st.tuples(st.just("push"), st.sampled_from(IDS)),
        st.tuples(st.just("deliver"), st.integers(0, 20)),
        checks,
        checks,
        checks,
    ),
    min_size=10,
    max_size=80,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(2, 4), script=steps)
def test_no_key_is_decided_by_two_cores_and_states_follow_their_keys(
    n: int, script: list[tuple[object, ...]]
) -> None:
    """Views change only once the network is quiet and every core has the last one
    (the router's push completes before the next change); checks and deliveries
    interleave at random in between, against cores that may not have the newest
    view yet."""
    ids = IDS[:n]
    cluster = Cluster({i: core(i) for i in ids}, views=[view(ids, 1)])
    for node_id in ids:
        cluster.push(node_id)
    for step in script:
        kind = step[0]
        if kind == "view":
            members = [m for m in step[1] if m in ids]  # type: ignore[attr-defined]
            if not members:
                continue
            for node_id in ids:  # the previous change completes first
                cluster.push(node_id)
            while cluster.net:
                cluster.deliver(0)
            cluster.views.append(view(members, cluster.views[-1].epoch + 1))
        elif kind == "push" and step[1] in ids:
            cluster.push(step[1])  # type: ignore[arg-type]
        elif kind == "deliver" and cluster.net:
            cluster.deliver(step[1])  # type: ignore[arg-type]
        elif kind == "check" and step[1] in ids:
            cluster.check(step[1], step[2])  # type: ignore[arg-type]
    # Under one epoch, ownership is unique among the cores that hold it.
    by_epoch: dict[int, list[ShardCore]] = {}
    for c in cluster.cores.values():
        by_epoch.setdefault(c.epoch, []).append(c)
    for cores in by_epoch.values():
        for key in KEYS:
            deciders = []
            for c in cores:
                try:
                    c.check_owner(key)
                    deciders.append(c.id)
                except NotOwner:
                    pass
            assert len(deciders) <= 1 or cores[0].view is None


def test_a_pull_of_an_older_view_that_ends_late_does_not_stop_the_pull_of_the_new_one() -> None:
    """n1 pulls a key from n0 under epoch 2; epoch 3 (n2 joins) comes while the pull
    is on its way, and the key is still n1's, still awaited from n0. The old pull
    ended (with nothing) and marked the key pulled under epoch 3: n1 no longer
    asked n0 for it and decided it on a fresh state, though n0's handoff of
    epoch 3 had not come. Only a pull of the view in force is remembered."""
    v1, v2, v3 = view(["n0"], 1), view(["n0", "n1"], 2), view(["n0", "n1", "n2"], 3)
    b = core("n1")
    b.apply(v2, v1, (), NOW, 0.0)
    key = next(k for k in KEYS if v2.owner_id(k) == "n1" and v3.owner_id(k) == "n1")
    old = b.inherit(key, (RULE,), 1.0)
    assert old == Pull("n0", "http://n0:8000", key, 2, "n1")
    b.start_pull(old)
    b.apply(v3, v2, (), NOW, 0.0)  # while the pull is on its way
    b.take_pulled([], NOW)
    b.pull_done(old)
    assert b.inherit(key, (RULE,), 1.0) == Pull("n0", "http://n0:8000", key, 3, "n1")


def test_a_node_may_rejoin_by_itself_unless_it_left() -> None:
    """node/server.py registers a --join node again when no router renews its
    lease: only while its newest view lists it, or removed it as crashed (a
    router that forgot it would never probe it back); never after a leave,
    which an operator's removal is (it was registered again 12 s later)."""
    a = core("n1")
    assert not a.may_rejoin()  # no view yet: its start registers it
    v1 = view(["n1", "n2", "n3"], 1)
    a.apply(v1, None, (), NOW, 0.0)
    assert a.may_rejoin()
    v2 = view(["n2", "n3"], 2)
    a.apply(v2, v1, ("n1",), NOW, 0.0)
    assert a.may_rejoin()  # removed as crashed
    a.apply(view(["n1", "n2", "n3"], 3), v2, (), NOW, 0.0)
    a.apply(view(["n2", "n3"], 4), None, (), NOW, 0.0)
    assert not a.may_rejoin()  # it left
