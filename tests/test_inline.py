"""A request started inline (node/inline.py, node/frontdoor.py): answered from
the parser's callback when nothing waits, taken over by a task from where it
suspended when something does, and never without a task where one is needed.

The front door runs on uvicorn's httptools protocol over a transport that
records its writes (tests/test_frontdoor_cycle.py), so "inline" is
observable: the answer is written during ``data_received``, before any
callback that read scheduled has run.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine
from typing import Any

import pytest
import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from node.app import NodeSettings, create_app
from node.clock import FrozenClock
from node.frontdoor import MAX_INLINE_PER_READ, FrontDoor, limited_protocol
from node.inline import INLINE, in_a_task, inline_app, start_inline
from node.peers import Peers
from node.redis_backend import RedisBackend
from node.server import uvicorn_options
from node.shard import Shard
from node.store import MemoryStore
from tests.processes import wait_until
from tests.test_frontdoor_cycle import DEFAULTS, GET, Recorder
from tests.test_shard_core import RULE, config, owned_by
from tests.test_shard_wait import view

OK = {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
#: A request a node serves (the limiter wants a user id).
USER_GET = b"GET /x HTTP/1.1\r\nHost: a\r\nX-User-Id: u1\r\n\r\n"
REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="none")


#: The event loops a node may run on: asyncio's and uvloop's (the server's).
LOOPS = [asyncio.new_event_loop, uvloop.new_event_loop]
LOOP_IDS = ["asyncio", "uvloop"]


def run(scenario: Coroutine[Any, Any, None], loop_factory: Any) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(scenario)


class Served:
    """One front-door connection to ``app`` on a recording transport; ``node``:
    with a node's own protocol (node/server.py: its coalesced writes and its
    keep-alive timer), not the front door alone."""

    def __init__(
        self,
        app: Any,
        *,
        reset_contextvars: bool = False,
        node: bool = False,
        timeout_keep_alive: int = 5,
    ) -> None:
        # (proxy_headers off, as a node runs: uvicorn's middleware would hide the app.)
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="critical",
            proxy_headers=False,
            reset_contextvars=reset_contextvars,
            timeout_keep_alive=timeout_keep_alive,
        )
        config.load()
        self.state = ServerState()
        self.state.default_headers = list(DEFAULTS)
        if node:
            protocol_class = uvicorn_options()["http"]
        else:
            protocol_class = limited_protocol(HttpToolsProtocol, FrontDoor())
        self.protocol = protocol_class(
            config=config, server_state=self.state, app_state={}, _loop=asyncio.get_running_loop()
        )
        self.transport = Recorder()
        self.protocol.connection_made(self.transport)

    async def feed(self, data: bytes) -> None:
        """``data`` read, from a callback of the loop as a socket's read is (no
        current task there); back once that callback ran, before the callbacks
        it scheduled (a task's first step)."""
        asyncio.get_running_loop().call_soon(self.protocol.data_received, data)
        await asyncio.sleep(0)

    async def answered_in_a_task(self, data: bytes) -> bool:
        """Whether the request in ``data`` was answered once the loop ran (by a
        task), and not within its read."""
        before = self.answers()
        await self.feed(data)
        within = self.answers() - before
        await self.settle()
        return within == 0 and self.answers() == before + 1

    def answers(self) -> int:
        return self.transport.out.count(b"HTTP/1.1 ")

    async def settle(self, steps: int = 20) -> None:
        for _ in range(steps):
            await asyncio.sleep(0)

    def close(self) -> None:
        self.protocol.connection_lost(None)


def counting(log: list[str]) -> Any:
    """An app that notes each request's path and answers it at once."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message["body"]
            if not message["more_body"]:
                break
        log.append(scope["path"] + ":" + body.decode())
        await send(OK)
        await send({"type": "http.response.body", "body": b"{}"})

    return app


def test_an_inline_app_is_answered_within_the_read_and_others_after_it() -> None:
    async def scenario() -> None:
        served = Served(inline_app(counting([])))
        await served.feed(GET)
        assert served.answers() == 1  # before any callback of the loop
        assert not served.state.tasks
        plain = Served(counting([]))  # not marked: uvicorn's task, as before
        assert await plain.answered_in_a_task(GET)
        served.close()
        plain.close()

    asyncio.run(scenario())


def test_reset_contextvars_keeps_uvicorns_task() -> None:
    async def scenario() -> None:
        served = Served(inline_app(counting([])), reset_contextvars=True)
        assert await served.answered_in_a_task(GET)
        served.close()

    asyncio.run(scenario())


def test_pipelined_requests_are_answered_in_order_each_once() -> None:
    async def scenario() -> None:
        log: list[str] = []
        served = Served(inline_app(counting(log)))
        await served.feed(b"".join(GET.replace(b"/x", b"/%d" % i) for i in range(5)))
        await served.settle()
        assert log == [f"/{i}:" for i in range(5)]
        assert served.answers() == 5
        served.close()

    asyncio.run(scenario())


def closing(log: list[str]) -> Any:
    """An app that notes each request's path and answers it closing the connection."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        log.append(scope["path"])
        headers = [(b"content-length", b"2"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"{}"})

    return app


@pytest.mark.parametrize(
    "behind",
    [GET.replace(b"/x", b"/y"), b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nab"],
    ids=["whole", "body to come"],
)
def test_nothing_behind_an_answer_that_closed_the_connection_is_served(behind: bytes) -> None:
    """An answer that closes the connection (the app said so) is written during
    the read now, before the request behind it is parsed: that request must not
    reach the app (it never did, when it waited in uvicorn's pipeline), whether
    it is whole (it would start inline) or its body is still to come (it would
    start in a task at the end of the read)."""

    async def scenario() -> None:
        log: list[str] = []
        served = Served(inline_app(closing(log)))
        await served.feed(GET + behind)
        await served.settle()
        assert log == ["/x"]
        assert served.answers() == 1
        assert served.transport.closed
        assert not served.state.tasks
        served.close()

    asyncio.run(scenario())


def test_a_read_starts_at_most_its_share_inline_and_the_rest_in_turn() -> None:
    """Thousands of requests pipelined in one read do not hold the loop for all of
    them at once: MAX_INLINE_PER_READ are served inline, the others one per loop
    step, as uvicorn serves a pipeline; every one is answered, in order."""

    async def scenario() -> None:
        log: list[str] = []
        served = Served(inline_app(counting(log)))
        count = MAX_INLINE_PER_READ + 36
        await served.feed(b"".join(GET.replace(b"/x", b"/%d" % i) for i in range(count)))
        assert served.answers() == MAX_INLINE_PER_READ
        await served.settle(3 * count)
        assert log == [f"/{i}:" for i in range(count)]
        assert served.answers() == count
        served.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("node", [False, True], ids=["uvicorn's timer", "a node's timer"])
def test_a_request_behind_an_inline_answer_is_not_idle_to_the_keep_alive_timer(
    node: bool,
) -> None:
    """An answer written inline arms uvicorn's keep-alive timer, or marks the
    connection idle for a node's (node/keepalive.py), in the middle of a read.
    A slow request behind it in that read is being served, not idle: the timer
    (0 s here) must not close its connection however long it takes. Idle after
    its answer, the connection closes."""

    async def scenario() -> None:
        gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["path"] == "/slow":
                await gate
            await send(OK)
            await send({"type": "http.response.body", "body": b"{}"})

        served = Served(inline_app(app), node=node, timeout_keep_alive=0)
        await served.feed(GET + GET.replace(b"/x", b"/slow"))
        await served.settle()
        assert served.answers() == 1
        assert len(served.state.tasks) == 1
        assert not served.transport.closed
        gate.set_result(None)
        await served.settle()
        assert served.answers() == 2
        assert served.transport.closed
        served.close()

    asyncio.run(scenario())


def test_a_nodes_connection_keeps_one_keep_alive_timer_across_its_answers() -> None:
    """uvicorn arms a keep-alive timer as each answer ends and cancels it as the
    next read begins: a timer made and dropped per request. A node's protocol
    keeps one per connection (node/keepalive.py), as the router's does."""

    async def scenario() -> None:
        served = Served(inline_app(counting([])), node=True)
        await served.feed(GET)
        await served.settle()
        timer = served.protocol.timeout_keep_alive_task
        assert timer is not None
        for _ in range(3):
            await served.feed(GET)
            await served.settle()
        assert served.answers() == 4
        assert served.protocol.timeout_keep_alive_task is timer
        served.close()
        assert timer.cancelled()

    asyncio.run(scenario())


def test_a_body_in_a_later_read_starts_a_task_at_the_end_of_the_first() -> None:
    async def scenario() -> None:
        log: list[str] = []
        served = Served(inline_app(counting(log)))
        head = b"POST /p HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\n"
        await served.feed(head + b"ab")
        assert len(served.state.tasks) == 1  # its task, as uvicorn starts it
        await served.settle()
        assert log == []  # waiting for the rest of its body
        await served.feed(b"cd")
        await served.settle()
        assert log == ["/p:abcd"]
        # A body whole in the read is served inline, body and all.
        await served.feed(head + b"wxyz")
        assert log == ["/p:abcd", "/p:wxyz"]
        assert served.answers() == 2
        served.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("loop_factory", LOOPS, ids=LOOP_IDS)
def test_a_request_that_waits_goes_on_in_a_task_from_where_it_stopped(loop_factory: Any) -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[str] = loop.create_future()
        seen: list[Any] = []

        async def waiting(scope: dict[str, Any], receive: Any, send: Any) -> None:
            REQUEST_ID.set("r1")
            seen.append(asyncio.current_task())
            seen.append(await gate)
            seen.append((asyncio.current_task(), REQUEST_ID.get()))
            await send(OK)
            await send({"type": "http.response.body", "body": b"{}"})

        served = Served(inline_app(waiting))
        await served.feed(GET)
        assert seen == [None]  # begun inline
        (task,) = served.state.tasks
        await served.settle()
        assert seen == [None]  # its task waits on what it waited on
        gate.set_result("opened")
        await served.settle()
        assert seen[1:] == ["opened", (task, "r1")]  # the same context, in the task
        assert served.answers() == 1
        assert not served.state.tasks
        assert REQUEST_ID.get() == "none"  # nothing leaked into the server's context
        served.close()

    run(scenario(), loop_factory)


def test_in_a_task_moves_the_request_into_its_task_first() -> None:
    async def scenario() -> None:
        seen: list[Any] = []

        async def needs_a_task(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append(asyncio.current_task())
            await in_a_task()
            seen.append(asyncio.current_task())
            async with asyncio.timeout(1):  # raises without a current task
                await send(OK)
                await send({"type": "http.response.body", "body": b"{}"})

        served = Served(inline_app(needs_a_task))
        await served.feed(GET)
        assert seen[0] is None
        assert served.answers() == 0
        await served.settle()
        assert seen[1] is not None
        assert served.answers() == 1
        assert served.transport.out.count(b" 200 OK") == 1
        served.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("loop_factory", LOOPS, ids=LOOP_IDS)
@pytest.mark.parametrize("started", [False, True])
def test_a_taken_over_request_is_cancelled_as_a_task_is(started: bool, loop_factory: Any) -> None:
    """uvicorn's graceful shutdown cancels what is in its tasks when it runs out of
    time: the cancellation reaches the request where it waits, and what it waits
    on is cancelled, whether or not its task has taken its first step."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        seen: list[str] = []
        waited_on: asyncio.Future[None] = loop.create_future()

        async def forever(scope: dict[str, Any], receive: Any, send: Any) -> None:
            try:
                await waited_on
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise

        served = Served(inline_app(forever))
        await served.feed(GET)
        (task,) = served.state.tasks
        if started:
            await served.settle()
        task.cancel()
        await served.settle()
        assert seen == ["cancelled"]
        assert waited_on.cancelled()
        assert task.done()  # (uvicorn's run_asgi answers a cancelled app 500, as ever)
        assert b" 500 Internal Server Error" in served.transport.out
        served.close()

    run(scenario(), loop_factory)


def test_an_exception_into_a_waiting_request_reaches_it() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[str] = loop.create_future()
        seen: list[str] = []

        async def failing_wait(scope: dict[str, Any], receive: Any, send: Any) -> None:
            try:
                await gate
            except LookupError as exc:
                seen.append(str(exc))
            await send(OK)
            await send({"type": "http.response.body", "body": b"{}"})

        served = Served(inline_app(failing_wait))
        await served.feed(GET)
        gate.set_exception(LookupError("gone"))
        await served.settle()
        assert seen == ["gone"]
        assert served.answers() == 1
        served.close()

    asyncio.run(scenario())


def test_start_inline_runs_to_the_end_without_a_task() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()
        done: list[str] = []

        async def quick() -> None:
            done.append("done")

        start_inline(loop, quick(), tasks)
        assert done == ["done"]
        assert not tasks

    asyncio.run(scenario())


def test_start_inline_logs_what_the_coroutine_itself_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """run_asgi answers an app's failure itself; should it raise anyway, the read
    goes on (the parser is not handed the exception) and the log says so."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        tasks: set[asyncio.Task[None]] = set()

        async def broken() -> None:
            raise ValueError("run_asgi's own")

        ran = loop.create_future()
        loop.call_soon(lambda: (start_inline(loop, broken(), tasks), ran.set_result(None)))
        await asyncio.wait_for(ran, 5)
        assert not tasks

    with caplog.at_level("ERROR", logger="ringlimit.node"):
        asyncio.run(scenario())
    assert "serving a request failed" in caplog.text
    assert "run_asgi's own" in caplog.text


def test_a_node_deciding_in_memory_is_started_inline_and_its_app_in_a_task() -> None:
    """A node's hot path starts inline; an application it fronts but does not know
    (here one that needs a task, as aiohttp and httpx do) and its control API run
    in a task."""

    async def scenario() -> None:
        seen: list[Any] = []

        async def foreign(scope: dict[str, Any], receive: Any, send: Any) -> None:
            seen.append(asyncio.current_task())
            async with asyncio.timeout(1):
                await send(OK)
                await send({"type": "http.response.body", "body": b"{}"})

        settings = NodeSettings(node_id="n1")
        node = create_app(settings, app=foreign)
        assert getattr(node, INLINE, False)
        served = Served(node)
        await served.feed(USER_GET)
        await served.settle()
        assert seen and seen[0] is not None
        assert served.transport.out.count(b" 200 OK") == 1
        # The echo app (the default) is the node's own: answered inline.
        echo = Served(create_app(settings))
        await echo.feed(USER_GET)
        assert echo.answers() == 1
        # Its control API (Starlette) is not.
        assert await echo.answered_in_a_task(b"GET /healthz HTTP/1.1\r\nHost: a\r\n\r\n")
        served.close()
        echo.close()

    asyncio.run(scenario())


def test_a_node_on_redis_is_not_started_inline() -> None:
    # (Its client is never used here: redis-py connects on the first command.)
    backend = RedisBackend("redis://127.0.0.1:1/0")
    node = create_app(NodeSettings(node_id="n1"), backend=backend)
    assert not getattr(node, INLINE, False)


@pytest.mark.parametrize("marked", [False, True])
def test_a_failing_app_gets_uvicorns_500_inline_or_not(marked: bool) -> None:
    async def scenario() -> bytes:
        async def broken(scope: dict[str, Any], receive: Any, send: Any) -> None:
            raise RuntimeError("boom")

        served = Served(inline_app(broken) if marked else broken)
        await served.feed(GET)
        await served.settle()
        served.close()
        return served.transport.out

    assert b"500 Internal Server Error" in asyncio.run(scenario())


def test_a_pull_asked_by_a_request_started_inline_is_made_from_its_task() -> None:
    """A key whose state is still on its way to this node is pulled from the
    member that had it (node/shard.py ``Shard.admit``) over httpx, which needs a
    current task: the request goes into its task first. (Here that member's
    port is refused, so the pull fails and the request is admitted once its
    deadline passes, as in tests/test_shard_wait.py.)"""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        timer = FrozenClock(0.0)
        fixed = config()
        peers = Peers()
        shard = Shard("n1", MemoryStore(), FrozenClock(), peers, lambda: fixed, timer=timer)
        v1, v2 = view(["n0", "n2"], 1), view(["n0", "n1", "n2"], 2)
        shard.apply(v2, v1)
        pulled = next(k for k in owned_by(v2, "n1") if v1.owner_id(k) == "n2")
        admitted: asyncio.Future[bool] = loop.create_future()

        async def request() -> None:
            try:
                admitted.set_result(await shard.admit(pulled, (RULE,)))
            except Exception as exc:
                admitted.set_exception(exc)

        tasks: set[asyncio.Task[None]] = set()
        loop.call_soon(start_inline, loop, request(), tasks)
        try:
            await wait_until(lambda: shard.core.stats.pulls == 1, 5)
            await asyncio.sleep(0.01)  # (refused: retried until its deadline)
            timer.advance(shard.handoff_wait + 1.0)
            assert await asyncio.wait_for(admitted, 5) is True
            assert shard.core.stats.pull_failures == 1
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await shard.close()
            await peers.close()

    asyncio.run(scenario())
