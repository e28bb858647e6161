"""Failure detection on the virtual clock: which paused members the router removes.

A ``pause`` event stops some nodes' processes for a while (SIGSTOP, a GC or
VM pause, a host stall; a router cut off from them looks the same). What
that costs depends on the router's failure detection, so this module
replays it, round by round, as ``router/membership.py`` runs it:

* **Probe rounds.** The health loop sleeps ``health_interval`` (``h``), then
  probes every member at once. A member that is paused does not answer; a
  round with an unanswered probe ends ``health_timeout`` (``T_h``) later,
  and only then are removals decided. Members removed on probes are probed
  after that (their own ``T_h`` if one of them is still paused), and one
  that answers rejoins at once, as a *returning* member.
* **The removal decision** is the router's own: ``router.removal.RemovalBudget``
  (quorum, one removal per interval, lease bound), fed the round's
  unreachable and due members (``failure_threshold`` failures in a row) and
  every member's lease bound. ``budget = false`` replays the router before
  the budget instead: every due member is removed, at once, even the last
  one (the ring is then empty and the router answers ``503 no_nodes``).
* **Leases** (``node/lease.py``; off with ``budget = false``, which predates
  them). Each answered probe grants the offer of the previous one, so a node
  may decide until ``previous offer + lease``, and the router's bound is
  ``lease_bound(last offer, lease)``. A grant sent while the node is paused
  waits in its socket and lands when it wakes, with the anchor of the last
  offer before the pause: it extends nothing past ``last offer + lease``.
  A node that wakes after its lease ran out decides again only from the
  first probe round that gets through (the router grants the fresh offer at
  once). Meanwhile, and during the pause, its keys are answered per each
  rule's ``on_error``.

Pure: a function of the scenario's events and the detection settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from node.lease import DEFAULT_DRIFT, lease_bound
from router.removal import RemovalBudget

from .scenario import Change, DetectionSpec, EventSpec, PauseError


@dataclass
class Outage:
    """One node of one pause: when it stopped deciding, and what became of it."""

    node: str
    source: int  # index of the pause in the scenario's events
    start: float  # relative to the clock start
    end: float  # the process runs again
    #: when it decides again as the member it was (None: removed before that)
    resume: float | None = None
    removed_at: float | None = None
    rejoined_at: float | None = None
    #: its last answered probe before the pause (the router's lease bound counts from it)
    last_answer: float | None = None

    @property
    def until(self) -> float:
        """End of the time its keys (while it owns any) are answered per ``on_error``
        (after a removal it owns none; when it rejoins it decides at once)."""
        for value in (self.resume, self.removed_at):
            if value is not None:
                return value
        return math.inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "source_event": self.source,
            "start_s": self.start,
            "end_s": self.end,
            "resumed_s": _r(self.resume),
            "removed_s": _r(self.removed_at),
            "rejoined_s": _r(self.rejoined_at),
            "last_answer_s": _r(self.last_answer),
        }


def _r(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(x, 6)


@dataclass
class Detection:
    """What the router's probes did over the run."""

    changes: list[Change]
    outages: list[Outage]
    rounds: int = 0
    removals: int = 0
    rejoins: int = 0
    #: due members the budget kept, per round and reason (quorum, rate, lease)
    deferred: dict[str, int] = field(default_factory=lambda: {"quorum": 0, "rate": 0, "lease": 0})
    #: rounds in which the router could not reach most members and suspected itself
    suspect_self_rounds: int = 0

    def to_dict(self, spec: DetectionSpec) -> dict[str, Any]:
        return {
            **spec.to_dict(),
            "rounds": self.rounds,
            "removals": self.removals,
            "rejoins": self.rejoins,
            "deferred": dict(self.deferred),
            "suspect_self_rounds": self.suspect_self_rounds,
            "outages": [o.to_dict() for o in self.outages],
        }


@dataclass
class _Health:
    """The router's view of one member (``router.membership.Health``) and the node's lease."""

    last: float  # when its last offer was received (last answered probe)
    lease_until: float  # router side: every lease granted has ended by then
    node_lease: float  # node side: it may decide until then
    failures: int = 0
    #: a grant sent while it was paused, landing when it wakes
    pending: float = -math.inf


def detect(
    weights: Mapping[str, int],
    scheduled: Sequence[Change],
    pauses: Sequence[EventSpec],
    spec: DetectionSpec,
    duration: float,
) -> Detection:
    """Replay the probe rounds over ``duration``; ``scheduled``: the events' own changes.

    Returns every membership change (scheduled ones and those the probes
    made) in the order they happen, and one :class:`Outage` per paused node.
    """
    h, timeout, lease = spec.health_interval, spec.health_timeout, spec.lease
    leases = spec.budget  # the router before the budget granted no leases
    budget = RemovalBudget(spec.removal_interval, spec.removal_quorum)

    def bound(offered_at: float) -> float:
        return lease_bound(offered_at, lease, DEFAULT_DRIFT)

    outages = sorted(
        (Outage(node, ev.index, ev.at, ev.at + ev.duration) for ev in pauses for node in ev.nodes),
        key=lambda o: (o.start, o.source),
    )
    by_node: dict[str, list[Outage]] = {}
    for outage in outages:
        earlier = by_node.setdefault(outage.node, [])
        if earlier and earlier[-1].end > outage.start:
            raise PauseError(
                outage.source,
                f"{outage.node!r} is already paused at {outage.start:g}s "
                f"(until {earlier[-1].end:g}s)",
            )
        earlier.append(outage)

    def paused(node: str, t: float) -> Outage | None:
        for outage in by_node.get(node, ()):
            if outage.start <= t < outage.end:
                return outage
        return None

    def latest(node: str, t: float) -> Outage | None:
        """The node's last pause that started by ``t`` (what made its probes fail)."""
        found = None
        for outage in by_node.get(node, ()):
            if outage.start <= t:
                found = outage
        return found

    members: dict[str, int] = dict(weights)
    health = {m: _Health(0.0, bound(0.0), lease) for m in members}
    #: removed on probes while paused: id -> (weight, its outage)
    away: dict[str, tuple[int, Outage]] = {}
    changes: list[Change] = []
    pending = list(scheduled)
    starts = sorted(outages, key=lambda o: o.start)
    out = Detection(changes, outages)

    def catch_up(upto: float) -> None:
        """Apply the scheduled changes and pause starts up to ``upto``, in time order."""
        while (pending and pending[0].at <= upto) or (starts and starts[0].start <= upto):
            if starts and (not pending or starts[0].start < pending[0].at):
                outage = starts.pop(0)
                if outage.node not in members:
                    raise PauseError(
                        outage.source,
                        f"{outage.node!r} is not a member at {outage.start:g}s (nothing to pause)",
                    )
                continue
            change = pending.pop(0)
            changes.append(change)
            if change.kind == "join":
                members[change.node] = change.weight or weights.get(change.node, 1)
                health[change.node] = _Health(change.at, bound(change.at), change.at + lease)
                away.pop(change.node, None)
            else:
                members.pop(change.node, None)
                health.pop(change.node, None)
                for gone in by_node.get(change.node, ()):
                    if gone.start <= change.at and gone.resume is None and gone.removed_at is None:
                        gone.removed_at = change.at

    def wake(node: str, state: _Health, t: float) -> None:
        """``node`` answers at ``t``: close its outage if it was paused before."""
        for outage in by_node.get(node, ()):
            if outage.end <= t and outage.resume is None and outage.removed_at is None:
                node_lease = max(state.node_lease, state.pending)
                outage.resume = outage.end if (not leases or outage.end < node_lease) else t

    t = h
    while t < duration:
        catch_up(t)
        out.rounds += 1
        failed: list[str] = []
        for node in sorted(members):
            state = health[node]
            if leases:
                # The grant of the previous offer, recorded before it is sent.
                state.lease_until = max(state.lease_until, bound(state.last))
            stopped = paused(node, t)
            if stopped is not None:
                if stopped.last_answer is None:
                    stopped.last_answer = state.last
                state.failures += 1
                state.pending = state.last + lease
                failed.append(node)
                continue
            wake(node, state, t)
            state.node_lease = max(state.node_lease, state.pending, state.last + lease)
            if state.node_lease <= t:  # lapsed: the fresh offer is granted at once
                state.node_lease = t + lease
                state.lease_until = max(state.lease_until, bound(t))
            state.pending = -math.inf
            state.last = t
            state.failures = 0
        end = t + (timeout if failed else 0.0)
        catch_up(end)
        due = [m for m in sorted(members) if health[m].failures >= spec.failure_threshold]
        unreachable = [m for m in failed if m in members]
        if spec.budget:
            plan = budget.plan(
                end,
                sorted(members),
                unreachable,
                due,
                {m: s.lease_until for m, s in health.items()},
            )
            remove = list(plan.remove)
            for reason in plan.deferred.values():
                out.deferred[reason] += 1
            out.suspect_self_rounds += plan.suspect_self
        else:
            remove = due
        for node in remove:
            cause = latest(node, t)
            weight = members.pop(node)
            del health[node]
            changes.append(Change(end, "crash", node, weight, _source(cause), False, "probe"))
            out.removals += 1
            if spec.budget:
                budget.removed(end)
            if cause is not None:
                cause.removed_at = end
                away[node] = (weight, cause)
        still_paused = False
        for node in sorted(away):
            weight, outage = away[node]
            if paused(node, end) is not None:
                still_paused = True
                continue
            if node in members:  # an event made it a member again meanwhile
                del away[node]
                continue
            del away[node]
            outage.rejoined_at = end
            members[node] = weight
            health[node] = _Health(end, bound(end), end + lease)
            changes.append(Change(end, "join", node, weight, outage.source, False, "return"))
            out.rejoins += 1
        t = end + (timeout if still_paused else 0.0) + h
    catch_up(math.inf)
    for outage in outages:
        if outage.resume is None and outage.removed_at is None:
            # Woke with a lease still running, or the run ended before a round renewed it.
            last = health.get(outage.node)
            node_lease = -math.inf if last is None else max(last.node_lease, last.pending)
            if not leases or outage.end < node_lease:
                outage.resume = min(outage.end, duration)
    return out


def _source(outage: Outage | None) -> int:
    return -1 if outage is None else outage.source
