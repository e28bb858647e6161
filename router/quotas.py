"""Quota leases for hot keys, the router's side: a pure lease book.

The book holds the leases a router got from key owners (``node/quota.py``)
and decides a leased key's requests without the owner:

* **admit** while a lease of the current epoch has the units and time left
  (the oldest-expiring lease first, so fewer units are stranded at expiry);
* **deny** while the last grant said the owner has nothing of that cost
  before ``refill_at`` (a drained hot key's denials, which are most of its
  traffic, never reach the owner);
* otherwise **forward** to the owner, as without leases.

It asks for the next block ahead of need: :meth:`LeaseBook.want` says how
many units to ask for once the units left fall to the low-water mark.
A ring change revokes every lease through the same epoch fencing as the
rest of the router: :meth:`LeaseBook.set_epoch` drops each lease of an
older epoch (their unused units are written off: the owner deducted them).

Owner times become router times conservatively: a lease asked for at
``asked_at`` (router clock) was granted after it, so its duration, shrunk
by the clocks' possible rate difference ``drift``, is counted from
``asked_at``: the router stops using a lease no later than the owner's
``expires_at``. What the owner said with its last grant for the router's own
answers (:meth:`LeaseBook.owner_answer`) counts from when the grant came in
instead: those are the times a client reads, later than the owner's by the
answer's transit (and off by the clocks' rate difference, which is not applied).
No clock is read here; every method takes ``now``.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from node.lease import DEFAULT_DRIFT
from node.quota import OwnerAnswer, QuotaLease

ADMIT = "admit"
DENY = "deny"
FORWARD = "forward"

#: What a book is keyed by: a key, or ``(rule, key)`` with several rules.
K = TypeVar("K", bound=Hashable)


@dataclass
class HeldLease:
    """A lease in the book: the units left and its end on the router's clock."""

    lease: QuotaLease
    left: int
    deadline: float


@dataclass
class _Entry:
    leases: list[HeldLease] = field(default_factory=list)
    #: deny requests of ``deny_cost`` or more until then (router clock)
    deny_until: float = float("-inf")
    deny_cost: int = 1
    #: units of the last block granted (the low-water mark is a share of it)
    block: int = 0
    #: leases spent to the last unit: settled with the next ask
    spent: list[HeldLease] = field(default_factory=list)
    #: the owner's answer with the last grant (None: a node that does not send one)
    answer: OwnerAnswer | None = None
    #: when that grant reached the router (router clock): its durations count from here
    answered_at: float = 0.0
    #: seconds from that grant until the owner admits ``deny_cost`` (inf: never)
    retry_after: float = math.inf


@dataclass(frozen=True)
class Released(Generic[K]):
    """A lease the book let go of, with the units it never used."""

    key: K
    lease: QuotaLease
    unused: int


class LeaseBook(Generic[K]):
    """One router's leases, per key (callers key by ``(rule, key)`` with several rules)."""

    def __init__(
        self, *, epoch: int = 0, drift: float = DEFAULT_DRIFT, low_water: float = 0.25
    ) -> None:
        if drift < 0 or not 0 <= low_water < 1:
            raise ValueError("drift must be >= 0 and low_water in [0, 1)")
        self.epoch = epoch
        self.drift = drift
        self.low_water = low_water
        self._keys: dict[K, _Entry] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def _local(self, lease: QuotaLease, at: float, asked_at: float) -> float:
        return asked_at + (at - lease.granted_at) / (1.0 + self.drift)

    def add(
        self, key: K, lease: QuotaLease, asked_at: float, received_at: float | None = None
    ) -> list[Released[K]]:
        """Take ``lease`` (asked for at ``asked_at``, its answer in at ``received_at``:
        by default ``asked_at``); a lease of another epoch is refused and returned as
        released, so that its units are accounted for."""
        if lease.epoch != self.epoch:
            return [Released(key, lease, lease.units)]
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = _Entry()
        deadline = self._local(lease, lease.expires_at, asked_at)
        if lease.units:
            entry.leases.append(HeldLease(lease, lease.units, deadline))
            entry.leases.sort(key=lambda held: held.deadline)
            entry.block = lease.units
        # Denials: only what the owner said about itself right after this grant.
        refill = self._local(lease, min(lease.refill_at, lease.expires_at), asked_at)
        entry.deny_until = refill if refill > asked_at else float("-inf")
        entry.deny_cost = max(1, lease.refill_cost)
        # What to tell clients: the owner's own times, counted from when the grant came
        # in (after it was made: a client is not told to retry before the owner said).
        entry.answer = lease.answer
        entry.answered_at = asked_at if received_at is None else received_at
        entry.retry_after = lease.refill_at - lease.granted_at
        return []

    def decide(self, key: K, now: float, cost: int = 1) -> str:
        """``ADMIT`` (a unit of a lease was spent), ``DENY`` or ``FORWARD``."""
        entry = self._keys.get(key)
        if entry is None:
            return FORWARD
        for held in entry.leases:
            if held.deadline > now and held.left >= cost:
                held.left -= cost
                if not held.left:
                    entry.leases.remove(held)
                    entry.spent.append(held)
                return ADMIT
        if now < entry.deny_until and cost >= entry.deny_cost:
            return DENY
        return FORWARD

    def left(self, key: K, now: float) -> int:
        """Units the book still holds for ``key`` at ``now``."""
        entry = self._keys.get(key)
        if entry is None:
            return 0
        return sum(h.left for h in entry.leases if h.deadline > now)

    def owner_answer(self, key: K, now: float) -> tuple[OwnerAnswer, float, float, int] | None:
        """The owner's answer with ``key``'s last grant, the seconds since it came in,
        the seconds from then until the owner admits again (inf: never) and the units
        the book holds at ``now``; None: no grant said (a node that does not send it)."""
        entry = self._keys.get(key)
        if entry is None or entry.answer is None:
            return None
        left = 0
        for held in entry.leases:
            if held.deadline > now:
                left += held.left
        elapsed = now - entry.answered_at
        return entry.answer, elapsed if elapsed > 0.0 else 0.0, entry.retry_after, left

    def denied_for(self, key: K, now: float) -> float:
        """Seconds until the owner said it may admit ``key`` again (0: not denying)."""
        entry = self._keys.get(key)
        if entry is None or now >= entry.deny_until:
            return 0.0
        return entry.deny_until - now

    def want(self, key: K, now: float, block: int) -> int:
        """Units to ask for now (0: none): the next ``block`` once the units left fall
        to the low-water mark, unless the owner said it has nothing before then."""
        entry = self._keys.get(key)
        if entry is None or now < entry.deny_until:
            return 0
        if self.left(key, now) > self.low_water * (entry.block or block):
            return 0
        return block

    def take_spent(self, key: K) -> list[QuotaLease]:
        """``key``'s leases spent to the last unit, to settle with the owner (0 unused)."""
        entry = self._keys.get(key)
        if entry is None or not entry.spent:
            return []
        spent, entry.spent = entry.spent, []
        return [held.lease for held in spent]

    def expire(self, now: float) -> list[Released[K]]:
        """Let go of every lease whose time is up (the caller returns or writes off
        the unused units) and of keys with nothing left to say."""
        out: list[Released[K]] = []
        for key in list(self._keys):
            entry = self._keys[key]
            keep = []
            for held in entry.leases:
                if held.deadline <= now:
                    out.append(Released(key, held.lease, held.left))
                else:
                    keep.append(held)
            entry.leases = keep
            # A spent lease needs no settling once it has expired (the owner drops it).
            entry.spent = [held for held in entry.spent if held.deadline > now]
            if not keep and now >= entry.deny_until and not entry.spent:
                del self._keys[key]
        return out

    def next_deadline(self) -> float:
        """The earliest deadline of a held lease (inf: none)."""
        return min(
            (h.deadline for e in self._keys.values() for h in e.leases), default=float("inf")
        )

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._keys))

    def release(self, key: K) -> list[Released[K]]:
        """Give up every lease of ``key`` now (e.g. to return the units)."""
        entry = self._keys.pop(key, None)
        if entry is None:
            return []
        return [Released(key, h.lease, h.left) for h in entry.leases]

    def set_epoch(self, epoch: int) -> list[Released[K]]:
        """A ring change: every lease of an older epoch is revoked (written off)."""
        if epoch == self.epoch:
            return []
        self.epoch = epoch
        out = [
            Released(key, h.lease, h.left)
            for key, entry in self._keys.items()
            for h in entry.leases
        ]
        self._keys.clear()
        return out
