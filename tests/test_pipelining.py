"""Pipelining between router and node (router/fastclient.py ``pipeline``; node/server.py).

Against a real node process: answers are matched to their requests, requests
made together share connections, and a node answers a pipelined batch in one
write. Against a scripted server on 127.0.0.1: what happens when a
connection closes, times out or is found closed in the middle of a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from router.fastclient import FastForwarder
from router.forward import AnswerLost, NodeTimeout, Timeouts
from tests.processes import Procs, procs  # noqa: F401 (fixture)

pytestmark = pytest.mark.anyio


async def _many(client: FastForwarder, base: str, count: int) -> list[dict[str, object]]:
    answers = await asyncio.gather(
        *(
            client.request("GET", f"{base}/item/{i}", [("x-user-id", f"u{i}")], None)
            for i in range(count)
        )
    )
    assert [a.status for a in answers] == [200] * count
    return [json.loads(a.body) for a in answers]


@pytest.mark.integration
async def test_a_real_node_answers_each_pipelined_request_in_order(procs: Procs) -> None:  # noqa: F811
    _, node = procs.node("n1", None)
    pipelined = FastForwarder(pipeline=8)
    plain = FastForwarder()
    try:
        for _ in range(3):  # a second and third round reuse the connections
            bodies = await _many(pipelined, node, 40)
            assert [b["path"] for b in bodies] == [f"/item/{i}" for i in range(40)]
        pool, _ = pipelined.base(node)
        # 40 requests made in one step, at most 8 per connection: 5 connections.
        assert len(pool.idle) == 5
        # ... and 5 writes each round (what /metrics shows as ringlimit_router_pipelined).
        assert pipelined.pipelined == {"writes": 15, "requests": 120}
        await _many(plain, node, 40)
        assert len(plain.base(node)[0].idle) == 40
        assert plain.pipelined == {"writes": 0, "requests": 0}
    finally:
        await pipelined.close()
        await plain.close()


@pytest.mark.integration
def test_a_node_answers_a_pipelined_batch_in_one_write(procs: Procs) -> None:  # noqa: F811
    """Five requests in one write come back in one read: the node postpones each
    answer's flush past the next request's task (node/server.py)."""
    _, node = procs.node("n1", None)
    port = int(node.rsplit(":", 1)[1])
    whole = 0
    for attempt in range(5):
        with socket.create_connection(("127.0.0.1", port), timeout=3) as sock:
            sock.sendall(
                b"".join(
                    b"GET /x HTTP/1.1\r\nhost: n\r\nx-user-id: u%d-%d\r\n\r\n" % (attempt, i)
                    for i in range(5)
                )
            )
            first = sock.recv(1 << 16)
            data = first
            while data.count(b"HTTP/1.1 200") < 5:
                chunk = sock.recv(1 << 16)
                assert chunk, data
                data += chunk
            whole += first.count(b"HTTP/1.1 200") == 5
    assert whole >= 4  # one write each time (a read may race the write once)


class Scripted:
    """Reads pipelined requests and answers each as ``behave(index)`` says."""

    def __init__(self, behave: Callable[[int], Awaitable[bytes | None]]) -> None:
        self.behave = behave
        self.seen = 0
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        buffer = b""
        try:
            while True:
                while b"\r\n\r\n" not in buffer:
                    chunk = await reader.read(4096)
                    if not chunk:
                        return
                    buffer += chunk
                _, buffer = buffer.split(b"\r\n\r\n", 1)
                index = self.seen
                self.seen += 1
                answer = await self.behave(index)
                if answer is None:
                    return  # close without answering
                writer.write(answer)
                await writer.drain()
                if b"connection: close" in answer:
                    return
        except (asyncio.CancelledError, ConnectionError):
            return
        finally:
            writer.close()


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[..., Awaitable[tuple[Scripted, str]]]]:
    servers: list[asyncio.Server] = []

    async def serve(behave: Callable[[int], Awaitable[bytes | None]]) -> tuple[Scripted, str]:
        script = Scripted(behave)
        server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return script, f"http://127.0.0.1:{port}"

    yield serve
    for server in servers:
        server.close()
        await server.wait_closed()


def _ok(index: int, close: bool = False) -> bytes:
    body = str(index).encode()
    extra = b"connection: close\r\n" if close else b""
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n%s\r\n%s" % (len(body), extra, body)


async def test_requests_behind_an_answer_that_closes_are_sent_again(scripted) -> None:  # type: ignore[no-untyped-def]
    async def behave(index: int) -> bytes:
        return _ok(index, close=index == 0)

    script, url = await scripted(behave)
    client = FastForwarder(pipeline=8)
    try:
        answers = await asyncio.gather(
            *(client.request("GET", f"{url}/{i}", [], None) for i in range(4))
        )
        assert [a.status for a in answers] == [200] * 4
        # The first on the first connection; the other three again, on a new one.
        assert script.connections == 2
        assert script.seen == 4
    finally:
        await client.close()


async def test_a_late_answer_times_out_every_request_behind_it_unsent_again(scripted) -> None:  # type: ignore[no-untyped-def]
    async def behave(index: int) -> bytes:
        if index == 0:
            await asyncio.sleep(1.0)
        return _ok(index)

    script, url = await scripted(behave)
    client = FastForwarder(pipeline=8, timeouts=Timeouts(total=0.3))
    try:
        results = await asyncio.gather(
            *(client.request("GET", f"{url}/{i}", [], None) for i in range(3)),
            return_exceptions=True,
        )
        assert all(isinstance(r, NodeTimeout) for r in results), results
        await asyncio.sleep(0.1)
        assert script.connections == 1  # sent once: a timeout is never sent again
    finally:
        await client.close()


async def test_a_connection_closed_while_idle_is_retried_once_for_the_whole_batch(scripted) -> None:  # type: ignore[no-untyped-def]
    async def behave(index: int) -> bytes | None:
        # The first request is answered; the connection is then found closed by
        # the server as the next batch arrives (as an idle keep-alive timeout would).
        return _ok(index) if index != 1 else None

    script, url = await scripted(behave)
    client = FastForwarder(pipeline=8)
    try:
        first = await client.request("GET", f"{url}/a", [], None)
        assert first.status == 200
        answers = await asyncio.gather(
            *(client.request("GET", f"{url}/{i}", [], None) for i in range(3))
        )
        assert [a.status for a in answers] == [200] * 3
        assert script.connections == 2
    finally:
        await client.close()


async def test_a_connection_lost_after_some_answers_fails_the_rest_unsent_again(scripted) -> None:  # type: ignore[no-untyped-def]
    async def behave(index: int) -> bytes | None:
        return _ok(index) if index == 0 else None  # answers one, then drops the connection

    script, url = await scripted(behave)
    client = FastForwarder(pipeline=8)
    try:
        results = await asyncio.gather(
            *(client.request("GET", f"{url}/{i}", [], None) for i in range(3)),
            return_exceptions=True,
        )
        assert results[0].status == 200  # type: ignore[union-attr]
        # The node may have processed them: never sent again, and not Unreachable
        # (which the router would route again or fail over): as a timeout.
        assert all(isinstance(r, AnswerLost) for r in results[1:]), results
        assert script.connections == 1
    finally:
        await client.close()


@pytest.mark.parametrize("pipeline", [1, 8])
async def test_a_request_whose_connection_closes_unanswered_is_not_unreachable(  # type: ignore[no-untyped-def]
    scripted, pipeline: int
) -> None:
    """The node reads the request on a fresh connection and closes it without an
    answer (killed as it answered, or its connection cut): the request may have
    been decided and passed to the application, so it is AnswerLost (a kind of
    NodeTimeout: never sent again, never failed over). Before, it was
    Unreachable, which the router answers by sending it to another node (a rule
    that fails open) or to a new owner (a newer view): a POST ran twice."""

    async def behave(index: int) -> bytes | None:
        return None  # read, then close without answering

    script, url = await scripted(behave)
    client = FastForwarder(pipeline=pipeline)
    try:
        with pytest.raises(AnswerLost):
            await client.request("POST", f"{url}/orders", [], b"{}")
        await asyncio.sleep(0.05)
        assert script.seen == 1 and script.connections == 1
    finally:
        await client.close()


async def test_head_requests_are_never_pipelined(scripted) -> None:  # type: ignore[no-untyped-def]
    async def behave(index: int) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n" + (b"" if index == 0 else b"hello")

    _script, url = await scripted(behave)
    client = FastForwarder(pipeline=8)
    try:
        head = await client.request("HEAD", f"{url}/h", [], None)
        assert head.status == 200 and head.body == b""
        get = await client.request("GET", f"{url}/g", [], None)
        assert get.body == b"hello"
    finally:
        await client.close()


def test_the_depth_must_be_at_least_one() -> None:
    with pytest.raises(ValueError):
        FastForwarder(pipeline=0)


def test_up_hands_pipeline_to_its_router(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse
    from pathlib import Path

    from node.config import ClusterConfig
    from router.cli import main
    from router.supervisor import _router_argv

    with pytest.raises(SystemExit) as exit_info:
        main(["up", "--pipeline", "0"])
    assert exit_info.value.code == 2
    assert "must be from 1 (off) to 64" in capsys.readouterr().err
    seen: list[list[str]] = []

    def run_cluster(args: argparse.Namespace, config: ClusterConfig) -> int:
        argv = _router_argv(args, config, "127.0.0.1", Path("cluster.toml"), [])
        seen.append(argv[argv.index("--pipeline") :][:2] if "--pipeline" in argv else [])
        return 0

    monkeypatch.setattr("router.supervisor.run_cluster", run_cluster)
    assert main(["up", "--pipeline", "8"]) == 0
    assert main(["up"]) == 0
    assert seen == [["--pipeline", "8"], []]


async def test_head_answers_with_and_without_pipelining(scripted) -> None:  # type: ignore[no-untyped-def]
    """HEAD answers that announce no body, several at once: each request gets its
    own answer (HEAD goes on connections of its own, never reused)."""

    async def behave(index: int) -> bytes:
        return b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"

    _script, url = await scripted(behave)
    for client in (FastForwarder(pipeline=8), FastForwarder()):
        try:
            answers = await asyncio.gather(
                *(client.request("HEAD", f"{url}/h{i}", [], None) for i in range(3))
            )
            assert [a.status for a in answers] == [200] * 3
        finally:
            await client.close()


async def test_a_request_cancelled_while_its_connection_connects_strands_none_behind_it(
    scripted,  # type: ignore[no-untyped-def]
) -> None:
    """The first request on a new pipelined connection connects it and then writes
    the batch; cancelled meanwhile, the requests that joined it are not left
    unsent until the deadline (nor later ones joining it): they are sent again."""

    async def behave(index: int) -> bytes:
        return _ok(index)

    _script, url = await scripted(behave)
    client = FastForwarder(pipeline=8, timeouts=Timeouts(total=2.0))
    try:
        loop = asyncio.get_running_loop()
        tasks = [
            asyncio.ensure_future(client.request("GET", f"{url}/{i}", [], None)) for i in range(3)
        ]
        await asyncio.sleep(0)  # all three on the one connection, still connecting
        tasks[0].cancel()
        started = loop.time()
        results = await asyncio.wait_for(
            asyncio.gather(*tasks[1:], return_exceptions=True), timeout=5
        )
        assert [getattr(r, "status", r) for r in results] == [200, 200]
        assert loop.time() - started < 1.0  # not held until the 2 s deadline
        later = await asyncio.wait_for(client.request("GET", f"{url}/later", [], None), 1.0)
        assert later.status == 200
    finally:
        await client.close()


@pytest.mark.integration
def test_a_node_flushes_answers_to_a_client_that_never_stops_pipelining(procs: Procs) -> None:  # noqa: F811
    """Postponing a flush past the next pipelined request is bounded: a client that
    keeps its pipeline full still gets answers while it sends (they are not all
    held in memory until it pauses)."""
    import threading
    import time

    _, node = procs.node("n1", None)
    port = int(node.rsplit(":", 1)[1])
    request = b"GET /x HTTP/1.1\r\nhost: n\r\nx-user-id: u1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        stop = time.monotonic() + 2.0

        def send() -> None:
            with contextlib.suppress(OSError):
                while time.monotonic() < stop:
                    sock.sendall(request * 200)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        started = time.monotonic()
        first = sock.recv(1 << 16)
        waited = time.monotonic() - started
        sock.shutdown(socket.SHUT_RDWR)
        sender.join(5)
    assert first.startswith(b"HTTP/1.1 ")
    assert waited < 1.0, waited
