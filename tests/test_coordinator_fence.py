"""etcd's election fence (router/coordinator.py ``commit``): a router writes the
ring's record or its rules only while the leader key it created is there, so a
deposed leader cannot write over its successor, whether or not it has noticed;
and a write of its own whose answer was lost is not taken for a refusal.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import pytest

from ring import Member, RingView
from router.coordinator import EtcdCoordinator, NotLeading, ViewRecord, _revoke
from tests.test_coordinator import _nothing, _setter, coordinator, stop_campaigns, two_routers
from tests.test_rebalancing import make_config

pytestmark = [pytest.mark.anyio, pytest.mark.etcd]


async def depose(etcd_endpoint: str) -> None:
    """Revoke the leader key's lease, as etcd expires it behind a paused leader."""
    admin = coordinator(etcd_endpoint)
    try:
        key = admin._key("leader")
        held = await admin._call("read leader", lambda c: c.get(key))
        await admin._call("lease revoke", partial(_revoke, held.lease))
    finally:
        await admin.close()


@pytest.mark.parametrize("noticed", [False, True], ids=["before-it-notices", "after"])
async def test_a_deposed_leader_cannot_write(etcd_endpoint: str, noticed: bool) -> None:
    """a leads; its leader key goes and b leads. Before a's next keep-alive
    (ttl/3 = 10 s away) a still believes it leads; after it (ttl 3 s) it knows
    it does not, but an admin call that passed its leader check earlier may
    still reach etcd. Either way a's write, built on the latest revision (which
    the revision check alone lets through), is refused; b's goes through."""
    loop = asyncio.get_running_loop()
    a, b = (coordinator(etcd_endpoint, ttl=3.0 if noticed else 30.0) for _ in range(2))
    a_led, b_led, a_lost = asyncio.Event(), asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(a.lead("http://a", _setter(a_led), _setter(a_lost), loop.time))]
    try:
        await asyncio.wait_for(a_led.wait(), timeout=10.0)
        config = make_config()
        one = RingView.of([Member("n1", "http://n1")], epoch=1)
        first = await a.commit(ViewRecord(one, None, (), config, True), expected=0)
        assert first is not None  # a's own fence holds while it leads
        tasks.append(asyncio.create_task(b.lead("http://b", _setter(b_led), _nothing, loop.time)))
        await depose(etcd_endpoint)
        await asyncio.wait_for(b_led.wait(), timeout=10.0)
        if noticed:
            await asyncio.wait_for(a_lost.wait(), timeout=10.0)
        else:
            assert not a_lost.is_set(), "a noticed: the test no longer shows the fence"
        latest = await a.load()
        assert latest is not None
        two = RingView.of([*one, Member("n2", "http://n2")], epoch=2)
        record = ViewRecord(two, one, (), config, False)
        with pytest.raises(NotLeading):
            await a.commit(record, expected=latest.revision)
        assert await b.commit(record, expected=latest.revision) is not None
    finally:
        await stop_campaigns(tasks, a, b)


async def test_a_deposed_leaders_rules_change_does_not_overwrite_its_successors(
    etcd_endpoint: str,
) -> None:
    """End to end: the old leader's PUT /admin/rules passed the leader check,
    then waited for the lock (a join or a push under way). Meanwhile it is
    deposed, notices, and the new leader records its own rules. The old call
    then loads the latest record (the successor's, same view) and commits on
    its revision: the fence must refuse it, or the old rules would replace the
    successor's in etcd and be pushed to the nodes (the review of the fence)."""
    async with two_routers(etcd_endpoint) as (cluster, second):
        first = cluster.router.membership
        other = second.membership
        old, new = (first, other) if first.leading else (other, first)
        rules_old = old.config.with_rule_tables(
            [{"name": "from-old", "rate": "1/s"}], source="test"
        )
        rules_new = new.config.with_rule_tables(
            [{"name": "from-new", "rate": "2/s"}], source="test"
        )
        await old.lock.acquire()  # a join under way
        pending = asyncio.create_task(old.change_config(rules_old))
        await asyncio.sleep(0.1)
        try:
            await depose(etcd_endpoint)
            for _ in range(200):
                if new.leading and not old.leading:
                    break
                await asyncio.sleep(0.05)
            assert new.leading and not old.leading
            await new.change_config(rules_new)
        finally:
            old.lock.release()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(pending, 10)
        record = await new.coordinator.load()
        names = [r.rule.name for r in record.config.rules]
        assert names == ["from-new"], f"the deposed leader overwrote the rules: {names}"


async def test_a_commit_whose_answer_was_lost_is_not_reported_as_lost(etcd_endpoint: str) -> None:
    """etcd applied a commit, but its answer was lost (the channel broke), and
    ``_call`` sent it again: that retry's compare fails on this router's own
    write. Taken for a refusal ("another router changed the ring first"), the
    leader would answer 409 and build every later change on a revision etcd no
    longer has, until leadership moved. The answer is lost for real here, by
    the coordinator's own call wrapper, against a real etcd."""

    class Lossy(EtcdCoordinator):
        lose = False

        async def _call(self, what: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
            if what != "commit" or not self.lose:
                return await super()._call(what, call)
            self.lose = False
            once = [True]

            async def lossy(client: Any) -> Any:
                got = await call(client)
                if once and once.pop():
                    raise ConnectionError("the answer was lost")
                return got

            return await super()._call(what, lossy)

    a = Lossy(coordinator(etcd_endpoint).endpoints, cluster="test", ttl=3.0)
    try:
        config = make_config()
        one = RingView.of([Member("n1", "http://n1")], epoch=1)
        first = await a.commit(ViewRecord(one, None, (), config, True), expected=0)
        assert first is not None
        two = RingView.of([*one, Member("n2", "http://n2")], epoch=2)
        a.lose = True
        got = await a.commit(ViewRecord(two, one, (), config, False), expected=first.revision)
        held = await a.load()
        assert held is not None and held.view == two  # it landed
        assert got is not None, "commit() said another router won; it was this one's write"
    finally:
        await a.close()
