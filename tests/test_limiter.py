"""Several rules on one request: decided atomically (``decide_all`` and the store).

Times are ``T0 + k / 64`` s with small dyadic or integer periods, so every time
and window boundary is exact in binary floating point.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.algorithms import REGISTRY
from node.clock import FrozenClock
from node.decision import Decision, most_restrictive
from node.limiter import decide_all
from node.rules import Rule
from node.store import MemoryStore

ALGORITHMS = ("token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window")
T0 = 1_000_000.0
TICK = 1 / 64

# Examples come from the loaded profile (tests/conftest.py; HYPOTHESIS_PROFILE=thorough).
SETTINGS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def rule_sets(draw: st.DrawFn) -> list[Rule]:
    n = draw(st.integers(2, 3))
    return [
        Rule(
            f"rule{i}",
            draw(st.integers(1, 8)),
            draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 5.0])),
            draw(st.sampled_from(ALGORITHMS)),
            burst=draw(st.one_of(st.just(0), st.integers(1, 10))),
        )
        for i in range(n)
    ]


ops = st.lists(
    st.tuples(
        st.one_of(st.just(0), st.integers(0, 16), st.integers(0, 256)),
        st.one_of(st.just(1), st.integers(0, 11)),
    ),
    min_size=1,
    max_size=40,
)


def solo(states: list[Any], now: float, rules: list[Rule], cost: int) -> list[tuple[Any, Decision]]:
    return [
        REGISTRY[r.algorithm].decide(s, now, r, cost) for s, r in zip(states, rules, strict=True)
    ]


def peek(state: Any, now: float, rule: Rule) -> Decision:
    return REGISTRY[rule.algorithm].decide(state, now, rule, 0)[1]


def check_verdict(states: list[Any], now: float, rules: list[Rule], cost: int, verdict) -> None:
    """The verdict is what deciding each rule alone implies."""
    alone = solo(states, now, rules, cost)
    allowed = all(d.allowed for _, d in alone)
    assert verdict.allowed == allowed
    if allowed:
        assert verdict.decisions == tuple(d for _, d in alone)
    else:
        for (_, d), state, rule, got in zip(alone, states, rules, verdict.decisions, strict=True):
            # A rule that would have allowed shows what is really left: a peek.
            assert got == (peek(state, now, rule) if d.allowed and cost else d)
    assert verdict.decision == most_restrictive(verdict.decisions)
    assert verdict.decision.allowed == allowed


@SETTINGS
@given(rules=rule_sets(), ops=ops)
def test_decide_all_is_atomic(rules: list[Rule], ops: list[tuple[int, int]]) -> None:
    """Allowed iff every rule alone allows; on denial nothing changes (the very same
    state objects come back); on allowance every rule consumes as it would alone."""
    states: list[Any] = [None] * len(rules)
    now = T0
    for ticks, cost in ops:
        now += ticks * TICK
        alone = solo(states, now, rules, cost)
        new_states, verdict = decide_all(states, now, rules, cost)
        check_verdict(states, now, rules, cost, verdict)
        if verdict.allowed:
            assert new_states == [s for s, _ in alone]
        else:
            assert all(a is b for a, b in zip(new_states, states, strict=True))
        states = new_states


@SETTINGS
@given(rules=rule_sets(), ops=ops, keys=st.lists(st.sampled_from("ab"), min_size=40, max_size=40))
def test_store_check_is_atomic(
    rules: list[Rule], ops: list[tuple[int, int]], keys: list[str]
) -> None:
    """MemoryStore.check with several rules: same verdicts as deciding each rule alone
    on a shadow copy of the states; a denial stores nothing."""
    store = MemoryStore()
    clock = FrozenClock(T0)
    shadow: dict[str, list[Any]] = {"a": [None] * len(rules), "b": [None] * len(rules)}
    for (ticks, cost), key in zip(ops, keys, strict=False):
        clock.advance(ticks * TICK)
        now = clock()
        before = [store.get(r, key) for r in rules]
        assert before == shadow[key]
        verdict = store.check(key, rules, now, cost)
        check_verdict(shadow[key], now, rules, cost, verdict)
        after = [store.get(r, key) for r in rules]
        if verdict.allowed:
            shadow[key] = [s for s, _ in solo(shadow[key], now, rules, cost)]
            assert after == shadow[key]
        else:
            assert all(a is b for a, b in zip(after, before, strict=True))


def test_one_denying_rule_blocks_and_burns_nothing() -> None:
    """A 2/second bucket and a 3/minute window: the window runs out first; the bucket's
    tokens are not spent by requests the window denied."""
    bucket = Rule("per-second", 2, 1.0, "token_bucket")
    window = Rule("per-minute", 3, 60.0, "fixed_window")
    store = MemoryStore()
    w = 1_000_020.0  # a multiple of 60: the minute window starts here
    allowed = [store.check("k", [bucket, window], w + t, 1).allowed for t in (0, 0, 1, 1, 1)]
    assert allowed == [True, True, True, False, False]
    verdict = store.check("k", [bucket, window], w + 1, 1)
    assert verdict.decision.rule == "per-minute"
    assert verdict.decision.retry_after == 59.0
    # The bucket spent one token at w + 1 and then nothing: 1 left, not 0.
    assert verdict.decisions[0] == Decision(True, 2, 1, 0.5, None, "per-second", None, 0.5)
    assert store.get(bucket, "k") == complex(1.0, w + 1)


def test_decide_all_validates() -> None:
    rules = [Rule("a", 1, 1.0), Rule("b", 1, 1.0)]
    with pytest.raises(ValueError, match="cost"):
        decide_all([None, None], T0, rules, -1)
    with pytest.raises(ValueError):
        decide_all([None], T0, rules, 1)


# --------------------------------------------------------------------------- most_restrictive


def _d(allowed: bool, remaining: int, reset: float, retry: float | None, rule: str) -> Decision:
    return Decision(allowed, 10, remaining, reset, retry, rule)


def test_most_restrictive_examples() -> None:
    a = _d(True, 5, 1.0, None, "a")
    b = _d(True, 2, 1.0, None, "b")
    c = _d(True, 2, 9.0, None, "c")
    d = _d(False, 0, 3.0, 3.0, "d")
    e = _d(False, 0, 8.0, 7.0, "e")
    never = Decision(False, 10, 0, 0.0, None, "never", "cost_exceeds_capacity")
    assert most_restrictive([a]) is a
    assert most_restrictive([a, b]) is b  # fewest remaining
    assert most_restrictive([a, b, c]) is c  # then the longest time to a full quota
    assert most_restrictive([a, d]) is d  # denied beats allowed
    assert most_restrictive([d, a, e]) is e  # the longest wait
    assert most_restrictive([e, never, d]) is never  # a request that never passes


decisions = st.builds(
    Decision,
    allowed=st.booleans(),
    limit=st.just(10),
    remaining=st.integers(0, 10),
    reset_after=st.floats(0, 100),
    retry_after=st.one_of(st.none(), st.floats(0, 100)),
    rule=st.sampled_from("abcd"),
)


@given(st.lists(decisions, min_size=1, max_size=5))
def test_most_restrictive_property(ds: list[Decision]) -> None:
    best = most_restrictive(ds)
    assert best in ds
    denied = [d for d in ds if not d.allowed]
    if denied:
        assert not best.allowed

        def wait(d: Decision) -> float:
            return float("inf") if d.retry_after is None else d.retry_after

        assert all(wait(best) >= wait(d) for d in denied)
    else:
        assert all((best.remaining, -best.reset_after) <= (d.remaining, -d.reset_after) for d in ds)
