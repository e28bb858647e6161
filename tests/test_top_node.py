"""A node's top limited keys: what its decisions put in the sketch, and how it shows them."""

from __future__ import annotations

import pytest

from node.app import NodeSettings, create_app
from node.clock import FrozenClock
from node.config import ClusterConfig, ScopedRule
from node.rules import Rule
from tests.test_node_api import assert_error, client_for
from tests.test_router import metric

pytestmark = pytest.mark.anyio


CONFIG = ClusterConfig(
    rules=(ScopedRule(Rule("api", 5, 60.0)), ScopedRule(Rule("big", 100, 60.0), paths=("/x",)))
)


async def test_denied_and_near_limit_decisions_are_counted_per_rule() -> None:
    clock = FrozenClock()
    node = create_app(NodeSettings(node_id="n1", config=CONFIG), clock=clock)
    async with client_for(node) as client:
        for _ in range(8):  # 5 allowed (the 5th leaves 0: near the limit), 3 denied
            await client.post("/v1/check", json={"key": "alice", "rule": "api"})
        batch = {"checks": [{"key": "bob", "rule": "api"}] * 6}
        await client.post("/v1/check", json=batch)  # 1 near, 1 denied
        for _ in range(3):  # far from the limit: not counted
            await client.post("/v1/check", json={"key": "carol", "rule": "big"})
        await client.get("/", headers={"X-User-Id": "dave"})  # proxied: 4 remain, not near

        answer = (await client.get("/internal/top", params={"n": 5})).json()
        assert answer["node"] == "n1"
        assert answer["decisions"] == {"allowed": 14, "denied": 4}
        assert answer["top"] == {
            "api": {
                "denied": [["alice", 3, 0], ["bob", 1, 0]],
                "near_limit": [["alice", 1, 0], ["bob", 1, 0]],
            }
        }
        clock.advance(2.0)
        assert answer["rate"] >= 0
        rated = (await client.get("/internal/top", params={"rule": "api", "n": 1})).json()
        assert rated["rate"] == pytest.approx(18 / 2.0)
        assert rated["denied_rate"] == pytest.approx(4 / 2.0)
        assert rated["top"] == {
            "api": {"denied": [["alice", 3, 0]], "near_limit": [["alice", 1, 0]]}
        }

        page = (await client.get("/metrics")).text
        assert metric(page, "ringlimit_top_limited", rule="api", kind="denied", rank="1") == 3
        assert metric(page, "ringlimit_top_limited", rule="api", kind="denied", rank="2") == 1
        assert "alice" not in page  # keys are never labels

        # int() took these: a Unicode digit (an Arabic-Indic 1), a sign, spaces, "2_0".
        odd = ("\u0661", "\uff15", "+5", " 5", "2_0", "", "9" * 5000)
        for params in ({"rule": "nope"}, {"n": "0"}, {"n": "x"}, {"n": "1001"}):
            assert_error(await client.get("/internal/top", params=params), 400)
        for n in odd:
            answer = await client.get("/internal/top", params={"n": n})
            assert_error(answer, 400)
            assert answer.json()["error"] == "invalid_n", n
        # Given twice, one reader took the first and another the last.
        for query, error in (("n=5&n=6", "invalid_n"), ("rule=api&rule=x", "invalid_rule")):
            answer = await client.get(f"/internal/top?{query}")
            assert_error(answer, 400)
            assert answer.json()["error"] == error, query


async def test_a_quiet_batch_is_counted_whole_and_puts_no_key_in_the_top() -> None:
    """A batch on one rule, every check allowed and far from the limit: the node's
    shortcut (Authority.decide_many) counts it as one tally, like any batch."""
    node = create_app(NodeSettings(node_id="n1", config=CONFIG), clock=FrozenClock())
    async with client_for(node) as client:
        batch = {"checks": [{"key": f"u{i}", "rule": "big"} for i in range(4)] * 2}
        assert (await client.post("/v1/check", json=batch)).status_code == 200
        answer = (await client.get("/internal/top", params={"n": 5})).json()
        assert answer["decisions"] == {"allowed": 8, "denied": 0}
        assert answer["top"] == {}
        page = (await client.get("/metrics")).text
        assert metric(page, "ringlimit_decisions_total", rule="big", outcome="allowed") == 8


async def test_internal_top_needs_the_token_when_one_is_configured() -> None:
    node = create_app(NodeSettings(node_id="n1", config=CONFIG, internal_token="s3cret"))
    async with client_for(node) as client:
        assert_error(await client.get("/internal/top"), 401)
        ok = await client.get("/internal/top", headers={"X-Ringlimit-Token": "s3cret"})
        assert ok.status_code == 200
    node = create_app(NodeSettings(node_id="n1", config=CONFIG))
    async with client_for(node, client=("10.1.2.3", 5000)) as client:
        assert_error(await client.get("/internal/top"), 403)  # loopback-only without a token


async def test_denials_that_are_not_the_users_fault_are_not_counted() -> None:
    config = ClusterConfig(rules=(ScopedRule(Rule("strict", 1, 60.0, on_error="closed")),))
    node = create_app(NodeSettings(node_id="n1", config=config, max_keys=1), clock=FrozenClock())
    async with client_for(node) as client:
        for key in ("first", "first", "later", "later"):
            await client.post("/v1/check", json={"key": key, "rule": "strict"})
        # "first" was near its limit, then over it; "later" was refused for lack of
        # room in the store (a closed rule), which says nothing about that user.
        answer = (await client.get("/internal/top")).json()
        assert answer["decisions"]["denied"] == 3
        assert answer["top"] == {
            "strict": {"denied": [["first", 1, 0]], "near_limit": [["first", 1, 0]]}
        }


async def test_shadow_rules_count_would_be_denials_and_reads_count_nothing() -> None:
    config = ClusterConfig(rules=(ScopedRule(Rule("trial", 2, 60.0, shadow=True)),))
    node = create_app(NodeSettings(node_id="n1", config=config), clock=FrozenClock())
    async with client_for(node) as client:
        for _ in range(5):  # never denied (shadow), but 3 would have been
            assert (await client.get("/", headers={"X-User-Id": "eve"})).status_code == 200
        for _ in range(3):  # reads: cost 0
            await client.post("/v1/check", json={"key": "mallory", "rule": "trial", "cost": 0})
        await client.post("/v1/check", json={"key": "mallory", "rule": "trial", "cost": 2})
        await client.post("/v1/check", json={"key": "mallory", "rule": "trial", "cost": 0})
        top = (await client.get("/internal/top")).json()["top"]
        # eve: the 2nd request left 0 (near), the next 3 would have been denied.
        # mallory: only the request that spent counts (near: 0 left), not the reads.
        assert top == {
            "trial": {
                "denied": [["eve", 3, 0]],
                "near_limit": [["eve", 1, 0], ["mallory", 1, 0]],
            }
        }
