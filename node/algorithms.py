"""The five limiter algorithms as pure functions.

Every algorithm is ``decide(state, now, rule, cost) -> (new_state, Decision)``:
no clock is read and no I/O is done, so the same inputs always give the same
answer (which is what lets hypothesis, the simulations and the Redis Lua
scripts check each other). States are small immutable values (a float or a
tuple); ``None`` is a fresh state.

Shared conventions, which the Lua scripts in ``node/lua/`` repeat operation
for operation so that both give identical decisions:

* ``cost`` is an integer >= 0. ``cost == 0`` peeks: the state is never
  changed, and ``allowed`` says whether a request of cost 1 would pass now.
* A cost above the rule's capacity can never pass: it is denied with
  ``reason="cost_exceeds_capacity"`` and no ``retry_after``.
* A denied request returns the state object it was given, unchanged.
* Comparisons allow ``EPS`` of floating-point slack so that a quota that is
  whole up to rounding error counts as whole.
* A clock that steps backwards never refills anything: elapsed time is
  clamped at zero and stored times never move back.
* ``available_after`` is the time until ``remaining`` grows by at least one
  unit (the draft's ``t``, see :class:`node.decision.Decision`), 0.0 when the
  quota is whole. It equals the ``retry_after`` of a request of cost
  ``remaining + 1``, so a denied request's ``retry_after`` is never below it.

Each algorithm also has ``fresh_at(state, rule)``: the time from which the
state is indistinguishable from ``None``, so the store can evict it. And
``to_relative``/``from_relative``: the handoff format, with every time stored
relative to the exporter's ``now`` so that node clocks need not agree.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from node.decision import COST_EXCEEDS_CAPACITY, Decision
from node.rules import MAX_LIMIT, MAX_LOG_LIMIT, MAX_PERIOD, Rule

EPS = 1e-9
#: GCRA's slack in units: its theoretical arrival time picks up rounding of about
#: ulp(now) on every addition (2.4e-7 s at today's Unix time), which divided by a
#: short emission interval is far more than EPS.
UNIT_EPS = 1e-6
_floor = math.floor
#: The shortest wait the sliding window answers (see ``_sw_wait``).
SW_MIN_WAIT = 1e-6

State = Any
DecideFn = Callable[[State, float, Rule, int], tuple[State, Decision]]

#: Builds a Decision from a 7-tuple without the NamedTuple's Python-level __new__
#: (which costs about as much as the whole token-bucket arithmetic).
_decision = partial(tuple.__new__, Decision)


def _impossible(
    state: State, rule: Rule, remaining: int, reset_after: float, available_after: float
) -> tuple[State, Decision]:
    return state, _decision(
        (
            False,
            rule.limit,
            remaining,
            reset_after,
            None,
            rule.name,
            COST_EXCEEDS_CAPACITY,
            available_after,
        )
    )


# --------------------------------------------------------------------------- token bucket
# state: complex(tokens, updated_at). Capacity = burst; refill = limit / period per second.
# Why a complex number: it is an immutable pair of C doubles in one 32-byte object, where
# a (tokens, updated_at) tuple costs 56 bytes plus two 24-byte floats. The token bucket is
# the default algorithm and a node holds up to millions of its states, so this is most of
# a node's memory per key after the key string and the dict slot. Both parts hold the
# exact doubles, so the arithmetic (and the Lua scripts' parity) is unchanged.


def token_bucket(state: State, now: float, rule: Rule, cost: int) -> tuple[State, Decision]:
    capacity = rule.capacity
    rate = rule.rate
    if state is None:
        tokens = float(capacity)
        last = now
    else:
        tokens = state.real
        last = state.imag
        if now > last:
            tokens += (now - last) * rate
            if tokens > capacity:
                tokens = float(capacity)
            last = now
        elif tokens > capacity:
            # A burst lowered at runtime (same rule name): full, no fuller. Refilling
            # clamps the same way once time moves; until then this does.
            tokens = float(capacity)
    # last > now only after the clock stepped back: nothing refills until it catches up.
    lag = last - now
    need = cost or 1
    if need > capacity:
        whole = _floor(tokens + EPS)
        return _impossible(
            state,
            rule,
            whole,
            _tb_reset(tokens, capacity, rate, lag),
            _tb_next(whole, tokens, capacity, rate, lag),
        )
    if tokens + EPS >= need:
        if cost:
            tokens -= cost
            state = complex(tokens, last)
        whole = _floor(tokens + EPS)
        # _tb_reset and _tb_next, inline (the same operations): most requests end here.
        reset = (capacity - tokens) / rate
        if reset > 0.0:
            reset += lag
        if whole >= capacity:
            after = 0.0
        else:
            after = (whole + 1 - tokens) / rate
            after = after + lag if after > 0.0 else 0.0
        return state, _decision((True, rule.limit, whole, reset, None, rule.name, None, after))
    whole = _floor(tokens + EPS)
    return state, _decision(
        (
            False,
            rule.limit,
            whole,
            _tb_reset(tokens, capacity, rate, lag),
            lag + (need - tokens) / rate,
            rule.name,
            None,
            _tb_next(whole, tokens, capacity, rate, lag),
        )
    )


def _tb_reset(tokens: float, capacity: int, rate: float, lag: float) -> float:
    reset = (capacity - tokens) / rate
    return reset + lag if reset > 0.0 else reset


def _tb_next(whole: int, tokens: float, capacity: int, rate: float, lag: float) -> float:
    """Seconds until ``whole + 1`` tokens (0.0 when the bucket is full)."""
    if whole >= capacity:
        return 0.0
    wait = (whole + 1 - tokens) / rate
    return wait + lag if wait > 0.0 else 0.0


def token_bucket_fresh_at(state: State, rule: Rule) -> float:
    fresh: float = state.imag + (rule.capacity - state.real) / rule.rate
    return fresh


# --------------------------------------------------------------------------- GCRA
# state: tat, the theoretical arrival time. A request of cost c is conforming when
# tat + c*T - burst*T <= now, with T = period / limit the emission interval.


def gcra(state: State, now: float, rule: Rule, cost: int) -> tuple[State, Decision]:
    interval = rule.interval
    tolerance = rule.capacity * interval
    tat = state if state is not None and state > now else now
    need = cost or 1
    capacity = rule.capacity
    if need > capacity:
        remaining = _gcra_remaining(tat, now, tolerance, interval)
        return _impossible(
            state,
            rule,
            remaining,
            tat - now,
            _gcra_next(remaining, capacity, tat, now, tolerance, interval),
        )
    allow_at = tat + need * interval - tolerance
    if now + UNIT_EPS * interval >= allow_at:
        if cost:
            tat += cost * interval
            state = tat
        remaining = _gcra_remaining(tat, now, tolerance, interval)
        return state, _decision(
            (
                True,
                rule.limit,
                remaining,
                tat - now,
                None,
                rule.name,
                None,
                _gcra_next(remaining, capacity, tat, now, tolerance, interval),
            )
        )
    remaining = _gcra_remaining(tat, now, tolerance, interval)
    return state, _decision(
        (
            False,
            rule.limit,
            remaining,
            tat - now,
            allow_at - now,
            rule.name,
            None,
            _gcra_next(remaining, capacity, tat, now, tolerance, interval),
        )
    )


def _gcra_remaining(tat: float, now: float, tolerance: float, interval: float) -> int:
    remaining = _floor((tolerance - (tat - now)) / interval + UNIT_EPS)
    return remaining if remaining > 0 else 0


def _gcra_next(
    remaining: int, capacity: int, tat: float, now: float, tolerance: float, interval: float
) -> float:
    """Seconds until ``remaining + 1`` units conform (0.0 when the burst is whole)."""
    if remaining >= capacity:
        return 0.0
    # tat - now first: exact (Sterbenz), where tat + x - now would lose the few
    # ulps of Unix time that decide whether a drained unit is still to come.
    wait = (tat - now) + (remaining + 1) * interval - tolerance
    return wait if wait > 0.0 else 0.0


def gcra_fresh_at(state: State, rule: Rule) -> float:
    return float(state)


# --------------------------------------------------------------------------- windows


def _aligned(now: float, period: float) -> float:
    """The start of the window of the grid ``k * period`` that holds ``now``.

    ``floor(now / period) * period`` alone can miss it by a window at a
    boundary: at Unix-time magnitudes, 1800000001.1 / 0.1 rounds to
    18000000010.999996, whose window ends exactly at ``now`` (a window already
    over, reported with no time left and no quota back). Corrected here until
    ``start <= now < start + period``.
    """
    start = _floor(now / period) * period
    while start > now:
        start -= period
    while now >= start + period:
        start += period
    return start


def _advance(start: float, now: float, period: float) -> tuple[float, int]:
    """Move a window start forward to the window holding ``now``; how many windows moved.

    ``floor((now - start) / period)`` can round below the true count at a
    boundary (periods like 0.1 s are not exact in binary), so the count is at
    least one and is then corrected until ``now`` is inside the window.
    """
    windows = _floor((now - start) / period)
    if windows < 1:
        windows = 1
    start += windows * period
    while now >= start + period:
        start += period
        windows += 1
    return start, windows


# --------------------------------------------------------------------------- fixed window
# state: (window_start, count). A key's first window is aligned to a multiple of the
# period on the deciding node's clock; later windows continue that key's grid
# (start + k*period), so a state handed to a node with another clock keeps its phase.


def fixed_window(state: State, now: float, rule: Rule, cost: int) -> tuple[State, Decision]:
    period = rule.period
    limit = rule.limit
    if state is None:
        start = _aligned(now, period)
        count = 0
    else:
        start, count = state
        if now >= start + period:
            start, _ = _advance(start, now, period)
            count = 0
    need = cost or 1
    reset_after = start + period - now
    # Units come back all at once at the window's end: that is both times.
    # Denied, a count above the limit (a limit lowered at runtime) has nothing
    # left, not less (allowed, it is under the limit).
    if need > limit:
        reset = reset_after if count else 0.0
        return _impossible(state, rule, limit - count if count < limit else 0, reset, reset)
    if count + need <= limit:
        if cost:
            count += cost
            state = (start, count)
        reset = reset_after if count else 0.0
        return state, _decision((True, limit, limit - count, reset, None, rule.name, None, reset))
    return state, _decision(
        (
            False,
            limit,
            limit - count if count < limit else 0,
            reset_after,
            reset_after,
            rule.name,
            None,
            reset_after,
        )
    )


def fixed_window_fresh_at(state: State, rule: Rule) -> float:
    start: float = state[0]
    return start + rule.period


# --------------------------------------------------------------------------- sliding log
# state: a sorted tuple of the times of admitted units still inside the window (one
# entry per unit of cost, so memory is bounded by the limit). An entry at t counts
# for now in (t, t + period) and is gone at now = t + period.


def sliding_log(state: State, now: float, rule: Rule, cost: int) -> tuple[State, Decision]:
    period = rule.period
    limit = rule.limit
    if state:
        drop = bisect_right(state, now - period)
        live = state[drop:] if drop else state
    else:
        live = ()
    count = len(live)
    need = cost or 1
    # One more unit comes back when the oldest live entry expires; with more
    # entries than the limit (a limit lowered at runtime), when enough of them
    # have expired that one fits: nothing is left until then, not less.
    if need > limit:
        return _impossible(
            state,
            rule,
            limit - count if count < limit else 0,
            live[-1] + period - now if live else 0.0,
            live[count - limit if count > limit else 0] + period - now if live else 0.0,
        )
    if count + need <= limit:
        if cost:
            stamp = now if not live or now >= live[-1] else live[-1]
            live = live + (stamp,) * cost
            state = live
        return state, _decision(
            (
                True,
                limit,
                limit - len(live),
                live[-1] + period - now if live else 0.0,
                None,
                rule.name,
                None,
                live[0] + period - now if live else 0.0,
            )
        )
    return state, _decision(
        (
            False,
            limit,
            limit - count if count < limit else 0,
            live[-1] + period - now,
            live[count + need - limit - 1] + period - now,
            rule.name,
            None,
            live[count - limit if count > limit else 0] + period - now,
        )
    )


def sliding_log_fresh_at(state: State, rule: Rule) -> float:
    return state[-1] + rule.period if state else -math.inf


# --------------------------------------------------------------------------- sliding window
# state: (window_start, previous_count, current_count). The estimate is
# previous * (fraction of the previous window still inside the sliding window)
# + current. Windows are aligned like the fixed window's.


def sliding_window(state: State, now: float, rule: Rule, cost: int) -> tuple[State, Decision]:
    period = rule.period
    limit = rule.limit
    if state is None:
        start = _aligned(now, period)
        prev = 0
        curr = 0
    else:
        start, prev, curr = state
        if now >= start + period:
            start, windows = _advance(start, now, period)
            prev = curr if windows == 1 else 0
            curr = 0
    weight = (period - (now - start)) / period
    if weight > 1.0:
        weight = 1.0
    elif weight < 0.0:
        weight = 0.0
    estimate = prev * weight + curr
    need = cost or 1
    if need > limit:
        remaining = _floor(limit - estimate + EPS)
        remaining = remaining if remaining > 0 else 0
        return _impossible(
            state,
            rule,
            remaining,
            _sw_reset(start, prev, curr, now, period),
            _sw_next(remaining, start, prev, curr, now, period, limit),
        )
    if estimate + need <= limit + EPS:
        if cost:
            curr += cost
            estimate += cost
            state = (start, prev, curr)
        remaining = _floor(limit - estimate + EPS)
        remaining = remaining if remaining > 0 else 0
        return state, _decision(
            (
                True,
                limit,
                remaining,
                _sw_reset(start, prev, curr, now, period),
                None,
                rule.name,
                None,
                _sw_next(remaining, start, prev, curr, now, period, limit),
            )
        )
    remaining = _floor(limit - estimate + EPS)
    remaining = remaining if remaining > 0 else 0
    retry_after = _sw_wait(need, start, prev, curr, now, period, limit)
    return state, _decision(
        (
            False,
            limit,
            remaining,
            _sw_reset(start, prev, curr, now, period),
            retry_after,
            rule.name,
            None,
            _sw_next(remaining, start, prev, curr, now, period, limit),
        )
    )


def _sw_wait(
    need: int, start: float, prev: int, curr: int, now: float, period: float, limit: int
) -> float:
    """Seconds until ``need`` units fit under the estimate (``need <= limit``)."""
    if curr + need <= limit and prev:
        # Wait inside this window until enough of the previous window has slid out.
        retry_at = start + period * (1.0 - (limit - curr - need) / prev)
    elif curr:
        # Wait until the current count becomes the previous one and has slid enough.
        retry_at = start + period + period * (1.0 - (limit - need) / curr)
    else:
        return 0.0
    wait = retry_at - now
    # Called only when ``need`` units do not fit under the estimate now; a
    # retry_at at or before now is rounding (the estimate's product with the
    # window's weight, at Unix-time magnitudes: 2 units of a 0.1 s window came
    # 5e-6 units short). Never 0.0, which says nothing is to wait for (a whole
    # quota): one microsecond, the decision API's resolution, by which the
    # estimate has slid further than that rounding (hypothesis found r=0, t=0).
    return wait if wait > SW_MIN_WAIT else SW_MIN_WAIT


def _sw_next(
    remaining: int, start: float, prev: int, curr: int, now: float, period: float, limit: int
) -> float:
    """Seconds until ``remaining + 1`` units fit (0.0 when the quota is whole).

    Unlike the other algorithms this can exceed the period: units admitted
    early in a window keep weighing on the estimate through the next one.
    """
    if remaining >= limit:
        return 0.0
    return _sw_wait(remaining + 1, start, prev, curr, now, period, limit)


def _sw_reset(start: float, prev: int, curr: int, now: float, period: float) -> float:
    if curr:
        return start + 2 * period - now
    if prev:
        return start + period - now
    return 0.0


def sliding_window_fresh_at(state: State, rule: Rule) -> float:
    start: float
    start, _prev, curr = state
    if curr:
        return start + 2 * rule.period
    return start + rule.period


# --------------------------------------------------------------------------- handoff format


def _tb_rel(state: State, now: float) -> list[float]:
    return [state.real, state.imag - now]


def _tb_abs(rel: list[Any], now: float) -> State:
    tokens, last = rel
    return complex(float(tokens), now + float(last))


def _gcra_rel(state: State, now: float) -> list[float]:
    return [state - now]


def _gcra_abs(rel: list[Any], now: float) -> State:
    return now + float(rel[0])


def _fw_rel(state: State, now: float) -> list[float]:
    return [state[0] - now, state[1]]


def _fw_abs(rel: list[Any], now: float) -> State:
    return (now + float(rel[0]), int(rel[1]))


def _log_rel(state: State, now: float) -> list[float]:
    return [t - now for t in state]


def _log_abs(rel: list[Any], now: float) -> State:
    return tuple(sorted(now + float(t) for t in rel))


def _sw_rel(state: State, now: float) -> list[float]:
    return [state[0] - now, state[1], state[2]]


def _sw_abs(rel: list[Any], now: float) -> State:
    return (now + float(rel[0]), int(rel[1]), int(rel[2]))


# --------------------------------------------------------------------------- the receiving rule
# A transferred state was made under the sender's rule, which may have had a larger
# burst or limit (lowered at runtime between the export and the import). It is kept
# as the receiving rule can hold it: spent or full, never more than its capacity.
# Only the shapes that can hold more are clamped: a GCRA ``tat`` in the past is a
# full bucket already, and a sliding window's estimate is floored where it is read.


def _tb_clamp(state: State, rule: Rule) -> State:
    """Tokens above the capacity (the bucket answered remaining 999999999 and a
    negative reset_after) become a full bucket, no more."""
    if state.real <= rule.capacity:
        return state
    return complex(float(rule.capacity), state.imag)


def _fw_clamp(state: State, rule: Rule) -> State:
    """A count over the limit (remaining would be negative) is a spent window."""
    start, count = state
    return state if count <= rule.limit else (start, rule.limit)


def _log_clamp(state: State, rule: Rule) -> State:
    """More entries than the limit: the newest ``limit`` are kept, so the next
    unit comes back when it would have with all of them (the oldest of those
    expires), and the log stays within the limit the store bounds it by."""
    return state if len(state) <= rule.limit else state[-rule.limit :]


# --------------------------------------------------------------------------- checking the format
# A state arrives from a peer (handoff, pull, replica) in the relative format above.
# Each check below accepts exactly what the matching ``to_relative`` can produce
# (within generous bounds that hold for every valid rule), so a record that passes
# becomes a state every decision, eviction and later export can work with: no
# NaN or infinity (a state that never refills or never expires), no wrong arity
# (an exception on every request of that user), no negative or fractional count.

#: The widest span a relative time can have: a GCRA state is at most
#: burst * period / limit ahead, with burst and period at their maxima.
MAX_SPAN = float(MAX_LIMIT) * MAX_PERIOD
#: How far ahead of the sender's now a time that records the past (a bucket's
#: update, a window's start, a logged request) may be: only a sender whose clock
#: stepped back produces one. Further ahead, the state would stop refilling.
MAX_AHEAD = 3600.0
#: Float slack below an empty bucket (``tokens -= cost`` after ``tokens + EPS >= cost``).
_TOKENS_FLOOR = -1e-6


def _time(value: Any, what: str, ahead: float = MAX_SPAN) -> float:
    # NaN fails both comparisons; so do infinities and anything that is not a number.
    if type(value) not in (float, int) or not -MAX_SPAN <= value <= ahead:
        raise ValueError(
            f"{what} must be a finite number of seconds, at most {ahead:g} ahead, got {value!r}"
        )
    return float(value)


def _count(value: Any, what: str) -> int:
    if type(value) is not int or not 0 <= value <= MAX_LIMIT:
        raise ValueError(f"{what} must be an integer 0..{MAX_LIMIT}, got {value!r}")
    return value


def _arity(rel: Any, n: int, shape: str) -> None:
    if type(rel) is not list or len(rel) != n:
        raise ValueError(f"state must be a list {shape}, got {rel!r}"[:200])


_NUM = (float, int)
_S = MAX_SPAN
_A = MAX_AHEAD
_L = MAX_LIMIT

# Each check is written out (no helper calls on success): a million-key handoff
# is checked record by record, so these are on a bulk path. On failure they
# call the helpers above, which say what was wrong.


def _tb_check(rel: Any) -> None:
    if not (
        type(rel) is list
        and len(rel) == 2
        and type(rel[0]) in _NUM
        and _TOKENS_FLOOR <= rel[0] <= _L
        and type(rel[1]) in _NUM
        and -_S <= rel[1] <= _A
    ):
        _arity(rel, 2, "[tokens, updated_at]")
        tokens = rel[0]
        if type(tokens) not in _NUM or not _TOKENS_FLOOR <= tokens <= _L:
            raise ValueError(f"tokens must be a finite number 0..{_L}, got {tokens!r}")
        _time(rel[1], "updated_at", _A)


def _gcra_check(rel: Any) -> None:
    if not (type(rel) is list and len(rel) == 1 and type(rel[0]) in _NUM and -_S <= rel[0] <= _S):
        _arity(rel, 1, "[tat]")
        _time(rel[0], "tat")


def _fw_check(rel: Any) -> None:
    if not (
        type(rel) is list
        and len(rel) == 2
        and type(rel[0]) in _NUM
        and -_S <= rel[0] <= _A
        and type(rel[1]) is int
        and 0 <= rel[1] <= _L
    ):
        _arity(rel, 2, "[window_start, count]")
        _time(rel[0], "window_start", _A)
        _count(rel[1], "count")


def _log_check(rel: Any) -> None:
    if type(rel) is not list or len(rel) > MAX_LOG_LIMIT:
        raise ValueError(f"state must be a list of at most {MAX_LOG_LIMIT} times")
    for t in rel:
        if type(t) not in _NUM or not -_S <= t <= _A:
            _time(t, "a logged time", _A)


def _sw_check(rel: Any) -> None:
    if not (
        type(rel) is list
        and len(rel) == 3
        and type(rel[0]) in _NUM
        and -_S <= rel[0] <= _A
        and type(rel[1]) is int
        and 0 <= rel[1] <= _L
        and type(rel[2]) is int
        and 0 <= rel[2] <= _L
    ):
        _arity(rel, 3, "[window_start, previous, current]")
        _time(rel[0], "window_start", _A)
        _count(rel[1], "previous")
        _count(rel[2], "current")


def check_relative(algorithm: str, rel: Any) -> None:
    """Raise ``ValueError`` unless ``rel`` is a valid relative state of ``algorithm``.

    Pure: it looks at nothing but its arguments.
    """
    found = REGISTRY.get(algorithm) if type(algorithm) is str else None
    if found is None:
        raise ValueError(f"unknown algorithm {algorithm!r}"[:200])
    found.check(rel)


class Algorithm(NamedTuple):
    """An algorithm's free functions, looked up by name."""

    name: str
    decide: DecideFn
    fresh_at: Callable[[State, Rule], float]
    to_relative: Callable[[State, float], list[Any]]
    from_relative: Callable[[list[Any], float], State]
    #: Raises ValueError unless its argument is a valid relative state.
    check: Callable[[Any], None]
    #: The state as ``rule`` can hold it (a transfer's, made under another
    #: rule); None where every valid state already fits.
    clamp: Callable[[State, Rule], State] | None = None


REGISTRY: dict[str, Algorithm] = {
    "token_bucket": Algorithm(
        "token_bucket",
        token_bucket,
        token_bucket_fresh_at,
        _tb_rel,
        _tb_abs,
        _tb_check,
        _tb_clamp,
    ),
    "gcra": Algorithm("gcra", gcra, gcra_fresh_at, _gcra_rel, _gcra_abs, _gcra_check),
    "fixed_window": Algorithm(
        "fixed_window",
        fixed_window,
        fixed_window_fresh_at,
        _fw_rel,
        _fw_abs,
        _fw_check,
        _fw_clamp,
    ),
    "sliding_log": Algorithm(
        "sliding_log",
        sliding_log,
        sliding_log_fresh_at,
        _log_rel,
        _log_abs,
        _log_check,
        _log_clamp,
    ),
    "sliding_window": Algorithm(
        "sliding_window", sliding_window, sliding_window_fresh_at, _sw_rel, _sw_abs, _sw_check
    ),
}


def exhausted(rule: Rule, at: float) -> tuple[State, float]:
    """A state whose whole capacity was spent at ``at``, and when it is fresh again.

    The conservative crash policy's starting point (node/shardcore.py ``_exhaust``, and
    the simulations): a fresh state charged ``capacity`` units by the engine itself.
    It is fresh again up to two periods later (sliding window), or later still for a
    bucket with burst > limit.
    """
    algorithm = REGISTRY[rule.algorithm]
    state, _ = algorithm.decide(None, at, rule, rule.capacity)
    return state, algorithm.fresh_at(state, rule)


def exhausted_for(rule: Rule) -> float:
    """How long a state exhausted at once stays distinguishable from a fresh one."""
    return exhausted(rule, 0.0)[1]


def decide(state: State, now: float, rule: Rule, cost: int) -> tuple[State, Decision]:
    """Dispatch on the rule's algorithm (convenience; hot paths bind the function)."""
    return REGISTRY[rule.algorithm].decide(state, now, rule, cost)
