"""The handoff's wire format: versioned msgpack, validated whole on receipt,
streamed in chunks, and handed-off states not replicated while the view settles
(node/peers.py, node/shardcore.py, issue 15)."""

from __future__ import annotations

import datetime
import json
from collections.abc import AsyncIterator
from datetime import UTC
from typing import Any

import httpx
import msgspec
import pytest

from node.app import Node
from node.peers import MSGPACK, WIRE_VERSION, Peers, WireError, decode, encode
from node.shardcore import Transfer
from tests.test_node_api import (
    BAD_RECORDS,
    EXHAUSTED_A,
    NODE,
    assert_error,
    client_for,
    make_node,
    node_config,
)
from tests.test_shard_core import KEYS, NOW, RULE, core, decide, view

pytestmark = pytest.mark.anyio


@pytest.fixture
async def in_ring() -> AsyncIterator[tuple[Node, httpx.AsyncClient]]:
    """A node alone in its ring (epoch 1), as in tests/test_node_api.py."""
    node, _ = make_node()
    async with client_for(node) as client:
        ring = {"epoch": 1, "nodes": [{"id": "n7", "url": NODE, "weight": 1}]}
        pushed = await client.put(
            "/internal/cluster",
            json={"config": node_config().to_dict(), "ring": ring, "previous": None},
        )
        assert pushed.status_code == 200, pushed.text
        yield node, client


def transfer(*records: Any, **fields: Any) -> dict[str, Any]:
    return {"from": "n1", "epoch": 1, "final": True, "records": list(records), **fields}


def post_msgpack(client: httpx.AsyncClient, path: str, body: Any) -> Any:
    content = msgspec.msgpack.encode(body)
    return client.post(path, content=content, headers={"content-type": MSGPACK})


def test_encode_carries_the_version_and_decode_reads_both_formats() -> None:
    body = encode(transfer(["api", "token_bucket", "a", [1.0, -2.0]]))
    assert decode(body, MSGPACK)["v"] == WIRE_VERSION
    assert decode(body, MSGPACK)["records"] == [["api", "token_bucket", "a", [1.0, -2.0]]]
    assert decode(json.dumps(transfer()).encode(), "application/json")["from"] == "n1"
    # Media types are case-insensitive: this was read as JSON (400 invalid_json).
    assert decode(body, "Application/MsgPack; charset=x")["v"] == WIRE_VERSION
    for version in (None, 0, 2, "1", True, 1.0):
        with pytest.raises(WireError) as refused:
            decode(msgspec.msgpack.encode({**transfer(), "v": version}), MSGPACK)
        assert refused.value.error == "unsupported_version"
        if version is not None:  # the same in JSON: true == 1 took "v": true for 1
            with pytest.raises(WireError) as refused:
                decode(json.dumps({**transfer(), "v": version}).encode(), "application/json")
            assert refused.value.error == "unsupported_version"
    with pytest.raises(WireError):
        decode(b"\xc1", MSGPACK)
    # An extension type is no part of the format: refused as the body's error, not
    # quoted later as "<msgspec.msgpack.Ext object at 0x...>".
    extended = msgspec.msgpack.encode({**transfer(), "x": msgspec.msgpack.Ext(5, b"ab")})
    with pytest.raises(WireError) as refused:
        decode(extended, MSGPACK)
    assert refused.value.error == "invalid_msgpack" and "extension type 5" in str(refused.value)
    # msgpack's timestamp (extension -1) msgspec reads itself, as a datetime: its
    # repr was quoted ("wire version datetime.datetime(2020, ...)").
    stamped = msgspec.msgpack.encode({**transfer(), "v": datetime.datetime(2020, 1, 1, tzinfo=UTC)})
    with pytest.raises(WireError) as refused:
        decode(stamped, MSGPACK)
    assert "datetime.datetime" not in str(refused.value), refused.value
    assert "wire version of type datetime is not supported" in str(refused.value)


async def test_a_msgpack_transfer_lands(in_ring: Any) -> None:
    _node, client = in_ring
    answer = await post_msgpack(
        client, "/internal/import", {"v": WIRE_VERSION, **transfer(json.loads(EXHAUSTED_A))}
    )
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"taken": 1}
    refused = await client.post("/v1/check", json={"key": "a"})
    assert refused.json()["allowed"] is False


async def test_an_unknown_version_is_refused_with_a_clear_400(in_ring: Any) -> None:
    _node, client = in_ring
    for body in (
        {"v": 2, **transfer(json.loads(EXHAUSTED_A))},
        transfer(json.loads(EXHAUSTED_A)),  # msgpack without a version
    ):
        answer = await post_msgpack(client, "/internal/import", body)
        assert assert_error(answer, 400)["error"] == "unsupported_version"
    as_json = await client.post("/internal/import", json={"v": 9, **transfer()})
    assert assert_error(as_json, 400)["error"] == "unsupported_version"
    # Nothing landed: "a" still has its whole quota.
    assert (await client.post("/v1/check", json={"key": "a"})).json()["remaining"] == 4


async def test_json_from_older_peers_is_still_accepted(in_ring: Any) -> None:
    _node, client = in_ring
    answer = await client.post("/internal/import", json=transfer(json.loads(EXHAUSTED_A)))
    assert answer.status_code == 200 and answer.json() == {"taken": 1}


@pytest.mark.parametrize("bad", BAD_RECORDS)
async def test_a_bad_record_refuses_the_whole_msgpack_transfer(in_ring: Any, bad: str) -> None:
    _node, client = in_ring
    try:
        content = encode(transfer(json.loads(EXHAUSTED_A), json.loads(bad)))
    except (msgspec.EncodeError, UnicodeEncodeError):
        pytest.skip("msgpack cannot carry this value at all")
    for path in ("/internal/import", "/internal/replica"):
        answer = await client.post(path, content=content, headers={"content-type": MSGPACK})
        assert_error(answer, 400)
    assert (await client.post("/v1/check", json={"key": "a"})).json()["remaining"] == 4


def test_chunks_stream_in_order_with_the_final_mark_on_the_last() -> None:
    records = [["api", "token_bucket", f"k{i}", [1.0, 0.0]] for i in range(7)]
    whole = Transfer("n1", "n2", "http://n2", 3, records, True, (), NOW)
    chunks = whole.chunks(3)
    assert [len(c.records) for c in chunks] == [3, 3, 1]
    assert [r for c in chunks for r in c.records] == records
    assert [c.final for c in chunks] == [False, False, True]
    assert {(c.sender, c.to, c.url, c.epoch) for c in chunks} == {("n1", "n2", "http://n2", 3)}
    assert whole.chunks(7) == [whole]
    passing_on = Transfer("n1", "n2", "http://n2", 3, records, False)
    assert not any(c.final for c in passing_on.chunks(2))


def test_handed_off_states_are_not_replicated_until_the_view_settles() -> None:
    """A leaving member hands its states to a node that does not have the new
    view yet: under the old view the sender is their successor, so replicating
    them now would stream them straight back to it mid-push."""
    a, b = core("n0"), core("n1")
    old = view(["n0", "n1"], 1)
    for c in (a, b):
        c.apply(old, None, (), NOW, 0.0)
        c.store.dirty = set()
    mine = [k for k in KEYS if old.owner_id(k) == "n0"]
    for key in mine:
        decide(a, key)
    new = view(["n1"], 2)
    a.apply(new, old, (), NOW, 0.0)
    (sent,) = a.transfers(NOW)
    first, last = sent.chunks(max(1, len(sent.records) // 2))[:2]
    b.receive("n0", 2, first.records, first.final, (), NOW)
    assert b.replica_batches(NOW) == []
    assert b.settling == {r[2] for r in first.records}
    b.receive("n0", 2, last.records, last.final, (), NOW)
    assert b.replica_batches(NOW) == []
    b.release_settled(100.0)  # no deadline can release states of a view not applied yet
    assert b.settling and not b.store.dirty
    b.apply(new, old, (), NOW, 0.0)
    assert not b.settling
    assert {k for k in mine if b.store.get(RULE, k) is not None} == set(mine)


def test_states_received_while_awaiting_a_handoff_replicate_once_it_lands() -> None:
    """A joining member gets its states from the old owners while its view is
    settling; they are replicated after the last final mark."""
    old = view(["n0", "n1"], 1)
    new = view(["n0", "n1", "n2"], 2)
    a, n = core("n0"), core("n2")
    a.apply(old, None, (), NOW, 0.0)
    for key in KEYS:
        if old.owner_id(key) == "n0":
            decide(a, key)
    a.apply(new, old, (), NOW, 0.0)
    n.apply(new, old, (), NOW, 0.0)
    assert n.pending  # n0 and n1 hand off to it
    (to_n,) = [t for t in a.transfers(NOW) if t.to == "n2"]
    assert to_n.records
    n.receive("n0", 2, to_n.records, True, (), NOW)
    assert n.settling and not n.store.dirty  # n1's final mark is still awaited
    n.receive("n1", 2, [], True, (), NOW)
    assert not n.settling and n.store.dirty == {r[2] for r in to_n.records}


async def test_a_peer_that_reads_only_json_gets_the_transfer_in_json() -> None:
    """An older node answers a msgpack body 400 invalid_json: the sender says it
    again in JSON, so a rolling upgrade still hands states off."""
    seen: list[str] = []

    def older_peer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["content-type"])
        try:
            return httpx.Response(200, json={"taken": len(json.loads(request.content)["records"])})
        except ValueError:
            return httpx.Response(400, json={"error": "invalid_json", "detail": "not JSON"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(older_peer))
    async with client:
        peers = Peers(client=client)
        body = transfer(json.loads(EXHAUSTED_A))
        answer = await peers.post("http://old", "/internal/import", body, compact=True)
    assert answer == {"taken": 1}
    assert seen == [MSGPACK, "application/json"]


ODD_MSGPACK = [
    b"",
    b"\x81",  # a map cut short
    msgspec.msgpack.encode({"v": 1, **transfer(["api", "token_bucket", b"a", [0.0, 0.0]])}),
    msgspec.msgpack.encode({"v": 1, **transfer(["api", "token_bucket", "a", [2**63, 0.0]])}),
    msgspec.msgpack.encode({"v": 1, **transfer(msgspec.msgpack.Ext(1, b"x"))}),
    msgspec.msgpack.encode({"v": 1, "from": "n1", "epoch": 2**64 - 1, "final": True}),
    msgspec.msgpack.encode([1, 2, 3]),
    b"\x91" * 100_000 + b"\xc0",  # nested arrays, deeper than anything sane
    b"\xcf" + b"\xff" * 8,  # a lone uint64
]


async def test_a_string_that_is_not_utf8_is_invalid_msgpack(in_ring: Any) -> None:
    _node, client = in_ring
    body = msgspec.msgpack.encode({"v": 1, **transfer(["api", "token_bucket", "a", [0.0, 0.0]])})
    body = body.replace(b"\xa1a", b"\xa1\xff")  # the key: one byte, not UTF-8
    for path in ("/internal/import", "/internal/replica", "/internal/pull"):
        answer = await client.post(path, content=body, headers={"content-type": MSGPACK})
        assert assert_error(answer, 400)["error"] == "invalid_msgpack", answer.text


@pytest.mark.parametrize("body", ODD_MSGPACK, ids=range(len(ODD_MSGPACK)))
async def test_odd_msgpack_bodies_are_4xx_never_500(in_ring: Any, body: bytes) -> None:
    _node, client = in_ring
    for path in ("/internal/import", "/internal/replica", "/internal/pull"):
        answer = await client.post(path, content=body, headers={"content-type": MSGPACK})
        assert_error(answer)
    assert (await client.post("/v1/check", json={"key": "a"})).json()["remaining"] == 4
