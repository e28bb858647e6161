"""``GET /admin/top``, the ring page and its data, in-process (router/top.py, router/ui.py)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import re
from typing import Any

import httpx
import pytest

from node.clock import FrozenClock
from node.config import ClusterConfig, ConfigError, Privacy, ScopedRule
from node.rules import Rule
from ring import Member, RingView
from ring.analysis import hash_share, ownership
from router.events import EventLog
from router.testing import InProcessCluster
from tests.test_node_api import assert_error

pytestmark = pytest.mark.anyio

CONFIG = ClusterConfig(
    rules=(ScopedRule(Rule("api", 3, 60.0)), ScopedRule(Rule("big", 1000, 60.0), paths=("/x",)))
)


async def hammer(cluster: InProcessCluster, users: dict[str, int]) -> None:
    for user, times in users.items():
        for _ in range(times):
            await cluster.client.get("/hello", headers={"X-User-Id": user})


def owners_differ(cluster: InProcessCluster, users: list[str]) -> bool:
    return len({cluster.owner(u) for u in users}) > 1


USERS = {f"user{i}": 3 + i for i in range(8)}  # user i is denied i times


async def test_top_merges_every_nodes_sketch() -> None:
    async with InProcessCluster(3, CONFIG, clock=FrozenClock()) as cluster:
        assert owners_differ(cluster, list(USERS))
        await hammer(cluster, USERS)
        answer = (await cluster.client.get("/admin/top", params={"rule": "api", "n": 3})).json()
        assert answer["keys"] == "plain"
        assert answer["nodes"] == {"n1": "ok", "n2": "ok", "n3": "ok"}
        assert answer["window_seconds"] == [60.0, 120.0]
        denied = answer["rules"]["api"]["denied"]
        assert [(e["key"], e["count"], e["error"]) for e in denied] == [
            ("user7", 7, 0),
            ("user6", 6, 0),
            ("user5", 5, 0),
        ]
        for entry in denied:
            assert entry["nodes"] == [cluster.owner(entry["key"])]
        near = answer["rules"]["api"]["near_limit"]
        assert len(near) == 3 and all(e["count"] == 1 for e in near)  # the 3rd request each
        # No rule named: every rule with events (here only "api").
        every = (await cluster.client.get("/admin/top")).json()
        assert list(every["rules"]) == ["api"]
        assert len(every["rules"]["api"]["denied"]) == 7  # user0 was never denied

        # int() took these: a Unicode digit (an Arabic-Indic 1), a sign, spaces, "2_0".
        odd = ("\u0661", "\uff15", "+5", " 5", "2_0", "", "9" * 5000)
        for params in ({"rule": "nope"}, {"n": "0"}, {"n": "many"}, {"n": "1001"}):
            assert_error(await cluster.client.get("/admin/top", params=params), 400)
        for n in odd:
            answer = await cluster.client.get("/admin/top", params={"n": n})
            assert_error(answer, 400)
            assert answer.json()["error"] == "invalid_n", n
        # Given twice, one reader took the first and another the last.
        for query, error in (("n=5&n=6", "invalid_n"), ("rule=api&rule=x", "invalid_rule")):
            answer = await cluster.client.get(f"/admin/top?{query}")
            assert_error(answer, 400)
            assert answer.json()["error"] == error, query


async def test_top_says_which_node_did_not_answer() -> None:
    async with InProcessCluster(3, CONFIG, clock=FrozenClock()) as cluster:
        await hammer(cluster, USERS)
        down = cluster.owner("user7")
        cluster.take_down(down)
        answer = (await cluster.client.get("/admin/top", params={"n": 50})).json()
        assert answer["nodes"][down] == "no_answer"
        shown = {e["key"] for e in answer["rules"]["api"]["denied"]}
        assert "user7" not in shown
        assert shown == {u for u in USERS if cluster.owner(u) != down and USERS[u] > 3}


async def test_top_counts_the_denials_a_router_made_from_its_leases() -> None:
    """A hot user's requests are mostly decided by the router from the owner's
    quota leases (docs/hotkeys.md), and the owner never sees them: /admin/top
    listed the few denials the owner made itself and missed the rest, so the
    user most limited was shown as barely limited. Its count is every 429."""
    rule = Rule("hot", 100, 60.0, burst=40, lease="auto")
    config = ClusterConfig(rules=(ScopedRule(rule),))
    async with InProcessCluster(3, config, clock=FrozenClock()) as cluster:
        owner = cluster.owner("alice")
        statuses = []
        for _ in range(300):
            statuses.append(
                (await cluster.client.get("/hello", headers={"X-User-Id": "alice"})).status_code
            )
            for _ in range(5):  # let the router's background lease asks run
                await asyncio.sleep(0)
        denied = statuses.count(429)
        assert statuses.count(200) == 40 and denied == 260
        from_leases = cluster.router.leases.counts["denied"]
        assert from_leases > 0
        answer = (await cluster.client.get("/admin/top", params={"rule": "hot"})).json()
        [entry] = answer["rules"]["hot"]["denied"]
        assert (entry["key"], entry["count"], entry["error"]) == ("alice", denied, 0)
        assert entry["leased"] == from_leases
        assert entry["nodes"] == ([owner] if denied > from_leases else [])
        # Admitted near the limit from a lease: the owner did not count those either.
        [near] = answer["rules"]["hot"]["near_limit"]
        # With at most 10 % of the limit (100) left: remaining 10 down to 0.
        assert (near["key"], near["count"], near["error"]) == ("alice", 11, 0)
        assert near["leased"] > 0
        assert (await cluster.client.get("/admin/ui/data")).json()["top"] == {
            "hot": answer["rules"]["hot"]
        }
        metrics = (await cluster.client.get("/metrics")).text
        assert f'ringlimit_router_leases_total{{kind="denied"}} {float(from_leases)}' in metrics
        units = cluster.router.leases.counts["units"]
        assert units > 0
        assert f'ringlimit_router_lease_units_total{{kind="granted"}} {float(units)}' in metrics


async def test_hashed_keys_never_show_the_id() -> None:
    config = CONFIG.with_(privacy=Privacy(show_keys="hashed", salt="pepper"))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        await hammer(cluster, {"alice@example.com": 6})
        text = (await cluster.client.get("/admin/top")).text
        data = (await cluster.client.get("/admin/ui/data")).text
        assert "alice" not in text and "alice" not in data
        expected = hmac.new(b"pepper", b"alice@example.com", hashlib.sha256).hexdigest()[:16]
        answer = (await cluster.client.get("/admin/top")).json()
        assert answer["keys"] == "hashed"
        assert answer["rules"]["api"]["denied"][0]["key"] == "h:" + expected
        assert ("h:" + expected) in data


async def test_without_a_salt_each_router_draws_its_own() -> None:
    config = CONFIG.with_(privacy=Privacy(show_keys="hashed"))
    async with InProcessCluster(1, config, clock=FrozenClock()) as cluster:
        await hammer(cluster, {"alice": 6})
        first = (await cluster.client.get("/admin/top")).json()["rules"]["api"]["denied"][0]
        again = (await cluster.client.get("/admin/top")).json()["rules"]["api"]["denied"][0]
        assert first["key"] == again["key"] and re.fullmatch(r"h:[0-9a-f]{16}", first["key"])
        assert first["key"] != "h:" + hmac.new(b"", b"alice", hashlib.sha256).hexdigest()[:16]


async def test_admin_token_guards_the_data_not_the_page() -> None:
    cluster = InProcessCluster(
        2, CONFIG, clock=FrozenClock(), router_options={"admin_token": "adm1n-t0ken"}
    )
    async with cluster:
        for path in ("/admin/top", "/admin/ui/data"):
            assert_error(await cluster.client.get(path), 401)
            wrong = {"Authorization": "Bearer nope"}
            assert_error(await cluster.client.get(path, headers=wrong), 401)
            right = {"Authorization": "Bearer adm1n-t0ken"}
            assert (await cluster.client.get(path, headers=right)).status_code == 200
        page = await cluster.client.get("/admin/ui")
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "adm1n-t0ken" not in page.text
        csp = page.headers["content-security-policy"]
        assert "default-src 'none'" in csp and "connect-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert page.headers["cache-control"] == "no-store"
        # Offline: nothing is loaded from anywhere else.
        assert not re.search(r"""(src|href)=["']?(https?:)?//""", page.text)


async def test_without_a_token_the_page_is_loopback_only() -> None:
    async with InProcessCluster(1, CONFIG, clock=FrozenClock()) as cluster:
        transport = httpx.ASGITransport(app=cluster.router, client=("10.0.0.9", 4000))  # type: ignore[arg-type]
        async with httpx.AsyncClient(transport=transport, base_url="http://r.localhost") as remote:
            for path in ("/admin/ui", "/admin/ui/data", "/admin/top"):
                assert_error(await remote.get(path), 403)


async def test_ui_data_shows_nodes_shares_rates_top_and_events() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, CONFIG, clock=clock) as cluster:
        await hammer(cluster, USERS)
        clock.advance(2.0)
        await cluster.add_node("n4")
        await cluster.remove_node("n2")
        await cluster.crash_node("n3")
        data: dict[str, Any] = (await cluster.client.get("/admin/ui/data")).json()
        nodes = {n["id"]: n for n in data["nodes"]}
        assert set(nodes) == {"n1", "n4"}
        assert data["epoch"] == cluster.router.membership.view.epoch
        assert sum(n["share"] for n in nodes.values()) == pytest.approx(1.0)
        assert all(n["reachable"] and n["state"] == "active" for n in nodes.values())
        n1 = nodes["n1"]
        assert n1["allowed"] + n1["denied"] > 0 and n1["rate"] > 0
        assert data["totals"]["rate"] == pytest.approx(sum(n["rate"] for n in nodes.values()))
        kinds = [(e["kind"], e["node"]) for e in data["events"]]
        assert kinds[:3] == [("crashed", "n3"), ("left", "n2"), ("joined", "n4")]
        assert ("joined", "n1") in kinds
        assert "api" in data["top"]


def test_hash_share_matches_a_sample_of_keys() -> None:
    view = RingView.of(
        [Member("a", "http://a"), Member("b", "http://b", 3), Member("c", "http://c")]
    )
    shares = hash_share(view)
    assert sum(shares.values()) == pytest.approx(1.0)
    sample = ownership(view, (f"key-{i}" for i in range(40_000)))
    for member, share in shares.items():
        assert sample[member] / 40_000 == pytest.approx(share, abs=0.02)
    assert shares["b"] > 2 * shares["a"]
    assert hash_share(RingView.empty()) == {}


def test_event_log_is_bounded_and_newest_first() -> None:
    now = [0.0]
    log = EventLog(limit=5, clock=lambda: now[0])
    a, b = Member("a", "http://a"), Member("b", "http://b")
    views = [RingView.empty(), RingView.of([a], 1), RingView.of([a, b], 2)]
    log.change(views[0], views[1])
    log.change(views[1], views[2])
    log.change(views[2], RingView.of([Member("a", "http://a2")], 3), crashed={"b"})
    assert [(e.epoch, e.kind, e.node) for e in log.last(10)] == [
        (3, "replaced", "a"),
        (3, "crashed", "b"),
        (2, "joined", "b"),
        (1, "joined", "a"),
    ]
    log.recovered(RingView.of([a, b], 7))
    assert log.last(1)[0][1:] == (7, "recovered", "a, b")
    for epoch in range(4, 20):
        log.change(RingView.of([a], epoch - 1), RingView.of([a, b], epoch))
    assert len(log.last(100)) == 5


def test_privacy_config_parses_round_trips_and_hides_its_salt() -> None:
    config = ClusterConfig.from_dict(
        {
            "rules": [{"name": "api", "rate": "5/minute"}],
            "privacy": {"show_keys": "hashed", "salt": "s4lt"},
        }
    )
    assert config.privacy == Privacy("hashed", "s4lt")
    assert ClusterConfig.from_dict(config.to_dict()).privacy == config.privacy  # pushed to nodes
    assert "s4lt" not in repr(config)
    assert ClusterConfig.from_dict({}).privacy == Privacy("plain", None)
    for bad, where in (
        ({"show_keys": "rot13"}, "privacy.show_keys"),
        ({"salt": ""}, "privacy.salt"),
        ({"pepper": "x"}, "privacy: unknown key(s) pepper"),
    ):
        with pytest.raises(ConfigError, match=re.escape(where)):
            ClusterConfig.from_dict({"privacy": bad})


async def test_a_restarted_router_says_it_recovered_the_ring() -> None:
    async with InProcessCluster(2, CONFIG, clock=FrozenClock()) as cluster:
        await cluster.restart_router(
            seeds=[Member(n, f"http://{n}.localhost") for n in ("n1", "n2")]
        )
        events = (await cluster.client.get("/admin/ui/data")).json()["events"]
        assert [(e["kind"], e["node"], e["epoch"]) for e in events] == [("recovered", "n1, n2", 1)]
