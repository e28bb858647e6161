"""The six modes: the real engine deciding the same arrivals six ways.

This module holds what is not the rebalancing protocol: the shared driver
(epochs, timers, routing, the hot loops), the exact global reference and
round robin. The four sticky modes run the node's own protocol core
(``node.shardcore.ShardCore``) over a simulated network: :mod:`simulations.sticky`.

Keys are user indices (``int``), not the ``user-<i>`` strings the ring
hashes: the store only ever hashes and compares its keys, so the decisions
are the same, and an int needs no lookup to find the user's owner.

What is real and what is simulated:

* Every decision is made by the engine's own algorithm functions
  (``node.algorithms.REGISTRY[alg].decide``) on the states held in real
  ``node.store.MemoryStore`` objects, one per node. With one rule the hot loop
  does exactly what ``MemoryStore.check`` does on its single-rule path (read
  the rule's state dict, ``decide``, write the state back if it changed)
  without building a ``Verdict`` per request; with several rules it calls
  ``MemoryStore.check`` itself, which goes through ``node.limiter.decide_all``.
* Handoff, the crash policies, replication and the hand-back of a returning
  member are the node's protocol core, one per simulated node, exchanging
  its messages through ``simulations.network.SimNetwork``.
* Routing is the real ``ring.RingView``; owners are looked up once per user per
  epoch (see :mod:`simulations.timeline`).
* Time is virtual: each arrival's timestamp is passed as ``now``. By default
  membership changes and state transfers are instantaneous at the event time
  (the network has no delay or loss, no request is in flight), which is the
  best case for every policy: the measured excess is a lower bound of what a
  real cluster shows.

Only the affected users, by default. A sticky mode routes a user whose owner
never changes during the run to the same node all along, and no policy ever
touches that user's state (handoff, reset, conservative and replica act on
moved keys only, and a crash moves every key of the crashed node). The
engine keeps one independent state per key, so such a user's verdicts in
every sticky mode are, by construction, the reference's. Sticky modes
therefore decide only the arrivals of *affected* users (moved by at least
one change) and take the reference's verdicts for the others
(:func:`complete`); ``full=True`` (``--full``) decides every arrival in every
mode instead, and the tests check that both give identical reports. Global
and round robin always decide every arrival.

Which policy applies to which event, per mode (also :func:`policy_table`):

=============  =========  =============  ======================================
mode           join       graceful leave crash
=============  =========  =============  ======================================
global         -          -              - (one exact limiter, the reference)
handoff        handoff    handoff        ``modes.handoff_crash_policy`` (reset)
reset          reset      reset          reset
conservative   handoff    handoff        conservative
replica        handoff    handoff        replica
round_robin    local      local          local (no shared state at all)
leases         handoff    handoff        conservative (leases revoked by epoch)
=============  =========  =============  ======================================

``leases`` is sticky routing with exact quota leases for hot keys, driven by
the real lease core (``node/quota.py``, ``router/quotas.py``):
:class:`simulations.quota.LeasesMode`.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from node.algorithms import REGISTRY
from node.rules import Rule
from node.store import MemoryStore

from .arrivals import Arrivals
from .scenario import Scenario
from .timeline import ChangeInfo, Epoch, Timeline

#: Requests decided per inner-loop call (progress is reported per chunk).
CHUNK = 262_144


def policy_table(scenario: Scenario) -> dict[str, dict[str, str]]:
    """For each mode, the policy applied to ``join``, ``leave`` (graceful) and ``crash``,
    and ``return``: what a member removed on probes while paused does with the
    states it held when it comes back (``hand_back``, ``discard``)."""
    back = scenario.returning
    return {
        "global": {"join": "none", "leave": "none", "crash": "none", "return": "none"},
        "handoff": {
            "join": "handoff",
            "leave": "handoff",
            "crash": scenario.handoff_crash_policy,
            "return": back,
        },
        # A node whose rebalance policy is reset drops what it would hand back.
        "reset": {"join": "reset", "leave": "reset", "crash": "reset", "return": "discard"},
        "conservative": {
            "join": "handoff",
            "leave": "handoff",
            "crash": "conservative",
            "return": back,
        },
        "replica": {"join": "handoff", "leave": "handoff", "crash": "replica", "return": back},
        "round_robin": {"join": "local", "leave": "local", "crash": "local", "return": "local"},
        "leases": {
            "join": "handoff",
            "leave": "handoff",
            "crash": "conservative",
            "return": back,
        },
    }


#: ``unavailable`` counts: answered per ``on_error`` (admitted unlimited when every
#: rule is ``open``, else denied), and of those, denied because the ring was empty.
_NO_OUTAGE: dict[str, int] = {"requests": 0, "admitted": 0, "denied": 0, "no_nodes": 0}


@dataclass
class ModeResult:
    mode: str
    #: allowed[i]: the mode's verdict on arrival i
    allowed: np.ndarray
    #: requests[epoch, node]: arrivals routed to each node in each epoch
    requests: np.ndarray
    #: keys[epoch, node]: live states held at the end of each epoch (-1: not a member)
    keys: np.ndarray
    #: what the mode did at each membership change
    actions: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    #: decisions the engine made (arrivals of the decided subset)
    decisions: int = 0
    #: arrival indices ``allowed`` refers to, when only a subset was decided
    index: np.ndarray | None = None
    #: live keys (user indices) at the end of each epoch: the reference's, for :func:`complete`
    live: list[np.ndarray] | None = None
    #: requests whose owner could not decide (paused, lease lapsed, empty ring)
    unavailable: dict[str, int] = field(default_factory=lambda: dict(_NO_OUTAGE))
    #: what the simulated network carried (sticky modes of a scenario with [network])
    network: dict[str, int] | None = None


# --------------------------------------------------------------------------- hot loops
# Module-level functions with everything passed in (locals are the fastest
# lookups CPython has), called once per node per chunk: nodes never share a
# state, so deciding a chunk node by node (each in time order) is the same as
# deciding it in arrival order. ``states`` is the node's dict for the rule,
# ``MemoryStore.table(rule).states``, and the body is MemoryStore.check's
# single-rule path.


def _loop(times: list, users: list, states: dict, decide: Callable, rule: Rule, cost: int) -> list:
    out: list[bool] = []
    append = out.append
    get = states.get
    for now, key in zip(times, users, strict=False):
        state = get(key)
        new, decision = decide(state, now, rule, cost)
        if new is not state:
            states[key] = new
        append(decision[0])
    return out


def _loop_dirty(
    times: list, users: list, states: dict, dirty: set, decide: Callable, rule: Rule, cost: int
) -> list:
    out: list[bool] = []
    append = out.append
    get = states.get
    mark = dirty.add
    for now, key in zip(times, users, strict=False):
        state = get(key)
        new, decision = decide(state, now, rule, cost)
        if new is not state:
            states[key] = new
            mark(key)
        append(decision[0])
    return out


def _loop_multi(
    times: list, users: list, check: Callable, dirty: set | None, rules: tuple, cost: int
) -> list:
    out: list[bool] = []
    append = out.append
    for now, key in zip(times, users, strict=False):
        allowed = check(key, rules, now, cost)[0]
        if allowed and dirty is not None:
            dirty.add(key)
        append(allowed)
    return out


def _loop_guarded(
    times: list, users: list, check: Callable, guard: Callable, rules: tuple, cost: int
) -> list:
    """Decide after the protocol's own step for each request (pull-on-miss, conservative)."""
    out: list[bool] = []
    append = out.append
    for now, key in zip(times, users, strict=False):
        guard(key, now)
        append(check(key, rules, now, cost)[0])
    return out


# --------------------------------------------------------------------------- modes


class Mode:
    """Shared driver: walk the epochs, decide their arrivals, apply each change."""

    name = ""

    def __init__(
        self,
        timeline: Timeline,
        arrivals: Arrivals,
        progress: Callable[[int], None] | None = None,
        index: np.ndarray | None = None,
    ) -> None:
        scenario = timeline.scenario
        self.scenario = scenario
        self.timeline = timeline
        self.arrivals = arrivals
        self.index = index
        if index is None:
            self.times = arrivals.times
            self.users = arrivals.users
        else:
            self.times = arrivals.times[index]
            self.users = arrivals.users[index]
        self.rules: tuple[Rule, ...] = scenario.rules
        self.rules_by_name = {r.name: r for r in self.rules}
        self.single = len(self.rules) == 1
        self.rule = self.rules[0]
        self.decide = REGISTRY[self.rule.algorithm].decide
        self.cost = scenario.arrivals.cost
        self.progress = progress or (lambda _n: None)
        self.policy = policy_table(scenario)[self.name]
        n_epochs = len(timeline.epochs)
        self.n_slots = self._slots()
        self.allowed = np.zeros(len(self.times), dtype=bool)
        self.requests = np.zeros((n_epochs, self.n_slots), dtype=np.int64)
        self.keys = np.full((n_epochs, self.n_slots), -1, dtype=np.int64)
        self.stores: list[MemoryStore | None] = [None] * self.n_slots
        self.dirty: list[set[int]] | None = None
        self.actions: list[dict[str, Any]] = []
        #: count routed requests while deciding (sticky modes count them on all arrivals)
        self.count_in_loop = True
        self.live: list[np.ndarray] | None = None
        #: (time, sequence, callback): things that happen between arrivals
        self.timers: list[tuple[float, int, Callable[[float, Epoch], None]]] = []
        self._sequence = itertools.count()
        #: owners that cannot decide at times (paused nodes, an empty ring): the
        #: reference is a limiter that never fails, so it has none
        self.outages = [] if self.name == "global" else timeline.outages
        self.check_down = self.name != "global" and (
            bool(self.outages) or any(not e.alive for e in timeline.epochs)
        )
        #: the router answers an unreachable owner's keys per on_error: admitted
        #: (unlimited) only if every rule fails open
        self.fail_open = all(r.on_error == "open" for r in self.rules)
        self.unavailable = dict(_NO_OUTAGE)

    def _slots(self) -> int:
        return len(self.timeline.node_ids)

    # -- driver --------------------------------------------------------------

    def run(self) -> ModeResult:
        started = time.perf_counter()
        timeline = self.timeline
        self.setup(timeline.epochs[0])
        bounds = np.searchsorted(self.times, timeline.change_times, side="left").tolist()
        edges = [0, *bounds, len(self.times)]
        for e, epoch in enumerate(timeline.epochs):
            self.process(edges[e], edges[e + 1], epoch)
            self.snapshot(epoch)
            if e < len(timeline.changes):
                self.actions.append(self.apply(timeline.changes[e], epoch, timeline.epochs[e + 1]))
        self.finish()
        return ModeResult(
            self.name,
            self.allowed,
            self.requests,
            self.keys,
            self.actions,
            time.perf_counter() - started,
            len(self.times),
            self.index,
            self.live,
            self.unavailable,
        )

    def finish(self) -> None:
        return None

    def setup(self, epoch: Epoch) -> None:
        for n in epoch.alive:
            self.stores[n] = MemoryStore()

    def at(self, when: float, callback: Callable[[float, Epoch], None]) -> None:
        """Run ``callback(when, epoch)`` after the arrivals before ``when``, before the rest.

        A timer due exactly at a membership change runs after the change.
        """
        heapq.heappush(self.timers, (when, next(self._sequence), callback))

    def process(self, i0: int, i1: int, epoch: Epoch) -> None:
        i = i0
        timers = self.timers
        while timers and timers[0][0] < epoch.end:
            when, _, callback = heapq.heappop(timers)
            j = min(i1, max(i, int(np.searchsorted(self.times, when, side="left"))))
            self.decide_range(i, j, epoch)
            callback(when, epoch)
            i = j
        self.decide_range(i, i1, epoch)

    def route(self, a: int, b: int, users: np.ndarray, epoch: Epoch) -> np.ndarray:
        raise NotImplementedError

    def down(self, times: np.ndarray, nodes: np.ndarray) -> np.ndarray | None:
        """Which of these routed arrivals no owner decides (None: all are decided).

        An owner is down while paused and until its lease is renewed
        (``Timeline.outages``); with an empty ring (``nodes`` = -1) nobody is.
        """
        mask = nodes < 0
        lo, hi = float(times[0]), float(times[-1])
        for node, start, _, until in self.outages:
            if start <= hi and until > lo:
                mask |= (nodes == node) & (times >= start) & (times < until)
        return mask if mask.any() else None

    def decide_range(self, i0: int, i1: int, epoch: Epoch) -> None:
        times, users, rule, cost, rules = self.times, self.users, self.rule, self.cost, self.rules
        stores, dirty, decide = self.stores, self.dirty, self.decide
        counts = self.requests[epoch.index]
        sink = self.n_slots  # arrivals nobody decides are routed here
        for a in range(i0, i1, CHUNK):
            b = min(i1, a + CHUNK)
            chunk_times = times[a:b]
            chunk_users = users[a:b]
            nodes = self.route(a, b, chunk_users, epoch)
            down = self.down(chunk_times, nodes) if self.check_down and b > a else None
            out = np.empty(b - a, dtype=bool)
            if down is not None:
                # Answered per on_error; an empty ring answers 503 no_nodes.
                empty = nodes < 0
                out[down] = self.fail_open
                out[empty] = False
                n_down, n_empty = int(down.sum()), int(empty.sum())
                admitted = (n_down - n_empty) if self.fail_open else 0
                self.unavailable["requests"] += n_down
                self.unavailable["admitted"] += admitted
                self.unavailable["denied"] += n_down - admitted
                self.unavailable["no_nodes"] += n_empty
                if self.count_in_loop:
                    counts += np.bincount(nodes[~empty], minlength=self.n_slots)
                nodes = np.where(down, sink, nodes)
                per_node = np.bincount(nodes, minlength=self.n_slots + 1)
            else:
                per_node = np.bincount(nodes, minlength=self.n_slots)
                if self.count_in_loop:
                    counts += per_node
            order = np.argsort(nodes, kind="stable")
            lo = 0
            for node in np.flatnonzero(per_node).tolist():
                hi = lo + int(per_node[node])
                sel = order[lo:hi]
                lo = hi
                if node == sink:
                    continue
                store = stores[node]
                assert store is not None, "a request was routed to a node that is not a member"
                t, u = chunk_times[sel].tolist(), chunk_users[sel].tolist()
                guard = self.guard(node, t[0])
                if guard is not None:
                    out[sel] = _loop_guarded(t, u, store.check, guard, rules, cost)
                elif not self.single:
                    out[sel] = _loop_multi(
                        t, u, store.check, None if dirty is None else dirty[node], rules, cost
                    )
                elif dirty is None:
                    out[sel] = _loop(t, u, store.table(rule).states, decide, rule, cost)
                else:
                    out[sel] = _loop_dirty(
                        t, u, store.table(rule).states, dirty[node], decide, rule, cost
                    )
            self.allowed[a:b] = out
            self.progress(b - a)

    def guard(self, node: int, now: float) -> Callable[[Any, float], None] | None:
        """A step to take before each of ``node``'s decisions from ``now`` on (None: none)."""
        return None

    def snapshot(self, epoch: Epoch) -> None:
        """Evict fresh states (what the node's sweeper does) and count what is held."""
        for n, store in enumerate(self.stores):
            if store is not None:
                store.sweep(epoch.end, budget=None)
                self.keys[epoch.index, n] = len(store) if self.single else len(store.keys())

    def apply(self, info: ChangeInfo, before: Epoch, after: Epoch) -> dict[str, Any]:
        raise NotImplementedError


class GlobalMode(Mode):
    """One exact limiter seeing every arrival: what a central Redis would answer."""

    name = "global"

    def _slots(self) -> int:
        return 1

    def setup(self, epoch: Epoch) -> None:
        self.stores[0] = MemoryStore()

    def route(self, a: int, b: int, users: np.ndarray, epoch: Epoch) -> np.ndarray:
        return np.zeros(b - a, dtype=np.int64)

    def snapshot(self, epoch: Epoch) -> None:
        super().snapshot(epoch)
        store = self.stores[0]
        assert store is not None
        if self.live is None:
            self.live = []
        self.live.append(np.fromiter(store.keys(), dtype=np.int64))

    def apply(self, info: ChangeInfo, before: Epoch, after: Epoch) -> dict[str, Any]:
        return {"policy": "none"}


class RoundRobinMode(Mode):
    """Arrival i goes to the (i mod N)-th member (by id); each node limits alone."""

    name = "round_robin"

    def route(self, a: int, b: int, users: np.ndarray, epoch: Epoch) -> np.ndarray:
        if not epoch.alive:
            return np.full(b - a, -1, dtype=np.int64)
        alive = np.asarray(epoch.alive, dtype=np.int64)
        return alive[np.arange(a, b, dtype=np.int64) % len(alive)]

    def apply(self, info: ChangeInfo, before: Epoch, after: Epoch) -> dict[str, Any]:
        node = info.node_index
        action: dict[str, Any] = {"policy": "local", "states_lost": 0}
        if info.change.kind == "join":
            self.stores[node] = MemoryStore()
        else:
            lost = self.stores[node]
            assert lost is not None
            action["states_lost"] = len(lost)  # swept at the epoch end: all live
            self.stores[node] = None
        return action


def make_mode(
    mode: str,
    timeline: Timeline,
    arrivals: Arrivals,
    progress: Callable[[int], None] | None = None,
    full: bool = False,
) -> Mode:
    if mode == "global":
        return GlobalMode(timeline, arrivals, progress)
    if mode == "round_robin":
        return RoundRobinMode(timeline, arrivals, progress)
    if mode in ("handoff", "reset", "conservative", "replica"):
        from .sticky import StickyMode  # the protocol's modes build on this module

        return StickyMode(mode, timeline, arrivals, progress, full)
    if mode == "leases":
        from .quota import LeasesMode  # the lease simulation builds on this module

        return LeasesMode(timeline, arrivals, progress)
    raise ValueError(f"unknown mode {mode!r}")


def decisions_needed(mode: str, timeline: Timeline, arrivals: Arrivals, full: bool) -> int:
    """How many arrivals ``mode`` will decide (for progress bars)."""
    if full or mode in ("global", "round_robin", "leases"):
        return len(arrivals)
    return int(timeline.affected[arrivals.users].sum())


def run_mode(
    mode: str,
    timeline: Timeline,
    arrivals: Arrivals,
    progress: Callable[[int], None] | None = None,
    full: bool = False,
) -> ModeResult:
    return make_mode(mode, timeline, arrivals, progress, full).run()


def complete(result: ModeResult, reference: ModeResult, timeline: Timeline) -> ModeResult:
    """Fill in a subset-decided sticky mode from the reference (see the module docstring).

    Unaffected users get the reference's verdicts, and their live states (the
    reference's at each epoch end) are counted on their owner, which never
    changes for them.
    """
    if result.index is None:
        return result
    assert reference.live is not None and reference.index is None
    allowed = reference.allowed.copy()
    allowed[result.index] = result.allowed
    keys = result.keys.copy()
    for e, epoch in enumerate(timeline.epochs):
        live = reference.live[e]
        unaffected = live[~timeline.affected[live]]
        counts = np.bincount(epoch.owners[unaffected], minlength=keys.shape[1])
        member = keys[e] >= 0
        assert not counts[~member].any(), "an unaffected key is owned by a non-member"
        keys[e, member] += counts[member]
    return ModeResult(
        result.mode,
        allowed,
        result.requests,
        keys,
        result.actions,
        result.seconds,
        result.decisions,
        None,
        None,
        result.unavailable,
        result.network,
    )
