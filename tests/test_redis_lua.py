"""The Lua scripts against the Python engine: the same inputs must give the same decisions.

Every sequence of checks goes both through :class:`node.store.MemoryStore`
(the engine) and through the scripts on a real Redis with injected time, and
after every step the decisions and the stored states must agree.
"""

from __future__ import annotations

import math
import os
import random
import re
from collections.abc import Iterator

import pytest
import redis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from node import algorithms
from node.algorithms import REGISTRY, decide
from node.lua import CHECK, SCRIPTS, STANDALONE, Script, pack_args, source, unpack_reply
from node.redis_backend import state_key
from node.rules import ALGORITHMS, Rule
from node.store import MemoryStore
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis

PREFIX = "t"
USERS = ("alice", "b{o}b", "")
#: Far beyond any test's run time: with injected time, Redis's own expiry clock must
#: never drop a state the engine (which only forgets on sweep) still holds.
SLACK_MS = 10**9
TIME_TOLERANCE = 1e-3
#: Every example makes dozens of Redis round trips, so shrinking a failure can take
#: minutes (past the suite's timeout). By default a failure is reported unshrunk (the
#: assertion names the failing step); RINGLIMIT_REDIS_SHRINK=1 shrinks it.
PHASES = (
    tuple(Phase)
    if os.environ.get("RINGLIMIT_REDIS_SHRINK") == "1"
    else (Phase.explicit, Phase.reuse, Phase.generate)
)


@pytest.fixture(scope="module")
def client(redis_server: RedisServer) -> Iterator[redis.Redis]:
    redis_server.start()
    with redis_server.client() as c:
        for script in SCRIPTS.values():
            c.script_load(script.source)
        yield c


def call(
    client: redis.Redis,
    script: Script,
    user: str,
    rules: list[Rule],
    now: float | None,
    cost: int,
    slack_ms: int = SLACK_MS,
):
    keys = [state_key(PREFIX, user, rule) for rule in rules]
    reply = client.evalsha(script.sha, len(keys), *keys, *pack_args(now, cost, rules, slack_ms))
    return unpack_reply(reply, rules)


def redis_state(client: redis.Redis, user: str, rule: Rule):
    """The state Redis holds, in the engine's shape (None when absent)."""
    key = state_key(PREFIX, user, rule)
    if rule.algorithm == "sliding_log":
        entries: list[tuple[bytes, float]] = client.zrange(key, 0, -1, withscores=True)  # type: ignore[assignment]
        return tuple(score for _member, score in entries) if entries else None
    raw = client.get(key)
    if raw is None:
        return None
    fields = [float(x) for x in raw.split()]
    if rule.algorithm == "gcra":
        (tat,) = fields
        return tat
    if rule.algorithm == "token_bucket":
        tokens, updated_at = fields
        return complex(tokens, updated_at)
    return tuple(fields)


def fresh_at(rule: Rule, state) -> float:
    return REGISTRY[rule.algorithm].fresh_at(state, rule)


def assert_same_verdict(lua, py, context: str) -> None:
    assert lua.allowed == py.allowed, context
    assert len(lua.decisions) == len(py.decisions), context
    for got, want in zip(lua.decisions, py.decisions, strict=True):
        assert got.rule == want.rule, context
        assert got.allowed == want.allowed, context
        assert got.limit == want.limit, context
        assert got.remaining == want.remaining, context
        assert got.reason == want.reason, context
        assert got.reset_after == pytest.approx(want.reset_after, abs=TIME_TOLERANCE), context
        assert got.available_after == pytest.approx(want.available_after, abs=TIME_TOLERANCE), (
            context
        )
        assert (got.retry_after is None) == (want.retry_after is None), context
        if want.retry_after is not None:
            assert got.retry_after == pytest.approx(want.retry_after, abs=TIME_TOLERANCE), context
    assert lua.decision.rule == py.decision.rule, context


# --------------------------------------------------------------------------- strategies

periods = st.one_of(
    st.sampled_from([0.5, 1.0, 2.5, 10.0, 60.0]),
    st.floats(0.01, 100.0, allow_nan=False, allow_infinity=False),
)
rule_specs = st.tuples(
    st.sampled_from(ALGORITHMS),
    st.integers(1, 8),
    periods,
    st.one_of(st.just(0), st.integers(1, 10)),
)
#: A time step: ("d", seconds) moves by a delta (back a little, nothing, or forward);
#: ("b", i) jumps exactly onto the next window boundary of rule i; ("p", i) moves by
#: exactly rule i's period (a sliding log entry then sits right on the cutoff);
#: ("i", i) moves by 1-4 emission intervals of rule i (buckets exactly refilled).
steps_in_time = st.one_of(
    st.tuples(st.just("d"), st.just(0.0)),
    st.tuples(st.just("d"), st.floats(-0.5, 0.0)),
    st.tuples(st.just("d"), st.floats(0.0, 0.5)),
    st.tuples(st.just("d"), st.floats(0.0, 5.0)),
    st.tuples(st.just("d"), st.floats(0.0, 150.0)),
    st.tuples(st.just("b"), st.integers(0, 3)),
    st.tuples(st.just("p"), st.integers(0, 3)),
    st.tuples(st.just("i"), st.integers(0, 15)),
)


def advance(now: float, rules: list[Rule], kind: str, step: float) -> float:
    if kind == "d":
        return now + step
    rule = rules[int(step) % len(rules)]
    if kind == "b":
        return (math.floor(now / rule.period) + 1) * rule.period
    if kind == "p":
        return now + rule.period
    return now + (int(step) // 4 + 1) * rule.interval


@st.composite
def scenarios(draw):
    specs = draw(st.lists(rule_specs, min_size=1, max_size=4))
    rules = [
        Rule(f"r{i}", limit, period, algorithm, burst)
        for i, (algorithm, limit, period, burst) in enumerate(specs)
    ]
    index = st.integers(0, len(rules) - 1)
    rule_sets = draw(
        st.lists(st.lists(index, min_size=1, max_size=3, unique=True), min_size=1, max_size=3)
    )
    start = draw(
        st.one_of(
            st.floats(0.0, 2e9, allow_nan=False),
            st.integers(0, 2 * 10**9).map(float),
            st.just(1_000_000.0),
        )
    )
    ops = draw(
        st.lists(
            st.tuples(
                st.integers(0, len(USERS) - 1),
                steps_in_time,
                st.integers(0, 11),
                st.integers(0, len(rule_sets) - 1),
                st.booleans(),
            ),
            min_size=8,
            max_size=40,
        )
    )
    # Each rule set also as it is after its rules' limits and bursts were lowered
    # at runtime (same names, same states): some ops decide with that.
    lowered = [
        Rule(r.name, max(1, r.limit // 3), r.period, r.algorithm, r.burst // 3) for r in rules
    ]
    lowering = draw(st.lists(st.booleans(), min_size=len(ops), max_size=len(ops)))
    sets = [[rules[i] for i in chosen] for chosen in rule_sets]
    sets += [[lowered[i] for i in chosen] for chosen in rule_sets]
    ops = [
        (u, step, cost, set_i + (len(rule_sets) if low else 0), standalone)
        for (u, step, cost, set_i, standalone), low in zip(ops, lowering, strict=True)
    ]
    return rules, sets, start, ops


# --------------------------------------------------------------------------- differential


@settings(
    max_examples=max(150, settings().max_examples),
    deadline=None,
    phases=PHASES,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenario=scenarios())
def test_lua_matches_the_engine(client: redis.Redis, scenario) -> None:
    rules, rule_sets, now, ops = scenario
    client.flushdb()
    store = MemoryStore()
    for n, (user_i, (kind, step), cost, set_i, standalone) in enumerate(ops):
        now = advance(now, rules, kind, step)
        user = USERS[user_i]
        chosen = rule_sets[set_i]
        script = STANDALONE[chosen[0].algorithm] if len(chosen) == 1 and standalone else CHECK
        before = [store.get(rule, user) for rule in chosen]
        want = store.check(user, chosen, now, cost)
        used_now, got = call(client, script, user, chosen, now, cost)
        context = f"step {n}: user={user!r} now={now!r} cost={cost} rules={chosen!r}"
        assert used_now == now, context
        assert_same_verdict(got, want, context)
        for rule, old in zip(chosen, before, strict=True):
            state = store.get(rule, user)
            assert redis_state(client, user, rule) == state, f"{context}: state of {rule.name}"
            if state is not old and state is not None:
                # Just written: the TTL ends when the state is fresh again (+ slack).
                ttl = client.pttl(state_key(PREFIX, user, rule))
                expected = math.ceil((fresh_at(rule, state) - now) * 1000) + SLACK_MS
                assert expected - 1000 <= ttl <= expected, f"{context}: TTL of {rule.name}"


def _edge_case(rng: random.Random, algorithm: str) -> tuple[Rule, list[tuple[float, int]]]:
    """A rule and checks at exact multiples of its emission interval (rounding edges)."""
    period = rng.choice([0.1, 0.3, 0.7, 1.0, 3.0, 7.0, 60.0, rng.uniform(0.01, 100.0)])
    rule = Rule("e", rng.randint(1, 8), period, algorithm, rng.choice([0, rng.randint(1, 10)]))
    now = rng.choice([0.0, 1_000_000.0, rng.uniform(0, 2e9), float(rng.randint(0, 2 * 10**9))])
    ops = []
    for _ in range(rng.randint(3, 20)):
        roll = rng.random()
        if roll < 0.5:
            now += rng.randint(1, 4) * rule.interval
        elif roll < 0.6:
            now += rule.period
        elif roll < 0.7:
            now += rng.uniform(0.0, 1.0)
        ops.append((now, rng.randint(0, rule.capacity)))
    return rule, ops


def _engine(rule: Rule, ops: list[tuple[float, int]]) -> list[tuple[bool, int]]:
    store = MemoryStore()
    return [
        (v.allowed, v.decision.remaining)
        for v in (store.check("u", [rule], now, cost) for now, cost in ops)
    ]


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra", "sliding_window"])
def test_eps_slack_decides_alike(
    client: redis.Redis, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sequences whose answers change without the engine's EPS slacks, replayed in Lua."""
    rng = random.Random(f"eps-{algorithm}")
    cases = []
    for _ in range(3000):
        rule, ops = _edge_case(rng, algorithm)
        with monkeypatch.context() as patch:
            patch.setattr(algorithms, "EPS", 0.0)
            patch.setattr(algorithms, "UNIT_EPS", 0.0, raising=False)
            without_slack = _engine(rule, ops)
        if without_slack != _engine(rule, ops):
            cases.append((rule, ops))
            if len(cases) == 25:
                break
    assert len(cases) >= 10, "too few sequences where EPS decides; the search needs care"
    for n, (rule, ops) in enumerate(cases):
        client.flushdb()
        store = MemoryStore()
        for now, cost in ops:
            script = CHECK if n % 2 else STANDALONE[algorithm]
            _, got = call(client, script, "u", [rule], now, cost)
            assert_same_verdict(got, store.check("u", [rule], now, cost), f"{rule!r} {ops!r}")
            assert redis_state(client, "u", rule) == store.get(rule, "u")


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_window"])
def test_a_first_window_at_a_rounding_boundary_holds_now(
    client: redis.Redis, algorithm: str
) -> None:
    """1800000001.1 / 0.1 rounds to 18000000010.999996: the window floor() gives
    ends exactly at now. Both the engine and the scripts correct it
    (node.algorithms._aligned, prelude.lua's aligned): the window holds now,
    so its time left is positive and its state is the same."""
    rule = Rule("w", 1, 0.1, algorithm)
    now = 1_800_000_001.1
    assert math.floor(now / 0.1) * 0.1 + 0.1 == now  # the boundary this is about
    for script in (STANDALONE[algorithm], CHECK):
        client.flushdb()
        store = MemoryStore()
        want = store.check("u", [rule], now, 1)
        _, got = call(client, script, "u", [rule], now, 1)
        assert want.decision.reset_after > 0, want
        assert_same_verdict(got, want, f"{algorithm} at {now!r}")
        assert redis_state(client, "u", rule) == store.get(rule, "u")
        start = store.get(rule, "u")[0]
        assert start <= now < start + rule.period


def test_a_sliding_windows_wait_lost_to_rounding_is_a_microsecond_in_lua_too(
    client: redis.Redis,
) -> None:
    """2 per 0.1 s, drained, then 0.1 s on: the estimate comes 5e-6 units short of
    a whole one, whose wait rounded to 0 (r=0 with t=0: tests/test_standards.py).
    Both the engine and the scripts say one microsecond (SW_MIN_WAIT)."""
    rule = Rule("w", 2, 0.1, "sliding_window")
    start = 1_800_000_000.0
    steps = [(start + 0.25, 2), (start + 0.25 + 0.1, 0)]
    for script in (STANDALONE["sliding_window"], CHECK):
        client.flushdb()
        store = MemoryStore()
        for now, cost in steps:
            want = store.check("u", [rule], now, cost)
            _, got = call(client, script, "u", [rule], now, cost)
            assert_same_verdict(got, want, f"sliding_window at {now!r}")
        assert want.decision.remaining == got.decision.remaining == 0
        # (Beyond assert_same_verdict's tolerance: 0.0 is what was wrong.)
        assert want.decision.available_after == algorithms.SW_MIN_WAIT
        assert got.decision.available_after == pytest.approx(algorithms.SW_MIN_WAIT, rel=1e-6)


def test_denied_multi_rule_call_changes_nothing(client: redis.Redis) -> None:
    client.flushdb()
    roomy = Rule("roomy", 10, 60.0, "sliding_log")
    tight = Rule("tight", 1, 60.0, "fixed_window")
    rules = [roomy, tight]
    _, first = call(client, CHECK, "u", rules, 120.0, 1)
    assert first.allowed
    snapshot = {r.name: redis_state(client, "u", r) for r in rules}
    ttls = {r.name: client.pttl(state_key(PREFIX, "u", r)) for r in rules}
    _, second = call(client, CHECK, "u", rules, 121.0, 1)
    assert not second.allowed
    assert second.decision.rule == "tight"
    # The allowing rule shows a peek: what is really left, not what would have been.
    assert second.decisions[0].allowed and second.decisions[0].remaining == 9
    assert {r.name: redis_state(client, "u", r) for r in rules} == snapshot
    for r in rules:
        assert client.pttl(state_key(PREFIX, "u", r)) <= ttls[r.name]


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_bucket_fresh_again_in_a_million_years_is_stored(
    client: redis.Redis, algorithm: str
) -> None:
    """A bucket's fresh_at can lie ~3e16 s ahead (burst 1e9, 1 per 366 days): more
    milliseconds than Redis's PX accepts (~9.2e18). The script used to fail with
    "invalid expire time" after committing the rules before it, so a check that
    errored had consumed the first rule's units."""
    client.flushdb()
    roomy = Rule("roomy", 10**9, 60.0)
    slow = Rule("slow", 1, 366 * 86400.0, algorithm, burst=10**9)
    rules = [roomy, slow]
    store = MemoryStore()
    now = 1_000_000.0
    for cost in (3 * 10**8, 1):
        want = store.check("u", rules, now, cost)
        _, got = call(client, CHECK, "u", rules, now, cost)
        assert_same_verdict(got, want, f"cost={cost}")
        for rule in rules:
            assert redis_state(client, "u", rule) == store.get(rule, "u"), rule.name
            # Stored for longer than any test (a capped TTL, not none and not an error).
            assert client.pttl(state_key(PREFIX, "u", rule)) > SLACK_MS, rule.name
        now += 1.0


def test_large_cost_on_the_sliding_log(client: redis.Redis) -> None:
    # More units than one ZADD batch, several at one time stamp.
    client.flushdb()
    rule = Rule("log", 5000, 60.0, "sliding_log")
    store = MemoryStore()
    for now, cost in ((10.0, 2500), (10.0, 2100), (9.5, 300), (10.0, 200), (71.0, 4999)):
        _, got = call(client, STANDALONE["sliding_log"], "u", [rule], now, cost)
        want = store.check("u", [rule], now, cost)
        assert_same_verdict(got, want, f"now={now} cost={cost}")
        assert redis_state(client, "u", rule) == store.get(rule, "u")
    assert client.zcard(state_key(PREFIX, "u", rule)) == 4999


def test_redis_time_mode_matches_the_engine_at_the_scripts_now(client: redis.Redis) -> None:
    client.flushdb()
    rules = [Rule(f"t{i}", 3, 60.0, alg) for i, alg in enumerate(ALGORITHMS)]
    store = MemoryStore()
    redis_now = float(client.time()[0])
    for cost in (1, 1, 0, 1, 1, 2):
        used_now, got = call(client, CHECK, "u", rules, None, cost, slack_ms=0)
        assert abs(used_now - redis_now) < 60.0
        assert_same_verdict(got, store.check("u", rules, used_now, cost), f"cost={cost}")
    for rule in rules:
        _, got = call(client, STANDALONE[rule.algorithm], "solo", [rule], None, 1, slack_ms=0)
        assert got.allowed and got.decision.remaining == 2


def test_scripts_reject_bad_calls(client: redis.Redis) -> None:
    rule = Rule("r", 3, 60.0)
    key = state_key(PREFIX, "u", rule)
    with pytest.raises(redis.ResponseError, match="bad call header"):
        client.evalsha(CHECK.sha, 1, key, "1.0", "-1", "0", *pack_args(1.0, 1, [rule])[3:])
    with pytest.raises(redis.ResponseError, match="not in this script"):
        client.evalsha(STANDALONE["gcra"].sha, 1, key, *pack_args(1.0, 1, [rule]))
    with pytest.raises(redis.ResponseError, match="6 ARGV per key"):
        client.evalsha(CHECK.sha, 2, key, key, *pack_args(1.0, 1, [rule]))


def test_fresh_decisions_match_the_engine_for_every_algorithm(client: redis.Redis) -> None:
    client.flushdb()
    for i, algorithm in enumerate(ALGORITHMS):
        rule = Rule(f"f{i}", 4, 10.0, algorithm, burst=6)
        for cost in (0, 1, 4, 6, 7):
            _, got = call(client, STANDALONE[algorithm], f"user{cost}", [rule], 1234.5, cost)
            want = decide(None, 1234.5, rule, cost)[1]
            assert got.decision == want, (algorithm, cost)


# --------------------------------------------------------------------------- the files


@pytest.mark.parametrize("name", [*ALGORITHMS, "prelude", "check"])
def test_every_lua_file_opens_with_its_keys_and_argv(name: str) -> None:
    text = source(name)
    header = re.match(r"(?:--[^\n]*\n)+", text)
    assert header, f"{name}.lua must open with a comment"
    assert "KEYS" in header.group(0) and "ARGV" in header.group(0), name
    assert text.startswith(f"-- {name}.lua")


def test_standalone_scripts_hold_one_algorithm_each() -> None:
    for algorithm, script in STANDALONE.items():
        assert script.algorithms == {algorithm}
        assert f"ALG.{algorithm} =" in script.source
        others = set(ALGORITHMS) - {algorithm}
        assert not any(f"ALG.{other} =" in script.source for other in others)
    assert CHECK.algorithms == set(ALGORITHMS)
    assert len({s.sha for s in SCRIPTS.values()}) == len(SCRIPTS)
