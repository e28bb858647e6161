"""Quota leases for hot keys, the owner's side: pure, no I/O, no clock.

A hot key (one user sending a large share of all traffic) pays the
router-to-owner hop on every request and loads its owner far above the mean.
A **quota lease** lets a router decide such a key locally: the owner grants
a block of ``units`` valid until ``expires_at``, deducting them from the
key's state at once (so the owner never admits what is leased), and tells
the router until when it has nothing more to give (``refill_at``), so the
router can also answer the denials of a drained key locally.

Exactness is measured against the reference that sees each request when the
router *uses* a unit, not when it was granted. Deducting early is exact
only while the algorithm cannot "forget" the early consumption, so each
algorithm bounds a lease's validity (``docs/hotkeys.md`` has the proofs):

* **token bucket, GCRA**: the bucket with every outstanding leased unit
  still unspent must not reach its capacity while a lease can be used:
  ``expires_at <= now + (capacity - tokens - outstanding) / rate`` (for
  GCRA that is ``tat - outstanding * interval``). A drained (hot) key gets
  a long lease, a full bucket none. Unused units are refunded only before
  ``expires_at`` (afterwards a refill may have been capped: written off).
* **fixed window, sliding window counter**: a lease ends with the window it
  was granted in (both count units per aligned window, and a unit used
  later in the same window counts the same). Unused units are refunded into
  the window they were taken from (for the counter: the current or the
  previous one), never into another.
* **sliding log**: no leases. Accounting the units at ``expires_at`` is
  safe, but the engine then stamps every later admission at ``expires_at``
  too (its log never moves back), which makes the false denials grow with
  the owner's own traffic rather than with the leased units. See the docs.

``outstanding`` (leases granted and not settled, per key) is kept beside the
state in :class:`Held` by the owner's desk (node/leasing.py) for its current
epoch only. No handoff carries it: a ring change writes the outstanding units
off (the state keeps them deducted), which keeps the bound (docs/hotkeys.md,
"Ring changes").
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass, field

from node.algorithms import REGISTRY, State
from node.decision import Decision
from node.rules import LEASE_ALGORITHMS, LEASE_MODES, Rule

#: Algorithms a lease may be granted for (see the module docstring for the sliding log).
LEASABLE = frozenset(LEASE_ALGORITHMS)
BUCKETS = frozenset({"token_bucket", "gcra"})
WINDOWS = frozenset({"fixed_window", "sliding_window"})
#: Leases of one key outstanding at once (routers x blocks ahead); beyond, no grant.
MAX_OUTSTANDING = 64


def parse_lease_mode(value: object) -> str:
    """A rule's ``lease`` setting: ``"auto"`` or ``"off"`` (the default until measured)."""
    if value is None:
        return "off"
    if value is True:
        return "auto"
    if value is False:
        return "off"
    if isinstance(value, str) and value.strip().lower() in LEASE_MODES:
        return value.strip().lower()
    raise ValueError(f"lease must be one of {', '.join(LEASE_MODES)}, got {value!r}")


@dataclass(frozen=True, slots=True)
class LeasePolicy:
    """How a node leases a rule's keys.

    ``threshold``: decisions per second of one key at its owner before it is
    offered a first lease (a router that holds one asks for the next block
    without it). ``ttl``: the longest a lease is valid, whatever the
    algorithm allows. ``max_units``: the largest block (0: a quarter of the
    rule's capacity, at least 1): several routers each holding a block strand
    units, and stranded units are what the false denials are bounded by.
    """

    mode: str = "off"
    threshold: float = 100.0
    ttl: float = 5.0
    max_units: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", parse_lease_mode(self.mode))
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"lease threshold must be a finite rate >= 0, got {self.threshold}")
        if not (math.isfinite(self.ttl) and self.ttl > 0):
            raise ValueError(f"lease ttl must be a positive number of seconds, got {self.ttl}")
        if self.max_units < 0:
            raise ValueError(f"lease max_units must be >= 0, got {self.max_units}")

    def block(self, rule: Rule) -> int:
        """The most units one lease of ``rule`` carries."""
        return self.max_units or max(1, rule.capacity // 4)

    def enabled(self, rule: Rule) -> bool:
        return self.mode == "auto" and rule.algorithm in LEASABLE


@dataclass(frozen=True, slots=True)
class Outstanding:
    """A lease the owner granted and no router settled yet (until it expires)."""

    lease_id: int
    units: int
    expires_at: float


@dataclass(frozen=True, slots=True)
class Held:
    """A key's state at its owner, with the leases granted from it."""

    state: State = None
    outstanding: tuple[Outstanding, ...] = ()

    def owed(self, now: float) -> int:
        """Units leased from this state that a router may still use at ``now``."""
        return sum(o.units for o in self.outstanding if o.expires_at > now)


@dataclass(frozen=True, slots=True)
class OwnerAnswer:
    """What the owner would answer for the key right after a grant (a peek: cost 0),
    so that a router answering from the lease tells what a node would.

    Durations from ``granted_at`` on the owner's clock, not times: the router's
    clock is another one, and only a duration measured on one clock means
    anything on another (the router counts these from when the grant reached
    it). ``remaining``: whole units the owner has beyond every lease it has
    granted; ``reset_after``, ``available_after``: as in
    :class:`node.decision.Decision`; ``refill``: units per second the owner
    regains after ``available_after`` while nothing else is decided (buckets:
    their rate; the sliding window counter: its previous window sliding out;
    fixed window: 0, its units come back when its leases have ended).
    """

    remaining: int
    reset_after: float
    available_after: float
    refill: float = 0.0


@dataclass(frozen=True, slots=True)
class QuotaLease:
    """What a router may decide alone, all times on the owner's clock.

    ``units`` may be 0: a *denial lease*, which only says that the owner
    admits nothing of ``cost`` before ``refill_at``. ``window``: the window
    start the units were taken from (window algorithms; refunds go there).
    """

    lease_id: int
    rule: str
    units: int
    granted_at: float
    expires_at: float
    refill_at: float
    epoch: int
    window: float | None = None
    #: the cost ``refill_at`` is about: a smaller request may pass before it
    refill_cost: int = 1
    key: Hashable = field(default=None, compare=False)
    #: the owner's own answer right after the grant (None: from a node that does not say)
    answer: OwnerAnswer | None = field(default=None, compare=False)


# --------------------------------------------------------------------------- validity
# Module-level functions (not inlined) so that the tests can mutate them and see the
# properties fail.


def _bucket_end(rule: Rule, state: State, now: float, owed: int) -> float:
    """The latest time the bucket, with ``owed`` leased units unspent, stays below capacity."""
    if rule.algorithm == "gcra":
        tat = state if state is not None and state > now else now
        return float(tat - owed * rule.interval)
    if state is None:
        return now - owed / rule.rate  # full: nothing may be leased
    tokens, last = state.real, state.imag
    if now > last:
        tokens = min(float(rule.capacity), tokens + (now - last) * rule.rate)
        last = now
    return float(last + (rule.capacity - tokens - owed) / rule.rate)


def _window_end(rule: Rule, state: State) -> float:
    """The end of the window a (just charged) window state counts in."""
    start: float = state[0]
    return start + rule.period


def _refund_ok(lease: QuotaLease, now: float) -> bool:
    """Buckets: units come back only while the lease could still be used."""
    return now <= lease.expires_at


# --------------------------------------------------------------------------- owner side


def decide(held: Held, rule: Rule, now: float, cost: int) -> tuple[Held, Decision]:
    """An ordinary request at the owner: the engine's decision on the held state."""
    state, decision = REGISTRY[rule.algorithm].decide(held.state, now, rule, cost)
    if state is held.state:
        return held, decision
    return Held(state, held.outstanding), decision


def grant(
    held: Held,
    rule: Rule,
    now: float,
    want: int,
    *,
    epoch: int,
    lease_id: int,
    ttl: float,
    cost: int = 1,
    key: Hashable = None,
) -> tuple[Held, QuotaLease | None]:
    """Lease up to ``want`` units of ``held`` at ``now``, deducting them at once.

    ``cost``: the cost of the requests the router decides for this key; the
    units are a multiple of it. Returns the new held state and the lease, or ``None`` when there is
    nothing to say (the algorithm takes no leases, or the owner has units but
    may not lease them yet: a full bucket). A lease of 0 units (a denial
    lease) tells the router that requests of ``cost`` cannot pass before
    ``refill_at``. Outstanding leases past their expiry are dropped here.
    """
    name = rule.algorithm
    if name not in LEASABLE:
        return held, None
    algorithm = REGISTRY[name]
    live = tuple(o for o in held.outstanding if o.expires_at > now)
    if len(live) >= MAX_OUTSTANDING:
        want = 0  # a denial lease at most: the key's state stays small
    state = held.state
    end = now + ttl
    if name in BUCKETS:
        end = min(end, _bucket_end(rule, state, now, sum(o.units for o in live)))
    units = 0
    new = state
    if want > 0 and end > now:
        units = min(want, algorithm.decide(state, now, rule, 0)[1].remaining)
        # Whole requests only: a router left with less than ``cost`` while the owner
        # also holds less would deny what the two together admit.
        units -= units % cost if cost > 1 else 0
        if units > 0:
            new, decision = algorithm.decide(state, now, rule, units)
            if not decision.allowed:  # never lease what the engine would not admit
                new, units = state, 0
    window = None
    if units and name in WINDOWS:
        window = float(new[0])
        end = min(end, _window_end(rule, new))
    after = algorithm.decide(new, now, rule, cost)[1]
    if after.allowed:
        refill_at = now
    elif after.retry_after is None:
        refill_at = math.inf
    else:
        refill_at = now + after.retry_after
    if units == 0:
        if refill_at <= now:
            return (held if len(live) == len(held.outstanding) else Held(state, live)), None
        end = min(now + ttl, refill_at)
        answer = _answer(rule, state, now)
        return Held(state, live), QuotaLease(
            lease_id, rule.name, 0, now, end, refill_at, epoch, None, cost, key, answer
        )
    answer = _answer(rule, new, now)
    lease = QuotaLease(
        lease_id, rule.name, units, now, end, refill_at, epoch, window, cost, key, answer
    )
    return Held(new, (*live, Outstanding(lease_id, units, end))), lease


def _answer(rule: Rule, state: State, now: float) -> OwnerAnswer:
    """The owner's peek at ``state`` (its units beyond every lease) right after a grant."""
    read = REGISTRY[rule.algorithm].decide(state, now, rule, 0)[1]
    if rule.algorithm in BUCKETS:
        refill = rule.rate
    elif rule.algorithm == "sliding_window" and state is not None:
        # The previous window's count slides out linearly (until the window ends).
        start, prev, curr = state
        if now >= start + rule.period:  # a window (or more) has passed since the state
            prev = curr if now < start + 2 * rule.period else 0
        refill = prev / rule.period
    else:
        refill = 0.0
    return OwnerAnswer(read.remaining, read.reset_after, read.available_after, refill)


def refund(held: Held, rule: Rule, lease: QuotaLease, unused: int, now: float) -> tuple[Held, int]:
    """Settle ``lease``: the router stopped using it with ``unused`` units left.

    Returns the new held state and the units given back. Only a lease still
    outstanding is settled (a retried or late settlement gives nothing back),
    and only where the owner stays at least as restrictive as the reference:
    buckets up to ``expires_at``, windows into the window the units came
    from. Anything else is written off (the owner stays stricter by it).
    """
    kept = tuple(o for o in held.outstanding if o.lease_id != lease.lease_id)
    if len(kept) == len(held.outstanding):
        return held, 0
    state = held.state
    unused = max(0, min(unused, lease.units))
    back = 0
    name = rule.algorithm
    if unused and state is not None:
        if name == "token_bucket" and _refund_ok(lease, now):
            tokens, last = state.real, state.imag
            if now > last:
                tokens = min(float(rule.capacity), tokens + (now - last) * rule.rate)
                last = now
            state = complex(min(float(rule.capacity), tokens + unused), last)
            back = unused
        elif name == "gcra" and _refund_ok(lease, now):
            tat = state if state > now else now
            state = max(now, tat - unused * rule.interval)
            back = unused
        elif name == "fixed_window":
            start, count = state
            if start == lease.window:
                back = min(unused, count)
                state = (start, count - back)
        elif name == "sliding_window":
            start, prev, curr = state
            if start == lease.window:
                back = min(unused, curr)
                state = (start, prev, curr - back)
            elif lease.window is not None and start == lease.window + rule.period:
                back = min(unused, prev)
                state = (start, prev - back, curr)
    return Held(state, kept), back


# --------------------------------------------------------------------------- hot keys


class HotKeys:
    """Each key's decision rate at its owner, exponentially decayed; pure.

    ``observe(key, now)`` counts one decision and says whether the key is
    hot: its rate (a decayed count with half-life ``half_life`` seconds,
    scaled so that a steady stream of r per second reads r) is at least
    ``threshold``. Memory is bounded by ``max_keys``: beyond it the coldest
    half is forgotten (a hot key is counted again within a half-life).
    """

    def __init__(self, threshold: float, *, half_life: float = 1.0, max_keys: int = 4096) -> None:
        if half_life <= 0 or max_keys < 1:
            raise ValueError("half_life must be > 0 and max_keys >= 1")
        self.threshold = threshold
        self.half_life = half_life
        self.max_keys = max_keys
        self._scale = math.log(2) / half_life
        self._rates: dict[Hashable, tuple[float, float]] = {}

    def rate(self, key: Hashable, now: float) -> float:
        found = self._rates.get(key)
        if found is None:
            return 0.0
        value, at = found
        return value * math.exp(-self._scale * max(0.0, now - at))

    def observe(self, key: Hashable, now: float, n: int = 1) -> bool:
        value = self.rate(key, now) + n * self._scale
        rates = self._rates
        if key not in rates and len(rates) >= self.max_keys:
            self._forget(now)
        rates[key] = (value, now)
        return value >= self.threshold

    def _forget(self, now: float) -> None:
        ranked = sorted(self._rates, key=lambda k: self.rate(k, now))
        for key in ranked[: max(1, len(ranked) // 2)]:
            del self._rates[key]

    def __len__(self) -> int:
        return len(self._rates)
