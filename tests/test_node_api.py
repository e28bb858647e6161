"""One node on its own, in-process: the decision API, health, metrics, internal API.

Every bad request must get a 4xx with a JSON ``{"error", "detail"}`` body, never
a 500, and must leave every counter as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from node.app import Node, NodeSettings, create_app
from node.clock import FrozenClock
from node.config import ClusterConfig, Limits, ScopedRule
from node.leasing import definition
from node.rules import Rule
from node.shardcore import MAX_CRASHES
from ring.view import MAX_MEMBERS
from tests.test_router import metric

pytestmark = pytest.mark.anyio

NODE = "http://node.localhost"


def node_config(**options: Any) -> ClusterConfig:
    return ClusterConfig(
        rules=(
            ScopedRule(Rule("api", 5, 60.0)),
            ScopedRule(Rule("search", 3, 10.0, algorithm="fixed_window"), paths=("/search",)),
        ),
        **options,
    )


def make_node(config: ClusterConfig | None = None, **settings: Any) -> tuple[Node, FrozenClock]:
    clock = FrozenClock()
    node = create_app(
        NodeSettings(node_id="n7", config=config or node_config(), **settings), clock=clock
    )
    return node, clock


def client_for(node: Node, client: tuple[str, int] = ("127.0.0.1", 4000)) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=node, client=client)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=transport, base_url=NODE)


@pytest.fixture
async def node_client() -> AsyncIterator[tuple[Node, FrozenClock, httpx.AsyncClient]]:
    node, clock = make_node()
    async with client_for(node) as client:
        yield node, clock, client


def assert_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if status is not None:
        assert response.status_code == status, response.text
    body = response.json()
    assert isinstance(body, dict) and {"error", "detail"} <= set(body), body
    assert isinstance(body["error"], str) and isinstance(body["detail"], str)
    return body


# --------------------------------------------------------------------------- the decision API


async def test_single_check_answers_every_field(node_client: Any) -> None:
    _, _, client = node_client
    response = await client.post("/v1/check", json={"key": "alice", "rule": "api", "cost": 1})
    assert response.status_code == 200
    assert response.json() == {
        "allowed": True,
        "limit": 5,
        "remaining": 4,
        "reset_after": 12.0,
        "retry_after": None,
        "rule": "api",
        "available_after": 12.0,
        "node": "n7",
    }
    # The rule may be omitted: the default (unscoped) rules apply.
    default = (await client.post("/v1/check", json={"key": "alice"})).json()
    assert default["rule"] == "api" and default["remaining"] == 3
    heavy = (await client.post("/v1/check", json={"key": "alice", "cost": 3})).json()
    assert heavy["allowed"] is True and heavy["remaining"] == 0
    denied = (await client.post("/v1/check", json={"key": "alice"})).json()
    assert denied["allowed"] is False
    assert denied["retry_after"] == pytest.approx(12.0)
    assert denied["remaining"] == 0 and denied["reset_after"] == pytest.approx(60.0)
    # The draft's t: one more unit in 12 s, long before the bucket is whole again.
    assert denied["available_after"] == pytest.approx(12.0)


async def test_cost_zero_peeks_and_a_cost_over_capacity_is_never_allowed(node_client: Any) -> None:
    _, _, client = node_client
    for _ in range(3):
        peek = (await client.post("/v1/check", json={"key": "bob", "cost": 0})).json()
        assert peek["allowed"] is True and peek["remaining"] == 5
    never = (await client.post("/v1/check", json={"key": "bob", "cost": 6})).json()
    assert never["allowed"] is False and never["retry_after"] is None
    assert never["reason"] == "cost_exceeds_capacity"
    assert (await client.post("/v1/check", json={"key": "bob"})).json()["remaining"] == 4


async def test_batch_answers_in_order_and_matches_single_checks(node_client: Any) -> None:
    _, _, client = node_client
    checks = [
        {"key": "k1", "rule": "api"},
        {"key": "k2", "rule": "search", "cost": 2},
        {"key": "k1", "rule": "api", "cost": 4},
        {"key": "k2", "rule": "search", "cost": 2},
        {"key": "k1"},
        {"key": "k3", "cost": 0},
    ]
    response = await client.post("/v1/check", json={"checks": checks})
    assert response.status_code == 200
    results = response.json()["results"]
    assert [(r["rule"], r["allowed"], r["remaining"]) for r in results] == [
        ("api", True, 4),
        ("search", True, 1),
        ("api", True, 0),
        ("search", False, 1),
        ("api", False, 0),
        ("api", True, 5),
    ]
    assert all(r["node"] == "n7" for r in results)
    other, _ = make_node()
    async with client_for(other) as fresh:
        singles = [(await fresh.post("/v1/check", json=c)).json() for c in checks]
    assert singles == results


async def test_several_default_rules_are_decided_together() -> None:
    config = ClusterConfig(
        rules=(ScopedRule(Rule("minute", 5, 60.0)), ScopedRule(Rule("second", 2, 1.0)))
    )
    node, _ = make_node(config)
    async with client_for(node) as client:
        answers = [(await client.post("/v1/check", json={"key": "c"})).json() for _ in range(3)]
    assert [a["allowed"] for a in answers] == [True, True, False]
    assert answers[2]["rule"] == "second"
    assert [d["rule"] for d in answers[2]["decisions"]] == ["minute", "second"]
    # The denied check consumed nothing from the rule that allowed it.
    assert answers[2]["decisions"][0]["remaining"] == 3


async def test_no_rule_named_and_no_default_rule_is_400() -> None:
    config = ClusterConfig(rules=(ScopedRule(Rule("scoped", 5, 60.0), paths=("/x",)),))
    node, _ = make_node(config)
    async with client_for(node) as client:
        body = assert_error(await client.post("/v1/check", json={"key": "d"}), 400)
        assert body["error"] == "no_rule"
        named = await client.post("/v1/check", json={"key": "d", "rule": "scoped"})
        assert named.status_code == 200


async def test_get_on_the_decision_api_is_405(node_client: Any) -> None:
    _, _, client = node_client
    assert (await client.get("/v1/check")).status_code == 405


BAD_BODIES: list[tuple[str, bytes, int]] = [
    ("malformed json", b'{"key": ', 400),
    ("trailing garbage", b'{"key": "a"} x', 400),
    ("not utf-8", b"\xff\xfe\xfd", 400),
    ("empty", b"", 400),
    ("nested 100k deep", b"[" * 100_000 + b"]" * 100_000, 400),
    ("nested objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 400),
    ("array", b"[]", 400),
    ("number", b"12", 400),
    ("true", b"true", 400),
    ("key wrong type", b'{"key": {"a": 1}}', 400),
    ("key lone surrogate", b'{"key": "x\\udc80"}', 400),
    ("key too long", json.dumps({"key": "k" * 257}).encode(), 400),
    ("cost negative", b'{"key": "a", "cost": -5}', 400),
    ("cost huge", b'{"key": "a", "cost": 1000000000001}', 400),
    ("cost with 5000 digits", b'{"key": "a", "cost": ' + b"9" * 5000 + b"}", 400),
    ("cost bool", b'{"key": "a", "cost": false}', 400),
    ("key null", b'{"key": null, "cost": null}', 400),
    ("unknown field null", b'{"key": "a", "costs": null}', 400),
    ("cost -Infinity", b'{"key": "a", "cost": -Infinity}', 400),
    ("unknown rule", b'{"key": "a", "rule": "nope"}', 404),
    ("rule number", b'{"key": "a", "rule": 1}', 400),
    ("unknown field", b'{"key": "a", "extra": 1}', 400),
    ("unknown top-level field in a batch", b'{"checks": [{"key": "a"}], "x": 1}', 400),
    # A field name UTF-8 cannot carry, quoted in the error: it must not make the answer a 500.
    ("unknown field lone surrogate", b'{"key": "a", "\\ud800": 1}', 400),
    ("unknown field lone surrogate in an item", b'{"checks": [{"key": "a", "\\udc00": 1}]}', 400),
    ("unknown top-level field lone surrogate", b'{"checks": [{"key": "a"}], "\\ud800": 1}', 400),
    ("empty batch", b'{"checks": []}', 400),
    ("batch of null", b'{"checks": null}', 400),
    ("batch item not an object", b'{"checks": ["a"]}', 400),
    ("oversized batch", json.dumps({"checks": [{"key": "a"}] * 1001}).encode(), 413),
    ("oversized body", b'{"key": "' + b"a" * (1 << 20) + b'"}', 413),
]


@pytest.mark.parametrize(
    ("body", "status"), [c[1:] for c in BAD_BODIES], ids=[c[0] for c in BAD_BODIES]
)
async def test_bad_input_is_a_clear_4xx_and_decides_nothing(
    node_client: Any, body: bytes, status: int
) -> None:
    node, _, client = node_client
    assert (await client.post("/v1/check", json={"key": "a"})).json()["remaining"] == 4
    response = await client.post("/v1/check", content=body)
    assert_error(response, status)
    assert (await client.post("/v1/check", json={"key": "a"})).json()["remaining"] == 3
    assert len(node.store) == 1


async def test_body_over_the_limit_is_refused_without_a_content_length() -> None:
    node, _ = make_node(node_config(limits=Limits(max_body=100)))

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"key": "'
        for _ in range(20):
            yield b"a" * 10
        yield b'"}'

    async with client_for(node) as client:
        body = assert_error(await client.post("/v1/check", content=chunks()), 413)
        assert body["error"] == "body_too_large"
        declared = await client.post(
            "/v1/check", content=b"{}" * 60, headers={"content-type": "application/json"}
        )
        assert_error(declared, 413)
        ok = await client.post("/v1/check", json={"key": "a"})
        assert ok.status_code == 200 and ok.json()["remaining"] == 4


async def test_configured_limits_apply() -> None:
    limits = Limits(max_key_length=4, max_batch=2, max_body=4096, max_cost=3)
    node, _ = make_node(node_config(limits=limits))
    async with client_for(node) as client:
        assert_error(await client.post("/v1/check", json={"key": "abcde"}), 400)
        assert_error(await client.post("/v1/check", json={"key": "a", "cost": 4}), 400)
        three = {"checks": [{"key": "a"}, {"key": "b"}, {"key": "c"}]}
        assert_error(await client.post("/v1/check", json=three), 413)
        fine = await client.post("/v1/check", json={"key": "abcd", "cost": 3})
        assert fine.status_code == 200 and fine.json()["remaining"] == 2
        two = await client.post("/v1/check", json={"checks": [{"key": "a"}, {"key": "b"}]})
        assert two.status_code == 200 and len(two.json()["results"]) == 2


# --------------------------------------------------------------------------- hypothesis

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=300),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
# Lone surrogates survive json.dumps as "\\udXXX" escapes (st.text() never makes them).
SURROGATES = st.text(st.sampled_from("\ud800\udbff\udc00\udfffa\u00e9"), min_size=1, max_size=4)
KEYS = st.text(max_size=20) | SURROGATES | st.text(min_size=250, max_size=260)
CHECKISH = st.fixed_dictionaries(
    {},
    optional={
        "key": KEYS | JSON,
        "rule": st.sampled_from(["api", "search", "nope", ""]) | JSON,
        "cost": st.integers(-3, 12) | st.sampled_from([10**9, 10**9 + 1, 2**63]) | JSON,
        "extra": JSON,
    },
)
VALID_SHAPED = st.fixed_dictionaries(
    {"key": KEYS},
    optional={"rule": st.sampled_from(["api", "search"]), "cost": st.integers(0, 6)},
)
BODIES = (
    JSON
    | CHECKISH
    | VALID_SHAPED
    | st.builds(lambda items: {"checks": items}, st.lists(VALID_SHAPED, min_size=1, max_size=5))
    | st.builds(lambda items: {"checks": items}, st.lists(CHECKISH | JSON, max_size=5))
)


class SyncNode:
    """One node and one client on a private event loop, for hypothesis (sync tests)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.node, _ = make_node()
        self.client = client_for(self.node)
        # In a ring, so that every key is hashed to find its owner.
        ring = {"epoch": 1, "nodes": [{"id": "n7", "url": NODE, "weight": 1}]}
        pushed = self.loop.run_until_complete(
            self.client.put(
                "/internal/cluster", json={"config": node_config().to_dict(), "ring": ring}
            )
        )
        assert pushed.status_code == 200, pushed.text

    def post(self, content: bytes) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post("/v1/check", content=content))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def sync_node() -> Iterator[SyncNode]:
    node = SyncNode()
    yield node
    node.close()


@settings(max_examples=250)
@given(body=BODIES)
def test_any_json_value_gets_an_answer_below_500(sync_node: SyncNode, body: object) -> None:
    response = sync_node.post(json.dumps(body).encode())
    assert response.status_code < 500
    data = response.json()
    if response.status_code >= 400:
        assert {"error", "detail"} <= set(data)
    else:
        assert "results" in data or "allowed" in data


@settings(max_examples=150)
@given(body=st.binary(max_size=200))
def test_any_bytes_get_an_answer_below_500(sync_node: SyncNode, body: bytes) -> None:
    assert sync_node.post(body).status_code < 500


# --------------------------------------------------------------------------- health, metrics


async def test_healthz(node_client: Any) -> None:
    _, _, client = node_client
    health = await client.get("/healthz")
    assert health.status_code == 200
    body = health.json()
    assert body == {
        "status": "ok",
        "node": "n7",
        "instance": body["instance"],
        "epoch": 0,
        "backend": "memory",
        "backend_available": True,
        "sticky": True,
        "cluster": None,
        "keys": 0,
        "config": body["config"],
        "unix_socket": None,
    }
    # The config it holds, as a short hash (the leader compares it with its own).
    assert len(body["config"]) == 16 and int(body["config"], 16) >= 0
    # This process among the node's (a join and a leave carry it): random, per process.
    assert len(body["instance"]) == 16 and int(body["instance"], 16) >= 0
    await client.post("/v1/check", json={"checks": [{"key": "a"}, {"key": "b"}, {"key": "a"}]})
    assert (await client.get("/healthz")).json()["keys"] == 2


async def test_metrics_count_decisions_by_rule_and_outcome_latency_and_keys(
    node_client: Any,
) -> None:
    _, _, client = node_client
    for _ in range(7):
        await client.post("/v1/check", json={"key": "m", "rule": "api"})
    await client.post("/v1/check", json={"key": "m", "rule": "search"})
    await client.get("/search", headers={"X-User-Id": "m2"})
    await client.post("/v1/check", json={"key": "m", "rule": "nope"})
    response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    decisions = "ringlimit_decisions_total"
    assert metric(text, decisions, rule="api", outcome="allowed") == 5
    assert metric(text, decisions, rule="api", outcome="denied") == 2
    # The proxied request had two rules; it counts once, under the tighter one.
    assert metric(text, decisions, rule="search", outcome="allowed") == 2
    assert metric(text, "ringlimit_decision_seconds_count") == 9
    assert metric(text, "ringlimit_keys") == 4  # (api|search) x (m|m2)
    assert metric(text, "ringlimit_node_errors_total", kind="unknown_rule") == 1


# --------------------------------------------------------------------------- proxied requests


async def test_node_proxy_path_without_a_router(node_client: Any) -> None:
    _, _, client = node_client
    for remaining in (2, 1, 0):
        response = await client.get("/search", headers={"X-User-Id": "p"})
        assert response.status_code == 200
        assert response.json() == {"node": "n7", "user": "p", "method": "GET", "path": "/search"}
        assert response.headers["ratelimit"].startswith('"api";r=')
        assert response.headers["x-ratelimit-remaining"] == str(remaining)
    denied = await client.get("/search", headers={"X-User-Id": "p"})
    assert denied.status_code == 429 and denied.json()["rule"] == "search"
    assert denied.headers["retry-after"] == "10"
    assert_error(await client.get("/search"), 400)
    assert_error(await client.get("/x", headers={"X-User-Id": "u" * 300}), 400)


async def test_a_fenced_node_refuses_every_key_until_it_gets_a_view() -> None:
    node, _ = make_node(fenced=True)
    async with client_for(node) as client:
        refused = await client.post("/v1/check", json={"key": "a"})
        body = assert_error(refused, 421)
        assert body["error"] == "not_owner"
        assert refused.headers["x-ringlimit-epoch"] == "0"
        proxied = await client.get("/", headers={"X-User-Id": "a"})
        assert_error(proxied, 421)
        # A rule it does not know yet (a restarted node's config file may lack
        # rules the router pushes: Envoy's) is refused as not owned, not as
        # unknown: the router retries, where a 404 became Envoy's UNAVAILABLE.
        for body in ({"key": "a", "rule": "edge.user"}, {"checks": [{"key": "a", "rule": "x"}]}):
            assert assert_error(await client.post("/v1/check", json=body), 421)["error"] == (
                "not_owner"
            )
        assert len(node.store) == 0


# --------------------------------------------------------------------------- internal API

INTERNAL_BAD: list[tuple[str, str, bytes]] = [
    ("PUT", "/internal/cluster", b"{"),
    ("PUT", "/internal/cluster", b"[]"),
    ("PUT", "/internal/cluster", b"{}"),
    ("PUT", "/internal/cluster", b'{"config": {}, "ring": 5}'),
    ("PUT", "/internal/cluster", b'{"config": [], "ring": {"epoch": 1, "nodes": []}}'),
    # A null config was taken as an empty one: it wiped the node's rules.
    ("PUT", "/internal/cluster", b'{"config": null, "ring": {"epoch": 2, "nodes": []}}'),
    ("PUT", "/internal/cluster", b'{"config": {"rules": [{"name": "x"}]}, "ring": {}}'),
    ("PUT", "/internal/cluster", b'{"config": {"limits": {"max_body": 0}}, "ring": {}}'),
    ("PUT", "/internal/cluster", b'{"config": {"identity": {"name": 5}}, "ring": {}}'),
    ("POST", "/internal/import", b"not json"),
    ("POST", "/internal/import", b'"str"'),
    ("POST", "/internal/import", b'{"from": "n1"}'),
    ("POST", "/internal/import", b'{"from": "n1", "epoch": "x", "records": [], "final": true}'),
    ("POST", "/internal/import", b'{"from": "n1", "epoch": 1, "records": 5, "final": true}'),
    ("POST", "/internal/pull", b"\xff"),
    ("POST", "/internal/pull", b'{"keys": ["a"]}'),
    ("POST", "/internal/pull", b'{"keys": 5, "to": "n1", "epoch": 1}'),
    ("POST", "/internal/pull", b'{"keys": [], "to": "n1", "epoch": [1]}'),
    ("POST", "/internal/replica", b"{"),
    ("POST", "/internal/replica", b'{"from": "n1"}'),
    ("POST", "/internal/replica", b'{"from": "n1", "records": [1, 2]}'),
    ("POST", "/internal/replica", b'{"from": "n1", "records": {"a": 1}}'),
    ("POST", "/internal/replica", b'{"from": "n1", "records": [], "round": [1]}'),
    ("POST", "/internal/replica", b'{"from": "n1", "records": [], "round": "1,2"}'),
    ("POST", "/internal/replica", b'{"from": "n1", "records": [], "round": [1, -2]}'),
    ("POST", "/internal/replica", b'{"from": "n1", "records": [], "round": [1, 1e3]}'),
    (
        "POST",
        "/internal/replica",
        b'{"from": "n1", "records": [], "round": [0, 9223372036854775808]}',
    ),
]


def _import(*records: str, extra: str = "") -> bytes:
    head = '{"from": "n1", "epoch": 1, "final": true'
    return (head + extra + ', "records": [' + ", ".join(records) + "]}").encode()


#: A valid record exhausting "a" (it must not land when the transfer is refused).
EXHAUSTED_A = '["api", "token_bucket", "a", [0.0, 0.0]]'
#: Records of every shape a transfer must refuse, whole.
BAD_RECORDS = [
    '["api", "token_bucket", "a", [1e999, 0.0]]',
    '["api", "token_bucket", "a", [0.0, -1e999]]',
    '["api", "token_bucket", "a", [NaN, 0.0]]',
    '["api", "token_bucket", "a", [0.0]]',
    '["api", "token_bucket", "a", [0.0, 0.0, 0.0]]',
    '["api", "token_bucket", "a", ["0", 0.0]]',
    '["api", "token_bucket", "a", [true, 0.0]]',
    '["api", "token_bucket", "a", [-5.0, 0.0]]',
    '["api", "token_bucket", "a", {"tokens": 0}]',
    '["api", "token_bucket", 5, [0.0, 0.0]]',
    '["api", "token_bucket", null, [0.0, 0.0]]',
    '["api", "token_bucket", "", [0.0, 0.0]]',
    '["api", "token_bucket", "\\ud800", [0.0, 0.0]]',
    '["api", "token_bucket", "a"]',
    '["api", "no_such_algorithm", "a", [0.0, 0.0]]',
    '[5, "token_bucket", "a", [0.0, 0.0]]',
    '["api", "gcra", "a", [1e308, 1]]',
    '["api", "fixed_window", "a", [0.0, 2.5]]',
    '["api", "fixed_window", "a", [0.0, -1]]',
    '["api", "sliding_log", "a", [0.0, NaN]]',
    '["api", "sliding_window", "a", [0.0, 1, 1e999]]',
    '"a record"',
]
for _bad in BAD_RECORDS:
    INTERNAL_BAD += [
        ("POST", "/internal/import", _import(EXHAUSTED_A, _bad)),
        ("POST", "/internal/replica", b'{"from": "n1", "records": [%s]}' % _bad.encode()),
    ]
INTERNAL_BAD += [
    ("POST", "/internal/import", _import(EXHAUSTED_A, extra=', "from": "a/b"')),
    ("POST", "/internal/import", _import(EXHAUSTED_A, extra=', "final": "yes"')),
    ("POST", "/internal/import", _import(EXHAUSTED_A, extra=', "epoch": -1')),
    ("POST", "/internal/import", _import(EXHAUSTED_A, extra=', "crashes": 5')),
    (
        "POST",
        "/internal/import",
        _import(
            EXHAUSTED_A,
            extra=', "crashes": [{"view": {"epoch": 1, "nodes": []}, "crashed": ["n1"], '
            '"age": 0, "left": 1e999}]',
        ),
    ),
    ("POST", "/internal/pull", b'{"keys": [5], "to": "n1", "epoch": 1}'),
    # Epochs past what msgpack carries: a view at 2**64 was applied, then the node
    # failed every transfer (OverflowError) and stayed at that epoch for good.
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 18446744073709551616, "nodes": []}}',
    ),
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 9223372036854775808, "nodes": []}}',
    ),
    ("POST", "/internal/pull", b'{"keys": [], "to": "n1", "epoch": 18446744073709551616}'),
    ("POST", "/internal/import", _import(EXHAUSTED_A, extra=', "epoch": 9223372036854775808')),
    # Unknown field names UTF-8 cannot carry: quoted in the error, not a 500.
    ("PUT", "/internal/cluster", b'{"config": {"\\ud800": 1}, "ring": {"epoch": 2, "nodes": []}}'),
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {"rules": [{"name": "api", "rate": "5/minute", "\\ud800": 1}]},'
        b' "ring": {"epoch": 2, "nodes": []}}',
    ),
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 2, "nodes": [], "\\ud800": 0}}',
    ),
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 2, "nodes": '
        b'[{"id": "n7", "url": "http://node.test", "\\ud800": 1}]}}',
    ),
    ("POST", "/internal/pull", b'{"keys": ["a"], "to": "n1", "epoch": 1.5}'),
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 2, "nodes": []}, "crashed": 5}',
    ),
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 2, "nodes": []}, "crashed": ["a/b"]}',
    ),
]


def _members(count: int) -> str:
    # Closed ports on 127.0.0.1: a node that took such a view (the caps undone)
    # would hand off to each member, and must send nothing off this machine.
    return ", ".join(f'{{"id": "m{i}", "url": "http://127.0.0.1:{i + 1}"}}' for i in range(count))


def _crash(epoch: int) -> str:
    view = f'{{"epoch": {epoch}, "nodes": [{_members(2)}]}}'
    return f'{{"view": {view}, "crashed": ["m0"], "age": 0, "left": 1}}'


# Sizes past the explicit caps (ring/view.py MAX_MEMBERS, node/shardcore.py
# MAX_CRASHES): a view of 2,500 members took a node 22 s to build (uhashring's
# continuum grows with the square of the points), 60 crashes of 300 members 20
# s, and the node was removed as crashed meanwhile (an exploratory tester).
INTERNAL_BAD += [
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 2, "nodes": [%s]}}' % _members(MAX_MEMBERS + 1).encode(),
    ),
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 2, "nodes": []}, "previous": '
        b'{"epoch": 1, "nodes": [%s]}}' % _members(2_500).encode(),
    ),
    (
        "POST",
        "/internal/import",
        _import(
            EXHAUSTED_A,
            extra=', "crashes": [' + ", ".join(_crash(i) for i in range(MAX_CRASHES + 1)) + "]",
        ),
    ),
]

# A falsy previous view was taken for none (its check skipped).
INTERNAL_BAD += [
    (
        "PUT",
        "/internal/cluster",
        b'{"config": {}, "ring": {"epoch": 2, "nodes": []}, "previous": %s}' % falsy,
    )
    for falsy in (b"0", b'""', b"[]", b"{}", b"false")
]


@pytest.fixture
async def fenced_in_ring() -> AsyncIterator[tuple[Node, httpx.AsyncClient]]:
    """A node that got a view with itself as the only member (epoch 1)."""
    node, _ = make_node()
    async with client_for(node) as client:
        config = node_config().to_dict()
        ring = {"epoch": 1, "nodes": [{"id": "n7", "url": NODE, "weight": 1}]}
        pushed = await client.put(
            "/internal/cluster", json={"config": config, "ring": ring, "previous": None}
        )
        assert pushed.status_code == 200, pushed.text
        yield node, client


@pytest.mark.parametrize(
    ("method", "path", "body"),
    INTERNAL_BAD,
    ids=[f"{m} {p} {b[:40]!r}" for m, p, b in INTERNAL_BAD],
)
async def test_malformed_internal_bodies_are_4xx(
    fenced_in_ring: Any, method: str, path: str, body: bytes
) -> None:
    node, client = fenced_in_ring
    assert (await client.post("/v1/check", json={"key": "a"})).json()["remaining"] == 4
    response = await client.request(method, path, content=body)
    assert_error(response)
    # The node still decides, with the state it had and the config it had.
    after = await client.post("/v1/check", json={"key": "a"})
    assert after.status_code == 200 and after.json()["remaining"] == 3
    assert node.shard is not None and node.shard.epoch == 1


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/internal/import", b'{"epoch": 1, "records": [], "final": true}', "from"),
        ("/internal/replica", b'{"records": []}', "from"),
    ],
)
async def test_an_internal_body_missing_a_field_names_it(
    fenced_in_ring: Any, path: str, body: bytes, field: str
) -> None:
    """Not the bare KeyError text (``'from'``), which says nothing to an operator."""
    _, client = fenced_in_ring
    response = await client.post(path, content=body)
    assert response.status_code == 400, response.text
    assert f"missing field '{field}'" in response.json()["detail"], response.text


async def test_a_bad_previous_view_is_named_as_such(fenced_in_ring: Any) -> None:
    """A push whose ``previous`` lacks its nodes said "ring is missing required
    field 'nodes'", as if ``ring`` were wrong (an exploratory tester)."""
    _, client = fenced_in_ring
    body = b'{"config": {}, "ring": {"epoch": 2, "nodes": []}, "previous": {"epoch": 1}}'
    response = await client.put("/internal/cluster", content=body)
    assert response.status_code == 400, response.text
    assert "update: previous (the view before this one): ring is missing" in response.text


async def test_a_transferred_bucket_fuller_than_the_rule_decides_as_a_full_one(
    fenced_in_ring: Any,
) -> None:
    """A burst lowered between export and import: the state is taken (not the
    transfer refused), as a full bucket; it answered remaining 999999999 and a
    negative reset_after."""
    _, client = fenced_in_ring
    record = '["api", "token_bucket", "kk", [1e9, 0.0]]'
    assert (await client.post("/internal/import", content=_import(record))).json() == {"taken": 1}
    answer = (await client.post("/v1/check", json={"key": "kk"})).json()
    assert answer["remaining"] == 4 and answer["reset_after"] == 12.0, answer


INTERNAL_BODIES_ONCE_FATAL: list[tuple[str, str, bytes]] = [
    ("POST", "/internal/pull", b'{"keys": [], "to": "n1", "epoch": 1e999}'),
    ("POST", "/internal/import", b'{"from": "n1", "epoch": 1e999, "records": [], "final": true}'),
    ("POST", "/internal/replica", b"[" * 100_000 + b"]" * 100_000),
    ("PUT", "/internal/cluster", b"[" * 100_000 + b"]" * 100_000),
]


@pytest.mark.parametrize(
    ("method", "path", "body"),
    INTERNAL_BODIES_ONCE_FATAL,
    ids=["pull-epoch-inf", "import-epoch-inf", "replica-nested", "cluster-nested"],
)
async def test_internal_bodies_that_once_crashed_the_node_are_refused(
    fenced_in_ring: Any, method: str, path: str, body: bytes
) -> None:
    _, client = fenced_in_ring
    assert_error(await client.request(method, path, content=body))


async def test_internal_api_is_loopback_only_without_a_token() -> None:
    node, _ = make_node()
    async with client_for(node, client=("192.0.2.10", 5000)) as remote:
        for method, path in (
            ("GET", "/internal/cluster"),
            ("PUT", "/internal/cluster"),
            ("POST", "/internal/pull"),
            ("GET", "/internal/status"),
        ):
            body = assert_error(await remote.request(method, path, content=b"{}"), 403)
            assert body["error"] == "forbidden"
        # The decision API itself is open.
        assert (await remote.post("/v1/check", json={"key": "a"})).status_code == 200


async def test_internal_api_needs_the_token_when_one_is_set() -> None:
    node, _ = make_node(internal_token="s3cret")
    async with client_for(node) as client:
        assert_error(await client.get("/internal/status"), 401)
        wrong = await client.get("/internal/status", headers={"X-Ringlimit-Token": "nope"})
        assert_error(wrong, 401)
        right = await client.get("/internal/status", headers={"X-Ringlimit-Token": "s3cret"})
        assert right.status_code == 200 and right.json()["node"] == "n7"
        bearer = await client.get("/internal/status", headers={"Authorization": "Bearer s3cret"})
        assert bearer.status_code == 200


# --------------------------------------------------------------------------- quota leases


def lease_config() -> ClusterConfig:
    return ClusterConfig(
        rules=(
            ScopedRule(Rule("hot", 100, 60.0, burst=40, lease="auto")),
            ScopedRule(Rule("plain", 5, 60.0), paths=("/plain",)),
        )
    )


async def _leasing_node(
    epoch: int = 1, members: tuple[str, ...] = ("n7",)
) -> tuple[Node, FrozenClock, httpx.AsyncClient]:
    node, clock = make_node(lease_config())
    client = client_for(node)
    ring = {
        "epoch": epoch,
        "nodes": [{"id": m, "url": f"http://{m}.test", "weight": 1} for m in members],
    }
    pushed = await client.put(
        "/internal/cluster", json={"config": lease_config().to_dict(), "ring": ring}
    )
    assert pushed.status_code == 200, pushed.text
    return node, clock, client


async def test_a_quota_lease_is_deducted_at_grant_and_settled_once() -> None:
    node, _, client = await _leasing_node()
    async with contextlib.aclosing(client):
        for _ in range(30):  # drain the bucket (40) to 10: a drained key gets a lease
            assert (await client.post("/v1/check", json={"key": "u", "rule": "hot"})).json()[
                "allowed"
            ]
        asked = await client.post(
            "/internal/quota", json={"epoch": 1, "rule": "hot", "key": "u", "want": 8}
        )
        assert asked.status_code == 200, asked.text
        lease = asked.json()["lease"]
        assert lease["units"] == 8 and lease["epoch"] == 1 and lease["expires_at"] > 0
        # the owner never admits what it leased: 2 units left at the owner
        answers = [
            (await client.post("/v1/check", json={"key": "u", "rule": "hot"})).json()["allowed"]
            for _ in range(3)
        ]
        assert answers == [True, True, False]
        settle = {"lease": lease["id"], "unused": 5}
        back = await client.post(
            "/internal/quota",
            json={"epoch": 1, "rule": "hot", "key": "u", "want": 0, "settle": [settle]},
        )
        assert back.status_code == 200 and back.json()["refunded"] == 5
        again = await client.post(
            "/internal/quota",
            json={"epoch": 1, "rule": "hot", "key": "u", "want": 0, "settle": [settle]},
        )
        assert again.json()["refunded"] == 0  # a lease is settled once
        assert node.desk.stats.units_leased == 8 and node.desk.stats.units_refunded == 5


async def test_a_quota_ask_for_another_definition_of_its_rule_gets_nothing() -> None:
    """New rules reach the router and the nodes one after the other: an ask made
    under a definition the owner does not hold (here the router's 10/day where
    the owner still has 100/minute) was granted units of the owner's limit."""
    node, _, client = await _leasing_node()
    async with contextlib.aclosing(client):
        rule = node.authority.config.rule("hot")
        assert rule is not None
        ask = {"epoch": 1, "rule": "hot", "key": "u", "want": 8}
        other = [rule.algorithm, 10, 86400.0, rule.burst]
        refused = await client.post("/internal/quota", json={**ask, "definition": other})
        assert assert_error(refused, 409)["error"] == "rule_changed"
        assert node.desk.stats.units_leased == 0
        same = await client.post("/internal/quota", json={**ask, "definition": definition(rule)})
        assert same.status_code == 200, same.text


async def test_a_rules_push_during_a_quota_asks_wait_grants_nothing_of_the_old_rule() -> None:
    """An ask waits in ``Shard.admit`` while a handoff into the node is under way;
    new rules pushed meanwhile redefine its rule. The grant used the rule as it
    stood before the wait, so a router still deciding by it got a lease of the
    old limit's units against a state the new rule governs."""
    node, _, client = await _leasing_node()
    async with contextlib.aclosing(client):
        rule = node.authority.config.rule("hot")
        assert rule is not None and node.shard is not None
        waiting, go = asyncio.Event(), asyncio.Event()
        admit = node.shard.admit

        async def held_admit(key: str, rules: Any) -> bool:  # as a handoff wait would
            waiting.set()
            await go.wait()
            return await admit(key, rules)

        node.shard.admit = held_admit  # type: ignore[method-assign]
        ask = {"epoch": 1, "rule": "hot", "key": "u", "want": 8, "definition": definition(rule)}
        asked = asyncio.ensure_future(client.post("/internal/quota", json=ask))
        await asyncio.wait_for(waiting.wait(), 5.0)
        lowered = ClusterConfig(
            rules=(ScopedRule(Rule("hot", 10, 86400.0, lease="auto")),), limits=Limits()
        )
        ring = {"epoch": 1, "nodes": [{"id": "n7", "url": "http://n7.test", "weight": 1}]}
        pushed = await client.put(
            "/internal/cluster", json={"config": lowered.to_dict(), "ring": ring}
        )
        assert pushed.status_code == 200, pushed.text
        go.set()
        answer = await asyncio.wait_for(asked, 5.0)
        assert assert_error(answer, 409)["error"] == "rule_changed"
        assert node.desk.stats.units_leased == 0


async def test_quota_asks_are_fenced_like_decisions() -> None:
    node, _, client = await _leasing_node(epoch=3, members=("n1", "n2", "n3", "n7"))
    async with contextlib.aclosing(client):
        owned = next(
            k for k in (f"k{i}" for i in range(100)) if node.shard.view.owner(k).id == "n7"
        )  # type: ignore[union-attr]
        other = next(
            k for k in (f"k{i}" for i in range(100)) if node.shard.view.owner(k).id != "n7"
        )  # type: ignore[union-attr]
        refused = await client.post(
            "/internal/quota", json={"epoch": 3, "rule": "hot", "key": other, "want": 5}
        )
        assert_error(refused, 421)
        assert refused.headers["x-ringlimit-epoch"] == "3"
        stale = await client.post(
            "/internal/quota", json={"epoch": 2, "rule": "hot", "key": owned, "want": 5}
        )
        assert assert_error(stale, 409)["error"] == "stale_epoch"
        off = await client.post(
            "/internal/quota", json={"epoch": 3, "rule": "plain", "key": owned, "want": 1}
        )
        assert assert_error(off, 409)["error"] == "lease_off"


async def test_a_ring_change_writes_off_outstanding_leases() -> None:
    node, _, client = await _leasing_node()
    async with contextlib.aclosing(client):
        for _ in range(35):
            await client.post("/v1/check", json={"key": "u", "rule": "hot"})
        lease = (
            await client.post(
                "/internal/quota", json={"epoch": 1, "rule": "hot", "key": "u", "want": 4}
            )
        ).json()["lease"]
        assert lease["units"] == 4
        ring = {"epoch": 2, "nodes": [{"id": "n7", "url": NODE, "weight": 1}]}
        await client.put(
            "/internal/cluster", json={"config": lease_config().to_dict(), "ring": ring}
        )
        settle = {"lease": lease["id"], "unused": 4}
        late = await client.post(
            "/internal/quota",
            json={"epoch": 2, "rule": "hot", "key": "u", "want": 0, "settle": [settle]},
        )
        assert late.status_code == 200 and late.json()["refunded"] == 0
        assert node.desk.stats.units_written_off == 4


QUOTA_BAD = [
    b"{",
    b"[]",
    b"{}",
    b'{"epoch": -1, "rule": "hot", "key": "u"}',
    b'{"epoch": 1, "rule": "nope", "key": "u"}',
    b'{"epoch": 1, "rule": 5, "key": "u"}',
    b'{"epoch": 1, "rule": "hot", "key": ""}',
    b'{"epoch": 1, "rule": "hot", "key": 7}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "want": -1}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "want": 1.5}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "want": 99999}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "cost": 0}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "settle": 5}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "settle": [5]}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "settle": [{"lease": "x", "unused": 1}]}',
    b'{"epoch": 1, "rule": "hot", "key": "u", "settle": [{"lease": 1, "unused": -1}]}',
]


@pytest.mark.parametrize("body", QUOTA_BAD)
async def test_bad_quota_asks_are_4xx_json(body: bytes) -> None:
    node, _, client = await _leasing_node()
    async with contextlib.aclosing(client):
        response = await client.post("/internal/quota", content=body)
        assert_error(response)
        assert node.desk.stats.grants == 0


async def test_quota_asks_need_the_internal_token() -> None:
    node, _ = make_node(lease_config(), internal_token="s3cret")
    async with client_for(node) as client:
        body = {"epoch": 0, "rule": "hot", "key": "u"}
        assert_error(await client.post("/internal/quota", json=body), 401)
    async with client_for(node, client=("10.1.2.3", 5)) as client:
        assert_error(await client.post("/internal/quota", json=body), 401)


class SyncLeasingNode:
    """A node whose rule leases, in a ring of its own, on a private loop (hypothesis)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.node, _, self.client = self.loop.run_until_complete(_leasing_node())

    def post(self, body: bytes) -> httpx.Response:
        return self.loop.run_until_complete(self.client.post("/internal/quota", content=body))

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def sync_leasing_node() -> Iterator[SyncLeasingNode]:
    node = SyncLeasingNode()
    yield node
    node.close()


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False),
    st.text(max_size=8),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.sampled_from(["lease", "unused", "x"]), st.integers(-3, 10**20)),
)
QUOTA_ASKS = st.fixed_dictionaries(
    {},
    optional={
        "epoch": st.one_of(st.just(1), _ANY),
        "rule": st.one_of(st.sampled_from(["hot", "plain"]), _ANY),
        "key": st.one_of(st.sampled_from(["u", "v"]), _ANY),
        "want": st.one_of(st.integers(0, 50), _ANY),
        "cost": st.one_of(st.integers(1, 3), _ANY),
        "settle": st.one_of(
            st.lists(
                st.fixed_dictionaries(
                    {"lease": st.integers(-2, 50), "unused": st.integers(-2, 50)}
                ),
                max_size=3,
            ),
            _ANY,
        ),
    },
)


@settings(max_examples=200, deadline=None)
@given(body=QUOTA_ASKS)
def test_any_quota_ask_gets_json_below_500(
    sync_leasing_node: SyncLeasingNode, body: dict[str, object]
) -> None:
    response = sync_leasing_node.post(json.dumps(body).encode())
    assert response.status_code < 500, response.text
    data = response.json()
    if response.status_code >= 400:
        assert {"error", "detail"} <= set(data)
    else:
        assert data["epoch"] == 1 and "refunded" in data
        lease = data["lease"]
        assert lease is None or (lease["units"] >= 0 and lease["epoch"] == 1)


async def test_a_full_store_says_so_without_flooding_the_log(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node at its key cap taking a stream of new keys logged every 1,000th
    refusal (50 lines a second at 50,000 new keys a second: an exploratory
    tester); now one line per 10 s, which says how many so far."""
    caplog.set_level(logging.WARNING, logger="ringlimit.node")
    node, _ = make_node(max_keys=10)
    async with client_for(node) as client:
        for batch in range(5):  # 5,000 new keys: 4,990 refused
            checks = [{"key": f"k{batch}-{i}", "rule": "api"} for i in range(1000)]
            answer = await client.post(f"{NODE}/v1/check", json={"checks": checks})
            assert answer.status_code == 200, answer.text
    lines = [r.getMessage() for r in caplog.records if "key cap of 10" in r.getMessage()]
    assert len(lines) == 1, lines
    assert node.store.store_full_events == 4990


async def test_a_full_store_refuses_a_closed_rules_new_key_as_the_services_fault() -> None:
    """A new key past the cap under a closed rule was answered 429 with
    ``remaining: 99`` (the fresh quota it was decided on) and no retry time:
    the client was told it was over a limit it had never used. The store, not
    the client, refused it: 503, nothing left said, as a closed rule's Redis
    outage answers (node/redis_backend.py), and the same on the decision API."""
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 100, 60.0, on_error="closed")),))
    node, _ = make_node(config, max_keys=1)
    async with client_for(node) as client:
        assert (await client.get("/", headers={"X-User-Id": "first"})).status_code == 200
        refused = await client.get("/", headers={"X-User-Id": "later"})
        assert refused.status_code == 503, refused.text
        assert refused.json()["reason"] == "store_full"
        # Not a retry time from the fresh quota: the 503's "try again soon", as
        # the cluster's other 503s say it (it had none).
        assert refused.headers["retry-after"] == "1"
        assert refused.headers["x-ratelimit-remaining"] == "0"
        answer = await client.post("/v1/check", json={"key": "later", "rule": "api"})
        assert answer.status_code == 503, answer.text  # as the proxy path says it
        assert answer.headers["retry-after"] == "1"
        result = answer.json()
        assert (result["allowed"], result["remaining"], result["reason"]) == (
            False,
            0,
            "store_full",
        )
        assert result["retry_after"] is None
        # The user who has a state keeps counting as usual.
        assert (await client.get("/", headers={"X-User-Id": "first"})).status_code == 200


@pytest.mark.parametrize(
    "path",
    [
        "/internal/cluster",
        "/internal/import",
        "/internal/pull",
        "/internal/replica",
        "/internal/lease",
        "/internal/quota",
    ],
)
async def test_a_client_gone_before_its_body_was_read_is_no_traceback(path: str) -> None:
    """uvicorn answers a read after the connection closed with ``http.disconnect``,
    even of a body that had arrived: Starlette raised ClientDisconnect out of the
    endpoint, and uvicorn logged "Exception in ASGI application" with a
    traceback (a router killed with a lease request on its way: an exploratory
    tester). The endpoint's own 400 now, sent to nobody, and nothing raised."""
    node, _ = make_node()
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "PUT" if path == "/internal/cluster" else "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 4000),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }
    await node(scope, receive, send)  # type: ignore[arg-type]
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 400, sent
    assert b"incomplete_body" in b"".join(m.get("body", b"") for m in sent[1:])


@pytest.mark.parametrize(
    "marks",
    [
        {"origin": "http://evil.example"},
        {"sec-fetch-site": "cross-site"},
        {"origin": "null", "sec-fetch-site": "cross-site"},
        {"host": "evil.example:4000", "origin": "http://evil.example:4000"},  # rebound
        {"host": "evil.example"},
    ],
)
async def test_a_page_of_another_site_cannot_spend_quota_on_a_node_without_a_token(
    marks: dict[str, str],
) -> None:
    """Without an internal token a node's decision API is open, but not to a web
    page: a page of any site could POST checks to it (text/plain needs no
    preflight), or rebind its name to 127.0.0.1 and read the answers. It was
    answered (exploratory testers: 421 not_owner, the body parsed; then a
    rebinding page's Host alone); now 403, nothing decided."""
    node, _ = make_node()
    async with client_for(node) as client:
        headers = {"content-type": "text/plain", **marks}
        refused = await client.post("/v1/check", content=b'{"key": "a"}', headers=headers)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"] == "forbidden"
        plain = await client.post("/v1/check", json={"key": "a"})
        assert plain.status_code == 200 and plain.json()["remaining"] == 4
    async with client_for(node, ("10.1.2.3", 4000)) as remote:  # another host
        # Open to tools (routers, apps) elsewhere, as documented; a browser's
        # marks are refused from there too (a rebinding page's Host is not: a
        # name is this host's concern only; keep node ports internal, or set a
        # token).
        assert (await remote.post("/v1/check", json={"key": "b"})).status_code == 200
        if "sec-fetch-site" in marks or ("origin" in marks and "host" not in marks):
            refused = await remote.post("/v1/check", content=b'{"key": "b"}', headers=headers)
            assert refused.status_code == 403, refused.text
