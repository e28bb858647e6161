"""The owner's lease desk: grants and settles quota leases on a node's store; pure.

``node/quota.py`` is the lease logic on one key's :class:`~node.quota.Held`
state. This desk keeps, per ``(rule, key)``, the leases granted and not yet
settled, so that every grant sees the key's outstanding units (the buckets'
validity bound needs them) and a settlement finds the lease it refers to.
The key's state itself stays in the node's ``MemoryStore``, where every
ordinary decision reads it: a grant deducts from that very state.

**Epochs.** The outstanding leases belong to one ring epoch. When the node's
epoch changes (a join, a leave, a crash), every outstanding lease is
forgotten: routers drop leases of older epochs (``LeaseBook.set_epoch``)
and a settlement of one is refused, so their unused units are **written
off** (the states keep them deducted). No handoff record has to carry
leases. This is safe without refunds: a lease's own bound covers its use
until its end (the bucket with every unit out stays below its capacity
until then, and nothing granted or settled later raises that sum), and an
old lease is never refunded into the new owner's state, which is the only
way a later lease computed without it could outlive that bound
(docs/hotkeys.md, "Ring changes").

No clock and no I/O here: the node passes ``now`` (its decision clock) and
its store.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from node.quota import Held, LeasePolicy, Outstanding, OwnerAnswer, QuotaLease, grant, refund
from node.rules import Rule
from node.store import MemoryStore
from ring.view import MAX_EPOCH

#: (rule, key) entries with outstanding leases a node keeps at most; beyond, no grant.
MAX_LEASED_KEYS = 65_536
#: Settlements one ask may carry.
MAX_SETTLE = 64


@dataclass
class DeskStats:
    """Counters for /metrics and /internal/status."""

    grants: int = 0
    denial_leases: int = 0
    units_leased: int = 0
    units_refunded: int = 0
    units_written_off: int = 0


class LeaseDesk:
    """One node's outstanding quota leases, by ``(rule name, key)``."""

    def __init__(self, policy: LeasePolicy | None = None) -> None:
        self.policy = policy or LeasePolicy("auto")
        self.epoch = -1
        self._out: dict[tuple[str, str], dict[int, QuotaLease]] = {}
        self._ids = itertools.count(1)
        self.stats = DeskStats()

    def __len__(self) -> int:
        return len(self._out)

    def set_epoch(self, epoch: int) -> int:
        """A ring change forgets every outstanding lease; returns the units written off."""
        if epoch == self.epoch:
            return 0
        self.epoch = epoch
        lost = sum(lease.units for leases in self._out.values() for lease in leases.values())
        self._out.clear()
        self.stats.units_written_off += lost
        return lost

    def _held(self, store: MemoryStore, rule: Rule, key: str) -> Held:
        leases = self._out.get((rule.name, key), {})
        return Held(
            store.get(rule, key),
            tuple(Outstanding(i, q.units, q.expires_at) for i, q in leases.items()),
        )

    def _keep(self, store: MemoryStore, rule: Rule, key: str, held: Held) -> None:
        store.put(rule, key, held.state)
        entry = (rule.name, key)
        leases = self._out.get(entry, {})
        live = {o.lease_id for o in held.outstanding}
        kept = {i: q for i, q in leases.items() if i in live}
        if kept:
            self._out[entry] = kept
        else:
            self._out.pop(entry, None)

    def settle(
        self, store: MemoryStore, rule: Rule, key: str, lease_id: int, unused: int, now: float
    ) -> int:
        """A router stopped using lease ``lease_id`` with ``unused`` units: the units
        given back (0 for a lease unknown here: settled already, or of an older epoch)."""
        lease = self._out.get((rule.name, key), {}).get(lease_id)
        if lease is None:
            return 0
        held, back = refund(self._held(store, rule, key), rule, lease, unused, now)
        self._keep(store, rule, key, held)
        self.stats.units_refunded += back
        self.stats.units_written_off += max(0, min(unused, lease.units)) - back
        return back

    def grant(
        self, store: MemoryStore, rule: Rule, key: str, now: float, want: int, cost: int
    ) -> QuotaLease | None:
        """Lease up to ``want`` units of ``key`` (at most a block), deducted from its
        state in ``store`` now. ``None``: nothing to say (see :func:`node.quota.grant`)."""
        policy = self.policy
        want = max(0, min(want, policy.block(rule)))
        entry = (rule.name, key)
        if entry not in self._out and len(self._out) >= MAX_LEASED_KEYS:
            self._prune(now)
            if len(self._out) >= MAX_LEASED_KEYS:
                want = 0  # memory is bounded: a denial lease at most
        if want and not store.has_room_for(rule, key, now):
            # A window leases from a fresh state, which the grant would write past
            # --max-keys: one more state per new hot key. No lease, so the key's
            # requests go to this node, which answers them store_full.
            want = 0
        held, lease = grant(
            self._held(store, rule, key),
            rule,
            now,
            want,
            epoch=self.epoch,
            lease_id=next(self._ids),
            ttl=policy.ttl,
            cost=cost,
        )
        if lease is not None and lease.units:
            self._out.setdefault(entry, {})[lease.lease_id] = lease
            self.stats.grants += 1
            self.stats.units_leased += lease.units
        elif lease is not None:
            self.stats.denial_leases += 1
        self._keep(store, rule, key, held)
        return lease

    def _prune(self, now: float) -> None:
        for entry in list(self._out):
            leases = {i: q for i, q in self._out[entry].items() if q.expires_at > now}
            if leases:
                self._out[entry] = leases
            else:
                del self._out[entry]


def lease_to_dict(lease: QuotaLease) -> dict[str, Any]:
    """The wire form of a lease (times on the owner's clock; ``refill_at`` null: never).

    ``answer`` (optional: a node before it sends none, and a router before it
    ignores it) is the owner's :class:`~node.quota.OwnerAnswer`, its times
    seconds after ``granted_at``.
    """
    data: dict[str, Any] = {
        "id": lease.lease_id,
        "rule": lease.rule,
        "units": lease.units,
        "granted_at": lease.granted_at,
        "expires_at": lease.expires_at,
        "refill_at": None if math.isinf(lease.refill_at) else lease.refill_at,
        "epoch": lease.epoch,
        "window": lease.window,
        "refill_cost": lease.refill_cost,
    }
    answer = lease.answer
    if answer is not None:
        data["answer"] = {
            "remaining": answer.remaining,
            "reset_after": answer.reset_after,
            "available_after": answer.available_after,
            "refill": answer.refill,
        }
    return data


def _answer_from_dict(data: Any) -> OwnerAnswer | None:
    """A lease's ``answer`` (None: absent, from a node that does not send it)."""
    if data is None:
        return None
    if type(data) is not dict:
        raise ValueError("lease answer must be an object")
    remaining = data.get("remaining")
    if type(remaining) is not int or remaining < 0:
        raise ValueError("lease answer remaining must be an integer >= 0")
    times = []
    for name in ("reset_after", "available_after", "refill"):
        value = data.get(name)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"lease answer {name} must be a number")
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"lease answer {name} must be finite and >= 0")
        times.append(float(value))
    return OwnerAnswer(remaining, *times)


def definition(rule: Rule) -> list[Any]:
    """What a lease's units are measured in, as a router's ask carries it: an
    owner that holds another definition of the rule (new rules reach the router
    and the nodes one after the other) refuses the ask rather than grant units
    of a limit the router no longer applies, or no longer of its own."""
    return [rule.algorithm, rule.limit, rule.period, rule.burst]


def lease_from_dict(data: Any, key: Hashable = None) -> QuotaLease:
    """A lease from its wire form; ``ValueError`` for anything malformed."""
    if type(data) is not dict:
        raise ValueError("a lease must be an object")

    def number(name: str, *, null: bool = False) -> float:
        value = data.get(name)
        if value is None and null:
            return math.inf
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"lease {name} must be a number")
        if not math.isfinite(value):
            raise ValueError(f"lease {name} must be finite")
        return float(value)

    def integer(name: str, low: int, high: int | None = None) -> int:
        value = data.get(name)
        if type(value) is not int or value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in {low}..{high}"
            raise ValueError(f"lease {name} must be an integer {bound}")
        return value

    rule = data.get("rule")
    if type(rule) is not str:
        raise ValueError("lease rule must be a string")
    window = data.get("window")
    return QuotaLease(
        integer("id", 1),
        rule,
        integer("units", 0),
        number("granted_at"),
        number("expires_at"),
        number("refill_at", null=True),
        integer("epoch", 0, MAX_EPOCH),
        None if window is None else number("window"),
        integer("refill_cost", 1),
        key,
        _answer_from_dict(data.get("answer")),
    )
