"""The response fields against draft-ietf-httpapi-ratelimit-headers-10, field by field.

Every header is parsed with an independent RFC 9651 parser (``http_sf``), and
the relations the draft asks for are checked on every decision hypothesis
finds, for all five algorithms: ``r <= q`` (section 3.1.1: q is the quota
allocated), ``t`` is when more quota is available (section 4.1.2: waiting
``t`` gives at least one more unit, waiting less gives none), ``t <= w`` where
the algorithm makes quota available within a window, ``Retry-After >= t`` of
every rule that denied (section 6), and ``q / w`` is the rule's true rate.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import http_sf
import httpx
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from node.algorithms import UNIT_EPS
from node.authority import Authority
from node.clock import FrozenClock
from node.config import ClusterConfig, ConfigError, Identity, ScopedRule
from node.decision import BACKEND_UNAVAILABLE, Decision, Verdict
from node.headers import QUOTA_EXCEEDED, HeaderCache, rate_limit_headers, rendered
from node.limiter import decide_all
from node.middleware import RateLimitMiddleware
from node.rules import ALGORITHMS, Rule, parse_rule
from tests import sample_app

START = 1_800_000_000.0  # a multiple of every period below
PERIODS = (0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 10.0, 60.0)


def parse(value: bytes) -> dict[str, dict[str, Any]]:
    """An SF list of string items -> {name: parameters}; fails on anything malformed."""
    items = http_sf.parse(value, tltype="list")
    out: dict[str, dict[str, Any]] = {}
    for item, params in items:
        assert isinstance(item, str), value
        out[item] = dict(params)
    return out


def fields(rules: tuple[Rule, ...], verdict: Verdict, **options: Any) -> dict[bytes, bytes]:
    headers = rate_limit_headers(rules, verdict, now=START, **options)
    names = [k for k, _ in headers]
    assert len(names) == len(set(names)), names
    return dict(headers)


def peek(states: list[Any], now: float, rules: tuple[Rule, ...]) -> Verdict:
    return decide_all(states, now, rules, 0)[1]


rule_strategy = st.builds(
    lambda algorithm, limit, period, extra: Rule(
        "r", limit, period, algorithm, burst=limit + extra if extra >= 0 else 0
    ),
    st.sampled_from(ALGORITHMS),
    st.integers(1, 12),
    st.sampled_from(PERIODS),
    st.integers(-1, 10),
)
events = st.lists(
    st.tuples(st.floats(0.0, 30.0).map(lambda x: round(x, 3)), st.integers(0, 3)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=300, deadline=None)
@given(rule_strategy, events)
# GCRA at a 25 ms interval: tat + x - now lost the ulps of Unix time, so one unit
# taken from a full burst gave r=8 (of 10) with t=0 (node.algorithms._gcra_next).
@example(Rule("r", 10, 0.25, "gcra", burst=10), [(0.0, 1)])
# A fixed window of 0.1 s at START + 1.1: 1800000001.1 / 0.1 rounds to ...10.999996, and
# the window floor() gave ended exactly at now: t=0 with r=0 (node.algorithms._aligned).
@example(Rule("r", 1, 0.1, "fixed_window", burst=1), [(1.1, 1)])
@example(Rule("r", 1, 0.1, "sliding_window", burst=1), [(1.1, 1)])
# GCRA 6/minute: a unit 8 ms away showed whole 9 us before t, within UNIT_EPS of it
# (the test's own slack was 0.1% of t; a CI run found it).
@example(
    Rule("r", 6, 60.0, "gcra", burst=6),
    [(0.0, 1), (1.484, 0), (1.648, 0), (1.305, 0), (1.492, 2), (14.594, 2), (29.469, 0)],
)
# A sliding window of 2 per 0.1 s, drained, then 0.1 s on: the estimate came 5e-6
# units short of a whole one, whose wait rounded to 0: r=0 with t=0 (a run found it;
# node.algorithms._sw_wait).
@example(Rule("r", 2, 0.1, "sliding_window", burst=2), [(0.25, 2), (0.1, 0)])
def test_every_field_keeps_the_drafts_relations(rule: Rule, steps: list[tuple[float, int]]) -> None:
    rules = (rule,)
    states: list[Any] = [None]
    now = START
    (policy,) = parse(fields(rules, peek(states, now, rules))[b"ratelimit-policy"]).values()
    q, w = policy["q"], policy["w"]
    assert isinstance(q, int) and isinstance(w, int) and q >= 0 and w >= 1
    # q per w is exactly the rule's sustained rate, in whole seconds (section 3.1.3).
    rate = Fraction(rule.limit) / Fraction(rule.period).limit_denominator(1000)
    assert Fraction(q, w) == rate
    assert q >= rule.capacity
    for dt, cost in steps:
        now += dt
        states, verdict = decide_all(states, now, rules, cost)
        headers = fields(rules, verdict)
        assert parse(headers[b"ratelimit-policy"]) == {"r": {"q": q, "w": w}}
        item = parse(headers[b"ratelimit"])["r"]
        r, t = item["r"], item["t"]
        decision = verdict.decision
        assert 0 <= r <= q
        assert r == decision.remaining
        # The legacy fields repeat the policy item (delta mode: t itself).
        legacy = fields(rules, verdict, legacy_reset="delta")
        assert int(legacy[b"x-ratelimit-limit"]) == q
        assert int(legacy[b"x-ratelimit-remaining"]) == r
        assert int(legacy[b"x-ratelimit-reset"]) == t
        assert int(headers[b"x-ratelimit-reset"]) == math.ceil(START + decision.available_after)
        if rule.algorithm == "sliding_window":
            # Units admitted early in a window weigh on the estimate through the next.
            assert t <= 2 * w
        else:
            assert t <= w
        if verdict.allowed:
            assert b"retry-after" not in headers
        elif decision.retry_after is not None:
            retry = int(headers[b"retry-after"])
            assert retry >= t and retry >= decision.retry_after
        # t is when more quota is available (section 4.1.2), to the float's precision.
        wait = decision.available_after
        later = peek(states, now + wait + 1e-6, rules).decision.remaining
        if wait > 0:
            assert later >= r + 1
            if wait > 1e-3:
                # Counts allow UNIT_EPS of a unit (node.algorithms): a unit may show
                # that much of its time early (10 us for a unit every 10 s).
                early = UNIT_EPS * rule.period / rule.limit
                before = now + wait * 0.999 - 1e-6 - early
                assert peek(states, before, rules).decision.remaining <= r
        else:
            # t == 0: nothing more is to come because the quota is whole now (the
            # bucket full, the window empty): r is all of it, and waiting adds none.
            assert r == rule.capacity, (r, rule.capacity)
            assert later == r
            if not verdict.allowed:  # then only a cost no quota can ever cover is denied
                assert decision.reason == "cost_exceeds_capacity", decision


@settings(max_examples=200, deadline=None)
@given(
    st.lists(rule_strategy, min_size=1, max_size=3),
    events,
    st.booleans(),
    st.sampled_from(["epoch", "delta"]),
    st.booleans(),
)
def test_the_header_cache_renders_what_rate_limit_headers_does(
    rules_list: list[Rule],
    steps: list[tuple[float, int]],
    legacy: bool,
    legacy_reset: str,
    shadow_second: bool,
) -> None:
    """node/headers.py's HeaderCache (what a node sends) answers each verdict
    with rate_limit_headers' fields, and its lines are those fields as uvicorn
    writes them (what a node's front door writes as they are)."""
    rules = tuple(
        Rule(
            f"r{i}", r.limit, r.period, r.algorithm, burst=r.burst, shadow=shadow_second and i == 1
        )
        for i, r in enumerate(rules_list)
    )
    cache = HeaderCache(legacy=legacy, legacy_reset=legacy_reset)
    states: list[Any] = [None] * len(rules)
    now = START
    for dt, cost in steps:
        now += dt
        states, verdict = decide_all(states, now, rules, cost)
        expected = tuple(
            rate_limit_headers(rules, verdict, legacy=legacy, legacy_reset=legacy_reset, now=now)
        )
        for _ in range(2):  # rendered, then remembered
            entry = cache.rendered(rules, verdict, now)
            assert entry.fields == expected
            assert entry.lines == b"".join(b"%s: %s\r\n" % (n.lower(), v) for n, v in expected)
            assert cache.render(rules, verdict, now) == expected


@pytest.mark.parametrize("field", [(b"x-a", b"1\r\nx-b: 2"), (b"x a", b"1"), (b"x-a", b"\x00")])
def test_a_field_uvicorn_would_refuse_is_never_rendered_into_lines(
    field: tuple[bytes, bytes],
) -> None:
    """Lines are written past the front door's per-field checks, so rendering
    checks them as uvicorn does: a bad one is an error, never response splitting."""
    with pytest.raises(ValueError, match="invalid response field"):
        rendered(((b"ratelimit", b"1"), field))


@pytest.mark.parametrize(
    ("algorithm", "t"), [("token_bucket", 12), ("gcra", 12), ("sliding_log", 60)]
)
def test_a_denied_request_waits_t_and_retry_after_alike(algorithm: str, t: int) -> None:
    """The issue's case: 5/minute, drained at once. A bucket refills one unit in 12 s."""
    rules = (Rule("5-per-minute", 5, 60.0, algorithm),)
    states: list[Any] = [None]
    for _ in range(5):
        states, verdict = decide_all(states, START, rules, 1)
    states, verdict = decide_all(states, START, rules, 1)
    headers = fields(rules, verdict)
    assert headers[b"ratelimit"] == f'"5-per-minute";r=0;t={t}'.encode()
    assert headers[b"retry-after"] == str(t).encode()


def test_sliding_window_t_is_when_the_estimate_lets_one_more_in() -> None:
    """Five requests at 20 s into a minute window, then a denial at 40 s: the count
    slides out from 60 s on, and one unit fits at 72 s (t = 32, not 80)."""
    rules = (Rule("w", 5, 60.0, "sliding_window"),)
    states: list[Any] = [None]
    for _ in range(5):
        states, _ = decide_all(states, START + 20, rules, 1)
    states, verdict = decide_all(states, START + 40, rules, 1)
    headers = fields(rules, verdict)
    assert parse(headers[b"ratelimit"]) == {"w": {"r": 0, "t": 32}}
    assert parse(headers[b"ratelimit-policy"]) == {"w": {"q": 5, "w": 60}}
    assert headers[b"retry-after"] == b"32"


def test_burst_is_advertised_as_the_bucket_and_its_refill_time() -> None:
    """10/minute with burst 20: q=20 over the 120 s a drained bucket takes to refill."""
    for algorithm in ("token_bucket", "gcra"):
        rules = (parse_rule("10/minute", algorithm=algorithm, burst=20),)
        _, verdict = decide_all([None], START, rules, 1)
        headers = fields(rules, verdict)
        (name,) = parse(headers[b"ratelimit"])
        assert parse(headers[b"ratelimit-policy"]) == {name: {"q": 20, "w": 120}}
        assert parse(headers[b"ratelimit"]) == {name: {"r": 19, "t": 6}}
        assert headers[b"x-ratelimit-limit"] == b"20"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_sub_second_window_scales_q_not_w(algorithm: str) -> None:
    """10/0.1s allows 100 a second: advertised as q=100;w=1 (not q=10), and about
    1000 is what ten seconds of requests (one every 2.5 ms) get through."""
    rules = (Rule("fast", 10, 0.1, algorithm),)
    _, verdict = decide_all([None], START, rules, 0)
    assert parse(fields(rules, verdict)[b"ratelimit-policy"]) == {"fast": {"q": 100, "w": 1}}
    states: list[Any] = [None]
    allowed = 0
    for i in range(4000):
        states, verdict = decide_all(states, START + i * 0.0025, rules, 1)
        allowed += verdict.allowed
    # (The sliding window counter is conservative: about 90% of the rate.)
    assert 850 <= allowed <= 1000 + rules[0].capacity


def test_denial_headers_cover_every_denying_rule() -> None:
    """Retry-After is at least the t of every rule that denied, not just the acting one."""
    rules = (Rule("a", 1, 60.0, "fixed_window"), Rule("b", 1, 10.0, "fixed_window"))
    decisions = (
        Decision(False, 1, 0, 50.0, None, "a", "cost_exceeds_capacity", 50.0),
        Decision(False, 1, 0, 7.0, 7.0, "b", None, 7.0),
    )
    verdict = Verdict(False, decisions[1], decisions)
    headers = fields(rules, verdict)
    assert parse(headers[b"ratelimit"]) == {"a": {"r": 0, "t": 50}, "b": {"r": 0, "t": 7}}
    assert headers[b"retry-after"] == b"50"


# --------------------------------------------------------------------------- over HTTP

pytestmark_anyio = pytest.mark.anyio


def client(app: Any) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 5555))
    return httpx.AsyncClient(transport=transport, base_url="http://app.test")


def middleware(*rules: Rule, **options: Any) -> tuple[RateLimitMiddleware, FrozenClock]:
    clock = FrozenClock(START)
    config = ClusterConfig(rules=tuple(ScopedRule(r) for r in rules), **options)
    authority = Authority.in_memory(config, clock=clock)
    app = RateLimitMiddleware(
        sample_app.app, authority=authority, trust_router=False, wall_clock=clock
    )
    return app, clock


@pytestmark_anyio
async def test_problem_json_names_every_violated_policy() -> None:
    app, _ = middleware(Rule("minute", 2, 60.0), Rule("burst", 2, 10.0, "fixed_window"))
    async with client(app) as c:
        for _ in range(2):
            assert (await c.get("/", headers={"X-User-Id": "u"})).status_code == 201
        denied = await c.get("/", headers={"X-User-Id": "u"})
    assert denied.status_code == 429
    assert denied.headers["content-type"] == "application/problem+json"
    body = denied.json()
    assert body["type"] == QUOTA_EXCEEDED
    assert body["status"] == 429 and isinstance(body["title"], str)
    assert body["violated-policies"] == ["minute", "burst"]
    # ringlimit's own members are kept as extensions.
    assert body["error"] == "rate_limited" and body["rule"] in ("minute", "burst")
    assert int(denied.headers["retry-after"]) >= max(
        p["t"] for p in parse(denied.headers["ratelimit"].encode()).values()
    )


@pytestmark_anyio
async def test_the_plain_json_body_is_an_option() -> None:
    app, _ = middleware(Rule("one", 1, 60.0), denial_format="json")
    async with client(app) as c:
        await c.get("/", headers={"X-User-Id": "u"})
        denied = await c.get("/", headers={"X-User-Id": "u"})
    assert denied.status_code == 429
    assert denied.headers["content-type"] == "application/json"
    body = denied.json()
    assert "type" not in body
    assert body["error"] == "rate_limited" and body["violated_rules"] == ["one"]


@pytestmark_anyio
async def test_a_closed_rule_without_backend_is_a_plain_503_problem() -> None:
    rules = (Rule("c", 1, 60.0, on_error="closed"),)
    decision = Decision(False, 1, 0, 0.0, None, "c", BACKEND_UNAVAILABLE)
    verdict = Verdict(False, decision, (decision,))

    class Down:
        config = ClusterConfig(rules=tuple(ScopedRule(r) for r in rules))

        async def decide(self, key: str, rules: Any, cost: int = 1) -> Verdict:
            return verdict

    app = RateLimitMiddleware(sample_app.app, authority=Down(), trust_router=False)  # type: ignore[arg-type]
    async with client(app) as c:
        response = await c.get("/", headers={"X-User-Id": "u"})
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    assert response.headers["retry-after"] == "1"  # RFC 9110 15.6.4: when to try again
    body = response.json()
    assert body["type"] == "about:blank" and body["status"] == 503
    assert "violated-policies" not in body and body["reason"] == BACKEND_UNAVAILABLE
    assert body["error"] == "limiter_unavailable"  # not a 429's rate_limited


@pytestmark_anyio
@pytest.mark.parametrize(("mode", "expected"), [("epoch", START + 60), ("delta", 60)])
async def test_legacy_reset_is_a_unix_time_or_seconds(mode: str, expected: float) -> None:
    app, _ = middleware(Rule("f", 3, 60.0, "fixed_window"), legacy_reset=mode)
    async with client(app) as c:
        response = await c.get("/", headers={"X-User-Id": "u"})
    assert response.headers["x-ratelimit-reset"] == str(int(expected))
    assert response.headers["ratelimit"] == '"f";r=2;t=60'


def test_header_options_are_validated_and_round_trip() -> None:
    data = {"headers": {"legacy_reset": "delta", "denial_body": "json"}}
    config = ClusterConfig.from_dict(data)
    assert (config.legacy_reset, config.denial_format) == ("delta", "json")
    assert ClusterConfig.from_dict(config.to_dict()) == config
    defaults = ClusterConfig.from_dict({})
    assert (defaults.legacy_reset, defaults.denial_format) == ("epoch", "problem")
    with pytest.raises(ConfigError, match="legacy_reset"):
        ClusterConfig.from_dict({"headers": {"legacy_reset": "iso"}})
    with pytest.raises(ConfigError, match="denial_body"):
        ClusterConfig.from_dict({"headers": {"denial_body": "xml"}})


# --------------------------------------------------------------------------- user ids


@pytestmark_anyio
async def test_user_ids_that_are_not_utf8_are_refused_not_merged() -> None:
    """b"\\xe9" (latin-1 é) and b"\\xc3\\xa9" (UTF-8 é) must not be one user."""
    app, _ = middleware(Rule("one", 1, 60.0))
    async with client(app) as c:
        utf8 = await c.get("/", headers=[(b"X-User-Id", "é".encode())])
        assert utf8.status_code == 201 and utf8.json()["user"] == "é"
        latin = await c.get("/", headers=[(b"X-User-Id", b"\xe9")])
        assert latin.status_code == 400
        assert latin.json()["error"] == "invalid_user_id"
        assert "UTF-8" in latin.json()["detail"]
        # The UTF-8 user's quota was not touched by the refused request.
        assert (await c.get("/", headers=[(b"X-User-Id", "é".encode())])).status_code == 429


@pytestmark_anyio
async def test_query_user_ids_keep_distinct_bytes_distinct() -> None:
    app, _ = middleware(Rule("one", 1, 60.0), identity=Identity(source="query", name="user"))
    async with client(app) as c:
        first = await c.get("/?user=%C3%A9")
        assert first.status_code == 201 and first.json()["user"] == "é"
        assert (await c.get("/?user=%E9")).status_code == 400
        assert (await c.get("/?user=%FF")).status_code == 400
        assert (await c.get("/?user=%C3%A9")).status_code == 429
        assert (await c.get("/?user=a+b")).json()["user"] == "a b"


@pytestmark_anyio
async def test_the_router_refuses_user_ids_that_are_not_utf8() -> None:
    """The router hashes the user id onto the ring: it refuses the same ids the
    node does, before routing, so distinct bytes never share an owner's key."""
    from router.testing import InProcessCluster

    config = ClusterConfig(rules=(ScopedRule(Rule("one", 1, 60.0)),))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        first = await cluster.client.get("/api", headers=[(b"X-User-Id", "é".encode())])
        assert first.status_code == 200
        latin = await cluster.client.get("/api", headers=[(b"X-User-Id", b"\xe9")])
        assert latin.status_code == 400, latin.text
        assert latin.json()["error"] == "invalid_user_id"
        assert "x-ringlimit-node" not in latin.headers  # refused by the router itself
        again = await cluster.client.get("/api", headers=[(b"X-User-Id", "é".encode())])
        assert again.status_code == 429
