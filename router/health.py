"""The router's health monitor: probes, leases and removals on probe failures.

Every ``health_interval`` seconds the leading router probes each member of
its view; a probe also renews the member's lease (node/lease.py). A member
behind the current view is sent it again; a removed member that answers
again rejoins (probed less often as its removal ages, and forgotten past
``--forget-removed-after``: router/revival.py); a member that failed
``failure_threshold`` probes in a row is removed as crashed, within the
removal budget (router/removal.py: quorum, rate, leases). Repairs and
removals run beside the loop, never in it: one may wait for the membership
lock, and leases must keep being renewed meanwhile. A removal does not wait
behind a change under way, though: it preempts it (Membership.preempt:
pushes to the condemned member are abandoned, members that applied the view
are no longer waited for, and a join not committed yet yields the lock). A
router on etcd that does not lead asks the members only whether their shared
backend (Redis) is up, in round-robin mode, since it routes by that too
(:meth:`HealthMonitor.check_backends`).

The monitor is a part of the membership (router/membership.py) and works on
its state: the view, the per-member :class:`Health`, the lock and the counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import typing
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from node.lease import DEFAULT_DRIFT, lease_bound
from ring import Member, RingView
from router.revival import RevivalProbes
from router.viewlog import MembershipError

if typing.TYPE_CHECKING:
    from router.membership import Membership

log = logging.getLogger("ringlimit.router")


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


class HealthMonitor:
    """The membership's probes; ``spawn`` runs a task the membership tracks
    (waited for by ``settle()``, cancelled by ``close()``, failures counted)."""

    def __init__(
        self,
        membership: Membership,
        spawn: Callable[[Coroutine[Any, Any, Any]], asyncio.Task[Any]],
    ) -> None:
        self.membership = membership
        self._spawn = spawn
        #: Members with a repair under way (a refresh or a rejoin): one at a time.
        self._repairing: set[str] = set()
        self._was_degraded = False
        #: Members being removed (crash in progress): probed, but granted no lease.
        self.condemned: set[str] = set()
        #: Removals the loop started that have not finished (router/removal.py).
        self.removing: dict[str, asyncio.Task[Any]] = {}
        #: When to probe each member removed as crashed, and when to forget it.
        self.revival = RevivalProbes(membership.health_interval, membership.forget_removed_after)

    async def loop(self) -> None:
        m = self.membership
        while True:
            await asyncio.sleep(m.health_interval)
            try:
                if m.leading:
                    # Removals run beside the loop: one waits for the lock (a change
                    # under way), and leases must keep being renewed meanwhile.
                    # Through the membership: its check_health is the seam tests replace.
                    await m.check_health(wait=False)
                elif m.config.balance == "round-robin":
                    # With etcd, only the leader probes, removes and grants leases;
                    # the others still route, so they ask whether Redis is up.
                    await self.check_backends()
            except Exception as exc:  # the loop outlives any one failure, never silently
                m.failures.record("health_loop", exc)

    async def check(self, *, wait: bool = True) -> None:
        """One round: probe every member (renewing leases), then start the
        removals the budget allows; ``wait`` for them (the loop does not)."""
        m = self.membership
        view = m.view
        answered = await asyncio.gather(*(self._probe(member, view) for member in view))
        self._report_degraded()
        failed = [member.id for member, ok in zip(view, answered, strict=True) if not ok]
        removals = self.remove_failed(view, failed)
        if wait and removals:
            await asyncio.gather(*removals)
        await self._probe_all_removed()

    async def check_backends(self) -> None:
        """A router that does not lead (etcd elected another): ask every member's
        ``/healthz`` whether its shared backend (Redis) is up, and nothing else
        (no lease, no failure count, no repair). Its own probes rather than the
        leader's word through etcd: they need nothing of the leader (one that died
        or lost etcd while Redis was down told nobody) and no record in etcd for a
        state that flips with every outage, at one GET per member per interval,
        round-robin clusters only. Before, such a router kept round-robin for the
        whole outage, each user's requests through it reaching every node's fresh
        local limiter. A member that does not answer keeps what it said last."""
        m = self.membership
        view = m.view
        answers = await asyncio.gather(
            *(m.nodes.healthz(member, m.health_timeout) for member in view)
        )
        for member, data in zip(view, answers, strict=True):
            # Only a member still in the view: one that left during the wait had
            # its entry dropped, and put back its "down" kept the router sticky
            # until the next view change, Redis back or not.
            if data is not None and member.id in m.view:
                health = m.health.setdefault(member.id, Health())
                health.backend_available = bool(data.get("backend_available", True))
        self._report_degraded()

    async def _probe(self, member: Member, view: RingView) -> bool:
        m = self.membership
        health = m.health.setdefault(member.id, Health())
        data = await self.renew(member, health)
        if data is None:
            health.failures += 1
            return False
        health.failures = 0
        try:
            health.epoch_seen = int(data.get("epoch", 0))
        except (TypeError, ValueError):
            health.epoch_seen = 0
        health.backend_available = bool(data.get("backend_available", True))
        if health.epoch_seen < view.epoch and not m.lock.locked():
            # In the background: a rejoin can take a readiness wait and several
            # pushes, and must not delay the detection of other nodes' crashes.
            self._in_background(member.id, m.refresh_node(member, health.epoch_seen))
        elif (
            health.epoch_seen == view.epoch
            and data.get("config") not in (None, m.config.digest)
            and not m.lock.locked()
        ):
            # It missed a change of rules (which moves no epoch): a push it did
            # not answer, or a leader that died before reaching it.
            self._in_background(member.id, m.repush_config(member))
        return True

    async def _probe_all_removed(self) -> None:
        """Probe the removed members due (router/revival.py), forget the old ones."""
        m = self.membership
        now = asyncio.get_running_loop().time()
        removed = [r for r in m.removed.values() if r.id not in m.view]
        # Dismissed members are removed ones: one forgotten or buried (MAX_REMOVED) is
        # no longer either.
        m.dismissed.intersection_update(m.removed)
        due, forget = self.revival.plan([r.id for r in removed], now)
        for member_id in forget:
            del m.removed[member_id]
            log.info(
                "node %s (removed as crashed) is forgotten: no answer for %gs; "
                "it comes back only by registering (--join, ringlimit nodes add)",
                member_id,
                m.forget_removed_after,
            )
        # Told it left at the first answer: probed every round, not backed off, so
        # the message reaches it before it registers again on its own (a --join
        # node whose lease no router renews does, after node/server.py
        # STRANDED_AFTER).
        due_set = set(due) | {r.id for r in removed if r.id in m.dismissed}
        await asyncio.gather(*(self._probe_removed(r, now) for r in removed if r.id in due_set))

    async def _probe_removed(self, member: Member, now: float) -> None:
        m = self.membership
        answered = await m.nodes.answered_as(member, m.health_timeout)
        if answered is None:
            self.revival.missed(member.id, now)
            return
        self.revival.answered(member.id, now)
        if answered != member.id:
            self._forget_removed(member, answered)
        elif member.id in m.dismissed:
            self._in_background(member.id, m.tell_dismissed(member))
        elif not m.lock.locked():
            log.warning("node %s answers again after its removal: it rejoins", member.id)
            self._in_background(member.id, self._rejoin(member))

    def _forget_removed(self, member: Member, answered: str) -> None:
        """Its address answers as another node (an IP or a port reused): the
        crashed member's process is gone for good, and a rejoin would be refused
        (the readiness gate's ``wrong_node``). Probed on, it was taken for back
        every round, with a warning and a failed join each time, for as long as
        the other node ran."""
        removed = self.membership.removed
        if removed.get(member.id) == member:
            del removed[member.id]
            log.info(
                "node %s (removed as crashed) is forgotten: %s answers as %s",
                member.id,
                member.url,
                repr(answered) if answered else "something that is not a node",
            )

    async def _rejoin(self, member: Member) -> None:
        with contextlib.suppress(MembershipError):
            await self.membership.join(member)

    def _in_background(self, member_id: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run one repair per member at a time, without blocking the health loop."""
        if member_id in self._repairing:
            coro.close()
            return
        self._repairing.add(member_id)
        task = self._spawn(coro)
        task.add_done_callback(lambda _: self._repairing.discard(member_id))

    def _report_degraded(self) -> None:
        degraded = self.membership.backend_degraded
        if degraded != self._was_degraded:
            self._was_degraded = degraded
            if degraded:
                log.warning("shared backend down on a node: routing stickily to local limiters")
            else:
                log.warning("shared backend back on every node: routing as configured again")

    async def renew(self, member: Member, health: Health | None = None) -> dict[str, Any] | None:
        """Probe a member and renew its lease (node/lease.py); None if it did not answer.

        Two round trips: the probe takes the node's offer, and the grant follows
        at once, so each round leaves the node a whole lease less one round
        trip (a router slowed down by load still renews in time). Before the
        grant is sent the router records until when it may keep the node
        deciding (the offer's arrival plus the lease, with the drift allowance).
        """
        m = self.membership
        if health is None:
            health = m.health.setdefault(member.id, Health())
        data = await m.nodes.lease(member, None, m.lease_seconds, m.health_timeout)
        if data is None:
            return None
        other = data.get("cluster")
        if m.cluster is not None and isinstance(other, str) and other != m.cluster:
            # A member killed and started again into another cluster answers at
            # its old address as that cluster's: not this ring's member, so no
            # lease, and it is removed as crashed in detection time. It stayed
            # in the ring, deciding this cluster's users by the other's rules
            # and counts, for good (a day's-end tester).
            m.failures.warn(
                f"another_cluster:{member.id}",  # (one line per member: a ring's few)
                "node %s answers as a member of cluster %r, not %r: it is removed as "
                "crashed once its probes fail (%d in a row)",
                member.id,
                other,
                m.cluster,
                m.failure_threshold,
            )
            return None
        token = data.get("token")
        health.token = token if isinstance(token, str) else None
        health.offered_at = asyncio.get_running_loop().time()
        if (
            not m.granting
            or health.token is None
            or member.id in self.condemned
            # Decided for removal (condemned only once its task runs): no lease
            # past the bound the removal waits out. Asked at the grant, not at
            # the probe: an on-demand renewal (Membership.renew_lapsed) may start
            # at any time. (Not "in the view": a newcomer's lease is granted
            # before the view that holds it is adopted.)
            or member.id in self.removing
            # Removed by a newer etcd record that a take-over has not rolled
            # forward yet (Membership._take_lead).
            or member.id in m.withheld
        ):
            return data
        health.lease_until = max(
            health.lease_until,
            lease_bound(health.offered_at, m.lease_seconds, DEFAULT_DRIFT),
        )
        granted = await m.nodes.lease(member, health.token, m.lease_seconds, m.health_timeout)
        if granted is not None:
            m.stats["lease_renewals"] += 1
            return granted
        return data

    def remove_failed(self, view: RingView, unreachable: list[str]) -> list[asyncio.Task[Any]]:
        """Start removing the members that failed ``failure_threshold`` probes in
        a row, within the removal budget (router/removal.py); returns the tasks."""
        m = self.membership
        due = [
            member.id
            for member in view
            if (h := m.health.get(member.id)) is not None
            and h.failures >= m.failure_threshold
            and member.id not in self.removing
        ]
        now = asyncio.get_running_loop().time()
        plan = m.budget.plan(
            now,
            view.ids,
            unreachable,
            due,
            {member_id: h.lease_until for member_id, h in m.health.items()},
        )
        self._suspect_self(plan.suspect_self, len(unreachable), len(view))
        for member_id, reason in plan.deferred.items():
            m.stats[f"deferred_{reason}"] += 1
            if reason != "lease":
                log.info("removal of %s deferred (%s budget)", member_id, reason)
        started: list[asyncio.Task[Any]] = []
        for member_id in plan.remove:
            # The rate counts from the decision: a removal still waiting for the
            # lock is one of this interval's.
            m.budget.removed(now)
            task = self.removing[member_id] = self._spawn(self._remove_crashed(member_id))
            started.append(task)
        return started

    def _suspect_self(self, suspect: bool, unreachable: int, size: int) -> None:
        m = self.membership
        if suspect == m.suspect_self:
            return
        m.suspect_self = suspect
        if suspect:
            m.stats["self_suspected"] += 1
            log.warning(
                "%d of %d members unreachable at once: suspecting this router's own "
                "network or host; keeping the ring (on_error answers for their keys)",
                unreachable,
                size,
            )
        else:
            log.warning("members reachable again: no longer suspecting this router")

    async def _remove_crashed(self, member_id: str) -> None:
        m = self.membership
        # No renewal from the decision on: if it answers again while the removal
        # waits for the lock, its lease must not outlive the removal.
        self.condemned.add(member_id)
        # And no waiting behind a change under way: its pushes to this member
        # are abandoned, a join not yet committed yields (Membership.preempt).
        m.preempt()
        try:
            try:
                removed = await m.crash(member_id, reason="failed its health checks")
            except MembershipError as exc:  # it stopped leading meanwhile (etcd)
                log.warning("removal of %s not made: %s", member_id, exc.detail)
                return
            # None also when the change it preempted removed it first (its push
            # was abandoned: the half-failed path): still this decision's removal.
            if removed is not None or (member_id not in m.view and member_id in m.removed):
                # And again from its end: the next removal waits one interval
                # after this one took effect, however long it waited for the lock.
                m.budget.removed(asyncio.get_running_loop().time())
                m.stats["removed_crashed"] += 1
        finally:
            self.removing.pop(member_id, None)
            self.condemned.discard(member_id)
