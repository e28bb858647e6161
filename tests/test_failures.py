"""Background loops outlive errors, and count and log each one (rate-limited)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from node.config import ClusterConfig, Policies, ScopedRule
from node.failures import Failures
from node.rules import Rule
from router.testing import InProcessCluster
from tests.test_router import metric

pytestmark = pytest.mark.anyio


def test_failures_are_all_counted_but_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    failures = Failures(logging.getLogger("test.failures"), every=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.ERROR, logger="test.failures"):
        logged = [failures.record("loop", RuntimeError(f"boom {i}")) for i in range(5)]
        now[0] = 10.5
        logged.append(failures.record("loop", RuntimeError("boom 5")))
        logged.append(failures.record("other", ValueError("bad")))
    assert logged == [True, False, False, False, False, True, True]
    assert failures.counts == {"loop": 6, "other": 1}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3
    assert "loop failed: RuntimeError: boom 0" in lines[0]
    assert "(4 more since the last report)" in lines[1]
    assert caplog.records[0].exc_info is not None  # the traceback is kept


async def _until(predicate, seconds: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(seconds / 0.01)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition not reached in time")


async def test_health_loop_errors_are_counted_in_metrics_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 5, 60.0)),))
    async with InProcessCluster(2, config) as cluster:
        membership = cluster.router.membership
        calls = []

        async def broken(*, wait: bool = True) -> None:
            calls.append(1)
            raise RuntimeError("probe bug")

        membership.check_health = broken  # type: ignore[method-assign]
        membership.health_interval = 0.01
        with caplog.at_level(logging.ERROR, logger="ringlimit.router"):
            task = asyncio.create_task(membership._health_loop())
            try:
                await _until(lambda: len(calls) >= 3)
                # The loop survived every error: still running, and still calling.
                assert not task.done()
                seen = len(calls)
                await _until(lambda: len(calls) > seen)
                assert not task.done()
            finally:
                task.cancel()
        text = (await cluster.client.get("/metrics")).text
        count = metric(text, "ringlimit_router_background_errors_total", kind="health_loop")
        assert count >= 3
        logged = [r for r in caplog.records if "health_loop failed" in r.getMessage()]
        assert len(logged) == 1 and "probe bug" in logged[0].getMessage()


async def test_replication_loop_errors_are_counted_in_metrics_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = ClusterConfig(
        rules=(ScopedRule(Rule("api", 5, 60.0)),),
        policies=Policies(crash="replica", replication_interval=0.01),
    )
    async with InProcessCluster(2, config) as cluster:
        node = cluster.nodes["n1"]
        shard = node.shard
        assert shard is not None
        calls = []

        async def broken() -> int:
            calls.append(1)
            raise OSError("peer went away mid-call")

        shard.replicate_once = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR, logger="ringlimit.node"):
            task = asyncio.create_task(shard.run_replication())
            try:
                await _until(lambda: len(calls) >= 3)
                assert not task.done()  # the loop survived every error
            finally:
                task.cancel()
        text = node.metrics.render().decode()
        assert metric(text, "ringlimit_background_errors_total", kind="replication_loop") >= 3
        logged = [r for r in caplog.records if "replication_loop failed" in r.getMessage()]
        assert len(logged) == 1 and "peer went away" in logged[0].getMessage()
