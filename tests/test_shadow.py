"""Shadow rules: decided and counted like enforced rules, never denying.

The reference for "counted" is the same rule enforced alone: a shadow rule's
would-be denials must be exactly the denials that enforcing it alone would
cause on the same traffic, and the enforced rules beside it must decide
exactly as if it were not there.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.authority import Authority
from node.clock import FrozenClock
from node.config import ClusterConfig, ConfigError, ScopedRule
from node.metrics import NodeMetrics
from node.redis_backend import RedisBackend
from node.rules import ALGORITHMS, Rule, parse_rule
from router.testing import InProcessCluster

pytestmark = pytest.mark.anyio


def authority(rules: tuple[Rule, ...], clock: FrozenClock) -> Authority:
    return Authority.in_memory(
        ClusterConfig(rules=tuple(ScopedRule(r) for r in rules)), clock=clock
    )


#: (seconds to wait, cost) per request.
requests = st.lists(
    st.tuples(st.sampled_from([0.0, 0.0, 0.3, 1.0, 7.0]), st.integers(0, 3)), max_size=60
)


@given(
    requests,
    st.sampled_from(ALGORITHMS),
    st.integers(1, 6),
    st.integers(1, 6),
)
def test_a_shadow_rule_counts_as_if_enforced_alone_and_never_denies(
    steps: list[tuple[float, int]], algorithm: str, shadow_limit: int, enforced_limit: int
) -> None:
    enforced = Rule("enforced", enforced_limit, 10.0, algorithm=algorithm)
    shadow = Rule("shadow", shadow_limit, 10.0, algorithm=algorithm, shadow=True)
    clock, ref_clock = FrozenClock(), FrozenClock()
    both = authority((enforced, shadow), clock)
    enforced_only = authority((enforced,), ref_clock)
    # What the shadow rule would do if it were the only rule, enforced, on the
    # traffic the enforced rule lets through (a request the enforced rule denies
    # consumes nothing anywhere).
    enforced_shadow = shadow.with_(shadow=False)
    shadow_alone = authority((enforced_shadow,), ref_clock)

    async def run() -> None:
        for wait, cost in steps:
            clock.advance(wait)
            ref_clock.advance(wait)
            verdict = await both.decide("u", (enforced, shadow), cost)
            reference = await enforced_only.decide("u", (enforced,), cost)
            assert verdict.allowed == reference.allowed  # the shadow rule never denies
            assert verdict.decisions[0] == reference.decisions[0]
            if reference.allowed:
                alone = await shadow_alone.decide("u", (enforced_shadow,), cost)
                assert verdict.decisions[1].allowed == alone.allowed
                assert verdict.decisions[1].remaining == alone.decisions[0].remaining

    asyncio.run(run())


async def test_shadow_rules_alone_never_deny_and_are_counted_in_metrics() -> None:
    shadow = Rule("trial", 3, 60.0, algorithm="fixed_window", shadow=True)
    config = ClusterConfig(rules=(ScopedRule(shadow),))
    store_authority = Authority.in_memory(config, clock=FrozenClock())
    metrics = NodeMetrics("n1")
    store_authority.metrics = metrics
    verdicts = [await store_authority.decide("u", (shadow,)) for _ in range(5)]
    assert all(v.allowed for v in verdicts)
    assert [v.decision.allowed for v in verdicts] == [True, True, True, False, False]
    rendered = metrics.render().decode()
    assert 'ringlimit_shadow_denials_total{rule="trial"} 2.0' in rendered
    batch = await store_authority.decide_many([("v", (shadow,), 2), ("v", (shadow,), 2)])
    assert [v.allowed for v in batch] == [True, True]
    assert [v.decision.allowed for v in batch] == [True, False]
    assert 'ringlimit_shadow_denials_total{rule="trial"} 3.0' in metrics.render().decode()


async def test_http_responses_name_would_be_denying_shadow_rules() -> None:
    enforced = Rule("api", 5, 60.0)
    shadow = Rule("trial", 2, 60.0, shadow=True)
    config = ClusterConfig(rules=(ScopedRule(enforced), ScopedRule(shadow)))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        answers = [await cluster.client.get("/", headers={"X-User-Id": "alice"}) for _ in range(6)]
        assert [a.status_code for a in answers] == [200] * 5 + [429]
        assert [a.headers.get("ringlimit-shadow") for a in answers[:5]] == [
            None,
            None,
            '"trial"',
            '"trial"',
            '"trial"',
        ]
        # The client sees only the enforced rule in the rate-limit fields.
        assert answers[0].headers["ratelimit-policy"] == '"api";q=5;w=60'
        assert answers[0].headers["ratelimit"].startswith('"api";r=4')
        assert "ringlimit-shadow" not in answers[5].headers  # denied: nothing was consumed
        # The decision API reports them too.
        result = (await cluster.client.post("/v1/check", json={"key": "bob", "cost": 3})).json()
        assert result["allowed"] is True and result["shadow_denied"] == ["trial"]
        metrics = "".join(
            [
                (await cluster.client.get(f"http://{n}.localhost/metrics")).text
                for n in cluster.nodes
            ]
        )
        assert 'ringlimit_shadow_denials_total{rule="trial"} 4.0' in metrics


def test_shadow_in_toml_in_specs_and_on_the_wire(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from node.config import load_config

    path = tmp_path / "c.toml"
    path.write_text('[[rules]]\nname = "trial"\nrate = "5/minute"\nshadow = true\n')
    config = load_config(path)
    assert config.rules[0].rule.shadow
    assert ClusterConfig.from_dict(config.to_dict()) == config
    assert parse_rule("trial=5/minute;shadow").shadow
    assert not parse_rule("5/minute").shadow
    path.write_text('[[rules]]\nname = "trial"\nrate = "5/minute"\nshadow = "yes"\n')
    with pytest.raises(ConfigError, match=r"rules\[0\]\.shadow"):
        load_config(path)


@pytest.mark.redis
async def test_shadow_rules_on_the_redis_backend(redis_url: str) -> None:
    clock = FrozenClock()
    enforced = Rule("api", 3, 60.0, algorithm="gcra")
    shadow = Rule("trial", 1, 60.0, algorithm="gcra", shadow=True)
    backend = RedisBackend(redis_url, clock=clock, ttl_slack=3600.0, prefix="shadowtest")
    await backend.start()
    try:
        node = Authority(ClusterConfig(rules=(ScopedRule(enforced), ScopedRule(shadow))), backend)
        verdicts = [await node.decide("u", (enforced, shadow)) for _ in range(4)]
        assert [v.allowed for v in verdicts] == [True, True, True, False]
        assert [v.decisions[1].allowed for v in verdicts[:3]] == [True, False, False]
    finally:
        await backend.close()
