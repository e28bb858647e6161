"""A node's shard: which keys it may decide, and how state follows the keys.

The node is the single authority for the keys the newest ring view gives it.
Everything here exists to keep that true while the ring changes:

* **Fencing.** A key is decided only by its owner under the newest epoch this
  node knows; any other key is refused with :class:`NotOwner`, which tells the
  router to refresh its view and retry. Two nodes never decide the same key at
  once, even while some router still holds a stale view.
* **Handoff.** When a view arrives, the node takes every state it no longer
  owns out of its store at once (so it can never decide them again) and sends
  each to its new owner, with times relative to its clock.
* **Pull-on-miss.** A new owner that is asked about a key it has not
  received yet pulls that key from the previous owner first, so no request is
  decided on a fresh state that should have been inherited.
* **Crashes.** A crashed node cannot hand anything off; the crash policy says
  what its keys start from: nothing (``reset``), an exhausted quota for one
  period (``conservative``) or the successor's replica (``replica``), which
  every node streams to each key's successor every replication interval.

See docs/rebalancing.md for what each event costs in the worst case.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from node.algorithms import MAX_SPAN, exhausted, exhausted_for
from node.clock import Clock
from node.config import ClusterConfig
from node.failures import Failures
from node.lease import Lease, boot_clock
from node.peers import PeerError, Peers
from node.rules import Rule
from node.store import MemoryStore, Record, check_records
from ring import EmptyRingError, RingView

log = logging.getLogger("ringlimit.node")

#: Keys whose replica targets replication remembers (then it starts over). Small on
#: purpose: a million-entry cache cost ~90 bytes per key of node memory.
SUCCESSOR_CACHE = 65_536


class NotOwner(Exception):
    """This node does not own the key under the newest view it knows."""

    def __init__(self, key: str, epoch: int, owner: str | None) -> None:
        super().__init__(f"key is owned by {owner} at epoch {epoch}")
        self.key = key
        self.epoch = epoch
        self.owner = owner


class LeaseExpired(Exception):
    """This node's lease lapsed: it may have been removed while it could not hear.

    It decides nothing until a router renews the lease (node/lease.py), so a
    node that wakes from a pause never answers from the state it held before.
    """


class StaleEpoch(Exception):
    """A peer asked about an epoch this node has not seen yet."""


class InFlight(Exception):
    """A peer asked for keys whose states are on their way to it right now.

    The puller waits for that transfer (or for it to fail, after which the
    states are back in the outbox and a pull gets them) rather than decide
    on a fresh state.
    """


@dataclass(frozen=True)
class Crash:
    """A crash the conservative policy still answers for.

    ``view`` is the ring before the crash (it says which keys the crashed
    members owned); ``at`` is when the crash was applied, on this node's
    clock. Until ``until`` a key those members owned and nobody holds a state
    for starts exhausted, as if it had been used up at ``at``.
    """

    view: RingView
    crashed: frozenset[str]
    at: float
    until: float

    def affects(self, key: str) -> bool:
        try:
            return self.view.owner_id(key) in self.crashed
        except EmptyRingError:
            return False

    def to_wire(self, now: float) -> dict[str, Any]:
        return {
            "view": self.view.to_dict(),
            "crashed": sorted(self.crashed),
            "age": now - self.at,
            "left": self.until - now,
        }

    @classmethod
    def from_wire(cls, data: dict[str, Any], now: float) -> Crash:
        """Parse a peer's crash; ``ValueError``/``KeyError``/``TypeError`` if malformed."""
        age, left, crashed = data["age"], data["left"], data["crashed"]
        for value in (age, left):
            if type(value) not in (int, float) or not -MAX_SPAN <= value <= MAX_SPAN:
                raise ValueError(f"crash age/left must be finite seconds, got {value!r}"[:120])
        if type(crashed) is not list or not all(type(c) is str for c in crashed):
            raise ValueError("crash 'crashed' must be a list of member ids")
        return cls(RingView.from_dict(data["view"]), frozenset(crashed), now - age, now + left)


@dataclass
class HandoffStats:
    keys_sent: int = 0
    keys_received: int = 0
    keys_dropped: int = 0
    pulls: int = 0
    pull_failures: int = 0
    replicas_sent: int = 0
    replicas_promoted: int = 0
    conservative_keys: int = 0
    views_applied: int = 0
    last_transfer_seconds: float = 0.0


class Shard:
    def __init__(
        self,
        node_id: str,
        store: MemoryStore,
        clock: Clock,
        peers: Peers,
        config: Callable[[], ClusterConfig],
        *,
        handoff_wait: float = 5.0,
        lease: Lease | None = None,
        monotonic: Clock = boot_clock,
    ) -> None:
        self.id = node_id
        self.store = store
        self.clock = clock
        self.peers = peers
        self._config = config
        self.handoff_wait = handoff_wait
        self.lease = lease if lease is not None else Lease()
        self.monotonic = monotonic
        #: None until a router sends a view: a standalone node decides every key.
        self.view: RingView | None = None
        self.previous: RingView | None = None
        self.stats = HandoffStats()
        #: Errors the replication loop survived (/metrics).
        self.failures = Failures(log)
        #: Crashes still covered by the conservative policy (newest last).
        self._crashes: list[Crash] = []
        self._pending: dict[str, float] = {}
        self._finals: dict[int, set[str]] = {}
        self._outbox: dict[str, list[Record]] = {}
        #: Keys being delivered right now, by receiving member (see serve_pull).
        self._in_flight: dict[str, set[str]] = {}
        self._pulling: dict[str, asyncio.Future[None]] = {}
        self._pulled: set[str] = set()
        self._replicas: dict[str, MemoryStore] = {}
        self._successors: dict[str, tuple[str, ...]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------ deciding

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view is not None else 0

    def check_owner(self, key: str) -> None:
        view = self.view
        if view is None:
            return
        try:
            owner = view.owner_id(key)
        except EmptyRingError:
            raise NotOwner(key, view.epoch, None) from None
        if owner != self.id:
            raise NotOwner(key, view.epoch, owner)
        lease = self.lease
        if lease.required and not lease.valid(self.monotonic()):
            raise LeaseExpired(f"lease expired at epoch {view.epoch}")

    async def admit(self, key: str, rules: Sequence[Rule]) -> bool:
        """Raise :class:`NotOwner` unless this node may decide ``key`` now.

        While a handoff into this node is still under way, make sure the key's
        inherited state is here before anyone decides on it. Returns True when
        it had to wait: a newer view may have arrived meanwhile, so a caller
        deciding several keys must check ownership again just before deciding
        (:meth:`check_owner`, which does not wait).
        """
        self.check_owner(key)
        waited = False
        if self._pending:
            await self._inherit(key, rules)
            waited = True
            self.check_owner(key)  # the view may have changed during the pull
        if self._crashes:
            self._conservative(key, rules)
        return waited

    async def _inherit(self, key: str, rules: Sequence[Rule]) -> None:
        previous = self.previous
        if previous is None or not len(previous):
            return
        previous_owner = previous.owner_id(key)
        if previous_owner == self.id:
            return
        loop = asyncio.get_running_loop()
        deadline = self._pending.get(previous_owner)
        if deadline is not None:
            if loop.time() > deadline:
                log.warning("handoff from %s not finished in time; deciding anyway", previous_owner)
                self._pending.pop(previous_owner, None)
            elif key not in self._pulled and not self._holds(key, rules):
                await self._pull(previous, previous_owner, key)

    def _conservative(self, key: str, rules: Sequence[Rule]) -> None:
        """A key a crashed member owned, with no state here, starts exhausted."""
        now = self.clock()
        if self._crashes[0].until <= now:
            self._crashes = [c for c in self._crashes if c.until > now]
        for crash in self._crashes:
            if crash.affects(key):
                self._exhaust(key, rules, now, crash.at)

    def _holds(self, key: str, rules: Sequence[Rule]) -> bool:
        return any(self.store.get(rule, key) is not None for rule in rules)

    async def _pull(self, previous: RingView, owner_id: str, key: str) -> None:
        waiting = self._pulling.get(key)
        if waiting is not None:
            await waiting
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pulling[key] = future
        self.stats.pulls += 1
        try:
            url = previous.member(owner_id).url
            deadline = asyncio.get_running_loop().time() + self.handoff_wait
            answer: dict[str, Any] = {}
            while True:
                try:
                    answer = await self.peers.post(
                        url, "/internal/pull", {"keys": [key], "epoch": self.epoch, "to": self.id}
                    )
                    break
                except PeerError as exc:
                    # 409: the peer has not applied this epoch yet, or the key's
                    # state is in a transfer to us right now; no answer or a 5xx:
                    # a hiccup. Wait for either to change, but not past the
                    # deadline, and stop as soon as the peer's transfer has landed
                    # (its final mark came in).
                    if exc.transient and asyncio.get_running_loop().time() < deadline:
                        await asyncio.sleep(0.02 if exc.status == 409 else 0.05)
                        if owner_id not in self._pending:
                            break
                        continue
                    raise
            records = check_records(answer.get("records", []))
            self.store.import_(records, self.clock(), self._config().rule_map)
            self._mark_dirty(records)
            self.stats.keys_received += len(records)
        except (PeerError, KeyError, ValueError, TypeError) as exc:
            self.stats.pull_failures += 1
            log.warning(
                "pull of one key from %s failed (%s); deciding on local state", owner_id, exc
            )
        finally:
            self._pulled.add(key)
            del self._pulling[key]
            future.set_result(None)

    def _exhaust(self, key: str, rules: Sequence[Rule], now: float, at: float) -> None:
        """Conservative crash policy: a key the crashed node held starts with no quota."""
        policy = self._config().policies.crash
        for rule in rules:
            if (rule.crash_policy or policy) != "conservative":
                continue
            if self.store.get(rule, key) is not None:
                continue
            state, fresh_at = exhausted(rule, at)
            # An exhausted bucket with burst > limit takes longer than a period to refill.
            if fresh_at <= now:
                continue
            self.store.put(rule, key, state)
            self.stats.conservative_keys += 1

    # ------------------------------------------------------------------ views

    def apply(
        self,
        view: RingView,
        previous: RingView | None,
        crashed: Sequence[str] = (),
    ) -> bool:
        """Adopt a newer view: fence, hand off, and set up inheritance.

        Runs without awaiting, so no request can be decided between the
        switch of view and the removal of the keys that moved away.
        """
        if self.view is not None and view.epoch <= self.view.epoch:
            return False
        config = self._config()
        previous = previous if previous is not None else self.view
        self.previous = previous
        self.view = view
        self._successors.clear()
        self.stats.views_applied += 1
        now = self.clock()
        if self.id in crashed and self.id not in view:
            self._hand_back(view, now)
            return True
        if len(view):
            me_in = self.id in view

            def moved(key: str) -> bool:
                return not me_in or view.owner_id(key) != self.id

            records = self.store.export(now, moved, remove=True)
            if config.policies.rebalance == "handoff":
                # States still waiting from an earlier view (a failed delivery)
                # go to their owner under this one.
                leftovers = [r for pending in self._outbox.values() for r in pending]
                self._outbox.clear()
                self._stash(leftovers, view, now)
                for record in records:
                    self._outbox.setdefault(view.owner_id(record[2]), []).append(record)
            else:
                self.stats.keys_dropped += len(records)
        self._promote_replicas(view, crashed, now, config)
        dirty = self._dirty()
        if dirty is not None:
            # Successors may have changed: every state goes to its (new)
            # successor at the next round, not only the ones that change.
            dirty.update(self.store.keys())
        conservative_rules = [
            s.rule
            for s in config.rules
            if (s.rule.crash_policy or config.policies.crash) == "conservative"
        ]
        if crashed and conservative_rules and previous is not None:
            # Remembered across later views (a join right after a crash must
            # not turn the crashed member's keys fresh), and handed to new
            # owners with the states.
            self._crashes = [c for c in self._crashes if c.until > now]
            self._crashes.append(
                Crash(
                    previous,
                    frozenset(crashed),
                    now,
                    now + max(exhausted_for(r) for r in conservative_rules),
                )
            )
        senders: set[str] = set()
        if previous is not None and self.id in view:
            senders = {m for m in previous.ids if m != self.id and m not in crashed}
        senders -= self._finals.pop(view.epoch, set())
        for epoch in [e for e in self._finals if e < view.epoch]:
            del self._finals[epoch]
        deadline = asyncio.get_event_loop().time() + self.handoff_wait
        self._pending = dict.fromkeys(senders, deadline)
        self._pulled.clear()
        return True

    def _hand_back(self, view: RingView, now: float) -> None:
        """This node was removed as crashed, but its process lived on (a pause, a
        partition, a slow host): it must stop deciding, and what it holds goes
        to the keys' current owners rather than away.

        The owners merge each state with theirs, keeping the more restrictive
        (``MemoryStore.import_``): they decided from a replica or from nothing
        while this node was away, and this node may hold admissions the replica
        never saw. A repeated or late hand-back never gives quota twice. Only a
        restarted process (memory gone) comes back empty.
        """
        self.lease.revoke()
        records = self.store.export(now, remove=True)
        leftovers = [r for pending in self._outbox.values() for r in pending]
        self._outbox.clear()
        self.store.sweep(float("inf"), budget=None)
        self._replicas.clear()
        if self.store.dirty is not None:
            self.store.dirty = set()
        self._pending = {}
        self._pulled.clear()
        if self._config().policies.rebalance != "handoff" or not len(view):
            self.stats.keys_dropped += len(records) + len(leftovers)
            return
        for record in [*leftovers, *records]:
            self._outbox.setdefault(view.owner_id(record[2]), []).append(record)
        if records:
            log.warning(
                "removed from the ring while away: handing %d state(s) back to their owners",
                len(records),
            )

    def _promote_replicas(
        self, view: RingView, crashed: Sequence[str], now: float, config: ClusterConfig
    ) -> None:
        """Crashed members' keys that this node now owns start from its replicas.

        The rest of a crashed member's replicas are kept as replicas of the
        keys' new owners: with ``replicas = 2`` this node may be the second copy
        of a key whose new owner crashed at the same time, and the removal of
        that owner (next) must find the copy here.
        """
        if self.id not in view or not len(view):
            self._replicas.clear()
            return
        for origin in crashed:
            replicas = self._replicas.pop(origin, None)
            if replicas is None:
                continue
            records = replicas.export(now)
            promoted: list[Record] = []
            kept: dict[str, list[Record]] = {}
            for record in records:
                owner = view.owner_id(record[2])
                if owner != self.id:
                    kept.setdefault(owner, []).append(record)
                    continue
                rule = config.rule(record[0])
                if rule is not None and (rule.crash_policy or config.policies.crash) == "replica":
                    promoted.append(record)
            self.stats.replicas_promoted += self.store.import_(promoted, now, config.rule_map)
            self._mark_dirty(promoted)
            for owner, moved in kept.items():
                store = self._replicas.get(owner)
                if store is None:
                    store = self._replicas[owner] = MemoryStore()
                store.import_(moved, now, config.rule_map)
        for origin in list(self._replicas):
            if origin not in view:
                del self._replicas[origin]

    def _mark_dirty(self, records: list[Record]) -> None:
        """States that arrived here must be replicated from here too."""
        dirty = self._dirty()
        if dirty is not None:
            dirty.update(record[2] for record in records)

    def _dirty(self) -> set[str] | None:
        """The store's change set, switched on as soon as replication is wanted."""
        if self.store.dirty is None and self.replication_wanted():
            self.store.dirty = set()
        return self.store.dirty

    def _stash(self, records: list[Record], view: RingView, now: float) -> None:
        """Keep undelivered states for their owner under ``view`` (ours go back in)."""
        if not records:
            return
        if not len(view):
            self.stats.keys_dropped += len(records)
            return
        mine: list[Record] = []
        for record in records:
            owner = view.owner_id(record[2])
            if owner == self.id:
                mine.append(record)
            else:
                self._outbox.setdefault(owner, []).append(record)
        if mine:
            self.store.import_(mine, now, self._config().rule_map)
            self._mark_dirty(mine)

    async def deliver(self) -> dict[str, int]:
        """Send every outbox entry to its new owner, with a final mark for each member."""
        view = self.view
        if view is None:
            return {}
        started = asyncio.get_running_loop().time()
        sent: dict[str, int] = {}
        now = self.clock()
        crashes = [c.to_wire(now) for c in self._crashes if c.until > now]

        async def send(member_id: str, url: str) -> None:
            records = self._outbox.pop(member_id, [])
            payload: dict[str, Any] = {
                "from": self.id,
                "epoch": view.epoch,
                "records": records,
                "final": True,
            }
            if crashes:
                payload["crashes"] = crashes
            # While the records travel they are in neither the outbox nor the
            # store: a pull for one of them must wait, not get "nothing".
            in_flight = {record[2] for record in records}
            self._in_flight.setdefault(member_id, set()).update(in_flight)
            try:
                for attempt in range(3):
                    try:
                        # A bulk transfer (a million states is tens of MB of JSON)
                        # gets time in proportion to its size, not the default.
                        await self.peers.post(
                            url,
                            "/internal/import",
                            payload,
                            seconds=max(5.0, len(payload["records"]) / 20_000),
                        )
                        self.stats.keys_sent += len(records)
                        sent[member_id] = len(records)
                        return
                    except PeerError as exc:
                        if attempt == 2:
                            # Kept for pull-on-miss: the new owner asks for each
                            # key it is asked about (until the next view).
                            log.warning(
                                "handoff of %d keys to %s failed (%s); kept for pulls",
                                len(records),
                                member_id,
                                exc,
                            )
                            current = self.view
                            if current is not None:
                                self._stash(records, current, self.clock())
                            return
                        await asyncio.sleep(0.05 * (attempt + 1))
            finally:
                flying = self._in_flight.get(member_id)
                if flying is not None:
                    flying -= in_flight
                    if not flying:
                        del self._in_flight[member_id]

        # Final marks matter only to members that wait for this node, i.e. when it
        # was a member of the previous view; a node that was not (a newcomer taking
        # its first config, a removed node handing back) sends only real transfers,
        # so a paused peer cannot hold up its push.
        previous = self.previous
        marks = previous is not None and self.id in previous
        await asyncio.gather(
            *(
                send(m.id, m.url)
                for m in view
                if m.id != self.id and (marks or self._outbox.get(m.id))
            )
        )
        for member_id in [m for m in self._outbox if m not in view]:
            self.stats.keys_dropped += len(self._outbox.pop(member_id))
        self.stats.last_transfer_seconds = asyncio.get_running_loop().time() - started
        return sent

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ peers' calls

    def receive(
        self,
        sender: str,
        epoch: int,
        records: list[Record],
        final: bool,
        crashes: Sequence[dict[str, Any]] = (),
    ) -> int:
        now = self.clock()
        incoming = [Crash.from_wire(data, now) for data in crashes]
        records, foreign = self._split_foreign(records, epoch)
        if foreign:
            # A transfer from an older view (a member handing back what it held
            # while away, late) may carry keys that moved on since: they go to
            # their owner now. (A newer view's transfer is kept whole: this node
            # is about to get that view, under which it owns those keys.)
            self.spawn(self._forward(foreign))
        taken = self.store.import_(records, now, self._config().rule_map)
        self._mark_dirty(records)
        self.stats.keys_received += taken
        if taken < len(records):
            # A rule this node does not know (or with another algorithm): the
            # states cannot be read. Never silent: this is lost quota history.
            self.stats.keys_dropped += len(records) - taken
            log.warning(
                "%d state(s) from %s dropped: their rule is unknown here",
                len(records) - taken,
                sender,
            )
        for crash in incoming:
            known = {(c.view.epoch, c.crashed) for c in self._crashes}
            if crash.until > now and (crash.view.epoch, crash.crashed) not in known:
                self._crashes.append(crash)
        if final:
            if epoch == self.epoch:
                self._pending.pop(sender, None)
            elif epoch > self.epoch:
                self._finals.setdefault(epoch, set()).add(sender)
        return taken

    def _split_foreign(
        self, records: list[Record], epoch: int
    ) -> tuple[list[Record], list[Record]]:
        """Records this node keeps, and those another member owns under a newer view."""
        view = self.view
        if view is None or epoch >= view.epoch or not len(view) or self.id not in view:
            return records, []
        mine: list[Record] = []
        foreign: list[Record] = []
        for record in records:
            (mine if view.owner_id(record[2]) == self.id else foreign).append(record)
        return mine, foreign

    async def _forward(self, records: list[Record]) -> None:
        """Pass states on to their owners, without a final mark (not a handoff of ours)."""
        view = self.view
        if view is None or not len(view):
            return
        by_owner: dict[str, list[Record]] = {}
        for record in records:
            by_owner.setdefault(view.owner_id(record[2]), []).append(record)
        for owner, batch in by_owner.items():
            try:
                await self.peers.post(
                    view.member(owner).url,
                    "/internal/import",
                    {"from": self.id, "epoch": view.epoch, "records": batch, "final": False},
                )
                self.stats.keys_sent += len(batch)
            except PeerError as exc:
                current = self.view
                log.warning("passing %d state(s) on to %s failed: %s", len(batch), owner, exc)
                if current is not None:
                    self._stash(batch, current, self.clock())

    def serve_pull(self, keys: Sequence[str], to: str, epoch: int) -> list[Record]:
        """Give up the named keys' states to their new owner (from the outbox or the store)."""
        if epoch > self.epoch:
            raise StaleEpoch(f"asked about epoch {epoch}, this node knows {self.epoch}")
        wanted = set(keys)
        if wanted & self._in_flight.get(to, set()):
            raise InFlight(f"{len(wanted)} key(s) on their way to {to}")
        found: list[Record] = []
        pending = self._outbox.get(to)
        if pending:
            keep: list[Record] = []
            for record in pending:
                (found if record[2] in wanted else keep).append(record)
            self._outbox[to] = keep
        view = self.view
        if view is not None and len(view):
            found += self.store.export(
                self.clock(),
                lambda k: k in wanted and (self.id not in view or view.owner_id(k) != self.id),
                remove=True,
            )
        return found

    def receive_replicas(self, origin: str, records: list[Record]) -> int:
        replicas = self._replicas.get(origin)
        if replicas is None:
            replicas = self._replicas[origin] = MemoryStore()
        return replicas.import_(records, self.clock(), self._config().rule_map, replace=True)

    # ------------------------------------------------------------------ replication

    def replication_wanted(self) -> bool:
        config = self._config()
        return config.policies.crash == "replica" or any(
            s.rule.crash_policy == "replica" for s in config.rules
        )

    async def replicate_once(self) -> int:
        """Send every state changed since the last round to its key's successors
        (as many as the state's rule asks for: ``replicas``)."""
        view = self.view
        dirty = self.store.dirty
        if view is None or len(view) < 2 or not dirty:
            return 0
        self.store.dirty = set()
        now = self.clock()
        rules = self._config().rule_map
        depth = 1 + max((rule.replicas for rule in rules.values()), default=1)
        by_target: dict[str, list[Record]] = {}
        successors = self._successors
        for record in self.store.export_keys(dirty, now):
            key = record[2]
            targets = successors.get(key)
            if targets is None:
                targets = tuple(m.id for m in view.successors(key, depth)[1:])
                if len(successors) >= SUCCESSOR_CACHE:
                    successors.clear()
                successors[key] = targets
            rule = rules.get(record[0])
            for target in targets[: rule.replicas if rule is not None else 1]:
                by_target.setdefault(target, []).append(record)
        sent = 0
        for target, records in by_target.items():
            try:
                await self.peers.post(
                    view.member(target).url,
                    "/internal/replica",
                    {"from": self.id, "epoch": view.epoch, "records": records},
                )
                sent += len(records)
            except (PeerError, KeyError) as exc:
                log.debug("replication to %s failed: %s", target, exc)
                # Sent again next round (unless the view changes first).
                if self.store.dirty is not None:
                    self.store.dirty.update(record[2] for record in records)
        self.stats.replicas_sent += sent
        return sent

    async def run_replication(self) -> None:
        while True:
            interval = self._config().policies.replication_interval
            await asyncio.sleep(interval)
            if self.replication_wanted():
                if self.store.dirty is None:
                    self.store.dirty = set()
                try:
                    await self.replicate_once()
                except Exception as exc:  # the loop outlives any one failure, never silently
                    self.failures.record("replication_loop", exc)
            else:
                self.store.dirty = None

    def sweep_replicas(self, now: float) -> None:
        for replicas in self._replicas.values():
            replicas.sweep(now)

    def status(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "pending_from": sorted(self._pending),
            "conservative_crashes": len(self._crashes),
            "outbox": {k: len(v) for k, v in self._outbox.items() if v},
            "replicas": {k: len(v) for k, v in self._replicas.items()},
            "stats": dict(self.stats.__dict__),
        }
