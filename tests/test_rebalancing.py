"""Rebalancing, in process: joins, leaves, crashes, restarts and stale views.

Every test runs a router and its nodes in one event loop (``InProcessCluster``:
httpx ASGI mounts, no sockets) on a ``FrozenClock``, so "within one period"
is exact and nothing depends on timing. The limit is 20 per minute with a
sliding log: within one period no user may be admitted more than 20 times,
whatever the ring does. Each test exhausts a population of users, changes
the ring, then sends every user more requests and counts admissions.

``excess`` is the number of admissions beyond 20 per user, summed over users.
The reset-policy tests expect it to be large: they show that the measurement
can see the failures the other tests rule out.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import shutil
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from node.clock import FrozenClock
from node.config import ClusterConfig, Policies, ScopedRule
from node.rules import Rule
from ring import Member, RingView
from router.testing import ROUTER_URL, InProcessCluster, node_url

LIMIT = 20
PERIOD = 60.0
USERS = [f"user-{i}" for i in range(60)]
TOKEN = "internal-s3cret"
ADMIN = "admin-s3cret"

pytestmark = pytest.mark.anyio


def make_config(
    *,
    rebalance: str = "handoff",
    crash: str = "replica",
    on_error: str = "open",
    algorithm: str = "sliding_log",
) -> ClusterConfig:
    rule = Rule("api", LIMIT, PERIOD, algorithm=algorithm, on_error=on_error)
    return ClusterConfig(
        rules=(ScopedRule(rule),), policies=Policies(rebalance=rebalance, crash=crash)
    )


class Tally:
    """Admissions per user, and which node answered each user last."""

    def __init__(self) -> None:
        self.allowed: Counter[str] = Counter()
        self.denied: Counter[str] = Counter()
        self.other: Counter[int] = Counter()
        self.node: dict[str, str] = {}

    def excess(self, limit: int = LIMIT) -> int:
        return sum(max(0, n - limit) for n in self.allowed.values())

    def over(self, limit: int = LIMIT) -> dict[str, int]:
        return {u: n for u, n in self.allowed.items() if n > limit}


async def send(
    client: httpx.AsyncClient,
    tally: Tally,
    users: list[str],
    times: int,
    *,
    base: str = ROUTER_URL,
) -> None:
    """``times`` requests per user through the router at ``base``, all users concurrently."""

    async def one_user(user: str) -> None:
        for _ in range(times):
            response = await client.get(f"{base}/api", headers={"X-User-Id": user})
            if response.status_code == 200:
                tally.allowed[user] += 1
            elif response.status_code == 429:
                tally.denied[user] += 1
            else:
                tally.other[response.status_code] += 1
            if "x-ringlimit-node" in response.headers:
                tally.node[user] = response.headers["x-ringlimit-node"]

    await asyncio.gather(*(one_user(u) for u in users))


@contextlib.asynccontextmanager
async def state_filed(
    tmp_path: Path, nodes: int = 3, config: ClusterConfig | None = None
) -> AsyncIterator[tuple[InProcessCluster, Path]]:
    """A cluster whose router keeps its ring in a state file: (it, the file)."""
    state = tmp_path / "ring.json"
    options = {"state_file": str(state)}
    async with InProcessCluster(
        nodes, config or make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        yield cluster, state


async def exhaust_and_replicate(cluster: InProcessCluster) -> Tally:
    """Exhaust every user with change tracking on, then run one replication round."""
    for node in cluster.nodes.values():
        node.store.dirty = set()
    tally = await exhaust(cluster)
    for node in cluster.nodes.values():
        assert node.shard is not None
        await node.shard.replicate_once()
    return tally


async def repaired_as_crashed(
    cluster: InProcessCluster, membership: Any, tally: Tally, *, base: str = ROUTER_URL
) -> None:
    """One health round repairs the member that restarted empty (a crash, then a
    join): its users go on from their replicas, nobody admitted over the limit."""
    await membership.check_health()
    await asyncio.gather(*membership._background)
    await send(cluster.client, tally, USERS, 2, base=base)
    assert tally.other == Counter()
    assert tally.excess() == 0, tally.over()
    assert membership.crashes == 1


async def exhaust(cluster: InProcessCluster, users: list[str] = USERS) -> Tally:
    """Every user sends LIMIT + 2 requests: LIMIT admitted, 2 denied."""
    tally = Tally()
    await send(cluster.client, tally, users, LIMIT + 2)
    assert tally.other == Counter()
    assert all(tally.allowed[u] == LIMIT for u in users), tally.over()
    return tally


async def node_status(cluster: InProcessCluster, node_id: str) -> dict[str, Any]:
    headers = {"X-Ringlimit-Token": cluster.internal_token} if cluster.internal_token else {}
    response = await cluster.client.get(f"{node_url(node_id)}/internal/status", headers=headers)
    assert response.status_code == 200
    data: dict[str, Any] = response.json()
    return data


def moved(before: RingView, after: RingView, users: list[str] = USERS) -> list[str]:
    return [u for u in users if before.owner_id(u) != after.owner_id(u)]


# --------------------------------------------------------------------------- join and leave


@pytest.mark.parametrize("rebalance", ["handoff", "reset"])
async def test_join_then_leave_within_one_period(rebalance: str) -> None:
    """The issue's first scenario, in process: handoff is exact, reset is not."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(rebalance=rebalance), clock=clock) as cluster:
        tally = await exhaust(cluster)
        v1 = cluster.router.membership.view
        await cluster.add_node("n4")
        v2 = cluster.router.membership.view
        assert v2.epoch == v1.epoch + 1
        joined = moved(v1, v2)
        assert joined and all(v2.owner_id(u) == "n4" for u in joined)
        await send(cluster.client, tally, USERS, 3)
        for user in joined:
            assert tally.node[user] == "n4"

        clock.advance(5.0)
        await cluster.remove_node("n2")
        v3 = cluster.router.membership.view
        assert v3.epoch == v2.epoch + 1 and "n2" not in v3
        left = moved(v2, v3)
        assert left and all(v2.owner_id(u) == "n2" for u in left)
        await send(cluster.client, tally, USERS, 3)
        for user in left:
            assert tally.node[user] == v3.owner_id(user) != "n2"
        assert tally.other == Counter()

        if rebalance == "handoff":
            assert tally.excess() == 0, tally.over()
            assert len(cluster.nodes["n2"].store) == 0
        else:
            # Every moved user starts from nothing, so all its later requests
            # are admitted: 3 + 3 for the users that went to n4, 3 for n2's.
            assert tally.over() == {
                **{u: LIMIT + 6 for u in joined},
                **{u: LIMIT + 3 for u in left},
            }


async def test_a_joining_node_needs_no_rules_of_its_own() -> None:
    """Like ``ringlimit node --join`` with no rule flags: the states handed to it
    must not be dropped for want of the rules (the config arrives first)."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        tally = await exhaust(cluster)
        v1 = cluster.router.membership.view
        n4 = await cluster.add_node("n4", config=ClusterConfig(), fenced=True)
        joined = moved(v1, cluster.router.membership.view)
        assert joined and n4.authority.config == cluster.config
        assert len(n4.store) == len(joined)
        await send(cluster.client, tally, USERS, 3)
        assert tally.excess() == 0, tally.over()


async def test_join_moves_only_keys_to_the_new_node_and_counts_them() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        await exhaust(cluster)
        v1 = cluster.router.membership.view
        await cluster.add_node("n4")
        joined = moved(v1, cluster.router.membership.view)
        sent = 0
        for node_id in ("n1", "n2", "n3"):
            status = await node_status(cluster, node_id)
            assert status["epoch"] == 2
            assert status["outbox"] == {}
            sent += status["stats"]["keys_sent"]
        received = (await node_status(cluster, "n4"))["stats"]["keys_received"]
        assert sent == received == len(joined)
        assert len(cluster.nodes["n4"].store) == len(joined)
        assert cluster.nodes["n4"].store.keys() == set(joined)


async def test_leave_hands_everything_off_and_drops_the_node() -> None:
    clock = FrozenClock()
    async with InProcessCluster(4, make_config(), clock=clock) as cluster:
        tally = await exhaust(cluster)
        held = len(cluster.nodes["n3"].store)
        assert held > 0
        await cluster.remove_node("n3")
        view = cluster.router.membership.view
        assert "n3" not in view and len(view) == 3
        assert len(cluster.nodes["n3"].store) == 0
        assert (await node_status(cluster, "n3"))["stats"]["keys_sent"] == held
        await send(cluster.client, tally, USERS, 2)
        assert tally.excess() == 0, tally.over()
        ring = (await cluster.client.get("/admin/ring")).json()
        assert ring["epoch"] == view.epoch
        assert [n["id"] for n in ring["nodes"]] == ["n1", "n2", "n4"]


@pytest.mark.parametrize(
    ("frozen_at_start", "delivered"), [(False, True), (True, True), (False, False)]
)
async def test_a_large_outbox_is_frozen_out_of_gc_while_it_travels(
    monkeypatch: pytest.MonkeyPatch, frozen_at_start: bool, delivered: bool
) -> None:
    """The leaving node freezes the heap (``gc.freeze()``) while its outbox
    travels, and thaws it once nothing is on its way: delivered, or refused and
    kept for pulls (a freeze left behind keeps cyclic garbage for ever). A
    process that had frozen its heap at start (node.memory.tune_gc) has it
    frozen again afterwards, not thawed for good."""
    import node.shard
    from node.memory import tune_gc

    monkeypatch.setattr(node.shard, "FREEZE_AT", 5)
    assert gc.get_freeze_count() == 0
    threshold = gc.get_threshold()
    clock = FrozenClock()
    try:
        async with InProcessCluster(3, make_config(), clock=clock) as cluster:
            tally = await exhaust(cluster)
            if frozen_at_start:
                tune_gc()  # what a server process does once started
            leaving = cluster.nodes["n3"].shard
            assert leaving is not None
            seen: list[tuple[int, bool]] = []
            for receiver in (n for n in cluster.nodes.values() if n is not cluster.nodes["n3"]):
                assert receiver.shard is not None
                receive = receiver.shard.receive

                def noting(sender: str, *args: Any, receive: Any = receive) -> int:
                    if sender == "n3":  # (the others send final marks only)
                        seen.append((gc.get_freeze_count(), leaving._frozen))
                        if not delivered:
                            raise ValueError("refused (the test's fault)")
                    return int(receive(sender, *args))

                monkeypatch.setattr(receiver.shard, "receive", noting)
            assert len(cluster.nodes["n3"].store) >= 5
            await cluster.remove_node("n3")
            # Frozen while the states travelled (the count alone says so only when
            # nothing was frozen before).
            assert seen and all(frozen and count > 0 for count, frozen in seen), seen
            assert not leaving._frozen
            assert (gc.get_freeze_count() > 0) == frozen_at_start
            if delivered:
                await send(cluster.client, tally, USERS, 2)
                assert tally.excess() == 0, tally.over()
            else:
                assert any(leaving.core.outbox.values())  # kept for pulls
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


async def test_admin_api_join_and_leave() -> None:
    clock = FrozenClock()
    async with InProcessCluster(2, make_config(), clock=clock) as cluster:
        ring = (await cluster.client.get("/admin/ring")).json()
        assert ring.pop("rules_digest") == cluster.router.config.rules_digest
        assert ring.pop("config_digest") == cluster.router.config.digest
        events = ring.pop("events")
        assert [(e["kind"], e["node"], e["epoch"]) for e in events] == [
            ("joined", "n1", 1),
            ("joined", "n2", 1),
        ]
        assert ring == {
            "epoch": 1,
            "nodes": [
                {
                    "id": node_id,
                    "url": node_url(node_id),
                    "weight": 1,
                    "state": "active",
                    # (in-process nodes: no socket, and no fast client to use one)
                    "unix_socket": None,
                }
                for node_id in ("n1", "n2")
            ],
        }
        cluster._make_node("n3")
        response = await cluster.client.post(
            "/admin/nodes", json={"id": "n3", "url": node_url("n3"), "weight": 2}
        )
        assert response.status_code == 200
        assert response.json()["epoch"] == 2
        assert {
            "id": "n3",
            "url": node_url("n3"),
            "weight": 2,
            "state": "active",
        } in response.json()["nodes"]
        # Registering again, unchanged, is a no-op; with another url it is refused.
        again = await cluster.client.post(
            "/admin/nodes", json={"id": "n3", "url": node_url("n3"), "weight": 2}
        )
        assert again.status_code == 200 and again.json()["epoch"] == 2
        clash = await cluster.client.post(
            "/admin/nodes", json={"id": "n3", "url": "http://x.localhost"}
        )
        assert clash.status_code == 409
        gone = await cluster.client.delete("/admin/nodes/n1")
        assert gone.status_code == 200
        assert [n["id"] for n in gone.json()["nodes"]] == ["n2", "n3"]
        assert (await cluster.client.delete("/admin/nodes/n1")).status_code == 404
        # A node that never answers is not made an owner (readiness gate, bounded).
        cluster.router.membership.ready_timeout = 0.2
        late = await cluster.client.post("/admin/nodes", json={"id": "n9", "url": node_url("n9")})
        assert late.status_code == 504
        assert cluster.router.membership.view.epoch == 3
        # The changes, oldest first, as `ringlimit up` reads them to report node exits.
        events = (await cluster.client.get("/admin/ring")).json()["events"]
        assert [(e["kind"], e["node"], e["epoch"]) for e in events][2:] == [
            ("joined", "n3", 2),
            ("left", "n1", 3),
        ]


# --------------------------------------------------------------------------- fencing


async def test_a_node_refuses_keys_it_does_not_own() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        view = cluster.router.membership.view
        user = USERS[0]
        stranger = next(n for n in ("n1", "n2", "n3") if n != view.owner_id(user))
        # Proxied path: the router's key header, sent straight to a non-owner.
        response = await cluster.client.get(
            f"{node_url(stranger)}/api", headers={"X-Ringlimit-Key": user}
        )
        assert response.status_code == 421
        assert response.headers["x-ringlimit-epoch"] == str(view.epoch)
        body = response.json()
        assert body["error"] == "not_owner" and body["owner"] == view.owner_id(user)
        # Decision API.
        response = await cluster.client.post(
            f"{node_url(stranger)}/v1/check", json={"key": user, "rule": "api"}
        )
        assert response.status_code == 421
        assert response.headers["x-ringlimit-epoch"] == str(view.epoch)
        # The owner decides.
        owner = view.owner_id(user)
        response = await cluster.client.post(
            f"{node_url(owner)}/v1/check", json={"key": user, "rule": "api"}
        )
        assert response.status_code == 200 and response.json()["node"] == owner


async def test_a_fenced_node_refuses_everything_until_it_gets_a_view() -> None:
    clock = FrozenClock()
    async with InProcessCluster(1, make_config(), clock=clock) as cluster:
        cluster.restart_node("n2")
        response = await cluster.client.get(
            f"{node_url('n2')}/api", headers={"X-Ringlimit-Key": "alice"}
        )
        assert response.status_code == 421
        assert response.headers["x-ringlimit-epoch"] == "0"


async def test_a_node_ignores_an_older_view() -> None:
    clock = FrozenClock()
    async with InProcessCluster(2, make_config(), clock=clock) as cluster:
        await cluster.add_node("n3")
        old = RingView.of([Member("n1", node_url("n1")), Member("n2", node_url("n2"))], epoch=1)
        response = await cluster.client.put(
            f"{node_url('n1')}/internal/cluster",
            json={"ring": old.to_dict(), "config": cluster.config.to_dict()},
        )
        assert response.status_code == 200
        assert response.json() == {"epoch": 2, "applied": False, "sent": {}}


# --------------------------------------------------------------------------- pull-on-miss


class SlowImports(httpx.AsyncBaseTransport):
    """A node whose incoming bulk transfers are held until released (or refused)."""

    def __init__(self, inner: httpx.AsyncBaseTransport, *, refuse: bool = False) -> None:
        self.inner = inner
        self.refuse = refuse
        self.release = asyncio.Event()
        self.held = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/import":
            if self.refuse:
                raise httpx.ConnectError("import refused by the test", request=request)
            self.held += 1
            await self.release.wait()
        return await self.inner.handle_async_request(request)


async def push_view(
    cluster: InProcessCluster, node_id: str, view: RingView, previous: RingView, *, wait: bool
) -> dict[str, Any]:
    response = await cluster.client.put(
        f"{node_url(node_id)}/internal/cluster",
        json={
            "ring": view.to_dict(),
            "previous": previous.to_dict(),
            "config": cluster.config.to_dict(),
            "wait": wait,
        },
    )
    assert response.status_code == 200, response.text
    data: dict[str, Any] = response.json()
    return data


@pytest.mark.parametrize("delivery", ["slow", "failed"])
async def test_pull_on_miss_while_the_bulk_has_not_arrived(delivery: str) -> None:
    """The new owner is asked about moved keys before their states arrive.

    ``slow``: the previous owners' bulk transfers are in flight (held) while
    the new owner already decides. ``failed``: they never arrive. Either way
    the new owner must pull each key from its previous owner before deciding.
    """
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        tally = await exhaust(cluster)
        v1 = cluster.router.membership.view
        n4 = cluster._make_node("n4")
        gate = SlowImports(cluster._mounts[node_url("n4")], refuse=delivery == "failed")
        cluster._mounts[node_url("n4")] = gate
        v2 = v1.with_member(Member("n4", node_url("n4")))
        for node_id in ("n1", "n2", "n3"):
            await push_view(cluster, node_id, v2, v1, wait=False)
        await push_view(cluster, "n4", v2, v1, wait=True)
        if delivery == "slow":
            # The old owners' transfers were spawned (wait=False): let them reach
            # the gate (bounded: a few loop turns).
            for _ in range(100):
                if gate.held:
                    break
                await asyncio.sleep(0)
            assert gate.held > 0
        joined = moved(v1, v2)
        assert joined
        assert len(n4.store) == 0

        async def ask(user: str) -> bool:
            response = await cluster.client.post(
                f"{node_url('n4')}/v1/check", json={"key": user, "rule": "api"}
            )
            assert response.status_code == 200, response.text
            return bool(response.json()["allowed"])

        async def release_later() -> None:
            await asyncio.sleep(0.05)
            gate.release.set()

        releaser = asyncio.create_task(release_later())
        answers = await asyncio.gather(*(ask(u) for u in joined for _ in range(3)))
        await releaser
        assert not any(answers), f"{sum(answers)} admissions on fresh states"
        stats = (await node_status(cluster, "n4"))["stats"]
        assert stats["pulls"] >= 1
        # Once everything has settled the router is told, and nobody gains anything.
        cluster.router.membership._adopt(v2)
        gate.release.set()
        await asyncio.sleep(0.05)
        await send(cluster.client, tally, USERS, 2)
        assert tally.excess() == 0, tally.over()


# ------------------------------------------------------------------ failed deliveries


class Gate(httpx.AsyncBaseTransport):
    """In front of one node: its incoming transfers pass, are refused, or are held."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.mode = "pass"
        self.release = asyncio.Event()
        self.refused = 0
        self.held = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/import":
            if self.mode == "hold":
                self.held += 1
                await self.release.wait()
            # (Refused at once, or once released if the mode became "refuse" meanwhile.)
            if self.mode == "refuse":
                self.refused += 1
                raise httpx.ConnectError("transfer refused by the test", request=request)
        return await self.inner.handle_async_request(request)


def gate(cluster: InProcessCluster, node_id: str) -> Gate:
    found = Gate(cluster._mounts[node_url(node_id)])
    cluster._mounts[node_url(node_id)] = found
    return found


async def checks_admitted(
    cluster: InProcessCluster, node_id: str, users: list[str], times: int = 3
) -> int:
    """``times`` checks of each user sent straight to ``node_id``: how many it admitted."""
    allowed = 0
    for user in users:
        for _ in range(times):
            response = await cluster.client.post(
                f"{node_url(node_id)}/v1/check", json={"key": user, "rule": "api"}
            )
            assert response.status_code == 200, response.text
            allowed += bool(response.json()["allowed"])
    return allowed


async def test_a_failed_join_handoff_is_pulled_past_the_deadline_and_sent_again() -> None:
    """The old owners' transfers to a newcomer fail; every member stays up.

    The states stay with the old owners for pulls, and the deadline ``W``
    gives up only on an owner that does not answer either: a reachable one is
    still asked, and sends its leftovers again in the background. Before, past
    ``W`` the newcomer decided every moved user on a fresh state while the
    states sat in the old owners' outboxes (17 users x 20 over the limit).
    """
    clock = FrozenClock()
    wait = 0.3
    options = {"handoff_wait": wait}
    async with InProcessCluster(3, make_config(), clock=clock, node_options=options) as cluster:
        tally = await exhaust(cluster)
        v1 = cluster.router.membership.view
        n4 = cluster._make_node("n4")
        door = gate(cluster, "n4")
        door.mode = "refuse"
        await cluster.router.membership.join(Member("n4", node_url("n4")))
        door.mode = "pass"
        v2 = cluster.router.membership.view
        joined = moved(v1, v2)
        assert joined and door.refused > 0
        assert any(cluster.nodes[n].shard.core.undelivered_states() for n in ("n1", "n2", "n3"))
        await asyncio.sleep(wait + 0.1)  # past W (real time; the engine's clock is frozen)
        await send(cluster.client, tally, USERS, LIMIT + 2)
        assert tally.excess() == 0, tally.over()
        assert tally.other == Counter()
        # The background redelivery lands (0.5 s after the failure): nothing is
        # left in an outbox and the newcomer waits for nobody.
        for _ in range(100):
            left = [cluster.nodes[n].shard.core.undelivered_states() for n in ("n1", "n2", "n3")]
            if not any(left) and not n4.shard.core.pending:
                break
            await asyncio.sleep(0.05)
        assert not any(left) and not n4.shard.core.pending, (left, n4.shard.core.pending)


async def test_a_handoff_still_unsettled_when_the_next_view_comes_is_still_inherited() -> None:
    """n4 joins and its handoff fails; n5 joins before anyone asked n4 about a
    moved user, and the old owners' second try at n4 is slow. n4 owned those
    users under the previous view already, but their states are still on their
    way: it must wait for them, not decide on fresh states (before, it admitted
    every check of those exhausted users: 30 of 30, docs/rebalancing.md)."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        await exhaust(cluster)
        v1 = cluster.router.membership.view
        n4 = cluster._make_node("n4")
        door = gate(cluster, "n4")
        door.mode = "refuse"
        await cluster.router.membership.join(Member("n4", node_url("n4")))
        v2 = cluster.router.membership.view
        door.mode = "hold"
        cluster._make_node("n5")
        join = asyncio.create_task(cluster.router.membership.join(Member("n5", node_url("n5"))))
        for _ in range(400):
            if n4.shard.epoch == 3 and door.held:
                break
            await asyncio.sleep(0.005)
        assert n4.shard.epoch == 3 and door.held
        v3 = n4.shard.view
        assert v3 is not None
        users = [
            u
            for u in USERS
            if v1.owner_id(u) != "n4" and v2.owner_id(u) == "n4" and v3.owner_id(u) == "n4"
        ]
        assert users

        async def release_soon() -> None:
            await asyncio.sleep(0.3)
            door.release.set()

        releaser = asyncio.create_task(release_soon())
        allowed = await checks_admitted(cluster, "n4", users)
        await releaser
        await asyncio.wait_for(join, 30)
        assert allowed == 0, f"{allowed} admissions of exhausted users on fresh states"


async def test_a_key_that_moves_on_before_its_handoff_landed_is_pulled_where_it_is() -> None:
    """n4 joins and the old owners' transfers to it fail; n5 joins and their
    transfers to n5 fail too (each kept for pulls). A user the first join gave
    n4 and the second gives n5 has its state in its first owner's outbox, now
    for n5. n5 asks n4, its previous owner, which never had it: n4 points n5 to
    the member it still awaits for that key, and n5 pulls it there. Before, n4's
    empty answer made n5 decide each such user on a fresh state."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        await exhaust(cluster)
        views = [cluster.router.membership.view]
        for newcomer in ("n4", "n5"):
            cluster._make_node(newcomer)
            door = gate(cluster, newcomer)
            door.mode = "refuse"
            await cluster.router.membership.join(Member(newcomer, node_url(newcomer)))
            assert door.refused > 0
            views.append(cluster.router.membership.view)
        v1, v2, v3 = views
        users = [
            u
            for u in USERS
            if v1.owner_id(u) != "n4" and v2.owner_id(u) == "n4" and v3.owner_id(u) == "n5"
        ]
        assert users and cluster.nodes["n5"].shard.epoch == v3.epoch
        allowed = await checks_admitted(cluster, "n5", users)
        assert allowed == 0, f"{allowed} admissions of {len(users)} exhausted users"


async def test_a_leave_whose_handoff_fails_counts_as_a_crash() -> None:
    """A leaving node whose transfer to a new owner fails does not answer its
    push as if it had left cleanly: the router removes it as crashed, and the
    new owner starts the keys from their replicas. Before, the leave looked
    clean, the states stayed in the leaving node's outbox while it exited, and
    every affected user got a fresh quota."""
    clock = FrozenClock()
    config = make_config(crash="replica", on_error="closed")
    async with InProcessCluster(3, config, clock=clock) as cluster:
        tally = await exhaust_and_replicate(cluster)
        v1 = cluster.router.membership.view
        door = gate(cluster, "n1")
        door.mode = "refuse"
        await cluster.remove_node("n2")
        door.mode = "pass"
        v2 = cluster.router.membership.view
        assert "n2" not in v2
        assert cluster.router.membership.crashes == 1  # the leave became a crash removal
        cluster.take_down("n2")  # the leaving process exits, its outbox with it
        affected = [u for u in USERS if v1.owner_id(u) == "n2" and v2.owner_id(u) == "n1"]
        assert affected and door.refused > 0
        await send(cluster.client, tally, USERS, LIMIT + 2)
        assert tally.excess() == 0, tally.over()
        assert tally.other == Counter()


async def test_a_request_during_a_slow_leave_does_not_take_it_for_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A leave is slow (n2's transfer to n1 hangs, then fails) and a request for
    one of n2's users reaches n2, which has taken the leave's view and refuses
    it (421, a newer epoch). The router waits for its own change and does not
    take that view from n2 while the change is under way: the leave fails and
    n2 is removed as crashed, its users starting from their replicas. Before,
    once the wait ran out (5 s; 0.2 here) the router took the leave's view for
    done; the failed leave then found n2 out of the ring already, removed
    nobody as crashed, and n2's users started afresh once it exited (an
    independent review: 36 over the limit for 12 users)."""
    clock = FrozenClock()
    config = make_config(crash="replica", on_error="closed")
    async with InProcessCluster(3, config, clock=clock) as cluster:
        membership = cluster.router.membership
        tally = await exhaust_and_replicate(cluster)
        v1 = membership.view
        door = gate(cluster, "n1")
        door.mode = "hold"
        waited = membership.wait_for_change
        monkeypatch.setattr(membership, "wait_for_change", lambda: waited(0.2))
        leave = asyncio.create_task(cluster.remove_node("n2"))
        for _ in range(250):  # n2 has taken its view and hands its states off
            if door.held:
                break
            await asyncio.sleep(0.02)
        assert door.held and not leave.done()
        user = next(u for u in USERS if v1.owner_id(u) == "n2")
        during = Tally()
        await send(cluster.client, during, [user], 1)
        assert membership.view.epoch == v1.epoch  # not taken from n2
        assert during.other == Counter({503: 1})  # refused as the ring changing
        door.mode = "refuse"  # the held transfer and its retries fail
        door.release.set()
        await leave
        v2 = membership.view
        assert "n2" not in v2 and membership.crashes == 1 and "n2" in membership.removed
        cluster.take_down("n2")  # the leaving process exits, its outbox with it
        await send(cluster.client, tally, USERS, LIMIT + 2)
        assert tally.excess() == 0, tally.over()


async def test_a_member_killed_during_a_join_hands_its_replicas_to_the_newcomer() -> None:
    """n1 dies as n4 joins: the join is adopted without it, then n1 is removed
    as crashed. n1's users that the join moved to n4 have their replicas on
    n1's successor, which sends them to n4; n4 waits for them. Before, the
    successor kept them as replicas of n4 and n4 decided those users on fresh
    states (14 users x 20 over the limit)."""
    clock = FrozenClock()
    config = make_config(crash="replica", on_error="closed")
    async with InProcessCluster(3, config, clock=clock) as cluster:
        tally = await exhaust_and_replicate(cluster)
        v1 = cluster.router.membership.view
        cluster._make_node("n4")
        cluster.take_down("n1")
        await cluster.router.membership.join(Member("n4", node_url("n4")))
        view = cluster.router.membership.view
        assert view.ids == ("n2", "n3", "n4") and cluster.router.membership.crashes == 1
        to_n4 = [u for u in USERS if v1.owner_id(u) == "n1" and view.owner_id(u) == "n4"]
        assert to_n4
        await send(cluster.client, tally, USERS, LIMIT + 2)
        assert tally.excess() == 0, tally.over()
        assert tally.other == Counter()


class HoldOnceAt(httpx.AsyncBaseTransport):
    """In front of one node: transfers into it are held once it has reached ``epoch``."""

    def __init__(self, inner: httpx.AsyncBaseTransport, node: Any, epoch: int) -> None:
        self.inner, self.node, self.epoch = inner, node, epoch
        self.release = asyncio.Event()
        self.held = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/internal/import" and self.node.shard.epoch >= self.epoch:
            self.held += 1
            await self.release.wait()
        return await self.inner.handle_async_request(request)


async def test_a_wait_for_a_crashed_members_replicas_starts_again_under_a_newer_view() -> None:
    """n1 dies as n4 joins; under the crash view a check of one of n1's users
    that n4 owns now waits for the replica holders' final transfers (held). A
    newer view comes meanwhile: the check must look for the state again under
    it (its sources still say where from), not decide on what n4 has. Before,
    every check waiting at that moment was decided on a fresh state."""
    clock = FrozenClock()
    config = make_config(crash="replica", on_error="closed")
    async with InProcessCluster(3, config, clock=clock) as cluster:
        await exhaust_and_replicate(cluster)
        v1 = cluster.router.membership.view
        n4 = cluster._make_node("n4")
        door = HoldOnceAt(cluster._mounts[node_url("n4")], n4, v1.epoch + 2)
        cluster._mounts[node_url("n4")] = door
        cluster.take_down("n1")
        join = asyncio.create_task(cluster.router.membership.join(Member("n4", node_url("n4"))))
        for _ in range(400):
            if n4.shard.epoch == v1.epoch + 2 and door.held:
                break
            await asyncio.sleep(0.005)
        assert n4.shard.epoch == v1.epoch + 2 and door.held
        v3 = n4.shard.view
        assert v3 is not None and "n1" not in v3
        users = [u for u in USERS if v1.owner_id(u) == "n1" and v3.owner_id(u) == "n4"]
        assert users
        checks = asyncio.gather(*(checks_admitted(cluster, "n4", [u], times=1) for u in users))
        await asyncio.sleep(0.1)
        assert not checks.done()  # waiting for the held transfers
        n4.shard.apply(RingView.of(list(v3), epoch=v3.epoch + 1), v3)
        await asyncio.sleep(0.1)
        door.release.set()
        allowed = sum(await asyncio.wait_for(checks, 30))
        await asyncio.wait_for(join, 30)
        assert allowed == 0, f"{allowed} of {len(users)} exhausted users admitted"


# --------------------------------------------------------------------------- crashes


async def test_crash_with_reset_gives_moved_users_a_fresh_quota() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="reset"), clock=clock) as cluster:
        tally = await exhaust(cluster)
        v1 = cluster.router.membership.view
        await cluster.crash_node("n2")
        lost = moved(v1, cluster.router.membership.view)
        assert lost and cluster.router.membership.crashes == 1
        await send(cluster.client, tally, USERS, LIMIT + 2)
        # The documented worst case: one extra quota per affected key, no more.
        assert tally.over() == {u: 2 * LIMIT for u in lost}


async def test_crash_with_conservative_policy_denies_instead_of_admitting() -> None:
    clock = FrozenClock()
    config = make_config(crash="conservative")
    async with InProcessCluster(3, config, clock=clock) as cluster:
        tally = await exhaust(cluster)
        newcomers = [f"new-{i}" for i in range(60)]
        v1 = cluster.router.membership.view
        clock.advance(10.0)
        await cluster.crash_node("n2")
        v2 = cluster.router.membership.view
        lost = moved(v1, v2)
        lost_new = [u for u in newcomers if v1.owner_id(u) == "n2"]
        kept_new = [u for u in newcomers if v1.owner_id(u) != "n2"]
        assert lost and lost_new and kept_new
        await send(cluster.client, tally, USERS + newcomers, 3)
        assert tally.excess() == 0, tally.over()
        # The price: users of the crashed node who had sent nothing are denied
        # too (false denials) until one period after the crash...
        assert all(tally.allowed[u] == 0 for u in lost_new)
        assert all(tally.allowed[u] == 3 for u in kept_new)
        clock.advance(PERIOD - 0.001)
        later = Tally()
        await send(cluster.client, later, lost_new, 1)
        assert later.allowed.total() == 0
        # ...and no longer: the crash was one period ago.
        clock.advance(0.002)
        await send(cluster.client, later, lost_new, 1)
        assert all(later.allowed[u] == 1 for u in lost_new)
        stats = [(await node_status(cluster, n))["stats"] for n in ("n1", "n3")]
        assert sum(s["conservative_keys"] for s in stats) == len(lost) + len(lost_new)


async def test_crash_with_replica_loses_only_the_last_interval() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="replica"), clock=clock) as cluster:
        for node in cluster.nodes.values():
            node.store.dirty = set()  # replication tracks changes from here on
        tally = Tally()
        await send(cluster.client, tally, USERS, 15)
        for node in cluster.nodes.values():
            assert await node.shard.replicate_once() > 0
        # Admitted after the last replication round: lost in the crash.
        await send(cluster.client, tally, USERS, 7)
        v1 = cluster.router.membership.view
        await cluster.crash_node("n2")
        lost = moved(v1, cluster.router.membership.view)
        assert lost
        await send(cluster.client, tally, USERS, LIMIT)
        # Bound: what each lost user was admitted since the last round (5).
        assert tally.over() == {u: LIMIT + 5 for u in lost}
        promoted = sum(
            [(await node_status(cluster, n))["stats"]["replicas_promoted"] for n in ("n1", "n3")]
        )
        assert promoted == len(lost)


async def test_replica_is_streamed_to_each_keys_successor() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="replica"), clock=clock) as cluster:
        for node in cluster.nodes.values():
            node.store.dirty = set()
        await send(cluster.client, Tally(), USERS, 1)
        view = cluster.router.membership.view
        for node in cluster.nodes.values():
            await node.shard.replicate_once()
        for node_id, node in cluster.nodes.items():
            for origin, replicas in node.shard._replicas.items():
                held = replicas.keys()
                for key in held:
                    assert view.owner_id(key) == origin
                    assert view.successors(key, 2)[1].id == node_id
        replicated = sum(len(r) for n in cluster.nodes.values() for r in n.shard._replicas.values())
        assert replicated == len(USERS)


async def test_unreachable_owner_follows_on_error_until_it_is_removed() -> None:
    clock = FrozenClock()
    for on_error, status in (("open", 200), ("closed", 503)):
        config = make_config(on_error=on_error)
        async with InProcessCluster(3, config, clock=clock) as cluster:
            user = next(u for u in USERS if cluster.owner(u) == "n2")
            cluster.take_down("n2")
            response = await cluster.client.get("/api", headers={"X-User-Id": user})
            assert response.status_code == status
            if on_error == "open":
                assert response.headers["x-ringlimit-degraded"] == "owner-unreachable"
            assert "n2" in cluster.router.membership.view


async def test_health_checks_remove_a_node_after_the_threshold() -> None:
    clock = FrozenClock()
    config = make_config()
    async with InProcessCluster(3, config, clock=clock) as cluster:
        membership = cluster.router.membership
        membership.failure_threshold = 3
        cluster.take_down("n3")
        for _ in range(2):
            await membership.check_health()
        assert "n3" in membership.view
        await membership.check_health()
        assert "n3" not in membership.view and membership.crashes == 1
        ring = (await cluster.client.get("/admin/ring")).json()
        assert [n["id"] for n in ring["nodes"]] == ["n1", "n2"]


async def test_health_loop_detects_a_crash_within_interval_times_threshold() -> None:
    clock = FrozenClock()
    options = {
        "health_checks": True,
        "health_interval": 0.02,
        "failure_threshold": 3,
        "health_timeout": 0.1,
    }
    async with InProcessCluster(3, make_config(), clock=clock, router_options=options) as cluster:
        loop = asyncio.get_running_loop()
        started = loop.time()
        cluster.take_down("n1")
        for _ in range(100):
            if "n1" not in cluster.router.membership.view:
                break
            await asyncio.sleep(0.01)
        assert "n1" not in cluster.router.membership.view
        # Removal waits for the lease (3 x (0.02 + 0.1) s) the node may still hold.
        assert 0.36 <= loop.time() - started < 1.0


# --------------------------------------------------------------------------- restarts


async def test_node_restart_is_a_crash_then_a_join() -> None:
    """A node re-registering at epoch 0 lost its memory: its old self crashed."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="reset"), clock=clock) as cluster:
        tally = await exhaust(cluster)
        membership = cluster.router.membership
        epoch = membership.view.epoch
        cluster.restart_node("n2")
        response = await cluster.client.post(
            "/admin/nodes", json={"id": "n2", "url": node_url("n2"), "weight": 1}
        )
        assert response.status_code == 200
        assert membership.view.epoch == epoch + 2 and "n2" in membership.view
        assert membership.crashes == 1
        assert (await node_status(cluster, "n2"))["epoch"] == epoch + 2
        await send(cluster.client, tally, USERS, 2)
        lost = [u for u in USERS if membership.view.owner_id(u) == "n2"]
        # Reset policy: n2's users start again (documented worst case), others do not.
        assert set(tally.over()) == set(lost)


async def test_a_registration_the_member_cannot_confirm_keeps_it() -> None:
    """A member registers again (a node's retried join) but does not answer when
    the router asks its epoch: that is no sign of a restart. It was taken for
    one (crash, then join), which removed a ring's only node as it was killed,
    past the removal budget that keeps the last member (CI). Now: 503
    ``member_unconfirmed`` (a node retries it), the view unchanged; once it
    answers, the registration is the no-op it always was."""
    clock = FrozenClock()
    async with InProcessCluster(1, make_config(), clock=clock) as cluster:
        membership = cluster.router.membership
        epoch = membership.view.epoch
        registration = {"id": "n1", "url": node_url("n1"), "weight": 1}
        cluster.take_down("n1")
        response = await cluster.client.post("/admin/nodes", json=registration)
        assert response.status_code == 503, response.text
        assert response.json()["error"] == "member_unconfirmed"
        assert membership.view.epoch == epoch and "n1" in membership.view
        assert membership.crashes == 0
        cluster.bring_back("n1")
        response = await cluster.client.post("/admin/nodes", json=registration)
        assert response.status_code == 200, response.text
        assert membership.view.epoch == epoch and membership.crashes == 0


async def test_node_restart_is_noticed_on_the_first_refused_request() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="replica"), clock=clock) as cluster:
        tally = await exhaust_and_replicate(cluster)
        membership = cluster.router.membership
        epoch = membership.view.epoch
        cluster.restart_node("n3")
        await send(cluster.client, tally, USERS, 2)
        assert membership.view.epoch == epoch + 2 and membership.crashes == 1
        assert tally.other == Counter()
        # With replicas the successor kept n3's users and handed them back.
        assert tally.excess() == 0, tally.over()


async def test_an_operators_removal_of_a_node_that_does_not_answer_is_final() -> None:
    """``ringlimit nodes remove`` of a paused node: it cannot take the leave, so
    it is removed as crashed; when it answered again, it was probed like any
    crashed member and made to rejoin, the removal undone (an exploratory
    tester). Now it is told that it left: it hands what it held to the owners
    (nobody gets quota twice) and stays out, and does not register again."""
    async with InProcessCluster(
        3, make_config(crash="reset"), clock=FrozenClock(), router_options={"health_timeout": 0.5}
    ) as cluster:
        tally = await exhaust(cluster)
        membership = cluster.router.membership
        cluster.take_down("n3")
        answer = await cluster.client.delete("/admin/nodes/n3")
        assert answer.status_code == 200, answer.text
        # Said (`nodes remove` prints it): not a clean leave.
        assert "did not take the leave" in answer.json()["warning"]
        assert "n3" not in membership.view and "n3" in membership.removed
        removed_at = membership.view.epoch
        old = cluster.nodes["n3"]
        assert old.shard is not None and len(old.store) > 0
        cluster.bring_back("n3")
        for _ in range(3):  # rounds of probes: it answers each
            await membership.check_health()
            await membership.settle()
            await asyncio.gather(*membership._background)
        assert "n3" not in membership.view and membership.view.epoch == removed_at
        assert "n3" not in membership.removed and not membership.dismissed
        assert old.shard.epoch == removed_at and not old.shard.core.may_rejoin()
        assert len(old.store) == 0  # its states went to their owners
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()
        # An operator may still add it back.
        await membership.join(Member("n3", node_url("n3")))
        assert "n3" in membership.view and old.shard.epoch == membership.view.epoch


async def test_a_removed_node_that_comes_back_hands_back_what_it_held() -> None:
    """A member removed while its process lived on (a pause, a partition) merges its
    states into the current owners before it rejoins: with ``reset`` (no replica)
    its users would otherwise start fresh; here nobody gets quota twice."""
    clock = FrozenClock()
    options = {"failure_threshold": 1}
    async with InProcessCluster(
        3, make_config(crash="reset"), clock=clock, router_options=options
    ) as cluster:
        tally = await exhaust(cluster)
        membership = cluster.router.membership
        cluster.take_down("n1")
        await membership.check_health()
        assert "n1" not in membership.view
        removed_at = membership.view.epoch
        old = cluster.nodes["n1"]
        held = len(old.store)
        assert held > 0
        cluster.bring_back("n1")
        await membership.check_health()
        await membership.settle()  # the rejoin runs beside the health loop
        assert "n1" in membership.view and membership.view.epoch > removed_at
        status = await node_status(cluster, "n1")
        assert status["epoch"] == membership.view.epoch
        # Its states went to the interim owners, and came back with its keys.
        assert old.shard is not None
        assert old.shard.stats.keys_sent >= held
        assert old.shard.stats.keys_dropped == 0
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()


@pytest.mark.parametrize("recovery", ["state_file", "rediscovery"])
async def test_router_restart_keeps_the_ring_and_every_counter(
    recovery: str, tmp_path: Path
) -> None:
    clock = FrozenClock()
    state_file = tmp_path / "ring.json"
    options = {"state_file": str(state_file)} if recovery == "state_file" else {}
    async with InProcessCluster(3, make_config(), clock=clock, router_options=options) as cluster:
        tally = await exhaust(cluster)
        await cluster.add_node("n4")
        before = cluster.router.membership.view
        if recovery == "state_file":
            assert json.loads(state_file.read_text()) == before.to_dict()
            await cluster.restart_router()
        else:
            # No state file: one seed is enough to find the whole ring.
            await cluster.restart_router(seeds=[Member("n1", node_url("n1"))])
        assert cluster.router.membership.view == before
        assert all(n.shard.epoch == before.epoch for n in cluster.nodes.values())
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()
        assert all(tally.denied[u] == 4 for u in USERS)


async def test_a_router_restarted_with_a_removed_node_as_its_seed_finds_the_newest_ring() -> None:
    """n4 was removed (it still runs, holding the view that removed it), then n5
    joined. A router restarted with n4 as its only seed recovered n4's view, one
    epoch behind the members, and its next change reused the members' epoch with
    other members: two rings under one epoch, users admitted on fresh state (an
    exploratory tester, with real processes). The members of the view a seed
    holds are asked too, and the newest view wins."""
    async with InProcessCluster(4, make_config(), clock=FrozenClock()) as cluster:
        tally = await exhaust(cluster)
        await cluster.remove_node("n4")
        await cluster.add_node("n5")
        newest = cluster.router.membership.view
        assert cluster.nodes["n4"].shard.epoch == newest.epoch - 1  # type: ignore[union-attr]
        await cluster.restart_router(seeds=[Member("n4", node_url("n4"))])
        assert cluster.router.membership.view == newest
        await cluster.add_node("n4")  # a new epoch, above every member's
        view = cluster.router.membership.view
        assert view.epoch == newest.epoch + 1
        assert all(n.shard.epoch == view.epoch for n in cluster.nodes.values())  # type: ignore[union-attr]
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()


async def test_a_router_restarted_with_a_node_finds_the_node_restarted(tmp_path: Path) -> None:
    """The router and n3 restart together; the router recovers the ring from
    its state file and pushes it with no previous view. n3, empty, took it:
    at the ring's epoch, its restart went unnoticed and its users started
    afresh. The other members still hold the view, so the push says every
    member holds its states: n3 refuses and is repaired as crashed."""
    options = {"state_file": str(tmp_path / "ring.json")}
    config = make_config(crash="replica")
    async with InProcessCluster(3, config, clock=FrozenClock(), router_options=options) as cluster:
        tally = await exhaust_and_replicate(cluster)
        cluster.restart_node("n3")
        await cluster.restart_router()
        assert cluster.nodes["n3"].shard.epoch == 0  # type: ignore[union-attr]
        await repaired_as_crashed(cluster, cluster.router.membership, tally)


async def test_a_removed_node_still_running_does_not_turn_a_cluster_restart_into_crashes(
    tmp_path: Path,
) -> None:
    """Every member restarted with the router, which recovers the ring from its
    state file: every member takes it empty, nobody is removed as crashed.
    A node removed earlier that still runs (and is still among the seeds)
    holds a view too; it is not a member and says nothing of theirs (a review
    found every member crashed and rejoined in turn)."""
    options = {"state_file": str(tmp_path / "ring.json")}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        await cluster.remove_node("n3")
        view = cluster.router.membership.view
        cluster.restart_node("n1")
        cluster.restart_node("n2")
        await cluster.restart_router(seeds=[Member(n, node_url(n)) for n in ("n1", "n2", "n3")])
        membership = cluster.router.membership
        assert membership.view == view
        await membership.check_health()
        await asyncio.gather(*membership._background)
        assert membership.crashes == 0 and membership.view == view
        assert all(cluster.nodes[n].shard.epoch == view.epoch for n in ("n1", "n2"))  # type: ignore[union-attr]
        tally = Tally()
        await send(cluster.client, tally, USERS[:10], 2)
        assert tally.other == Counter()


async def test_a_state_file_that_cannot_be_written_does_not_fail_a_change_that_happened(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The state file's folder became unwritable (a full disk, a read-only
    mount) while the router ran: DELETE /admin/nodes answered 500
    bad_state_file, but the node had left (its states handed over, every node
    on the new view; a retry: 404), and nothing was logged. The change is
    answered as what it is, with a warning in the answer and in the log, until
    the file can be written again."""
    folder = tmp_path / "state"
    options = {"state_file": str(folder / "ring.json")}
    async with InProcessCluster(
        3, make_config(), clock=FrozenClock(), router_options=options
    ) as cluster:
        tally = await exhaust(cluster)
        shutil.rmtree(folder)
        folder.write_text("not a folder")
        with caplog.at_level(logging.ERROR, logger="ringlimit.router"):
            answer = await cluster.client.delete(f"{ROUTER_URL}/admin/nodes/n3")
        assert answer.status_code == 200, answer.text
        assert "n3" not in cluster.router.membership.view
        assert "state file was not written" in answer.json()["warning"]
        assert any("not written" in r.getMessage() for r in caplog.records)
        ring = (await cluster.client.get(f"{ROUTER_URL}/admin/ring")).json()
        assert "warning" in ring and ring["epoch"] == cluster.router.membership.view.epoch
        await send(cluster.client, tally, USERS, 2)
        assert tally.excess() == 0, tally.over()
        folder.unlink()
        answer = await cluster.client.delete(f"{ROUTER_URL}/admin/nodes/n2")
        assert answer.status_code == 200 and "warning" not in answer.json()
        saved = json.loads((folder / "ring.json").read_text())
        assert saved["epoch"] == cluster.router.membership.view.epoch


async def test_a_router_with_no_state_file_and_no_seeds_says_it_has_no_ring(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """docs/rebalancing.md ("Router restart"): with neither a state file nor seeds
    a router starts with an empty ring, and says so. It said so only when given a
    state file; without one it started silent and answered every request 503
    no_nodes (an operator ran `ringlimit router --config ringlimit.toml` and
    read nothing in its log)."""
    with caplog.at_level(logging.WARNING, logger="ringlimit.router"):
        async with InProcessCluster(0, make_config(), clock=FrozenClock()) as cluster:
            assert len(cluster.router.membership.view) == 0
    said = [r.getMessage() for r in caplog.records if "no ring to serve" in r.getMessage()]
    assert len(said) == 1 and "--state-file" in said[0] and "--node" in said[0], said


async def test_a_restarted_router_says_where_its_ring_came_from(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """At the default level a router that recovered its ring said nothing (an
    INFO line), even when the nodes held a newer epoch than its state file; and
    a state file whose members were all gone led only to "suspecting this
    router's own network or host". Now one warning says where the ring came
    from, its epoch and size, and that the state file may name nodes gone."""

    def said() -> list[str]:
        lines = [r.getMessage() for r in caplog.records if "recovered the ring" in r.getMessage()]
        caplog.clear()
        return lines

    async with state_filed(tmp_path) as (cluster, state):
        epoch = cluster.router.membership.view.epoch
        with caplog.at_level(logging.WARNING, logger="ringlimit.router"):
            await cluster.restart_router()
            assert said() == [
                f"recovered the ring at epoch {epoch} (3 members) from the state file {state}"
            ]
            older = state.read_text()
            await cluster.add_node("n4")
            state.write_text(older)  # the file is behind the nodes
            await cluster.restart_router()
            (line,) = said()
            # (the newest view's node: whichever of them answered first)
            assert line.startswith(
                f"recovered the ring at epoch {epoch + 1} (4 members) from the node at http"
            ), line
            assert line.endswith(f" (the state file {state} had epoch {epoch})"), line
        for node_id in ("n1", "n2", "n3", "n4"):
            cluster.take_down(node_id)
        with caplog.at_level(logging.WARNING, logger="ringlimit.router"):
            await cluster.restart_router()
        (line,) = said()
        assert line.startswith(
            f"recovered the ring at epoch {epoch + 1} (4 members) from the state file {state}; "
            "none of its members answered: the state file may name nodes that are gone"
        ), line


async def test_a_router_that_lost_its_ring_takes_it_back_from_the_first_node_given_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The router's state file is gone and it restarts with no seeds: it says
    so (it started silently empty), and the operator adds a node again. The
    router made a ring of its own at epoch 1 with that node alone and answered
    200, beside the nodes' ring at epoch 3 (the node refused the older view).
    It now takes the node's ring, whole, and every counter with it."""
    async with state_filed(tmp_path) as (cluster, state):
        await cluster.add_node("n4")
        await cluster.remove_node("n4")
        tally = await exhaust(cluster)
        before = cluster.router.membership.view
        state.unlink()
        with caplog.at_level(logging.WARNING, logger="ringlimit.router"):
            await cluster.restart_router()
        assert any("did not exist" in r.getMessage() for r in caplog.records)
        assert len(cluster.router.membership.view) == 0
        answer = await cluster.client.post(
            f"{ROUTER_URL}/admin/nodes", json={"id": "n1", "url": node_url("n1"), "weight": 1}
        )
        assert answer.status_code == 200, answer.text
        assert cluster.router.membership.view == before
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()


async def test_a_node_removed_but_running_does_not_give_a_ringless_router_an_old_ring(
    tmp_path: Path,
) -> None:
    """As above, but the first node given again is one removed from the ring
    that still runs: its view is the one it was removed from (it is not in
    it). Taken, the router stood at that old epoch and joined the node into
    it, which then decided keys the ring's members also own: users admitted
    over their limit (found by a review). The router takes the newest view
    the members of that ring hold, and joins the node to it as a new member."""
    async with state_filed(tmp_path) as (cluster, state):
        await cluster.add_node("n4")
        await cluster.remove_node("n4")  # n4 runs on, holding the view without itself
        await cluster.add_node("n5")
        await cluster.add_node("n6")
        tally = await exhaust(cluster)
        before = cluster.router.membership.view
        state.unlink()
        await cluster.restart_router()
        answer = await cluster.client.post(
            f"{ROUTER_URL}/admin/nodes", json={"id": "n4", "url": node_url("n4"), "weight": 1}
        )
        assert answer.status_code == 200, answer.text
        view = cluster.router.membership.view
        assert view.epoch > before.epoch and set(view.ids) == {*before.ids, "n4"}
        assert all(n.shard.epoch == view.epoch for n in cluster.nodes.values())
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()


async def test_a_node_of_another_ring_is_refused_by_a_router_that_has_one() -> None:
    """A node that holds another cluster's ring (a newer epoch than this
    router's) given to a router with a ring of its own: the router took that
    ring whole and dropped its own members (found by a review of the
    catch-up). Refused, 409, the router's ring unchanged."""
    async with InProcessCluster(2, make_config(), clock=FrozenClock()) as cluster:
        before = cluster.router.membership.view
        stranger = cluster._make_node("n9")
        ring = {"epoch": 7, "nodes": [{"id": "n9", "url": node_url("n9"), "weight": 1}]}
        pushed = await cluster.client.put(
            f"{node_url('n9')}/internal/cluster",
            json={
                "ring": ring,
                "previous": {"epoch": 0, "nodes": []},
                "config": make_config().to_dict(),
            },
        )
        assert pushed.status_code == 200 and stranger.shard.epoch == 7  # type: ignore[union-attr]
        answer = await cluster.client.post(
            f"{ROUTER_URL}/admin/nodes", json={"id": "n9", "url": node_url("n9"), "weight": 1}
        )
        assert answer.status_code == 409 and answer.json()["error"] == "node_in_another_ring"
        assert cluster.router.membership.view == before


async def test_a_join_meanwhile_is_not_dropped_by_the_ring_a_ringless_router_takes(
    tmp_path: Path,
) -> None:
    """While a ringless router asked the members of n1's ring for their newest
    view, a new node's join made a ring of its own; the older ring taken then
    replaced it, and the new node was out of the router's ring, unprobed,
    though its join had answered 200 (a review). Every join answered 200 is
    in the router's ring; n1 is refused if its ring can no longer be taken."""
    async with state_filed(tmp_path) as (cluster, state):
        await cluster.add_node("n4")
        await cluster.remove_node("n4")
        state.unlink()
        await cluster.restart_router()
        nodes = cluster.router.membership.nodes
        discover = nodes.discover

        async def slow_discover(*args: Any, **kwargs: Any) -> Any:
            await asyncio.sleep(0.3)
            return await discover(*args, **kwargs)

        nodes.discover = slow_discover  # type: ignore[method-assign]
        cluster._make_node("n9")
        joins = await asyncio.gather(
            *(
                cluster.client.post(
                    f"{ROUTER_URL}/admin/nodes", json={"id": n, "url": node_url(n), "weight": 1}
                )
                for n in ("n1", "n9")
            )
        )
        view = cluster.router.membership.view
        for node_id, answer in zip(("n1", "n9"), joins, strict=True):
            if answer.status_code == 200:
                assert node_id in view, (node_id, view)
            else:
                assert answer.json()["error"] == "node_in_another_ring", answer.text
        assert joins[1].status_code == 200


async def test_an_empty_ring_in_the_state_file_keeps_its_epoch(tmp_path: Path) -> None:
    """A state file holding an empty ring at epoch 5 started the router at
    epoch 0: its next view was epoch 1, below the views its nodes had held."""
    async with state_filed(tmp_path, nodes=1) as (cluster, state):
        state.write_text(json.dumps({"epoch": 5, "nodes": []}))
        await cluster.restart_router()
        cluster.restart_node("n1")
        answer = await cluster.client.post(
            f"{ROUTER_URL}/admin/nodes", json={"id": "n1", "url": node_url("n1"), "weight": 1}
        )
        assert answer.status_code == 200, answer.text
        assert cluster.router.membership.view.epoch == 6


# --------------------------------------------------------------------------- stale router


async def test_a_router_with_a_stale_view_never_double_counts() -> None:
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(), clock=clock) as cluster:
        seeds = [Member(n, node_url(n)) for n in cluster.nodes]
        second = cluster.new_router("http://router2.localhost", seeds=seeds)
        await second.start()
        try:
            assert second.membership.view == cluster.router.membership.view
            half = USERS[: len(USERS) // 2]
            tally = Tally()
            await send(cluster.client, tally, half, LIMIT // 2)
            await send(cluster.client, tally, half, LIMIT // 2, base="http://router2.localhost")
            v1 = cluster.router.membership.view
            await cluster.add_node("n4")
            await cluster.remove_node("n1")
            # The second router was told nothing: its view is two epochs old.
            assert second.membership.view == v1
            await asyncio.gather(
                send(cluster.client, tally, USERS, LIMIT),
                send(cluster.client, tally, USERS, LIMIT, base="http://router2.localhost"),
            )
            assert tally.other == Counter()
            assert tally.excess() == 0, tally.over()
            assert all(tally.allowed[u] == LIMIT for u in USERS)
            # It caught up from a node's refusal.
            assert second.membership.view == cluster.router.membership.view
        finally:
            await second.close()


@pytest.mark.parametrize("api", ["proxy", "decision"])
async def test_a_stale_router_finding_a_departed_node_gone_catches_up(api: str) -> None:
    """n2 left (and exited) without the second router being told: its owner is
    unreachable, but the view is what is stale, not the node. The router must
    find the newer view rather than fail open (which would admit unlimited)."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(on_error="open"), clock=clock) as cluster:
        seeds = [Member(n, node_url(n)) for n in cluster.nodes]
        second = cluster.new_router("http://router2.localhost", seeds=seeds)
        await second.start()
        try:
            tally = await exhaust(cluster)
            v1 = cluster.router.membership.view
            await cluster.remove_node("n2")
            cluster.take_down("n2")  # the process exited after its leave
            left = moved(v1, cluster.router.membership.view)
            assert left
            if api == "proxy":
                await send(cluster.client, tally, left, 3, base="http://router2.localhost")
                assert tally.other == Counter()
            else:
                for user in left:
                    response = await cluster.client.post(
                        "http://router2.localhost/v1/check", json={"key": user, "rule": "api"}
                    )
                    assert response.status_code == 200, response.text
                    body = response.json()
                    assert body["allowed"] is False and body.get("reason") is None, body
            assert tally.excess() == 0, tally.over()
            assert second.membership.view == cluster.router.membership.view
        finally:
            await second.close()


async def test_stale_router_pushes_its_view_to_a_node_that_is_behind() -> None:
    clock = FrozenClock()
    async with InProcessCluster(2, make_config(), clock=clock) as cluster:
        await cluster.add_node("n3")
        lagging = cluster.nodes["n3"]
        assert lagging.shard.epoch == 2
        membership = cluster.router.membership
        await membership.refresh_node(membership.view.member("n3"), 2)
        assert lagging.shard.epoch == 2


# --------------------------------------------------------------------------- tokens


async def test_internal_and_admin_endpoints_require_the_tokens() -> None:
    clock = FrozenClock()
    options = {"admin_token": ADMIN}
    async with InProcessCluster(
        3, make_config(), clock=clock, internal_token=TOKEN, router_options=options
    ) as cluster:
        tally = await exhaust(cluster)
        n1 = node_url("n1")
        internal = [
            ("GET", f"{n1}/internal/cluster", None),
            ("PUT", f"{n1}/internal/cluster", {}),
            ("POST", f"{n1}/internal/import", {}),
            ("POST", f"{n1}/internal/pull", {}),
            ("POST", f"{n1}/internal/replica", {}),
            ("GET", f"{n1}/internal/status", None),
        ]
        for method, url, body in internal:
            for headers in ({}, {"X-Ringlimit-Token": "wrong"}, {"Authorization": "Bearer no"}):
                response = await cluster.client.request(method, url, json=body, headers=headers)
                assert response.status_code == 401, (method, url, headers)
        for headers in ({"X-Ringlimit-Token": TOKEN}, {"Authorization": f"Bearer {TOKEN}"}):
            response = await cluster.client.get(f"{n1}/internal/status", headers=headers)
            assert response.status_code == 200
        # The router's key header is not believed without the token.
        spoofed = await cluster.client.get(f"{n1}/api", headers={"X-Ringlimit-Key": USERS[0]})
        assert spoofed.status_code == 400

        admin = [
            ("GET", "/admin/ring", None),
            ("POST", "/admin/nodes", {"id": "n9", "url": node_url("n9")}),
            ("DELETE", "/admin/nodes/n1", None),
        ]
        for method, url, body in admin:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": ADMIN}):
                response = await cluster.client.request(method, url, json=body, headers=headers)
                assert response.status_code == 401, (method, url, headers)
        assert len(cluster.router.membership.view) == 3
        auth = {"Authorization": f"Bearer {ADMIN}"}
        assert (await cluster.client.get("/admin/ring", headers=auth)).status_code == 200
        # Handoff works with the token (the nodes send it to each other).
        cluster._make_node("n4")
        response = await cluster.client.post(
            "/admin/nodes", json={"id": "n4", "url": node_url("n4")}, headers=auth
        )
        assert response.status_code == 200
        assert (await cluster.client.delete("/admin/nodes/n2", headers=auth)).status_code == 200
        await send(cluster.client, tally, USERS, 2)
        assert tally.excess() == 0, tally.over()


async def test_without_tokens_internal_and_admin_endpoints_are_loopback_only() -> None:
    clock = FrozenClock()
    async with InProcessCluster(2, make_config(), clock=clock) as cluster:
        remote_node = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=cluster.nodes["n1"], client=("10.1.2.3", 4000)),  # type: ignore[arg-type]
            base_url=node_url("n1"),
        )
        remote_router = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=cluster.router, client=("10.1.2.3", 4000)),  # type: ignore[arg-type]
            base_url=ROUTER_URL,
        )
        async with remote_node, remote_router:
            for path in ("/internal/cluster", "/internal/status"):
                assert (await remote_node.get(path)).status_code == 403
            assert (await remote_node.post("/internal/import", json={})).status_code == 403
            assert (await remote_router.get("/admin/ring")).status_code == 403
            assert (await remote_router.delete("/admin/nodes/n1")).status_code == 403
        assert (await cluster.client.get("/admin/ring")).status_code == 200
        assert len(cluster.router.membership.view) == 2


async def test_replicas_cover_states_received_in_a_handoff() -> None:
    """A new owner replicates what it inherited, not only what changes later."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="replica"), clock=clock) as cluster:
        tally = await exhaust(cluster)
        v1 = cluster.router.membership.view
        await cluster.add_node("n4")
        joined = moved(v1, cluster.router.membership.view)
        assert joined
        for node in cluster.nodes.values():
            await node.shard.replicate_once()
        await cluster.crash_node("n4")
        await send(cluster.client, tally, USERS, 3)
        assert tally.excess() == 0, tally.over()


async def test_replicas_follow_a_change_of_successor() -> None:
    """After a join some keys have a new successor: it must get their replicas."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="replica"), clock=clock) as cluster:
        tally = await exhaust_and_replicate(cluster)
        await cluster.add_node("n4")
        view = cluster.router.membership.view
        # Keys n1 keeps whose successor is now the newcomer.
        rerouted = [
            u for u in USERS if view.owner_id(u) == "n1" and view.successors(u, 2)[1].id == "n4"
        ]
        assert rerouted
        for node in cluster.nodes.values():
            await node.shard.replicate_once()
        await cluster.crash_node("n1")
        await send(cluster.client, tally, USERS, 3)
        assert tally.excess() == 0, tally.over()


@pytest.mark.parametrize("then", ["join", "crash", "leave"])
async def test_conservative_crash_survives_a_later_change(then: str) -> None:
    """Keys of a crashed node stay exhausted through later changes in the period."""
    clock = FrozenClock()
    async with InProcessCluster(4, make_config(crash="conservative"), clock=clock) as cluster:
        tally = await exhaust(cluster)
        v1 = cluster.router.membership.view
        newcomers = [f"new-{i}" for i in range(60)]
        await cluster.crash_node("n2")
        clock.advance(1.0)
        if then == "join":
            await cluster.add_node("n5")
        elif then == "crash":
            await cluster.crash_node("n3")
        else:
            await cluster.remove_node("n3")
        # Nobody asked about n2's users between the crash and the change.
        await send(cluster.client, tally, USERS + newcomers, 3)
        of_n2 = [u for u in USERS + newcomers if v1.owner_id(u) == "n2"]
        assert of_n2
        assert all(tally.allowed[u] == (LIMIT if u in USERS else 0) for u in of_n2)
        assert tally.excess() == 0, tally.over()
        if then == "crash":
            assert all(tally.allowed[u] == 0 for u in newcomers if v1.owner_id(u) == "n3")


# --------------------------------------------------------------------------- partitions


class NoProbes(httpx.AsyncBaseTransport):
    """A node whose health probes time out (it is slow, or probes are lost) but
    which still takes every other request."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path in ("/healthz", "/internal/lease"):
            raise httpx.ReadTimeout("probe lost", request=request)
        return await self.inner.handle_async_request(request)


async def test_partition_router_and_node_single_router() -> None:
    """Router and n2 cannot talk: on_error meanwhile, crash policy, then a clean rejoin."""
    clock = FrozenClock()
    options = {"failure_threshold": 2}
    config = make_config(crash="replica", on_error="closed")
    async with InProcessCluster(3, config, clock=clock, router_options=options) as cluster:
        tally = await exhaust_and_replicate(cluster)
        membership = cluster.router.membership
        v1 = membership.view
        cut_off = [u for u in USERS if v1.owner_id(u) == "n2"]
        cluster.take_down("n2")
        # Before detection: the rule's on_error (closed: 503, nothing admitted).
        during = Tally()
        await send(cluster.client, during, cut_off, 1)
        assert during.other == Counter({503: len(cut_off)})
        for _ in range(2):
            await membership.check_health()
        assert "n2" not in membership.view
        await send(cluster.client, tally, USERS, 3)
        # Healed: n2 hands its old states back (merged, most restrictive first)
        # and rejoins; its keys' states come back to it in the handoff.
        cluster.bring_back("n2")
        await membership.check_health()
        await membership.settle()
        assert "n2" in membership.view
        assert cluster.nodes["n2"].shard.stats.keys_dropped == 0
        assert cluster.nodes["n2"].shard.stats.keys_sent > 0
        await send(cluster.client, tally, USERS, 3)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()
        assert all(tally.node[u] == "n2" for u in cut_off)


async def test_partition_with_two_routers_is_bounded_by_one_quota_per_key() -> None:
    """The one case that double counts: a second router still reaches a node the
    first one removed. Measured here for docs/rebalancing.md: each affected key
    can get at most one extra quota per period (its two copies each run out)."""
    clock = FrozenClock()
    config = make_config(crash="replica")
    options = {"failure_threshold": 1}
    async with InProcessCluster(3, config, clock=clock, router_options=options) as cluster:
        for node in cluster.nodes.values():
            node.store.dirty = set()
        seeds = [Member(n, node_url(n)) for n in cluster.nodes]
        other_side = cluster.detached_client()
        second = cluster.new_router("http://router2.localhost", client=other_side, seeds=seeds)
        await second.start()
        try:
            tally = Tally()
            await send(cluster.client, tally, USERS, LIMIT // 2)
            for node in cluster.nodes.values():
                await node.shard.replicate_once()
            v1 = cluster.router.membership.view
            affected = [u for u in USERS if v1.owner_id(u) == "n2"]
            # {router, n1, n3} | {router2, n2}; router2 still reaches everyone.
            cluster.take_down("n2")
            await cluster.router.membership.check_health()
            assert "n2" not in cluster.router.membership.view
            await asyncio.gather(
                send(cluster.client, tally, USERS, LIMIT),
                send(cluster.client, tally, USERS, LIMIT, base="http://router2.localhost"),
            )
            # Each copy of an affected key had LIMIT/2 left, and both ran out:
            # LIMIT/2 extra per affected key (LIMIT if it had been unused).
            assert affected
            assert tally.over() == {u: LIMIT + LIMIT // 2 for u in affected}
        finally:
            await second.close()
            await other_side.aclose()


async def test_a_slow_node_removed_as_crashed_stops_deciding() -> None:
    """Probes time out but the node is alive: once removed it is told, so a
    router that still reaches it cannot make it decide its old keys."""
    clock = FrozenClock()
    config = make_config(crash="replica")
    options = {"failure_threshold": 1}
    async with InProcessCluster(3, config, clock=clock, router_options=options) as cluster:
        for node in cluster.nodes.values():
            node.store.dirty = set()
        seeds = [Member(n, node_url(n)) for n in cluster.nodes]
        second = cluster.new_router("http://router2.localhost", seeds=seeds)
        await second.start()
        try:
            tally = Tally()
            await send(cluster.client, tally, USERS, LIMIT // 2)
            for node in cluster.nodes.values():
                await node.shard.replicate_once()
            cluster._mounts[node_url("n2")] = NoProbes(cluster._mounts[node_url("n2")])
            membership = cluster.router.membership
            await membership.check_health()
            assert "n2" not in membership.view
            await asyncio.gather(*membership._background)
            assert cluster.nodes["n2"].shard.epoch == membership.view.epoch
            assert len(cluster.nodes["n2"].store) == 0
            await asyncio.gather(
                send(cluster.client, tally, USERS, LIMIT),
                send(cluster.client, tally, USERS, LIMIT, base="http://router2.localhost"),
            )
            assert tally.other == Counter()
            assert tally.excess() == 0, tally.over()
            assert second.membership.view == membership.view
        finally:
            await second.close()


async def test_a_restarted_node_refuses_a_push_that_would_hide_its_restart() -> None:
    """A member restarts (empty, fenced) and the first thing to reach it is a
    push of a change (here another node's join), before any health probe. It
    took it: at the ring's epoch, the router, which tells a restart by epoch 0,
    never knew, and its users started afresh with no crash policy applied
    (found by a review). Refused, it is removed as crashed: its users go on
    from their replicas."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="replica"), clock=clock) as cluster:
        tally = await exhaust_and_replicate(cluster)
        membership = cluster.router.membership
        cluster.restart_node("n3")
        cluster._make_node("n4")
        response = await cluster.client.post(
            "/admin/nodes", json={"id": "n4", "url": node_url("n4"), "weight": 1}
        )
        assert response.status_code == 200, response.text
        await send(cluster.client, tally, USERS, 2)
        assert tally.other == Counter()
        assert tally.excess() == 0, tally.over()
        assert "n3" not in membership.view and membership.crashes == 1


async def test_a_restarted_node_refuses_new_rules_that_would_hide_its_restart() -> None:
    """As above, with new rules as the first thing to reach the restarted
    member: a push with no previous view, which it took (a documented gap):
    at the ring's epoch, the health loop saw nothing wrong and its users
    started afresh. The router now says its members hold their states
    (``established``), so the empty one refuses; the rules reach the others,
    and the health loop removes it as crashed: its users go on from their
    replicas, under the new rules."""
    clock = FrozenClock()
    async with InProcessCluster(3, make_config(crash="replica"), clock=clock) as cluster:
        tally = await exhaust_and_replicate(cluster)
        membership = cluster.router.membership
        cluster.restart_node("n3")
        api = {"name": "api", "limit": LIMIT, "period": PERIOD, "algorithm": "sliding_log"}
        rules = {"rules": [api, {"name": "other", "rate": "5/minute", "paths": ["/other"]}]}
        answer = await cluster.client.put(f"{ROUTER_URL}/admin/rules", json=rules)
        assert answer.status_code == 200, answer.text
        assert answer.json()["pending"] == ["n3"]  # the answer says who has not got them
        assert cluster.nodes["n3"].shard.epoch == 0  # it refused the push
        assert cluster.nodes["n1"].authority.config.rule("other") is not None
        await repaired_as_crashed(cluster, membership, tally)
        assert all(node.authority.config.rule("other") for node in cluster.nodes.values())
