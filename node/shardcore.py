"""A node's authority over its keys, as an I/O-free state machine.

This is the protocol of sticky routing: which keys a node may decide, and how
their states follow the keys when the ring changes. It is written the way
h11 or httpx's core are: events go in (a view arrives, states arrive, a key is
checked, a peer asks for keys, replicas arrive, time passes) with the time
passed as an argument, and decisions and *messages to send* come out as
plain data. Nothing here awaits, sleeps, reads a clock, logs or touches the
network, so the node (node/shard.py, the async driver that owns peers,
timers and retries) and the simulations (simulations/protocol.py, on a
virtual clock) run the same code.

* **Fencing.** A key is decided only by its owner under the newest epoch this
  node knows; any other key is refused with :class:`NotOwner`, which tells the
  router to refresh its view and retry. Two nodes never decide the same key at
  once, even while some router still holds a stale view.
* **Handoff.** When a view arrives, the node takes every state it no longer
  owns out of its store at once (so it can never decide them again) and puts
  it in the outbox for its new owner; :meth:`ShardCore.transfers` turns the
  outbox into :class:`Transfer` messages, each with a *final mark* that tells
  the receiver this sender has nothing more for it under that epoch.
* **Pull-on-miss.** A new owner that is asked about a key whose previous
  owner's final mark has not arrived yet must get that key first
  (:meth:`ShardCore.inherit` answers :class:`Pull`), so no request is decided
  on a fresh state that should have been inherited.
* **Crashes.** A crashed node cannot hand anything off; the crash policy says
  what its keys start from: nothing (``reset``), an exhausted quota until it
  would have been fresh again (``conservative``) or the successor's replica
  (``replica``), which every node streams to each key's successor
  (:meth:`ShardCore.replica_batches`).
* **Leases.** A node in a leased ring decides only while its lease runs
  (node/lease.py); a member removed as crashed whose process lived on hands
  what it holds back to the keys' owners.

Two clocks come in as arguments: ``now`` is the engine's clock (the one the
algorithms and the store run on, whose times cross the wire relative to the
sender's ``now``) and ``elapsed`` is a monotonic clock for deadlines and the
lease. See docs/rebalancing.md for what each event costs in the worst case.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter, itemgetter
from typing import Any

from node.algorithms import MAX_SPAN, exhausted, exhausted_for
from node.config import ClusterConfig
from node.lease import Lease
from node.rules import Rule
from node.store import MemoryStore, Record
from ring import EmptyRingError, OwnerCache, RingView

#: Keys whose replica targets replication remembers (then it starts over). Small on
#: purpose: a million-entry cache cost ~90 bytes per key of node memory.
SUCCESSOR_CACHE = 65_536
#: Views a new owner looks back through for a key's state (:meth:`ShardCore.inherit`):
#: the previous one, and older ones whose handoffs had not finished.
MAX_SOURCES = 4
#: Keys whose owner fencing remembers, for the current view only (then it starts
#: over). 8,192 entries stay under 1 byte per key of node memory at a million
#: keys (ring/owners.py); 65,536 cost several.
OWNER_CACHE = 8_192
#: Crashes a transfer carries at most (the newest; a receiver refuses more). Each
#: carries a view, which costs its receiver up to ~0.2 s to build (ring/view.py
#: ``MAX_MEMBERS``): a peer's body with 60 of them stalled a node for 20 s,
#: long enough to be removed as crashed. More than this many crashes within
#: the conservative window is a cluster in pieces; the oldest are left out.
MAX_CRASHES = 16

# ---------------------------------------------------------------------- refusals


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


class NoLongerMember(Exception):
    """A transfer of an older view reached a node that the newer view it holds
    does not list (it left, or was removed as crashed).

    Refused, not kept: that node hands off nothing more, so states it took
    stayed with it, and their owner under the newer view decided those keys
    fresh (an independent review: a redelivery that landed at a member just
    after its leave; 5 more admitted for a user at 5 of 5). Refused, the
    sender keeps them in its outbox, and its own final mark of the newer view
    takes them to their owner.
    """


class InFlight(Exception):
    """A peer asked for keys whose states are on their way to it right now.

    The puller waits for that transfer (or for it to fail, after which the
    states are back in the outbox and a pull gets them) rather than decide
    on a fresh state.
    """


# ---------------------------------------------------------------------- data


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
        """Parse a peer's crash; ``ValueError``/``KeyError``/``TypeError`` if malformed.

        (Callers parse at most :data:`MAX_CRASHES` per transfer.)"""
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
    replicas_stale: int = 0
    replicas_dropped: int = 0
    conservative_keys: int = 0
    views_applied: int = 0
    last_transfer_seconds: float = 0.0


# ---------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Transfer:
    """States for member ``to`` (at ``url``): POST /internal/import.

    ``final`` marks a handoff: the sender has nothing more for ``to`` under
    ``epoch``. A transfer without it passes on states that arrived here for a
    key another member owns (a late hand-back). ``crashes`` are the crashes
    the conservative policy still answers for; ``sent_at`` is the sender's
    ``now``, against which the wire form's times are relative (as the
    records' are).
    """

    sender: str
    to: str
    url: str
    epoch: int
    records: list[Record]
    final: bool
    crashes: tuple[Crash, ...] = ()
    sent_at: float = 0.0

    def chunks(self, size: int) -> list[Transfer]:
        """This transfer as a stream of transfers of about ``size`` records each;
        only the last carries the final mark (and the crashes), so the
        receiver applies chunk by chunk and stops waiting only after the last.

        A key's states under several rules travel in one chunk: a new owner
        holding any of a key's states decides it (:meth:`ShardCore.holds`),
        and the states are exported rule by rule. Sliced in order, one rule's
        state of a key landed a chunk before another's, and the key was
        decided with the other fresh for the rest of the stream (an
        independent review: a user at 5 of 5 per day admitted 5 more in a
        10,001-key join). States of one rule are sliced in order; of several,
        spread over the chunks by key."""
        if size < 1:
            raise ValueError("size must be >= 1")
        records = self.records
        if len(records) <= size:
            return [self]
        parts: list[list[Record]]
        if len(set(map(itemgetter(0), records))) == 1:
            parts = [records[i : i + size] for i in range(0, len(records), size)]
        else:
            count = -(-len(records) // size)
            parts = [[] for _ in range(count)]
            for record in records:
                parts[hash(record[2]) % count].append(record)
            parts = [part for part in parts if part]
        last = len(parts) - 1
        return [
            Transfer(
                self.sender,
                self.to,
                self.url,
                self.epoch,
                part,
                self.final and i == last,
                self.crashes if i == last else (),
                self.sent_at,
            )
            for i, part in enumerate(parts)
        ]

    def payload(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "from": self.sender,
            "epoch": self.epoch,
            "records": self.records,
            "final": self.final,
        }
        if self.crashes:
            body["crashes"] = [crash.to_wire(self.sent_at) for crash in self.crashes]
        return body


@dataclass(frozen=True)
class Pull:
    """Ask member ``owner`` (at ``url``) for ``key``'s state: POST /internal/pull.

    ``late``: asked past the handoff deadline. The owner is still asked (its
    handoff failed, but it keeps the states for pulls and may well answer);
    if this pull fails too, it is no longer waited for (:meth:`ShardCore.pull_failed`).
    """

    owner: str
    url: str
    key: str
    epoch: int
    to: str
    late: bool = False

    def payload(self) -> dict[str, Any]:
        return {"keys": [self.key], "epoch": self.epoch, "to": self.to}


@dataclass(frozen=True)
class AwaitHandoffs:
    """``key`` was a crashed member's: its state, if any, comes from the member
    holding its replica, in that member's final transfer of this view. Decide
    it once no member is awaited any more (or every deadline has passed)."""

    key: str


@dataclass(frozen=True)
class ReplicaBatch:
    """States for their keys' successor ``to`` (at ``url``): POST /internal/replica."""

    sender: str
    to: str
    url: str
    epoch: int
    records: list[Record]
    #: (the sender's incarnation, its round number): see :meth:`ShardCore.receive_replicas`.
    round: tuple[int, int] = (0, 0)

    def payload(self) -> dict[str, Any]:
        return {
            "from": self.sender,
            "epoch": self.epoch,
            "records": self.records,
            "round": list(self.round),
        }


@dataclass(frozen=True)
class Received:
    """What a transfer did here: states taken, states dropped (unknown rule),
    and states passed on to the member that owns them now."""

    taken: int
    dropped: int
    forwards: list[Transfer] = field(default_factory=list)


# ---------------------------------------------------------------------- the core


class ShardCore:
    """The authority state machine of one node (see the module docstring).

    ``config`` is read on every event (the router may push new rules under
    the same epoch). ``handoff_wait`` is how long, on the ``elapsed`` clock,
    a new owner waits for a previous owner's handoff before it decides the
    keys anyway.
    """

    def __init__(
        self,
        node_id: str,
        store: MemoryStore,
        config: Callable[[], ClusterConfig],
        *,
        handoff_wait: float = 5.0,
        lease: Lease | None = None,
        incarnation: int = 0,
    ) -> None:
        self.id = node_id
        #: Tells this process's replica rounds from an earlier one's with the same id
        #: (the driver draws it at random; the core reads no randomness).
        self.incarnation = incarnation
        #: Replication rounds started (:meth:`replica_round`), numbering the batches.
        self.rounds = 0
        #: The newest replica round applied, by origin: (incarnation, round).
        self.replica_seen: dict[str, tuple[int, int]] = {}
        self.store = store
        self.config = config
        self.handoff_wait = handoff_wait
        self.lease = lease if lease is not None else Lease()
        #: None until a router sends a view: a standalone node decides every key.
        self.view: RingView | None = None
        self.previous: RingView | None = None
        #: Where a key's state may still come from, newest first: the previous
        #: view, then older ones whose handoffs had not finished when the next
        #: view came (see :meth:`apply`); and the members they lost as crashed.
        self.sources: list[RingView] = []
        self.sources_crashed: frozenset[str] = frozenset()
        #: The newest view removed this node as crashed (its process lived on),
        #: rather than in a leave: see :meth:`may_rejoin`.
        self.removed_as_crashed = False
        self.stats = HandoffStats()
        #: Crashes still covered by the conservative policy (newest last).
        self.crashes: list[Crash] = []
        #: Members whose handoff to this node is still awaited, with its deadline.
        self.pending: dict[str, float] = {}
        #: Final marks that arrived before their view, by epoch.
        self.finals: dict[int, set[str]] = {}
        #: States waiting to be sent to their new owner, by member.
        self.outbox: dict[str, list[Record]] = {}
        #: States being delivered right now, by receiving member (see serve_pull):
        #: each transfer's record list, known by identity until it lands.
        self.in_flight: dict[str, list[list[Record]]] = {}
        #: Flights of which a newer view's transfers carry a copy of every state
        #: (:meth:`_flying_copies`), known by identity until they land.
        self.copied: list[list[Record]] = []
        #: Their keys, collected only when a pull asks: most handoffs see none, and
        #: a set of every key in flight, built and emptied, slowed every handoff.
        self._flying_keys: dict[str, set[str]] = {}
        #: Keys already pulled under the current view (never pulled twice).
        self.pulled: set[str] = set()
        #: Pulls under way, by key: the epoch each was asked under (see serve_pull).
        self.pulling: dict[str, int] = {}
        #: Keys whose state came back into the store from this node's outbox or a
        #: flight (:meth:`stash`) since the current view: such a state may be older
        #: than what the member it was sent to decided since (a delivery that
        #: landed though its answer was lost), so holding it does not spare the
        #: pull while that member's handoff is awaited (:meth:`inherit`).
        self.returned: set[str] = set()
        #: Keys whose pull found nothing at the owner asked, which named members
        #: it still expected their states from (:meth:`refer`): the member to ask
        #: next, and the members asked so far.
        self.referred: dict[str, tuple[str, frozenset[str]]] = {}
        #: Replicas of other members' states, by origin member.
        self.replicas: dict[str, MemoryStore] = {}
        self.successors: dict[str, tuple[str, ...]] = {}
        #: Keys of the replication round in progress (:meth:`replica_round`): taken
        #: from the change set when the round starts, sent in slices.
        self.round: set[str] = set()
        #: The successors each rule's states were replicated to so far (a config
        #: asking for more has every state sent again: :meth:`replication_tick`).
        self.replicated_depths: dict[str, int] = {}
        #: Keys handed to this node while its view settles, not replicated yet
        #: (see :meth:`receive`); they join the change set once it has settled.
        self.settling: set[str] = set()
        #: The epoch of the view whose final marks :meth:`transfers` sent last.
        self.marked = 0
        #: Members whose final mark of this view did not land (a failed delivery):
        #: the next :meth:`transfers` sends them one, with whatever is left for them.
        self.owed_marks: set[str] = set()
        #: The newest epoch a deferred state arrived under: none is released before it.
        self.settling_epoch = 0
        #: Owners :meth:`check_owner` looked up, for whichever view it was last
        #: asked under (keyed on the view object, so any new view starts afresh).
        self.owners = OwnerCache(OWNER_CACHE)

    # ------------------------------------------------------------------ deciding

    @property
    def epoch(self) -> int:
        return self.view.epoch if self.view is not None else 0

    def check_owner(self, key: str) -> None:
        """Raise :class:`NotOwner` unless this node owns ``key`` under its newest view.

        Every decision's path: the owner comes from :attr:`owners`, which
        answers exactly as ``view.owner`` does for whatever ``self.view`` is now.
        (:meth:`check_owners` for one key, written out: no tuple, loop or second
        call per request.)
        """
        view = self.view
        if view is None:
            return
        owners = self.owners
        member = owners.known(view).get(key)
        if member is None:
            try:
                member = owners.owner(view, key)
            except EmptyRingError:
                raise NotOwner(key, view.epoch, None) from None
        if member.id != self.id:
            raise NotOwner(key, view.epoch, member.id)

    def check_owners(self, keys: Iterable[str]) -> None:
        """:meth:`check_owner` for each of ``keys``, in order (the first key this
        node does not own raises). A batch reads the remembered owners in one
        loop, not through two calls per key."""
        view = self.view
        if view is None:
            return
        known = self.owners.known(view).get
        me = self.id
        for key in keys:
            member = known(key)
            if member is None:
                try:
                    member = self.owners.owner(view, key)
                except EmptyRingError:
                    raise NotOwner(key, view.epoch, None) from None
            if member.id != me:
                raise NotOwner(key, view.epoch, member.id)

    def check_lease(self, elapsed: float) -> None:
        """Raise :class:`LeaseExpired` if this node is in a leased ring and its lease ran out."""
        view = self.view
        lease = self.lease
        if view is not None and lease.required and not lease.valid(elapsed):
            raise LeaseExpired(f"lease expired at epoch {view.epoch}")

    def may_decide(self, key: str, elapsed: float) -> None:
        """Fencing and the lease together: raise unless ``key`` may be decided here."""
        self.check_owner(key)
        self.check_lease(elapsed)

    def inherit(
        self, key: str, rules: Sequence[Rule], elapsed: float
    ) -> Pull | AwaitHandoffs | None:
        """While a handoff into this node is under way: must ``key``'s state be
        fetched or awaited before it is decided?

        :class:`Pull` when a member that owned it in a view still being
        settled has not sent its final mark, no state for it is here and it was
        not pulled yet (past that member's deadline too: a failed delivery
        leaves the states with it for pulls, and only a pull that fails gives
        up on it). :class:`AwaitHandoffs` when the member that owned it crashed
        and replicas are kept: the replica's holder sends it in its final
        transfer. None when the key may be decided as it is.

        A state that came back from this node's outbox or a flight
        (:attr:`returned`) is held but still pulled: it may have landed at its
        recipient, which decided on it since.

        The sources go back past the previous view while an older handoff had
        not finished when a newer view came: a key this node already owned
        in the previous view may still be in its first owner's outbox (a failed
        delivery re-sent under the newer view) or in flight.
        """
        pending = self.pending
        if not pending or not self.sources:
            return None
        if self.holds(key, rules) and key not in self.returned:
            return None
        me = self.id
        referral = self.referred.get(key)
        if referral is not None and self.previous is not None:
            owner = referral[0]
            deadline = pending.get(owner)
            if deadline is not None:
                url = self.previous.member(owner).url
                return Pull(owner, url, key, self.epoch, me, late=elapsed > deadline)
        if key in self.pulled:
            return None
        for source in self.sources:
            if not len(source):
                continue
            owner = source.owner_id(key)
            if owner == me:
                continue
            deadline = pending.get(owner)
            if deadline is not None:
                url = source.member(owner).url
                return Pull(owner, url, key, self.epoch, me, late=elapsed > deadline)
            if (
                owner in self.sources_crashed
                and self.replication_wanted()
                and any(d > elapsed for d in pending.values())
            ):
                return AwaitHandoffs(key)
            return None
        return None

    def awaits(self, member_id: str) -> bool:
        """Is this node still waiting for ``member_id``'s handoff (no final mark yet)?"""
        return member_id in self.pending

    def start_pull(self, pull: Pull) -> None:
        self.stats.pulls += 1
        self.pulling[pull.key] = pull.epoch

    def take_pulled(self, records: list[Record], now: float, epoch: int | None = None) -> bool:
        """The answer to a pull of ``epoch`` (None: the current view's): the key's
        state, or nothing (it had none).

        A newer view that came while the pull was on its way may have moved the
        key on: its state then goes to its owner under that view (in the outbox:
        True, for the driver to deliver), not into this store. Kept here, it
        stayed with a node that no longer decided the key, and the key's new
        owner, told by this node's final mark that nothing more was coming,
        decided it fresh (an independent review: 5 more for a user at 5 of 5).
        The driver holds this view's final marks until its pulls have ended
        (node/shard.py ``deliver``), so such a state goes with them."""
        self.stats.keys_received += len(records)
        view = self.view
        if epoch is None or view is None or epoch == view.epoch:
            self.store.import_(records, now, self.config().rule_map)
            self.mark_dirty(records)
            return False
        return self.stash(records, view, now) > 0

    def refer(self, pull: Pull, members: Sequence[str]) -> None:
        """The owner asked had nothing for ``pull.key``, and named the members it
        was itself still expecting that key's state from (:meth:`earlier_owners`):
        the state may be in one's outbox or on its way here. The first such
        member this node still awaits is asked next (:meth:`inherit`), each at
        most once per key. (A pull of an older view refers nobody: its sources
        are not this view's.)"""
        if pull.epoch != self.epoch:
            return
        previous = self.referred.get(pull.key)
        asked = (previous[1] if previous is not None else frozenset()) | {pull.owner}
        for member in members:
            if member != self.id and member not in asked and member in self.pending:
                self.referred[pull.key] = (member, asked)
                return

    def earlier_owners(self, keys: Sequence[str]) -> list[str]:
        """Members that owned ``keys`` in the views this node still looks back
        through (:attr:`sources`), other than itself.

        Told to a member whose pull found nothing here: a handoff into this
        node that had not settled when a newer view moved the keys on leaves
        their states with their earlier owner, which now sends them to the
        keys' new owner; that owner asked this node, their previous owner,
        which never had them."""
        found: list[str] = []
        for source in self.sources:
            if not len(source):
                continue
            for key in keys:
                owner = source.owner_id(key)
                if owner != self.id and owner not in found:
                    found.append(owner)
        return found

    def pull_failed(self, pull: Pull) -> None:
        """A pull that got no answer. Past the deadline its owner is given up:
        unreachable as well as late, it is no longer waited for, and the keys
        it held are decided on what this node has (docs/rebalancing.md, Join)."""
        self.stats.pull_failures += 1
        if pull.late and pull.epoch == self.epoch:
            self.pending.pop(pull.owner, None)
            if not self.pending:
                self._settled()
                self._release_settling()

    def pull_done(self, pull: Pull) -> None:
        """Whatever the answer, ``pull.key`` is not pulled again under this view
        (from another member only if this one referred it there: :meth:`refer`).
        Once no handoff is awaited nothing is pulled, and nothing is remembered.
        Nor is a pull of an older view (a newer one came while it was on its way):
        marked pulled, its key was not asked for under the view in force, and was
        decided on what this node had before that view's handoff came."""
        self.pulling.pop(pull.key, None)
        if pull.epoch != self.epoch:
            return
        if self.pending:
            self.pulled.add(pull.key)
        referral = self.referred.get(pull.key)
        if referral is not None and referral[0] == pull.owner:
            del self.referred[pull.key]

    def conservative(self, key: str, rules: Sequence[Rule], now: float) -> None:
        """A key a crashed member owned, with no state here, starts exhausted."""
        if not self.crashes:
            return
        if self.crashes[0].until <= now:
            self.crashes = [c for c in self.crashes if c.until > now]
        for crash in self.crashes:
            if crash.affects(key):
                self._exhaust(key, rules, now, crash.at)

    def holds(self, key: str, rules: Sequence[Rule]) -> bool:
        """Whether a state for ``key`` is here under any of ``rules``: a handoff
        brings all of a key's states at once (one chunk: :meth:`Transfer.chunks`;
        a pull answers with all), and a rule's state that was not sent was
        fresh, as good as none."""
        return any(self.store.get(rule, key) is not None for rule in rules)

    def _exhaust(self, key: str, rules: Sequence[Rule], now: float, at: float) -> None:
        """Conservative crash policy: a key the crashed node held starts with no quota.

        Within the store's cap (``--max-keys``), as a new key's first decision
        is: in a full store (after a sweep) the exhausted state is not written,
        and the key is decided as any new key there, ``store_full`` (admitted
        unremembered under ``on_error = "open"``, denied under ``closed``).
        Before, every key of a crashed member that came in wrote a state past
        the cap.
        """
        policy = self.config().policies.crash
        for rule in rules:
            if (rule.crash_policy or policy) != "conservative":
                continue
            if self.store.get(rule, key) is not None:
                continue
            if not self.store.has_room_for(rule, key, now):
                continue  # decided as any new key of a full store
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
        crashed: Sequence[str],
        now: float,
        elapsed: float,
    ) -> int | None:
        """Adopt a newer view: fence, fill the outbox, and set up inheritance.

        Returns None if ``view`` is not newer than the one held; otherwise the
        number of states handed back (0 unless this node learns it was removed
        as crashed while its process lived on). The driver sends
        :meth:`transfers` next.
        """
        if self.view is not None and view.epoch <= self.view.epoch:
            if (
                self.removed_as_crashed
                and view.epoch == self.view.epoch
                and self.id not in crashed
                and view == self.view
            ):
                # The router says again that this node is out, not as a crash: an
                # operator removed it while it did not answer (router/membership.py
                # ``tell_dismissed``). It handed its states back already; it must
                # not register again, as after a leave (:meth:`may_rejoin`).
                self.removed_as_crashed = False
            return None
        config = self.config()
        self.returned = set()
        previous = previous if previous is not None else self.view
        # A handoff of the view being replaced had not finished (some member's
        # final mark never came): its sources stay, behind the new one.
        carried = self.sources[: MAX_SOURCES - 1] if self.pending else []
        self.sources = [previous, *carried] if previous is not None else []
        self.sources_crashed = frozenset(crashed) | (
            self.sources_crashed if carried else frozenset()
        )
        # A crash folded into this node's leave (router/viewlog.py ``fold_crashes``):
        # it left by the view being replaced, and the new one is built from the
        # view before that. Its final marks must carry what the leave's transfers
        # still have on their way (:meth:`_flying_copies`), and the crash
        # covers what they already brought to the crashed members.
        replaced = self.view
        folded = (
            replaced is not None
            and self.id not in replaced
            and previous is not None
            and previous.epoch < replaced.epoch
        )
        self.previous = previous
        self.view = view
        self.successors.clear()
        self.stats.views_applied += 1
        self.removed_as_crashed = self.id in crashed and self.id not in view
        if self.removed_as_crashed:
            return self._hand_back(view, now)
        if len(view):
            me_in = self.id in view

            def moved(key: str) -> bool:
                return view.owner_id(key) != self.id

            if not me_in:  # leaving: every key moves, none needs hashing here
                records = self.store.export(now, remove=True)
            elif len(view) == 1:  # alone in the ring, this node owns every key
                records = []
            else:
                records = self.store.export(now, moved, remove=True)
            if config.policies.rebalance == "handoff":
                # States still waiting from an earlier view (a failed delivery)
                # go to their owner under this one.
                leftovers = [r for pending in self.outbox.values() for r in pending]
                self.outbox.clear()
                self.stash(leftovers, view, now)
                self.stash(self._flying_copies(), view, now)
                if len(view) == 1 and not me_in:
                    # One member left (the other leaving): it owns every key, no
                    # need to hash a million of them to find that out.
                    self.outbox.setdefault(next(iter(view)).id, []).extend(records)
                else:
                    for record in records:
                        self.outbox.setdefault(view.owner_id(record[2]), []).append(record)
                    if records and me_in:
                        self._keep_handed_off(now)
            else:
                self.stats.keys_dropped += len(records)
        rejoined = replaced is not None and self.id not in replaced and self.id in view
        self._promote_replicas(view, crashed, now, config, folded=folded, rejoined=rejoined)
        dirty = self._dirty()
        if dirty is not None and len(view) > 1:
            # Successors may have changed: every state goes to its (new)
            # successor at the next round, not only the ones that change.
            dirty.update(self.store.keys())
        self._remember_crash(previous, crashed, now, config)
        if folded:
            # States this node's leave delivered to a member now crashed are known
            # to be theirs under the view it left by, not under ``previous``: a
            # conservative rule's new owner starts those keys exhausted too, as it
            # would had the crash been removed after the leave.
            self._remember_crash(replaced, crashed, now, config)
        senders: set[str] = set()
        if previous is not None and self.id in view:
            senders = {m for m in previous.ids if m != self.id and m not in crashed}
        senders -= self.finals.pop(view.epoch, set())
        for epoch in [e for e in self.finals if e < view.epoch]:
            del self.finals[epoch]
        self.pending = dict.fromkeys(senders, elapsed + self.handoff_wait)
        self._settled()  # nothing remembered for pulls carries over
        # Every state here is in the change set now (above): deferred ones too.
        self.settling = set()
        return 0

    def _remember_crash(
        self,
        previous: RingView | None,
        crashed: Sequence[str],
        now: float,
        config: ClusterConfig,
    ) -> None:
        conservative_rules = [
            s.rule
            for s in config.rules
            if (s.rule.crash_policy or config.policies.crash) == "conservative"
        ]
        if crashed and conservative_rules and previous is not None:
            # Remembered across later views (a join right after a crash must
            # not turn the crashed member's keys fresh), and handed to new
            # owners with the states.
            self.crashes = [c for c in self.crashes if c.until > now]
            self.crashes.append(
                Crash(
                    previous,
                    frozenset(crashed),
                    now,
                    now + max(exhausted_for(r) for r in conservative_rules),
                )
            )

    def may_rejoin(self) -> bool:
        """Whether this node, when no router renews its lease, should register again
        (node/server.py): its newest view lists it (it never heard of a removal),
        or removed it as crashed while its process lived on (a router that
        forgot it would never probe it back). Not after a leave, an operator's
        removal included: that one is meant to last."""
        view = self.view
        return view is not None and (self.id in view or self.removed_as_crashed)

    def _hand_back(self, view: RingView, now: float) -> int:
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
        leftovers = [r for pending in self.outbox.values() for r in pending]
        self.outbox.clear()
        self.store.sweep(float("inf"), budget=None)
        self.replicas.clear()
        if self.store.dirty is not None:
            self.store.dirty = set()
        self.round = set()
        self.settling = set()
        self.pending = {}
        self._settled()  # nothing remembered for pulls carries over
        if self.config().policies.rebalance != "handoff" or not len(view):
            self.stats.keys_dropped += len(records) + len(leftovers)
            return 0
        for record in [*leftovers, *records]:
            self.outbox.setdefault(view.owner_id(record[2]), []).append(record)
        return len(records)

    def _keep_handed_off(self, now: float) -> None:
        """Keep what this node hands to new owners as their replicas, as if they
        had replicated it here already.

        A key a join takes from this node has this node as its successor (the
        next member clockwise from the joiner's point is the key's old owner),
        which is where its new owner will replicate it, once its view has
        settled (:meth:`receive`). Until then the states would live only in the
        new owner's memory: killed in that window, it took every moved user's
        history with it, and those users started over with a whole quota.
        Kept here, a crash of the new owner promotes them back
        (:meth:`_promote_replicas`) like any replica; the owner's own
        replication replaces them with newer states. Merged into what is held
        for that owner (the outbox also holds older leftovers of a failed
        handoff). Only when the crash policy replicates at all; swept like other
        replicas.
        """
        if not self.replication_wanted():
            return
        for owner, records in self.outbox.items():
            # Merged, not replaced: the outbox also holds leftovers of an earlier
            # failed handoff, older than what their owner may have replicated here
            # since; the more restrictive state wins (the owner's own rounds replace).
            self.keep_replicas(owner, records, now)

    def _promote_replicas(
        self,
        view: RingView,
        crashed: Sequence[str],
        now: float,
        config: ClusterConfig,
        *,
        folded: bool = False,
        rejoined: bool = False,
    ) -> None:
        """Crashed members' keys that this node now owns start from its replicas.

        The rest of a crashed member's replicas go to the keys' new owners, in
        this view's transfers (the owner keeps the more restrictive of that
        and what it has: :meth:`inherit` makes it wait for them). They are
        not always this node's: a key the crashed member replicated here under
        an older view may belong to a member that joined since (a member killed
        during a join). They are also kept here as replicas of those owners:
        with ``replicas = 2`` this node may be the second copy of a key whose
        new owner crashed at the same time, and the removal of that owner
        (next) must find the copy here.

        A node leaving keeps its replicas until its process ends, or it rejoins:
        a crash folded into its leave (``folded``: router/viewlog.py
        ``fold_crashes``) sends it a second view, and its copies of the crashed
        member's keys may be the only ones (let go at the leave, those users
        started afresh: an exploratory tester, 8 of 26 users of a paused
        member). They go to the keys' new owners with its final marks.
        """

        def replicated(record: Record) -> bool:
            """Whether ``record``'s rule is known here and replicated on a crash."""
            rule = config.rule(record[0])
            return rule is not None and (rule.crash_policy or config.policies.crash) == "replica"

        if self.id not in view or not len(view):
            if folded and len(view):
                for origin in crashed:
                    replicas = self.replicas.pop(origin, None)
                    for record in replicas.export(now) if replicas is not None else ():
                        if replicated(record):
                            self.outbox.setdefault(view.owner_id(record[2]), []).append(record)
            if not len(view):
                self.replicas.clear()
                self.replica_seen.clear()
            return
        if rejoined:
            # Back from a leave: the copies kept through it are of its time.
            self.replicas.clear()
            self.replica_seen.clear()

        for origin in crashed:
            replicas = self.replicas.pop(origin, None)
            if replicas is None:
                continue
            records = replicas.export(now)
            promoted: list[Record] = []
            kept: dict[str, list[Record]] = {}
            for record in records:
                owner = view.owner_id(record[2])
                if owner != self.id:
                    kept.setdefault(owner, []).append(record)
                elif replicated(record):
                    promoted.append(record)
            self.stats.replicas_promoted += self.store.import_(promoted, now, config.rule_map)
            self.mark_dirty(promoted)
            for owner, moved in kept.items():
                self.keep_replicas(owner, moved, now)
                if owner not in crashed:
                    self.outbox.setdefault(owner, []).extend(filter(replicated, moved))
        for origin in list(self.replicas):
            if origin not in view:
                del self.replicas[origin]
        for origin in [o for o in self.replica_seen if o not in view]:
            del self.replica_seen[origin]

    def mark_dirty(self, records: list[Record]) -> None:
        """States that arrived here must be replicated from here too."""
        dirty = self._dirty()
        if dirty is not None:
            dirty.update(record[2] for record in records)

    def _dirty(self) -> set[str] | None:
        """The store's change set, switched on as soon as replication is wanted."""
        if self.store.dirty is None and self.replication_wanted():
            self.store.dirty = set()
        return self.store.dirty

    def _flying_copies(self) -> list[Record]:
        """Copies of every state on its way to another member (a transfer of an
        older view, say a redelivery or a large handoff, still in flight when a
        newer view came).

        Stashed for their owner under the new view, they go out with its final
        mark (or back into this node's store, if it owns them again) and answer
        a pull for them. Without the copies the final mark said nothing more
        was coming, and the owner decided those keys on a fresh state before
        the flight landed: up to a quota per key. That holds whether the key
        moved on or not: a flight to a member that still owns its keys is
        overtaken by this view's final mark to that member as easily (an
        independent review: 10 admitted under 5/hour; only moved keys were
        copied before). So does a node that left the view being replaced
        (a crash removal folded into its leave sends it a second view:
        router/viewlog.py ``fold_crashes``), which may exit once it has
        answered, before its flights land. A copy is exact (nobody decides a
        state in flight), and the flight's own landing is merged as the more
        restrictive of two states, so the state is never counted twice. A
        flight copied so puts nothing back in the outbox if it fails
        (:attr:`copied`): its copy is on its way already.
        """
        copies: list[Record] = []
        copied = self.copied
        for flights in self.in_flight.values():
            for records in flights:
                # A flight copied at an earlier change is in that copy's flight (or
                # landed with it): copied again, every view doubled what is sent.
                if not any(records is done for done in copied):
                    copies.extend(records)
                    copied.append(records)
        return copies

    def stash(self, records: list[Record], view: RingView, now: float) -> int:
        """Keep undelivered states for their owner under ``view`` (ours go back in);
        how many went to the outbox."""
        if not records:
            return 0
        if not len(view):
            self.stats.keys_dropped += len(records)
            return 0
        mine: list[Record] = []
        for record in records:
            owner = view.owner_id(record[2])
            if owner == self.id:
                mine.append(record)
            else:
                self.outbox.setdefault(owner, []).append(record)
        if mine:
            self.store.import_(mine, now, self.config().rule_map)
            self.mark_dirty(mine)
            self.returned.update(record[2] for record in mine)
        return len(records) - len(mine)

    # ------------------------------------------------------------------ sending

    def transfers(self, now: float) -> list[Transfer]:
        """Empty the outbox into one transfer per member, with final marks.

        Final marks matter only to members that wait for this node, i.e. when
        it was a member of the previous view; a node that was not (a newcomer
        taking its first config, a removed node handing back) sends only real
        transfers, so a paused peer cannot hold up its push. States for
        members outside the view are dropped. Until :meth:`delivered` or
        :meth:`undelivered`, the states are in flight: a pull for one waits.
        """
        view = self.view
        if view is None:
            return []
        crashes = tuple(c for c in self.crashes if c.until > now)
        if len(crashes) > MAX_CRASHES:
            crashes = tuple(sorted(crashes, key=attrgetter("at"))[-MAX_CRASHES:])
        previous = self.previous
        # Final marks once per view: a second, empty mark could overtake the
        # first transfer (with the states) and end the receiver's wait for them.
        marks = previous is not None and self.id in previous and self.marked < view.epoch
        if marks:
            self.marked = view.epoch
        owed, self.owed_marks = self.owed_marks, set()
        out: list[Transfer] = []
        for member in view:
            if member.id == self.id or not (
                marks or member.id in owed or self.outbox.get(member.id)
            ):
                continue
            records = self.outbox.pop(member.id, [])
            out.append(
                Transfer(self.id, member.id, member.url, view.epoch, records, True, crashes, now)
            )
            # While the records travel they are in neither the outbox nor the
            # store: a pull for one of them must wait, not get "nothing".
            self._take_off(member.id, records)
        for member_id in [m for m in self.outbox if m not in view]:
            self.stats.keys_dropped += len(self.outbox.pop(member_id))
        return out

    def _take_off(self, to: str, records: list[Record]) -> None:
        """``records`` leave for ``to``: in flight until they land (or come back)."""
        self.in_flight.setdefault(to, []).append(records)
        self._flying_keys.pop(to, None)

    def owes_handoff(self) -> bool:
        """Whether a failed delivery left states or a final mark owed to a member
        of the current view (:meth:`transfers` sends them)."""
        view = self.view
        return view is not None and (
            any(member in view for member in self.owed_marks) or self.undelivered_states() > 0
        )

    def undelivered_states(self) -> int:
        """States waiting in the outbox for members of the current view (a
        delivery that failed: they are kept for pulls and sent again)."""
        view = self.view
        if view is None:
            return 0
        return sum(len(records) for member, records in self.outbox.items() if member in view)

    def delivered(self, transfer: Transfer) -> None:
        self.stats.keys_sent += len(transfer.records)
        self._landed(transfer)

    def undelivered(self, transfer: Transfer, now: float) -> None:
        """A transfer that could not be delivered: its states are kept for pulls
        (the new owner asks for each key it is asked about, until the next view)."""
        self.partly_delivered(transfer, [], transfer.records, now)

    def partly_delivered(
        self, transfer: Transfer, done: list[Record], rest: list[Record], now: float
    ) -> None:
        """Some of a transfer's states landed (``done``), the ``rest`` did not and
        are kept for pulls, as :meth:`undelivered` keeps them. ``transfer`` is the
        one :meth:`transfers` gave out (it is known by identity)."""
        self.stats.keys_sent += len(done)
        copied = any(records is transfer.records for records in self.copied)
        self._landed(transfer)
        if self.view is not None:
            if not copied:  # (a copy of each is on its way already: not twice)
                self.stash(rest, self.view, now)
            if transfer.final and transfer.epoch == self.view.epoch:
                self.owed_marks.add(transfer.to)

    def abandon(self, transfer: Transfer) -> None:
        """A transfer that will never land (its sender was cancelled): stop waiting for it."""
        self._landed(transfer)

    def _landed(self, transfer: Transfer) -> None:
        if self.copied:
            self.copied = [r for r in self.copied if r is not transfer.records]
        flights = self.in_flight.get(transfer.to)
        if flights is None:
            return
        for index, records in enumerate(flights):
            if records is transfer.records:
                del flights[index]
                self._flying_keys.pop(transfer.to, None)
                break
        if not flights:
            del self.in_flight[transfer.to]

    # ------------------------------------------------------------------ peers' messages

    def receive(
        self,
        sender: str,
        epoch: int,
        records: list[Record],
        final: bool,
        crashes: Sequence[Crash],
        now: float,
    ) -> Received:
        """A transfer arrived (its crashes parsed by the caller: :meth:`Crash.from_wire`).

        :class:`NoLongerMember` if it is of an older view than this node's, which
        does not list this node (:meth:`_split_foreign`)."""
        records, foreign = self._split_foreign(records, epoch)
        # A transfer from an older view (a member handing back what it held
        # while away, late) may carry keys that moved on since: they go to
        # their owner now. (A newer view's transfer is kept whole: this node
        # is about to get that view, under which it owns those keys.)
        forwards = self._forwards(foreign)
        taken = self.store.import_(records, now, self.config().rule_map)
        if epoch > self.epoch or self.pending:
            # The view is settling: the sender may be this key's successor under
            # the view this node still holds (a member leaving) or still be
            # pushing to it (a member joining). Replicating the handed-off states
            # now would stream them straight back to a sender busy with its
            # push (it timed out, once). They are replicated once the view has
            # settled: the newer view's apply marks every state, or the last
            # final mark (or the handoff deadline) releases them.
            self.settling.update(record[2] for record in records)
            self.settling_epoch = max(self.settling_epoch, epoch)
        else:
            self.mark_dirty(records)
        self.stats.keys_received += taken
        # A rule this node does not know (or with another algorithm): the
        # states cannot be read. Never silent: this is lost quota history.
        dropped = len(records) - taken
        self.stats.keys_dropped += dropped
        for crash in crashes:
            known = {(c.view.epoch, c.crashed) for c in self.crashes}
            if crash.until > now and (crash.view.epoch, crash.crashed) not in known:
                self.crashes.append(crash)
        if final:
            if epoch == self.epoch and sender in self.pending:
                del self.pending[sender]
                if not self.pending:
                    self._settled()
            elif epoch > self.epoch:
                self.finals.setdefault(epoch, set()).add(sender)
        if not self.pending and self.settling_epoch <= self.epoch:
            self._release_settling()
        return Received(taken, dropped, forwards)

    def release_settled(self, elapsed: float) -> None:
        """Replicate the deferred states once every awaited handoff has landed
        or is past its deadline (the driver calls this before each round)."""
        if (
            self.settling
            and self.settling_epoch <= self.epoch
            and all(deadline <= elapsed for deadline in self.pending.values())
        ):
            self._release_settling()

    def _settled(self) -> None:
        """No handoff into this node is awaited any more: what it remembered per key
        for pulls (:meth:`inherit`) is of no use until the next view sets up
        another, and goes now rather than stay for as long as the ring does."""
        self.pulled = set()
        self.referred = {}

    def _release_settling(self) -> None:
        if not self.settling:
            return
        dirty = self._dirty()
        if dirty is not None:
            dirty.update(self.settling)
        self.settling = set()

    def _split_foreign(
        self, records: list[Record], epoch: int
    ) -> tuple[list[Record], list[Record]]:
        """Records this node keeps, and those another member owns under a newer view;
        :class:`NoLongerMember` if the newer view does not list this node (the
        sender keeps the states for their owner under it)."""
        view = self.view
        if view is None or epoch >= view.epoch or not len(view):
            return records, []
        if self.id not in view:
            raise NoLongerMember(
                f"{self.id} is not a member at epoch {view.epoch} (the transfer is of "
                f"epoch {epoch}): keep the states for their owner under the newer view"
            )
        mine: list[Record] = []
        foreign: list[Record] = []
        for record in records:
            (mine if view.owner_id(record[2]) == self.id else foreign).append(record)
        return mine, foreign

    def _forwards(self, records: list[Record]) -> list[Transfer]:
        """States passed on to their owners, without a final mark (not a handoff of ours)."""
        view = self.view
        if not records or view is None or not len(view):
            return []
        by_owner: dict[str, list[Record]] = {}
        for record in records:
            by_owner.setdefault(view.owner_id(record[2]), []).append(record)
        for owner, batch in by_owner.items():
            # In flight as a handoff's states are: a pull for one waits, and a
            # newer view copies them into its final marks (:meth:`_flying_copies`).
            # Not so, a forward refused by a member that left meanwhile went back
            # to the outbox after this node's final marks had told the key's new
            # owner that nothing more was coming (an independent review).
            self._take_off(owner, batch)
        return [
            Transfer(self.id, owner, view.member(owner).url, view.epoch, batch, False)
            for owner, batch in by_owner.items()
        ]

    def serve_pull(self, keys: Sequence[str], to: str, epoch: int, now: float) -> list[Record]:
        """Give up the named keys' states to their new owner (from the outbox or the store)."""
        if epoch > self.epoch:
            raise StaleEpoch(f"asked about epoch {epoch}, this node knows {self.epoch}")
        pulling = self.pulling
        if pulling and any(pulling.get(key, epoch) < epoch for key in keys):
            # This node pulls the key itself under an older view: the answer may
            # bring its state, which then goes to the asker with this node's final
            # mark (:meth:`take_pulled`). Answered "nothing" meanwhile, the asker
            # decided the key fresh (an independent review).
            raise InFlight(f"key(s) being pulled by {self.id} under an older view")
        wanted = set(keys)
        flights = self.in_flight.get(to)
        if flights:
            flying = self._flying_keys.get(to)
            if flying is None:
                flying = {record[2] for records in flights for record in records}
                self._flying_keys[to] = flying
            if not wanted.isdisjoint(flying):
                raise InFlight(f"{len(wanted)} key(s) on their way to {to}")
        found: list[Record] = []
        pending = self.outbox.get(to)
        if pending:
            keep: list[Record] = []
            for record in pending:
                (found if record[2] in wanted else keep).append(record)
            self.outbox[to] = keep
        view = self.view
        if view is not None and len(view):
            found += self.store.export(
                now,
                lambda k: k in wanted and (self.id not in view or view.owner_id(k) != self.id),
                remove=True,
            )
        return found

    def receive_replicas(
        self,
        origin: str,
        records: list[Record],
        now: float,
        round: tuple[int, int] | None = None,
    ) -> int:
        """Keep ``origin``'s copies, replacing older ones; returns how many.

        A batch of an older round than one already applied from the same
        process (``round``: its incarnation and round number) is dropped: it
        timed out at the sender, whose next round sent those keys again with
        newer states, and it arrived after that round (this node was paused,
        or the connections raced). Applied, it would put older states over
        newer ones, and a crash of the origin would promote them: more lost
        than its last interval.
        """
        if round is not None:
            seen = self.replica_seen.get(origin)
            if seen is not None and seen[0] == round[0] and round[1] < seen[1]:
                self.stats.replicas_stale += 1
                return 0
            self.replica_seen[origin] = round
        return self.keep_replicas(origin, records, now, replace=True)

    def keep_replicas(
        self, origin: str, records: list[Record], now: float, *, replace: bool = False
    ) -> int:
        """Keep ``records`` among ``origin``'s replicas; returns how many were taken.

        The replicas held here, every origin's together, are capped at the
        store's own cap (``--max-keys``): without it a node held its peers'
        copies without bound, however its own store was capped. Past it, the
        copies of keys not held yet are dropped (``replicas_dropped``), those
        held are kept up to date, and the sweep makes room as states go fresh.
        A dropped copy costs only on a crash of its owner: that key starts over
        at its new owner, as under ``reset``.
        """
        replicas = self.replicas.get(origin)
        if replicas is None:
            replicas = self.replicas[origin] = MemoryStore()
        cap = self.store.max_keys
        room = None if cap is None else max(0, cap - sum(map(len, self.replicas.values())))
        taken = replicas.import_(records, now, self.config().rule_map, replace=replace, room=room)
        self.stats.replicas_dropped += replicas.refused
        return taken

    # ------------------------------------------------------------------ replication

    def replication_wanted(self) -> bool:
        config = self.config()
        return config.policies.crash == "replica" or any(
            s.rule.crash_policy == "replica" for s in config.rules
        )

    def replication_tick(self) -> bool:
        """A replication round is due: switch change tracking on or off; True if wanted.

        Alone in its view (or with none), a node has no successor to send to:
        tracking stays off, so it costs nothing per key (the view that brings a
        second member marks every state changed, see :meth:`apply`).
        """
        view = self.view
        if view is None or len(view) < 2:
            self.store.dirty = None
            self.round = set()
            return False
        if self.replication_wanted():
            depth = self._replica_depths()
            if self.store.dirty is None or any(
                n > self.replicated_depths.get(rule, 0) for rule, n in depth.items()
            ):
                # Replication on, or a rule replicated further (a config pushed
                # under the same view): no state has (all) its replicas, and none
                # would go until it changes or the view does. Every one goes.
                self.store.dirty = set(self.store.keys()) | (self.store.dirty or set())
            self.replicated_depths = depth
            return True
        self.store.dirty = None
        self.round = set()
        return False

    def _replica_depths(self) -> dict[str, int]:
        """How many successors each rule replicates to."""
        return {name: rule.replicas for name, rule in self.config().rule_map.items()}

    def replica_round(self) -> int:
        """Start a replication round: every key changed so far joins the round
        (with any a broken-off round left), and the change set starts over.
        Returns how many keys the round holds.

        Keys that change while the round is sent wait for the next round: a
        round that also took those would never end under load (each send
        lets new requests in), and sent one small body after another
        back to back instead of one per interval.
        """
        self.rounds += 1
        dirty = self.store.dirty
        if dirty:
            if self.round:
                self.round |= dirty
            else:
                self.round = dirty
            self.store.dirty = set()
        return len(self.round)

    def replica_batches(self, now: float, limit: int | None = None) -> list[ReplicaBatch]:
        """The states of the round's keys (:meth:`replica_round`; with no round
        in progress, one starts), for their key's successors (as many as the
        state's rule asks for: ``replicas``).

        With ``limit``, at most that many keys' states: the rest stay in the
        round for the next call, so a round over a million changed keys
        never holds a million records (and their encoded body) at once.
        """
        view = self.view
        if view is None or len(view) < 2:
            return []
        if not self.round:
            self.replica_round()
        dirty = self.round
        if not dirty:
            return []
        if limit is not None and len(dirty) > limit:
            taken = set(islice(dirty, limit))
            dirty -= taken
            dirty = taken
        else:
            self.round = set()
        rules = self.config().rule_map
        depth = 1 + max((rule.replicas for rule in rules.values()), default=1)
        by_target: dict[str, list[Record]] = {}
        successors = self.successors
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
        batches: list[ReplicaBatch] = []
        for target, records in by_target.items():
            try:
                url = view.member(target).url
            except KeyError:
                self.replicas_failed(records)
                continue
            batches.append(
                ReplicaBatch(
                    self.id, target, url, view.epoch, records, (self.incarnation, self.rounds)
                )
            )
        return batches

    def replicas_failed(self, records: list[Record]) -> None:
        """Sent again next round (unless the view changes first)."""
        if self.store.dirty is not None:
            self.store.dirty.update(record[2] for record in records)

    def sweep_replicas(self, now: float) -> None:
        rules = self.config().rule_map
        for replicas in self.replicas.values():
            replicas.sweep(now)
            replicas.forget_rules(rules, keep_states=False)

    def status(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "pending_from": sorted(self.pending),
            "conservative_crashes": len(self.crashes),
            "outbox": {k: len(v) for k, v in self.outbox.items() if v},
            "settling": len(self.settling),
            "replicas": {k: len(v) for k, v in self.replicas.items()},
            "stats": dict(self.stats.__dict__),
        }
