"""RedisBackend and FallbackBackend against a real redis-server.

The tests are synchronous and drive each scenario with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot
from redis.exceptions import ClusterCrossSlotError

from node.algorithms import decide
from node.backend import MemoryBackend
from node.clock import Clock, FrozenClock, system_clock
from node.decision import BACKEND_ERROR, BACKEND_UNAVAILABLE, COST_EXCEEDS_CAPACITY, Verdict
from node.lua import CHECK, SCRIPTS
from node.redis_backend import (
    ALGORITHM_CODES,
    BackendUnavailable,
    FallbackBackend,
    RedisBackend,
    hash_tag,
    state_key,
)
from node.rules import ALGORITHMS, Rule
from node.store import MemoryStore
from tests.redis_server import RedisServer, find_redis_server, free_port

pytestmark = pytest.mark.redis

#: Whatever Redis does, one call must answer within this (timeouts are 100 ms).
FAST = 0.5


@pytest.fixture(params=[False, True], ids=["one-by-one", "pipelined"])
def pipeline(request: pytest.FixtureRequest) -> bool:
    """Tests that hold with and without coalesced pipelining run in both modes."""
    return bool(request.param)


def run(scenario: Callable[[], Coroutine[Any, Any, Any]]) -> Any:
    return asyncio.run(scenario())


def sync_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5.0)


@contextlib.contextmanager
def blackhole() -> Iterator[tuple[int, list[Any]]]:
    """A TCP port that accepts connections and never answers (a hung Redis).

    Yields the port and the list of accepted connections (one per attempt).
    """
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.05)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                accepted.append(server.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        server.close()


# --------------------------------------------------------------------------- deciding


def test_checks_match_the_memory_backend(redis_url: str, pipeline: bool) -> None:
    clock = FrozenClock(1_700_000_000.25)
    rules = [Rule(f"r{i}", 3, 10.0, alg, burst=4) for i, alg in enumerate(ALGORITHMS)]
    sets = [rules[:1], rules[1:2], rules[2:3], rules[3:4], rules[4:5], rules, rules[1:4]]

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=clock, ttl_slack=3600.0, pipeline=pipeline)
        memory = MemoryBackend(MemoryStore(), clock)
        await backend.start()
        try:
            assert backend.name == "redis"
            for step in range(40):
                rule_set = sets[step % len(sets)]
                cost = (0, 1, 2, 1, 5)[step % 5]
                for user in ("alice", "bob{x}"):
                    got = await backend.check(user, rule_set, cost)
                    want = await memory.check(user, rule_set, cost)
                    assert got == want, (step, user)
                clock.advance(0.7)
            assert backend.available
        finally:
            await backend.close()

    run(scenario)


def test_check_many_pipelines_and_matches(redis_url: str, pipeline: bool) -> None:
    clock = FrozenClock(5_000.0)
    a = Rule("a", 2, 60.0, "sliding_log")
    b = Rule("b", 5, 60.0, "gcra")
    batch = [("u1", [a], 1), ("u2", [a, b], 1), ("u1", [a], 1), ("u1", [a, b], 1), ("u3", [b], 9)]

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=clock, ttl_slack=3600.0, pipeline=pipeline)
        memory = MemoryBackend(MemoryStore(), clock)
        try:
            assert await backend.check_many([]) == []
            for _ in range(3):
                got = await backend.check_many(batch)
                assert got == await memory.check_many(batch)
                clock.advance(1.0)
            assert got[4].decision.reason == COST_EXCEEDS_CAPACITY
        finally:
            await backend.close()

    run(scenario)


def test_reloads_scripts_after_noscript(redis_url: str, pipeline: bool) -> None:
    clock = FrozenClock(100.0)
    single = [Rule("one", 5, 60.0)]
    multi = [Rule("x", 5, 60.0, "fixed_window"), Rule("y", 5, 60.0, "sliding_window")]

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=clock, pipeline=pipeline)
        await backend.start()
        try:
            with sync_client(redis_url) as client:
                assert all(client.script_exists(*[s.sha for s in SCRIPTS.values()]))
                client.script_flush()
                assert (await backend.check("u", single, 1)).decision.remaining == 4
                assert (await backend.check("u", multi, 1)).decision.remaining == 4
                client.script_flush()
                verdicts = await backend.check_many([("u", single, 1), ("u", multi, 1)])
                assert [v.decision.remaining for v in verdicts] == [3, 3]
                assert client.script_exists(CHECK.sha) == [True]
        finally:
            await backend.close()

    run(scenario)


def test_redis_time_mode(redis_url: str) -> None:
    rules = [Rule(f"m{i}", 3, 60.0, alg) for i, alg in enumerate(ALGORITHMS)]
    unaligned = [r for r in rules if r.algorithm in ("token_bucket", "gcra", "sliding_log")]

    async def scenario() -> None:
        backend = RedisBackend(redis_url)  # no clock: Redis TIME
        try:
            for rule in unaligned:
                verdicts = [await backend.check("u", [rule], 1) for _ in range(4)]
                assert [v.allowed for v in verdicts] == [True, True, True, False], rule
                assert [v.decision.remaining for v in verdicts] == [2, 1, 0, 0], rule
                assert 0.0 < verdicts[2].decision.reset_after <= 60.0
                retry = verdicts[3].decision.retry_after
                assert retry is not None and 0.0 < retry <= 60.0
                if rule.algorithm != "sliding_log":
                    assert retry == pytest.approx(20.0, abs=1.0)
            # Windows are aligned to the minute, so at most one boundary can pass here.
            for rule in rules:
                if rule in unaligned:
                    continue
                allowed = [(await backend.check("w", [rule], 1)).allowed for _ in range(4)]
                assert allowed.count(True) in (3, 4), rule
            with sync_client(redis_url) as client:
                ttl = client.pttl(state_key("rl", "u", unaligned[0]))
                assert 0 < ttl <= 60_000
        finally:
            await backend.close()

    run(scenario)


# --------------------------------------------------------------------------- TTLs


def test_keys_expire_when_fresh_and_come_back_fresh(redis_url: str) -> None:
    clock = FrozenClock(2_000_000.0)
    rules = [Rule(f"e{i}", 2, 0.3, alg) for i, alg in enumerate(ALGORITHMS)]

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=clock)
        try:
            with sync_client(redis_url) as client:
                keys = [backend.key("u", rule) for rule in rules]
                assert (await backend.check("u", rules, 2)).allowed
                assert all(client.exists(k) for k in keys)
                ttls = [client.pttl(k) for k in keys]
                # fresh_at - now: buckets and log 0.3 s; the windows end on the
                # period's grid, the sliding one a period later (up to 0.6 s).
                assert all(0 < t <= 600 for t in ttls), ttls
                assert max(ttls) > 300

                # Denials and peeks never extend a TTL or change a state.
                values = [client.dump(k) for k in keys]
                clock.advance(0.01)
                assert not (await backend.check("u", rules, 1)).allowed
                assert not (await backend.check("u", rules, 0)).allowed
                assert [client.dump(k) for k in keys] == values
                assert all(client.pttl(k) <= t for k, t in zip(keys, ttls, strict=True))

                deadline = time.monotonic() + 3.0
                while any(client.exists(k) for k in keys):
                    assert time.monotonic() < deadline, "keys outlived their TTL"
                    await asyncio.sleep(0.05)
            # Same injected time: only Redis's expiry made the states fresh.
            verdict = await backend.check("u", rules, 1)
            fresh = [decide(None, clock(), rule, 1)[1] for rule in rules]
            assert list(verdict.decisions) == fresh
        finally:
            await backend.close()

    run(scenario)


#: A rule tightened at runtime (same name and algorithm): a lower rate with the same
#: burst, or a longer period. A state written before is fresh again later under it
#: (not GCRA's: its state, tat, is the time it is fresh again, whatever the rule).
TIGHTENED = {
    "token_bucket": (Rule("t", 100, 0.6, burst=100), Rule("t", 10, 0.6, burst=100)),
    "fixed_window": (Rule("t", 5, 0.6, "fixed_window"), Rule("t", 5, 6.0, "fixed_window")),
    "sliding_log": (Rule("t", 5, 0.6, "sliding_log"), Rule("t", 5, 6.0, "sliding_log")),
    "sliding_window": (Rule("t", 5, 0.6, "sliding_window"), Rule("t", 5, 6.0, "sliding_window")),
}


@pytest.mark.parametrize("algorithm", sorted(TIGHTENED))
def test_a_denied_user_keeps_its_state_after_the_rule_is_tightened(
    redis_url: str, algorithm: str
) -> None:
    """A key's TTL ended at fresh_at under the rule of its last write. Denials write
    nothing, so after the rule was tightened at runtime a user denied under it kept
    the old TTL, and Redis dropped a state that still mattered: a full quota once
    the old rule would have refilled (before: the token bucket showed 100 remaining
    where the engine shows 16, the log and windows 5 where it shows 0). A check that
    writes nothing now stretches the TTL to the state's fresh_at under the rule in
    force (its reset_after), never shortens it."""
    before, after = TIGHTENED[algorithm]
    clock = FrozenClock(1_000_000.0)

    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=clock)
        memory = MemoryBackend(MemoryStore(), clock)
        try:
            for rule, cost in ((before, before.capacity), (after, 1)):
                assert await backend.check("u", [rule], cost) == await memory.check(
                    "u", [rule], cost
                )
                clock.advance(0.01)
            assert not (await memory.check("u", [after], 1)).allowed
            # Past every TTL the old rule gave; injected time moves as much.
            await asyncio.sleep(1.0)
            clock.advance(1.0)
            assert await backend.check("u", [after], 0) == await memory.check("u", [after], 0)
        finally:
            await backend.close()

    run(scenario)


# --------------------------------------------------------------------------- keys


def redis_tag(key: str) -> str:
    """The hash tag Redis Cluster hashes: between the first '{' and the next '}'."""
    start = key.index("{")
    end = key.index("}", start + 1)
    return key[start + 1 : end]


def test_keys_of_one_user_share_one_hash_tag() -> None:
    rules = [Rule(f"r{i}", 3, 60.0, alg) for i, alg in enumerate(ALGORITHMS)]
    users = ["alice", "a}b", "{alice}", "x}:r0:tb", "%7D", "", "%", "}{", "ünï{}"]
    seen: dict[str, str] = {}
    for user in users:
        keys = [state_key("rl", user, rule) for rule in rules]
        tags = {redis_tag(k) for k in keys}
        assert tags == {hash_tag(user)}, user
        assert len({key_slot(k.encode()) for k in keys}) == 1, user
        assert "}" not in hash_tag(user) and hash_tag(user), user
        for key in keys:
            assert key not in seen, (user, seen.get(key))
            seen[key] = user
    assert state_key("rl", "alice", rules[0]) == "rl:{alice}:r0:tb"
    # A user cannot pick another user's tag by writing braces into its key.
    assert hash_tag("alice}") != hash_tag("alice")
    assert redis_tag(state_key("rl", "alice}:r0:tb", rules[0])) == "alice%7D:r0:tb"
    assert set(ALGORITHM_CODES) == set(ALGORITHMS)
    with pytest.raises(ValueError, match="braces"):
        RedisBackend("redis://127.0.0.1:1/0", prefix="r{l}")


def test_multi_rule_scripts_run_on_a_cluster_node(redis_cluster_server: RedisServer) -> None:
    rules = [Rule(f"r{i}", 3, 60.0, alg) for i, alg in enumerate(ALGORITHMS)]

    async def scenario() -> None:
        backend = RedisBackend(redis_cluster_server.url, clock=FrozenClock(10.0))
        try:
            for user in ("alice", "a}b", "{x}", ""):
                assert (await backend.check(user, rules, 1)).allowed, user
        finally:
            await backend.close()

    run(scenario)
    # The control: keys of two users in one call are refused, as on any cluster.
    with redis_cluster_server.client() as client:
        keys = [state_key("rl", "alice", rules[0]), state_key("rl", "bob", rules[0])]
        assert key_slot(keys[0].encode()) != key_slot(keys[1].encode())
        with pytest.raises(ClusterCrossSlotError):
            client.eval("return 1", 2, *keys)


# --------------------------------------------------------------------------- failures


def test_unreachable_redis_fails_fast(pipeline: bool) -> None:
    port = free_port()  # nothing listens there

    async def scenario() -> None:
        backend = RedisBackend(
            f"redis://127.0.0.1:{port}/0", clock=FrozenClock(), pipeline=pipeline
        )
        try:
            await backend.start()  # reports, does not raise
            assert not backend.available
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(BackendUnavailable):
                    await backend.check("u", [Rule("r", 1, 1.0)], 1)
                with pytest.raises(BackendUnavailable):
                    await backend.check_many([("u", [Rule("r", 1, 1.0)], 1)])
                assert time.monotonic() - started < FAST
            assert await backend.ping() is False
        finally:
            await backend.close()

    run(scenario)


def test_hung_redis_times_out_in_milliseconds() -> None:
    async def scenario(port: int) -> None:
        backend = RedisBackend(f"redis://127.0.0.1:{port}/0", clock=FrozenClock(), timeout=0.05)
        try:
            for _ in range(3):
                started = time.monotonic()
                with pytest.raises(BackendUnavailable):
                    await backend.check("u", [Rule("r", 1, 1.0)], 1)
                assert time.monotonic() - started < FAST
            assert not backend.available
        finally:
            await backend.close()

    with blackhole() as (port, accepted):
        asyncio.run(scenario(port))
        time.sleep(0.2)  # let the accept loop catch up
        # One connection per call: a timeout is never retried.
        assert len(accepted) == 3


def test_idle_connections_the_server_closed_are_no_outage(redis_url: str, pipeline: bool) -> None:
    """Redis's ``timeout`` setting, a proxy or a NAT closes idle connections. The pool
    must open new ones, not hand out the closed ones: with redis-py 8 (RESP3, where
    maintenance notifications default to "auto") its check of a pooled connection
    was skipped, and every check after an idle spell failed with "Connection closed
    by server" (before: 10 of 10 BackendUnavailable after each kill), so the node
    fell back to local limits for a probe interval."""
    rule = [Rule("r", 1000, 60.0)]

    async def scenario() -> None:
        backend = RedisBackend(redis_url, pipeline=pipeline, max_connections=4)
        await backend.start()
        try:
            with sync_client(redis_url) as client:
                for _ in range(3):
                    killed = client.client_kill_filter(_type="normal", skipme=True)
                    assert killed >= 1  # the pool's warm connections
                    await asyncio.sleep(0.05)  # the loop sees them closed
                    outcomes = await asyncio.gather(
                        *(backend.check(f"k{i}", rule, 1) for i in range(10)),
                        return_exceptions=True,
                    )
                    assert all(isinstance(o, Verdict) for o in outcomes), outcomes
            assert backend.available
        finally:
            await backend.close()

    run(scenario)


def test_a_burst_on_a_healthy_redis_is_no_outage(redis_url: str, pipeline: bool) -> None:
    """More concurrent checks than connections queue up; they are not failures."""
    rule = [Rule("burst", 10**6, 60.0)]

    async def scenario() -> None:
        # A generous queue bound: 1000 checks through 8 connections take far longer
        # than the 100 ms that a wait held to the Redis timeout would allow.
        backend = RedisBackend(redis_url, max_connections=8, queue_timeout=10.0, pipeline=pipeline)
        with sync_client(redis_url) as client:
            before = client.info("clients")["connected_clients"]
            await backend.start()
            # start() opened the connections checks use, so a first burst need not:
            # every call slot's, or (pipelined) the one round trip's in flight.
            opened = client.info("clients")["connected_clients"] - before
            assert opened == (1 if pipeline else 8)
        try:
            checks = (backend.check(f"k{i}", rule, 1) for i in range(1000))
            verdicts = await asyncio.gather(*checks)
            assert all(v.allowed for v in verdicts)
            assert backend.available
        finally:
            await backend.close()

    # The premise is a healthy Redis: a reply that itself took longer than the
    # backend's 100 ms timeout (a loaded CI machine stalled it: seen once) is
    # an outage by the backend's own definition, not a queued check counted as
    # one. The queue's failures (BackendUnavailable from None) fail at once.
    for attempt in range(3):
        try:
            run(scenario)
            return
        except BackendUnavailable as exc:
            if not isinstance(exc.__cause__, redis.exceptions.TimeoutError) or attempt == 2:
                raise


def test_calls_queued_behind_a_failure_fail_at_once() -> None:
    async def scenario(port: int) -> list[Any]:
        backend = RedisBackend(
            f"redis://127.0.0.1:{port}/0", clock=FrozenClock(), timeout=0.05, max_connections=2
        )
        try:
            started = time.monotonic()
            results = await asyncio.gather(
                *(backend.check(f"k{i}", [Rule("r", 1, 1.0)], 1) for i in range(20)),
                return_exceptions=True,
            )
            assert time.monotonic() - started < FAST
            return results
        finally:
            await backend.close()

    with blackhole() as (port, accepted):
        results = asyncio.run(scenario(port))
        time.sleep(0.2)
        assert all(isinstance(r, BackendUnavailable) for r in results)
        # Only the two calls in flight tried Redis; the 18 queued ones did not pile on.
        assert len(accepted) == 2
        assert sum("queued" in str(r) for r in results) == 18


def test_the_queue_wait_is_bounded(pipeline: bool) -> None:
    """A check waits at most ``queue_timeout`` behind a round trip that hangs (one
    connection busy, or the pipeline's one round trip in flight)."""

    async def scenario(port: int) -> None:
        backend = RedisBackend(
            f"redis://127.0.0.1:{port}/0",
            clock=FrozenClock(),
            timeout=0.3,
            max_connections=1,
            queue_timeout=0.05,
            pipeline=pipeline,
        )
        try:
            first = asyncio.create_task(backend.check("a", [Rule("r", 1, 1.0)], 1))
            await asyncio.sleep(0.01)
            started = time.monotonic()
            with pytest.raises(BackendUnavailable, match="overloaded"):
                await backend.check("b", [Rule("r", 1, 1.0)], 1)
            assert time.monotonic() - started < 0.25
            with pytest.raises(BackendUnavailable):
                await first
        finally:
            await backend.close()

    with blackhole() as (port, _accepted):
        asyncio.run(scenario(port))


def test_bad_calls_are_errors_not_outages(redis_url: str, pipeline: bool) -> None:
    async def scenario() -> None:
        backend = RedisBackend(redis_url, clock=FrozenClock(), pipeline=pipeline)
        try:
            with pytest.raises(ValueError, match="cost"):
                await backend.check("u", [Rule("r", 1, 1.0)], -1)
            with pytest.raises(ValueError, match="rule"):
                await backend.check("u", [], 1)
            with sync_client(redis_url) as client:
                client.set(backend.key("u", Rule("z", 1, 1.0, "sliding_log")), "not a zset")
            with pytest.raises(redis.ResponseError):
                await backend.check("u", [Rule("z", 1, 1.0, "sliding_log")], 1)
            assert backend.available
        finally:
            await backend.close()

    run(scenario)


@pytest.mark.parametrize("refusal", ["MISCONF", "NOREPLICAS"])
def test_a_redis_refusing_writes_is_unavailable(tmp_path: Path, refusal: str) -> None:
    """A Redis that refuses every write, as a replica does with READONLY, cannot
    decide now, and each rule's on_error must: MISCONF (its RDB snapshot failed, a
    full disk) and NOREPLICAS (fewer replicas than min-replicas-to-write) were plain
    errors (before: every check raised ResponseError, a 500, in both modes, open and
    closed rules alike)."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server is not installed")
    gone = tmp_path / "gone"
    gone.mkdir()
    (tmp_path / "redis").mkdir()
    extra = {
        # Snapshots go to a directory removed once the server runs: BGSAVE fails.
        "MISCONF": ["--dir", str(gone), "--save", "3600 1"],
        "NOREPLICAS": ["--min-replicas-to-write", "1"],
    }[refusal]
    server = RedisServer(binary, tmp_path / "redis", extra_args=extra)
    server.start()
    try:
        with server.client() as client:
            if refusal == "MISCONF":
                gone.rmdir()
                client.bgsave()
                deadline = time.monotonic() + 10.0
                while client.info("persistence")["rdb_last_bgsave_status"] != "err":
                    assert time.monotonic() < deadline, "BGSAVE did not fail"
                    time.sleep(0.02)
            with pytest.raises(redis.ResponseError, match=f"^{refusal}"):
                client.set("x", "1")
        rules = [Rule("open", 3, 60.0), Rule("shut", 3, 60.0, on_error="closed")]

        async def scenario() -> None:
            for pipelined in (False, True):
                backend = RedisBackend(server.url, pipeline=pipelined)
                await backend.start()
                try:
                    with pytest.raises(BackendUnavailable, match=refusal):
                        await backend.check("u", rules[:1], 1)
                    assert not backend.available
                finally:
                    await backend.close()
            fallback = FallbackBackend(
                RedisBackend(server.url, pipeline=True),
                MemoryBackend(MemoryStore(), system_clock),
                probe_interval=0.05,
            )
            await fallback.start()
            try:
                verdict = await fallback.check("u", rules[:1], 1)
                assert verdict.allowed and verdict.decision.reason == BACKEND_UNAVAILABLE
                verdict = await fallback.check("u", rules, 1)
                assert not verdict.allowed and verdict.decision.rule == "shut"
                # Its probes must not take it for back: PING answers, writes do not.
                # (On PING alone it switched back each probe and down at the next
                # check, logging both, for as long as the refusal lasted.)
                for _ in range(6):
                    await asyncio.sleep(0.05)
                    assert not fallback._up
            finally:
                await fallback.close()

        run(scenario)
    finally:
        with contextlib.suppress(redis.RedisError), server.client() as client:
            client.config_set("save", "")  # else SIGTERM's final save fails: no exit
        server.stop()


def test_fallback_degrades_and_recovers(
    redis_server: RedisServer, redis_url: str, caplog: pytest.LogCaptureFixture, pipeline: bool
) -> None:
    caplog.set_level(logging.INFO, logger="ringlimit.redis")
    opened = Rule("open", 3, 60.0, "token_bucket", on_error="open")
    closed = Rule("closed", 100, 60.0, "fixed_window", on_error="closed")

    async def timed(call: Awaitable[Any]) -> Any:
        started = time.monotonic()
        result = await call
        assert time.monotonic() - started < FAST, "a check took too long while Redis was down"
        return result

    async def scenario() -> None:
        primary = RedisBackend(redis_url, timeout=0.1, pipeline=pipeline)
        local = MemoryBackend(MemoryStore(), system_clock)
        backend = FallbackBackend(primary, local, probe_interval=0.1)
        calls = 0
        real_check, real_check_many = primary.check, primary.check_many

        async def counting_check(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            return await real_check(*args)

        async def counting_check_many(*args: Any) -> Any:
            nonlocal calls
            calls += 1
            return await real_check_many(*args)

        primary.check = counting_check  # type: ignore[method-assign,assignment]
        primary.check_many = counting_check_many  # type: ignore[method-assign,assignment]
        await backend.start()
        try:
            verdict = await backend.check("u", [opened], 1)
            assert verdict.allowed and verdict.decision.reason is None
            assert backend.available and backend.fallbacks == 0

            redis_server.stop()
            got = [await timed(backend.check("u", [opened], 1)) for _ in range(5)]
            assert not backend.available
            calls_when_down = calls
            # Still limited, by the local in-memory limiter (it starts fresh).
            assert [v.allowed for v in got] == [True, True, True, False, False]
            assert {d.reason for v in got for d in v.decisions} == {BACKEND_UNAVAILABLE}
            assert got[3].decision.retry_after == pytest.approx(20.0, abs=1.0)

            denied = await timed(backend.check("u", [closed], 1))
            assert not denied.allowed
            assert denied.decision.reason == BACKEND_UNAVAILABLE
            assert denied.decision.retry_after is None

            # A closed rule's denial keeps the open rules from consuming.
            other = Rule("other", 2, 60.0, "gcra", on_error="open")
            mixed = await timed(backend.check("v", [other, closed], 1))
            assert not mixed.allowed and mixed.decision.rule == "closed"
            assert mixed.decisions[0].allowed and mixed.decisions[0].remaining == 2
            assert (await timed(backend.check("v", [other], 1))).decision.remaining == 1

            many = await timed(backend.check_many([("w", [opened], 1), ("w", [closed], 1)]))
            assert [v.allowed for v in many] == [True, False]
            assert calls == calls_when_down, "the primary was called while known to be down"
            assert backend.fallbacks == 10 and backend.outages == 1

            redis_server.start()
            deadline = time.monotonic() + 5.0
            while not backend.available:
                assert time.monotonic() < deadline, "did not switch back to Redis"
                await asyncio.sleep(0.02)
            # Back on Redis (restarted empty: fresh state, scripts reloaded on NOSCRIPT).
            verdict = await backend.check("u", [opened], 1)
            assert verdict.allowed and verdict.decision.reason is None
            assert verdict.decision.remaining == 2
            assert backend.fallbacks == 10
        finally:
            await backend.close()
        assert backend._probe is None

    run(scenario)
    lines = [r.getMessage() for r in caplog.records if r.name == "ringlimit.redis"]
    assert len([m for m in lines if "unavailable" in m]) == 1, lines
    assert len([m for m in lines if "available again" in m]) == 1, lines


def _redis_down(clock: Clock = system_clock) -> FallbackBackend:
    """A fallback whose Redis is a port nobody listens on (it starts down)."""
    primary = RedisBackend(f"redis://127.0.0.1:{free_port()}/0")
    return FallbackBackend(primary, MemoryBackend(MemoryStore(), clock))


def test_fallback_starting_while_redis_is_down() -> None:
    rule = Rule("r", 1, 60.0, on_error="open")

    async def scenario() -> None:
        backend = _redis_down()
        await backend.start()
        try:
            assert not backend.available and backend.outages == 1
            assert (await backend.check("u", [rule], 1)).allowed
            denied = await backend.check("u", [rule], 1)
            assert not denied.allowed and denied.decision.reason == BACKEND_UNAVAILABLE
            impossible = await backend.check("u", [rule], 2)
            assert impossible.decision.reason == COST_EXCEEDS_CAPACITY
        finally:
            await backend.close()

    run(scenario)


def test_the_local_limiters_states_are_swept_when_fresh_again() -> None:
    """Keys decided locally during an outage leave the local limiter once their
    states are fresh again (the node's sweep calls ``sweep_local``), with the
    tables of rules no longer in force; before, they stayed for the node's life."""
    clock = FrozenClock()
    rule = Rule("r", 5, 1.0, on_error="open")

    async def scenario() -> None:
        backend = _redis_down(clock)
        await backend.start()
        try:
            assert not backend.available
            for i in range(100):
                assert (await backend.check(f"user-{i}", [rule], 1)).allowed
            store = backend.local.store
            assert len(store) == 100
            assert backend.sweep_local({"r"}) == 0  # not fresh yet: all kept
            clock.advance(2.0)
            assert backend.sweep_local({"r"}) == 100
            assert len(store) == 0 and "r" in store._tables
            backend.sweep_local({"other"})  # "r" is no longer in force
            assert "r" not in store._tables
        finally:
            await backend.close()

    run(scenario)


def test_a_redis_nodes_sweep_loop_sweeps_its_local_limiter() -> None:
    """The node's own sweep loop reaches the fallback's local limiter."""
    from node.app import NodeSettings, create_app
    from node.config import ClusterConfig

    clock = FrozenClock()

    async def scenario() -> None:
        config = ClusterConfig.from_dict(
            {"backend": "redis", "rules": [{"name": "r", "rate": "5/second"}]}
        )
        backend = _redis_down(clock)
        local = backend.local
        node = create_app(
            NodeSettings(node_id="n1", config=config, sweep_interval=0.02),
            backend=backend,
            clock=clock,
        )
        async with node.control.router.lifespan_context(node.control):
            rules = (config.rule_map["r"],)
            for i in range(20):
                assert (await backend.check(f"user-{i}", rules, 1)).allowed
            assert len(local.store) == 20
            clock.advance(5.0)
            for _ in range(200):  # bounded: 4 s
                if not len(local.store):
                    break
                await asyncio.sleep(0.02)
            assert len(local.store) == 0

    run(scenario)


def test_a_probe_that_raises_is_counted_and_logged_without_flooding(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 10 item 6: the probe loop outlives any error, never silently: each
    is counted (the node's /metrics, kind backend_probe), logged at most once
    per 10 s."""
    port = free_port()

    async def scenario() -> None:
        primary = RedisBackend(f"redis://127.0.0.1:{port}/0")
        backend = FallbackBackend(
            primary, MemoryBackend(MemoryStore(), system_clock), probe_interval=0.02
        )

        async def broken_ping() -> bool:
            raise RuntimeError("probe bug")

        primary.ping = broken_ping  # type: ignore[method-assign]
        await backend.start()  # Redis is not there: the backend starts down
        try:
            for _ in range(100):  # 2 s at most
                if backend.failures.counts.get("backend_probe", 0) >= 5:
                    break
                await asyncio.sleep(0.02)
            assert backend.failures.counts["backend_probe"] >= 5
            assert not backend.available
        finally:
            await backend.close()

    with caplog.at_level(logging.ERROR, logger="ringlimit"):
        run(scenario)
    logged = [r for r in caplog.records if "backend_probe failed" in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]


@contextlib.contextmanager
def acl_user(server: RedisServer, *rules: str) -> Iterator[str]:
    """A Redis ACL user ``limited`` (password ``s3cret-pw``) with ``rules``; its URL."""
    with server.client() as client:
        client.execute_command("ACL", "SETUSER", "limited", "reset", "on", ">s3cret-pw", *rules)
    try:
        yield f"redis://limited:s3cret-pw@127.0.0.1:{server.port}/0"
    finally:
        with server.client() as client:
            client.execute_command("ACL", "DELUSER", "limited")


@pytest.mark.parametrize(
    ("acl", "fix"),
    [
        (("~other:*", "+@all"), "check the ACL of user 'limited'"),
        (("~*", "+@all", "-evalsha"), "check the ACL of user 'limited'"),
        (("~*", "+@all", "<s3cret-pw", ">other-pw"), "check the password in --redis-url"),
    ],
    ids=["keys-out-of-scope", "no-evalsha", "wrong-password"],
)
def test_a_user_redis_refuses_is_an_outage_named_once(
    redis_server: RedisServer,
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    pipeline: bool,
    acl: tuple[str, ...],
    fix: str,
) -> None:
    """An ACL that refuses the node's user (its keys out of scope, EVALSHA not
    allowed, another password) is the whole backend unusable: each rule's on_error
    decides, as for an outage, and the log says once what to fix, without the
    password. Before: every check raised NoPermissionError (a 500 with a traceback
    per request, open and closed rules alike). The probe must not take it back
    either: PING and SET may pass where a check cannot (it logged two lines a
    probe)."""
    caplog.set_level(logging.INFO, logger="ringlimit")
    opened = Rule("open", 3, 60.0)
    closed = Rule("closed", 3, 60.0, on_error="closed")

    async def scenario(url: str) -> None:
        backend = FallbackBackend(
            RedisBackend(url, pipeline=pipeline),
            MemoryBackend(MemoryStore(), system_clock),
            probe_interval=0.05,
        )
        await backend.start()
        try:
            got = [await backend.check("u", [opened], 1) for _ in range(4)]
            assert [v.allowed for v in got] == [True, True, True, False]
            assert {v.decision.reason for v in got} == {BACKEND_UNAVAILABLE}
            denied = await backend.check("u", [closed], 1)
            assert not denied.allowed and denied.decision.reason == BACKEND_UNAVAILABLE
            assert denied.decision.retry_after is None
            many = await backend.check_many([("v", [opened], 1), ("v", [closed], 1)])
            assert [v.allowed for v in many] == [True, False]
            await asyncio.sleep(0.4)  # several probes: none may switch back
            assert not backend.available and backend.outages == 1
        finally:
            await backend.close()

    with acl_user(redis_server, *acl) as url:
        run(lambda: scenario(url))
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ringlimit")]
    named = [m for m in lines if "refused user 'limited'" in m]
    assert len(named) == 1 and fix in named[0], lines
    assert not any("available again" in m for m in lines), lines
    assert not any("s3cret-pw" in m for m in lines)
    assert not any(r.exc_info for r in caplog.records)


@pytest.mark.parametrize(
    ("spoil", "said"),
    [
        (lambda c, k: c.lpush(k, "x"), "WRONGTYPE"),
        (lambda c, k: c.set(k, "nan nan"), "a wait of nan s from its stored state"),
        (lambda c, k: c.set(k, "-inf 1"), "a wait of inf s from its stored state"),
        (lambda c, k: c.set(k, "1 9e99"), "a wait of 9e+99 s from its stored state"),
        (lambda c, k: c.set(k, "x"), "holds no ringlimit state (not numbers)"),
        (lambda c, k: c.set(k, ""), "holds no ringlimit state (empty)"),
    ],
    ids=["another-type", "nan", "infinity", "far-away", "a-word", "empty"],
)
def test_a_key_of_another_type_fails_that_check_only_by_its_on_error(
    redis_url: str,
    caplog: pytest.LogCaptureFixture,
    pipeline: bool,
    spoil: Callable[[Any, str], object],
    said: str,
) -> None:
    """A ringlimit key that something else overwrote (WRONGTYPE) makes that user's
    checks answer per their rules' on_error (open: the local limiter; closed:
    denied, reason backend_error), one warning line per 10 s, while every other
    check, in the same batch too, is decided by Redis. Before: the check raised
    ResponseError (a 500 with a traceback per request), and a batch failed whole.
    So does a state holding values no script writes (NaN, infinity, a time
    centuries away): before, a 500 (int(nan) in the headers), in a batch its
    node's other checks failed though counted, and a far time locked its user
    out with a 100-digit Retry-After (an exploratory tester). A value that is not
    numbers at all (a word, an empty string) was read as a fresh state, a new
    quota for its user, closed rule or not (an exploratory tester)."""
    caplog.set_level(logging.INFO, logger="ringlimit")
    opened = Rule("open", 3, 60.0)
    closed = Rule("closed", 3, 60.0, on_error="closed")

    async def scenario() -> None:
        primary = RedisBackend(redis_url, pipeline=pipeline)
        backend = FallbackBackend(
            primary, MemoryBackend(MemoryStore(), system_clock), probe_interval=0.05
        )
        await backend.start()
        try:
            with sync_client(redis_url) as client:
                for rule in (opened, closed):
                    spoil(client, primary.key("mallory", rule))
            got = [await backend.check("mallory", [opened], 1) for _ in range(4)]
            assert [v.allowed for v in got] == [True, True, True, False]
            assert {v.decision.reason for v in got} == {BACKEND_ERROR}
            denied = await backend.check("mallory", [closed], 1)
            assert not denied.allowed and denied.decision.reason == BACKEND_ERROR
            assert denied.decision.retry_after is None
            fine = await backend.check("alice", [closed], 1)
            assert fine.allowed and fine.decision.reason is None
            many = await backend.check_many(
                [("alice", [closed], 1), ("mallory", [closed], 1), ("bob", [opened], 1)]
            )
            assert [v.allowed for v in many] == [True, False, True]
            assert [v.decision.reason for v in many] == [None, BACKEND_ERROR, None]
            assert many[0].decision.remaining == 1, "alice's checks are Redis's"
            assert backend.available and primary.available, "one bad key is no outage"
            with sync_client(redis_url) as client:
                assert client.exists(primary.key("bob", opened))
        finally:
            await backend.close()

    run(scenario)
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ringlimit")]
    wrong = [m for m in lines if said in m]
    assert len(wrong) == 1, lines
    assert "rl:{mallory}:open:tb" in wrong[0], wrong
    assert not any("unavailable" in m for m in lines), lines
    assert not any(r.exc_info for r in caplog.records)


def test_a_burst_refused_by_maxclients_is_an_outage_the_probe_ends(tmp_path: Path) -> None:
    """Without pipelining, a burst of more calls than Redis's ``maxclients`` lets
    the node connect is refused connections: an outage. Once the burst is over the
    probe must find Redis again. Before, it never did: the pool handed it one of
    the connections refused in the burst (the last released) rather than an open
    one, and reconnecting that was refused again, for as long as the node's own
    idle open connections kept Redis full (its closed rules 503 for good)."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server is not installed")
    (tmp_path / "redis").mkdir()
    server = RedisServer(binary, tmp_path / "redis", extra_args=["--maxclients", "8"])
    server.start()
    rule = [Rule("burst", 10**6, 60.0)]

    async def scenario() -> None:
        # A timeout of 1 s, not 100 ms: on a loaded machine 40 sockets connecting at
        # once timed out before Redis's refusal arrived (a flaky run), and a burst
        # refused by timeouts is not the case this test is about. Any refusal may
        # come first (a timeout, a reset); Redis must have refused some (its
        # rejected_connections, below: over RESP2 the client's first write meets
        # the closed socket before it reads Redis's "max number of clients").
        backend = RedisBackend(server.url, pipeline=False, timeout=1.0)
        await backend.start()
        try:
            checks = [backend.check(f"k{i}", rule, 1) for i in range(40)]
            outcomes = await asyncio.gather(*checks, return_exceptions=True)
            refused = [str(o) for o in outcomes if isinstance(o, BackendUnavailable)]
            assert refused, outcomes[:3]
            # Redis frees a closed connection's slot on its next turn: a few probes.
            for _ in range(5):
                if await backend.ping():
                    break
                await asyncio.sleep(0.2)
            assert backend.available
            assert (await backend.check("after", rule, 1)).allowed
        finally:
            await backend.close()

    try:
        run(scenario)
        with server.client() as client:
            assert client.info("stats")["rejected_connections"] > 0, "no refusal by maxclients"
    finally:
        server.stop()


@contextlib.contextmanager
def not_redis(port: int, resp: bytes | None = None) -> Iterator[None]:
    """A server on ``port`` that answers every connection as an HTTP server answers
    a stranger (``HTTP/1.1 400``) and closes it: not a Redis, faked or otherwise.
    With ``resp``, a server that speaks RESP but is not Redis either: it answers
    ``resp`` to every command, as some proxies and toys do."""
    import socket
    import threading

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen(64)
    server.settimeout(0.05)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn = server.accept()[0]
            except OSError:
                continue
            with contextlib.suppress(OSError), conn:
                conn.settimeout(1.0)
                if resp is None:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    continue
                for _ in range(200):  # one answer per command (each begins a line with *)
                    data = conn.recv(65536)
                    if not data:
                        break
                    commands = data.count(b"\r\n*") + data.startswith(b"*")
                    conn.sendall(resp * commands)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        server.close()


@pytest.mark.parametrize(
    "answer",
    [b":1\r\n", b"$-1\r\n", b"*8\r\n" + b"$1\r\nx\r\n" * 8],
    ids=["integer", "nil", "words"],
)
def test_a_server_that_speaks_resp_but_is_not_redis_is_an_outage(
    answer: bytes, pipeline: bool
) -> None:
    """A server that answers every command ``:1`` (or nil) speaks the protocol but
    runs no script: its replies were a TypeError in reading them, a 500 per
    request with on_error ignored and /healthz saying Redis was fine (the review
    of the day's changes). It is an outage now: each rule's on_error decides.
    So is one that answers a list of the script's length holding words where the
    script sends numbers (a ValueError and a 500 per request before)."""
    port = free_port()
    opened = Rule("open", 3, 60.0)
    closed = Rule("closed", 3, 60.0, on_error="closed")

    async def scenario() -> None:
        url = f"redis://127.0.0.1:{port}/0"
        # A timeout of 1 s: the server is a thread of this process, and on a loaded
        # machine its answer to the connection's handshake came after 0.1 s (a CI
        # run: "Timeout connecting to server"), which is not this test's case.
        bare = RedisBackend(url, pipeline=pipeline, timeout=1.0)
        backend = FallbackBackend(
            RedisBackend(url, pipeline=pipeline, timeout=1.0),
            MemoryBackend(MemoryStore(), system_clock),
        )
        try:
            with pytest.raises(BackendUnavailable, match="not a ringlimit script's reply"):
                await bare.check("u", [opened], 1)
            assert not bare.available
            got = [await backend.check("u", [opened], 1) for _ in range(4)]
            assert [v.allowed for v in got] == [True, True, True, False]
            assert {v.decision.reason for v in got} == {BACKEND_UNAVAILABLE}
            denied = await backend.check("u", [closed], 1)
            assert not denied.allowed and denied.decision.reason == BACKEND_UNAVAILABLE
            many = await backend.check_many([("w", [opened], 1), ("w", [closed], 1)])
            assert [v.allowed for v in many] == [True, False]
            assert not backend.available
        finally:
            await backend.close()
            await bare.close()

    with not_redis(port, answer):
        run(scenario)


def test_a_server_that_is_not_redis_is_an_outage_until_redis_answers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pipeline: bool
) -> None:
    """A --redis-url whose server speaks something else (an HTTP server's
    ``HTTP/1.1 400``: redis-py's InvalidResponse) is Redis unavailable, at start
    and while running: each rule's on_error decides, one log line names the
    cause, and the probe switches back once Redis answers there. Before, a node
    starting with such a URL exited ("Application startup failed"), and one
    whose Redis was replaced by such a server answered every request 500 with a
    traceback, on_error ignored, while its /healthz said Redis was available."""
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server is not installed")
    caplog.set_level(logging.INFO, logger="ringlimit")
    (tmp_path / "redis").mkdir()
    server = RedisServer(binary, tmp_path / "redis")
    opened = Rule("open", 3, 60.0)
    closed = Rule("closed", 3, 60.0, on_error="closed")

    async def decided_locally(backend: FallbackBackend, user: str) -> None:
        got = [await backend.check(user, [opened], 1) for _ in range(4)]
        assert [v.allowed for v in got] == [True, True, True, False]
        assert {v.decision.reason for v in got} == {BACKEND_UNAVAILABLE}
        denied = await backend.check(user, [closed], 1)
        assert not denied.allowed and denied.decision.reason == BACKEND_UNAVAILABLE
        many = await backend.check_many([(user + "+", [opened], 1), (user + "+", [closed], 1)])
        assert [v.allowed for v in many] == [True, False]
        assert not backend.available

    async def scenario() -> None:
        backend = FallbackBackend(
            RedisBackend(server.url, pipeline=pipeline),
            MemoryBackend(MemoryStore(), system_clock),
            probe_interval=0.05,
        )
        bare = RedisBackend(server.url, pipeline=pipeline)
        with not_redis(server.port):
            await backend.start()  # before: raised InvalidResponse
            assert not backend.available and backend.outages == 1
            await decided_locally(backend, "u")
            for _ in range(3):
                with pytest.raises(BackendUnavailable, match="does not speak the Redis"):
                    await bare.check("u", [opened], 1)
            assert not bare.available and await bare.ping() is False
            await asyncio.sleep(0.3)  # several probes: none may switch back
            assert not backend.available
        try:
            server.start()
            deadline = time.monotonic() + 5.0
            while not backend.available:
                assert time.monotonic() < deadline, "did not switch back to Redis"
                await asyncio.sleep(0.02)
            assert (await backend.check("u", [closed], 1)).decision.reason is None
            assert await bare.ping() is True
            assert (await bare.check("u", [opened], 1)).decision.reason is None

            # While running: Redis gives way to a server that is not Redis.
            server.stop()
            with not_redis(server.port):
                for _ in range(3):
                    with pytest.raises(BackendUnavailable):
                        await bare.check("v", [opened], 1)
                await decided_locally(backend, "v")
                assert backend.outages == 2
        finally:
            await backend.close()
            await bare.close()

    try:
        run(scenario)
    finally:
        server.stop()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("ringlimit")]
    named = [m for m in lines if "does not speak the Redis protocol" in m]
    assert named and "is --redis-url the address of a Redis server" in named[0], lines
    assert len([m for m in lines if "backend unavailable" in m]) == 2, lines
    assert len([m for m in lines if "available again" in m]) == 1, lines
    assert not any(r.exc_info for r in caplog.records)


def test_the_middleware_marks_what_the_fallback_decided_under_any_asgi_server(
    redis_url: str,
) -> None:
    """RateLimitMiddleware under a server without the node's front door (httpx's
    ASGI transport here) adds ``X-Ringlimit-Degraded`` through its send wrapper:
    ``backend-error`` for a key Redis answers with an error, ``backend-unavailable``
    while Redis is down, each on the answer and on the application's request (and
    in ``scope["state"]["ringlimit"]``). Before, both answers were ordinary 201s."""
    import httpx

    from node.authority import Authority
    from node.config import ClusterConfig, ScopedRule
    from node.middleware import RateLimitMiddleware

    config = ClusterConfig(rules=(ScopedRule(Rule("open", 5, 60.0, on_error="open")),))
    seen: list[object] = []

    async def application(scope: dict[str, Any], receive: Any, send: Any) -> None:
        seen.append(scope["state"]["ringlimit"].get("degraded"))
        fields = [v for k, v in scope["headers"] if k == b"x-ringlimit-degraded"]
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"|".join(fields)})

    async def asked(backend: FallbackBackend, user: str) -> httpx.Response:
        app = RateLimitMiddleware(
            application, authority=Authority(config, backend), trust_router=False
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app.test") as c:
            forged = {"X-User-Id": user, "X-Ringlimit-Degraded": "forged"}
            return await c.get("/", headers=forged)

    async def scenario() -> None:
        with sync_client(redis_url) as client:
            client.lpush("rl:{mallory}:open:tb", "x")
        up = FallbackBackend(RedisBackend(redis_url), MemoryBackend(MemoryStore(), system_clock))
        down = _redis_down()
        for backend in (up, down):
            await backend.start()
        try:
            fine = await asked(up, "alice")
            assert fine.status_code == 201 and "x-ringlimit-degraded" not in fine.headers
            assert fine.content == b""  # the client's field never reaches the application
            broken = await asked(up, "mallory")
            assert broken.headers["x-ringlimit-degraded"] == "backend-error"
            assert broken.content == b"backend-error"
            local = await asked(down, "alice")
            assert local.status_code == 201, local.text
            assert local.headers["x-ringlimit-degraded"] == "backend-unavailable"
            assert local.headers["ratelimit"] == '"open";r=4;t=12'
            assert local.content == b"backend-unavailable"
        finally:
            for backend in (up, down):
                await backend.close()
        assert seen == [None, "backend-error", "backend-unavailable"]

    run(scenario)


@pytest.mark.parametrize("denial_format", ["problem", "json"])
def test_a_closed_rule_redis_cannot_decide_is_limiter_unavailable_not_rate_limited(
    redis_url: str, denial_format: str
) -> None:
    """A closed rule's 503 while Redis is down (or answers that check with an
    error) says ``error: limiter_unavailable``, as the router's 503 for a closed
    rule whose owner cannot be reached: the service refused, no quota ran out.
    Before, its body said ``rate_limited``, as a 429's does, and a client branching
    on ``error`` took an outage for an exhausted quota. A 429 of the open rule's
    local limiter stays ``rate_limited``; both 503s keep ``Retry-After: 1`` and
    ``X-Ringlimit-Degraded``."""
    import httpx

    from node.authority import Authority
    from node.config import ClusterConfig, ScopedRule
    from node.middleware import RateLimitMiddleware
    from tests import sample_app

    opened = Rule("open", 1, 60.0, on_error="open")
    closed = Rule("closed", 5, 60.0, on_error="closed")
    config = ClusterConfig(
        rules=(
            ScopedRule(opened, paths=("/open/*",)),
            ScopedRule(closed, paths=("/closed/*",)),
        ),
        denial_format=denial_format,
    )

    async def asked(backend: FallbackBackend, path: str, user: str) -> httpx.Response:
        app = RateLimitMiddleware(
            sample_app.app, authority=Authority(config, backend), trust_router=False
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app.test") as c:
            return await c.get(path, headers={"X-User-Id": user})

    async def scenario() -> None:
        with sync_client(redis_url) as client:
            client.lpush(state_key("rl", "mallory", closed), "x")
        up = FallbackBackend(RedisBackend(redis_url), MemoryBackend(MemoryStore(), system_clock))
        down = _redis_down()
        for backend in (up, down):
            await backend.start()
        try:
            for backend, user, mark in (
                (down, "alice", "backend-unavailable"),
                (up, "mallory", "backend-error"),
            ):
                refused = await asked(backend, "/closed/x", user)
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.headers["x-ringlimit-degraded"] == mark
                body = refused.json()
                assert body["error"] == "limiter_unavailable", body
                assert body["reason"] == mark.replace("-", "_")
                assert body["rule"] == "closed" and body["retry_after"] is None
            assert (await asked(down, "/open/x", "bob")).status_code != 429
            limited = await asked(down, "/open/x", "bob")
            assert limited.status_code == 429, limited.text
            assert limited.json()["error"] == "rate_limited"
        finally:
            for backend in (up, down):
                await backend.close()

    run(scenario)


def test_the_fallback_limiter_is_capped_and_its_states_are_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A node's local fallback limiter holds at most ``--max-keys`` states (no
    cap without it, as a memory node's store), built as ``ringlimit node
    --backend redis`` builds it; its states count in the node's ``keys``
    (``/healthz``, ``ringlimit_keys``) and a key past the cap is a
    ``store_full`` error, logged once. Before, ``--max-keys`` was ignored and
    both figures said 0 while an outage with many distinct users grew a node by
    ~100-150 B per key, for an hour under an hourly rule (an exploratory
    tester)."""
    import httpx

    from node.app import Node, NodeSettings
    from node.config import ClusterConfig, ScopedRule
    from router.cli import _redis_backend

    down = f"redis://127.0.0.1:{free_port()}/0"
    default = _redis_backend(down, pipeline=True, timeout=0.1, max_keys=None)
    assert isinstance(default, FallbackBackend)
    assert default.local.store.max_keys is None
    rule = Rule("hourly", 5, 3600.0, on_error="open")
    config = ClusterConfig(rules=(ScopedRule(rule),))

    async def scenario() -> None:
        backend = _redis_backend(down, pipeline=True, timeout=0.1, max_keys=50)
        assert isinstance(backend, FallbackBackend)
        node = Node(
            NodeSettings(node_id="r1", config=config, max_keys=50, sticky=False),
            backend=backend,
        )
        await backend.start()
        try:
            assert not backend.available
            with caplog.at_level(logging.WARNING):
                verdicts = [await backend.check(f"user-{i}", [rule], 1) for i in range(60)]
            assert all(v.allowed for v in verdicts)  # open: fresh past the cap
            assert len(backend.local.store) == 50 and node.held_keys() == 50
            transport = httpx.ASGITransport(app=node)
            async with httpx.AsyncClient(transport=transport, base_url="http://n") as client:
                health = (await client.get("/healthz")).json()
                page = (await client.get("/metrics")).text
            assert health["keys"] == 50, health
            assert "ringlimit_keys 50.0" in page
            assert 'ringlimit_node_errors_total{kind="store_full"} 10.0' in page
            full = [r for r in caplog.records if "local fallback limiter holds" in r.message]
            assert len(full) == 1, [r.message for r in caplog.records]
        finally:
            await backend.close()

    run(scenario)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_redis_without_hello_decides(tmp_path: Path, pipelined: bool) -> None:
    """The node speaks RESP2 unless its URL says ``?protocol=3``: redis-py 8
    says ``HELLO 3`` on every connect, with no fallback, so a Redis without HELLO
    (before 6, a renamed command, some proxies) was an outage for good, whose log
    named a command ringlimit never sends (an exploratory tester). Exact limits
    on it, pipelined or not; asking for RESP3 there is still an outage, named."""
    from router.supervisor import check_redis

    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(binary, tmp_path, extra_args=["--rename-command", "HELLO", ""])
    server.start()
    rule = Rule("r", 3, 60.0, on_error="closed")

    async def scenario() -> None:
        backend = RedisBackend(server.url, pipeline=pipelined)
        await backend.start()
        try:
            assert backend.available
            allowed = [(await backend.check("u", [rule], 1)).allowed for _ in range(5)]
            assert allowed == [True, True, True, False, False]
        finally:
            await backend.close()
        resp3 = RedisBackend(f"{server.url}?protocol=3", pipeline=pipelined)
        await resp3.start()
        try:
            with pytest.raises(BackendUnavailable, match="HELLO"):
                await resp3.check("v", [rule], 1)
        finally:
            await resp3.close()

    try:
        with server.client() as client, pytest.raises(redis.ResponseError, match="unknown"):
            client.execute_command("HELLO", "3")
        check_redis(server.url)  # `ringlimit up`'s check before its nodes start
        run(scenario)
    finally:
        server.stop()


def test_a_refusal_names_the_user_of_the_url_however_it_is_given() -> None:
    """``USER:PASSWORD@`` or ``?username=``: a refusal's line named ``default``
    for the second, and said to check that user's ACL (an exploratory tester)."""
    port = free_port()
    assert RedisBackend(f"redis://bob:pw@127.0.0.1:{port}/0").user == "bob"
    assert RedisBackend(f"redis://127.0.0.1:{port}/0?username=nobody").user == "nobody"
    assert RedisBackend(f"redis://127.0.0.1:{port}/0").user == "default"
