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

The parts: router/viewlog.py is the I/O-free view log (epochs, history,
crashed members, and the push plan of each change); router/nodeclient.py
the HTTP calls to nodes; router/health.py the health monitor (probes,
leases, removals); router/statefile.py the state file. This module is the
driver tying them together: the lock, the tasks, etcd, and carrying out
each plan.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from node.config import ClusterConfig
from node.failures import Failures
from node.lease import DEFAULT_DRIFT
from ring import Member, RingView
from router.coordinator import CoordinatorError, EtcdCoordinator, ViewRecord
from router.events import EventLog
from router.health import Health, HealthMonitor
from router.nodeclient import NodeClient, push_body
from router.removal import RemovalBudget
from router.statefile import load_view, save_view
from router.viewlog import MAX_HISTORY, MAX_REMOVED, Change, MembershipError, Push, ViewLog

__all__ = [
    "MAX_EVENTS",
    "MAX_HISTORY",
    "MAX_REMOVED",
    "Health",
    "Membership",
    "MembershipError",
]

log = logging.getLogger("ringlimit.router")

#: Membership events listed by ``GET /admin/ring`` (``ringlimit up`` reports from them).
MAX_EVENTS = 64


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
        #: The view, the epochs used, history and crashed members (router/viewlog.py).
        self.log = ViewLog()
        self.health: dict[str, Health] = {}
        self.joining: dict[str, Member] = {}
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
        #: The HTTP calls to nodes (router/nodeclient.py).
        self.nodes = NodeClient(self._client, internal_token)
        #: Probes, leases and removals on probe failures (router/health.py).
        self.monitor = HealthMonitor(self, self._spawn)
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._newer_check: asyncio.Task[bool] | None = None
        self._joins: dict[str, asyncio.Future[RingView]] = {}
        self._newer_checked_at = float("-inf")
        #: The leading router's URL when this one follows it (router/workers.py).
        self.leader_url: str | None = None

    @property
    def view(self) -> RingView:
        """The view this router routes by."""
        return self.log.view

    @property
    def removed(self) -> dict[str, Member]:
        """Members removed as crashed: still probed, and made to rejoin (as new
        members, their old state discarded) when they answer again."""
        return self.log.removed

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
        discovered = await self.nodes.discover(candidates, self.health_timeout)
        best = max(
            [v for v in (recovered, discovered) if v is not None],
            key=lambda v: v.epoch,
            default=None,
        )
        if best is not None and len(best):
            self.log.view = best
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
        self.log.saw(record.view.epoch)
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
            view = await self.nodes.leader_ring(leader_url, headers)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.debug("could not poll the leader at %s: %s", leader_url, exc)
            return False
        if view.epoch <= self.view.epoch or not len(view):
            return False
        self.log.saw(view.epoch)
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
            log.warning(
                "finishing the change to epoch %d left by the last leader", record.view.epoch
            )
            change = self.log.roll_forward(record.view, record.previous, record.crashed)
            # Leases before the view that makes the newcomers owners (as in a join):
            # the welcome made them require one, and without it they would
            # refuse their first requests (lease_expired) and the router would
            # fail those open. (The first view of a cluster is such a roll-forward.)
            failed = await self._carry_out(change)
            self.log.remember(change.previous, record.crashed)
            for member in change.view:
                self.health.setdefault(member.id, Health())
            self._adopt(change.view, change.crashed)
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
        if not self.log.registered(member):
            return False
        if await self.nodes.epoch(member, self.health_timeout) == self.view.epoch:
            return True
        # The member registers again without the current view: it restarted and
        # lost its state. Its old incarnation crashed; the new one joins.
        log.warning("node %s re-registered after a restart: crash, then join", member.id)
        await self._crash_locked(member.id, reason="it registered again after a restart")
        return False

    async def _join_locked(self, member: Member) -> RingView:
        # First the newcomer gets the cluster's config, with the current view
        # (in which it owns nothing): see ViewLog.welcome.
        await self._send(self.log.welcome(member))
        health = Health(state="joining")
        if self.leasing:
            # Its lease before it owns anything, so its first requests are decided.
            await self._renew(member, health)
        change = self.log.join(member)
        committed = await self._commit(change.view, change.previous, ())
        # Old members lose keys to the newcomer: they go first. A member that
        # does not take the view does not stop the change half-way (others
        # already hold it): the change is adopted, then the failed ones are
        # removed as crashed, under a newer epoch.
        failed = await self._carry_out(change)
        self.log.remember(change.previous, ())
        self._adopt(change.view)
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
        log.info("node %s joined: epoch %d", member.id, change.view.epoch)
        return change.view

    async def leave(self, member_id: str) -> RingView:
        """Graceful leave: the leaving node hands everything off before it is dropped."""
        async with self.lock:
            change = self.log.leave(member_id)
            self.health.setdefault(member_id, Health()).state = "leaving"
            committed = await self._commit(change.view, change.previous, ())
            try:
                failed = await self._carry_out(change)
            except MembershipError:
                log.warning("node %s did not take the leave; treating it as a crash", member_id)
                # An operator's removal: no quorum, but its lease still bounds it.
                await self._crash_unresponsive(
                    [member_id], reason="did not take the leave", budgeted=False
                )
                self.health.pop(member_id, None)
                return self.view
            self.log.remember(change.previous, ())
            self._adopt(change.view)
            await self._settle(committed)
            self.health.pop(member_id, None)
            await self._crash_unresponsive(failed)
            log.info("node %s left: epoch %d", member_id, change.view.epoch)
            return change.view

    async def crash(self, member_id: str, reason: str = "unreachable") -> RingView | None:
        """Drop a node that stopped answering; its keys follow the crash policy."""
        async with self.lock:
            return await self._crash_locked(member_id, reason=reason)

    async def _crash_locked(self, member_id: str, *, reason: str) -> RingView | None:
        change = self.log.crash(member_id)
        if change is None:
            return None
        committed = await self._commit(change.view, change.previous, change.crashed)
        # A member that misses this push learns the view from the health loop
        # (refresh_node, with the crashes it missed); removing it too would be a
        # cascade, so it is not removed for this.
        await self._carry_out(change)
        self.log.remember(change.previous, change.crashed)
        self.log.bury(change.previous.member(member_id))
        self._adopt(change.view)
        await self._settle(committed)
        self.health.pop(member_id, None)
        self.crashes += 1
        log.warning(
            "node %s removed as crashed (%s): epoch %d", member_id, reason, change.view.epoch
        )
        # If it is only slow, or cut off from our probes but not from other
        # routers, it must stop deciding: tell it too (best effort, not waited
        # for). It discards its states and may rejoin later as a new member.
        for push in change.afterwards:
            self._spawn(self._send(push))
        return change.view

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
        plan = self.log.unresponsive(
            failed,
            quorum=self.budget.quorum,
            lease_until={m: h.lease_until for m, h in self.health.items()},
            now=asyncio.get_running_loop().time(),
            budgeted=budgeted,
        )
        if not plan.crash:
            return
        if plan.defer_quorum:
            self.stats["deferred_quorum"] += len(plan.crash)
            log.warning(
                "%d of %d members did not take epoch %d: suspecting this router's own "
                "network or host; keeping them (they get the view when they answer)",
                len(plan.crash),
                len(self.view),
                self.view.epoch,
            )
            return
        condemned = self.monitor.condemned
        condemned.update(plan.crash)
        try:
            if plan.wait > 0:
                self.stats["deferred_lease"] += len(plan.crash)
                await asyncio.sleep(plan.wait)
            for member_id in plan.crash:
                await self._crash_locked(member_id, reason=reason)
        finally:
            condemned.difference_update(plan.crash)

    async def settle(self) -> None:
        """Wait for the repairs the health loop started (rejoins, refreshes)."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

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
        self.log.adopt(view)
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
            data = await self.nodes.cluster(node_url)
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
        found = await self.nodes.discover(others, self.health_timeout, with_urls=True)
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
        if self.log.lost_state(member, node_epoch):
            if self.lock.locked():
                # Someone is already making a change (perhaps this very one):
                # let the request retry on its outcome rather than at once.
                await self.wait_for_change()
                return
            log.warning("node %s restarted with no state: crash, then rejoin", member.id)
            with contextlib.suppress(MembershipError):
                await self.join(member)
            return
        # Its own previous view and every crash it missed (ViewLog.refresh).
        await self._send(self.log.refresh(member, node_epoch))

    # ------------------------------------------------------------------ pushing

    async def _carry_out(self, change: Change) -> list[str]:
        """Send a plan's pushes, step after step; returns who did not take the view.

        A plan's ``welcome`` goes first, then the newcomers' leases (a view
        that makes them owners must find them leased), then its steps.
        """
        if change.welcome is not None:
            await self._send(change.welcome)
            await asyncio.gather(*(self._renew(m) for m in change.welcome.members))
        failed: list[str] = []
        for push in change.pushes:
            failed += await self._send(push)
        return failed

    async def _send(self, push: Push) -> list[str]:
        seconds = self.ready_timeout if push.ready else None
        return await self._push(
            push.members,
            push.view,
            push.previous,
            push.crashed,
            tolerate=push.tolerate,
            seconds=seconds,
        )

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
        self.log.saw(view.epoch)
        # Only the router that removes members on its own probes makes nodes
        # require a lease; others leave the setting as it is.
        lease = self.lease_seconds if self.leasing else None
        payload = push_body(view, previous, crashed, self.config, lease)
        return await self.nodes.push(
            members, view.epoch, payload, tolerate=tolerate, seconds=seconds
        )

    async def push_config(self, config: ClusterConfig) -> None:
        async with self.lock:
            self.config = config
            await self._push_all(self.view, None, ())

    async def _wait_ready(self, member: Member) -> None:
        await self.nodes.wait_ready(member, self.ready_timeout, self.health_timeout)

    async def _renew(self, member: Member, health: Health | None = None) -> dict[str, Any] | None:
        """Probe a member and renew its lease (router/health.py)."""
        return await self.monitor.renew(member, health)

    # ------------------------------------------------------------------ health

    async def _health_loop(self) -> None:
        await self.monitor.loop()

    async def check_health(self, *, wait: bool = True) -> None:
        """One round: probe every member (renewing leases), then start the
        removals the budget allows; ``wait`` for them (the loop does not)."""
        await self.monitor.check(wait=wait)

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
        if self.state_file is not None:
            save_view(self.state_file, self.view)

    def _load_state(self) -> RingView | None:
        return load_view(self.state_file) if self.state_file is not None else None
