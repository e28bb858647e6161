"""The six modes: the real engine deciding the same arrivals six ways.

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
* Handoff is ``MemoryStore.export(now, select, remove=True)`` on the old owner
  and ``MemoryStore.import_`` on the new one, i.e. the node's real handoff
  path with its relative-time wire format. The crash policies follow
  ``node/shard.py`` (see :class:`StickyMode` and :class:`ReplicaMode`).
* Routing is the real ``ring.RingView``; owners are looked up once per user per
  epoch (see :mod:`simulations.timeline`).
* Time is virtual: each arrival's timestamp is passed as ``now``. Membership
  changes and state transfers are instantaneous at the event time (no
  detection delay, no in-flight requests), which is the best case for every
  policy: the measured excess is a lower bound of what a real cluster shows.

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
=============  =========  =============  ======================================
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from node.algorithms import REGISTRY, exhausted
from node.rules import Rule
from node.store import MemoryStore, Record

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


# --------------------------------------------------------------------------- modes


class _Mode:
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
                if not self.single:
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

    def snapshot(self, epoch: Epoch) -> None:
        """Evict fresh states (what the node's sweeper does) and count what is held."""
        for n, store in enumerate(self.stores):
            if store is not None:
                store.sweep(epoch.end, budget=None)
                self.keys[epoch.index, n] = len(store) if self.single else len(store.keys())

    def apply(self, info: ChangeInfo, before: Epoch, after: Epoch) -> dict[str, Any]:
        raise NotImplementedError


class GlobalMode(_Mode):
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


class RoundRobinMode(_Mode):
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


@dataclass
class _Exhaustion:
    """Keys of a crashed node that start exhausted under ``rule`` until ``until``.

    The node does this lazily (``node.shard.Shard._exhaust``): a key the crashed
    member owned that has no state yet and is asked about before ``until``
    starts from the state ``node.algorithms.exhausted(rule, at)`` gives, which
    is fresh from ``until`` on (up to two periods for a sliding window, longer
    for a bucket with burst > limit); after that, a missing state is fresh.
    The simulator puts the exhausted state in place at the crash, and at
    ``until`` removes it from every key that no request asked about in between
    (``keys``: such keys, mapped to the state object their owner holds). The
    two are the same.
    """

    rule: Rule
    at: float
    until: float
    keys: dict[int, Any]
    action: dict[str, Any]
    #: arrivals (of this mode's arrays) before this index have been looked at
    seen: int = 0
    used: int = 0


class StickyMode(_Mode):
    """Each user is decided by the ring owner of its key; changes follow ``self.policy``.

    ``policy["join"]``/``policy["leave"]`` (the node's rebalance policy) is
    ``handoff`` or ``reset``; ``policy["crash"]`` is ``reset``,
    ``conservative`` or ``replica``, and applies to the crashed node's keys
    only (keys moving between survivors follow the rebalance policy).
    """

    def __init__(
        self,
        name: str,
        timeline: Timeline,
        arrivals: Arrivals,
        progress: Callable[[int], None] | None = None,
        full: bool = False,
    ) -> None:
        self.name = name
        index = None if full else np.flatnonzero(timeline.affected[arrivals.users])
        super().__init__(timeline, arrivals, progress, index)
        self.node_index = {node_id: i for i, node_id in enumerate(timeline.node_ids)}
        self.count_in_loop = False
        self.exhaustions: list[_Exhaustion] = []
        #: stores of members removed on probes while paused: they come back with them
        self.away: dict[int, MemoryStore] = {}

    def route(self, a: int, b: int, users: np.ndarray, epoch: Epoch) -> np.ndarray:
        return epoch.owners[users]

    def finish(self) -> None:
        # Requests per node, over every arrival (the decided subset or not).
        times, users = self.arrivals.times, self.arrivals.users
        edges = [
            0,
            *np.searchsorted(times, self.timeline.change_times, side="left").tolist(),
            len(times),
        ]
        for e, epoch in enumerate(self.timeline.epochs):
            routed = epoch.owners[users[edges[e] : edges[e + 1]]]
            self.requests[e] += np.bincount(routed[routed >= 0], minlength=self.n_slots)
        for exhaustion in list(self.exhaustions):
            self._expire(exhaustion, self.scenario.end, self.timeline.epochs[-1])

    def snapshot(self, epoch: Epoch) -> None:
        super().snapshot(epoch)
        # The node exhausts keys lazily, on first request: states the simulator put
        # in place for keys nobody asked about yet would not be held there.
        pending: set[int] = set()
        for exhaustion in self.exhaustions:
            self._prune_asked(exhaustion, epoch.end)
            rule = exhaustion.rule
            pending.update(
                k for k, state in exhaustion.keys.items() if self._state_of(epoch, rule, k) is state
            )
        if pending:
            owners = epoch.owners[np.fromiter(pending, dtype=np.int64, count=len(pending))]
            owners = owners[owners >= 0]
            self.keys[epoch.index] -= np.bincount(owners, minlength=self.n_slots)

    # -- membership changes -------------------------------------------------

    def _import_grouped(self, records: list[Record], owner_of: list[int], now: float) -> int:
        by_target: dict[int, list[Record]] = {}
        for record in records:
            by_target.setdefault(owner_of[record[2]], []).append(record)
        taken = 0
        for target, group in by_target.items():
            if target < 0:  # the ring is empty: nobody to give them to
                continue
            store = self.stores[target]
            assert store is not None, "a key moved to a node that is not a member"
            taken += store.import_(group, now, self.rules_by_name)
        return taken

    def _state_of(self, epoch: Epoch, rule: Rule, key: int) -> Any:
        owner = epoch.owners[key]
        store = self.stores[owner] if owner >= 0 else None
        return None if store is None else store.table(rule).states.get(key)

    def apply(self, info: ChangeInfo, before: Epoch, after: Epoch) -> dict[str, Any]:
        kind = info.change.kind
        node = info.node_index
        now = info.at
        policy = self.policy[kind]
        # Keys that move between nodes that stay up follow the rebalance policy;
        # on a crash that only happens with unequal weights (ketama re-shares points).
        move_policy = self.policy["leave"] if kind == "crash" else policy
        action: dict[str, Any] = {
            "policy": policy,
            "states_transferred": 0,
            "states_dropped": 0,
            "states_lost": 0,
        }
        if info.change.cause == "return":
            self._returning(node, before, now, action)
        carried = self._untouched_moving(before, after, node if kind == "crash" else None, now)
        if kind == "join":
            self.stores[node] = MemoryStore()
        elif kind == "crash":
            lost = self.stores[node]
            assert lost is not None
            action["states_lost"] = len(lost)  # swept at the epoch end: all live
            if info.change.cause == "probe":
                # Removed while paused: its process, and what it holds, lives on.
                self.away[node] = lost
            self.stores[node] = None
        new_owner = after.owner_list()
        for n in before.alive:
            store = self.stores[n]
            if store is None:  # the crashed node
                continue

            def leaving(key: Any, n: int = n) -> bool:
                return new_owner[key] != n

            records = store.export(now, leaving, remove=True)
            if move_policy == "handoff":
                action["states_transferred"] += self._import_grouped(records, new_owner, now)
            else:
                action["states_dropped"] += len(records)
        if kind == "leave":
            self.stores[node] = None
        for exhaustion, keys in carried:
            for key in keys:
                state = self._state_of(after, exhaustion.rule, key)
                if state is None:
                    del exhaustion.keys[key]
                else:
                    exhaustion.keys[key] = state
        if kind == "crash":
            self.on_crash(info, before, after, action)
        self.after_change(info, before, after, action)
        return action

    def _returning(self, node: int, current: Epoch, now: float, action: dict[str, Any]) -> None:
        """A member removed while paused is back: before it rejoins, what it held goes
        to the keys' current owners, merged keeping the more restrictive state
        (``MemoryStore.import_``), as ``node/shard.py`` ``_hand_back`` does; or,
        with ``modes.returning = "discard"`` (the node before the change), away."""
        held = self.away.pop(node, None)
        records = [] if held is None else held.export(now, remove=True)
        action["states_handed_back"] = 0
        action["states_discarded"] = 0
        if self.policy["return"] != "hand_back" or not current.alive:
            action["states_discarded"] = len(records)
            return
        owners = current.owner_list()
        action["states_handed_back"] = self._import_grouped(records, owners, now)
        # A key whose state the merge replaced holds a real state now, not the
        # conservative placeholder: it must outlive the placeholder's ``until``.
        keys = {record[2] for record in records}
        for exhaustion in self.exhaustions:
            for key in keys & exhaustion.keys.keys():
                if self._state_of(current, exhaustion.rule, key) is not exhaustion.keys[key]:
                    del exhaustion.keys[key]

    def _prune_asked(self, exhaustion: _Exhaustion, now: float) -> None:
        """Forget the keys asked about before ``now``: their state is a normal one now."""
        upto = int(np.searchsorted(self.times, now, side="left"))
        if upto > exhaustion.seen:
            asked = np.unique(self.users[exhaustion.seen : upto]).tolist()
            exhaustion.seen = upto
            keys = exhaustion.keys
            for key in asked:
                if keys.pop(key, None) is not None:
                    exhaustion.used += 1

    def _untouched_moving(
        self, before: Epoch, after: Epoch, crashed: int | None, now: float
    ) -> list[tuple[_Exhaustion, list[int]]]:
        """Still-exhausted keys that this change moves, so that the marks follow them."""
        carried = []
        for exhaustion in self.exhaustions:
            self._prune_asked(exhaustion, now)
            keys = []
            for key in list(exhaustion.keys):
                if before.owners[key] == after.owners[key]:
                    continue
                if before.owners[key] == crashed:
                    del exhaustion.keys[key]  # lost with the node
                else:
                    keys.append(key)
            carried.append((exhaustion, keys))
        return carried

    def on_crash(
        self, info: ChangeInfo, before: Epoch, after: Epoch, action: dict[str, Any]
    ) -> None:
        policy = self.policy["crash"]
        if policy == "reset":
            return
        if policy != "conservative":
            raise AssertionError(f"{self.name}: no crash policy {policy!r}")
        affected = np.flatnonzero(before.owners == info.node_index)
        targets = after.owners[affected]
        groups = [
            (target, affected[targets == target].tolist()) for target in np.unique(targets).tolist()
        ]
        action["conservative_keys"] = int(affected.size)
        action["conservative_used"] = 0
        for rule in self.rules:
            # The node's own starting state, and when it is fresh again.
            state, fresh_at = exhausted(rule, info.at)
            for target, keys in groups:
                if target < 0:  # the ring is empty: nobody owns them
                    continue
                store = self.stores[target]
                assert store is not None
                states = store.table(rule).states
                for key in keys:
                    # The node exhausts only keys it holds no state for.
                    if states.get(key) is None:
                        states[key] = state
            exhaustion = _Exhaustion(
                rule,
                info.at,
                fresh_at,
                {k: state for k in affected.tolist() if self._state_of(after, rule, k) is state},
                action,
                seen=int(np.searchsorted(self.times, info.at, side="left")),
            )
            self.exhaustions.append(exhaustion)
            self.at(exhaustion.until, self._expiry(exhaustion))

    def _expiry(self, exhaustion: _Exhaustion) -> Callable[[float, Epoch], None]:
        return lambda now, epoch: self._expire(exhaustion, now, epoch)

    def _expire(self, exhaustion: _Exhaustion, now: float, epoch: Epoch) -> None:
        """The exhausted state is fresh: keys nobody asked about since the crash are too."""
        if exhaustion not in self.exhaustions:
            return
        self.exhaustions.remove(exhaustion)
        self._prune_asked(exhaustion, exhaustion.until)
        for key, state in exhaustion.keys.items():
            owner = epoch.owners[key]
            store = self.stores[owner] if owner >= 0 else None
            if store is None:
                continue
            states = store.table(exhaustion.rule).states
            if states.get(key) is state:
                del states[key]
        if exhaustion.rule is self.rules[0]:
            exhaustion.action["conservative_used"] = exhaustion.used

    def after_change(
        self, info: ChangeInfo, before: Epoch, after: Epoch, action: dict[str, Any]
    ) -> None:
        return None


class ReplicaMode(StickyMode):
    """Sticky, plus each node streams changed states to each key's ring successor.

    Every ``replication_interval`` (virtual time, ticks at multiples of it
    from the clock start) each node sends the states changed since the last
    tick to the key's successor (``RingView.successors(key, 2)[1]``), in the
    handoff wire format, where they replace the previous replica. On a crash
    the new owner of each of the crashed node's keys promotes the replica it
    holds, if it holds one (``export``/``import_``); updates made since the
    last tick are lost, so the excess is bounded by what was admitted in one
    interval. A tick due exactly at a change runs after it (the worst case).
    After every membership change each holder drops the replicas it is no
    longer the successor for, and every node re-sends all its states at the
    next tick (a full resync), as the node does.
    """

    def __init__(
        self,
        timeline: Timeline,
        arrivals: Arrivals,
        progress: Callable[[int], None] | None = None,
        full: bool = False,
    ) -> None:
        super().__init__("replica", timeline, arrivals, progress, full)
        self.interval = self.scenario.replication_interval
        self.tick = 0
        self.replicas: list[MemoryStore | None] = [None] * self.n_slots
        self.dirty = [set() for _ in range(self.n_slots)]
        self._succ: dict[int, list[int]] = {}

    def setup(self, epoch: Epoch) -> None:
        super().setup(epoch)
        for n in epoch.alive:
            self.replicas[n] = MemoryStore()
        self._next_tick()

    def _next_tick(self) -> None:
        self.tick += 1
        self.at(self.scenario.clock_start + self.tick * self.interval, self._on_tick)

    def _on_tick(self, now: float, epoch: Epoch) -> None:
        self.flush(now, epoch)
        self._next_tick()

    def successor(self, epoch: Epoch, key: int) -> int:
        """Node index of ``key``'s successor at ``epoch`` (-1 with a single member)."""
        cache = self._succ.get(epoch.index)
        if cache is None:
            cache = self._succ[epoch.index] = [-2] * len(self.timeline.names)
        found = cache[key]
        if found == -2:
            members = epoch.view.successors(self.timeline.names[key], 2)
            found = self.node_index[members[1].id] if len(members) > 1 else -1
            cache[key] = found
        return found

    def flush(self, now: float, epoch: Epoch) -> None:
        """One replication tick: send every changed state to its key's successor."""
        assert self.dirty is not None
        for n in epoch.alive:
            changed = self.dirty[n]
            if not changed:
                continue
            if self.outages and self.timeline.paused(n, now):
                continue  # a stopped process sends nothing: it catches up when it runs
            store = self.stores[n]
            assert store is not None
            for rule in self.rules:
                table = store.table(rule)
                states: dict[Any, Any] = table.states
                to_rel, from_rel = table.algorithm.to_relative, table.algorithm.from_relative
                targets = [None if r is None else r.table(rule).states for r in self.replicas]
                for key in changed:
                    state = states.get(key)
                    if state is None:
                        continue
                    succ = self.successor(epoch, key)
                    if succ < 0:
                        continue
                    targets[succ][key] = from_rel(to_rel(state, now), now)  # type: ignore[index]
            changed.clear()

    def snapshot(self, epoch: Epoch) -> None:
        super().snapshot(epoch)
        for replica in self.replicas:
            if replica is not None:
                replica.sweep(epoch.end, budget=None)

    def on_crash(
        self, info: ChangeInfo, before: Epoch, after: Epoch, action: dict[str, Any]
    ) -> None:
        crashed = info.node_index
        now = info.at
        old_owner = before.owner_list()
        new_owner = after.owner_list()
        promoted = 0
        for holder in after.alive:
            replica = self.replicas[holder]
            if replica is None:
                continue

            def mine(key: Any, holder: int = holder) -> bool:
                return old_owner[key] == crashed and new_owner[key] == holder

            records = replica.export(now, mine, remove=True)
            promoted += self._import_grouped(records, new_owner, now)
        action["replicas_promoted"] = promoted
        self.replicas[crashed] = None
        assert self.dirty is not None
        self.dirty[crashed] = set()

    def after_change(
        self, info: ChangeInfo, before: Epoch, after: Epoch, action: dict[str, Any]
    ) -> None:
        node = info.node_index
        assert self.dirty is not None
        if info.change.kind == "join":
            self.replicas[node] = MemoryStore()
        else:
            self.replicas[node] = None
            self.dirty[node] = set()
        for holder in after.alive:
            replica = self.replicas[holder]
            assert replica is not None
            for rule in self.rules:
                held: dict[Any, Any] = replica.table(rule).states
                stale = [k for k in held if self.successor(after, k) != holder]
                for k in stale:
                    del held[k]
        for n in after.alive:
            store = self.stores[n]
            assert store is not None
            self.dirty[n] = cast(set[int], store.keys())


def make_mode(
    mode: str,
    timeline: Timeline,
    arrivals: Arrivals,
    progress: Callable[[int], None] | None = None,
    full: bool = False,
) -> _Mode:
    if mode == "global":
        return GlobalMode(timeline, arrivals, progress)
    if mode == "round_robin":
        return RoundRobinMode(timeline, arrivals, progress)
    if mode == "replica":
        return ReplicaMode(timeline, arrivals, progress, full)
    if mode in ("handoff", "reset", "conservative"):
        return StickyMode(mode, timeline, arrivals, progress, full)
    raise ValueError(f"unknown mode {mode!r}")


def decisions_needed(mode: str, timeline: Timeline, arrivals: Arrivals, full: bool) -> int:
    """How many arrivals ``mode`` will decide (for progress bars)."""
    if full or mode in ("global", "round_robin"):
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
    )
