"""``RateLimitMiddleware`` on its own, identity extraction, and header values."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from node.authority import Authority
from node.clock import FrozenClock
from node.config import ClusterConfig, Identity, ScopedRule, hash_token
from node.decision import Decision, Verdict
from node.headers import rate_limit_headers, retry_after_value, whole_seconds
from node.identity import IdentityResolver, InvalidUserId
from node.middleware import RateLimitMiddleware
from node.rules import Rule
from tests import sample_app

pytestmark = pytest.mark.anyio


def client(app: Any, peer: str = "127.0.0.1") -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, client=(peer, 5555))
    return httpx.AsyncClient(transport=transport, base_url="http://app.test")


def frozen(
    *rules: Rule | ScopedRule, clock: FrozenClock | None = None, **options: Any
) -> tuple[Authority, FrozenClock]:
    clock = clock or FrozenClock()
    scoped = tuple(r if isinstance(r, ScopedRule) else ScopedRule(r) for r in rules)
    return Authority.in_memory(ClusterConfig(rules=scoped, **options), clock=clock), clock


# --------------------------------------------------------------------------- standalone use


async def test_standalone_with_rule_strings() -> None:
    app = RateLimitMiddleware(sample_app.app, rules=["3/minute"])
    async with client(app) as c:
        statuses = [(await c.get("/", headers={"X-User-Id": "a"})).status_code for _ in range(5)]
        assert statuses == [201, 201, 201, 429, 429]
        assert (await c.get("/", headers={"X-User-Id": "b"})).status_code == 201
        denied = await c.get("/", headers={"X-User-Id": "a"})
        assert denied.headers["ratelimit-policy"] == '"3-per-minute";q=3;w=60'
        assert int(denied.headers["retry-after"]) >= denied.json()["retry_after"]
        assert denied.json()["error"] == "rate_limited"


async def test_allowed_requests_reach_the_app_with_headers_added() -> None:
    authority, clock = frozen(Rule("api", 2, 10.0))
    app = RateLimitMiddleware(
        sample_app.app, authority=authority, trust_router=False, wall_clock=clock
    )
    async with client(app) as c:
        response = await c.post("/items?q=1", headers={"X-User-Id": "u1"}, content=b"payload")
        assert response.status_code == 201
        assert response.headers["x-sample-app"] == "yes"  # the app's own headers are kept
        assert response.headers["ratelimit"] == '"api";r=1;t=5'
        # The legacy reset is a Unix time by default: the same moment as t.
        assert response.headers["x-ratelimit-reset"] == str(int(clock() + 5))
        seen = response.json()
        assert (seen["method"], seen["path"], seen["query"], seen["body"]) == (
            "POST",
            "/items",
            "q=1",
            "payload",
        )
        assert seen["user"] == "u1"  # the app learns the key through scope["state"]
        await c.get("/", headers={"X-User-Id": "u1"})
        denied = await c.get("/", headers={"X-User-Id": "u1"})
        assert denied.status_code == 429 and denied.headers["retry-after"] == "5"
        clock.advance(5)
        assert (await c.get("/", headers={"X-User-Id": "u1"})).status_code == 201


async def test_the_response_body_is_streamed_not_buffered() -> None:
    chunks_sent: list[bytes] = []

    async def streaming(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for part in (b"one,", b"two,", b"three"):
            chunks_sent.append(part)
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    messages: list[dict[str, Any]] = []

    async def record(message: dict[str, Any]) -> None:
        messages.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    authority, _ = frozen(Rule("api", 5, 60.0))
    app = RateLimitMiddleware(streaming, authority=authority)
    scope = {
        "type": "http",
        "method": "GET",
        "path": "/",
        "headers": [(b"x-user-id", b"s")],
        "query_string": b"",
        "client": ("127.0.0.1", 1),
    }
    await app(scope, receive, record)
    assert [m["type"] for m in messages] == ["http.response.start"] + ["http.response.body"] * 4
    assert [m["body"] for m in messages[1:]] == [b"one,", b"two,", b"three", b""]
    assert (b"ratelimit", b'"api";r=4;t=12') in messages[0]["headers"]


async def test_missing_user_id_is_a_json_400_and_the_app_is_not_called() -> None:
    called = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        called.append(scope)

    authority, _ = frozen(Rule("api", 5, 60.0))
    async with client(RateLimitMiddleware(app, authority=authority)) as c:
        response = await c.post("/", content=b"x" * 10_000)
        assert response.status_code == 400
        body = response.json()
        assert body["error"] == "missing_user_id" and "X-User-Id" in body["detail"]
        too_long = await c.get("/", headers={"X-User-Id": "x" * 257})
        assert too_long.status_code == 400 and too_long.json()["error"] == "key_too_long"
    assert called == []


async def test_non_http_scopes_pass_through() -> None:
    seen: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["type"])

    middleware = RateLimitMiddleware(app, rules=["1/minute"])
    await middleware({"type": "lifespan"}, None, None)  # type: ignore[arg-type]
    await middleware({"type": "websocket", "headers": []}, None, None)  # type: ignore[arg-type]
    assert seen == ["lifespan", "websocket"]


async def test_standalone_middleware_ignores_router_only_headers() -> None:
    """Without a router in front, a client could otherwise pick any key or skip limiting."""
    app = RateLimitMiddleware(sample_app.app, rules=["2/minute"])
    async with client(app) as c:
        for _ in range(2):
            assert (await c.get("/", headers={"X-User-Id": "eve"})).status_code == 201
        forged = [
            {"X-User-Id": "eve", "X-Ringlimit-Failover": "owner-unreachable"},
            {"X-User-Id": "eve", "X-Ringlimit-Key": "someone-new"},
        ]
        for headers in forged:
            response = await c.get("/", headers=headers)
            assert response.status_code == 429, headers
            assert "x-ringlimit-degraded" not in response.headers


async def test_behind_a_router_the_routed_key_is_believed_only_with_the_token() -> None:
    authority, _ = frozen(Rule("api", 1, 60.0))
    app = RateLimitMiddleware(sample_app.app, authority=authority, internal_token="tok")
    async with client(app) as c:
        routed = {"X-Ringlimit-Key": "r%C3%A9mi", "X-Ringlimit-Token": "tok"}
        response = await c.get("/", headers=routed)
        assert response.status_code == 201 and response.json()["user"] == "rémi"
        assert (await c.get("/", headers=routed)).status_code == 429
        # Without the token the header is not believed: the user id comes from identity.
        remi = "rémi".encode()
        forged = await c.get("/", headers={"X-Ringlimit-Key": "other", "X-User-Id": remi})
        assert forged.status_code == 429
        no_id = await c.get("/", headers={"X-Ringlimit-Key": "other"})
        assert no_id.status_code == 400
        failover = await c.get(
            "/", headers={"X-Ringlimit-Failover": "owner-unreachable", "X-User-Id": remi}
        )
        assert failover.status_code == 429
        trusted_failover = await c.get(
            "/", headers={"X-Ringlimit-Failover": "owner-unreachable", "X-Ringlimit-Token": "tok"}
        )
        assert trusted_failover.status_code == 201
        assert trusted_failover.headers["x-ringlimit-degraded"] == "owner-unreachable"


async def test_bypass_and_scoped_rules_standalone() -> None:
    authority, _ = frozen(
        ScopedRule(Rule("login", 1, 60.0), paths=("/login",), methods=("POST",)),
        Rule("all", 3, 60.0),
        bypass_sha256=(hash_token("ops-token"),),
    )
    app = RateLimitMiddleware(sample_app.app, authority=authority)
    async with client(app) as c:
        user = {"X-User-Id": "f"}
        assert (await c.post("/login", headers=user)).status_code == 201
        login = await c.post("/login", headers=user)
        assert login.status_code == 429 and login.json()["rule"] == "login"
        assert login.headers["ratelimit-policy"] == '"login";q=1;w=60, "all";q=3;w=60'
        assert login.headers["ratelimit"] == '"login";r=0;t=60, "all";r=2;t=20'
        assert (await c.get("/login", headers=user)).status_code == 201  # GET: only "all"
        ops = {**user, "X-Ringlimit-Bypass": "ops-token"}
        for _ in range(3):
            bypassed = await c.post("/login", headers=ops)
            assert bypassed.status_code == 201 and bypassed.headers["x-ringlimit-bypass"] == "1"
        assert (await c.get("/", headers=user)).status_code == 201
        assert (await c.get("/", headers=user)).status_code == 429


# --------------------------------------------------------------------------- identity


def scope(
    headers: dict[str, str] | list[tuple[str, str]] | None = None,
    query: bytes = b"",
    peer: str | None = "10.0.0.1",
) -> dict[str, Any]:
    pairs = list(headers.items()) if isinstance(headers, dict) else headers or []
    return {
        "type": "http",
        "headers": [(k.lower().encode(), v.encode()) for k, v in pairs],
        "query_string": query,
        "client": (peer, 1234) if peer else None,
    }


def test_identity_from_the_default_header_and_tier() -> None:
    resolver = IdentityResolver(Identity())
    assert resolver.user(scope({"X-User-Id": "alice", "X-User-Tier": "gold"})) == "alice"
    assert resolver.tier(scope({"X-User-Id": "alice", "X-User-Tier": "gold"})) == "gold"
    assert resolver.user(scope({"X-User-Id": ""})) is None
    assert resolver.user(scope({"Other": "alice"})) is None
    assert resolver.user(scope({"X-User-Id": "jos\u00e9"})) == "jos\u00e9"
    assert IdentityResolver(Identity(tier_header=None)).tier(scope({"X-User-Tier": "g"})) is None


def test_identity_from_another_header_or_a_query_parameter() -> None:
    by_header = IdentityResolver(Identity(name="X-Api-Key"))
    assert by_header.user(scope({"X-Api-Key": "k1", "X-User-Id": "u"})) == "k1"
    by_query = IdentityResolver(Identity(source="query", name="uid"))
    assert by_query.user(scope(query=b"a=1&uid=bob%20b&b=2")) == "bob b"
    assert by_query.user(scope(query=b"uid=")) is None
    assert by_query.user(scope(query=b"UID=x")) is None
    assert by_query.user(scope({"X-User-Id": "u"})) is None


@pytest.mark.parametrize(
    ("identity", "request_scope"),
    [
        (Identity(), scope([("X-User-Id", "new-1"), ("X-User-Id", "alice")])),
        (Identity(), scope([("X-User-Id", "alice"), ("x-user-id", "")])),
        (Identity(source="query", name="uid"), scope(query=b"uid=new-1&uid=alice")),
        (Identity(source="query", name="uid"), scope(query=b"uid=alice&a=1&u%69d=")),
        (Identity(source="query", name="uid"), scope(query=b"uid&uid=alice")),
        (Identity(fallback_to_client=True), scope([("X-User-Id", "a"), ("X-User-Id", "b")])),
    ],
    ids=["header", "header-empty-second", "query", "query-encoded-empty", "query-bare", "fallback"],
)
def test_a_user_id_given_twice_is_refused(
    identity: Identity, request_scope: dict[str, Any]
) -> None:
    """The limiter took the first, many frameworks the last (Starlette's and
    Django's ``get``): ``?uid=<new>&uid=alice`` was counted under a fresh key each
    time and served as alice (an exploratory tester). Neither is guessed at."""
    with pytest.raises(InvalidUserId, match="more than once"):
        IdentityResolver(identity).user(request_scope)


def test_client_address_ignores_forwarded_for_from_untrusted_peers() -> None:
    resolver = IdentityResolver(Identity(source="client"))
    assert resolver.user(scope({"X-Forwarded-For": "1.2.3.4"}, peer="10.0.0.1")) == "10.0.0.1"
    only_other = IdentityResolver(Identity(source="client", trusted_proxies=("10.9.0.0/16",)))
    assert only_other.user(scope({"X-Forwarded-For": "1.2.3.4"}, peer="10.0.0.1")) == "10.0.0.1"
    assert resolver.user(scope(peer=None)) is None


def test_client_address_walks_the_forwarded_chain_through_trusted_proxies() -> None:
    resolver = IdentityResolver(
        Identity(source="client", trusted_proxies=("10.0.0.0/8", "2001:db8::/32"))
    )
    # The right-most untrusted hop is the client; entries to its left are client-written.
    chain = {"X-Forwarded-For": "6.6.6.6, 198.51.100.9, 10.1.1.1"}
    assert resolver.user(scope(chain, peer="10.0.0.1")) == "198.51.100.9"
    assert resolver.user(scope({"X-Forwarded-For": "203.0.113.5"}, peer="10.0.0.1")) == (
        "203.0.113.5"
    )
    assert resolver.user(scope({"X-Forwarded-For": "10.2.2.2"}, peer="10.0.0.1")) == "10.0.0.1"
    assert resolver.user(scope(peer="10.0.0.1")) == "10.0.0.1"
    v6 = scope({"X-Forwarded-For": "2001:db8::5, 2600::1"}, peer="2001:db8::1")
    assert resolver.user(v6) == "2600::1"


def test_fallback_to_client_address() -> None:
    plain = IdentityResolver(Identity())
    assert plain.user(scope(peer="192.0.2.1")) is None
    fallback = IdentityResolver(Identity(fallback_to_client=True, trusted_proxies=("10.0.0.0/8",)))
    assert fallback.user(scope(peer="192.0.2.1")) == "192.0.2.1"
    assert fallback.user(scope({"X-Forwarded-For": "192.0.2.7"}, peer="10.0.0.3")) == "192.0.2.7"
    assert fallback.user(scope({"X-User-Id": "carl"}, peer="192.0.2.1")) == "carl"
    query = IdentityResolver(Identity(source="query", name="u", fallback_to_client=True))
    assert query.user(scope(query=b"u=dora", peer="192.0.2.1")) == "dora"
    assert query.user(scope(query=b"v=dora", peer="192.0.2.1")) == "192.0.2.1"


# --------------------------------------------------------------------------- header values


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.0, "1"), (0.001, "1"), (1.0, "1"), (1.0000001, "2"), (11.5, "12"), (59.9999, "60")],
)
def test_retry_after_rounds_up_to_whole_seconds(seconds: float, expected: str) -> None:
    assert retry_after_value(seconds) == expected
    assert int(expected) >= seconds


def test_reset_rounds_up_and_is_never_negative() -> None:
    assert [whole_seconds(s) for s in (0.0, -1.0, 0.2, 12.0, 12.0000000001, 12.01)] == [
        0,
        0,
        1,
        12,
        12,
        13,
    ]


def test_headers_for_a_denied_multi_rule_verdict() -> None:
    rules = (Rule("a", 10, 60.0), Rule("b", 2, 1.5))
    decisions = (
        Decision(True, 10, 7, 18.0, None, "a", None, 6.0),
        Decision(False, 2, 0, 1.5, 0.25, "b", None, 0.25),
    )
    verdict = Verdict(False, decisions[1], decisions)
    headers = dict(rate_limit_headers(rules, verdict, now=1000.5))
    # 2 per 1.5 s is advertised in whole seconds: 4 per 3 s.
    assert headers[b"ratelimit-policy"] == b'"a";q=10;w=60, "b";q=4;w=3'
    assert headers[b"ratelimit"] == b'"a";r=7;t=6, "b";r=0;t=1'
    assert headers[b"x-ratelimit-limit"] == b"4"
    assert headers[b"x-ratelimit-remaining"] == b"0"
    assert headers[b"x-ratelimit-reset"] == b"1001"
    assert headers[b"retry-after"] == b"1"
    delta = dict(rate_limit_headers(rules, verdict, legacy_reset="delta"))
    assert delta[b"x-ratelimit-reset"] == b"1"
    legacy_off = dict(rate_limit_headers(rules, verdict, legacy=False))
    assert not [h for h in legacy_off if h.startswith(b"x-ratelimit")]
    assert legacy_off[b"retry-after"] == b"1"


async def test_a_node_reads_the_first_of_two_tier_fields_as_a_router_does() -> None:
    """Two ``X-User-Tier`` fields: the node's rules are those of the tier a
    router judged the request by (``IdentityResolver.tier``: the first field).
    The node took the last, so a request a router judged as ``premium`` (its
    open/closed rules, its quota leases) was decided under ``free``'s rules."""
    premium = ScopedRule(Rule("premium", 1, 60.0), tiers=("premium", "prémium"))
    free = ScopedRule(Rule("free", 5, 60.0), tiers=("free",))
    authority, _ = frozen(premium, free)
    app = RateLimitMiddleware(sample_app.app, authority=authority, trust_router=False)
    # A tier's bytes are read as the router reads them too: UTF-8 (else latin-1).
    for user, tier in (("u", "premium"), ("v", "prémium")):
        fields = [(b"x-user-id", user.encode()), (b"x-user-tier", tier.encode())]
        fields.append((b"x-user-tier", b"free"))
        assert IdentityResolver(Identity()).tier({"headers": fields}) == tier
        async with client(app) as c:
            first = await c.get("/", headers=fields)
            assert first.headers["ratelimit-policy"] == '"premium";q=1;w=60', tier
            assert (await c.get("/", headers=fields)).status_code == 429
