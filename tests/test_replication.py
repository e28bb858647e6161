"""Replication rounds: one body per successor per interval, whatever changes
while it is sent (node/shardcore.py ``replica_round``), and replicas over a
real socket through :meth:`Peers.replicate` (aiohttp), including the JSON
fallback for an older peer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import uvicorn
from aiohttp import web

from node.app import Node
from node.config import ClusterConfig, Policies, ScopedRule
from node.peers import MSGPACK, PeerError, Peers
from node.rules import Rule
from node.shard import Shard
from node.shardcore import ShardCore
from node.store import MemoryStore
from tests.processes import free_port
from tests.test_node_api import make_node, node_config
from tests.test_shard_core import KEYS, NOW, RULE, config, core, decide, view

pytestmark = pytest.mark.anyio


def replicating(ids: list[str]) -> Any:
    """Cores of ``ids`` in one view, change tracking on and empty."""
    ring = view(ids, 1)
    cores = [core(i) for i in ids]
    for c in cores:
        c.apply(ring, None, (), NOW, 0.0)
        assert c.replication_tick()
        c.store.dirty = set()
    return cores


#: Keys n0 owns in the ring of n0 and n1 (their successor is n1).
MINE = [k for k in KEYS if view(["n0", "n1"], 1).owner_id(k) == "n0"]


def sent_keys(batches: Any) -> set[str]:
    return {r[2] for b in batches for r in b.records}


# --------------------------------------------------------------------------- the core


def test_a_round_takes_the_keys_changed_before_it_began_and_no_more() -> None:
    (a, _) = replicating(["n0", "n1"])
    early, late = MINE[:6], MINE[6:12]
    for key in early:
        decide(a, key)
    assert a.replica_round() == len(early)
    for key in late:  # requests answered while the round is being sent
        decide(a, key)
    first = a.replica_batches(NOW, 4)
    rest = a.replica_batches(NOW, 100)
    assert len(sent_keys(first)) == 4
    assert sent_keys(first) | sent_keys(rest) == set(early)
    assert a.store.dirty == set(late)  # the next round's
    assert a.replica_round() == len(late)
    assert sent_keys(a.replica_batches(NOW)) == set(late)
    assert a.replica_batches(NOW) == []


def test_keys_left_by_a_broken_off_round_join_the_next() -> None:
    (a, _) = replicating(["n0", "n1"])
    for key in MINE[:6]:
        decide(a, key)
    a.replica_round()
    taken = sent_keys(a.replica_batches(NOW, 2))  # the driver stops here (an error)
    decide(a, MINE[6])
    assert a.replica_round() == 4 + 1
    assert sent_keys(a.replica_batches(NOW)) == set(MINE[:6]) - taken | {MINE[6]}


def test_without_a_round_replica_batches_takes_every_change_so_far() -> None:
    """The simulations call replica_batches alone, once per interval."""
    (a, _) = replicating(["n0", "n1"])
    for key in MINE[:5]:
        decide(a, key)
    assert sent_keys(a.replica_batches(NOW)) == set(MINE[:5])
    assert a.replica_batches(NOW) == []


def test_a_round_ends_when_replication_stops() -> None:
    (a, _) = replicating(["n0", "n1"])
    for key in MINE[:5]:
        decide(a, key)
    a.replica_round()
    a.apply(view(["n0"], 2), view(["n0", "n1"], 1), ("n1",), NOW, 0.0)
    assert not a.replication_tick()
    assert a.round == set() and a.store.dirty is None


# --------------------------------------------------------------------------- the driver


class SlowPeers(Peers):
    """A successor that answers after requests changed more keys meanwhile."""

    def __init__(self, shard_core: Any, keys: list[str]) -> None:
        super().__init__()
        self.core = shard_core
        self.keys = keys
        self.bodies: list[set[str]] = []

    async def replicate(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append({r[2] for r in payload["records"]})
        if self.keys:
            decide(self.core, self.keys.pop())
        await asyncio.sleep(0)
        return {"taken": len(payload["records"])}


async def test_one_round_sends_one_body_however_many_keys_change_meanwhile() -> None:
    """Under load every send lets requests in: a round that also took their keys
    sent one small body after another, back to back, for as long as load lasted."""
    (a, _) = replicating(["n0", "n1"])
    peers = SlowPeers(a, list(MINE[10:]))
    shard = Shard("n0", a.store, lambda: NOW, peers, a.config)
    shard.core = a
    for key in MINE[:10]:
        decide(a, key)
    assert await shard.replicate_once() == 10
    assert peers.bodies == [set(MINE[:10])]
    assert a.store.dirty == {MINE[-1]}
    assert await shard.replicate_once() == 1
    assert peers.bodies[1:] == [{MINE[-1]}]
    await peers.close()


# --------------------------------------------------------------------------- the wire


@pytest.fixture
async def served() -> AsyncIterator[tuple[Node, str]]:
    """A sticky node in a two-member ring, on a real socket (uvicorn)."""
    node, _ = make_node(fenced=True)
    assert node.shard is not None
    node.shard.apply(view(["n7", "n1"], 1), None, ())
    node.authority.config = node_config()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(node, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    )
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.01)
    try:
        yield node, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def replica(*records: list[Any]) -> dict[str, Any]:
    return {"from": "n1", "epoch": 1, "records": list(records)}


async def test_replicas_reach_a_node_over_aiohttp(served: tuple[Node, str]) -> None:
    node, url = served
    peers = Peers()
    try:
        answer = await peers.replicate(url, replica(["api", "token_bucket", "a", [0.0, 0.0]]))
        assert answer == {"taken": 1}
        assert node.shard is not None and len(node.shard.core.replicas["n1"]) == 1
        with pytest.raises(PeerError) as refused:
            await peers.replicate(url, replica(["api", "token_bucket", "a", [float("nan"), 0.0]]))
        assert refused.value.status == 400 and not refused.value.transient
    finally:
        await peers.close()


async def test_an_unreachable_successor_is_a_transient_peer_error() -> None:
    peers = Peers(timeout=0.5)
    try:
        with pytest.raises(PeerError) as down:
            await peers.replicate(f"http://127.0.0.1:{free_port()}", replica())
        assert down.value.status is None and down.value.transient
    finally:
        await peers.close()


async def test_a_peer_that_reads_only_json_gets_replicas_in_json() -> None:
    """An older node answers a msgpack body 400 invalid_json: said again in JSON."""
    seen: list[str] = []

    async def older_peer(request: web.Request) -> web.Response:
        seen.append(request.content_type)
        body = await request.read()
        try:
            records = json.loads(body)["records"]
        except ValueError:
            return web.json_response({"error": "invalid_json", "detail": "no"}, status=400)
        return web.json_response({"taken": len(records)})

    app = web.Application()
    app.router.add_post("/internal/replica", older_peer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    peers = Peers()
    try:
        answer = await peers.replicate(
            f"http://127.0.0.1:{port}", replica(["api", "token_bucket", "a", [0.0, 0.0]])
        )
    finally:
        await peers.close()
        await runner.cleanup()
    assert answer == {"taken": 1}
    assert seen == [MSGPACK, "application/json"]


# --------------------------------------------------------------------------- after a view change

MANY = [f"user-{i}" for i in range(400)]


def placed(ring: Any, key: str) -> list[str]:
    """The key's owner and successor: where its state and its replica live."""
    return placed_at(ring, key, 2)


def placed_at(ring: Any, key: str, depth: int) -> list[str]:
    """The key's owner and its ``depth - 1`` successors."""
    return [m.id for m in ring.successors(key, depth)]


LIMIT_OF_MANY = 1_000_000


def started(ring: Any, *spare: str) -> dict[str, Any]:
    """Cores of ``ring``'s members in it, replicating, and ``spare`` ones not yet."""
    cores = {i: core(i) for i in (*ring.ids, *spare)}
    for i in ring.ids:
        cores[i].apply(ring, None, (), NOW, 0.0)
        assert cores[i].replication_tick()
    return cores


def replicated_by_n0(cores: dict[str, Any], ring: Any) -> tuple[Any, list[str]]:
    """n0 decides each key it owns in ``ring`` once, and replicates them."""
    a = cores["n0"]
    mine = [k for k in MANY if ring.owner_id(k) == "n0"]
    for key in mine:
        decide(a, key)
    replicate(a, cores)
    return a, mine


def replicate(origin: Any, cores: dict[str, Any]) -> set[str]:
    """One whole round of ``origin``, delivered; the keys it sent."""
    batches = origin.replica_batches(NOW)
    for batch in batches:
        cores[batch.to].receive_replicas(origin.id, batch.records, NOW, batch.round)
    return sent_keys(batches)


def test_after_a_view_change_every_state_is_where_its_replicas_belong() -> None:
    """A join moves some states' successors: each state's replica is where it
    belongs afterwards, sent before the join or after it."""
    v1, v2 = view(["n0", "n1", "n2"], 1), view(["n0", "n1", "n2", "n3"], 2)
    cores = started(v1, "n3")
    a = cores["n0"]
    mine = [k for k in MANY if v1.owner_id(k) == "n0"]
    for key in mine:
        decide(a, key)
    assert replicate(a, cores) == set(mine)

    cores["n3"].apply(v2, v1, (), NOW, 0.0)
    a.apply(v2, v1, (), NOW, 0.0)
    kept = [k for k in mine if v2.owner_id(k) == "n0"]
    moved = {k for k in kept if placed(v1, k) != placed(v2, k)}
    assert moved and len(moved) < len(kept)  # the ring puts n3 after some of them
    assert replicate(a, cores) >= moved
    assert replicate(a, cores) == set()  # nothing changed since
    for key in kept:  # what a crash of n0 would promote
        holder = cores[placed(v2, key)[1]]
        assert holder.replicas["n0"].get(RULE, key) == a.store.get(RULE, key), key


def test_a_successor_that_left_and_came_back_in_views_a_node_missed_gets_its_replicas() -> None:
    """n1 leaves (its replicas go) and comes back; n0 missed both views and is
    refreshed with its own last view as the previous one and no crash (found
    by a review of an attempt to send only what a view moved)."""
    ids = ["n0", "n1", "n2", "n3"]
    v1, v2, v3 = view(ids, 1), view(["n0", "n2", "n3"], 2), view(ids, 3)
    cores = started(v1)
    a, mine = replicated_by_n0(cores, v1)
    for i in ("n1", "n2", "n3"):
        cores[i].apply(v2, v1, (), NOW, 0.0)  # n1 leaving: its replicas go
    for i in ("n1", "n2", "n3"):
        cores[i].apply(v3, v2, (), NOW, 0.0)
    a.apply(v3, v1, (), NOW, 0.0)  # the health loop's refresh of n0
    assert a.replication_tick()
    replicate(a, cores)
    back = [k for k in mine if placed(v3, k)[1] == "n1"]
    assert back and all(cores["n1"].replicas["n0"].get(RULE, k) is not None for k in back)


def test_replicas_placed_under_no_one_view_go_again() -> None:
    """Two view changes before a round (n1 removed, then back with nothing): the
    keys of the first change not looked at yet go as changed, since a member
    may have left and come back empty in between. Compared with the view
    before the second change alone, a key whose successor is n1 again would
    have been taken for placed."""
    v1, v2, v3 = view(["n0", "n1", "n2"], 1), view(["n0", "n2"], 2), view(["n0", "n1", "n2"], 3)
    cores = started(v1)
    a = cores["n0"]
    mine = [k for k in MANY if v1.owner_id(k) == "n0" and v3.owner_id(k) == "n0"]
    for key in mine:
        decide(a, key)
    assert replicate(a, cores) == set(mine)
    a.apply(v2, v1, ("n1",), NOW, 0.0)
    cores["n1"] = core("n1")  # restarted: no replicas
    a.apply(v3, v2, (), NOW, 0.0)
    assert replicate(a, cores) >= set(mine)
    back = [k for k in mine if placed(v3, k)[1] == "n1"]
    assert back and all(cores["n1"].replicas["n0"].get(RULE, k) is not None for k in back)


def test_replicas_are_checked_against_the_view_they_were_placed_under() -> None:
    """A node that missed a view (the router's ``previous`` is one it never
    applied) placed its replicas under its own last view: compared with the
    router's, a key whose successor changed in the view it missed, and not
    since, would be taken for placed, and its new successor never sent it."""
    v1 = view(["n0", "n1", "n2"], 1)
    v2 = view(["n0", "n1", "n2", "n3"], 2)
    v3 = view(["n0", "n1", "n2", "n3", "n4"], 3)
    cores = started(v1, "n3", "n4")
    a = cores["n0"]
    mine = [k for k in MANY if v1.owner_id(k) == "n0" and v3.owner_id(k) == "n0"]
    for key in mine:
        decide(a, key)
    assert replicate(a, cores) == set(mine)
    a.apply(v3, v2, (), NOW, 0.0)  # v2 never reached n0
    missed = {k for k in mine if placed(v1, k) != placed(v3, k) == placed(v2, k)}
    assert missed
    assert replicate(a, cores) >= missed


def test_a_successor_back_from_a_crash_in_views_a_node_missed_gets_its_replicas() -> None:
    """The health loop's refresh of a node that missed the views in which its
    successor crashed and came back empty: the new view places the keys as
    the node's own last one did, so compared, nothing went to the restarted
    successor (found by a review)."""
    ids = ["n0", "n1", "n2", "n3"]
    v1, v3 = view(ids, 1), view(ids, 3)
    cores = started(v1)
    a, mine = replicated_by_n0(cores, v1)
    cores["n1"] = core("n1")  # restarted: no replicas
    a.apply(v3, v1, ("n1",), NOW, 0.0)  # v2 (without n1) never reached n0
    assert a.replication_tick()
    replicate(a, cores)
    back = [k for k in mine if placed(v3, k)[1] == "n1"]
    assert back and all(cores["n1"].replicas["n0"].get(RULE, k) is not None for k in back)


def test_states_handed_over_while_a_view_settles_are_replicated_at_the_next_view() -> None:
    """A handoff's states that land while the receiver's view settles wait to
    be replicated until it has settled; a view that comes first lets that set
    go, and they joined no change set: never replicated, a crash of their new
    owner gave their users fresh quotas (found by a review)."""
    v1 = view(["n0", "n1", "n2", "n3"], 1)
    v2 = view(["n0", "n2", "n3"], 2)  # n1 leaves
    v3 = view(["n0", "n2", "n3", "n4"], 3)  # n4 joins before the handoff settled
    cores = started(v1, "n4")
    leaving = cores["n1"]
    theirs = [k for k in MANY if v1.owner_id(k) == "n1"]
    for key in theirs:
        decide(leaving, key)
    replicate(leaving, cores)
    for i in ("n0", "n2", "n3", "n1"):
        cores[i].apply(v2, v1, (), NOW, 0.0)
    landed: dict[str, list[str]] = {}
    for transfer in leaving.transfers(NOW):
        for chunk in transfer.chunks(max(1, len(transfer.records) - 1))[:-1]:  # not the final
            cores[chunk.to].receive(chunk.sender, chunk.epoch, chunk.records, chunk.final, (), NOW)
            landed.setdefault(chunk.to, []).extend(r[2] for r in chunk.records)
    assert any(cores[i].settling for i in landed)
    for i in ("n0", "n2", "n3", "n4"):
        cores[i].apply(v3, v2, (), NOW, 0.0)
    for i in ("n0", "n2", "n3"):
        replicate(cores[i], cores)
    checked = [
        (owner, key)
        for owner, keys in landed.items()
        for key in keys
        if v3.owner_id(key) == owner and placed(v2, key) == placed(v3, key)
    ]
    assert checked
    for owner, key in checked:
        held = cores[placed(v3, key)[1]].replicas.get(owner)
        assert held is not None and held.get(RULE, key) is not None, (owner, key)


def test_a_config_that_turns_replication_on_or_deeper_sends_every_state() -> None:
    """A rule switched to crash policy replica with two replicas, pushed under
    the same view: no state had its replicas, and none went until it changed
    (a later view change used to send every state, which hid it; found by a
    review)."""
    flat = Rule("api", LIMIT_OF_MANY, 3600.0, algorithm="fixed_window")
    deep = Rule("api", LIMIT_OF_MANY, 3600.0, algorithm="fixed_window", replicas=2)
    current = {"config": config(crash="conservative", rule=flat)}
    ids = ["n0", "n1", "n2", "n3"]
    cores = {i: ShardCore(i, MemoryStore(), lambda: current["config"]) for i in ids}
    v1 = view(ids, 1)
    for c in cores.values():
        c.apply(v1, None, (), NOW, 0.0)
        assert not c.replication_tick()  # conservative: nothing to replicate
    a = cores["n0"]
    mine = [k for k in MANY if v1.owner_id(k) == "n0"]
    for key in mine:
        decide(a, key, rule=flat)
    current["config"] = config(crash="replica", rule=deep)
    for c in cores.values():
        assert c.replication_tick()
    assert replicate(a, cores) == set(mine)
    for key in mine:
        first, second = placed_at(v1, key, 3)[1:]
        for holder in (first, second):
            assert cores[holder].replicas["n0"].get(deep, key) is not None, (key, holder)


def test_a_rule_replicated_further_below_the_deepest_sends_its_states() -> None:
    """Rule ``a`` raised from one replica to two while rule ``b`` already had
    two: the deepest stayed two, and a check of it alone sent nothing (found
    by a review)."""
    a1 = Rule("a", LIMIT_OF_MANY, 3600.0, algorithm="fixed_window", replicas=1)
    a2 = Rule("a", LIMIT_OF_MANY, 3600.0, algorithm="fixed_window", replicas=2)
    b = Rule("b", LIMIT_OF_MANY, 3600.0, algorithm="fixed_window", replicas=2)
    policies = Policies(rebalance="handoff", crash="replica")
    current = {"config": ClusterConfig(rules=(ScopedRule(a1), ScopedRule(b)), policies=policies)}
    ids = ["n0", "n1", "n2", "n3"]
    cores = {i: ShardCore(i, MemoryStore(), lambda: current["config"]) for i in ids}
    v1 = view(ids, 1)
    for c in cores.values():
        c.apply(v1, None, (), NOW, 0.0)
        assert c.replication_tick()
    x = cores["n0"]
    mine = [k for k in MANY if v1.owner_id(k) == "n0"]
    for key in mine:
        decide(x, key, rule=a1)
    replicate(x, cores)
    current["config"] = ClusterConfig(rules=(ScopedRule(a2), ScopedRule(b)), policies=policies)
    assert x.replication_tick()
    replicate(x, cores)
    for key in mine:
        second = placed_at(v1, key, 3)[2]
        assert cores[second].replicas["n0"].get(a2, key) is not None, key
