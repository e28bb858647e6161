"""MemoryStore: eviction (sweep), the key cap, and handoff (export / import).

Times are multiples of 1/1024 s below 2**22 s in magnitude (and periods are
small dyadic or integer seconds). Such numbers need at most 32 significant
bits, so every time, every difference of two times and every rebasing
``t2 + (t - t1)`` is computed exactly in binary64: a state handed from a node
at clock t1 to a node at clock t2 is then *exactly* the same state shifted by
t2 - t1, and any difference in later decisions is a real handoff bug rather
than a rounding accident at a boundary.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.algorithms import REGISTRY
from node.clock import FrozenClock
from node.decision import STORE_FULL, Decision
from node.rules import Rule
from node.store import MemoryStore

ALGORITHMS = ("token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window")
WINDOWS = ("fixed_window", "sliding_window")
T0 = 1_000_000.0
TICK = 1 / 64
KEYS = ("a", "b", "c", "d")

# Examples come from the loaded profile (tests/conftest.py; HYPOTHESIS_PROFILE=thorough).
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def rules_for(draw: st.DrawFn, algorithm: str, name: str | None = None) -> Rule:
    # GCRA's interval period/limit must be exact too (powers of two), or its tat is
    # rounded differently at different clock magnitudes (see test_algorithms.py).
    if algorithm == "gcra":
        limit = draw(st.sampled_from([1, 2, 4, 8]))
        period = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0]))
    else:
        limit = draw(st.integers(1, 8))
        period = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 5.0]))
    burst = draw(st.one_of(st.just(0), st.integers(1, 10)))
    return Rule(name or algorithm, limit, period, algorithm, burst=burst)


all_rules = st.tuples(*(rules_for(a) for a in ALGORITHMS)).map(list)
ticks = st.one_of(st.just(0), st.integers(0, 16), st.integers(0, 256))
costs = st.one_of(st.just(1), st.integers(0, 9))
#: (ticks, key, index of the rule, cost)
requests = st.lists(
    st.tuples(ticks, st.sampled_from(KEYS), st.integers(0, len(ALGORITHMS) - 1), costs),
    min_size=1,
    max_size=40,
)


def decide(rule: Rule, state: Any, now: float, cost: int) -> tuple[Any, Decision]:
    return REGISTRY[rule.algorithm].decide(state, now, rule, cost)


def fresh_like(rule: Rule, state: Any, now: float) -> bool:
    for c in (0, 1, rule.capacity):
        a = decide(rule, state, now, c)[1]
        b = decide(rule, None, now, c)[1]
        if (a.allowed, a.remaining) != (b.allowed, b.remaining):
            return False
        if abs(a.reset_after - b.reset_after) > 1e-6:
            return False
    return True


def fill(store: MemoryStore, rules: list[Rule], reqs: list, now: float) -> float:
    for t, key, i, cost in reqs:
        now += t * TICK
        store.check(key, [rules[i]], now, cost)
    return now


def snapshot(store: MemoryStore, rules: list[Rule]) -> dict[tuple[str, str], Any]:
    return {
        (r.name, k): store.get(r, k) for r in rules for k in KEYS if store.get(r, k) is not None
    }


# --------------------------------------------------------------------------- sweep


@SETTINGS
@given(rules=all_rules, reqs=requests, later=ticks, budget=st.one_of(st.none(), st.integers(1, 7)))
def test_sweep_evicts_exactly_the_fresh_states(
    rules: list[Rule], reqs: list, later: int, budget: int | None
) -> None:
    store = MemoryStore()
    now = fill(store, rules, reqs, T0) + later * TICK
    by_name = {r.name: r for r in rules}
    before = snapshot(store, rules)
    stale = {
        k
        for k, s in before.items()
        if REGISTRY[by_name[k[0]].algorithm].fresh_at(s, by_name[k[0]]) <= now
    }
    if budget is None:
        evicted = store.sweep(now, budget=None)
    else:
        # Small sweeps continue where the last stopped: enough of them cover every key.
        evicted = 0
        for _ in range(math.ceil(len(before) / budget) + 1):
            evicted += store.sweep(now, budget=budget)
    after = snapshot(store, rules)
    assert evicted == len(stale)
    assert set(after) == set(before) - stale
    assert all(after[k] is before[k] for k in after)  # kept states are untouched
    for name, key in stale:  # evicting them changes nothing...
        assert fresh_like(by_name[name], before[name, key], now), (name, key)
    for name, key in after:  # ...and the kept ones are not fresh yet
        rule = by_name[name]
        assert decide(rule, after[name, key], now, 0)[1].reset_after > 0, (name, key)


def test_budgeted_sweep_looks_at_most_budget_entries() -> None:
    rule = Rule("r", 1, 1.0, "fixed_window")
    store = MemoryStore()
    for i in range(10):
        store.check(f"k{i}", [rule], T0, 1)
    assert store.sweep(T0 + 5, budget=3) == 3
    assert len(store) == 7
    assert store.sweep(T0 + 5, budget=3) == 3
    assert store.sweep(T0 + 5, budget=100) == 4
    assert len(store) == 0


# --------------------------------------------------------------------------- the key cap


class CapModel:
    """The documented cap behaviour, for one rule, on plain dicts."""

    def __init__(self, rule: Rule, cap: int) -> None:
        self.rule, self.cap = rule, cap
        self.states: dict[str, Any] = {}

    def check(self, key: str, now: float, cost: int) -> Decision:
        rule = self.rule
        state = self.states.get(key)
        if state is None and len(self.states) >= self.cap:
            fresh_at = REGISTRY[rule.algorithm].fresh_at
            self.states = {k: s for k, s in self.states.items() if fresh_at(s, rule) > now}
            if len(self.states) >= self.cap:
                d = decide(rule, None, now, cost)[1]
                if rule.on_error == "closed" and d.allowed:
                    # The store refused, not the count: nothing left, no retry time.
                    return Decision(False, rule.limit, 0, 0.0, None, rule.name, STORE_FULL)
                return d._replace(reason=d.reason or STORE_FULL)
        new, d = decide(rule, state, now, cost)
        if new is not state:
            self.states[key] = new
        return d


@SETTINGS
@given(
    data=st.data(),
    algorithm=st.sampled_from(ALGORITHMS),
    on_error=st.sampled_from(["open", "closed"]),
    cap=st.integers(1, 3),
    reqs=st.lists(st.tuples(ticks, st.sampled_from(KEYS), costs), min_size=1, max_size=50),
)
def test_key_cap(data: st.DataObject, algorithm: str, on_error: str, cap: int, reqs: list) -> None:
    """At the cap existing keys are decided exactly as without a cap (never reset); a new
    key gets room only when a sweep frees some, otherwise it is decided on a fresh state
    and not stored ("open") or denied ("closed"), with reason "store_full"."""
    rule = data.draw(rules_for(algorithm)).with_(on_error=on_error)
    seen: list[tuple[Rule, str]] = []
    store = MemoryStore(max_keys=cap)
    store.on_store_full = lambda r, k: seen.append((r, k))
    model = CapModel(rule, cap)
    now = T0
    full_events = 0
    for t, key, cost in reqs:
        now += t * TICK
        known = store.get(rule, key) is not None
        expected = model.check(key, now, cost)
        verdict = store.check(key, [rule], now, cost)
        assert verdict.decision == expected
        assert verdict.allowed == expected.allowed
        assert {k: store.get(rule, k) for k in KEYS if store.get(rule, k) is not None} == (
            model.states
        )
        assert len(store) <= cap
        if expected.reason == STORE_FULL or (
            not known and key not in model.states and len(model.states) >= cap
        ):
            full_events += 1
            assert seen[-1] == (rule, key)
            if on_error == "closed":
                assert not verdict.allowed and verdict.decision.retry_after is None
        assert store.store_full_events == full_events


def test_key_cap_example() -> None:
    open_rule = Rule("open", 5, 60.0, on_error="open")
    closed_rule = Rule("closed", 5, 60.0, on_error="closed")
    clock = FrozenClock(T0)
    store = MemoryStore(max_keys=2)
    assert store.check("a", [open_rule], clock(), 1).allowed
    assert store.check("b", [open_rule], clock(), 2).allowed
    # Full: a new key is decided on a fresh quota but not remembered.
    d = store.check("c", [open_rule], clock(), 1).decision
    assert (d.allowed, d.remaining, d.reason) == (True, 4, STORE_FULL)
    assert store.get(open_rule, "c") is None and len(store) == 2
    d = store.check("c", [closed_rule], clock(), 1).decision
    assert (d.allowed, d.reason, d.retry_after) == (False, STORE_FULL, None)
    assert (d.remaining, d.reset_after) == (0, 0.0)  # not a fresh quota's 4 left
    # Existing keys keep their state: "b" has 3 left, then 2.
    d = store.check("b", [open_rule], clock(), 1).decision
    assert (d.allowed, d.remaining, d.reason) == (True, 2, None)
    assert store.store_full_events == 2
    # Once "a" is whole again (12 s for one token), a sweep makes room for "c".
    clock.advance(12.0)
    d = store.check("c", [open_rule], clock(), 1).decision
    assert (d.allowed, d.remaining, d.reason) == (True, 4, None)
    assert store.get(open_rule, "a") is None
    assert store.get(open_rule, "c") is not None


def test_key_cap_with_several_rules_that_all_have_states() -> None:
    a = Rule("a", 2, 60.0)
    b = Rule("b", 3, 60.0, "fixed_window")
    store = MemoryStore(max_keys=2)
    assert store.check("k", [a, b], T0, 1).allowed
    assert [store.check("k", [a, b], T0, 1).allowed for _ in range(3)] == [True, False, False]
    assert store.store_full_events == 0


def test_key_cap_keeps_counting_a_rule_that_has_state_when_another_has_none() -> None:
    """Key "k" has a state for rule a (2/minute) but none for rule b (b is new, or its
    state was swept as fresh). The store is full. Rule a must still count: 2 requests
    per minute, not unlimited."""
    a = Rule("a", 2, 60.0)
    b = Rule("b", 100, 60.0)
    store = MemoryStore(max_keys=2)
    assert store.check("k", [a], T0, 1).allowed  # a: 1 left
    assert store.check("other", [a], T0, 1).allowed  # the store is now full
    passed = sum(store.check("k", [a, b], T0, 1).allowed for _ in range(5))
    assert passed <= 1


# --------------------------------------------------------------------------- handoff


offsets = st.one_of(
    st.sampled_from([1_000_000.0, -1_000_000.0, -2_000_000.0, 0.0]),
    st.integers(-(2**30), 2**30).map(lambda n: n / 1024),
)


@SETTINGS
@given(rules=all_rules, before=requests, pause=ticks, offset=offsets, later=requests)
def test_export_import_round_trip_at_any_clock_offset(
    rules: list[Rule], before: list, pause: int, offset: float, later: list
) -> None:
    """Export from a node at clock t1, import into a fresh node at t2 = t1 + offset:
    the same later requests (at t1 + d and t2 + d) get the same decisions."""
    first = MemoryStore()
    t1 = fill(first, rules, before, T0) + pause * TICK
    records = first.export(t1)
    second = MemoryStore()
    t2 = t1 + offset
    assert second.import_(records, t2, {r.name: r for r in rules}) == len(records)
    exported = {(name, key) for name, _, key, _ in records}
    d = 0.0
    for t, key, i, cost in later:
        d += t * TICK
        rule = rules[i]
        if rule.algorithm in WINDOWS and offset % rule.period and (rule.name, key) not in exported:
            # A key with no state starts on its node's own window grid (windows are
            # aligned to multiples of the period on the local clock), so two nodes
            # whose clocks differ by a non-multiple of the period disagree for it.
            continue
        a = first.check(key, [rule], t1 + d, cost).decision
        b = second.check(key, [rule], t2 + d, cost).decision
        assert (a.allowed, a.remaining, a.reason) == (b.allowed, b.remaining, b.reason)
        assert a.reset_after == pytest.approx(b.reset_after, abs=1e-6)
        if a.retry_after is None:
            assert b.retry_after is None
        else:
            assert a.retry_after == pytest.approx(b.retry_after, abs=1e-6)


@SETTINGS
@given(rules=all_rules, reqs=requests, pause=ticks)
def test_export_skips_fresh_states_and_records_are_relative(
    rules: list[Rule], reqs: list, pause: int
) -> None:
    store = MemoryStore()
    now = fill(store, rules, reqs, T0) + pause * TICK
    by_name = {r.name: r for r in rules}
    live = {
        k: s
        for k, s in snapshot(store, rules).items()
        if REGISTRY[by_name[k[0]].algorithm].fresh_at(s, by_name[k[0]]) > now
    }
    records = store.export(now)
    assert {(name, key) for name, _, key, _ in records} == set(live)
    for name, algorithm, key, relative in records:
        assert algorithm == by_name[name].algorithm
        assert REGISTRY[algorithm].from_relative(relative, now) == live[name, key]
    # Only selected keys, and remove=True takes them out.
    picked = store.export(now, lambda k: k in ("a", "b"), remove=True)
    assert sorted(map(tuple, picked)) == sorted(tuple(r) for r in records if r[2] in ("a", "b"))
    assert all(store.get(by_name[n], k) is None for n, _, k, _ in picked)
    assert sorted(map(tuple, store.export_keys(["c", "d"], now))) == sorted(
        tuple(r) for r in records if r[2] in ("c", "d")
    )


def test_import_skips_unknown_rules_and_changed_algorithms() -> None:
    tb = Rule("api", 5, 10.0)
    store = MemoryStore()
    records = [
        ["api", "token_bucket", "a", [2.0, -1.0]],
        ["gone", "token_bucket", "b", [2.0, -1.0]],
        ["api2", "token_bucket", "c", [2.0, -1.0]],
    ]
    rules = {"api": tb, "api2": Rule("api2", 5, 10.0, "gcra")}
    assert store.import_(records, T0, rules) == 1
    assert store.get(tb, "a") == complex(2.0, T0 - 1.0)
    assert store.get(rules["api2"], "c") is None


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(SETTINGS, max_examples=max(1, settings().max_examples // 2))
@given(data=st.data(), reqs_a=requests, reqs_b=requests, offset=offsets)
def test_import_keeps_the_more_restrictive_state(
    algorithm: str, data: st.DataObject, reqs_a: list, reqs_b: list, offset: float
) -> None:
    """A key held by this node and arriving in a transfer keeps whichever state leaves
    fewer units now (then the longer time to a full quota); a repeated transfer changes
    nothing."""
    rule = data.draw(rules_for(algorithm))
    rules = [rule] * len(ALGORITHMS)  # every request below goes to this one rule
    mine, theirs = MemoryStore(), MemoryStore()
    now = max(fill(mine, rules, reqs_a, T0), fill(theirs, rules, reqs_b, T0 + offset) - offset)
    for key in KEYS:
        a = mine.get(rule, key)
        incoming = theirs.export_keys([key], now + offset)
        mine.import_(incoming, now, {rule.name: rule})
        kept = mine.get(rule, key)
        if not incoming:
            assert kept is a
            continue
        b = REGISTRY[algorithm].from_relative(incoming[0][3], now)
        if a is None:
            assert kept == b
            continue
        pa, pb, pk = (decide(rule, s, now, 0)[1] for s in (a, b, kept))
        assert kept in (a, b)
        assert pk.remaining == min(pa.remaining, pb.remaining)
        if pa.remaining == pb.remaining:
            assert pk.reset_after == max(pa.reset_after, pb.reset_after)
        mine.import_(incoming, now, {rule.name: rule})
        assert mine.get(rule, key) == kept


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(data=st.data(), reqs=requests)
def test_a_state_from_a_larger_rule_arrives_as_the_receiving_rule_can_hold_it(
    algorithm: str, data: st.DataObject, reqs: list
) -> None:
    """The sender's rule had four times the limit and burst (lowered at runtime
    since): what arrives answers within the receiving rule, never more remaining
    than it holds, never less than none, never a negative time (a bucket with a
    billion tokens answered remaining 999999999 and a negative reset_after)."""
    small = data.draw(rules_for(algorithm, "r"))
    big = Rule("r", small.limit * 4, small.period, algorithm, burst=small.capacity * 4)
    theirs, mine = MemoryStore(), MemoryStore()
    now = fill(theirs, [big] * len(ALGORITHMS), reqs, T0)
    records = theirs.export(now)
    # Every state sent is taken (clamped, not refused): none skips the checks below.
    assert mine.import_(records, now, {"r": small}) == len(records)
    ceiling = small.limit if algorithm in (*WINDOWS, "sliding_log") else small.capacity
    for key in {record[2] for record in records}:
        state = mine.get(small, key)
        assert state is not None, key
        for cost in (0, 1):
            decision = decide(small, state, now, cost)[1]
            assert 0 <= decision.remaining <= ceiling, (state, decision)
            assert decision.reset_after >= 0 and decision.available_after >= 0, decision


@pytest.mark.parametrize("tokens", [5.0, 6.0, 7.5, 1e9])
def test_a_bucket_fuller_than_its_rule_arrives_full_and_no_fuller(tokens: float) -> None:
    rule = Rule("api", 5, 60.0)
    for replace in (False, True):  # a transfer, a replica
        store = MemoryStore()
        store.import_(
            [["api", "token_bucket", "k", [tokens, 0.0]]], T0, {"api": rule}, replace=replace
        )
        assert store.get(rule, "k") == complex(5.0, T0)
        assert fresh_like(rule, store.get(rule, "k"), T0)


def test_rule_changes() -> None:
    """A changed limit keeps the states (read at decision time); a changed algorithm drops
    them (their shape differs)."""
    rule = Rule("api", 5, 10.0)
    store = MemoryStore()
    store.check("k", [rule], T0, 5)
    bigger = rule.with_(limit=10)
    assert store.check("k", [bigger], T0, 0).decision.remaining == 0
    window = rule.with_(algorithm="fixed_window")
    assert store.check("k", [window], T0, 0).decision.remaining == 5


def test_a_full_store_of_active_keys_does_not_scan_every_state_for_each_new_key() -> None:
    """A full store whose states are all still in use: a stream of new keys made it
    sweep every state for every one of them (1,000 new keys at a cap of 1,000:
    1,001,000 states looked at before). A full sweep notes when the first state
    left will be fresh, and none is made before then; once it comes, new keys
    get room again as before."""
    cap = 1000
    rule = Rule("r", 10, 60.0)  # a token back every 6 s
    store = MemoryStore(max_keys=cap)
    looked = 0
    fresh_at = store.table(rule).fresh_at

    def counting(state: Any, rule: Rule) -> float:
        nonlocal looked
        looked += 1
        return fresh_at(state, rule)

    store.table(rule).fresh_at = counting
    for i in range(cap):
        assert store.check(f"old{i}", [rule], T0 + i * 0.001, 1).allowed
    looked = 0
    for i in range(cap):
        assert store.check(f"new{i}", [rule], T0 + 2.0, 1).decision.reason == STORE_FULL
    assert store.store_full_events == cap
    assert looked <= 2 * cap, looked
    # The active keys keep counting (each write lowers the floor to its own fresh time).
    assert store.check("old999", [rule], T0 + 2.0, 1).allowed
    # The first state is whole again 6 s after its one request: room for a new key.
    d = store.check("later", [rule], T0 + 6.0005, 1).decision
    assert d.reason is None and store.get(rule, "old0") is None
    assert store.get(rule, "later") is not None and len(store) == cap


def test_a_full_store_makes_room_from_the_states_of_rules_no_longer_in_force() -> None:
    """Rules replaced at runtime left their states in the store until each was
    fresh again (a day for a daily rule), and they counted against the cap: a
    node filled by users of a removed 1/day rule answered every new user of
    the rule in force ``store_full`` (admitted uncounted under ``open``, 503
    under ``closed``) for up to a day (a real node: 200,000 of 200,000 keys
    held after the rule was removed, every new user store_full). Once the
    store is full, the sweep's forget_rules drops them: they decide nothing."""
    daily = Rule("daily", 1, 86_400.0)
    current = Rule("current", 5, 1.0)
    store = MemoryStore(max_keys=3)
    for key in ("a", "b", "c"):
        assert store.check(key, [daily], T0, 1).allowed
    assert store.check("d", [current], T0, 1).decision.reason == STORE_FULL
    store.forget_rules({"current"})  # the node's sweep, after the rules changed
    d = store.check("d", [current], T0 + 1.0, 1).decision
    assert (d.allowed, d.reason) == (True, None)
    assert store.get(current, "d") is not None and len(store) <= 3


def test_a_store_with_room_keeps_a_retired_rules_states_for_its_return() -> None:
    """Below the cap (or without one) a rule no longer in force keeps its states
    until they are fresh: a rename undone finds its users' counts."""
    daily = Rule("daily", 1, 86_400.0)
    for store in (MemoryStore(), MemoryStore(max_keys=10)):
        assert store.check("a", [daily], T0, 1).allowed
        store.forget_rules({"current"})
        assert not store.check("a", [daily], T0 + 1.0, 1).allowed


def test_a_retired_rules_states_handed_over_join_those_kept_for_its_return() -> None:
    """A handoff's states of a rule no longer in force were dropped by the new
    owner (its rules did not name it), though it kept that rule's own states
    for its return: a rule removed, a node leaving, the rule put back, and 36
    of 60 users had a fresh quota (an exploratory tester). They join the
    states kept; a store that keeps none of the rule's still cannot read them."""
    daily = Rule("daily", 1, 86_400.0)
    sender, receiver, other = MemoryStore(), MemoryStore(), MemoryStore()
    assert sender.check("a", [daily], T0, 1).allowed
    assert receiver.check("b", [daily], T0, 1).allowed  # it keeps the rule's states too
    records = sender.export(T0, remove=True)
    assert receiver.import_(records, T0, {}) == 1  # {}: the rules in force name it not
    assert not receiver.check("a", [daily], T0 + 1.0, 1).allowed  # the rule's return
    assert other.import_(records, T0, {}) == 0
