"""The router's membership: the ring view it routes by, and every change to it.

The router is where membership changes are made (admin API, health checks).
Each change makes a new view with ``epoch + 1`` and pushes it to the nodes,
with the previous view, the crashed members and the cluster config, in an
order that keeps a single authority per key at every moment:

* the nodes that lose keys first (they stop deciding those keys and hand
  their states off before answering),
* then the nodes that only gain keys,
* and only then does the router itself route by the new view.

Membership survives a router restart: it is written atomically to a state
file after every change, and on start the router also asks the nodes for
the newest view they know (re-discovery), adopting it when it is newer.

Several routers may share a cluster; one of them takes admin changes, the
others learn new views from the nodes (a node refusing a key tells the router
its newer epoch, and the router fetches that view). A router given the
leader's URL (``follow``: the workers of ``ringlimit router --workers N``
without etcd) also polls the leader's ring, so it converges within one poll.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import tempfile
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from node.config import ClusterConfig
from node.failures import Failures
from node.lease import DEFAULT_DRIFT, lease_bound
from node.peers import INTERNAL_TOKEN_HEADER
from ring import Member, RingView
from router.coordinator import CoordinatorError, EtcdCoordinator, ViewRecord
from router.events import EventLog
from router.removal import RemovalBudget

log = logging.getLogger("ringlimit.router")
#: Views and crashes remembered for nodes that missed pushes.
MAX_HISTORY = 32

#: How many crashed members the router keeps probing, to let them rejoin.
MAX_REMOVED = 256

#: Membership events listed by ``GET /admin/ring`` (``ringlimit up`` reports from them).
MAX_EVENTS = 64


class MembershipError(Exception):
    """A change that cannot be made; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail


@dataclass
class Health:
    failures: int = 0
    state: str = "active"  # joining | active | leaving
    epoch_seen: int = 0
    backend_available: bool = True
    #: The node's last lease offer (node/lease.py) and when it reached us.
    token: str | None = None
    offered_at: float = float("-inf")
    #: When every lease granted to this member has certainly ended (loop time).
    lease_until: float = float("-inf")


class Membership:
    def __init__(
        self,
        config: ClusterConfig,
        *,
        internal_token: str | None = None,
        state_file: str | Path | None = None,
        ready_timeout: float = 10.0,
        push_timeout: float = 30.0,
        health_interval: float = 1.0,
        failure_threshold: int = 3,
        health_timeout: float = 0.5,
        lease: float | None = None,
        removal_interval: float | None = None,
        removal_quorum: float = 0.5,
        coordinator: EtcdCoordinator | None = None,
        advertise: str | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = config
        self.view = RingView.empty()
        self.health: dict[str, Health] = {}
        self.joining: dict[str, Member] = {}
        #: Members removed as crashed: still probed, and made to rejoin (as new
        #: members, their old state discarded) when they answer again.
        self.removed: dict[str, Member] = {}
        self.state_file = Path(state_file) if state_file else None
        self.ready_timeout = ready_timeout
        self.health_interval = health_interval
        self.failure_threshold = failure_threshold
        self.health_timeout = health_timeout
        #: Detection time: a member answering nothing is due for removal after it.
        detection = failure_threshold * (health_interval + health_timeout)
        #: Seconds of lease granted per renewal (None: leases are off until start()
        #: turns on health checks: only a router that removes members needs them).
        self.lease_seconds = lease if lease is not None else detection
        self.leasing = False
        self.budget = RemovalBudget(
            detection if removal_interval is None else removal_interval, removal_quorum
        )
        #: Counters for /metrics: removals, deferred removals by reason, self-suspicion.
        self.stats: dict[str, int] = {
            "removed_crashed": 0,
            "deferred_quorum": 0,
            "deferred_rate": 0,
            "deferred_lease": 0,
            "self_suspected": 0,
            "lease_renewals": 0,
        }
        self.suspect_self = False
        #: With a coordinator (etcd) the ring is shared by several routers and one
        #: of them leads: it alone makes changes, probes members and grants leases.
        self.coordinator = coordinator
        self.advertise = advertise
        self.leading = coordinator is None
        self._revision = 0
        self._coordination: list[asyncio.Task[Any]] = []
        #: The last membership changes, for operators (router/events.py).
        self.events = EventLog()
        #: Errors the health loop and background repairs survived (/metrics).
        self.failures = Failures(log)
        self.lock = asyncio.Lock()
        self.changed = asyncio.Event()
        self.crashes = 0
        self._owned = client is None
        self.push_timeout = push_timeout
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(push_timeout, connect=1.0))
        # Sent per request (not as client defaults) so a shared client carries no secret.
        self._headers = {INTERNAL_TOKEN_HEADER: internal_token} if internal_token else {}
        self._health_task: asyncio.Task[None] | None = None
        self._was_degraded = False
        self._repairing: set[str] = set()
        #: Members being removed (crash in progress): probed, but granted no lease.
        self._condemned: set[str] = set()
        #: Removals the health loop started that have not finished (router/removal.py).
        self._removing: dict[str, asyncio.Task[Any]] = {}
        #: The highest epoch ever pushed: new views always go above it.
        self._highest = 0
        self._history: dict[int, RingView] = {}
        self._crashed_at: dict[int, tuple[str, ...]] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._newer_check: asyncio.Task[bool] | None = None
        self._joins: dict[str, asyncio.Future[RingView]] = {}
        self._newer_checked_at = float("-inf")
        #: The leading router's URL when this one follows it (router/workers.py).
        self.leader_url: str | None = None

    # ------------------------------------------------------------------ start / stop

    async def start(self, seeds: Iterable[Member] = (), *, health: bool = True) -> None:
        """Recover membership (state file, then the nodes), else build it from seeds."""
        seeds = list(seeds)
        # With etcd, leases are the leader's: on only while this router leads.
        self.leasing = health and self.coordinator is None
        if self.coordinator is not None:
            await self._start_coordinated(seeds, health)
            return
        recovered = self._load_state()
        candidates = list(recovered) if recovered is not None else []
        known = {m.id for m in candidates}
        candidates += [m for m in seeds if m.id not in known]
        discovered = await self._discover(candidates)
        best = max(
            [v for v in (recovered, discovered) if v is not None],
            key=lambda v: v.epoch,
            default=None,
        )
        if best is not None and len(best):
            self.view = best
            self.events.recovered(best)
            for member in best:
                self.health.setdefault(member.id, Health())
            log.info("recovered ring at epoch %d: %s", best.epoch, ", ".join(best.ids))
            await self._push_all(self.view, None, ())
        elif seeds:
            await asyncio.gather(*(self._wait_ready(m) for m in seeds))
            view = RingView.of(seeds, epoch=1)
            await self._push_all(view, RingView.empty(), ())
            self._adopt(view)
            for member in seeds:
                self.health[member.id] = Health()
        self._save_state()
        if health:
            # Leases lapsed while no router ran: renew them before serving.
            await asyncio.gather(*(self._renew(m) for m in self.view))
            self._health_task = asyncio.create_task(self._health_loop())

    async def _start_coordinated(self, seeds: list[Member], health: bool) -> None:
        """The ring from etcd; the first view from the seeds only if etcd has none."""
        assert self.coordinator is not None
        await self.coordinator.connect()
        record = await self.coordinator.load()
        if record is None and seeds:
            await asyncio.gather(*(self._wait_ready(m) for m in seeds))
            view = RingView.of(seeds, epoch=1)
            first = ViewRecord(view, RingView.empty(), (), self.config, settled=False)
            committed = await self.coordinator.commit(first, expected=0)
            if committed is None:
                record = await self.coordinator.load()
            else:
                await self._push_all(view, RingView.empty(), ())
                self._adopt(view)
                record = await self._settle(committed)
        if record is not None:
            if seeds and {m.id: m for m in seeds} != {m.id: m for m in record.view}:
                log.warning(
                    "etcd %s holds the ring at epoch %d (%s): it wins over the --node seeds",
                    self.coordinator.where,
                    record.view.epoch,
                    ", ".join(record.view.ids) or "no nodes",
                )
            self._take(record, force=True)
        self._coordination = [asyncio.create_task(self._watch())]
        if health:
            loop = asyncio.get_running_loop()
            self._coordination.append(
                asyncio.create_task(
                    self.coordinator.lead(
                        self.advertise or "", self._on_lead, self._on_lose, loop.time
                    )
                )
            )
            self._health_task = asyncio.create_task(self._health_loop())

    def _take(self, record: ViewRecord, *, force: bool = False) -> None:
        """Follow etcd's record: remember its revision, adopt a settled newer view."""
        self._revision = max(self._revision, record.revision)
        self._highest = max(self._highest, record.view.epoch)
        if (record.settled or force) and record.view.epoch > self.view.epoch:
            if record.config != self.config:
                log.warning("taking the cluster config from etcd (epoch %d)", record.view.epoch)
                self.config = record.config
            for member in record.view:
                self.health.setdefault(member.id, Health())
            self._adopt(record.view, record.crashed)
            log.info("adopted epoch %d from etcd", record.view.epoch)

    def follow(self, leader_url: str, headers: dict[str, str], interval: float) -> None:
        """Follow the router at ``leader_url``: poll its ring every ``interval``
        seconds and adopt each newer view (from the nodes, with their config)."""
        self.leader_url = leader_url
        self._coordination.append(
            asyncio.create_task(self._follow_loop(leader_url, headers, interval))
        )

    async def first_follow(
        self, leader_url: str, headers: dict[str, str], limit: float = 5.0
    ) -> None:
        """Before a follower serves: the leader's view, if it has one within
        ``limit`` seconds. A follower that served first would answer ``no_nodes``
        until its first poll (the leader may still be making the first view);
        a leader whose ring is really empty costs the follower ``limit`` once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        while not len(self.view) and loop.time() < deadline:
            if await self.follow_once(leader_url, headers):
                return
            await asyncio.sleep(0.1)

    async def _follow_loop(self, leader_url: str, headers: dict[str, str], interval: float) -> None:
        while True:
            try:
                await self.follow_once(leader_url, headers)
            except Exception as exc:  # the loop outlives any one failure, never silently
                self.failures.record("follow_loop", exc)
            await asyncio.sleep(interval)

    async def follow_once(self, leader_url: str, headers: dict[str, str]) -> bool:
        """One poll of the leader's ring; True if a newer view was adopted.

        The leader adopts a view only after pushing it to its members, so the
        view it shows is one the nodes already hold: adopting it here is as safe
        as learning it from a node that refuses a key (:meth:`catch_up`), and
        works for nodes that keep no view (the Redis backend's).
        """
        try:
            response = await self._client.get(
                leader_url.rstrip("/") + "/admin/ring", headers=headers, timeout=2.0
            )
            data = response.json()
            nodes = [
                {k: n[k] for k in ("id", "url", "weight")}
                for n in data["nodes"]
                if n.get("state") != "joining"
            ]
            view = RingView.from_dict({"epoch": data["epoch"], "nodes": nodes})
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.debug("could not poll the leader at %s: %s", leader_url, exc)
            return False
        if view.epoch <= self.view.epoch or not len(view):
            return False
        self._highest = max(self._highest, view.epoch)
        for member in view:
            self.health.setdefault(member.id, Health())
        self._adopt(view)
        log.info("adopted epoch %d from the leader at %s", view.epoch, leader_url)
        return True

    async def _watch(self) -> None:
        assert self.coordinator is not None
        # aclosing: on cancellation the generator (a gRPC stream) is closed now,
        # not at the event loop's shutdown.
        async with contextlib.aclosing(self.coordinator.watch(self._revision)) as records:
            async for record in records:
                self._take(record)

    async def _on_lead(self) -> None:
        """Leadership won: finish a change the last leader left half-done.

        Leases the previous leader granted may run for up to one lease after
        it stepped down: no member is removed before they have certainly ended.
        """
        now = asyncio.get_running_loop().time()
        bound = now + self.lease_seconds * (1 + DEFAULT_DRIFT)
        for health in self.health.values():
            health.lease_until = max(health.lease_until, bound)
            health.failures = 0
        self.leasing = True
        self._spawn(self._take_lead())

    async def _take_lead(self) -> None:
        # Leases first (granted, then required by a push of the current view), so
        # that no node is left without one; then any change left half-done.
        try:
            async with self.lock:
                await asyncio.gather(*(self._renew(m) for m in self.view))
                await self._push_all(self.view, None, ())
            self.leading = True
            log.warning("took the lead at epoch %d", self.view.epoch)
            await self._roll_forward()
        except Exception:
            log.exception("taking the lead failed")

    async def _on_lose(self) -> None:
        self.leading = False
        self.leasing = False

    async def _roll_forward(self) -> None:
        assert self.coordinator is not None
        async with self.lock:
            try:
                record = await self.coordinator.load()
            except CoordinatorError as exc:
                log.warning("could not read the ring from etcd: %s", exc)
                return
            if record is None:
                return
            if record.settled:
                self._take(record)  # a view this router may have missed
                return
            view = record.view
            log.warning("finishing the change to epoch %d left by the last leader", view.epoch)
            previous = record.previous if record.previous is not None else RingView.empty()
            crashed = record.crashed
            newcomers = [m for m in view if m.id not in previous]
            # The order of a join: newcomers learn the config first, then whoever
            # loses keys, then the newcomers get the view.
            ready = self.ready_timeout
            await self._push(newcomers, previous, None, (), tolerate=True, seconds=ready)
            # Leases before the view that makes the newcomers owners (as in a join):
            # the push above made them require one, and without it they would
            # refuse their first requests (lease_expired) and the router would
            # fail those open. (The first view of a cluster is such a roll-forward.)
            await asyncio.gather(*(self._renew(m) for m in newcomers))
            failed = await self._push(previous.members, view, previous, crashed, tolerate=True)
            failed += await self._push(newcomers, view, previous, (), tolerate=True)
            self._remember(previous, record.crashed)
            for member in view:
                self.health.setdefault(member.id, Health())
            self._adopt(view, crashed)
            await self._settle(record)
            await self._crash_unresponsive(failed)

    async def _commit(
        self, view: RingView, previous: RingView, crashed: tuple[str, ...]
    ) -> ViewRecord | None:
        """Record a change in etcd before carrying it out (no coordinator: nothing)."""
        if self.coordinator is None:
            return None
        record = ViewRecord(view, previous, crashed, self.config, settled=False)
        # A write that did not change the view (the record of ``previous`` marked
        # settled by the router that made it, after this one read it) moves the
        # revision without invalidating the change: build on the new revision.
        # Bounded: each retry needs another write to etcd in between.
        for _ in range(3):
            try:
                committed = await self.coordinator.commit(record, expected=self._revision)
                if committed is not None:
                    self._revision = committed.revision
                    return committed
                latest = await self.coordinator.load()
            except CoordinatorError as exc:
                raise MembershipError(503, "coordinator_unavailable", str(exc)) from None
            if latest is None:
                break
            self._take(latest)
            self._revision = latest.revision
            if latest.view != previous:
                break
        raise MembershipError(409, "ring_changed", "another router changed the ring first; retry")

    async def _settle(self, record: ViewRecord | None) -> ViewRecord | None:
        """Mark a committed change as carried out, so every router adopts it."""
        if self.coordinator is None or record is None:
            return record
        done = ViewRecord(
            record.view, record.previous, record.crashed, record.config, True, record.revision
        )
        try:
            settled = await self.coordinator.commit(done, expected=record.revision)
        except CoordinatorError as exc:
            log.warning("could not mark epoch %d settled: %s", record.view.epoch, exc)
            return None
        if settled is not None:
            self._revision = settled.revision
        return settled

    async def close(self) -> None:
        was_leading = self.leading and self.coordinator is not None
        for coordination in self._coordination:
            coordination.cancel()
        for coordination in self._coordination:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await coordination
        if self.coordinator is not None:
            if was_leading and self.advertise:
                await self.coordinator.resign(self.advertise)
            await self.coordinator.close()
        tasks: list[asyncio.Future[Any]] = [
            *self._background,
            *self._joins.values(),
            *([self._health_task] if self._health_task else []),
        ]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._owned:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        """The control plane's HTTP client (pushes, probes, calls to the leader)."""
        return self._client

    # ------------------------------------------------------------------ changes

    async def join(self, member: Member) -> RingView:
        """Add a member: readiness first (outside the lock), then the push protocol.

        The readiness wait is bounded by ``ready_timeout`` and holds no lock, so a
        join that cannot become ready (a mistyped URL, a node still starting)
        never delays the removal of a crashed member or another change.
        """
        underway = self._joins.get(member.id)
        if underway is not None:
            if self.joining.get(member.id) != member:
                raise MembershipError(
                    409,
                    "join_in_progress",
                    f"node {member.id!r} is joining with another url or weight; wait for it",
                )
            # The same registration twice (a node's retry, a rejoin by the health
            # loop): both get the one outcome.
            return await asyncio.shield(underway)
        task = self._joins[member.id] = asyncio.ensure_future(self._join(member))
        self.joining[member.id] = member
        try:
            return await asyncio.shield(task)
        finally:
            if task.done():
                self._joins.pop(member.id, None)
                self.joining.pop(member.id, None)
            else:
                task.add_done_callback(lambda _: self._join_done(member.id, task))

    def _join_done(self, member_id: str, task: asyncio.Future[RingView]) -> None:
        if self._joins.get(member_id) is task:
            del self._joins[member_id]
            self.joining.pop(member_id, None)
        if not task.cancelled():
            task.exception()  # retrieved: a caller that went away is not an error

    async def _join(self, member: Member) -> RingView:
        async with self.lock:
            if await self._already_joined(member):
                return self.view
        await self._wait_ready(member)
        async with self.lock:
            if await self._already_joined(member):
                return self.view
            return await self._join_locked(member)

    async def _already_joined(self, member: Member) -> bool:
        """True for a repeated registration of a healthy member (nothing to do)."""
        if member.id not in self.view:
            return False
        if self.view.member(member.id) != member:
            raise MembershipError(
                409,
                "already_member",
                f"node {member.id!r} is already in the ring with another url or weight",
            )
        if await self._node_epoch(member) == self.view.epoch:
            return True
        # The member registers again without the current view: it restarted and
        # lost its state. Its old incarnation crashed; the new one joins.
        log.warning("node %s re-registered after a restart: crash, then join", member.id)
        await self._crash_locked(member.id, reason="it registered again after a restart")
        return False

    async def _join_locked(self, member: Member) -> RingView:
        # First the newcomer gets the cluster's config, with the current view
        # (in which it owns nothing): the states the old members are about to
        # hand it are kept only for rules it knows, and a node started with
        # --join has no rules of its own. If it was removed as crashed before,
        # this also makes it hand back what it held to the current owners.
        crashed = (member.id,) if member.id in self.removed else ()
        await self._push([member], self.view, None, crashed, seconds=self.ready_timeout)
        health = Health(state="joining")
        if self.leasing:
            # Its lease before it owns anything, so its first requests are decided.
            await self._renew(member, health)
        previous = self.view
        new = self._next_view([*(m for m in previous if m.id != member.id), member])
        committed = await self._commit(new, previous, ())
        # Old members lose keys to the newcomer: they go first. A member that
        # does not take the view does not stop the change half-way (others
        # already hold it): the change is adopted, then the failed ones are
        # removed as crashed, under a newer epoch.
        failed = await self._push(previous.members, new, previous, (), tolerate=True)
        failed += await self._push([member], new, previous, (), tolerate=True)
        self._remember(previous, ())
        self._adopt(new)
        await self._settle(committed)
        health.state = "active"
        self.health[member.id] = health
        if member.id in failed:
            # It owned nothing before this view: removed at once, not budgeted.
            await self._crash_locked(member.id, reason="did not take its first view")
        await self._crash_unresponsive([m for m in failed if m != member.id])
        if member.id in failed:
            raise MembershipError(
                502, "join_failed", f"node {member.id} did not take the new view; removed"
            )
        log.info("node %s joined: epoch %d", member.id, new.epoch)
        return new

    async def _node_epoch(self, member: Member) -> int | None:
        try:
            response = await self._client.get(
                member.url.rstrip("/") + "/healthz", timeout=self.health_timeout
            )
            return int(response.json().get("epoch", 0))
        except (httpx.HTTPError, ValueError, TypeError, AttributeError):
            return None

    async def leave(self, member_id: str) -> RingView:
        """Graceful leave: the leaving node hands everything off before it is dropped."""
        async with self.lock:
            if member_id not in self.view:
                raise MembershipError(404, "unknown_node", f"no node {member_id!r} in the ring")
            self.health.setdefault(member_id, Health()).state = "leaving"
            previous = self.view
            leaving = previous.member(member_id)
            new = self._next_view(m for m in previous if m.id != member_id)
            committed = await self._commit(new, previous, ())
            try:
                await self._push([leaving], new, previous, (), tolerate=False)
            except MembershipError:
                log.warning("node %s did not take the leave; treating it as a crash", member_id)
                # An operator's removal: no quorum, but its lease still bounds it.
                await self._crash_unresponsive(
                    [member_id], reason="did not take the leave", budgeted=False
                )
                self.health.pop(member_id, None)
                return self.view
            failed = await self._push(new.members, new, previous, (), tolerate=True)
            self._remember(previous, ())
            self._adopt(new)
            await self._settle(committed)
            self.health.pop(member_id, None)
            await self._crash_unresponsive(failed)
            log.info("node %s left: epoch %d", member_id, new.epoch)
            return new

    async def crash(self, member_id: str, reason: str = "unreachable") -> RingView | None:
        """Drop a node that stopped answering; its keys follow the crash policy."""
        async with self.lock:
            return await self._crash_locked(member_id, reason=reason)

    async def _crash_locked(self, member_id: str, *, reason: str) -> RingView | None:
        if member_id not in self.view:
            return None
        previous = self.view
        new = self._next_view(m for m in previous if m.id != member_id)
        committed = await self._commit(new, previous, (member_id,))
        # A member that misses this push learns the view from the health loop
        # (refresh_node, with the crashes it missed); removing it too would be a
        # cascade, so it is not removed for this.
        await self._push(new.members, new, previous, (member_id,), tolerate=True)
        self._remember(previous, (member_id,))
        crashed = previous.member(member_id)
        self.removed[member_id] = crashed
        while len(self.removed) > MAX_REMOVED:
            del self.removed[next(iter(self.removed))]
        self._adopt(new)
        await self._settle(committed)
        self.health.pop(member_id, None)
        self.crashes += 1
        log.warning("node %s removed as crashed (%s): epoch %d", member_id, reason, new.epoch)
        # If it is only slow, or cut off from our probes but not from other
        # routers, it must stop deciding: tell it too (best effort, not waited
        # for). It discards its states and may rejoin later as a new member.
        self._spawn(self._push([crashed], new, previous, (member_id,), tolerate=True))
        return new

    async def _crash_unresponsive(
        self,
        failed: Iterable[str],
        *,
        reason: str = "did not take a new view",
        budgeted: bool = True,
    ) -> None:
        """Remove, as crashed, members that did not take a committed view (lock held).

        Within the removal budget's quorum (router/removal.py): when so many
        failed that removing them would leave no majority, this router suspects
        itself (a blip of its own network or host) and keeps them; the health
        loop sends them the view, with every crash they missed, once they answer
        (refresh_node). And only once every lease granted to them has certainly
        ended: they get no more renewals, and the removal waits out the rest, so
        a member that is alive but failed the push (a pause, an error) cannot
        decide on old state while its keys move on.
        """
        ids = [m for m in dict.fromkeys(failed) if m in self.view]
        if not ids:
            return
        size = len(self.view)
        if budgeted and size - len(ids) <= self.budget.quorum * size:
            self.stats["deferred_quorum"] += len(ids)
            log.warning(
                "%d of %d members did not take epoch %d: suspecting this router's own "
                "network or host; keeping them (they get the view when they answer)",
                len(ids),
                size,
                self.view.epoch,
            )
            return
        loop = asyncio.get_running_loop()
        self._condemned.update(ids)
        try:
            until = max(
                (h.lease_until for m in ids if (h := self.health.get(m)) is not None),
                default=float("-inf"),
            )
            if until > loop.time():
                self.stats["deferred_lease"] += len(ids)
                await asyncio.sleep(until - loop.time())
            for member_id in ids:
                await self._crash_locked(member_id, reason=reason)
        finally:
            self._condemned.difference_update(ids)

    async def settle(self) -> None:
        """Wait for the repairs the health loop started (rejoins, refreshes)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    async def _rejoin(self, member: Member) -> None:
        with contextlib.suppress(MembershipError):
            await self.join(member)

    def _in_background(self, member_id: str, coro: Any) -> None:
        """Run one repair per member at a time, without blocking the health loop."""
        if member_id in self._repairing:
            coro.close()
            return
        self._repairing.add(member_id)
        task = self._spawn(coro)
        task.add_done_callback(lambda _: self._repairing.discard(member_id))

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(self._report)
        return task

    def _report(self, task: asyncio.Task[Any]) -> None:
        """A background repair that failed is counted and logged, not lost."""
        if not task.cancelled() and (exc := task.exception()) is not None:
            self.failures.record("background_task", exc)

    def _adopt(self, view: RingView, crashed: Iterable[str] = ()) -> None:
        self.events.change(self.view, view, crashed={*self.removed, *crashed})
        self.view = view
        for member_id in [m for m in self.removed if m in view]:
            del self.removed[member_id]
        self._save_state()
        self.changed.set()
        self.changed = asyncio.Event()

    # ------------------------------------------------------------------ stale views

    async def catch_up(self, epoch: int, node_url: str) -> None:
        """A node knows a newer epoch than this router: wait for our change or fetch it."""
        if self.view.epoch >= epoch:
            return
        if self.lock.locked():
            await self.wait_for_change()
            if self.view.epoch >= epoch:
                return
        try:
            response = await self._client.get(
                node_url.rstrip("/") + "/internal/cluster", headers=self._headers
            )
            data = response.json()
            view = RingView.from_dict(data["ring"])
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            log.warning("could not fetch the newer view from %s: %s", node_url, exc)
            return
        if view.epoch > self.view.epoch:
            config = data.get("config")
            if config:
                with contextlib.suppress(ValueError):
                    self.config = ClusterConfig.from_dict(config, source="node config")
            for member in view:
                self.health.setdefault(member.id, Health())
            self._adopt(view)
            log.info("adopted epoch %d from %s", view.epoch, node_url)

    async def wait_for_change(self, limit: float = 5.0) -> None:
        """Wait (at most ``limit`` seconds) for the change under way to be adopted."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.changed.wait(), timeout=limit)

    async def newer_view(self, unreachable: Member, *, every: float = 0.5) -> bool:
        """An owner did not answer: is this router's view stale (it left, or was
        replaced)? Ask the other members; adopt a newer view if one has it.

        Returns True when the view changed (the request should be routed
        again) and False when the rule's on_error must decide. Concurrent
        callers share one check, and the members are asked at most once per
        ``every`` seconds, so a dead owner does not multiply the traffic.
        """
        if unreachable.id not in self.view or self.view.member(unreachable.id) != unreachable:
            return True  # the view changed since the request picked its owner
        task = self._newer_check
        if task is None or task.done():
            loop = asyncio.get_running_loop()
            if loop.time() - self._newer_checked_at < every:
                return False
            self._newer_checked_at = loop.time()
            task = self._newer_check = self._spawn(self._ask_newer(unreachable.id))
        return bool(await asyncio.shield(task))

    async def _ask_newer(self, unreachable: str) -> bool:
        epoch = self.view.epoch
        others = [m for m in self.view if m.id != unreachable]
        found = await self._discover(others, with_urls=True)
        if found is None or found[0].epoch <= epoch:
            return False
        await self.catch_up(found[0].epoch, found[1])
        return self.view.epoch > epoch

    async def refresh_node(self, member: Member, node_epoch: int) -> None:
        """A node is behind this router's view: push it the current view again.

        A node at epoch 0 while the ring is older has restarted and lost its
        state: it is treated as crashed (its keys follow the crash policy) and
        then joins again as a new member.
        """
        if node_epoch == 0 and self.view.epoch > 0 and member.id in self.view:
            if self.lock.locked():
                # Someone is already making a change (perhaps this very one):
                # let the request retry on its outcome rather than at once.
                await self.wait_for_change()
                return
            log.warning("node %s restarted with no state: crash, then rejoin", member.id)
            with contextlib.suppress(MembershipError):
                await self.join(member)
            return
        # Send the node its own previous view and every crash it missed, so its
        # crash policy (replica promotion, conservative) still applies.
        previous = self._history.get(node_epoch)
        missed = tuple(
            m for epoch, ids in sorted(self._crashed_at.items()) if epoch > node_epoch for m in ids
        )
        await self._push([member], self.view, previous, missed, tolerate=True)

    # ------------------------------------------------------------------ pushing

    async def _push_all(
        self, view: RingView, previous: RingView | None, crashed: Iterable[str]
    ) -> None:
        await self._push(view.members, view, previous, tuple(crashed), tolerate=True)

    async def _push(
        self,
        members: Iterable[Member],
        view: RingView,
        previous: RingView | None,
        crashed: tuple[str, ...] | Iterable[str],
        *,
        tolerate: bool = False,
        seconds: float | None = None,
    ) -> list[str]:
        """Send a view; returns the ids that did not take it (raises unless ``tolerate``).

        ``seconds`` bounds a push that carries no handoff (the default, the
        client's push timeout, leaves room for a node to deliver its states).
        """
        members = list(members)
        self._highest = max(self._highest, view.epoch)
        payload: dict[str, Any] = {
            "ring": view.to_dict(),
            "previous": previous.to_dict() if previous is not None else None,
            "crashed": list(crashed),
            "config": self.config.to_dict(),
            "wait": True,
        }
        if self.leasing:
            # Only the router that removes members on its own probes makes nodes
            # require a lease; others leave the setting as it is.
            payload["lease"] = self.lease_seconds
        extra: dict[str, Any] = {} if seconds is None else {"timeout": seconds}

        async def push(member: Member) -> None:
            try:
                response = await self._client.put(
                    member.url.rstrip("/") + "/internal/cluster",
                    json=payload,
                    headers=self._headers,
                    **extra,
                )
            except httpx.HTTPError as exc:
                raise MembershipError(
                    502, "push_failed", f"node {member.id} unreachable: {type(exc).__name__}"
                ) from None
            if response.status_code != 200:
                raise MembershipError(
                    502, "push_failed", f"node {member.id} answered HTTP {response.status_code}"
                )

        results = await asyncio.gather(*(push(m) for m in members), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and not tolerate:
            raise errors[0]
        for error in errors:
            log.warning("push of epoch %d: %s", view.epoch, error)
        return [m.id for m, r in zip(members, results, strict=True) if isinstance(r, BaseException)]

    def _next_view(self, members: Iterable[Member]) -> RingView:
        """A view after the current one, with an epoch never used before.

        Epochs only grow, even past views that were pushed to some nodes but
        never adopted here: a node ignores a view whose epoch it has seen.
        """
        self._highest = max(self._highest, self.view.epoch) + 1
        return RingView.of(members, epoch=self._highest)

    def _remember(self, previous: RingView, crashed: Iterable[str]) -> None:
        """Keep recent views and crashes, for nodes that miss a push (see refresh_node)."""
        self._history[previous.epoch] = previous
        for member_id in crashed:
            self._crashed_at[self._highest] = (*self._crashed_at.get(self._highest, ()), member_id)
        for epoch in sorted(self._history)[:-MAX_HISTORY]:
            del self._history[epoch]
        for epoch in sorted(self._crashed_at)[:-MAX_HISTORY]:
            del self._crashed_at[epoch]

    async def push_config(self, config: ClusterConfig) -> None:
        async with self.lock:
            self.config = config
            await self._push_all(self.view, None, ())

    async def _wait_ready(self, member: Member) -> None:
        """Readiness gate: a joining node must answer, as itself, before it is
        given any key. A URL that reaches another member, a router or anything
        else that does not call itself ``member.id`` is refused at once."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ready_timeout
        while True:
            try:
                response = await self._client.get(
                    member.url.rstrip("/") + "/healthz", timeout=self.health_timeout
                )
                if response.status_code == 200:
                    answered = _node_id(response)
                    if answered == member.id:
                        return
                    raise MembershipError(
                        409,
                        "wrong_node",
                        f"{member.url} answers as "
                        + (f"node {answered!r}" if answered else "something that is not a node")
                        + f", not as {member.id!r}: check the node's --url and --id",
                    )
            except httpx.HTTPError:
                pass
            if loop.time() > deadline:
                raise MembershipError(
                    504,
                    "not_ready",
                    f"node {member.id} at {member.url} did not answer /healthz within "
                    f"{self.ready_timeout:g}s",
                )
            await asyncio.sleep(0.05)

    async def _renew(self, member: Member, health: Health | None = None) -> dict[str, Any] | None:
        """Probe a member and renew its lease (node/lease.py); None if it did not answer.

        Two round trips: the probe takes the node's offer, and the grant follows
        at once, so each round leaves the node a whole lease less one round
        trip (a router slowed down by load still renews in time). Before the
        grant is sent the router records until when it may keep the node
        deciding (the offer's arrival plus the lease, with the drift allowance).
        """
        if health is None:
            health = self.health.setdefault(member.id, Health())
        data = await self._lease_call(member, None)
        if data is None:
            return None
        token = data.get("token")
        health.token = token if isinstance(token, str) else None
        health.offered_at = asyncio.get_running_loop().time()
        if not self.leasing or health.token is None or member.id in self._condemned:
            return data
        health.lease_until = max(
            health.lease_until,
            lease_bound(health.offered_at, self.lease_seconds, DEFAULT_DRIFT),
        )
        granted = await self._lease_call(member, health.token)
        if granted is not None:
            self.stats["lease_renewals"] += 1
            return granted
        return data

    async def _lease_call(self, member: Member, grant: str | None) -> dict[str, Any] | None:
        body: dict[str, Any] = {"grant": grant}
        if grant is not None:
            body["seconds"] = self.lease_seconds
        try:
            response = await self._client.post(
                member.url.rstrip("/") + "/internal/lease",
                json=body,
                headers=self._headers,
                timeout=self.health_timeout,
            )
            data = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("probe of %s failed: %s", member.id, exc)
            return None
        if response.status_code != 200 or not isinstance(data, dict):
            log.debug("probe of %s: HTTP %d", member.id, response.status_code)
            return None
        return data

    @typing.overload
    async def _discover(self, members: list[Member]) -> RingView | None: ...

    @typing.overload
    async def _discover(
        self, members: list[Member], *, with_urls: typing.Literal[True]
    ) -> tuple[RingView, str] | None: ...

    async def _discover(self, members: list[Member], *, with_urls: bool = False) -> Any:
        """The newest view the members know (and, with ``with_urls``, who knows it)."""

        async def ask(member: Member) -> tuple[RingView, str] | None:
            try:
                response = await self._client.get(
                    member.url.rstrip("/") + "/internal/cluster",
                    timeout=self.health_timeout,
                    headers=self._headers,
                )
                ring = response.json().get("ring")
                return (RingView.from_dict(ring), member.url) if ring else None
            except (httpx.HTTPError, ValueError, TypeError, AttributeError):
                return None

        answers = [a for a in await asyncio.gather(*(ask(m) for m in members)) if a is not None]
        best = max(answers, key=lambda a: a[0].epoch, default=None)
        if best is None:
            return None
        return best if with_urls else best[0]

    # ------------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            if not self.leading:
                continue  # with etcd, only the leader probes, removes and grants leases
            try:
                # Removals run beside the loop: one waits for the lock (a change
                # under way), and leases must keep being renewed meanwhile.
                await self.check_health(wait=False)
            except Exception as exc:  # the loop outlives any one failure, never silently
                self.failures.record("health_loop", exc)

    async def check_health(self, *, wait: bool = True) -> None:
        """One round: probe every member (renewing leases), then start the
        removals the budget allows; ``wait`` for them (the loop does not)."""
        view = self.view

        async def probe(member: Member) -> bool:
            health = self.health.setdefault(member.id, Health())
            data = await self._renew(member, health)
            if data is None:
                health.failures += 1
                return False
            health.failures = 0
            try:
                health.epoch_seen = int(data.get("epoch", 0))
            except (TypeError, ValueError):
                health.epoch_seen = 0
            health.backend_available = bool(data.get("backend_available", True))
            if health.epoch_seen < view.epoch and not self.lock.locked():
                # In the background: a rejoin can take a readiness wait and several
                # pushes, and must not delay the detection of other nodes' crashes.
                self._in_background(member.id, self.refresh_node(member, health.epoch_seen))
            return True

        async def probe_removed(member: Member) -> None:
            try:
                response = await self._client.get(
                    member.url.rstrip("/") + "/healthz", timeout=self.health_timeout
                )
            except httpx.HTTPError:
                return
            if response.status_code == 200 and not self.lock.locked():
                log.warning("node %s answers again after its removal: it rejoins", member.id)
                self._in_background(member.id, self._rejoin(member))

        answered = await asyncio.gather(*(probe(m) for m in view))
        degraded = self.backend_degraded
        if degraded != self._was_degraded:
            self._was_degraded = degraded
            if degraded:
                log.warning("shared backend down on a node: routing stickily to local limiters")
            else:
                log.warning("shared backend back on every node: routing as configured again")
        failed = [m.id for m, ok in zip(view, answered, strict=True) if not ok]
        removals = self._remove_failed(view, failed)
        if wait and removals:
            await asyncio.gather(*removals)
        await asyncio.gather(
            *(probe_removed(m) for m in list(self.removed.values()) if m.id not in self.view)
        )

    def _remove_failed(self, view: RingView, unreachable: list[str]) -> list[asyncio.Task[Any]]:
        """Start removing the members that failed ``failure_threshold`` probes in
        a row, within the removal budget (router/removal.py); returns the tasks."""
        due = [
            m.id
            for m in view
            if (h := self.health.get(m.id)) is not None
            and h.failures >= self.failure_threshold
            and m.id not in self._removing
        ]
        now = asyncio.get_running_loop().time()
        plan = self.budget.plan(
            now,
            view.ids,
            unreachable,
            due,
            {m: h.lease_until for m, h in self.health.items()},
        )
        if plan.suspect_self != self.suspect_self:
            self.suspect_self = plan.suspect_self
            if plan.suspect_self:
                self.stats["self_suspected"] += 1
                log.warning(
                    "%d of %d members unreachable at once: suspecting this router's own "
                    "network or host; keeping the ring (on_error answers for their keys)",
                    len(unreachable),
                    len(view),
                )
            else:
                log.warning("members reachable again: no longer suspecting this router")
        for member_id, reason in plan.deferred.items():
            self.stats[f"deferred_{reason}"] += 1
            if reason != "lease":
                log.info("removal of %s deferred (%s budget)", member_id, reason)
        started: list[asyncio.Task[Any]] = []
        for member_id in plan.remove:
            # The rate counts from the decision: a removal still waiting for the
            # lock is one of this interval's.
            self.budget.removed(now)
            task = self._removing[member_id] = self._spawn(self._remove_crashed(member_id))
            started.append(task)
        return started

    async def _remove_crashed(self, member_id: str) -> None:
        # No renewal from the decision on: if it answers again while the removal
        # waits for the lock, its lease must not outlive the removal.
        self._condemned.add(member_id)
        try:
            if await self.crash(member_id, reason="failed its health checks") is not None:
                # And again from its end: the next removal waits one interval
                # after this one took effect, however long it waited for the lock.
                self.budget.removed(asyncio.get_running_loop().time())
                self.stats["removed_crashed"] += 1
        finally:
            self._removing.pop(member_id, None)
            self._condemned.discard(member_id)

    @property
    def backend_degraded(self) -> bool:
        return any(not h.backend_available for h in self.health.values())

    # ------------------------------------------------------------------ state file

    def describe(self) -> dict[str, Any]:
        nodes = [{**m.to_dict(), "state": self.health.get(m.id, Health()).state} for m in self.view]
        nodes += [{**m.to_dict(), "state": "joining"} for m in self.joining.values()]
        data: dict[str, Any] = {"epoch": self.view.epoch, "nodes": nodes}
        if self.coordinator is not None:
            data["coordinator"] = {"etcd": self.coordinator.where, "leading": self.leading}
        elif self.leader_url is not None:
            data["leader"] = self.leader_url
        data["events"] = [e.to_dict() for e in reversed(self.events.last(MAX_EVENTS))]
        return data

    def _save_state(self) -> None:
        if self.state_file is None:
            return
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.state_file.parent, prefix=".ring-")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(self.view.to_dict(), handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.state_file)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise

    def _load_state(self) -> RingView | None:
        if self.state_file is None or not self.state_file.exists():
            return None
        try:
            return RingView.from_dict(json.loads(self.state_file.read_text()))
        except (ValueError, TypeError) as exc:
            raise MembershipError(
                500, "bad_state_file", f"{self.state_file}: cannot read ring state: {exc}"
            ) from None


def _node_id(response: httpx.Response) -> str | None:
    """The id a /healthz answer gives (nodes say ``node``; routers say nothing)."""
    try:
        data = response.json()
    except ValueError:
        return None
    value = data.get("node") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None
