"""RedisBackend with pipelining on, against a real redis-server.

Concurrent checks share pipelined round trips; each keeps its own outcome:
order, partial errors, NOSCRIPT in the middle of a pipeline, timeouts, a
queue behind a failure, and Redis killed while pipelines are in flight.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis

from node.backend import MemoryBackend
from node.clock import FrozenClock
from node.decision import Verdict
from node.lua import CHECK, STANDALONE
from node.redis_backend import BackendUnavailable, RedisBackend
from node.rules import Rule
from node.store import MemoryStore
from tests.redis_server import RedisServer
from tests.test_redis_backend import FAST, blackhole, sync_client

pytestmark = pytest.mark.redis


def test_concurrent_checks_are_decided_in_order_as_one_by_one(redis_url: str) -> None:
    """Coalesced checks decide exactly what the same checks one after another decide."""
    clock = FrozenClock(1_000.0)
    tb = Rule("tb", 10, 60.0)
    gcra = Rule("g", 4, 60.0, "gcra")
    log = Rule("log", 6, 60.0, "sliding_log")
    sets: list[list[Rule]] = [[tb], [gcra], [tb, log], [log], [tb, gcra, log]]
    checks = [(f"u{i % 3}", sets[i % len(sets)], 1 + i % 2) for i in range(60)]

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=clock, ttl_slack=3600.0, pipeline=True, max_batch=7)
        memory = MemoryBackend(MemoryStore(), clock)
        await backend.start()
        try:
            assert backend.pipelined and backend.round_trips is not None
            got = await asyncio.gather(*(backend.check(*c) for c in checks))
            want = [await memory.check(*c) for c in checks]
            assert got == want
            assert any(v.allowed for v in got) and any(not v.allowed for v in got)
            # 60 checks in batches of at most 7: coalesced, and bounded.
            assert backend.round_trips.batches == 9
            # check_many joins the queue as one group, in order.
            clock.advance(5.0)
            assert await backend.check_many(checks) == await memory.check_many(checks)
            assert backend.available
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_an_error_reply_fails_its_check_only(redis_url: str) -> None:
    broken = Rule("z", 3, 60.0, "sliding_log")
    fine = Rule("f", 3, 60.0)

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=FrozenClock(10.0), pipeline=True)
        try:
            with sync_client(redis_url) as client:
                client.set(backend.key("bad", broken), "not a zset")
            results = await asyncio.gather(
                backend.check("a", [fine], 1),
                backend.check("bad", [broken], 1),
                backend.check("b", [fine, broken], 1),
                backend.check("bad", [fine], 1),
                return_exceptions=True,
            )
            assert backend.round_trips is not None and backend.round_trips.batches == 1
            assert isinstance(results[1], redis.ResponseError)
            assert "WRONGTYPE" in str(results[1])
            for verdict in (results[0], results[2], results[3]):
                assert isinstance(verdict, Verdict) and verdict.allowed
            assert backend.available, "a bad call is an error, not an outage"
            # A batch (check_many) fails as a whole, as without pipelining.
            with pytest.raises(redis.ResponseError):
                await backend.check_many([("c", [fine], 1), ("bad", [broken], 1)])
            # ... and what it decided stays decided: "c" consumed one.
            assert (await backend.check("c", [fine], 0)).decision.remaining == 2
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_noscript_in_the_middle_of_a_pipeline(redis_url: str) -> None:
    """Only the calls that got NOSCRIPT run again: nothing is consumed twice."""
    clock = FrozenClock(50.0)
    tb = Rule("tb", 5, 60.0)
    fw = Rule("fw", 5, 60.0, "fixed_window")
    sw = Rule("sw", 5, 60.0, "sliding_window")
    sets: list[list[Rule]] = [[tb], [fw], [tb, sw], [tb], [fw], [tb, sw]]

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=clock, pipeline=True)
        memory = MemoryBackend(MemoryStore(), clock)
        await backend.start()
        try:
            with sync_client(redis_url) as client:
                client.script_flush()
                # Only the token bucket's script is there: calls 0 and 3 run the first
                # time, the fixed window's and the multi-rule ones get NOSCRIPT.
                client.script_load(STANDALONE["token_bucket"].source)
                checks = [("u", rules, 1) for rules in sets]
                got = await asyncio.gather(*(backend.check(*c) for c in checks))
                # The re-run calls are decided after the pipeline they were in
                # (concurrent checks have no order among themselves).
                order = [0, 3, 1, 2, 4, 5]
                want = {i: await memory.check(*checks[i]) for i in order}
                assert got == [want[i] for i in range(len(checks))]
                assert [v.decisions[0].remaining for v in got] == [4, 4, 2, 3, 3, 1]
                assert backend.round_trips is not None and backend.round_trips.batches == 1
                assert client.script_exists(CHECK.sha, STANDALONE["fixed_window"].sha) == [
                    True,
                    True,
                ]
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_a_hung_redis_fails_one_round_trip_per_batch_in_milliseconds() -> None:
    rule = [Rule("r", 1, 1.0)]

    async def scenario(port: int) -> None:
        backend = RedisBackend(
            f"redis://127.0.0.1:{port}/0", clock=FrozenClock(), timeout=0.05, pipeline=True
        )
        try:
            started = time.monotonic()
            results = await asyncio.gather(
                *(backend.check(f"k{i}", rule, 1) for i in range(20)), return_exceptions=True
            )
            assert time.monotonic() - started < FAST
            assert all(isinstance(r, BackendUnavailable) for r in results), results
            assert not backend.available
            for _ in range(2):
                started = time.monotonic()
                with pytest.raises(BackendUnavailable):
                    await backend.check("u", rule, 1)
                assert time.monotonic() - started < FAST
        finally:
            await backend.close()

    with blackhole() as (port, accepted):
        asyncio.run(scenario(port))
        time.sleep(0.2)  # let the accept loop catch up
        # One connection per round trip (20 checks shared one), never retried.
        assert len(accepted) == 3


def test_checks_queued_behind_a_failed_round_trip_fail_at_once() -> None:
    rule = [Rule("r", 1, 1.0)]

    async def scenario(port: int) -> list[Any]:
        backend = RedisBackend(
            f"redis://127.0.0.1:{port}/0", clock=FrozenClock(), timeout=0.1, pipeline=True
        )
        try:
            first = asyncio.create_task(backend.check("first", rule, 1))
            await asyncio.sleep(0.02)  # the first round trip is in flight (and hangs)
            started = time.monotonic()
            queued = await asyncio.gather(
                *(backend.check(f"k{i}", rule, 1) for i in range(10)), return_exceptions=True
            )
            assert time.monotonic() - started < FAST
            with pytest.raises(BackendUnavailable):
                await first
            return queued
        finally:
            await backend.close()

    with blackhole() as (port, accepted):
        queued = asyncio.run(scenario(port))
        time.sleep(0.2)
        assert all(isinstance(r, BackendUnavailable) for r in queued)
        assert all("queued" in str(r) for r in queued)
        assert len(accepted) == 1, "queued checks tried a Redis already found down"


def test_redis_killed_while_pipelines_are_in_flight(redis_server: RedisServer) -> None:
    """Every check answers quickly: a verdict, or BackendUnavailable; then Redis returns."""
    url = redis_server.url
    redis_server.start()
    rule = [Rule("k", 10**6, 60.0)]

    async def scenario() -> None:
        backend = RedisBackend(url, timeout=0.1, pipeline=True, max_batch=32)
        await backend.start()
        assert backend.round_trips is not None
        try:
            # Keep checks coming (200 concurrent clients), kill Redis mid-stream.
            async def client(n: int) -> list[Any]:
                outcomes: list[Any] = []
                for i in range(40):
                    try:
                        outcomes.append(await backend.check(f"c{n}-{i % 5}", rule, 1))
                    except Exception as exc:
                        outcomes.append(exc)
                    await asyncio.sleep(0.001)
                return outcomes

            started = time.monotonic()
            clients = asyncio.gather(*(client(n) for n in range(200)))
            deadline = time.monotonic() + 10.0
            while backend.round_trips.batches < 20:
                assert time.monotonic() < deadline, "no round trips"
                await asyncio.sleep(0.005)
            process = redis_server.process
            assert process is not None
            process.kill()
            killed_at = time.monotonic()
            outcomes = [o for one in await clients for o in one]
            assert time.monotonic() - killed_at < 5.0
            assert time.monotonic() - started < 15.0
            kinds = {type(o) for o in outcomes}
            assert kinds <= {Verdict, BackendUnavailable}, kinds
            assert Verdict in kinds and BackendUnavailable in kinds
            assert all(o.allowed for o in outcomes if isinstance(o, Verdict))
            assert not backend.available

            redis_server.stop()  # reap it
            redis_server.start()
            assert await backend.ping()
            verdict = await backend.check("after", rule, 1)  # NOSCRIPT: loaded again
            assert verdict.allowed and backend.available
        finally:
            await backend.close()

    asyncio.run(scenario())


def test_nodes_pipeline_by_default_and_off_is_the_naive_baseline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from node.redis_backend import FallbackBackend
    from router.cli import _redis_backend, _redis_timeout, build_parser

    def backend_for(*flags: str) -> RedisBackend:
        args = build_parser().parse_args(["node", "--id", "n", "--port", "1", *flags])
        backend = _redis_backend(
            args.redis_url,
            pipeline=args.redis_pipeline == "on",
            timeout=_redis_timeout(args),
            max_keys=args.max_keys,
        )
        assert isinstance(backend, FallbackBackend)
        assert isinstance(backend.primary, RedisBackend)
        return backend.primary

    monkeypatch.delenv("RINGLIMIT_REDIS_PIPELINE", raising=False)
    monkeypatch.delenv("RINGLIMIT_REDIS_TIMEOUT", raising=False)
    assert backend_for("--backend", "redis").pipelined
    assert backend_for("--backend", "redis").timeout == 0.1
    assert backend_for("--backend", "redis").queue_timeout == 1.0
    assert backend_for("--backend", "redis", "--redis-timeout", "0.5").timeout == 0.5
    monkeypatch.setenv("RINGLIMIT_REDIS_TIMEOUT", "2")
    assert backend_for("--backend", "redis").timeout == 2.0
    # A queued check may wait for a call ahead of it: never held to less than that.
    assert backend_for("--backend", "redis").queue_timeout == 4.0
    assert not backend_for("--backend", "redis", "--redis-pipeline", "off").pipelined
    # `ringlimit up` hands the choice to its nodes through the environment.
    monkeypatch.setenv("RINGLIMIT_REDIS_PIPELINE", "off")
    assert not backend_for("--backend", "redis").pipelined
    with pytest.raises(SystemExit):
        build_parser().parse_args(["node", "--id", "n", "--port", "1", "--redis-pipeline", "x"])
