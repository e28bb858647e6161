"""``GET``/``PUT /admin/rules``: new rules for a running cluster, without a restart.

In process (router/testing.py); the etcd form is in tests/test_coordinator.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from node.clock import FrozenClock
from node.config import ClusterConfig, ScopedRule
from node.rules import Rule
from router.admin import MAX_RULES, MAX_RULES_BODY
from router.envoy_config import EnvoyConfig, parse_envoy_config, with_envoy_rules
from router.testing import ROUTER_URL, InProcessCluster
from tests.processes import wait_until
from tests.test_followers import follower

pytestmark = pytest.mark.anyio

RULES = f"{ROUTER_URL}/admin/rules"


def config(limit: int = 5) -> ClusterConfig:
    return ClusterConfig(rules=(ScopedRule(Rule("api", limit, 60.0)),))


async def spend(cluster: InProcessCluster, user: str, n: int) -> list[int]:
    return [
        (await cluster.client.get("/x", headers={"X-User-Id": user})).status_code for _ in range(n)
    ]


def node_limits(cluster: InProcessCluster) -> dict[str, int]:
    limits = {}
    for node_id, node in cluster.nodes.items():
        rule = node.authority.config.rule("api")
        assert rule is not None
        limits[node_id] = rule.limit
    return limits


async def test_new_limits_apply_at_once_and_keep_what_users_spent() -> None:
    async with InProcessCluster(3, config(5), clock=FrozenClock()) as cluster:
        assert await spend(cluster, "ann", 3) == [200] * 3
        answer = await cluster.client.put(
            RULES, json={"rules": [{"name": "api", "limit": 4, "period": 60}]}
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["rules"] == [{**answer.json()["rules"][0], "limit": 4}]
        assert answer.json()["pending"] == []
        assert node_limits(cluster) == {"n1": 4, "n2": 4, "n3": 4}
        # ann's bucket kept its 2 tokens (at most the new 4); bob's is a new one of 4.
        assert await spend(cluster, "ann", 3) == [200, 200, 429]
        assert await spend(cluster, "bob", 5) == [200] * 4 + [429]
        got = await cluster.client.get(RULES)
        assert got.json()["rules"][0]["limit"] == 4
        ring = (await cluster.client.get(f"{ROUTER_URL}/admin/ring")).json()
        assert ring["rules_digest"] == cluster.router.config.rules_digest


async def test_a_window_keeps_its_count_under_a_new_limit() -> None:
    window = ClusterConfig(rules=(ScopedRule(Rule("api", 5, 60.0, algorithm="fixed_window")),))
    async with InProcessCluster(3, window, clock=FrozenClock()) as cluster:
        assert await spend(cluster, "ann", 3) == [200] * 3
        rules = [{"name": "api", "limit": 4, "period": 60, "algorithm": "fixed_window"}]
        assert (await cluster.client.put(RULES, json={"rules": rules})).status_code == 200
        # 3 counted in this window, of 4 now.
        assert await spend(cluster, "ann", 2) == [200, 429]


async def test_a_new_algorithm_starts_its_rule_afresh_and_new_rules_add() -> None:
    async with InProcessCluster(3, config(2), clock=FrozenClock()) as cluster:
        assert await spend(cluster, "ann", 3) == [200, 200, 429]
        rules: list[dict[str, Any]] = [
            {"name": "api", "limit": 2, "period": 60, "algorithm": "fixed_window"},
            {"name": "writes", "limit": 1, "period": 60, "methods": ["POST"]},
        ]
        answer = await cluster.client.put(RULES, json={"rules": rules})
        assert answer.status_code == 200, answer.text
        # States of another algorithm cannot be read as this one's: dropped.
        assert await spend(cluster, "ann", 3) == [200, 200, 429]
        posts = [
            (await cluster.client.post("/w", headers={"X-User-Id": "cy"})).status_code
            for _ in range(2)
        ]
        assert posts == [200, 429]


@pytest.mark.parametrize(
    ("body", "status", "error", "says"),
    [
        (b"{", 400, "invalid_json", "not valid JSON"),
        (b'{"rules": [], "rules": []}', 400, "invalid_request", "'rules' is given twice"),
        (b"[]", 400, "invalid_rules", '{"rules": [...]}'),
        (b'{"rules": [], "x": 1}', 400, "invalid_rules", '{"rules": [...]}'),
        (b'{"rules": []}', 400, "invalid_rules", f"1 to {MAX_RULES}"),
        (b'{"rules": {"name": "api"}}', 400, "invalid_rules", "list"),
        (b'{"rules": [{"name": "api"}]}', 400, "invalid_rules", "rules[0]"),
        (b'{"rules": [{"name": "api", "rate": "x"}]}', 400, "invalid_rules", "rules[0]"),
        (b'{"rules": [{"rate": "1/s", "name": "a"}, 7]}', 400, "invalid_rules", "rules[1]"),
        (b'{"rules": [{"name": "api", "rate": "1/s", "oops": 1}]}', 400, "invalid_rules", "oops"),
        (
            b'{"rules": [{"name": "api", "rate": "1/s", "\\ud800": 1}]}',
            400,
            "invalid_rules",
            "'\\ud800'",
        ),
        (b'{"rules": [{"name": "a", "rate": "1/s", "paths": "a"}]}', 400, "invalid_rules", "paths"),
        (
            b'{"rules": [{"name": "a", "rate": "1/s", "methods": ["G T"]}]}',
            400,
            "invalid_rules",
            "methods[0]",
        ),
        (
            b'{"rules": [{"name": "a", "rate": "1/s", "tiers": [""]}]}',
            400,
            "invalid_rules",
            "tiers[0]",
        ),
        (b'{"rules": [{"name": "a", "rate": "1/s", "burst": ""}]}', 400, "invalid_rules", "burst"),
        (b'{"rules": [{"name": "a", "rate": "1/s", "burst": []}]}', 400, "invalid_rules", "burst"),
        (b'{"rules": [{"name": "a", "rate": "1/s", "burst": {}}]}', 400, "invalid_rules", "burst"),
        # Text no push can carry: it was taken (a 500), and every push after failed.
        (
            b'{"rules": [{"name": "a", "rate": "1/s", "tiers": ["\\ud800"]}]}',
            400,
            "invalid_rules",
            "rules[0].tiers[0]: not valid Unicode",
        ),
        (
            b'{"rules": [{"name": "a", "rate": "1/s", "paths": ["/\\udfff"]}]}',
            400,
            "invalid_rules",
            "rules[0].paths[0]: not valid Unicode",
        ),
    ],
)
async def test_bad_rules_are_a_400_saying_why_and_change_nothing(
    body: bytes, status: int, error: str, says: str
) -> None:
    async with InProcessCluster(2, config(5), clock=FrozenClock()) as cluster:
        before = (await cluster.client.get(RULES)).json()
        answer = await cluster.client.put(
            RULES, content=body, headers={"content-type": "application/json"}
        )
        assert answer.status_code == status, answer.text
        assert answer.json()["error"] == error and says in answer.json()["detail"], answer.text
        assert (await cluster.client.get(RULES)).json() == before
        assert node_limits(cluster) == {"n1": 5, "n2": 5}


async def test_a_config_that_cannot_be_pushed_leaves_the_router_as_it_was() -> None:
    """Past the parser (a config built in code): refused before the router takes
    it. It used to be taken, then its push failed to encode at every node, and the
    router decided with rules no node had, answered GET /admin/rules with a 500
    and failed every join."""
    async with InProcessCluster(2, config(5), clock=FrozenClock()) as cluster:
        membership = cluster.router.membership
        before = membership.config
        bad = ClusterConfig(rules=(ScopedRule(Rule("api", 7, 60.0), tiers=("\ud800",)),))
        with pytest.raises(ValueError, match=r"rules\[0\]\.tiers\[0\]"):
            await membership.change_config(bad)
        assert membership.config is before
        assert (await cluster.client.get(RULES)).status_code == 200
        assert node_limits(cluster) == {"n1": 5, "n2": 5}


async def test_a_push_that_fails_leaves_the_router_with_its_config(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No etcd: nothing recorded the new config, so the old one stays this router's."""
    async with InProcessCluster(2, config(5), clock=FrozenClock()) as cluster:
        membership = cluster.router.membership
        before = membership.config

        async def broken(*args: Any, **options: Any) -> None:
            raise RuntimeError("push failed")

        monkeypatch.setattr(membership, "_push_all", broken)
        with pytest.raises(RuntimeError):
            await membership.change_config(config(7))
        assert membership.config is before


async def test_rules_past_the_limits_are_refused() -> None:
    async with InProcessCluster(2, config(5), clock=FrozenClock()) as cluster:
        many = [{"name": f"r{i}", "rate": "1/s", "paths": [f"/{i}"]} for i in range(MAX_RULES + 1)]
        answer = await cluster.client.put(RULES, json={"rules": many})
        assert answer.status_code == 400 and "1 to 1000" in answer.json()["detail"]
        long_path = "x" * MAX_RULES_BODY
        huge = json.dumps({"rules": [{"name": "a", "rate": "1/s", "paths": [long_path]}]})
        answer = await cluster.client.put(RULES, content=huge)
        assert answer.status_code == 413 and answer.json()["error"] == "body_too_large"
        assert node_limits(cluster) == {"n1": 5, "n2": 5}


async def test_the_rules_take_the_admin_token() -> None:
    async with InProcessCluster(
        2, config(5), clock=FrozenClock(), router_options={"admin_token": "adm1n"}
    ) as cluster:
        rules = {"rules": [{"name": "api", "limit": 1, "period": 60}]}
        for call in (cluster.client.get(RULES), cluster.client.put(RULES, json=rules)):
            answer = await call
            assert answer.status_code == 401 and answer.json()["error"] == "unauthorized"
        wrong = {"authorization": "Bearer nope"}
        assert (await cluster.client.put(RULES, json=rules, headers=wrong)).status_code == 401
        assert node_limits(cluster) == {"n1": 5, "n2": 5}
        right = {"authorization": "Bearer adm1n"}
        assert (await cluster.client.put(RULES, json=rules, headers=right)).status_code == 200
        assert node_limits(cluster) == {"n1": 1, "n2": 1}


async def test_a_following_router_passes_the_change_on_and_takes_the_leaders_rules() -> None:
    """The workers of ``ringlimit router --workers N`` without etcd: a change
    through a follower is the leader's, and the follower polls the new rules."""
    async with InProcessCluster(3, config(5), clock=FrozenClock()) as cluster:
        second = await follower(cluster)
        try:
            answer = await cluster.client.put(
                "http://router2.localhost/admin/rules",
                json={"rules": [{"name": "api", "limit": 3, "period": 60}]},
            )
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-ringlimit-leader"] == ROUTER_URL
            assert node_limits(cluster) == {"n1": 3, "n2": 3, "n3": 3}

            def limit() -> int | None:
                rule = second.config.rule("api")
                return rule.limit if rule is not None else None

            await wait_until(lambda: limit() == 3, 5.0)
        finally:
            await second.close()


async def test_a_follower_refuses_bad_rules_itself() -> None:
    """Checked where they arrive, before anything is passed on: nothing changes."""
    async with InProcessCluster(2, config(5), clock=FrozenClock()) as cluster:
        second = await follower(cluster)
        try:
            answer = await cluster.client.put(
                "http://router2.localhost/admin/rules", json={"rules": [{"name": "api"}]}
            )
            assert answer.status_code == 400 and answer.json()["error"] == "invalid_rules"
            assert node_limits(cluster) == {"n1": 5, "n2": 5}
        finally:
            await second.close()


async def test_a_node_that_missed_the_new_rules_gets_them_when_it_answers_again() -> None:
    """A config moves no epoch, so the health loop's epoch check cannot see a
    node that missed it: the probe's config digest does."""
    async with InProcessCluster(3, config(5), clock=FrozenClock()) as cluster:
        cluster.take_down("n2")
        answer = await cluster.client.put(
            RULES, json={"rules": [{"name": "api", "limit": 1, "period": 60}]}
        )
        assert answer.status_code == 200, answer.text
        assert node_limits(cluster) == {"n1": 1, "n2": 5, "n3": 1}
        cluster.bring_back("n2")
        await cluster.router.membership.check_health()
        await cluster.router.membership.settle()
        assert node_limits(cluster) == {"n1": 1, "n2": 1, "n3": 1}
        digests = {n.authority.config.digest for n in cluster.nodes.values()}
        assert digests == {cluster.router.config.digest}


async def test_the_envoy_rules_of_a_router_stay_whatever_the_new_rules() -> None:
    """Rules from ``--envoy-config`` are the router's own: a PUT without them
    keeps them (Envoy's calls name them), one that redefines them is refused."""
    envoy = EnvoyConfig({"api": parse_envoy_config(ENVOY, "api.yaml")})
    names = {scoped.rule.name for scoped in envoy.rules}
    async with InProcessCluster(
        2,
        with_envoy_rules(config(5), envoy),
        clock=FrozenClock(),
        router_options={"envoy": envoy},
    ) as cluster:
        answer = await cluster.client.put(
            RULES, json={"rules": [{"name": "api", "limit": 3, "period": 60}]}
        )
        assert answer.status_code == 200, answer.text
        assert {r["name"] for r in answer.json()["rules"]} == {"api", *names}
        for node in cluster.nodes.values():
            assert names <= {s.rule.name for s in node.authority.config.rules}
        (name,) = names
        clash = [{"name": "api", "rate": "3/minute"}, {"name": name, "rate": "1/hour"}]
        answer = await cluster.client.put(RULES, json={"rules": clash})
        assert answer.status_code == 400 and answer.json()["error"] == "invalid_rules"
        assert node_limits(cluster) == {"n1": 3, "n2": 3}


ENVOY = """\
domain: api
descriptors:
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 20}
"""
