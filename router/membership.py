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

A crash removal never waits behind a change holding the lock: it preempts
it (:meth:`Membership.preempt`, docs/rebalancing.md). A router that does not
lead (etcd, or a worker following ``leader_url``) never changes the ring.

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
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from node.clock import boot_clock
from node.config import ClusterConfig, unencodable
from node.failures import Failures
from node.lease import DEFAULT_DRIFT, MAX_LEASE
from node.peers import CONTROL_LIMITS
from ring import Member, RingView
from router.coordinator import (
    CoordinatorError,
    EtcdCoordinator,
    NotLeading,
    ViewRecord,
    node_lease,
)
from router.events import EventLog
from router.health import Health, HealthMonitor
from router.nodeclient import NodeClient, held_epoch, push_body
from router.removal import RemovalBudget
from router.revival import FORGET_AFTER
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

#: Seconds :meth:`Membership.close` waits for each group of its tasks to stop.
CLOSE_TIMEOUT = 5.0


async def _cancel_within(tasks: Iterable[asyncio.Future[Any]], seconds: float, what: str) -> None:
    """Cancel ``tasks`` and wait for them, at most ``seconds``; cancel again every
    :data:`RECANCEL` seconds while one is not done.

    Not ``await task`` one by one: a task inside a gRPC call (etcd's client)
    can take its cancellation and never finish, and then an unbounded wait
    hangs the router's shutdown for ever (seen in the test suite, about one
    run in two on a loaded 2-core machine, with the waiting task collected
    as garbage, so nothing ever woke it). ``asyncio.wait`` holds a timer.
    Again: on Python 3.11 a cancellation that arrives just as an
    ``asyncio.wait_for`` inside the task (aetcd has them) completes is lost,
    and the task goes on as if never cancelled.
    """
    every = [task for task in tasks if not task.done()]
    if not every:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    pending: set[asyncio.Future[Any]] = set(every)
    # The first wait is long enough for a task's own cleanup (closing a gRPC
    # channel): a second cancellation must not cut that short.
    wait = RECANCEL_AFTER
    while pending:
        for task in pending:
            task.cancel()
        left = deadline - loop.time()
        if left <= 0:
            break
        _, pending = await asyncio.wait(pending, timeout=min(wait, left))
        wait = RECANCEL
    for task in every:
        if task.done() and not task.cancelled():
            task.exception()  # retrieved: a task that failed as it stopped is not news
    if pending:
        log.warning("%d %s task(s) did not stop within %g s", len(pending), what, seconds)


#: When :func:`_cancel_within` first cancels again a task that has not stopped,
#: and how often after that (seconds).
RECANCEL_AFTER = 1.0
RECANCEL = 0.1


#: How often a following router looks whether the leader repaired a node (seconds).
REPAIR_POLL = 0.1

#: While a crash removal waits, how often a push under way looks for members
#: that applied its view and are only still delivering (seconds).
RELEASE_POLL = 0.1

#: At a start, how many times the router follows the members of the newest view
#: it found to a newer one they hold (each round's epoch is higher than the last).
MAX_RECOVERY_ROUNDS = 8

#: How many times a join may yield to crash removals before it gives up (503).
MAX_PREEMPTIONS = 8

#: Seconds members answer that their lease lapsed, to a router that renews none,
#: before it says so in the log (a --join node registers again after as long:
#: node/server.py STRANDED_AFTER); a pause of the renewing router is shorter.
LAPSED_WARN_AFTER = 10.0
#: A member not seen lapsed for this long has had its lease renewed meanwhile.
LAPSED_GAP = 5.0


class _Preempted(Exception):
    """A change not committed yet gave way to a crash removal (it retries)."""


def _log_released(member_id: str, epoch: int) -> Callable[[asyncio.Task[Any]], None]:
    """The end of a push no longer waited for: logged, not lost."""

    def done(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("node %s, push of epoch %d (not waited for): %s", member_id, epoch, exc)

    return done


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
        forget_removed_after: float = FORGET_AFTER,
        coordinator: EtcdCoordinator | None = None,
        advertise: str | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = config
        #: What this router adds to any config it adopts from etcd or a node (its
        #: ``--envoy-config`` rules): a config written by a router started without
        #: them must not take them away (every ShouldRateLimit would fail).
        self.keep_config: Callable[[ClusterConfig], ClusterConfig] | None = None
        #: Called with every view the router adopts (its metrics drop the series
        #: of nodes that left: router/metrics.py ``view_changed``).
        self.view_watchers: list[Callable[[RingView], None]] = []
        #: The view, the epochs used, history and crashed members (router/viewlog.py).
        self.log = ViewLog()
        self.health: dict[str, Health] = {}
        self.joining: dict[str, Member] = {}
        self.state_file = Path(state_file) if state_file else None
        #: Why the last write of the state file failed, until one succeeds.
        self.state_problem: str | None = None
        self.ready_timeout = ready_timeout
        self.health_interval = health_interval
        self.failure_threshold = failure_threshold
        self.health_timeout = health_timeout
        #: Detection time: a member answering nothing is due for removal after it.
        detection = failure_threshold * (health_interval + health_timeout)
        self._detection = detection
        #: ``--lease`` (None: :attr:`lease_seconds` works it out).
        self._lease = lease
        self.leasing = False
        #: Members granted no lease: those a newer etcd record removed, read at a
        #: take-over of the lead, until a view of that record's epoch or newer is
        #: adopted, or the roll-forward has ended (:meth:`_take_lead`, :meth:`_adopt`).
        self.withheld: frozenset[str] = frozenset()
        #: The epoch of the record :attr:`withheld` comes from.
        self._withheld_for = 0
        #: The newest record etcd's watch brought (settled or not): see _newest_record.
        self._newest_seen: ViewRecord | None = None
        self.budget = RemovalBudget(
            detection if removal_interval is None else removal_interval, removal_quorum
        )
        #: Seconds after which a member removed as crashed is no longer probed
        #: (router/revival.py: the probes back off before).
        self.forget_removed_after = forget_removed_after
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
        #: Leadership terms this router has won or lost (a take-over checks that
        #: its term is still the current one before it claims to lead).
        self._term = 0
        #: The etcd revision a change of this router is conditioned on: the
        #: record of the view it adopted (or of the change it is carrying out),
        #: never that of a newer record it only saw (unsettled, not adopted).
        self._revision = 0
        #: The newest revision seen (the watch resumes after it).
        self._seen_revision = 0
        #: The coordinator's ``history_lost`` when the revisions above were taken.
        self._history = 0
        self._coordination: list[asyncio.Task[Any]] = []
        #: The last membership changes, for operators (router/events.py).
        self.events = EventLog()
        #: Errors the health loop and background repairs survived (/metrics).
        self.failures = Failures(log)
        self.lock = asyncio.Lock()
        #: Set (and replaced) when a crash removal is decided: see :meth:`preempt`.
        self._preempt = asyncio.Event()
        self.changed = asyncio.Event()
        self.crashes = 0
        self._owned = client is None
        self.push_timeout = push_timeout
        self._client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(push_timeout, connect=1.0),
            limits=CONTROL_LIMITS,
        )
        #: The HTTP calls to nodes (router/nodeclient.py).
        self.nodes = NodeClient(self._client, internal_token)
        #: Probes, leases and removals on probe failures (router/health.py).
        self.monitor = HealthMonitor(self, self._spawn)
        self._health_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._newer_check: asyncio.Task[bool] | None = None
        self._joins: dict[str, asyncio.Future[RingView]] = {}
        self._newer_checked_at = float("-inf")
        #: Followers: one wait per member for the leader to repair it.
        self._awaiting_repair: dict[str, asyncio.Task[Any]] = {}
        #: The leading router's URL when this one follows it (router/workers.py).
        self.leader_url: str | None = None
        #: Members seen answering that their lease lapsed: id -> (since, last seen).
        self._lapsed: dict[str, tuple[float, float]] = {}
        #: Members an operator removed while they did not answer (the removal was
        #: carried out as a crash): told they left once they answer again, never
        #: made to rejoin (:meth:`tell_dismissed`). A join takes one back.
        self.dismissed: set[str] = set()
        #: Renewals of a lapsed lease on demand (:meth:`renew_lapsed`): id -> the
        #: renewal under way, and when the last one was started.
        self._renewing: dict[str, asyncio.Task[bool]] = {}
        self._renewed_at: dict[str, float] = {}
        #: Whether the leading router, at this follower's last poll, had a node
        #: reporting its shared backend (Redis) down: a follower probes no node.
        self.leader_backend_degraded = False

    @property
    def view(self) -> RingView:
        """The view this router routes by."""
        return self.log.view

    @property
    def cluster(self) -> str | None:
        """The cluster's name with etcd (``--cluster``); None without, where a
        router makes every view of its ring and tells another's by its epoch."""
        return self.coordinator.cluster if self.coordinator is not None else None

    @property
    def follows(self) -> bool:
        """True while another router leads membership: with etcd, this one was
        not elected; without, it follows a leading router (``leader_url``, the
        workers of ``ringlimit router --workers N``). A router that follows
        never changes the ring: admin calls are passed to the leader (router/app.py),
        and a node that is behind or restarted is the leader's health loop's to
        repair (:meth:`refresh_node`)."""
        return self.leader_url is not None or not self.leading

    @property
    def granting(self) -> bool:
        """True while this router may grant node leases: ``leasing`` and, with
        etcd, a lead whose step-down deadline has not passed.

        Asked just before each grant: etcd fences this router's commits, not its
        grants, and a grant made after the deadline (its step-down, a task of the
        event loop, not run yet) could outlast the bound a successor elected
        meanwhile waits out before it removes that member.
        """
        return self.leasing and (self.coordinator is None or self.coordinator.holds_lead())

    def _must_lead(self) -> None:
        if self.follows:
            raise MembershipError(
                503,
                "not_leader",
                "this router does not lead the cluster's membership: "
                + (f"the router at {self.leader_url} does" if self.leader_url else "retry shortly"),
            )

    @property
    def removed(self) -> dict[str, Member]:
        """Members removed as crashed: still probed, and made to rejoin (as new
        members, their old state discarded) when they answer again."""
        return self.log.removed

    # ------------------------------------------------------------------ start / stop

    async def start(
        self,
        seeds: Iterable[Member] = (),
        *,
        health: bool = True,
        fellows: Sequence[str] = (),
        fellow_headers: Mapping[str, str] | None = None,
        adopt_config: bool = False,
        follower: bool = False,
        state_required: bool = True,
    ) -> None:
        """Recover membership (state file, then the nodes), else build it from seeds.

        ``fellows`` (routers' admin URLs) name more nodes to ask: a leading
        worker restarted by its supervisor has no other way to find nodes that
        joined it. With ``adopt_config`` the rules of the node that knows the
        newest view win over this router's own: the cluster's rules, those
        applied at runtime included, rather than the flags it was started with.
        A ``follower`` (a worker that learns the ring from its leader next) starts
        empty by design, and does not warn of it.

        A state file that cannot be read or written stops the start (one line,
        MembershipError): a typo in ``--state-file`` fails loudly before any
        traffic. Without ``state_required`` (a worker its supervisor started
        again after it had served) it is warned of instead, and the ring taken
        from the nodes and ``fellows``: a crash of the leading worker during a
        full disk stopped every worker, for a file the workers did not need.
        """
        seeds = list(seeds)
        # With etcd, leases are the leader's: on only while this router leads.
        self.leasing = health and self.coordinator is None
        if self.coordinator is not None:
            await self._start_coordinated(seeds, health)
            return
        recovered: RingView | None = None
        unreadable = False
        try:
            recovered = self._load_state()
        except MembershipError as exc:
            if state_required:
                raise
            unreadable = True
            log.warning(
                "the state file could not be used (%s); taking the ring from the "
                "other workers and the nodes",
                exc.detail,
            )
        candidates: dict[str, Member] = {}  # by id; the first one named wins
        fellows_members = await self._fellows_members(fellows, dict(fellow_headers or {}))
        for member in [*(recovered or ()), *seeds, *fellows_members]:
            candidates.setdefault(member.id, member)
        found = await self.nodes.discover(
            list(candidates.values()), self.health_timeout, with_urls=True
        )
        best = max(
            [v for v in (recovered, found[0] if found is not None else None) if v is not None],
            key=lambda v: v.epoch,
            default=None,
        )
        newest_at = found[1] if found is not None else None  # whose rules adopt_config takes
        held: RingView | None = None
        for _ in range(MAX_RECOVERY_ROUNDS):
            if best is None or not len(best):
                break
            # Ask the members of the newest view found so far: a seed (or the
            # state file) may be behind them. A node removed from the ring that
            # still runs holds the view that removed it and no later one, so a
            # router restarted with it as its only seed recovered that view, and
            # its next change reused an epoch the members already held with
            # other members: two rings under one epoch (an exploratory tester).
            asked = await self.nodes.discover(
                list(best.members), self.health_timeout, with_urls=True
            )
            held = asked[0] if asked is not None else None
            if asked is None or asked[0].epoch <= best.epoch:
                break
            best, newest_at = asked
        if adopt_config and newest_at is not None:
            await self._adopt_nodes_config(newest_at)
        if best is not None and len(best):
            self.log.view = best
            self.events.recovered(best)
            for member in best:
                self.health.setdefault(member.id, Health())
            # A member that holds a view means the cluster kept its states: one
            # that is empty restarted (it refuses, and the health loop removes it
            # as crashed). None holding one: the whole cluster restarted, and
            # every member takes the recovered view empty. Asked of the members
            # alone (above): a node removed from the ring that still runs (and
            # may be among the seeds) holds a view too, and said nothing of theirs.
            failed = await self._push_all(
                self.view, None, (), established=held is not None and len(held) > 0
            )
            self._say_recovered(best, recovered, newest_at, answered=len(best) - len(failed))
        else:
            if best is not None:
                # An empty ring keeps its epoch: the next view goes above it (it
                # started again at 1, below the views its nodes had held).
                self.log.saw(best.epoch)
            if seeds:
                await asyncio.gather(*(self._wait_ready(m) for m in seeds))
                view = RingView.of(seeds, epoch=self.log.highest + 1)
                await self._push_all(view, RingView.empty(), ())
                self._adopt(view)
                for member in seeds:
                    self.health[member.id] = Health()
        self._save_state(strict=state_required)
        if not len(self.view) and not follower:
            # A router that starts with no ring serves nothing (503 no_nodes) until
            # nodes join; said, not silent, with a state file or without one.
            if self.state_file is None:
                why = "no --state-file"
            else:
                if unreadable:
                    state = "could not be read"
                elif recovered is not None:
                    state = "held an empty ring"
                else:
                    state = "did not exist"
                why = f"the state file {self.state_file} {state}"
            log.warning(
                "no ring to serve: %s and no --node seeds were given; nodes started "
                "with --join register again when restarted, others with "
                "`ringlimit nodes add`",
                why,
            )
        if health:
            # Leases lapsed while no router ran: renew them before serving.
            await asyncio.gather(*(self._renew(m) for m in self.view))
            self._health_task = asyncio.create_task(self._health_loop())

    def _say_recovered(
        self, best: RingView, saved: RingView | None, node_url: str | None, *, answered: int
    ) -> None:
        """One line at the default level: where the ring came from (a newer
        epoch than the state file's said), and, for a ring from the state file
        none of whose members answered, that the file may name nodes long gone
        (the health loop then suspects this router's own network)."""
        from_file = best is saved
        where = f"the state file {self.state_file}" if from_file else f"the node at {node_url}"
        line = f"recovered the ring at epoch {best.epoch} ({len(best)} members) from {where}"
        if not from_file and saved is not None:
            line += f" (the state file {self.state_file} had epoch {saved.epoch})"
        if from_file and not answered:
            line += (
                "; none of its members answered: the state file may name nodes that are "
                "gone (nodes started with --join register again when restarted, others "
                "with `ringlimit nodes add`)"
            )
        log.warning("%s", line)

    async def _fellows_members(
        self, fellows: Sequence[str], headers: dict[str, str]
    ) -> list[Member]:
        """The members in other routers' rings (those that answer within the
        health timeout): where a router without a state file finds its nodes."""

        async def ring(url: str) -> list[Member]:
            try:
                async with asyncio.timeout(self.health_timeout):
                    return list(await self.nodes.leader_ring(url, headers))
            except (TimeoutError, httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
                log.warning("could not read the ring of the router at %s: %s", url, exc)
                return []

        rings = await asyncio.gather(*(ring(url) for url in fellows))
        return [member for members in rings for member in members]

    def _take_etcd_config(self, record: ViewRecord) -> None:
        """Take the config etcd holds, saying which sections differ from this
        router's: at start, those of its flags and file that do not apply (etcd's
        wins, so a restart does not undo a runtime change), which an operator
        restarting routers with a new file could not tell (an exploratory tester)."""
        mine, theirs = self.config.to_dict(), record.config.to_dict()
        differ = ", ".join(n for n in theirs if mine.get(n) != theirs.get(n)) or "nothing shown"
        if self._coordination:
            # Watching etcd: a change made at runtime (change_config), through any router.
            log.info(
                "taking the cluster config from etcd (epoch %d): %s changed",
                record.view.epoch,
                differ,
            )
        else:
            log.warning(
                "taking the cluster config from etcd (epoch %d); it differs from this "
                "router's flags and file in %s (etcd's wins: `ringlimit config FILE` "
                "changes it)",
                record.view.epoch,
                differ,
            )
        self._take_config(record.config, "etcd")

    async def _adopt_nodes_config(self, node_url: str) -> None:
        """Take the config of the node at ``node_url`` (it knows the newest view)."""
        try:
            data = await self.nodes.cluster(node_url)
        except (httpx.HTTPError, ValueError) as exc:
            log.error("could not take the cluster's rules from %s: %s", node_url, exc)
            return
        config = _node_config(data)
        if config is None:
            log.error("could not take the cluster's rules from %s: no config it can read", node_url)
        elif config != self.config:
            log.warning("took the cluster's rules from %s over this router's own", node_url)
            self._take_config(config, node_url)

    async def _start_coordinated(self, seeds: list[Member], health: bool) -> None:
        """The ring from etcd; the first view from the seeds only if etcd has none."""
        assert self.coordinator is not None
        await self.coordinator.connect()
        record = await self.coordinator.load()
        if record is None and seeds:
            # etcd may have lost a ring its nodes still hold (its data gone, and
            # no router left that carried the ring out): the nodes' newest view,
            # not a first one below it, whose push they would refuse.
            # Their rules too: those applied at runtime were etcd's and theirs.
            found = await self.nodes.discover(
                seeds, self.health_timeout, with_urls=True, cluster=self.cluster
            )
            if found is not None and len(found[0]):
                await self._adopt_nodes_config(found[1])
                await self._record_again(None, self.config, found[0])
                record = await self.coordinator.load()  # ours, or a router's that was quicker
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
            # A ring this router found, not one it changed: "recovered", as a
            # restart on a state file or the nodes' view says (it said every
            # member "joined" at that epoch).
            self._take(record, force=True, recovered=True)
        self._coordination = [asyncio.create_task(self._watch())]
        if health:
            # The step-down deadline counts on a clock that keeps counting while
            # the host is suspended: on the event loop's (monotonic, stopped
            # meanwhile) a leader woken from a suspend longer than the ttl would
            # grant node leases until its next keep-alive step, while etcd had
            # expired its key and another router led.
            self._coordination.append(
                asyncio.create_task(
                    self.coordinator.lead(
                        self.advertise or "", self._on_lead, self._on_lose, boot_clock
                    )
                )
            )
            self._health_task = asyncio.create_task(self._health_loop())

    def _take(self, record: ViewRecord, *, force: bool = False, recovered: bool = False) -> None:
        """Follow etcd's record: adopt a settled newer view.

        A change is conditioned on the revision of the view it was built from:
        the revision moves with an adopted view (or a rewrite of the view this
        router holds, e.g. marked settled), not with an unsettled record of a
        newer view, else a change built from view N-1 could be committed over
        record N (a forked history, N never carried out).
        """
        self._forget_lost_history()
        self._seen_revision = max(self._seen_revision, record.revision)
        self.log.saw(record.view.epoch)
        if self._newest_seen is None or record.view.epoch >= self._newest_seen.view.epoch:
            self._newest_seen = record
        if record.view == self.view:
            newer = record.revision > self._revision
            self._revision = max(self._revision, record.revision)
            # Adopted before, from a node (which does not say who crashed).
            self.events.crashed(record.view.epoch, record.crashed)
            if newer and record.settled and record.config != self.config:
                # New rules for the same ring (:meth:`change_config`).
                self._take_etcd_config(record)
        elif (record.settled or force) and record.view.epoch > self.view.epoch:
            self._revision = record.revision
            if record.config != self.config:
                self._take_etcd_config(record)
            for member in record.view:
                self.health.setdefault(member.id, Health())
            self._adopt(record.view, record.crashed, recovered=recovered and not len(self.view))
            log.info("adopted epoch %d from etcd", record.view.epoch)

    def _forget_lost_history(self) -> None:
        """etcd went back (its data lost, or restored from an older snapshot:
        router/coordinator.py ``history_lost``): the revisions taken from the
        history before mean nothing in the new one. Kept, every change
        conditioned on them was refused (409) for good."""
        assert self.coordinator is not None
        if self.coordinator.history_lost != self._history:
            self._history = self.coordinator.history_lost
            self._revision = self._seen_revision = 0
            self._newest_seen = None

    async def _record_again(
        self, record: ViewRecord | None, config: ClusterConfig, view: RingView | None = None
    ) -> bool:
        """Record ``view`` (this router's by default; settled, with ``config``)
        over etcd's ``record``: none (etcd lost its data, or a cluster that has
        no ring yet is given rules), or a settled one older than the view this
        router carried out (etcd restored from an older snapshot). Views in etcd
        only go forward otherwise (every view is recorded before it is carried
        out), so this overwrites nothing newer. At a start, ``view`` is the
        nodes' newest. True if written; raises CoordinatorError, NotLeading."""
        assert self.coordinator is not None
        view = self.view if view is None else view
        self._forget_lost_history()
        fresh = ViewRecord(view, None, (), config, True)
        committed = await self.coordinator.commit(
            fresh, expected=0 if record is None else record.revision
        )
        if committed is None:
            return False
        self._revision = committed.revision
        if len(view):
            log.error(
                "etcd %s held %s: recorded the ring (epoch %d) there again",
                self.coordinator.where,
                "no ring" if record is None else f"an older ring (epoch {record.view.epoch})",
                view.epoch,
            )
        return True

    def _behind(self, record: ViewRecord | None) -> bool:
        """etcd holds no record of the ring this router carried out, or an older one."""
        if record is None:
            return len(self.view) > 0
        return record.settled and record.view.epoch < self.view.epoch

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
        self.leader_url = leader_url
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
            state = await self.nodes.leader_state(leader_url, headers)
            view, events = state.view, state.events
            self.leader_backend_degraded = state.degraded
            if state.config_digest is not None:
                # The whole config (PUT /admin/config changes more than rules).
                if state.config_digest != self.config.digest:
                    self._take_leaders_config(
                        await self.nodes.leader_config(leader_url, headers), leader_url
                    )
            elif state.rules_digest is not None and state.rules_digest != self.config.rules_digest:
                # A leader of a version that says its rules' digest alone.
                self._take_leaders_rules(
                    await self.nodes.leader_rules(leader_url, headers), leader_url
                )
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.debug("could not poll the leader at %s: %s", leader_url, exc)
            return False
        # The leader's events, as they are: it knows which members crashed and
        # which left (a view learnt here or from a node does not say).
        self.events.mirror(events)
        if view.epoch <= self.view.epoch or not len(view):
            return False
        self.log.saw(view.epoch)
        for member in view:
            self.health.setdefault(member.id, Health())
        self._adopt(view)
        log.info("adopted epoch %d from the leader at %s", view.epoch, leader_url)
        return True

    def rules_data(self) -> list[dict[str, Any]]:
        return [scoped.to_dict() for scoped in self.config.rules]

    def _take_leaders_config(self, data: Any, leader_url: str) -> None:
        """The config the leader took since (:meth:`change_config`, a
        ``PUT /admin/config`` or new rules), whole: a follower that took its
        rules alone kept its own identity, bypass tokens and limits (the review
        of the day's changes: half of a --workers group's answers used the old
        user-id field after `ringlimit config`)."""
        try:
            config = ClusterConfig.from_dict(
                data, source=f"the config of {leader_url}", strict=False
            )
        except ValueError as exc:
            log.error("could not take the leader's config: %s", exc)
            return
        if config.digest == self.config.digest:
            return
        log.info("taking the config of the leading router at %s", leader_url)
        self._take_config(config, leader_url)

    def _take_leaders_rules(self, rules: list[Any], leader_url: str) -> None:
        """Rules the leader took since (:meth:`change_config`), with this router's
        other settings: its own flags and file made those, as they made the leader's."""
        try:
            config = self.config.with_rule_tables(
                rules, source=f"the rules of {leader_url}", strict=False
            )
        except ValueError as exc:
            log.error("could not take the leader's rules: %s", exc)
            return
        log.warning("taking the rules of the leading router at %s", leader_url)
        self._take_config(config, leader_url)

    async def _watch(self) -> None:
        assert self.coordinator is not None
        # aclosing: on cancellation the generator (a gRPC stream) is closed now,
        # not at the event loop's shutdown.
        since = max(self._revision, self._seen_revision)
        async with contextlib.aclosing(self.coordinator.watch(since)) as records:
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
        self._term += 1
        self._spawn(self._take_lead(self._term))

    async def _take_lead(self, term: int) -> None:
        """Leases first (granted, then required by a push of the current view), so
        that no node is left without one; then any change left half-done.

        The push waits a few probe timeouts per member, not the push timeout:
        a member paused at the take-over would otherwise hold it for 30 s,
        with no renewals or removals meanwhile (the health loop waits for
        ``leading``), and every member's keys answered by ``on_error``. A
        member that missed it gets the view from the health loop. Leadership
        lost meanwhile (``term``) is not taken back: an unconditional
        ``leading = True`` left a deposed router leading beside the new one.
        """
        try:
            record = await self._newest_record()
            if term != self._term:
                return
            # Not the members a newer record removed (the last leader committed a
            # crash removal and died before settling it): leased again here, a
            # paused member that woke decided its users beside the survivors
            # that had taken them over from replicas (an independent review:
            # 199 over the limit). Withheld until a view of that record's epoch
            # (or newer) is adopted, or the roll-forward below has ended.
            if record is not None and record.view.epoch > self.view.epoch:
                self.withheld = frozenset(m.id for m in self.view if m.id not in record.view)
                self._withheld_for = record.view.epoch
            else:
                self.withheld, self._withheld_for = frozenset(), 0
            self.leasing = True
            async with self.lock:
                withheld = self.withheld
                offers = await asyncio.gather(
                    *(self._renew(m) for m in self.view if m.id not in withheld)
                )
                # As a recovered start (see start): a member that holds a view means
                # the cluster kept its states, and one that is empty restarted.
                held = any(isinstance(o, dict) and held_epoch(o.get("epoch")) for o in offers)
                await self._push_all(
                    self.view, None, (), seconds=self._takeover_push, established=held
                )
            if term != self._term:
                return
            self.leading = True
            log.warning("took the lead at epoch %d", self.view.epoch)
            await self._roll_forward(term)
            if term == self._term:
                # Rolled forward, or etcd's record put back as this router's view
                # (history lost): the view in force says who is a member now.
                self.withheld = frozenset()
        except Exception:
            log.exception("taking the lead failed")

    async def _newest_record(self) -> ViewRecord | None:
        """etcd's ring record, read once; if etcd does not answer, the newest one
        this router's watch has seen (a take-over waits for no etcd read before
        it leases: an etcd that answers the campaign but not reads, or a record
        this version cannot read, left every node without a lease, for as long
        as it lasted, in a first version of this; the review)."""
        assert self.coordinator is not None
        try:
            return await self.coordinator.load()
        except CoordinatorError as exc:
            log.warning(
                "could not read the ring from etcd at the take-over (%s): going by the "
                "newest record seen",
                exc,
            )
            return self._newest_seen

    @property
    def _takeover_push(self) -> float:
        return max(2.0, 4 * self.health_timeout)

    async def _on_lose(self) -> None:
        self._term += 1
        self.leading = False
        self.leasing = False

    async def _roll_forward(self, term: int) -> None:
        """:meth:`_roll_forward_once` until etcd answers, while this term lasts.

        Once was not enough: a take-over whose one read failed (etcd paused or
        restarting) left the last leader's unsettled change undone, and every
        later change conditioned on the adopted view got 409 ring_changed for as
        long as this router led (a crash removal nobody had applied: the dead
        member stayed in the ring).
        """
        delay = 0.25
        while term == self._term:
            try:
                await self._roll_forward_once()
                return
            except CoordinatorError as exc:
                log.warning("could not read the ring from etcd: %s; trying again", exc)
            await asyncio.sleep(delay)
            delay = min(2 * delay, 5.0)

    async def _roll_forward_once(self) -> None:
        assert self.coordinator is not None
        async with self.lock:
            record = await self.coordinator.load()
            if self._behind(record):
                await self._record_again(record, self.config)
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
            self._revision = record.revision  # the record of the view now adopted
            await self._settle(record)
            await self._crash_unresponsive(failed)

    async def _commit(
        self, view: RingView, previous: RingView, crashed: tuple[str, ...]
    ) -> ViewRecord | None:
        """Record a change in etcd before carrying it out (no coordinator: nothing).

        A write that did not change the view (the record of ``previous`` marked
        settled by the router that made it, or given new rules, after this one
        read it) moves the revision without invalidating the change: the change
        is tried again on the new revision. Its record is built again for each
        try, with the config the reload just took: the record built before it
        wrote the old rules over the newer ones (a lost update). Bounded: each
        retry needs another write to etcd in between.
        """
        if self.coordinator is None:
            return None
        for _ in range(3):
            record = ViewRecord(view, previous, crashed, self.config, settled=False)
            try:
                committed = await self.coordinator.commit(record, expected=self._revision)
                if committed is not None:
                    self._revision = committed.revision
                    return committed
                latest = await self.coordinator.load()
            except NotLeading as exc:
                raise MembershipError(503, "no_leader", f"{exc}; retry shortly") from None
            except CoordinatorError as exc:
                self._finish_unsettled()
                raise MembershipError(503, "coordinator_unavailable", str(exc)) from None
            if latest is None or (self._behind(latest) and previous == self.view):
                # etcd lost the record this change is built on (or went back to an
                # older one): the change is recorded over what it holds now.
                self._forget_lost_history()
                self._revision = 0 if latest is None else latest.revision
                continue
            self._take(latest)
            if latest.view != previous:
                if not latest.settled:
                    self._finish_unsettled()
                break
            self._revision = latest.revision
        raise MembershipError(409, "ring_changed", "another router changed the ring first; retry")

    def _finish_unsettled(self) -> None:
        """Carry out, in the background, a change etcd may hold unsettled.

        A commit whose answer was lost may have landed: etcd then holds a change
        nobody carries out (this router took the write for failed), and every
        later change, conditioned on the revision before it, got 409
        ring_changed for as long as this router led. Only the leader writes
        changes, so an unsettled record it is not carrying out is its own lost
        commit (or its predecessor's, which the take-over rolls forward too):
        it is rolled forward as a new leader would, once the lock is free.
        """
        if self.leading and self.coordinator is not None:
            self._spawn(self._roll_forward(self._term))

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
        """Stop every background task, bounded in time: a router that is told to
        stop stops, even when one of them is stuck in an etcd call."""
        was_leading = self.leading and self.coordinator is not None
        await _cancel_within(self._coordination, CLOSE_TIMEOUT, "etcd coordination")
        if self.coordinator is not None:
            if was_leading and self.advertise:
                with contextlib.suppress(TimeoutError, CoordinatorError):
                    await asyncio.wait_for(self.coordinator.resign(self.advertise), CLOSE_TIMEOUT)
            await self.coordinator.close()
        tasks: list[asyncio.Future[Any]] = [
            *self._background,
            *self._joins.values(),
            *([self._health_task] if self._health_task else []),
        ]
        await _cancel_within(tasks, CLOSE_TIMEOUT, "background")
        if self._owned:
            await self._client.aclose()

    @property
    def client(self) -> httpx.AsyncClient:
        """The control plane's HTTP client (pushes, probes, calls to the leader)."""
        return self._client

    # ------------------------------------------------------------------ changes

    async def join(self, member: Member, *, instance: str | None = None) -> RingView:
        """Add a member: readiness first (outside the lock), then the push protocol.

        The readiness wait is bounded by ``ready_timeout`` and holds no lock, so a
        join that cannot become ready (a mistyped URL, a node still starting)
        never delays the removal of a crashed member or another change.

        ``instance``: the process a node's own registration comes from (its
        ``X-Ringlimit-Instance``); refused if another process answers at its URL.
        """
        self._must_lead()
        await self.check_instance(member, instance, "join")
        self.dismissed.discard(member.id)  # added again (an operator, a fresh start)
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
            self._check_room(member)
        held = await self._wait_ready(member)
        if held > self.view.epoch and not len(self.view):
            await self._take_ring_of(member)  # (then its view is at least ``held``)
        if held > self.view.epoch and self.coordinator is None:
            # Not a view this router made (it makes every view of its ring): a
            # node of another cluster (or of a ring this router could not take,
            # another join having made one first). Joined, it refused every view
            # and answered each key with its own ring's epoch, which the router
            # would take for a newer view of its own.
            raise MembershipError(
                409,
                "node_in_another_ring",
                f"node {member.id} holds a ring at epoch {held}, newer than this "
                f"router's ({self.view.epoch}): it is another cluster's member; give it "
                "to that cluster's router, or restart it empty to join this one",
            )
        for _ in range(MAX_PREEMPTIONS):
            async with self.lock:
                if await self._already_joined(member):
                    return self.view
                try:
                    return await self._join_locked(member)
                except _Preempted:
                    log.info("join of %s yields to a crash removal; then it retries", member.id)
            # The lock is released: the removal, queued for it, goes first (an
            # asyncio.Lock is fair), and this join queues behind it.
        raise MembershipError(
            503, "ring_changing", f"join of {member.id} yielded to removals too often; retry"
        )

    async def check_instance(self, member: Member, instance: str | None, what: str) -> None:
        """Refuse a node's join or leave (409 ``another_process``) when the node at
        ``member.url`` answers as another process than ``instance``, the sender's.

        A second process started with a member's ``--id`` and a ``--url`` that
        reaches the running member had its join answered "joined" (a no-op: the
        member was healthy), and its graceful leave at shutdown removed the real
        member, which kept running outside the ring and said nothing. Only a
        positive answer of another process refuses: none (a node paused, slow,
        or of a version that says no instance) leaves the call as it was."""
        if instance is None:
            return
        answered = await self.nodes.instance(member, self.health_timeout)
        if answered is None or answered == instance:
            return
        if what == "join":
            outcome = f"node {member.id!r} runs there already: check this process's --url"
        else:
            outcome = "the ring keeps the node that answers there"
        raise MembershipError(
            409,
            "another_process",
            f"{member.url} answers as another process of node {member.id!r} than the "
            f"one asking to {what}; {outcome}",
        )

    async def _already_joined(self, member: Member) -> bool:
        """True for a repeated registration of a healthy member (nothing to do)."""
        if not self.log.registered(member):
            return False
        epoch = await self.nodes.epoch(member, self.health_timeout)
        if epoch == self.view.epoch:
            return True
        if epoch is None:
            # No answer is no sign of a restart: the member may be paused, slow or
            # gone, which the health loop judges within the removal budget (taken
            # as a restart, a registration that arrived as the ring's only node
            # was killed emptied the ring). A 503, which a node retries until its
            # --join-timeout: a 504 would read as a wrong --url, and make it exit.
            raise MembershipError(
                503,
                "member_unconfirmed",
                f"node {member.id} is in the ring but did not answer /healthz at "
                f"{member.url} within {self.health_timeout:g}s; it is kept as it is "
                "(retry once it answers)",
            )
        # The member registers again without the current view: it restarted and
        # lost its state. Its old incarnation crashed; the new one joins.
        log.warning("node %s re-registered after a restart: crash, then join", member.id)
        await self._crash_locked(member.id, reason="it registered again after a restart")
        return False

    def _check_room(self, member: Member) -> None:
        """409 ``invalid_membership`` when the ring with ``member`` cannot be made:
        over ``MAX_MEMBERS``, or a weight that gets no point on the continuum.
        Asked before the newcomer hears anything; it was a 500 after its welcome."""
        try:
            problem = RingView.of([*(m for m in self.view if m.id != member.id), member]).unplaced()
        except ValueError as exc:
            problem = str(exc)
        if problem is not None:
            raise MembershipError(409, "invalid_membership", f"cannot add {member.id}: {problem}")

    async def _join_locked(self, member: Member) -> RingView:
        self._check_room(member)  # the ring may have changed while it waited
        # First the newcomer gets the cluster's config, with the current view
        # (in which it owns nothing): see ViewLog.welcome. Nothing is committed
        # yet, so a crash removal decided meanwhile goes first (_Preempted).
        await self._unless_preempted(self._send(self.log.welcome(member)))
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
        # Its health before the view that makes it a member: the health loop
        # renews members of the adopted view into their entries, and one made
        # there meanwhile (during the settle, with etcd) was overwritten by
        # this one after it, with an older lease bound than the node held (an
        # independent review): a removal could come before its lease had ended.
        self.health[member.id] = health
        self._adopt(change.view)
        await self._settle(committed)
        health.state = "active"
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

    async def _unless_preempted(self, step: Coroutine[Any, Any, Any]) -> None:
        """Run a step of a change that is not committed yet, unless a crash
        removal is decided meanwhile: then abandon it and raise _Preempted."""
        task = asyncio.ensure_future(step)
        preempted = asyncio.ensure_future(self._preempt.wait())
        try:
            await asyncio.wait([task, preempted], return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            preempted.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise _Preempted
        task.result()

    async def leave(
        self, member_id: str, *, force: bool = False, instance: str | None = None
    ) -> RingView:
        """Graceful leave: the leaving node hands everything off before it is dropped
        (the last node only when ``force``d: :meth:`ViewLog.leave`).

        ``instance``: the process a node's own leave comes from; the member is
        kept if another process answers at its URL (see :meth:`check_instance`)."""
        self._must_lead()
        if member_id not in self.view and member_id in self.joining:
            # Listed (`nodes list` says "joining"), so "no such node" read as a bug.
            raise MembershipError(
                409,
                "still_joining",
                f"node {member_id} is still joining, not in the ring yet: the router waits "
                f"up to {self.ready_timeout:g} s for it to answer /healthz, and drops the "
                "join if it does not; remove it once it has joined",
            )
        if instance is not None and member_id in self.view:
            await self.check_instance(self.view.member(member_id), instance, "leave")
        async with self.lock:
            change = self.log.leave(member_id, force=force)
            health = self.health.setdefault(member_id, Health())
            health.state = "leaving"
            try:
                committed = await self._commit(change.view, change.previous, ())
            except BaseException:
                # Not committed (etcd refused or did not answer): it is not leaving
                # (it was shown "leaving" for good).
                health.state = "active"
                raise
            try:
                change, committed, failed = await self._carry_out_leave(
                    change, member_id, committed
                )
            except MembershipError:
                log.warning("node %s did not take the leave; treating it as a crash", member_id)
                # An operator's removal: no quorum, but its lease still bounds it.
                await self._crash_unresponsive(
                    [member_id], reason="did not take the leave", budgeted=False
                )
                self.health.pop(member_id, None)
                if member_id not in self.view:
                    self.dismissed.add(member_id)
                return self.view
            self.log.remember(change.previous, change.crashed)
            for crashed_id in change.crashed:
                self.log.bury(change.previous.member(crashed_id))
            self._adopt(change.view, change.crashed)
            await self._settle(committed)
            self.health.pop(member_id, None)
            for crashed_id in change.crashed:
                self.health.pop(crashed_id, None)
                self.crashes += 1
                log.warning(
                    "node %s removed as crashed (failed its health checks, during the "
                    "leave of %s): epoch %d",
                    crashed_id,
                    member_id,
                    change.view.epoch,
                )
            for push in change.afterwards:
                self._spawn(self._send(push))
            await self._crash_unresponsive(failed)
            log.info("node %s left: epoch %d", member_id, change.view.epoch)
            return change.view

    async def _carry_out_leave(
        self, change: Change, member_id: str, committed: ViewRecord | None
    ) -> tuple[Change, ViewRecord | None, list[str]]:
        """A leave's pushes; a crash removal decided meanwhile is folded into it.

        The leaving member answers its push once it has delivered every state,
        and a delivery to a paused member waits its three tries of 5 s. A
        crash removal of such a member, decided meanwhile (its lease has ended:
        it decides nothing), waited for the lock the leave held: removed ~15 s
        after its pause instead of the detection time, and the leaving
        member's keys routed by the new view only when the leave ended (their
        requests waited the router's refusal time, 5 s, then on the paused
        member). So while the leaving member's push is under way, a member of
        the leave's view condemned for removal is dropped from that view
        (:meth:`ViewLog.fold_crashes`): the leaving member is sent the new view
        and hands what it was delivering to the crashed member to its new
        owner, with its final marks; the push it was answering is no longer
        waited for (it goes on, and its end is logged); and again for a member
        condemned while the leaving member delivers under the folded view.
        Returns the change carried out, its etcd record and the members that
        did not take it.
        """
        losers, gainers = change.pushes
        task = asyncio.ensure_future(self._send(losers))
        folding = True
        try:
            while not task.done():
                # Condemned: decided for removal by the health monitor, once its
                # lease had ended (it decides nothing).
                crashed = [m for m in change.view.ids if m in self.monitor.condemned]
                folded = self.log.fold_crashes(change, crashed) if folding and crashed else None
                if folded is not None:
                    try:
                        committed = await self._commit(folded.view, folded.previous, folded.crashed)
                    except MembershipError as exc:
                        # Not recorded (etcd away, the lead lost, another router's
                        # change): the leave goes on as it was, the removal after
                        # it. Not a failure of the leaving member's.
                        log.warning(
                            "could not fold the removal of %s into the leave of %s: %s",
                            ", ".join(crashed),
                            member_id,
                            exc.detail,
                        )
                        folding = False
                        continue
                    log.warning(
                        "node(s) %s removed as crashed during the leave of %s: folded "
                        "into it (epoch %d)",
                        ", ".join(crashed),
                        member_id,
                        folded.view.epoch,
                    )
                    self._background.add(task)
                    task.add_done_callback(self._background.discard)
                    task.add_done_callback(_log_released(member_id, change.view.epoch))
                    # And again if another member is condemned while the leaver
                    # delivers under this view (two paused members: the second
                    # waited 15 s, and the leaver was taken for crashed: a tester).
                    change = folded
                    losers, gainers = change.pushes
                    task = asyncio.ensure_future(self._send(losers))
                    continue
                preempted = asyncio.ensure_future(self._preempt.wait())
                try:
                    await asyncio.wait([task, preempted], return_when=asyncio.FIRST_COMPLETED)
                finally:
                    preempted.cancel()
            failed = task.result()
            return change, committed, failed + await self._send(gainers)
        except BaseException:
            if not task.done() and task not in self._background:
                task.cancel()
            raise

    async def tell_dismissed(self, member: Member) -> None:
        """A member an operator removed while it did not answer (a pause, a
        partition) answers again: tell it that it left, as a leave it took
        would have, so it hands its states to their owners (who keep the more
        restrictive of two) and does not register again (node/shardcore.py
        ``may_rejoin``); then forget it. Before, the removal was carried out as
        a crash and the member, probed like any crashed one, was made to rejoin
        the ring it had been removed from (an exploratory tester). Tried again
        at the next probe if the push fails."""
        if member.id not in self.dismissed or member.id in self.view:
            return
        failed = await self._send(Push((member,), self.view, None, (), "notify"))
        if failed or member.id not in self.dismissed:
            return
        self.dismissed.discard(member.id)
        if self.removed.get(member.id) == member:
            del self.removed[member.id]
        log.warning(
            "node %s, removed by an operator without a leave it took (it did not answer, "
            "or could not hand its states over), answers again: told it left the ring "
            "(its states go to their owners); it does not rejoin",
            member.id,
        )

    async def crash(self, member_id: str, reason: str = "unreachable") -> RingView | None:
        """Drop a node that stopped answering; its keys follow the crash policy."""
        self._must_lead()
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

    def _adopt(
        self, view: RingView, crashed: Iterable[str] = (), *, recovered: bool = False
    ) -> None:
        members_changed = view.members != self.view.members
        if self.leader_url is None:
            # A follower shows the leader's events instead (follow_once).
            if recovered:
                self.events.recovered(view)
            else:
                self.events.change(self.view, view, crashed={*self.removed, *crashed})
        self.log.adopt(view)
        for watch in self.view_watchers:
            watch(view)
        if self.leading and members_changed:
            problem = view.unplaced()
            if problem is not None:
                # A leave or a crash removal is carried out all the same (a dead
                # member cannot be kept for another's weight; refused, a crashed
                # node stayed in the ring for good, its removal failing every 10 s).
                log.warning("epoch %d is carried out, though %s", view.epoch, problem)
        # Health is kept for the members of the view and the nodes joining it:
        # the entries of members a view dropped go, whichever way it came. (Only
        # the leader's leave and crash pop their own: a follower kept an entry
        # per node id it ever saw, and a departed node's Redis outage made
        # backend_degraded true for good.)
        gone = [i for i in self.health if i not in view and i not in self.joining]
        for member_id in gone:
            del self.health[member_id]
        # The record a take-over withheld leases for is carried out (or passed):
        # its members, a member withheld then joining again included, are leased.
        if self.withheld and view.epoch >= self._withheld_for:
            self.withheld = frozenset()
        # And what on-demand renewals remember (renew_lapsed): one entry per id
        # ever renewed, for as long as the router ran.
        for member_id in [i for i in self._renewed_at if i not in view]:
            del self._renewed_at[member_id]
            self._renewing.pop(member_id, None)
        self._save_state()
        self.changed.set()
        self.changed = asyncio.Event()

    @property
    def lease_seconds(self) -> float:
        """Seconds of lease granted per renewal (leases are off until start() turns
        on health checks: only a router that removes members needs them). Without
        ``--lease``, at least what a take-over of the lead needs, from the ttl
        etcd granted: an etcd with a longer election timeout raises a 2 s ttl to
        its minimum, and a lease sized from the ttl asked for lapsed at each
        take-over again (the review of the day's changes)."""
        if self._lease is not None:
            return self._lease
        ttl = self.coordinator.granted_ttl if self.coordinator is not None else None
        return min(
            MAX_LEASE,
            node_lease(self._detection, self.health_interval + self.health_timeout, ttl),
        )

    # ------------------------------------------------------------------ stale views

    async def _take_ring_of(self, member: Member) -> None:
        """This router has no ring and a node given to it holds one: a router
        started with none (its state file lost, no seeds) that an operator
        gives its nodes again. Joined as it stood, the router made a ring of its
        own at epoch 1 beside theirs and answered 200 (the node refused the
        older view). It takes the newest view the members of the node's ring
        hold (the node's own may be old: one removed from the ring that still
        runs holds the view it was removed from), then joins the node as
        usual: already a member of that view, or joined to it.

        On etcd the same holds when etcd lost its data while no router carried
        the ring (every router restarted, no seeds): the leader records the
        nodes' newest view there, as a start with seeds does. Before, the
        nodes' re-registrations made a ring at epoch 1 below theirs; they
        refused its views, a node joining it decided its users from fresh
        states, and users got twice their limit, silently (an exploratory
        tester).

        Only when this router has no ring: a node of another cluster given to a
        router that has one must not replace its ring (and take its members'
        counters out of it)."""
        # Of this cluster only (etcd's name): a member of the node's ring that now
        # runs in another cluster must not lend this one its ring and rules.
        cluster = self.cluster
        seen = await self.nodes.discover([member], self.health_timeout, cluster=cluster)
        if seen is None or not len(seen):
            return
        asked = {m.id: m for m in (*seen.members, member)}
        found = await self.nodes.discover(
            list(asked.values()), self.health_timeout, with_urls=True, cluster=cluster
        )
        if found is None or found[0].epoch <= self.view.epoch or not len(found[0]):
            return
        async with self.lock:
            # Under the lock, and only if still without a ring: a join of another
            # node meanwhile made one, which the older ring must not replace (a
            # review: the new node was dropped from the router's ring, unprobed).
            if len(self.view):
                return
            log.warning(
                "node %s holds a ring and this router none: taking the newest its members "
                "hold, epoch %d",
                member.id,
                found[0].epoch,
            )
            if self.coordinator is None:
                await self._take_view_of(found[1])
            else:
                await self._record_nodes_ring(found[0], found[1])

    async def _record_nodes_ring(self, view: RingView, node_url: str) -> None:
        """On etcd, under the lock: record ``view`` (the nodes' newest, from the
        node at ``node_url``) where etcd holds no ring, and follow the record.
        A ring etcd holds meanwhile wins. Their rules too when etcd has none (as
        at a start with seeds: those applied at runtime were etcd's and theirs);
        rules given since etcd lost its data are etcd's record's."""
        assert self.coordinator is not None
        written = False
        try:
            record = await self.coordinator.load()
            if record is None or (not len(record.view) and view.epoch > record.view.epoch):
                if record is None:
                    await self._adopt_nodes_config(node_url)
                written = await self._record_again(record, self.config, view)
                record = await self.coordinator.load()
        except NotLeading as exc:
            raise MembershipError(503, "no_leader", f"{exc}; retry shortly") from None
        except CoordinatorError as exc:
            raise MembershipError(503, "coordinator_unavailable", str(exc)) from None
        if record is not None:
            # Forced only onto the record this router wrote; another is followed
            # as any record is (settled).
            self._take(record, force=written and record.view == view)

    def token_refused(self, member: Member) -> None:
        """A member refused this router's internal token on a proxied request:
        said in the log (at most once per 10 s), not left to look like a
        network fault (the health loop's probes fail the same way)."""
        self.failures.warn(
            "token_refused",
            "node %s refused this router's internal token: set RINGLIMIT_INTERNAL_TOKEN "
            "to the nodes' token (its keys are answered by their on_error until then)",
            member.id,
        )

    async def renew_lapsed(self, member: Member, *, every: float = 0.1) -> bool:
        """A member answered that its lease lapsed: renew it now if this router
        grants leases, and say whether the member decides again (the request,
        which it did not decide, may be sent again). Otherwise, or when the
        renewal fails, :meth:`lease_lapsed` says so in time.

        After a pause of this router (or a restart that adopted a ring before its
        first probe round), leases have lapsed while the router and its members
        are healthy: the requests queued meanwhile were each answered by their
        rules' on_error, an open rule's admitted uncounted, until the next probe
        renewed them (an exploratory tester: exhausted users admitted again after
        a 2-3 s pause). A renewal here is what that probe does, for a member of
        the view this router holds and has not condemned (router/health.py
        ``renew``): the lease's bound on a member being removed is unchanged.
        Concurrent callers share one renewal, and one is started at most every
        ``every`` seconds per member.
        """
        if not self.leasing or member.id not in self.view or self.view.member(member.id) != member:
            self.lease_lapsed(member)
            return False
        task = self._renewing.get(member.id)
        if task is None or task.done():
            now = asyncio.get_running_loop().time()
            if now - self._renewed_at.get(member.id, float("-inf")) < every:
                self.lease_lapsed(member)
                return False
            self._renewed_at[member.id] = now
            task = self._renewing[member.id] = self._spawn(self._renew_now(member))
        if await asyncio.shield(task):
            return True
        self.lease_lapsed(member)
        return False

    async def _renew_now(self, member: Member) -> bool:
        answer = await self._renew(member)
        left = answer.get("lease_left") if answer is not None else None
        return isinstance(left, int | float) and left > 0

    def lease_lapsed(self, member: Member) -> None:
        """A member answered that its lease lapsed, and this router grants none:
        once members have answered so for :data:`LAPSED_WARN_AFTER` seconds on
        end, say which and why in the log (at most once per 10 s).

        Only the router that runs health checks renews leases, and a node it made
        require one keeps requiring it (docs/rebalancing.md): a ring whose only
        router was restarted with --no-health-checks answered every key by its
        on_error, an open rule's uncounted, with nothing in any log. Not at the
        first lapse: one lasts while the renewing router is paused or an etcd
        election runs, and ends by itself."""
        if self.leasing:
            return  # renewed at its next probe round
        now = asyncio.get_running_loop().time()
        first, last = self._lapsed.get(member.id, (now, now))
        if now - last > LAPSED_GAP:
            first = now  # not seen lapsed for a while: a new lapse
        self._lapsed[member.id] = (first, now)
        for node_id in [n for n, (_, seen) in self._lapsed.items() if now - seen > LAPSED_GAP]:
            del self._lapsed[node_id]
        lasting = sorted(
            n for n, (since, _) in self._lapsed.items() if now - since >= LAPSED_WARN_AFTER
        )
        if not lasting:
            return
        if self.coordinator is not None:
            why = (
                "this router follows on etcd and the elected leader renews leases: no "
                "router leads, or the leader cannot reach them"
            )
        elif self.leader_url is not None:
            why = "the leading worker renews leases: it is restarting, or cannot reach them"
        else:
            why = (
                "this router runs without health checks and renews none: the router "
                "that runs them is down or cannot reach them, or none runs them any "
                "more (run one; as a last resort, restart the nodes)"
            )
        names = ", ".join(lasting[:5])
        if len(lasting) > 5:
            names += f" and {len(lasting) - 5} more"
        self.failures.warn(
            "lease_lapsed",
            "node(s) %s decide nothing: their leases lapsed at least %.0f s ago, and %s. "
            "Their keys are answered by their on_error",
            names,
            LAPSED_WARN_AFTER,
            why,
        )

    async def catch_up(self, epoch: int, node_url: str) -> None:
        """A node knows a newer epoch than this router: wait for our change or fetch it.

        While this router's own change is still under way the node's view is
        not taken: it is that change's, pushed to some members, and the change
        may yet fail (a leave whose leaver cannot hand its states off is
        turned into a crash removal). Taken mid-change after the 5 s wait, a
        slow leave that then failed was neither removed as a crash nor
        reported, and the leaver's users started afresh once it exited (an
        independent review). The request is refused as the ring changing.
        """
        if self.view.epoch >= epoch:
            return
        if self.lock.locked():
            await self.wait_for_change()
            if self.view.epoch >= epoch or self.lock.locked():
                return
        await self._take_view_of(node_url)

    async def _take_view_of(self, node_url: str) -> None:
        """Adopt the view (and config) of the node at ``node_url`` if it is newer."""
        try:
            data = await self.nodes.cluster(node_url)
            view = RingView.from_dict(data["ring"])
        except (httpx.HTTPError, KeyError, TypeError, ValueError) as exc:
            log.warning("could not fetch the newer view from %s: %s", node_url, exc)
            return
        other = data.get("cluster")
        if self.cluster is not None and isinstance(other, str) and other != self.cluster:
            # Never another cluster's ring as this one's (router/nodeclient.py
            # wait_ready keeps such nodes out; a node of a version before both
            # clusters said their names may still be shared).
            self.failures.warn(
                "another_cluster_view",
                "not adopting epoch %d from %s: it is cluster %r's ring, not %r's",
                view.epoch,
                node_url,
                other,
                self.cluster,
            )
            return
        if view.epoch > self.view.epoch:
            taken = _node_config(data)
            if taken is not None:
                self._take_config(taken, node_url)
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
        found = await self.nodes.discover(
            others, self.health_timeout, with_urls=True, cluster=self.cluster
        )
        if found is None or found[0].epoch <= epoch:
            return False
        await self.catch_up(found[0].epoch, found[1])
        return self.view.epoch > epoch

    async def refresh_node(self, member: Member, node_epoch: int) -> None:
        """A node is behind this router's view: push it the current view again.

        A node at epoch 0 while the ring is older has restarted and lost its
        state: it is treated as crashed (its keys follow the crash policy) and
        then joins again as a new member.

        Only the leading router does either: a router that follows has neither
        the authority to change the ring nor the history of crashes a refresh
        carries. It waits (bounded) for the leader's health loop to repair the
        node, which it does within one health interval.
        """
        if self.follows:
            await self._leader_repairs(member)
            return
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

    async def _leader_repairs(self, member: Member) -> None:
        """Wait until the leader brought ``member`` up to date (its epoch reaches
        ours) or changed the ring, at most ``2 * health_interval + health_timeout``;
        concurrent callers share one wait per member (one probe per 0.1 s)."""
        task = self._awaiting_repair.get(member.id)
        if task is None or task.done():
            task = self._awaiting_repair[member.id] = self._spawn(self._poll_repair(member))
            task.add_done_callback(partial(self._repair_awaited, member.id))
        await asyncio.shield(task)

    def _repair_awaited(self, member_id: str, task: asyncio.Task[Any]) -> None:
        """A finished wait leaves (ids of nodes long gone do not pile up)."""
        if self._awaiting_repair.get(member_id) is task:
            del self._awaiting_repair[member_id]

    async def _poll_repair(self, member: Member) -> None:
        loop = asyncio.get_running_loop()
        epoch = self.view.epoch
        deadline = loop.time() + 2 * self.health_interval + self.health_timeout
        while loop.time() < deadline and self.view.epoch == epoch:
            await asyncio.sleep(REPAIR_POLL)
            seen = await self.nodes.epoch(member, self.health_timeout)
            if seen is not None and seen >= self.view.epoch:
                return

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
            # Telling a removed member is the point of a notify: never abandoned.
            abandon=push.role != "notify",
            established=push.established,
        )

    async def _push_all(
        self,
        view: RingView,
        previous: RingView | None,
        crashed: Iterable[str],
        *,
        seconds: float | None = None,
        established: bool = False,
    ) -> list[str]:
        """Send ``view`` to every member; returns the ids that did not take it."""
        return await self._push(
            view.members,
            view,
            previous,
            tuple(crashed),
            tolerate=True,
            seconds=seconds,
            established=established,
        )

    async def _push(
        self,
        members: Iterable[Member],
        view: RingView,
        previous: RingView | None,
        crashed: tuple[str, ...] | Iterable[str],
        *,
        tolerate: bool = False,
        seconds: float | None = None,
        abandon: bool = True,
        established: bool = False,
    ) -> list[str]:
        """Send a view; returns the ids that did not take it (raises unless ``tolerate``).

        ``seconds`` bounds a push that carries no handoff (the default, the
        client's push timeout, leaves room for a node to deliver its states).
        With ``abandon``, the push to a member whose crash removal is decided
        meanwhile is abandoned (:meth:`_abandon_condemned`). ``established``:
        see router/nodeclient.py ``push_body``.
        """
        members = list(members)
        self.log.saw(view.epoch)
        # Only the router that removes members on its own probes makes nodes
        # require a lease; others leave the setting as it is.
        lease = self.lease_seconds if self.leasing else None
        payload = push_body(
            view,
            previous,
            crashed,
            self.config,
            lease,
            established=established,
            cluster=self.cluster,
        )
        pending = {
            asyncio.create_task(self.nodes.push_one(m, payload, seconds=seconds)): m
            for m in members
        }
        errors: dict[str, BaseException] = {}
        waited = False
        try:
            while pending:
                urgent = abandon and bool(self.monitor.removing)
                if abandon:
                    self._abandon_condemned(pending, errors, view.epoch)
                if urgent and waited and pending:
                    await self._release_applied(pending, view)
                if not pending:
                    break
                # Wake on an answer, or when a removal is decided (it may
                # condemn a member this push is still waiting for); while one
                # waits, look again every RELEASE_POLL seconds.
                preempted = asyncio.ensure_future(self._preempt.wait())
                try:
                    await asyncio.wait(
                        [*pending, preempted],
                        timeout=RELEASE_POLL if urgent else None,
                        return_when=asyncio.FIRST_COMPLETED,
                    )
                finally:
                    preempted.cancel()
                waited = True
                for task in [t for t in pending if t.done()]:
                    member = pending.pop(task)
                    if (exc := task.exception()) is not None:
                        errors[member.id] = exc
        finally:
            for task in pending:
                task.cancel()
        failed = [m.id for m in members if m.id in errors]
        if failed and not tolerate:
            raise errors[failed[0]]
        for member_id in failed:
            log.warning("push of epoch %d: %s", view.epoch, errors[member_id])
        return failed

    async def _release_applied(
        self, pending: dict[asyncio.Task[None], Member], view: RingView
    ) -> None:
        """While a crash removal waits: stop waiting for members of ``view`` that
        have already applied it, and are only still delivering.

        A node applies a view the moment the push arrives, without awaiting
        (node/shard.py ``apply``: it stops deciding the keys it lost, and its
        states leave in an outbox), and answers once it delivered them; its
        ``/healthz`` epoch says it applied. What it delivers keeps going (the
        push is not cancelled, only no longer waited for), and a new owner
        waits for states in flight or pulls them (the node's handoff wait), as
        with ``wait: false``. Without this, a live member's answer may wait for
        its final marks to the very member being removed (three tries of 5 s
        each, to a paused peer), and the removal behind it.
        """
        candidates = [(t, m) for t, m in pending.items() if m.id in view and not t.done()]
        epochs = await asyncio.gather(
            *(self.nodes.epoch(m, self.health_timeout) for _, m in candidates)
        )
        for (task, member), epoch in zip(candidates, epochs, strict=True):
            if epoch is None or epoch < view.epoch or task.done() or task not in pending:
                continue
            del pending[task]
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            task.add_done_callback(_log_released(member.id, view.epoch))
            log.info(
                "node %s applied epoch %d and is still delivering: not waited for "
                "(a crash removal is due)",
                member.id,
                view.epoch,
            )

    def _abandon_condemned(
        self,
        pending: dict[asyncio.Task[None], Member],
        errors: dict[str, BaseException],
        epoch: int,
    ) -> None:
        """Stop waiting for pushes to members being removed as crashed.

        A member is condemned only once every lease granted to it has certainly
        ended (router/removal.py), so it decides nothing whether or not it ever
        takes this view: waiting for it (up to the push timeout, for a paused
        node) would only delay its own removal. It counts as a member that did
        not take the view: the change goes on without it (the view log's
        half-failed-change path), and the removal follows at once.
        """
        for task, member in list(pending.items()):
            if member.id in self.monitor.condemned:
                task.cancel()
                del pending[task]
                errors[member.id] = MembershipError(
                    502,
                    "push_abandoned",
                    f"node {member.id} is being removed as crashed; "
                    f"push of epoch {epoch} abandoned",
                )

    def preempt(self) -> None:
        """A removal was decided: wake every push under way (see :meth:`_push`)
        and a join still before its commit (it yields the lock and retries)."""
        self._preempt.set()
        self._preempt = asyncio.Event()

    def _take_config(self, config: ClusterConfig, source: str) -> None:
        """Adopt ``config`` from ``source``, with what this router keeps added.

        The additions reach the nodes with this router's next push (a leader
        pushes its view, with its config, when it takes the lead) and etcd with
        its next commit; a clash keeps the adopted config, loudly.
        """
        if self.keep_config is not None:
            try:
                kept = self.keep_config(config)
            except ValueError as exc:
                log.error(
                    "the config from %s clashes with this router's own rules: %s", source, exc
                )
            else:
                if kept != config:
                    log.warning("kept this router's own rules in the config from %s", source)
                config = kept
        self.config = config

    async def repush_config(self, member: Member) -> None:
        """The health loop found ``member`` at the current epoch with a config
        that is not this leader's: push it the view and config again."""
        if self.follows:
            return
        async with self.lock:
            if member in self.view.members:
                log.warning("node %s holds other rules than this router's: pushed again", member.id)
                await self._push([member], self.view, None, (), tolerate=True, established=True)

    async def push_config(self, config: ClusterConfig) -> None:
        self._must_lead()
        async with self.lock:
            self.config = config
            await self._push_all(self.view, None, (), established=True)

    async def change_config(self, config: ClusterConfig) -> ConfigChange:
        """Make ``config`` the cluster's (the admin API's new rules): the config
        the cluster now has, this router's own rules added, and the members that
        did not take it yet (a member that did not answer, or that restarted
        and refused: the health loop gives it the rules, or repairs it).

        Recorded in etcd first, as a settled record of the same view (a config
        changes no view, so there is nothing to roll forward): the other
        routers adopt it from their watch, and a leader that dies before its
        push leaves the next one to push it with its view. Then pushed to
        every member, which keeps the states of a rule whose algorithm stays
        (limits and periods are read at decision time) and drops those of a
        rule whose algorithm changed. Raises ValueError when ``config`` clashes
        with this router's own rules (``--envoy-config``) or cannot be sent,
        MembershipError when etcd cannot take it.

        A failure leaves this router's config as it was, unless etcd already
        holds the new one (then it is the cluster's, and a member that missed
        it gets it again from the health loop): a config adopted before a push
        that failed was answered by the decision API and pushed to every
        joining node, though no node had it (a lone surrogate in a tier).
        """
        self._must_lead()
        if self.keep_config is not None:
            config = self.keep_config(config)
        if (where := unencodable(config.to_dict())) is not None:
            raise ValueError(f"the config cannot be sent to the nodes: {where} is not UTF-8 text")
        async with self.lock:
            if self.coordinator is not None:
                await self._record_config(config)
            before, self.config = self.config, config
            try:
                pending = await self._push_all(self.view, None, (), established=True)
            except BaseException:
                if self.coordinator is None:
                    self.config = before
                raise
        return ConfigChange(config, tuple(pending))

    async def _record_config(self, config: ClusterConfig) -> None:
        assert self.coordinator is not None
        try:
            record = await self.coordinator.load()
            # No record (a cluster with no ring yet, or an etcd that lost its
            # data) or an older one: the rules go with this leader's view.
            if record is None or self._behind(record):
                if await self._record_again(record, config):
                    return
                raise MembershipError(
                    409, "ring_changed", "another router changed the ring first; retry"
                )
            # The view this leader holds is one it carried out: a record of it
            # left unsettled (a failed settle) is marked settled here too.
            if record.view != self.view:
                raise MembershipError(409, "ring_changing", "the ring is changing; retry")
            done = ViewRecord(
                record.view, record.previous, record.crashed, config, True, record.revision
            )
            committed = await self.coordinator.commit(done, expected=record.revision)
        except NotLeading as exc:
            raise MembershipError(503, "no_leader", f"{exc}; retry shortly") from None
        except CoordinatorError as exc:
            raise MembershipError(503, "coordinator_unavailable", str(exc)) from None
        if committed is None:
            raise MembershipError(
                409, "ring_changed", "another router changed the ring first; retry"
            )
        self._revision = committed.revision

    async def _wait_ready(self, member: Member) -> int:
        """Until ``member`` answers as itself; the epoch it holds."""
        return await self.nodes.wait_ready(
            member,
            self.ready_timeout,
            self.health_timeout,
            round_robin=self.config.balance == "round-robin",
            owner_routed=self.config.backend == "memory" and self.config.balance == "sticky",
            cluster=self.cluster,
        )

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
        """A node reports its shared backend (Redis) down, so users are routed
        stickily to the nodes' local limiters: by this router's own probes (a
        router on etcd that does not lead asks for this alone: HealthMonitor.
        check_backends), or, for a follower worker (which probes nothing), by the
        leader's at the last poll. Before, a follower worker kept round-robin for
        the whole outage."""
        return self.leader_backend_degraded or any(
            not h.backend_available for h in self.health.values()
        )

    # ------------------------------------------------------------------ state file

    def describe(self) -> dict[str, Any]:
        nodes = [{**m.to_dict(), "state": self.health.get(m.id, Health()).state} for m in self.view]
        nodes += [{**m.to_dict(), "state": "joining"} for m in self.joining.values()]
        data: dict[str, Any] = {
            "epoch": self.view.epoch,
            "nodes": nodes,
            "rules_digest": self.config.rules_digest,
            "config_digest": self.config.digest,
        }
        if self.backend_degraded:
            data["backend_degraded"] = True  # what a follower polls (follow_once)
        if self.coordinator is not None:
            data["coordinator"] = {"etcd": self.coordinator.where, "leading": self.leading}
        elif self.leader_url is not None:
            data["leader"] = self.leader_url
        if self.state_problem is not None:
            data["warning"] = (
                f"the state file was not written: {self.state_problem} (the ring above is "
                "in force on the nodes; a router restarted now recovers an older one)"
            )
        data["events"] = [e.to_dict() for e in reversed(self.events.last(MAX_EVENTS))]
        return data

    def _save_state(self, *, strict: bool = False) -> None:
        """Keep the view in the state file. At start (``strict``) a file that
        cannot be written stops the router, in one line. Afterwards the view
        is already in force on the nodes when it is saved: a failure (a full
        disk, a read-only mount) was raised into the admin call, which
        answered 500 for a change that had happened (a retry: 404), and was
        logged nowhere. Now it is an error line per change, and said in
        :meth:`describe` (every admin answer) until a write succeeds."""
        if self.state_file is None:
            return
        try:
            save_view(self.state_file, self.view)
        except MembershipError as exc:
            if strict:
                raise
            self.state_problem = exc.detail
            log.error(
                "the ring at epoch %d is in force, but the state file was not written (%s): "
                "a router restarted now recovers an older ring from it",
                self.view.epoch,
                exc.detail,
            )
            return
        if self.state_problem is not None:
            log.warning("state file written again at epoch %d", self.view.epoch)
            self.state_problem = None

    def _load_state(self) -> RingView | None:
        return load_view(self.state_file) if self.state_file is not None else None


class ConfigChange(NamedTuple):
    """What :meth:`Membership.change_config` did."""

    config: ClusterConfig
    #: Members that did not take it (yet): unreachable, or restarted and refused.
    pending: tuple[str, ...]


def _node_config(data: dict[str, Any]) -> ClusterConfig | None:
    """The config in a node's ``/internal/cluster`` answer; None if it has none
    this router can read."""
    raw = data.get("config") if isinstance(data, dict) else None
    if not raw:
        return None
    try:
        return ClusterConfig.from_dict(raw, source="node config", strict=False)
    except (TypeError, ValueError):
        return None
