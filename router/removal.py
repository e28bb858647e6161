"""The removal budget: how many members a router may remove on its own probes.

Removing a member on probe failures alone is a guess: the member may be dead,
or the router may be the one cut off (its network, its host, a pause of its
own). A wrong guess is expensive: the removed member's keys move to replicas
or start fresh, and its load moves to the survivors, which may then time out
in turn (the cascade hash-ring operators learned to fear). So the router
removes on its own probes only when the evidence points at the member:

* **Quorum.** Most of the ring must answer this round (strictly more than
  ``quorum`` of the members), and the ring left after the removal must still
  hold more than ``quorum`` of today's members. A router that cannot reach
  most members at once suspects itself, keeps the ring, and lets each rule's
  ``on_error`` answer for the unreachable keys.
* **Rate.** At most one removal per ``interval`` seconds (by default one
  detection time): a second failure that starts while the first is being
  absorbed waits, and is removed only if it persists.
* **Leases.** A member is removed only once every lease the router granted it
  has certainly ended (node/lease.py): ``lease_until`` per member.

With three members, one may be removed; with two, none (a router that reaches
one of two cannot tell which side is at fault): remove it by hand
(``ringlimit nodes remove``) or lower ``quorum``. An operator's removal is
never subject to the budget.

Pure: the clock is an argument, and the decision is data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ring.errors import given


@dataclass(frozen=True)
class RemovalPlan:
    remove: tuple[str, ...]
    #: Members that are due but wait, and why: "quorum", "rate" or "lease".
    deferred: Mapping[str, str]
    #: True when the router cannot reach most members: it suspects itself.
    suspect_self: bool


@dataclass
class RemovalBudget:
    interval: float
    quorum: float = 0.5
    _last_removal: float = field(default=float("-inf"), repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.quorum < 1.0:
            raise ValueError(f"removal quorum must be in [0, 1), got {given(self.quorum)}")
        if not self.interval >= 0.0:
            raise ValueError(f"removal interval must be >= 0, got {given(self.interval)}")

    def plan(
        self,
        now: float,
        members: Sequence[str],
        unreachable: Sequence[str] | set[str],
        due: Sequence[str],
        lease_until: Mapping[str, float],
    ) -> RemovalPlan:
        """Which of the ``due`` members (failed often enough) to remove now."""
        size = len(members)
        missing = set(unreachable) & set(members)
        reachable = size - len(missing)
        deferred: dict[str, str] = {}
        if size == 0:
            return RemovalPlan((), {}, False)
        if reachable <= self.quorum * size:
            return RemovalPlan((), dict.fromkeys(due, "quorum"), bool(due) or bool(missing))
        remove: list[str] = []
        for member in due:
            if member not in members:
                continue
            if now < lease_until.get(member, float("-inf")):
                deferred[member] = "lease"
            elif (size - 1) <= self.quorum * size:
                deferred[member] = "quorum"
            elif remove or now - self._last_removal < self.interval:
                deferred[member] = "rate"
            else:
                remove.append(member)
        return RemovalPlan(tuple(remove), deferred, False)

    def removed(self, now: float) -> None:
        """Record a removal made on probes (the rate counts from here)."""
        self._last_removal = now
