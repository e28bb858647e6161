"""Top limited users: a bounded space-saving sketch of denied and near-limit keys.

An operator asks "who is being limited right now?". Counting every key
exactly would cost memory proportional to the number of users; the
space-saving algorithm (Metwally, Agrawal and El Abbadi, "Efficient
computation of frequent and top-k elements in data streams", ICDT 2005)
keeps ``capacity`` counters and still guarantees, for a stream of ``N``
events:

* every monitored key ``x`` has ``count(x) - error(x) <= true(x) <= count(x)``;
* the smallest counter (the *floor*) is at most ``N / capacity``, and every
  key that is not monitored occurred at most ``floor`` times, so a key with
  more than ``N / capacity`` events is always in the sketch.

Only denied and near-limit decisions reach the sketch (see
:data:`NEAR_LIMIT_FRACTION`), so the cost on the hot path is one comparison
per decision, plus a few dict operations (O(1)) for those that count.

:class:`TopKeys` keeps one sketch per rule and kind (``denied``,
``near_limit``) over a window that rotates: the answer covers the current
window and the previous one (between ``window`` and ``2 * window`` seconds
of history), so a user limited an hour ago does not stay on top forever.
Rotation is driven by the caller's clock (the node's sweep loop), never read
here.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from node.decision import BACKEND_ERROR, BACKEND_UNAVAILABLE, STORE_FULL, Verdict

#: An allowed decision is *near the limit* when at most ``1 / NEAR_LIMIT`` of the
#: limit remains after it (``remaining * 10 <= limit``): the one definition of
#: "near" (top keys, the node's batch path, the router's leases), compared in
#: integers on the hot path (:func:`is_near_limit`, :func:`worth_noting`).
NEAR_LIMIT = 10
#: The same, as a fraction (for what the admin API says it means).
NEAR_LIMIT_FRACTION = 1 / NEAR_LIMIT
KINDS = ("denied", "near_limit")
#: Denials (and fail-open allowances) that say nothing about the user.
NOT_THE_USERS = frozenset({BACKEND_UNAVAILABLE, BACKEND_ERROR, STORE_FULL})
DEFAULT_CAPACITY = 256
DEFAULT_WINDOW = 60.0


class Entry(NamedTuple):
    """One key's estimate: ``hits - error <= true count <= hits``."""

    key: str
    hits: int
    error: int


class SpaceSaving:
    """The space-saving summary, on Metwally et al.'s *stream-summary* structure.

    Keys are grouped in buckets by count (``count -> {key: None}``, ordered
    by arrival), and the smallest count is tracked, so a unit increment and
    an eviction are O(1): move the key to the next bucket, or take the oldest
    key of the smallest bucket. (A heap of ``(count, key)`` pairs would
    compare strings whenever counts tie, which they nearly always do when
    many distinct keys pass through.) A weighted increment that empties the
    smallest bucket finds the next one by a scan of the buckets (at most
    ``capacity``); the node only adds 1 at a time.
    """

    __slots__ = ("_buckets", "_min", "capacity", "counts", "errors", "total")

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.counts: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.total = 0
        self._buckets: dict[int, dict[str, None]] = {}
        self._min = 0

    def add(self, key: str, weight: int = 1) -> None:
        counts, buckets = self.counts, self._buckets
        self.total += weight
        count = counts.get(key)
        if count is not None:
            bucket = buckets[count]
            del bucket[key]
            if not bucket:
                del buckets[count]
                if count == self._min:
                    self._min = count + weight if weight == 1 else -1
        elif len(counts) < self.capacity:
            self.errors[key] = 0
            count = 0
            if weight < self._min or not counts:
                self._min = weight
        else:
            count = self._min
            bucket = buckets[count]
            victim = next(iter(bucket))
            del bucket[victim], counts[victim], self.errors[victim]
            if not bucket:
                del buckets[count]
                self._min = count + weight if weight == 1 else -1
            self.errors[key] = count
        count += weight
        counts[key] = count
        target = buckets.get(count)
        if target is None:
            buckets[count] = {key: None}
        else:
            target[key] = None
        if self._min < 0:
            self._min = min(buckets)

    @property
    def floor(self) -> int:
        """The most an unmonitored key can have occurred (0 until the sketch is full)."""
        return self._min if len(self.counts) >= self.capacity else 0

    def entries(self) -> list[Entry]:
        return [Entry(k, c, self.errors[k]) for k, c in self.counts.items()]

    def top(self, n: int) -> list[Entry]:
        return rank(self.entries(), n)


def rank(entries: Iterable[Entry], n: int) -> list[Entry]:
    """The ``n`` largest counts, ties broken by key (a stable, repeatable order)."""
    return heapq.nsmallest(n, entries, key=lambda e: (-e.hits, e.key))


def merge_windows(sketches: Sequence[SpaceSaving]) -> list[Entry]:
    """Several sketches of the same keys (successive windows of one node), merged.

    A key missing from a full sketch may still have occurred up to that
    sketch's floor, so it is counted at the floor, and the floor is added to
    its error: ``count - error <= true <= count`` still holds for the union
    stream, and any key missing from every sketch occurred at most the sum of
    the floors.
    """
    floors = [s.floor for s in sketches]
    keys: set[str] = set()
    for sketch in sketches:
        keys.update(sketch.counts)
    merged = []
    for key in keys:
        count = error = 0
        for sketch, floor in zip(sketches, floors, strict=True):
            c = sketch.counts.get(key)
            if c is None:
                count += floor
                error += floor
            else:
                count += c
                error += sketch.errors[key]
        merged.append(Entry(key, count, error))
    return merged


def merge_disjoint(lists: Iterable[Iterable[Entry]]) -> list[Entry]:
    """Answers of several nodes merged by summing per key.

    Right under sticky routing: a key is decided by one node (its owner), so
    its events are counted in one sketch and the others hold 0 for it. During
    a handoff both the old and the new owner may report the key: each counted
    decisions it really made, so the sum is still the cluster's count.
    """
    merged: dict[str, Entry] = {}
    for entries in lists:
        for entry in entries:
            seen = merged.get(entry.key)
            if seen is not None:
                entry = Entry(entry.key, seen.hits + entry.hits, seen.error + entry.error)
            merged[entry.key] = entry
    return list(merged.values())


def is_near_limit(remaining: int, limit: int) -> bool:
    """``remaining <= 10 %`` of ``limit`` (integers: no float on the hot path)."""
    return remaining * NEAR_LIMIT <= limit


def worth_noting(verdict: Verdict) -> bool:
    """Whether :meth:`TopKeys.note` may count anything of ``verdict``: it was
    denied, its first decision is near its limit, or several rules decided it
    (``note`` looks at each). The common verdict (one rule, allowed, far from
    its limit) is ruled out here by one test, before any call into ``note``.
    (Indexes, not field names: a NamedTuple's field costs more to read.)"""
    return not verdict[0] or verdict[1][2] * NEAR_LIMIT <= verdict[1][1] or len(verdict[2]) > 1


class TopKeys:
    """Denied and near-limit keys of one node, per rule, over a rotating window."""

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, window: float = DEFAULT_WINDOW, now: float = 0.0
    ) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        self.capacity = capacity
        self.window = window
        self.started = now
        self.denied: dict[str, SpaceSaving] = {}
        self.near: dict[str, SpaceSaving] = {}
        self._previous: dict[str, dict[str, SpaceSaving]] = {"denied": {}, "near_limit": {}}

    def note(self, decided: Iterable[tuple[str, Verdict]]) -> None:
        """Count the denied and near-limit decisions among ``(key, verdict)`` pairs.

        Called once per request or batch, with the pairs the caller already
        picked (likely candidates); each rule's decision is looked at here.
        Denials that say nothing about the user (the backend is down, the
        store is full) are not counted.
        """
        denied_sketches, near_sketches = self.denied, self.near
        for key, verdict in decided:
            for d in verdict.decisions:
                if d.allowed:
                    if not is_near_limit(d.remaining, d.limit) or d.reason in NOT_THE_USERS:
                        continue
                    sketches = near_sketches
                elif d.reason in NOT_THE_USERS:
                    continue
                else:
                    sketches = denied_sketches
                sketch = sketches.get(d.rule)
                if sketch is None:
                    sketch = sketches[d.rule] = SpaceSaving(self.capacity)
                sketch.add(key)

    def record(self, rule: str, key: str, denied: bool) -> None:
        """One denied or near-limit decision (the hot path: keep it small)."""
        sketches = self.denied if denied else self.near
        sketch = sketches.get(rule)
        if sketch is None:
            sketch = sketches[rule] = SpaceSaving(self.capacity)
        sketch.add(key)

    def rotate(self, now: float) -> bool:
        """Start a new window once the current one is ``window`` seconds old."""
        if now - self.started < self.window:
            return False
        elapsed = now - self.started
        if elapsed >= 2 * self.window:
            # Nothing recorded in the window before this one is recent any more.
            self._previous = {"denied": {}, "near_limit": {}}
        else:
            self._previous = {"denied": self.denied, "near_limit": self.near}
        self.denied, self.near = {}, {}
        self.started = now
        return True

    def rules(self) -> list[str]:
        names = set(self.denied) | set(self.near)
        for previous in self._previous.values():
            names |= set(previous)
        return sorted(names)

    def report(self, rules: Iterable[str] | None, n: int) -> dict[str, dict[str, list[list]]]:
        """Per rule (``rules``, else every rule with events) and kind, the ``n``
        top keys as ``[key, hits, error]``: what ``GET /internal/top`` answers
        and the router merges (router/top.py)."""
        names = self.rules() if rules is None else rules
        return {
            name: {kind: [list(e) for e in self.top(name, kind, n)] for kind in KINDS}
            for name in names
        }

    def top(self, rule: str, kind: str, n: int) -> list[Entry]:
        """The ``n`` keys with the most ``kind`` events for ``rule`` in the last
        one to two windows."""
        current = self.denied if kind == "denied" else self.near
        sketches = [s for s in (self._previous[kind].get(rule), current.get(rule)) if s is not None]
        if not sketches:
            return []
        if len(sketches) == 1:
            return sketches[0].top(n)
        return rank(merge_windows(sketches), n)
