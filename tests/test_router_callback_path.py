"""The router's forward without a task (router/protocol.py ``ProxyCycle.begin``,
router/app.py ``Router.forward_now`` and ``answered_now``).

The common proxied request is sent from the protocol's callback and answered
from a callback of its answer's future; everything else goes on in uvicorn's
task, in ``Router.proxy``. What that must keep: uvicorn's bookkeeping (a
graceful shutdown, with and without time left; a client gone mid-forward;
``limit_concurrency``), the general path's handling of every way an answer
fails, flow control towards the client, and a 500 for a bug.

A router served in-process on 127.0.0.1 (:func:`router.server.router_server`,
the real protocol) in front of a scripted node on 127.0.0.1 in the test's
event loop, whose answers the test holds, breaks or shapes; requests are raw
HTTP/1.1 on real sockets. A first request makes the router's connection to
the node, so the next finds it idle: the callback path's case (each test
checks that it was taken).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest

from node.config import ClusterConfig, ScopedRule
from node.rules import parse_rule
from ring import Member, RingView
from router.app import Router, RouterSettings
from router.fastclient import FastForwarder
from router.forward import Timeouts
from router.protocol import ProxyCycle
from router.server import router_server
from tests.processes import wait_until
from tests.test_fastclient import read_head
from tests.test_router_protocol import get, read_answer

pytestmark = pytest.mark.anyio


def _answer(status: bytes, body: bytes, *fields: bytes) -> bytes:
    head = b"".join(field + b"\r\n" for field in fields)
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), head, body)


class Node:
    """A scripted node: answers each request by its path.

    ``/hold...``: 200 once :attr:`release` is set; ``/silent``: never;
    ``/close-once``: the connection closed unanswered the first time, 200 after;
    ``/partial``: half an answer, then closed; ``/big``: 2,000 bytes of body;
    ``/gone``: stops listening and closes the connection unanswered;
    ``/refuse-once``: 421 (not the owner, at the router's epoch) the first time;
    ``/lease``, ``/token``: the 503 of a lapsed lease, of a refused token;
    anything else: 200 at once."""

    def __init__(self) -> None:
        self.seen: list[bytes] = []
        self.release = asyncio.Event()
        self.held = 0
        self.server: asyncio.Server | None = None
        self.url = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def close(self) -> None:
        self.release.set()
        if self.server is not None:
            self.server.close()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                data = await read_head(reader)
                if data is None:
                    return
                path = data.split(b" ", 2)[1]
                first = path not in self.seen
                self.seen.append(path)
                if path.startswith(b"/hold"):
                    self.held += 1
                    await self.release.wait()
                elif path == b"/silent":
                    await self.release.wait()  # (set as the test ends)
                    return
                elif path == b"/close-once" and first:
                    return
                elif path == b"/partial":
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhalf")
                    await writer.drain()
                    return
                elif path == b"/gone":
                    assert self.server is not None
                    self.server.close()
                    return
                if path == b"/big":
                    writer.write(_answer(b"200 OK", b"x" * 2000))
                elif path == b"/refuse-once" and first:
                    writer.write(
                        _answer(b"421 Misdirected Request", b"{}", b"x-ringlimit-epoch: 1")
                    )
                elif path in (b"/lease", b"/token"):
                    why = path[1:]
                    writer.write(
                        _answer(
                            b"503 Service Unavailable", b"{}", b"x-ringlimit-unavailable: " + why
                        )
                    )
                else:
                    writer.write(_answer(b"200 OK", b'{"path": "%s"}' % path, b"x-a: 1"))
                await writer.drain()
        except (asyncio.CancelledError, ConnectionError):
            return
        finally:
            writer.close()


class Watched(Router):
    """A router that notes what each answer on the callback path turned into:
    ``relayed`` from the callback, or ``continued`` in a task. (A request that
    connects to its node, as a warm-up does, is not on it.)"""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.now: list[str] = []

    def answered_now(self, cycle: Any, flight: Any) -> Callable[[], Awaitable[None]] | None:
        later = super().answered_now(cycle, flight)
        self.now.append("relayed" if later is None else "continued")
        return later


class Served:
    """A router served in front of a scripted node (:func:`served`)."""

    def __init__(self, router: Any, node: Node, server: Any, port: int, serving: Any) -> None:
        self.router = router
        self.node = node
        #: The uvicorn server, and its ``serve()`` task.
        self.server = server
        self.serving: asyncio.Task[None] = serving
        self.port = port


@asynccontextmanager
async def served(
    *,
    direct: bool = True,
    on_error: str = "open",
    total: float = 3.0,
    max_answer: int = 1000,
    **uvicorn_config: Any,
) -> AsyncIterator[Served]:
    """A scripted node, and a :class:`Watched` router on a free port of 127.0.0.1
    whose ring is that node alone (not started: no health checks, no seeds to
    ask); ``uvicorn_config`` set on the server's ``uvicorn.Config``."""
    node = Node()
    await node.start()
    config = ClusterConfig(rules=(ScopedRule(parse_rule("100/minute", on_error=on_error)),))
    router = Watched(RouterSettings(config=config, health_checks=False, direct_proxy=direct))
    router.membership.log.view = RingView.of([Member("n1", node.url)], epoch=1)
    forwarder = FastForwarder(timeouts=Timeouts(total=total), max_answer=max_answer)
    router.forwarder = forwarder
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(128)
    port = listener.getsockname()[1]
    server = router_server(router, host="127.0.0.1", port=port)
    for name, value in uvicorn_config.items():
        setattr(server.config, name, value)
    serving = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        await wait_until(lambda: server.started, 5)
        yield Served(router, node, server, port, serving)
    finally:
        node.close()
        server.should_exit = True
        await asyncio.wait_for(serving, 10)
        await forwarder.close()
        listener.close()


async def ask(port: int, path: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client connection with ``GET path`` sent on it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(get(path, "alice"))
    await writer.drain()
    return reader, writer


async def warm(port: int, count: int = 1) -> None:
    """``count`` connections from the router to the node, left idle."""
    clients = [await ask(port, "/warm") for _ in range(count)]
    for reader, writer in clients:
        assert (await read_answer(reader)).status == 200
        writer.close()


def in_flight(server: Any) -> tuple[int, int]:
    """What ``server_state.tasks`` holds: (requests in flight without a task, tasks)."""
    tasks = server.server_state.tasks
    return (
        sum(type(t) is ProxyCycle for t in tasks),
        sum(isinstance(t, asyncio.Task) for t in tasks),
    )


def forwarded(router: Router, outcome: str = "2xx") -> float:
    """The forwards the router counted with ``outcome``."""
    text = router.metrics.render().decode()
    pattern = rf'ringlimit_router_forwarded_total{{node="n1",outcome="{outcome}"}} ([\d.]+)'
    found = re.search(pattern, text)
    return float(found[1]) if found else 0.0


async def test_the_common_request_is_forwarded_without_a_task() -> None:
    """In flight, it stands in the server's tasks as itself (no asyncio task); once
    answered, it is gone from them, and counted."""
    async with served() as it:
        await warm(it.port)
        reader, writer = await ask(it.port, "/hold/a")
        await wait_until(lambda: it.node.held == 1, 5)
        assert in_flight(it.server) == (1, 0)
        it.node.release.set()
        answer = await read_answer(reader)
        writer.close()
        assert answer.status == 200 and answer.field(b"x-ringlimit-node") == b"n1"
        assert json.loads(answer.body) == {"path": "/hold/a"}
        assert it.router.now == ["relayed"]
        assert in_flight(it.server) == (0, 0)
        assert forwarded(it.router) == 2


async def test_a_graceful_shutdown_completes_an_answer_in_flight_without_a_task() -> None:
    """uvicorn's shutdown waits for the connection, then for its tasks: the answer
    arrives whole, says ``connection: close``, the connection closes, and the
    server ends (it would wait for a request left in its tasks for ever)."""
    async with served() as it:
        await warm(it.port)
        reader, writer = await ask(it.port, "/hold/a")
        await wait_until(lambda: it.node.held == 1, 5)
        it.server.should_exit = True
        await asyncio.sleep(0.3)  # the shutdown began: it waits for the connection
        assert not it.serving.done()
        it.node.release.set()
        answer = await read_answer(reader)
        assert answer.status == 200 and answer.field(b"connection") == b"close"
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        await asyncio.wait_for(asyncio.shield(it.serving), 5)
        assert it.router.now == ["relayed"]
        assert in_flight(it.server) == (0, 0)


async def test_a_graceful_shutdown_out_of_time_answers_500_as_for_a_task(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """uvicorn cancels what is in its tasks when its shutdown runs out of time:
    the request in flight without a task gets what a cancelled task's does, a
    500 and the connection closed; the node's answer, later, is dropped."""
    async with served(timeout_graceful_shutdown=0.5) as it:
        await warm(it.port)
        reader, writer = await ask(it.port, "/hold/a")
        await wait_until(lambda: it.node.held == 1, 5)
        it.server.should_exit = True
        data = await asyncio.wait_for(reader.read(), 5)  # to the end: closed
        writer.close()
        assert data.startswith(b"HTTP/1.1 500 ")
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"] == "internal_error"
        await asyncio.wait_for(asyncio.shield(it.serving), 5)
        it.node.release.set()
        await asyncio.sleep(0.2)
        assert it.router.now == []  # (its answer never came back)
        assert in_flight(it.server) == (0, 0)
    assert not [
        r for r in caplog.records if r.levelno >= logging.ERROR and r.name != "uvicorn.error"
    ]


async def test_a_forced_exit_answers_500_as_for_a_task() -> None:
    """A second SIGTERM (``force_exit``) ends the shutdown without cancelling the
    server's tasks (asyncio.run cancels tasks later: each answers 500). A request
    in flight without a task gets the same 500, not a connection closed without
    a byte (router/server.py RouterServer)."""
    async with served() as it:
        await warm(it.port)
        reader, writer = await ask(it.port, "/hold/a")
        await wait_until(lambda: it.node.held == 1, 5)
        assert in_flight(it.server) == (1, 0)
        it.server.should_exit = True
        it.server.force_exit = True
        data = await asyncio.wait_for(reader.read(), 5)  # to the end: closed
        writer.close()
        assert data.startswith(b"HTTP/1.1 500 "), data[:80]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"] == "internal_error"
        await asyncio.wait_for(asyncio.shield(it.serving), 5)
        it.node.release.set()


def gone(writer: asyncio.StreamWriter) -> None:
    """The client goes away at once: its connection reset (SO_LINGER 0). A client
    that closes with a FIN may only have half-closed, and is answered first
    (node/frontdoor.py ``eof_received``; tests/test_frontdoor.py)."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.close()


async def test_a_client_gone_mid_forward(caplog: pytest.LogCaptureFixture) -> None:
    """The forward goes on (counted in the server's tasks meanwhile, as a task
    would be), its answer is dropped, it is counted, nothing is logged as a
    failure, and the node's connection is kept for the next request."""
    async with served() as it:
        await warm(it.port)
        reader, writer = await ask(it.port, "/hold/a")
        await wait_until(lambda: it.node.held == 1, 5)
        gone(writer)
        await wait_until(lambda: not it.server.server_state.connections, 5)
        assert in_flight(it.server) == (1, 0)
        it.node.release.set()
        await wait_until(lambda: in_flight(it.server) == (0, 0), 5)
        assert it.router.now == ["relayed"]
        assert forwarded(it.router) == 2
        reader, writer = await ask(it.port, "/next")
        assert (await read_answer(reader)).status == 200
        writer.close()
        assert it.router.now == ["relayed"] * 2  # the kept connection: the callback path again
        assert len(it.node.seen) == 3
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


async def test_forwards_in_flight_without_a_task_count_against_limit_concurrency() -> None:
    """uvicorn's ``limit_concurrency`` counts the server's tasks (and connections):
    forwards whose clients left are still in flight, and count. Two of them, at a
    limit of two: the next request gets the front door's 503."""
    async with served() as it:
        # Two connections to the node, made by two requests at once, then idle.
        first = [await ask(it.port, path) for path in ("/hold/1", "/hold/2")]
        await wait_until(lambda: it.node.held == 2, 5)
        it.node.release.set()
        for reader, writer in first:
            assert (await read_answer(reader)).status == 200
            writer.close()
        it.node.release.clear()
        it.server.config.limit_concurrency = 2  # (read by each connection as it is made)
        for held, path in enumerate(("/hold/a", "/hold/b"), start=3):
            _, writer = await ask(it.port, path)
            await wait_until(lambda held=held: it.node.held == held, 5)  # type: ignore[misc]
            gone(writer)
        await wait_until(lambda: not it.server.server_state.connections, 5)
        assert in_flight(it.server) == (2, 0)
        reader, writer = await ask(it.port, "/c")
        answer = await read_answer(reader)
        writer.close()
        assert answer.status == 503 and json.loads(answer.body)["error"] == "over_capacity"
        it.node.release.set()
        await wait_until(lambda: in_flight(it.server) == (0, 0), 5)
        reader, writer = await ask(it.port, "/c")
        assert (await read_answer(reader)).status == 200
        writer.close()
        assert it.router.now == ["relayed"] * 3


#: A node's failing answer: what the client gets for it (status, error), and how
#: many times the node was sent the request.
FAILURES = {
    # On a reused connection, nothing back: sent again on a fresh one.
    "/close-once": (200, None, 2),
    # Sent, and the connection broke mid-answer (AnswerLost): never sent again.
    "/partial": (504, "node_timeout", 1),
    # Sent, unanswered in time (NodeTimeout): never sent again.
    "/silent": (504, "node_timeout", 1),
    # Answered past --max-answer (AnswerTooLarge).
    "/big": (502, "answer_too_large", 1),
    # The node gone: the retry cannot connect (Unreachable), on_error open decides.
    "/gone": (502, "no_node_available", 1),
    # A refusal while the ring changes: sent again.
    "/refuse-once": (200, None, 2),
    # A lapsed lease, a refused token: as if unreachable.
    "/lease": (502, "no_node_available", 1),
    "/token": (502, "no_node_available", 1),
}


@pytest.mark.parametrize("path", list(FAILURES))
async def test_each_failure_of_an_answer_goes_through_the_general_path(path: str) -> None:
    """Each is begun on the callback path and goes on in a task, in
    ``Router.proxy``: what the client gets, and what the node is sent, are what
    they are with uvicorn's own cycle (``direct_proxy`` off: the general path
    alone)."""
    got = {}
    for direct in (True, False):
        async with served(direct=direct, total=0.5) as it:
            await warm(it.port)
            reader, writer = await ask(it.port, path)
            answer = await read_answer(reader)
            writer.close()
            error = json.loads(answer.body).get("error") if answer.status != 200 else None
            got[direct] = (answer.status, error, it.node.seen.count(path.encode()))
            assert it.router.now == (["continued"] if direct else [])
    assert got[True] == got[False] == FAILURES[path]


async def test_an_answer_waits_for_a_client_not_taking_writes() -> None:
    """Flow control: an answer that comes while the client's connection is paused
    for writing is written once it resumes (in a task, as the general path does)."""
    async with served() as it:
        await warm(it.port)
        reader, writer = await ask(it.port, "/hold/a")
        await wait_until(lambda: it.node.held == 1, 5)
        (protocol,) = it.server.server_state.connections
        protocol.flow.pause_writing()
        it.node.release.set()
        await wait_until(lambda: it.router.now == ["continued"], 5)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 0.3)
        protocol.flow.resume_writing()
        answer = await read_answer(reader)
        writer.close()
        assert answer.status == 200 and json.loads(answer.body) == {"path": "/hold/a"}
        assert in_flight(it.server) == (0, 0)
