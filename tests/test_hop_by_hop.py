"""What the two proxies (router -> node, node -> ``--upstream``) pass on and what
they do not: fields a ``Connection`` field lists, trailers, ``date`` and
``server``; and the length of answers without content (HEAD, 204, 304).

The far side is a scripted HTTP/1.1 server on 127.0.0.1, which records each
request's head and answers by path, so each case is exactly the bytes a
server could send.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from node.hopbyhop import connection_options, without_options
from router.fastclient import FastForwarder
from router.forward import AiohttpForwarder, Answer, Forwarder, HttpxForwarder
from tests.processes import Procs, procs  # noqa: F401 (fixture)
from tests.test_router_protocol import Answer as Raw
from tests.test_router_protocol import exchange, served

pytestmark = pytest.mark.anyio

#: Path -> the whole answer the scripted server sends.
ANSWERS = {
    b"/nocontent": b"HTTP/1.1 204 No Content\r\nx-a: 1\r\n\r\n",
    b"/notmodified": b'HTTP/1.1 304 Not Modified\r\netag: "v1"\r\ncontent-length: 5\r\n\r\n',
    b"/listed": (
        b"HTTP/1.1 200 OK\r\nconnection: keep-alive, X-Hop\r\nx-hop: secret\r\n"
        b"x-a: 1\r\ncontent-length: 2\r\n\r\nok"
    ),
    b"/trailers": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ntrailer: x-sum\r\nx-a: 1\r\n\r\n"
        b"2\r\nok\r\n0\r\nx-sum: 42\r\n\r\n"
    ),
    b"/early": (
        b"HTTP/1.1 103 Early Hints\r\nconnection: x-a\r\nlink: </s.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 2\r\n\r\nok"
    ),
    b"/badtrailer": (
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n"
        b"2\r\nok\r\n0\r\nconnection: x-a\r\n\r\n"
    ),
    b"/chunkedhead": (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nx-a: 1\r\n\r\n0\r\n\r\n"),
    b"/stamped": (
        b"HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2001 00:00:00 GMT\r\nserver: origin/1\r\n"
        b"content-length: 2\r\n\r\nok"
    ),
}
#: What a router asks a node before it forwards anything: who it is.
_NODE = b'{"status": "ok", "node": "n1", "epoch": 0}'
ANSWERS[b"/healthz"] = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(_NODE), _NODE)
ANSWERS[b"/internal/cluster"] = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"
PLAIN = b"HTTP/1.1 200 OK\r\nx-a: 1\r\ncontent-length: 5\r\n\r\nhello"


class Scripted:
    """An HTTP/1.1 server that answers by path and keeps every request's head."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            for _ in range(100):
                head = await reader.readuntil(b"\r\n\r\n")
                self.heads.append(head)
                fields = head.lower().split(b"\r\n")
                length = next((f[15:] for f in fields if f.startswith(b"content-length:")), b"0")
                await reader.readexactly(int(length))
                if b"transfer-encoding: chunked" in fields:
                    await reader.readuntil(b"0\r\n\r\n")  # (the tests send no chunk of 0s)
                method, path = head.split(b" ", 2)[:2]
                answer = ANSWERS.get(path.partition(b"?")[0], PLAIN)
                if method == b"HEAD":
                    answer = answer.rpartition(b"\r\n\r\n")[0] + b"\r\n\r\n"
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    def fields(self, head: bytes) -> dict[bytes, bytes]:
        lines = head.rstrip(b"\r\n").split(b"\r\n")[1:]
        return {k.strip().lower(): v.strip() for k, _, v in (li.partition(b":") for li in lines)}


def request(method: str, path: str, user: str, extra: bytes = b"", body: bytes = b"") -> bytes:
    """A client's request to the router, as bytes."""
    sized = b"content-length: %d\r\n" % len(body) if body else b""
    head = f"{method} {path} HTTP/1.1\r\nhost: r\r\nx-user-id: {user}\r\n".encode()
    return head + extra + sized + b"\r\n" + body


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[Scripted, str]]:
    script = Scripted()
    server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
    try:
        yield script, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        server.close()


def test_connection_options_name_fields_not_options() -> None:
    assert connection_options([b"keep-alive"]) == frozenset()
    assert connection_options([b"Close"]) == frozenset()
    assert connection_options([b"keep-alive, X-Hop ,TE", b"x-other"]) == {
        b"x-hop",
        b"te",
        b"x-other",
    }
    fields = [(b"x-hop", b"1"), (b"x-a", b"2")]
    assert without_options(fields, [b"close"]) is fields
    assert without_options(fields, [b"x-hop"]) == [(b"x-a", b"2")]


FORWARDERS: dict[str, Callable[[], Forwarder]] = {
    "fast": FastForwarder,
    "aiohttp": AiohttpForwarder,
    "httpx": lambda: HttpxForwarder(httpx.AsyncClient()),
}


@pytest.mark.parametrize("kind", list(FORWARDERS))
async def test_every_forwarder_reads_an_answer_the_same(
    kind: str, scripted: tuple[Scripted, str]
) -> None:
    """The router's three clients give the same :class:`Answer` for each case."""
    _, url = scripted
    forwarder = FORWARDERS[kind]()

    async def ask(path: str, method: str = "GET") -> Answer:
        return await forwarder.request(method, url + path, [], None)

    try:
        plain = await ask("/")
        assert (plain.status, plain.headers, plain.body, plain.sized) == (
            200,
            [(b"x-a", b"1")],
            b"hello",
            False,
        )
        head = await ask("/", "HEAD")
        assert (head.headers, head.body, head.sized) == (
            [(b"x-a", b"1"), (b"content-length", b"5")],
            b"",
            True,
        )
        empty = await ask("/nocontent")
        assert (empty.status, empty.headers, empty.sized) == (204, [(b"x-a", b"1")], True)
        cached = await ask("/notmodified")
        assert (cached.status, cached.headers, cached.sized) == (
            304,
            [(b"etag", b'"v1"')],
            True,
        )
        listed = await ask("/listed")
        assert (listed.headers, listed.body) == ([(b"x-a", b"1")], b"ok")
        trailed = await ask("/trailers")
        assert (trailed.headers, trailed.body, trailed.sized) == ([(b"x-a", b"1")], b"ok", False)
        # The connection is still good after each of them.
        again = await ask("/")
        assert again.body == b"hello"
    finally:
        await forwarder.close()


@pytest.mark.parametrize("direct", [True, False])
async def test_the_router_passes_on_no_hop_by_hop_field_and_sizes_only_what_has_content(
    direct: bool, scripted: tuple[Scripted, str]
) -> None:
    """Through the router's own path for bodiless requests (``direct``) and
    uvicorn's: the client's answers, and what the node was sent."""
    script, url = scripted

    async with served(url, direct=direct) as (_, _, port):
        answers: list[Raw] = await exchange(
            port,
            request("GET", "/nocontent", "a"),
            request("POST", "/nocontent", "b", body=b"x"),
            request("GET", "/notmodified", "c"),
            request("HEAD", "/", "d"),
            request("GET", "/listed", "e"),
            request("GET", "/trailers", "f"),
            request(
                "GET",
                "/",
                "g",
                b"connection: keep-alive, x-secret, X-Forwarded-For\r\n"
                b"x-secret: s3cret\r\nx-keep: 1\r\nx-forwarded-for: 6.6.6.6\r\n",
            ),
        )
        after = await exchange(port, request("GET", "/", "h"))
    statuses = [a.status for a in answers]
    assert statuses == [204, 204, 304, 200, 200, 200, 200]
    for answer in answers[:2]:
        assert answer.field(b"content-length") is None and answer.field(b"x-a") == b"1"
        assert answer.field(b"transfer-encoding") is None
    assert answers[2].field(b"content-length") is None and answers[2].field(b"etag") == b'"v1"'
    assert answers[3].field(b"content-length") == b"5"
    assert answers[4].field(b"x-hop") is None and answers[4].body == b"ok"
    assert answers[5].field(b"x-sum") is None and answers[5].body == b"ok"
    assert after[0].body == b"hello"  # the keep-alive connection was framed right
    sent = script.fields(next(h for h in script.heads if b"x-ringlimit-key: g" in h))
    assert b"x-secret" not in sent and sent[b"x-keep"] == b"1"
    assert sent[b"x-forwarded-for"] == b"127.0.0.1"  # the listed chain is dropped
    assert b"connection" not in sent or b"x-secret" not in sent[b"connection"]


async def test_a_node_passes_an_upstream_no_hop_by_hop_field_and_one_date(
    procs: Procs,  # noqa: F811
    scripted: tuple[Scripted, str],
) -> None:
    """A node with ``--upstream``: the same rules on its side, and the answer
    carries the node's ``date`` and ``server`` once, not the upstream's too."""
    script, url = scripted
    _, node = await asyncio.to_thread(procs.node, "n1", None, "--upstream", url)
    async with httpx.AsyncClient(base_url=node, timeout=5) as client:
        stamped = await client.get("/stamped", headers={"x-user-id": "u1"})
        listed = await client.get("/listed", headers={"x-user-id": "u2"})
        sent = await client.get(
            "/", headers={"x-user-id": "u3", "connection": "x-secret", "x-secret": "s"}
        )
        empty = await client.get("/nocontent", headers={"x-user-id": "u4"})
    assert stamped.status_code == 200 and stamped.text == "ok"
    assert len(stamped.headers.get_list("date")) == 1
    assert stamped.headers.get_list("server") == ["uvicorn"]
    assert stamped.headers["content-length"] == "2"
    assert "x-hop" not in listed.headers and listed.text == "ok"
    assert sent.text == "hello"
    sent_head = next(h for h in script.heads if h.startswith(b"GET / "))
    assert b"x-secret" not in script.fields(sent_head)
    assert b"transfer-encoding" not in script.fields(sent_head)  # no body came, none goes
    assert empty.status_code == 204 and "content-length" not in empty.headers


@pytest.mark.parametrize("kind", list(FORWARDERS))
async def test_an_interim_answer_names_no_field_of_the_final_one(
    kind: str, scripted: tuple[Scripted, str]
) -> None:
    """A 103's ``Connection`` is its own: the final answer keeps ``x-a``."""
    _, url = scripted
    forwarder = FORWARDERS[kind]()
    try:
        answer = await forwarder.request("GET", url + "/early", [], None)
        assert answer.status == 200 and (b"x-a", b"1") in answer.headers
    finally:
        await forwarder.close()


@pytest.mark.parametrize("kind", list(FORWARDERS))
async def test_a_trailer_changes_nothing_of_the_next_answer_on_the_connection(
    kind: str, scripted: tuple[Scripted, str]
) -> None:
    """A trailer named ``connection`` is dropped with the trailers; kept by the
    fast client, it stripped the fields it names from the next answer on that
    pooled connection, maybe another client's (the review of the change)."""
    _, url = scripted
    forwarder = FORWARDERS[kind]()
    try:
        first = await forwarder.request("GET", url + "/badtrailer", [], None)
        assert first.body == b"ok"
        second = await forwarder.request("GET", url + "/", [], None)
        assert (b"x-a", b"1") in second.headers, second.headers
    finally:
        await forwarder.close()


@pytest.mark.parametrize("direct", [True, False])
async def test_pipelined_heads_and_gets_are_framed_right(
    direct: bool, scripted: tuple[Scripted, str]
) -> None:
    """HEADs (one with a chunked answer, one through uvicorn's cycle), GETs and a
    304 in one write: each answer is framed so the next one is read right."""
    _, url = scripted

    async with served(url, direct=direct) as (_, _, port):
        answers = await exchange(
            port,
            request("HEAD", "/", "a"),
            request("GET", "/", "b"),
            request("HEAD", "/chunkedhead", "c"),
            request("GET", "/notmodified", "d"),
            request("HEAD", "/", "e", b"content-length: 0\r\n"),  # uvicorn's cycle
            request("GET", "/", "f"),
            together=True,
        )
    assert [a.status for a in answers] == [200, 200, 200, 304, 200, 200]
    assert answers[0].field(b"content-length") == b"5"
    assert answers[1].body == b"hello" and answers[5].body == b"hello"
    assert answers[4].field(b"content-length") == b"5"


async def test_a_client_cannot_take_the_tier_away_from_the_node(
    scripted: tuple[Scripted, str],
) -> None:
    """``Connection: X-User-Tier``: the node still gets the tier (and the user
    id), which it decides tier-scoped rules by; dropped, a free user would
    escape every rule of the free tier (Traefik's CVE-2024-45410 class)."""
    script, url = scripted
    async with served(url, direct=True) as (_, _, port):
        await exchange(
            port,
            b"GET / HTTP/1.1\r\nhost: r\r\nx-user-id: t1\r\nx-user-tier: free\r\n"
            b"connection: keep-alive, X-User-Tier, x-user-id, x-other\r\nx-other: 1\r\n\r\n",
        )
    sent = script.fields(next(h for h in script.heads if b"x-ringlimit-key: t1" in h))
    assert sent[b"x-user-tier"] == b"free" and sent[b"x-user-id"] == b"t1"
    assert b"x-other" not in sent


async def test_a_node_drops_the_length_of_an_upstreams_304(
    procs: Procs,  # noqa: F811
    scripted: tuple[Scripted, str],
) -> None:
    """A 304 may carry the length of what it did not send (RFC 9110 8.6);
    relayed, uvicorn waits for that body, fails the answer and closes the
    client's connection under its next request."""
    _, url = scripted
    _, node = await asyncio.to_thread(procs.node, "n1", None, "--upstream", url)
    port = int(node.rsplit(":", 1)[1])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET /notmodified HTTP/1.1\r\nhost: n\r\nx-user-id: u\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 304") and b"content-length" not in head.lower()
        writer.write(b"GET / HTTP/1.1\r\nhost: n\r\nx-user-id: u\r\n\r\n")
        again = await asyncio.wait_for(reader.read(65536), 5)
        assert again.startswith(b"HTTP/1.1 200"), (head, again)
    finally:
        writer.close()
