"""When to probe the members removed as crashed, and when to forget them (pure).

The router probes a member it removed as crashed so that it rejoins when it
answers again: a paused or partitioned process that lived on, or one
restarted without ``--join`` (its router is its only way back). Probed every
health round for as long as the router ran, a node that died for good cost a
probe, and on an unreachable host a connect timeout, every round forever
(up to ``MAX_REMOVED`` of them). So the probes back off and end:

* for :data:`FULL_RATE_FOR` seconds after its removal a member is probed
  every round (a supervisor's restart comes back within it, at full speed);
* then the gap doubles after each probe it does not answer, from the health
  interval up to :data:`MAX_GAP`;
* at ``forget_after`` seconds (``--forget-removed-after``) it is forgotten:
  no more probes. It can still come back by registering (``--join``, or
  ``ringlimit nodes add``).

An answer resets the member's schedule: it is alive, and a rejoin that did
not happen (the lock was held, the join failed) is tried again at full rate.
No I/O and no clock reads: ``now`` is passed in (router/health.py drives it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

#: Seconds after a removal during which the member is probed every round.
FULL_RATE_FOR = 60.0
#: The longest gap between two probes of a removed member (seconds).
MAX_GAP = 30.0
#: Seconds after which a removed member is forgotten (``--forget-removed-after``).
FORGET_AFTER = 3600.0


@dataclass
class _Track:
    since: float
    next_at: float
    gap: float = 0.0


class RevivalProbes:
    """The probe schedule of each removed member, keyed by member id."""

    def __init__(self, interval: float, forget_after: float = FORGET_AFTER) -> None:
        self.interval = interval
        self.forget_after = forget_after
        self._tracks: dict[str, _Track] = {}

    def plan(self, removed: Iterable[str], now: float) -> tuple[list[str], list[str]]:
        """``(due, forget)``: the removed members to probe this round, and those
        to forget now. A member first seen here is removed as of ``now``; ids no
        longer removed (rejoined, forgotten elsewhere) leave the schedule."""
        removed = list(removed)
        for gone in self._tracks.keys() - set(removed):
            del self._tracks[gone]
        due: list[str] = []
        forget: list[str] = []
        for member_id in removed:
            track = self._tracks.setdefault(member_id, _Track(since=now, next_at=now))
            if now - track.since >= self.forget_after:
                del self._tracks[member_id]
                forget.append(member_id)
            elif now >= track.next_at:
                due.append(member_id)
        return due, forget

    def missed(self, member_id: str, now: float) -> None:
        """Its probe got no answer at ``now``: back off, once past the full-rate time."""
        track = self._tracks.get(member_id)
        if track is None or now - track.since < FULL_RATE_FOR:
            return
        track.gap = min(MAX_GAP, max(self.interval, 2 * track.gap))
        track.next_at = now + track.gap

    def answered(self, member_id: str, now: float) -> None:
        """It answered: alive, so probed at full rate again, its age from ``now``."""
        self._tracks[member_id] = _Track(since=now, next_at=now)
