"""The router's direct proxy path (router/protocol.py) against uvicorn's own cycle.

A router served in-process on 127.0.0.1 by :func:`router.server.router_server`,
in front of real node processes; requests are raw HTTP/1.1 bytes on real
sockets, so what is checked is what a client reads. Every behaviour is run
with the direct path on and off: the answers must not differ.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest

from node.asgi import dumps
from node.config import ClusterConfig, ScopedRule
from node.rules import parse_rule
from ring import Member
from router.app import Router, RouterSettings
from router.server import router_server
from tests.processes import Procs, procs  # noqa: F401 (fixture)

pytestmark = [pytest.mark.anyio, pytest.mark.integration]

#: Fields whose values differ between two answers that are the same.
_VARYING = {b"date", b"x-ratelimit-reset"}


@asynccontextmanager
async def served(
    node_url: str, *, direct: bool, on_error: str = "open", kind: type[Router] = Router
) -> AsyncIterator[tuple[Router, Any, int]]:
    """A router on a free port of 127.0.0.1 in front of ``node_url`` (rule 2/minute)."""
    config = ClusterConfig(rules=(ScopedRule(parse_rule("2/minute", on_error=on_error)),))
    router = kind(
        RouterSettings(
            config=config,
            seeds=[Member("n1", node_url)],
            health_checks=False,
            direct_proxy=direct,
        )
    )
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    server = router_server(router, host="127.0.0.1", port=port)
    await router.start()
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.01)
        assert server.started
        yield router, server, port
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        await router.close()
        listener.close()


class Answer:
    def __init__(self, status: int, fields: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status = status
        self.fields = fields
        self.body = body

    def field(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.fields if k == name), None)

    def same(self) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """What must not differ between the two paths (fields in any order; a
        denial says how long to wait, to the millisecond in its body and to the
        second in its fields, so its numbers and its body's length vary)."""
        fields = sorted(f for f in self.fields if f[0] not in _VARYING)
        if self.status != 429:
            return self.status, fields, self.body
        fields = [(k, re.sub(rb"[0-9.]+", b"#", v)) for k, v in fields]
        return self.status, fields, re.sub(rb"[0-9.]+", b"#", self.body)


async def read_answer(reader: asyncio.StreamReader, head: bool = False) -> Answer:
    """One answer; ``head``: to a HEAD (its content-length is not followed by a body,
    nor is a 204's or a 304's)."""
    data = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    lines = data[:-4].split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    fields = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        fields.append((name.strip().lower(), value.strip()))
    bodiless = head or status in (204, 304)
    size = 0 if bodiless else int(next(v for k, v in fields if k == b"content-length"))
    return Answer(status, fields, await asyncio.wait_for(reader.readexactly(size), 5))


def get(path: str, user: str | None, method: str = "GET", extra: str = "") -> bytes:
    who = f"x-user-id: {user}\r\n" if user is not None else ""
    return f"{method} {path} HTTP/1.1\r\nhost: r\r\n{who}{extra}\r\n".encode()


async def exchange(port: int, *requests: bytes, together: bool = False) -> list[Answer]:
    """Send ``requests`` on one connection (in one write if ``together``), one answer each."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    answers = []
    try:
        if together:
            writer.write(b"".join(requests))
            answers = [await read_answer(reader, r.startswith(b"HEAD")) for r in requests]
        else:
            for request in requests:
                writer.write(request)
                answers.append(await read_answer(reader, request.startswith(b"HEAD")))
    finally:
        writer.close()
    return answers


def cycles(server: Any) -> list[str]:
    """The kind of request cycle each open connection served last."""
    return sorted(type(c.cycle).__name__ for c in server.server_state.connections)


async def test_a_proxied_exchange_reads_the_same_on_both_paths(procs: Procs) -> None:  # noqa: F811
    """Admitted, limited, HEAD, a refused user id, a client's pipelined batch:
    the same statuses, fields and bodies, with the direct path on and off
    (each with a node process of its own, so both start from fresh quotas)."""
    seen: dict[bool, list[tuple[int, list[tuple[bytes, bytes]], bytes]]] = {}
    for direct in (True, False):
        _, node = procs.node("n1", None)
        async with served(node, direct=direct) as (_, _, port):
            answers = await exchange(
                port,
                get("/a?x=1", "alice"),
                get("/a", "alice", "HEAD"),
                get("/a", "alice"),
                get("/a", None),
                get("/a", "x" * 300),
            )
            answers += await exchange(
                port, get("/b", "bob"), get("/b", "bob"), get("/b", "bob"), together=True
            )
            # A dot segment, as sent and percent-encoded: refused on both paths.
            answers += await exchange(
                port, get("/x/../internal/cluster", "carol"), get("/x/%2e%2e/y", "carol")
            )
        seen[direct] = [a.same() for a in answers]
        statuses = [a.status for a in answers]
        assert statuses == [200, 200, 429, 400, 400, 200, 200, 429, 400, 400], (direct, statuses)
        assert all(json.loads(a.body)["error"] == "invalid_path" for a in answers[-2:])
        assert answers[0].field(b"x-ringlimit-node") == b"n1"
        # A HEAD's length is the node's: that of the answer it would have sent.
        would_send = dumps({"node": "n1", "user": "alice", "method": "HEAD", "path": "/a"})
        assert answers[1].body == b""
        assert answers[1].field(b"content-length") == str(len(would_send)).encode()
        assert json.loads(answers[3].body)["error"] == "missing_user_id"
        assert json.loads(answers[4].body)["error"] == "key_too_long"
    assert seen[True] == seen[False]


async def test_proxied_requests_without_a_body_take_the_direct_path(procs: Procs) -> None:  # noqa: F811
    """What decides the path: a proxied request without a body is served by
    ProxyCycle; a body, the decision API, health, or the switch off: uvicorn's."""
    _, node = procs.node("n1", None)
    for direct in (True, False):
        async with served(node, direct=direct) as (_, server, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                kinds = []
                for request in (
                    get("/a", "carol"),
                    get("/a", "carol", "POST", "content-length: 2\r\n") + b"{}",
                    get("/healthz", None),
                    get("/a", "carol", "DELETE"),
                ):
                    writer.write(request)
                    await read_answer(reader)
                    kinds.append(cycles(server))
            finally:
                writer.close()
        expected = "ProxyCycle" if direct else "RequestResponseCycle"
        assert kinds == [
            [expected],
            ["RequestResponseCycle"],
            ["RequestResponseCycle"],
            [expected],
        ], direct


@pytest.mark.parametrize("direct", [True, False])
async def test_connection_close_and_http_1_0_end_the_connection(
    procs: Procs,  # noqa: F811
    direct: bool,
) -> None:
    _, node = procs.node("n1", None)
    async with served(node, direct=direct) as (_, _, port):
        for request in (
            get("/a", "dave", extra="connection: close\r\n"),
            b"GET /a HTTP/1.0\r\nx-user-id: erin\r\n\r\n",
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(request)
                answer = await read_answer(reader)
                assert answer.status == 200
                assert answer.field(b"connection") == b"close"
                assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the router
            finally:
                writer.close()


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("on_error", ["open", "closed"])
async def test_an_unreachable_owner_answers_by_its_rule(
    procs: Procs,  # noqa: F811
    direct: bool,
    on_error: str,
) -> None:
    """The owner killed with -9 (health checks off, so it stays in the ring):
    fail-closed answers 503 ``limiter_unavailable``; fail-open has no other
    node to serve through and answers 502. JSON either way, never a 500."""
    proc, node = procs.node("n1", None)
    async with served(node, direct=direct, on_error=on_error) as (_, _, port):
        assert (await exchange(port, get("/a", "frank")))[0].status == 200
        proc.kill9()
        answers = await exchange(port, get("/a", "frank"), get("/a", "grace", "HEAD"))
        expected = 503 if on_error == "closed" else 502
        assert [a.status for a in answers] == [expected, expected]
        error = json.loads(answers[0].body)["error"]
        assert error == ("limiter_unavailable" if on_error == "closed" else "no_node_available")
        assert answers[1].body == b"" and answers[1].field(b"content-length") != b"0"


class _Faulty(Router):
    """A router whose proxy fails in the ways a bug would make it fail, at the step
    both ways of proxying share (``_deliver``: the task's ``proxy`` and the
    callback path's ``answered_now``)."""

    def _deliver(self, send: Any, member: Any, answer: Any, started: float) -> Any:
        path = send.__self__.scope["path"]
        if path == "/silent":
            return None  # no answer at all
        if path == "/half":
            return partial(self._half, send)
        if path == "/boom":
            raise RuntimeError("a bug")
        return super()._deliver(send, member, answer, started)

    @staticmethod
    async def _half(send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x", "more_body": True})
        # an answer never finished


@pytest.mark.parametrize("path", ["/silent", "/half", "/boom"])
@pytest.mark.parametrize("warm", [False, True])
async def test_a_proxy_that_does_not_answer_gets_a_500_and_a_closed_connection(
    procs: Procs,  # noqa: F811
    path: str,
    warm: bool,
) -> None:
    """Never a hung connection (nor the requests pipelined behind it): a JSON 500
    when nothing was sent, then the connection is closed, as uvicorn's cycle does.
    ``warm``: the router's connection to the node is idle, so the request is sent
    without a task and answered from a callback (router/protocol.py
    ``ProxyCycle.begin``); otherwise it connects, in uvicorn's task."""
    _, node = procs.node("n1", None)
    async with served(node, direct=True, kind=_Faulty) as (_, _, port):
        if warm:
            assert (await exchange(port, get("/warm", "ivan")))[0].status == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(get(path, "ivan") + get("/next", "ivan"))
            data = await asyncio.wait_for(reader.read(), 5)  # to the end: closed
        finally:
            writer.close()
    if path == "/half":
        assert data == b""  # the started answer could not be finished: closed
    else:
        assert data.startswith(b"HTTP/1.1 500 ")
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"] == "internal_error"
