"""Properties of the five pure algorithms in ``node/algorithms.py``.

No sleeps: every time is passed in. Unless a test says otherwise, times are
``T0 + k * period / 64`` for integers ``k``: every period used here is a small
dyadic or integer number of seconds, so these times, their differences and
``floor(t / period)`` are exact in binary floating point, and a property that
fails is a real failure, not a rounding accident at a boundary. Rounding at
non-dyadic times is tested separately (see the window-boundary tests).

Some tests pin engine bugs found while writing them (negative GCRA remaining,
window boundaries at non-dyadic periods, retry times after a backward clock
step); each failed before its fix.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from fractions import Fraction
from typing import Any, NamedTuple

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from node.algorithms import REGISTRY, fixed_window, gcra, sliding_log, token_bucket
from node.decision import COST_EXCEEDS_CAPACITY, Decision
from node.rules import Rule

ALGORITHMS = ("token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window")
BUCKETS = ("token_bucket", "gcra")
T0 = 1_000_000.0  # FrozenClock's default start
PERIODS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 60.0)
TICKS = 64  # times move in steps of period / TICKS

# Four fifths of the loaded profile's examples (tests/conftest.py: 100 by default, more
# with HYPOTHESIS_PROFILE=thorough) keeps the default run of these files under ~40 s.
SETTINGS = settings(
    max_examples=max(1, settings().max_examples * 4 // 5),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- helpers


class Spec(NamedTuple):
    limit: int
    period: float
    burst: int


def make_rule(algorithm: str, spec: Spec) -> Rule:
    return Rule("r", spec.limit, spec.period, algorithm, burst=spec.burst)


specs = st.builds(
    Spec,
    limit=st.integers(1, 12),
    period=st.sampled_from(PERIODS),
    burst=st.one_of(st.just(0), st.integers(1, 15)),
)
#: Rules whose rate and emission interval are both exact binary fractions.
dyadic_specs = st.builds(
    Spec,
    limit=st.sampled_from([1, 2, 4, 8, 16]),
    period=st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0, 8.0]),
    burst=st.one_of(st.just(0), st.integers(1, 20)),
)
costs = st.one_of(st.just(1), st.just(1), st.integers(0, 17))
forward_ticks = st.one_of(st.just(0), st.integers(0, 8), st.integers(0, 3 * TICKS))
#: (ticks to move the clock by, cost) pairs; the clock never moves back.
forward_ops = st.lists(st.tuples(forward_ticks, costs), min_size=1, max_size=40)
#: The same with backward steps too.
any_ops = st.lists(
    st.tuples(st.one_of(forward_ticks, st.integers(-4 * TICKS, 0)), costs),
    min_size=1,
    max_size=40,
)
waits = st.lists(st.integers(0, 4 * TICKS), min_size=1, max_size=3)


class Step(NamedTuple):
    now: float
    cost: int
    before: Any
    after: Any
    decision: Decision


def run(rule: Rule, ops: list[tuple[int, int]], t0: float = T0) -> list[Step]:
    decide = REGISTRY[rule.algorithm].decide
    tick = rule.period / TICKS
    state: Any = None
    now = t0
    steps = []
    for ticks, cost in ops:
        now += ticks * tick
        new, decision = decide(state, now, rule, cost)
        steps.append(Step(now, cost, state, new, decision))
        state = new
    return steps


def peek(rule: Rule, state: Any, now: float) -> Decision:
    return REGISTRY[rule.algorithm].decide(state, now, rule, 0)[1]


def close(a: float | None, b: float | None, tol: float = 1e-6) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= tol


def same_decision(a: Decision, b: Decision) -> bool:
    return (
        a.allowed == b.allowed
        and a.remaining == b.remaining
        and a.reason == b.reason
        and close(a.reset_after, b.reset_after)
        and close(a.retry_after, b.retry_after)
    )


def admitted(steps: list[Step]) -> list[tuple[float, int]]:
    return [(s.now, s.cost) for s in steps if s.decision.allowed and s.cost]


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=any_ops)
@example(spec=Spec(5, 1.0, 0), ops=[(0, 5), (-10 * TICKS, 0)])
def test_decisions_are_well_formed(algorithm: str, spec: Spec, ops: list) -> None:
    """Whatever the history (clock steps back too): 0 <= remaining <= capacity, times >= 0,
    retry_after only on denials, and reasons only where documented."""
    rule = make_rule(algorithm, spec)
    for step in run(rule, ops):
        d = step.decision
        assert d.limit == rule.limit and d.rule == rule.name
        assert 0 <= d.remaining <= rule.capacity, step
        assert math.isfinite(d.reset_after) and d.reset_after >= 0, step
        if d.allowed:
            assert d.retry_after is None and d.reason is None, step
            if step.cost:
                assert d.remaining <= rule.capacity - step.cost, step
        elif d.retry_after is None:
            assert d.reason == COST_EXCEEDS_CAPACITY, step
        else:
            assert math.isfinite(d.retry_after) and d.retry_after >= 0, step


def decided_after_a_change(
    old: Rule, new: Rule, before: list[tuple[int, int]], after: list[tuple[int, int]]
) -> Iterator[tuple[Any, float, int, Decision]]:
    """``before`` decided under ``old``, then ``after`` under ``new`` (a rule
    changed at runtime) on the states it left, ticks in ``new``'s period:
    (state, now, cost, decision) of each ``after`` step."""
    decide = REGISTRY[new.algorithm].decide
    steps = run(old, before)
    state, now = steps[-1].after, steps[-1].now
    tick = new.period / TICKS
    for ticks, cost in after:
        now += ticks * tick
        state, d = decide(state, now, new, cost)
        yield state, now, cost, d


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, before=forward_ops, after=any_ops, shrink=st.integers(2, 6))
@example(
    spec=Spec(8, 60.0, 0), before=[(0, 8)], after=[(0, 1)], shrink=2
)  # fixed window, count 8 under a limit of 4: remaining was -4
def test_decisions_stay_well_formed_after_the_rule_is_lowered(
    algorithm: str, spec: Spec, before: list, after: list, shrink: int
) -> None:
    """A rule's limit and burst lowered at runtime (same name, PUT /admin/rules):
    its states, made under the larger rule, are decided under the smaller one.
    Remaining stays within 0..capacity and every time is finite and >= 0 (a
    fixed window or sliding log over the new limit answered a negative
    remaining, a token bucket over the new burst more than its capacity and a
    negative reset_after), and a denial's next unit is not promised sooner
    than its retry time."""
    big = make_rule(algorithm, spec)
    small = Rule(
        "r", max(1, spec.limit // shrink), spec.period, algorithm, burst=spec.burst // shrink
    )
    for state, now, cost, d in decided_after_a_change(big, small, before, after):
        context = (state, now, cost)
        assert 0 <= d.remaining <= small.capacity, context
        for value in (d.reset_after, d.available_after):
            assert math.isfinite(value) and value >= 0, context
        if not d.allowed and d.retry_after is not None:
            assert math.isfinite(d.retry_after) and d.retry_after >= 0, context
            if cost == d.remaining + 1:
                assert close(d.available_after, d.retry_after), context


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, new=specs, before=forward_ops, after=any_ops)
@example(  # GCRA throttled under 10/day, then 100/minute: it keeps the day
    spec=Spec(10, 86400.0, 0), new=Spec(100, 60.0, 0), before=[(0, 10), (0, 1)], after=[(0, 1)]
)
def test_decisions_after_any_rules_change_are_ones_redis_takes_for_sound(
    algorithm: str, spec: Spec, new: Spec, before: list, after: list
) -> None:
    """A rule changed at runtime (limit, period and burst, each any way, and the
    clock stepped back too): every decision on a state made under the old rule
    passes the Redis backend's check of a state some rule wrote
    (node.redis_backend._out_of_range). A check against the current rule's
    horizon took a GCRA state made under 10/day, decided under 100/minute, for
    a corrupt one (the review of the day's changes)."""
    from node.decision import Verdict
    from node.redis_backend import _out_of_range

    changed = make_rule(algorithm, new)
    for state, now, cost, d in decided_after_a_change(
        make_rule(algorithm, spec), changed, before, after
    ):
        problem = _out_of_range(Verdict(d.allowed, d, (d,)), [changed])
        assert problem is None, (problem, state, now, cost)


def test_gcra_remaining_is_never_negative_at_realistic_times() -> None:
    """100/second at t = 1e6: the 101st request of a burst is denied with remaining -1
    (100 additions of T = 0.01 leave tat 9.3e-10 s past now + tolerance, within EPS)."""
    rule = Rule("r", 100, 1.0, "gcra")
    state = None
    for _ in range(100):
        state, d = gcra(state, T0, rule, 1)
        assert d.allowed
    _, d = gcra(state, T0, rule, 1)
    assert not d.allowed
    assert d.remaining == 0


# --------------------------------------------------------------------------- never too many


@SETTINGS
@given(spec=specs, ops=forward_ops)
def test_sliding_log_is_exact(spec: Spec, ops: list) -> None:
    """In every interval (t - period, t], admitted units <= limit; and a denial (of a
    cost <= limit) happens only when admitting would break that."""
    rule = make_rule("sliding_log", spec)
    steps = run(rule, ops)
    taken = admitted(steps)
    for t, _ in taken:
        inside = sum(c for s, c in taken if t - rule.period < s <= t)
        assert inside <= rule.limit
    for step in steps:
        need = step.cost or 1
        if not step.decision.allowed and need <= rule.limit:
            inside = sum(c for s, c in taken if step.now - rule.period < s <= step.now)
            assert inside + need > rule.limit


@SETTINGS
@given(spec=specs, ops=forward_ops)
def test_fixed_window_counts_each_aligned_window(spec: Spec, ops: list) -> None:
    """Per aligned window [k*period, (k+1)*period): admitted units <= limit, and a denial
    happens only when the window is really full."""
    rule = make_rule("fixed_window", spec)
    steps = run(rule, ops)
    per_window: dict[int, int] = {}
    for step in steps:
        window = math.floor(step.now / rule.period)
        used = per_window.get(window, 0)
        need = step.cost or 1
        assert step.decision.allowed == (used + need <= rule.limit), step
        if step.decision.allowed and step.cost:
            per_window[window] = used + step.cost
    assert all(n <= rule.limit for n in per_window.values())


@SETTINGS
@given(spec=specs, ops=forward_ops)
def test_sliding_window_bounds(spec: Spec, ops: list) -> None:
    """Every aligned window <= limit; any interval (t - period, t] <= 2*limit - 1.

    (Derivation in docs/algorithms.md: at the last admission y in the current window,
    prev*(1 - (y-start)/period) + curr <= limit, and the interval can only hold
    previous-window units if y - start < period.)"""
    rule = make_rule("sliding_window", spec)
    steps = run(rule, ops)
    taken = admitted(steps)
    per_window: dict[int, int] = {}
    for t, c in taken:
        window = math.floor(t / rule.period)
        per_window[window] = per_window.get(window, 0) + c
    assert all(n <= rule.limit for n in per_window.values())
    for t, _ in taken:
        inside = sum(c for s, c in taken if t - rule.period < s <= t)
        assert inside <= 2 * rule.limit - 1


@pytest.mark.parametrize("algorithm", BUCKETS)
@SETTINGS
@given(spec=specs, ops=forward_ops)
def test_buckets_admit_at_most_capacity_plus_rate_times_duration(
    algorithm: str, spec: Spec, ops: list
) -> None:
    rule = make_rule(algorithm, spec)
    taken = admitted(run(rule, ops))
    for i, (a, _) in enumerate(taken):
        total = 0
        for b, c in taken[i:]:
            total += c
            assert total <= rule.capacity + rule.rate * (b - a) + 1e-6, (a, b, total)


# --------------------------------------------------------------------------- a reference model


class Reference:
    """The five algorithms as their docs describe them, in exact rational arithmetic.

    GCRA has no model of its own: it is specified to decide exactly like the token
    bucket, so it is checked against the bucket's model.
    """

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.limit = rule.limit
        self.cap = Fraction(rule.capacity)
        self.period = Fraction(rule.period)
        self.rate = Fraction(rule.limit) / self.period
        self.tokens: Fraction | None = None
        self.last = Fraction(0)
        self.log: list[Fraction] = []
        self.windows: dict[int, int] = {}

    def decide(self, now_f: float, cost: int) -> tuple[bool, int, Fraction, Fraction | None]:
        now = Fraction(now_f)
        kind = self.rule.algorithm
        if kind in BUCKETS:
            return self._bucket(now, cost)
        if kind == "sliding_log":
            return self._log(now, cost)
        return self._windows(now, cost, sliding=kind == "sliding_window")

    def _bucket(self, now: Fraction, cost: int) -> tuple[bool, int, Fraction, Fraction | None]:
        tokens = self.cap if self.tokens is None else self.tokens
        tokens = min(self.cap, tokens + (now - self.last) * self.rate)
        need = cost or 1
        ok = need <= self.cap and tokens >= need
        if ok and cost:
            tokens -= cost
            self.tokens, self.last = tokens, now
        elif self.tokens is not None:
            self.tokens, self.last = tokens, now
        retry = None if ok or need > self.cap else (need - tokens) / self.rate
        return ok, math.floor(tokens), (self.cap - tokens) / self.rate, retry

    def _log(self, now: Fraction, cost: int) -> tuple[bool, int, Fraction, Fraction | None]:
        live = sorted(t for t in self.log if t > now - self.period)
        need = cost or 1
        ok = need <= self.limit and len(live) + need <= self.limit
        if ok and cost:
            live += [now] * cost
            self.log = live
        retry = None
        if not ok and need <= self.limit:
            retry = live[len(live) + need - self.limit - 1] + self.period - now
        reset = live[-1] + self.period - now if live else Fraction(0)
        return ok, self.limit - len(live), reset, retry

    def _windows(
        self, now: Fraction, cost: int, *, sliding: bool
    ) -> tuple[bool, int, Fraction, Fraction | None]:
        p = self.period
        k = math.floor(now / p)
        start = k * p
        curr = self.windows.get(k, 0)
        prev = self.windows.get(k - 1, 0) if sliding else 0
        weight = (p - (now - start)) / p
        need = cost or 1
        ok = need <= self.limit and prev * weight + curr + need <= self.limit
        if ok and cost:
            curr += cost
            self.windows[k] = curr
        remaining = max(0, math.floor(self.limit - prev * weight - curr))
        retry = None
        if sliding:
            reset = 2 * p + start - now if curr else p + start - now if prev else Fraction(0)
            if not ok and need <= self.limit:
                if curr + need <= self.limit:
                    retry = start + p * (1 - Fraction(self.limit - curr - need, prev)) - now
                else:
                    retry = start + p + p * (1 - Fraction(self.limit - need, curr)) - now
        else:
            reset = start + p - now if curr else Fraction(0)
            if not ok and need <= self.limit:
                retry = start + p - now
        return ok, remaining, reset, retry


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(data=st.data(), ops=forward_ops)
def test_matches_the_exact_reference_model(algorithm: str, data: st.DataObject, ops: list) -> None:
    """Every decision equals the documented algorithm computed in exact arithmetic
    (allowed and remaining exactly; reset/retry within 1e-6).

    GCRA gets rules whose emission interval is exact (see
    test_gcra_and_token_bucket_agree_for_any_rule for why)."""
    spec = data.draw(dyadic_specs if algorithm == "gcra" else specs, label="spec")
    rule = make_rule(algorithm, spec)
    model = Reference(rule)
    for step in run(rule, ops):
        ok, remaining, reset, retry = model.decide(step.now, step.cost)
        d = step.decision
        assert d.allowed == ok, (step, ok)
        assert d.remaining == remaining, (step, remaining)
        assert close(d.reset_after, float(reset)), (step, float(reset))
        assert close(d.retry_after, None if retry is None else float(retry)), (step, retry)


# --------------------------------------------------------------------------- state conventions


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=any_ops)
def test_denials_and_peeks_return_the_state_unchanged(
    algorithm: str, spec: Spec, ops: list
) -> None:
    """A denied request and a cost-0 peek return the very state object they were given;
    a peek's ``allowed`` says whether cost 1 would pass."""
    rule = make_rule(algorithm, spec)
    decide = REGISTRY[algorithm].decide
    for step in run(rule, ops):
        if not step.decision.allowed or step.cost == 0:
            assert step.after is step.before, step
        else:
            assert step.after is not None and step.after != step.before, step
        if step.cost == 0:
            assert step.decision.allowed == decide(step.before, step.now, rule, 1)[1].allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=any_ops, extra=st.integers(1, 5))
def test_cost_above_capacity_is_denied_for_good(
    algorithm: str, spec: Spec, ops: list, extra: int
) -> None:
    rule = make_rule(algorithm, spec)
    decide = REGISTRY[algorithm].decide
    states = [None] + [s.after for s in run(rule, ops)]
    now = T0 + 1000 * rule.period  # long after: even a fresh quota cannot hold it
    for state in states:
        for t in (T0, now):
            new, d = decide(state, t, rule, rule.capacity + extra)
            assert new is state
            assert not d.allowed
            assert d.reason == COST_EXCEEDS_CAPACITY
            assert d.retry_after is None
        assert decide(None, now, rule, rule.capacity)[1].allowed  # capacity itself is fine


# --------------------------------------------------------------------------- honest times


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=forward_ops)
def test_retry_after_is_honest(algorithm: str, spec: Spec, ops: list) -> None:
    """Denied with retry_after r: the same request passes at now + r (+1e-6), and is
    still denied at now + 0.99r - 1e-3. Holds for all five algorithms."""
    rule = make_rule(algorithm, spec)
    decide = REGISTRY[algorithm].decide
    for step in run(rule, ops):
        r = step.decision.retry_after
        if r is None:
            continue
        assert decide(step.before, step.now + r + 1e-6, rule, step.cost)[1].allowed, step
        early = step.now + r * 0.99 - 1e-3
        if early > step.now:
            assert not decide(step.before, early, rule, step.cost)[1].allowed, step


def _fresh_like(rule: Rule, state: Any, now: float) -> bool:
    """``state`` decides like ``None`` at ``now``, for a peek, cost 1 and full capacity."""
    decide = REGISTRY[rule.algorithm].decide
    return all(
        same_decision(decide(state, now, rule, c)[1], decide(None, now, rule, c)[1])
        for c in (0, 1, rule.capacity, rule.capacity + 1)
    )


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=forward_ops)
def test_reset_after_is_honest_and_agrees_with_fresh_at(
    algorithm: str, spec: Spec, ops: list
) -> None:
    """At now + reset_after the state decides like a fresh one; and reset_after is the
    time to fresh_at (not later, not earlier), 0 when the state is already fresh."""
    rule = make_rule(algorithm, spec)
    fresh_at = REGISTRY[algorithm].fresh_at
    for step in run(rule, ops):
        reset = step.decision.reset_after
        assert _fresh_like(rule, step.after, step.now + reset + 1e-6), step
        if step.after is None or fresh_at(step.after, rule) <= step.now:
            assert reset == pytest.approx(0.0, abs=1e-9), step
        else:
            assert step.now + reset == pytest.approx(fresh_at(step.after, rule), abs=1e-6), step


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(data=st.data(), ops=forward_ops, later=st.integers(0, 3 * TICKS))
def test_fresh_at_is_when_a_state_becomes_indistinguishable_from_none(
    algorithm: str, data: st.DataObject, ops: list, later: int
) -> None:
    """From fresh_at(state) on, the state decides exactly like None (so evicting it
    changes nothing); one tick before, it does not (so fresh_at is not late).

    Exactly at fresh_at only where fresh_at is computed exactly (dyadic rates); for any
    rate, from fresh_at + 1e-6. (A token bucket of 9/0.25s with 7 tokens at t = 1e6 has
    fresh_at = 1e6 + 2/36 rounded down by 4e-11 s, where it holds 8.999999998 tokens:
    remaining 8, not 9. The 2e-9 tokens an eviction then gives away are harmless.)"""
    exact = data.draw(st.booleans(), label="exact")
    spec = data.draw(dyadic_specs if exact else specs, label="spec")
    slack = 0.0 if exact else 1e-6
    rule = make_rule(algorithm, spec)
    fresh_at = REGISTRY[algorithm].fresh_at
    tick = rule.period / TICKS
    for step in run(rule, ops):
        if step.after is None:
            continue
        at = max(fresh_at(step.after, rule), step.now) + slack
        for t in (at, at + later * tick):
            assert _fresh_like(rule, step.after, t), (step, at, t)
        if at - tick >= step.now:
            assert peek(rule, step.after, at - tick).reset_after > 0, (step, at)


# --------------------------------------------------------------------------- time moving


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=any_ops, waits=waits)
def test_waiting_never_reduces_remaining(
    algorithm: str, spec: Spec, ops: list, waits: list[int]
) -> None:
    rule = make_rule(algorithm, spec)
    tick = rule.period / TICKS
    for step in run(rule, ops):
        before = peek(rule, step.after, step.now)
        for w in waits:
            later = peek(rule, step.after, step.now + w * tick)
            assert later.remaining >= before.remaining, (step, w)
            assert later.allowed or not before.allowed, (step, w)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=any_ops)
def test_a_clock_stepping_back_never_gives_quota_back(
    algorithm: str, spec: Spec, ops: list
) -> None:
    """Along a history whose clock also steps back: deciding at an earlier time never
    shows more remaining than at the latest time seen, and admitting never moves the
    state's fresh_at earlier (so a sweep cannot evict a state that just consumed)."""
    rule = make_rule(algorithm, spec)
    fresh_at = REGISTRY[algorithm].fresh_at
    latest = -math.inf
    for step in run(rule, ops):
        latest = max(latest, step.now)
        if step.before is not None:
            assert (
                peek(rule, step.before, step.now).remaining
                <= peek(rule, step.before, latest).remaining
            ), step
            if step.decision.allowed and step.cost:
                assert fresh_at(step.after, rule) >= fresh_at(step.before, rule), step


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@SETTINGS
@given(spec=specs, ops=any_ops)
@example(spec=Spec(5, 10.0, 0), ops=[(0, 5), (-TICKS, 1)])
def test_retry_and_reset_stay_honest_after_the_clock_steps_back(
    algorithm: str, spec: Spec, ops: list
) -> None:
    rule = make_rule(algorithm, spec)
    decide = REGISTRY[algorithm].decide
    for step in run(rule, ops):
        d = step.decision
        if d.retry_after is not None:
            assert decide(step.before, step.now + d.retry_after + 1e-6, rule, step.cost)[
                1
            ].allowed, step
        assert _fresh_like(rule, step.after, step.now + d.reset_after + 1e-6), step


# --------------------------------------------------------------------------- GCRA == token bucket


@SETTINGS
@given(spec=dyadic_specs, ops=forward_ops)
def test_gcra_and_token_bucket_are_the_same_algorithm(spec: Spec, ops: list) -> None:
    """With limit and period powers of two, rate and interval are exact, so GCRA and the
    token bucket must give identical decisions (all fields) on a non-decreasing clock."""
    tb = run(make_rule("token_bucket", spec), ops)
    gc = run(make_rule("gcra", spec), ops)
    for a, b in zip(tb, gc, strict=True):
        assert a.decision == b.decision, (a, b)


@SETTINGS
@given(spec=specs, ops=forward_ops)
@example(spec=Spec(12, 0.25, 0), ops=[(0, 1)])
def test_gcra_and_token_bucket_agree_for_any_rule(spec: Spec, ops: list) -> None:
    """For rules whose interval is not exact (12/250ms: T = 1/48 s) at T0 = 1e6, the two
    agree on allowed and remaining at times on the grid, where the exact token counts
    are whole numbers or far from them. gcra's tat picks up rounding of ulp(now) (1.2e-10
    s at 1e6, 2.4e-7 s at 1.7e9) on every addition, which the 1e-9 s EPS alone did not
    absorb once divided by a small interval: gcra reported one unit fewer (12/250ms: the
    first request on a fresh key left 10, not 11). Its UNIT_EPS slack, counted in
    intervals, is what this example and the property hold it to."""
    tb = run(make_rule("token_bucket", spec), ops)
    gc = run(make_rule("gcra", spec), ops)
    for a, b in zip(tb, gc, strict=True):
        assert a.decision.allowed == b.decision.allowed, (a, b)
        assert a.decision.remaining == b.decision.remaining, (a, b)
        assert close(a.decision.reset_after, b.decision.reset_after), (a, b)
        assert close(a.decision.retry_after, b.decision.retry_after), (a, b)


# --------------------------------------------------------------------------- decimal periods


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window"])
@SETTINGS
@given(
    period=st.sampled_from([0.1, 0.3, 0.7, 1.1, 0.01, 1 / 3]),
    base=st.one_of(st.floats(1e3, 1e4), st.floats(1.5e9, 2e9)),
    windows=st.integers(1, 3),
    limit=st.integers(1, 4),
)
@example(period=0.1, base=2663.3, windows=1, limit=1)
def test_a_window_boundary_never_admits_more_than_the_limit_at_one_instant(
    algorithm: str, period: float, base: float, windows: int, limit: int
) -> None:
    """Fill a window, then at the computed start of a later window (a float boundary)
    send limit + 1 requests at one instant: at most limit may pass."""
    rule = Rule("r", limit, period, algorithm)
    decide = REGISTRY[algorithm].decide
    state, d = decide(None, base, rule, limit)
    assert d.allowed
    now = state[0] + windows * period
    passed = 0
    for _ in range(limit + 1):
        state, d = decide(state, now, rule, 1)
        passed += d.allowed
    assert passed <= limit


# --------------------------------------------------------------------------- worked timelines
# The same timelines are explained in docs/algorithms.md. T0 = 1,000,000 s is a
# multiple of 10 s, so the windows of these 10 s rules start at T0.


def test_token_bucket_timeline() -> None:
    """5/10s: the bucket holds 5 tokens and gains one every 2 s."""
    rule = Rule("r", 5, 10.0, "token_bucket")
    state = None
    for i in range(5):
        state, d = token_bucket(state, T0, rule, 1)
        assert d.allowed and d.remaining == 4 - i
    assert state == complex(0.0, T0)
    assert d.reset_after == 10.0  # empty -> full takes 5 * 2 s
    _, d = token_bucket(state, T0, rule, 1)
    assert (d.allowed, d.remaining, d.retry_after) == (False, 0, 2.0)
    _, d = token_bucket(state, T0 + 1.0, rule, 1)
    assert (d.allowed, d.retry_after) == (False, 1.0)  # half a token so far
    state, d = token_bucket(state, T0 + 2.0, rule, 1)
    assert (d.allowed, d.remaining) == (True, 0)
    _, d = token_bucket(state, T0 + 2.0, rule, 3)
    assert (d.allowed, d.retry_after) == (False, 6.0)  # a cost of 3 waits for 3 tokens
    _, d = token_bucket(state, T0 + 12.0, rule, 0)
    assert (d.allowed, d.remaining, d.reset_after) == (True, 5, 0.0)  # full again


def test_gcra_timeline() -> None:
    """5/10s as GCRA: one emission every T = 2 s, tolerance 5 * T = 10 s; same answers
    as the token bucket, with a single float (tat) of state."""
    rule = Rule("r", 5, 10.0, "gcra")
    state = None
    for i in range(5):
        state, d = gcra(state, T0, rule, 1)
        assert d.allowed and d.remaining == 4 - i
    assert state == T0 + 10.0  # tat: the bucket is empty until T0 + 10
    _, d = gcra(state, T0, rule, 1)
    assert (d.allowed, d.remaining, d.retry_after, d.reset_after) == (False, 0, 2.0, 10.0)
    state, d = gcra(state, T0 + 2.0, rule, 1)
    assert (d.allowed, d.remaining) == (True, 0)
    assert state == T0 + 12.0
    assert gcra(state, T0 + 12.0, rule, 0)[1].remaining == 5


def test_fixed_window_timeline() -> None:
    """5/10s, windows [T0, T0+10), [T0+10, T0+20)...: the count resets at each boundary,
    so 10 requests can pass within 0.1 s around one (the 2x boundary burst)."""
    rule = Rule("r", 5, 10.0, "fixed_window")
    state, d = fixed_window(None, T0 + 3.0, rule, 1)
    assert state == (T0, 1)
    assert (d.remaining, d.reset_after) == (4, 7.0)
    for _ in range(4):
        state, d = fixed_window(state, T0 + 3.0, rule, 1)
    _, d = fixed_window(state, T0 + 3.0, rule, 1)
    assert (d.allowed, d.remaining, d.retry_after) == (False, 0, 7.0)
    state, d = fixed_window(state, T0 + 10.0, rule, 1)
    assert d.allowed and state == (T0 + 10.0, 1)
    # The boundary burst: 5 at T0 + 29.9 and 5 more at T0 + 30.0.
    passed = 0
    state = None
    for t in [T0 + 29.9] * 5 + [T0 + 30.0] * 5 + [T0 + 30.0]:
        state, d = fixed_window(state, t, rule, 1)
        passed += d.allowed
    assert passed == 10


def test_sliding_log_timeline() -> None:
    """3/10s: one timestamp per admitted unit; an entry at t stops counting at t + 10."""
    rule = Rule("r", 3, 10.0, "sliding_log")
    state = None
    for t in (0.0, 1.0, 2.0):
        state, d = sliding_log(state, T0 + t, rule, 1)
        assert d.allowed
    assert state == (T0, T0 + 1.0, T0 + 2.0)
    _, d = sliding_log(state, T0 + 3.0, rule, 1)
    assert (d.allowed, d.retry_after, d.reset_after) == (False, 7.0, 9.0)
    _, d = sliding_log(state, T0 + 3.0, rule, 2)
    assert d.retry_after == 8.0  # two entries must expire: T0 and T0 + 1
    state, d = sliding_log(state, T0 + 10.0, rule, 1)
    assert d.allowed and state == (T0 + 1.0, T0 + 2.0, T0 + 10.0)
    # Memory: one float per admitted unit still in the window.
    assert len(state) == rule.limit


def test_sliding_window_timeline() -> None:
    """10/10s: estimate = previous * (share of the previous window still covered) +
    current. The worst case lets 2 * limit - 1 units through in one period."""
    rule = Rule("r", 10, 10.0, "sliding_window")
    decide = REGISTRY["sliding_window"].decide
    state, d = decide(None, T0 + 9.0, rule, 10)  # 10 at the end of window [T0, T0+10)
    assert state == (T0, 0, 10)
    # At T0 + 12.5 a quarter of the new window has passed: estimate 10 * 0.75 = 7.5.
    state, d = decide(state, T0 + 12.5, rule, 0)
    assert (d.allowed, d.remaining, d.reset_after) == (True, 2, 7.5)
    state, d = decide(state, T0 + 12.5, rule, 2)
    assert d.allowed and state == (T0 + 10.0, 10, 2)
    _, d = decide(state, T0 + 12.5, rule, 1)
    # 10 * w + 2 + 1 <= 10 needs w <= 0.7, i.e. 3 s into the window: T0 + 13.
    assert (d.allowed, d.retry_after) == (False, 0.5)
    # Worst case: 10 at T0 + 9.5, then at T0 + 19 (weight 0.1) 10 * 0.1 + 9 <= 10, so
    # 9 more pass: 19 = 2 * 10 - 1 units inside (T0 + 9, T0 + 19], one period.
    state, _ = decide(None, T0 + 9.5, rule, 10)
    _, d = decide(state, T0 + 18.5, rule, 9)
    assert not d.allowed  # weight 0.15: 1.5 + 9 > 10
    state, d = decide(state, T0 + 19.0, rule, 9)
    assert d.allowed
    _, d = decide(state, T0 + 19.0, rule, 1)
    assert not d.allowed
