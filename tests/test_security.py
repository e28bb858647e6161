"""What must never cross the front door, and what must never reach the app."""

from __future__ import annotations

import json
import logging
import socket
import time
from typing import Any

import pytest

from node.asgi import Receive, Scope, Send, drain, send_json
from node.clock import FrozenClock
from node.config import ClusterConfig
from router.testing import InProcessCluster
from tests.processes import Procs, free_port, procs, wait_healthy  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio

CONFIG = ClusterConfig.from_dict({"rules": [{"name": "api", "rate": "5/minute"}]})


async def headers_app(scope: Scope, receive: Receive, send: Send) -> None:
    await drain(receive)
    await send_json(send, 200, {"headers": [[k.decode(), v.decode()] for k, v in scope["headers"]]})


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/internal/cluster"),
        ("PUT", "/internal/cluster"),
        ("POST", "/internal/pull"),
        ("POST", "/internal/import"),
        ("GET", "/internal/status"),
        ("GET", "/internal"),
    ],
)
async def test_the_router_never_forwards_the_internal_api(method: str, path: str) -> None:
    async with InProcessCluster(3, CONFIG, clock=FrozenClock(), internal_token="s3cret") as c:
        before = {n: node.shard.epoch for n, node in c.nodes.items() if node.shard}
        response = await c.client.request(
            method, path, headers={"X-User-Id": "mallory"}, content=b"{}"
        )
        assert response.status_code == 404
        assert response.json()["error"] == "not_found"
        assert {n: node.shard.epoch for n, node in c.nodes.items() if node.shard} == before


async def test_the_app_sees_neither_the_internal_token_nor_routing_fields() -> None:
    cluster = InProcessCluster(
        2, CONFIG, clock=FrozenClock(), internal_token="s3cret", node_options={}
    )
    for node in cluster.nodes.values():
        node.limited.app = headers_app
    async with cluster:
        response = await cluster.client.get(
            "/x", headers={"X-User-Id": "alice", "X-Forwarded-For": "203.0.113.9"}
        )
        assert response.status_code == 200
        seen: dict[str, Any] = {}
        for name, value in response.json()["headers"]:
            seen.setdefault(name, []).append(value)
        assert "x-ringlimit-token" not in seen
        assert "x-ringlimit-key" not in seen
        assert "s3cret" not in json.dumps(response.json())
        # One X-Forwarded-For: the client's chain, then the peer the router saw.
        assert len(seen["x-forwarded-for"]) == 1
        assert seen["x-forwarded-for"][0].startswith("203.0.113.9, ")


async def test_the_app_gets_every_forwarded_for_field_in_one_chain() -> None:
    """Several X-Forwarded-For fields are one list (RFC 9110 5.3): the router
    passed on only the last one, so the application lost the hops before it."""
    cluster = InProcessCluster(1, CONFIG, clock=FrozenClock(), internal_token="s3cret")
    for node in cluster.nodes.values():
        node.limited.app = headers_app
    async with cluster:
        response = await cluster.client.get(
            "/x",
            headers=[
                ("X-User-Id", "alice"),
                ("X-Forwarded-For", "198.51.100.1"),
                ("X-Forwarded-For", "203.0.113.9"),
            ],
        )
        assert response.status_code == 200
        chains = [v for k, v in response.json()["headers"] if k == "x-forwarded-for"]
        assert chains == ["198.51.100.1, 203.0.113.9, 127.0.0.1"]


def test_redis_passwords_are_redacted_from_logs_and_errors() -> None:
    from node.redis_backend import RedisBackend, redact_url

    assert redact_url("redis://default:hunter2@127.0.0.1:6379/0") == (
        "redis://default:***@127.0.0.1:6379/0"
    )
    assert redact_url("redis://127.0.0.1:6379/0") == "redis://127.0.0.1:6379/0"
    # In the query too (redis-py takes it there), the rest shown as written.
    assert redact_url("unix:///run/redis.sock?db=2&password=hunter2") == (
        "unix:///run/redis.sock?db=2&password=***"
    )
    assert (
        redact_url("rediss://h:6380/0?ssl_password=hunter2") == "rediss://h:6380/0?ssl_password=***"
    )
    assert "hunter2" not in redact_url("redis://u:hunter2@[::1/0?password=hunter2")
    backend = RedisBackend("redis://u:hunter2@127.0.0.1:1/0")
    assert "hunter2" not in backend.where


def test_a_bypass_header_may_not_impersonate_ringlimit_fields() -> None:
    from node.config import ConfigError

    with pytest.raises(ConfigError, match="X-Ringlimit-"):
        ClusterConfig.from_dict({"bypass": {"header": "X-Ringlimit-Failover"}})
    assert ClusterConfig.from_dict({"bypass": {"header": "X-Partner-Token"}})


@pytest.mark.parametrize(
    ("bypass", "identity", "why"),
    [
        ("Host", {}, "HTTP or a proxy uses it"),
        ("content-length", {}, "HTTP or a proxy uses it"),
        ("Connection", {}, "HTTP or a proxy uses it"),
        ("TE", {}, "HTTP or a proxy uses it"),
        ("X-Forwarded-For", {}, "HTTP or a proxy uses it"),
        ("x-user-id", {}, "identity.name"),
        ("X-Account", {"name": "X-Account"}, "identity.name"),
        ("X-User-Tier", {}, "identity.tier_header"),
    ],
)
def test_a_bypass_header_may_not_be_a_field_whose_value_is_no_secret(
    bypass: str, identity: dict[str, str], why: str
) -> None:
    """Every HTTP/1.1 client sends ``Host`` (a value anyone may copy), a router
    writes ``X-Forwarded-For``, hop-by-hop fields never reach a node behind a
    router, and in the user-id or tier field a user whose id equals a token
    would bypass every limit: refused with what the field is."""
    from node.config import ConfigError

    with pytest.raises(ConfigError, match=why):
        ClusterConfig.from_dict({"bypass": {"header": bypass}, "identity": identity})


def test_a_bypass_header_may_be_any_other_field() -> None:
    """Authorization (a partner's bearer token), and the user-id field's usual
    name once the id comes from somewhere else."""
    for config in (
        {"bypass": {"header": "Authorization"}},
        {"bypass": {"header": "X-User-Id"}, "identity": {"source": "client"}},
        {"bypass": {"header": "X-User-Tier"}, "identity": {"tier_header": ""}},
    ):
        assert ClusterConfig.from_dict(config).bypass_header == config["bypass"]["header"]


def test_such_a_bypass_header_taken_by_another_process_is_kept_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A config another ringlimit process already took (an etcd record, a node's
    ring, perhaps written by a version without the check) still loads, said in
    the log: a router that could not read it would not start."""
    with caplog.at_level(logging.WARNING, logger="ringlimit.config"):
        config = ClusterConfig.from_dict(
            {"bypass": {"header": "Host"}}, source="etcd record", strict=False
        )
    assert config.bypass_header == "Host"
    assert any("bypass.header: 'Host'" in r.getMessage() for r in caplog.records), caplog.text


async def test_a_config_with_such_a_bypass_header_is_refused_by_the_admin_api() -> None:
    """``PUT /admin/config``: a 400 that says why, and the cluster's config as it was."""
    async with InProcessCluster(2, CONFIG, clock=FrozenClock()) as cluster:
        before = (await cluster.client.get("/admin/config")).json()
        answer = await cluster.client.put(
            "/admin/config", json={**before["config"], "bypass": {"header": "Host"}}
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == "invalid_config"
        assert "bypass.header: 'Host'" in answer.json()["detail"]
        assert (await cluster.client.get("/admin/config")).json() == before


async def test_the_decision_api_needs_its_token_when_one_is_set() -> None:
    async with InProcessCluster(2, CONFIG, clock=FrozenClock()) as cluster:
        cluster.router.settings.api_token = "api-s3cret"
        check = {"key": "alice", "cost": 5}
        refused = await cluster.client.post("/v1/check", json=check)
        assert refused.status_code == 401 and refused.json()["error"] == "unauthorized"
        wrong = await cluster.client.post(
            "/v1/check", json=check, headers={"Authorization": "Bearer nope"}
        )
        assert wrong.status_code == 401
        # Nothing was spent by the refused calls: alice still has her whole quota.
        allowed = await cluster.client.post(
            "/v1/check", json=check, headers={"Authorization": "Bearer api-s3cret"}
        )
        assert allowed.status_code == 200 and allowed.json()["allowed"] is True


@pytest.mark.parametrize(
    "marks",
    [
        {"Origin": "http://evil.example", "Content-Type": "text/plain"},
        {"Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"},
        {"Host": "evil.example:8000"},  # a rebinding page, from this host
    ],
)
async def test_without_an_api_token_a_web_page_cannot_spend_quota_through_the_router(
    marks: dict[str, str],
) -> None:
    """Without RINGLIMIT_API_TOKEN the router's decision API was open to any page a
    browser on its host showed: a text/plain POST spent a unit of the victim's
    quota (200; an exploratory tester), where a node's refused it. Now 403 as
    the node's, nothing decided; tools (no browser fields) are served."""
    async with InProcessCluster(2, CONFIG, clock=FrozenClock()) as cluster:
        check = json.dumps({"key": "victim", "cost": 5})
        refused = await cluster.client.post("/v1/check", content=check, headers=marks)
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"] == "forbidden"
        assert "RINGLIMIT_API_TOKEN" in refused.json()["detail"]
        batch = json.dumps({"checks": [{"key": "victim"}]})
        assert (
            await cluster.client.post("/v1/check", content=batch, headers=marks)
        ).status_code == 403
        # Nothing was spent: the victim's whole quota (5) is still there.
        whole = await cluster.client.post("/v1/check", json={"key": "victim", "cost": 5})
        assert whole.status_code == 200 and whole.json()["allowed"] is True, whole.text


async def test_the_admin_config_hides_the_privacy_salt_and_keeps_it_when_sent_back() -> None:
    """GET /admin/config showed privacy.salt, the HMAC key that hides user ids
    (with it a hash can be tested against guessed ids), and `ringlimit config`
    printed it (the review and a tester). Hidden now; sent back hidden, a PUT
    keeps the cluster's salt."""
    async with InProcessCluster(2, CONFIG, clock=FrozenClock()) as cluster:
        salted = {**CONFIG.to_dict(), "privacy": {"show_keys": "hashed", "salt": "pepper"}}
        put = await cluster.client.put("/admin/config", json=salted)
        assert put.status_code == 200, put.text
        assert "pepper" not in put.text and put.json()["config"]["privacy"]["salt"] == "<hidden>"
        shown = (await cluster.client.get("/admin/config")).json()["config"]
        assert shown["privacy"] == {"show_keys": "hashed", "salt": "<hidden>"}
        again = await cluster.client.put("/admin/config", json=shown)
        assert again.status_code == 200, again.text
        assert cluster.router.config.privacy.salt == "pepper"
        assert all(n.authority.config.privacy.salt == "pepper" for n in cluster.nodes.values())


async def test_a_nodes_decision_api_takes_the_internal_token_when_one_is_set() -> None:
    """With RINGLIMIT_INTERNAL_TOKEN set, only routers (which send it) may use a
    node's decision API: before, anyone reaching a node port could spend any
    user's quota there (the security audit). Routers' checks still pass."""
    from router.testing import node_url

    async with InProcessCluster(
        1, CONFIG, clock=FrozenClock(), internal_token="int-s3cret"
    ) as cluster:
        node = node_url("n1") + "/v1/check"
        check = {"key": "alice", "cost": 5}
        for headers in ({}, {"X-Ringlimit-Token": "nope"}, {"Authorization": "Bearer nope"}):
            refused = await cluster.client.post(node, json=check, headers=headers)
            assert refused.status_code == 401, refused.text
            assert refused.json()["error"] == "unauthorized"
        for headers in (
            {"X-Ringlimit-Token": "int-s3cret"},
            {"Authorization": "Bearer int-s3cret"},
        ):
            taken = await cluster.client.post(node, json={"key": "bob"}, headers=headers)
            assert taken.status_code == 200 and taken.json()["allowed"] is True
        # Through the router (which sends the token): decided, and alice's quota whole.
        routed = await cluster.client.post("/v1/check", json=check)
        assert routed.status_code == 200 and routed.json()["allowed"] is True


def test_an_ipv4_client_of_a_dual_stack_socket_is_loopback_when_it_is() -> None:
    """``--host ::`` sees 127.0.0.1 as ::ffff:127.0.0.1: refused as not loopback
    (403 on the admin API without a token), before."""
    from node.security import is_loopback

    assert is_loopback("::ffff:127.0.0.1") and is_loopback("127.0.0.1") and is_loopback("::1")
    assert not is_loopback("::ffff:10.0.0.1") and not is_loopback("10.0.0.1")


#: What a browser adds to a request a page of another site makes: a POST with a
#: text/plain body is a "simple" request, sent without asking the router first.
CROSS_SITE = {
    "Origin": "https://evil.example",
    "Sec-Fetch-Site": "cross-site",
    "Content-Type": "text/plain",
}
#: A page of evil.example whose name its DNS now resolves to 127.0.0.1 (DNS
#: rebinding): same origin as far as the browser knows, so it may read answers.
REBOUND = {"Host": "evil.example:8000", "Sec-Fetch-Site": "same-origin"}
#: The same page served over plain HTTP: not a secure context, so the browser
#: sends no Sec-Fetch-Site, and a same-origin GET no Origin; only Host tells.
REBOUND_PLAIN = {"Host": "evil.example:8000"}


async def test_without_an_admin_token_another_sites_page_cannot_use_the_admin_api() -> None:
    """Without an admin token the admin API trusts loopback clients, and an
    operator's browser is one: a page of any site could join its own node to the
    ring (a cross-site POST needs no preflight) or, rebinding its name to
    127.0.0.1, read the ring. Before, the join below was made (200) and the ring
    read; now both are 403, and calls without a browser's fields still pass."""
    from ring import Member
    from router.testing import node_url

    async with InProcessCluster(2, CONFIG, clock=FrozenClock()) as cluster:
        cluster._make_node("n3")
        join = json.dumps({"id": "n3", "url": node_url("n3")})
        forged = await cluster.client.post("/admin/nodes", content=join, headers=CROSS_SITE)
        assert forged.status_code == 403, forged.text
        assert "n3" not in cluster.router.membership.view.ids
        rebound = await cluster.client.get("/admin/ring", headers=REBOUND)
        assert rebound.status_code == 403
        data = await cluster.client.get("/admin/ui/data", headers=REBOUND)
        assert data.status_code == 403
        # Served before (an exploratory tester read /admin/ring with Host alone).
        for path in ("/admin/ring", "/admin/top", "/admin/ui/data"):
            plain = await cluster.client.get(path, headers=REBOUND_PLAIN)
            assert plain.status_code == 403, (path, plain.text)
        joined = await cluster.client.post("/admin/nodes", content=join, headers=REBOUND_PLAIN)
        assert joined.status_code == 403, joined.text
        assert "n3" not in cluster.router.membership.view.ids
        # Names no page can rebind: loopback ones, addresses (a node bound to
        # 0.0.0.0 registers so), this machine's own name (or else, as a review found).
        import socket

        for name in (
            "127.0.0.1:8000",
            "localhost.:8000",  # the same name (it was refused)
            "LOCALHOST",
            "[::1]:8000",
            "n1.localhost",
            "0.0.0.0:8001",
            "10.0.0.7:8000",
            f"{socket.gethostname()}:8001",
        ):
            loopback = await cluster.client.get("/admin/ring", headers={"Host": name})
            assert loopback.status_code == 200, (name, loopback.text)
        # The ring page itself, and its data, opened at a loopback address.
        page = {"Host": "127.0.0.1:8000", "Sec-Fetch-Site": "same-origin"}
        assert (await cluster.client.get("/admin/ui/data", headers=page)).status_code == 200
        local = {"Host": "localhost:8000", "Origin": "http://localhost:8000"}
        assert (await cluster.client.get("/admin/ring", headers=local)).status_code == 200
        # Tools (no browser fields) are served as before.
        assert (await cluster.client.get("/admin/ring")).status_code == 200
        assert Member("n1", node_url("n1")) in cluster.router.membership.view.members


async def test_without_an_internal_token_another_sites_page_cannot_call_a_node() -> None:
    """The nodes' internal API trusts loopback clients without an internal token
    (``ringlimit up``): a cross-site POST reached ``/internal/lease`` and the other
    POST endpoints (answered 200 before, 403 now)."""
    from router.testing import node_url

    async with InProcessCluster(1, CONFIG, clock=FrozenClock()) as cluster:
        url = node_url("n1") + "/internal/lease"
        forged = await cluster.client.post(url, content=b"{}", headers=CROSS_SITE)
        assert forged.status_code == 403, forged.text
        rebound = await cluster.client.get(node_url("n1") + "/internal/status", headers=REBOUND)
        assert rebound.status_code == 403
        plain = await cluster.client.post(url, content=b"{}", headers=REBOUND_PLAIN)
        assert plain.status_code == 403, plain.text
        assert (await cluster.client.post(url, content=b"{}")).status_code == 200


async def test_a_router_without_the_nodes_token_is_told_so() -> None:
    """A node that requires the internal token refuses a router that sends none:
    the push failure says which token, where it said only "answered HTTP 401"
    and the router went on to suspect its own network (an exploratory tester)."""
    import httpx

    from node.app import NodeSettings, create_app
    from ring import Member
    from router.membership import MembershipError
    from router.nodeclient import NodeClient

    node = create_app(NodeSettings(node_id="n1", internal_token="s3cret"))
    transport = httpx.ASGITransport(app=node)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://n1") as client:
        member = Member("n1", "http://n1")
        with pytest.raises(MembershipError) as refused:
            await NodeClient(client).push_one(member, {"ring": None})
        assert "RINGLIMIT_INTERNAL_TOKEN" in str(refused.value)
        assert "s3cret" not in str(refused.value)


@pytest.mark.parametrize("on_error", ["open", "closed"])
async def test_a_router_with_another_internal_token_gets_no_decision_and_says_why(
    on_error: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The internal token rotated on one router only: the nodes took its
    requests for a client's, and every key they did not own came back 421
    not_owner with the node's internals, which the router passed on. Now the
    node decides nothing (503, x-ringlimit-unavailable: token), the router
    answers as for an unreachable owner (its rule's on_error) and logs why."""
    from ring import Member
    from router.testing import node_url

    config = ClusterConfig.from_dict(
        {"rules": [{"name": "api", "rate": "5/minute", "on_error": on_error}]}
    )
    async with InProcessCluster(3, config, clock=FrozenClock(), internal_token="s3cret") as c:
        seeds = [Member(n, node_url(n)) for n in c.nodes]
        other = c.new_router("http://rotated.localhost", seeds=seeds, internal_token="rotated")
        await other.start()
        try:
            with caplog.at_level("WARNING", logger="ringlimit.router"):
                answers = [
                    await c.client.get(
                        "http://rotated.localhost/x", headers={"X-User-Id": f"user-{i}"}
                    )
                    for i in range(12)
                ]
        finally:
            await other.close()
        for answer in answers:
            assert answer.status_code == 503, answer.text
            error = answer.json()["error"]
            expected = "limiter_unavailable" if on_error == "closed" else "internal_token_refused"
            assert error == expected, answer.text
        logged = [r.getMessage() for r in caplog.records if "internal token" in r.getMessage()]
        assert logged and "s3cret" not in " ".join(logged) and "rotated" not in " ".join(logged)
        # Nothing was counted: the right router's users still have their whole quota.
        for i in range(12):
            kept = await c.client.get("/x", headers={"X-User-Id": f"user-{i}"})
            assert kept.headers["ratelimit"].startswith('"api";r=4'), kept.headers


@pytest.mark.parametrize(
    ("token", "length", "status"),
    [("wrong", 2_000_000, 401), ("s3cret", 2_000_000, 413)],
)
def test_a_node_refuses_a_decision_call_before_its_body(
    procs: Procs,  # noqa: F811 (the fixture)
    token: str,
    length: int,
    status: int,
) -> None:
    """A call refused on its headers alone (a wrong internal token, a declared
    length over ``limits.max_body``) is answered at once: the node read the
    whole body first, and a client sending 2 MB slowly waited for all of it, or
    the body timeout (10 s), for its 401 (an exploratory tester)."""
    port = free_port()
    node = procs.start(
        "n1",
        ["node", "--id", "n1", "--port", str(port), "--rule", "5/minute"],
        env={"RINGLIMIT_INTERNAL_TOKEN": "s3cret"},
    )
    wait_healthy(f"http://127.0.0.1:{port}", node)
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(
            b"POST /v1/check HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + token.encode() + b"\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n{" % length
        )
        started = time.monotonic()
        head = sock.recv(65536)
        assert head.startswith(b"HTTP/1.1 %d " % status), head
        assert time.monotonic() - started < 3.0
    node.stop()
