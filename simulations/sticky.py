"""The sticky modes, running the node's own protocol core on the virtual clock.

Each simulated node is a :class:`node.shardcore.ShardCore`, the same state
machine the node process drives (node/shard.py): the simulation pushes each
ring change to the cores as the router pushes views, carries the messages
the cores emit (handoff transfers with their final marks, forwarded states,
replica batches) through a :class:`simulations.network.SimNetwork`, and
decides each arrival on the owning core's store with the engine's own
algorithms (the hot loops of :mod:`simulations.modes`). So the handoff, the
crash policies (``reset``, ``conservative``, ``replica``), the replica
streams and the hand-back of a member that returns after a pause are the
node's code, not a re-implementation of it.

Each mode is one cluster configuration (``policies.rebalance`` and
``policies.crash``):

=============  =========  ==========================================
mode           rebalance  crash
=============  =========  ==========================================
handoff        handoff    ``modes.handoff_crash_policy`` (reset)
reset          reset      reset
conservative   handoff    conservative
replica        handoff    replica (a replica round every ``modes.replication_interval``)
=============  =========  ==========================================

The network is the scenario's ``[network]`` table (:func:`simulations.network.from_spec`):
delay, jitter, loss and timed partitions; a paused node is cut off from
everyone while its process is stopped.

What is simulated rather than run: the router (it pushes each view to every
member at the change's instant, the members that lose keys first), the
lease (a paused member's keys are answered per ``on_error`` for the outage
``Timeline.outages`` computes) and a pull's wait: a new owner that must pull
a key asks the previous owner at once and decides on what it gets (a
transfer still in flight is delivered first; an unreachable owner or one
that has not seen the view yet gives nothing). With the default network (no
delay, no loss) every change completes at its instant, and no pull happens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np

from node.config import ClusterConfig, Policies, ScopedRule
from node.shardcore import (
    InFlight,
    Pull,
    ReplicaBatch,
    ShardCore,
    StaleEpoch,
    Transfer,
)
from node.store import MemoryStore
from ring import EmptyRingError, RingView

from .arrivals import Arrivals
from .modes import Mode, ModeResult
from .network import SimNetwork, from_spec
from .timeline import ChangeInfo, Epoch, Timeline


class IndexedView(RingView):
    """A ring view whose keys are the simulation's user indices.

    The timeline has already looked every user's owner up (one md5 per user
    per epoch, ``Epoch.owners``); the core asks this view, which answers from
    that table. ``successors`` (replica targets) hashes the user's name, as
    the node does.
    """

    @classmethod
    def of_epoch(cls, epoch: Epoch, timeline: Timeline) -> IndexedView:
        view = cls(epoch.view.epoch, epoch.view.members)
        object.__setattr__(view, "_owner_index", epoch.owner_list())
        object.__setattr__(view, "_node_ids", timeline.node_ids)
        object.__setattr__(view, "_names", timeline.names)
        return view

    def owner_id(self, key: Any) -> str:
        owner: int = self._owner_index[key]  # type: ignore[attr-defined]
        if owner < 0:
            raise EmptyRingError(f"cannot place a key: ring at epoch {self.epoch} is empty")
        return self._node_ids[owner]  # type: ignore[attr-defined,no-any-return]

    def successors(self, key: Any, n: int) -> list[Any]:
        return super().successors(self._names[key], n)  # type: ignore[attr-defined]


def mode_config(name: str, rules: Sequence[Any], handoff_crash_policy: str) -> ClusterConfig:
    """The cluster configuration a sticky mode runs the nodes with."""
    rebalance, crash = {
        "handoff": ("handoff", handoff_crash_policy),
        "reset": ("reset", "reset"),
        "conservative": ("handoff", "conservative"),
        "replica": ("handoff", "replica"),
    }[name]
    return ClusterConfig(
        rules=tuple(ScopedRule(rule) for rule in rules),
        policies=Policies(rebalance=rebalance, crash=crash),
    )


class StickyMode(Mode):
    """Each user is decided by the ring owner of its key, each node a protocol core.

    ``network``: the scenario's (``[network]``, with paused nodes cut off
    while stopped) when None; one given is used as it is (tests).
    """

    def __init__(
        self,
        name: str,
        timeline: Timeline,
        arrivals: Arrivals,
        progress: Callable[[int], None] | None = None,
        full: bool = False,
        network: SimNetwork | None = None,
    ) -> None:
        self.name = name
        index = None if full else np.flatnonzero(timeline.affected[arrivals.users])
        super().__init__(timeline, arrivals, progress, index)
        self.node_index = {node_id: i for i, node_id in enumerate(timeline.node_ids)}
        self.count_in_loop = False
        scenario = self.scenario
        config = mode_config(name, self.rules, scenario.handoff_crash_policy)
        self.config = config
        self.replicating = name == "replica"
        self.views: dict[int, IndexedView] = {}
        self.cores: list[ShardCore | None] = [None] * self.n_slots
        #: cores of members removed on probes while paused: their process lives on
        self.away: dict[int, ShardCore] = {}
        #: cores of members that left gracefully: a leaving process serves pulls
        #: until its handoff is done (the last one stays until the next change)
        self.leaving: dict[int, ShardCore] = {}
        if network is None:
            network = from_spec(scenario.network, scenario.seed, scenario.clock_start)
            self._cut_paused(network)
        self.network = network
        self.network.schedule = self.at
        #: every core this run made (crashed ones too): for the network's counters
        self.all_cores: list[ShardCore] = []
        #: the action of each crash the conservative policy answers for, by crash
        self.crash_actions: dict[tuple[int, frozenset[str]], dict[str, Any]] = {}
        self.tick = 0

    def _cut_paused(self, network: SimNetwork) -> None:
        """A paused process sends and receives nothing: cut it off while it is stopped.

        (A node a partition cut off from the router is paused only for the
        router: the network's own split already says whom it can reach.)
        """
        detection = self.timeline.detection
        if detection is None:
            return
        start = self.scenario.clock_start
        for outage in detection.outages:
            if outage.source >= 0:
                network.split(start + outage.start, start + outage.end, [frozenset((outage.node,))])

    def run(self) -> ModeResult:
        result = super().run()
        if self.scenario.network is not None:
            stats = [c.stats for c in self.all_cores]
            result.network = {
                "messages_sent": self.network.sent,
                "messages_lost": self.network.lost,
                "pulls": sum(s.pulls for s in stats),
                "pull_failures": sum(s.pull_failures for s in stats),
            }
        return result

    # -- the cores -----------------------------------------------------------

    def view(self, epoch: Epoch) -> IndexedView:
        view = self.views.get(epoch.index)
        if view is None:
            view = self.views[epoch.index] = IndexedView.of_epoch(epoch, self.timeline)
        return view

    def _new_core(self, node: int) -> ShardCore:
        config = self.config
        core = ShardCore(self.timeline.node_ids[node], MemoryStore(), lambda: config)
        self.all_cores.append(core)
        self.cores[node] = core
        self.stores[node] = core.store
        return core

    def _core_of(self, node_id: str) -> ShardCore | None:
        node = self.node_index.get(node_id)
        return None if node is None else self.cores[node]

    def setup(self, epoch: Epoch) -> None:
        view = self.view(epoch)
        for n in epoch.alive:
            core = self._new_core(n)
            core.apply(view, None, (), self.scenario.clock_start, self.scenario.clock_start)
        if self.replicating:
            self._next_tick()

    # -- messages --------------------------------------------------------------

    def send(
        self, core: ShardCore, transfers: list[Transfer], credit: dict[str, Any], field: str
    ) -> None:
        for transfer in transfers:
            self._send_transfer(core, transfer, credit, field)

    def _send_transfer(
        self, core: ShardCore, transfer: Transfer, credit: dict[str, Any], field: str
    ) -> None:
        def arrive(now: float) -> None:
            target = self._core_of(transfer.to)
            if target is None:  # gone meanwhile: as a failed POST
                core.undelivered(transfer, now)
                return
            received = target.receive(
                transfer.sender,
                transfer.epoch,
                transfer.records,
                transfer.final,
                transfer.crashes,
                now,
            )
            core.delivered(transfer)
            credit[field] = credit.get(field, 0) + received.taken
            self.send(target, received.forwards, credit, field)

        self.network.send(
            transfer.sender,
            transfer.to,
            transfer,
            transfer.sent_at,
            arrive,
            lambda now: core.undelivered(transfer, now),
        )

    def _send_replicas(self, core: ShardCore, batch: ReplicaBatch, now: float) -> None:
        def arrive(when: float) -> None:
            target = self._core_of(batch.to)
            if target is None:
                core.replicas_failed(batch.records)
                return
            target.receive_replicas(batch.sender, batch.records, when)
            core.stats.replicas_sent += len(batch.records)

        self.network.send(
            batch.sender,
            batch.to,
            batch,
            now,
            arrive,
            lambda _: core.replicas_failed(batch.records),
        )

    # -- deciding --------------------------------------------------------------

    def route(self, a: int, b: int, users: np.ndarray, epoch: Epoch) -> np.ndarray:
        return epoch.owners[users]

    def decide_range(self, i0: int, i1: int, epoch: Epoch) -> None:
        if self.replicating:
            # The hot loops mark changed keys in the store's own change set.
            # (Its keys are the user indices: ints, whatever the store's hints say.)
            self.dirty = [
                set() if c is None or c.store.dirty is None else cast(set[int], c.store.dirty)
                for c in self.cores
            ]
        super().decide_range(i0, i1, epoch)

    def guard(self, node: int, now: float) -> Callable[[Any, float], None] | None:
        """The core's step before a decision, when it has one to take."""
        core = self.cores[node]
        if core is None:
            return None
        crashes = any(c.until > now for c in core.crashes)
        if not core.pending and not crashes:
            return None
        rules = self.rules
        first = rules[0]

        def step(key: Any, when: float) -> None:
            if core.pending:
                found = core.inherit(key, rules, core_elapsed(when))
                if isinstance(found, Pull):
                    self._pull(core, found, when)
            if core.crashes:
                had = core.store.get(first, key) is not None
                core.conservative(key, rules, when)
                if not had and core.store.get(first, key) is not None:
                    self._used(core, key, when)

        return step

    def _used(self, core: ShardCore, key: Any, now: float) -> None:
        for crash in core.crashes:
            if crash.until > now and crash.affects(key):
                action = self.crash_actions.get((crash.view.epoch, crash.crashed))
                if action is not None:
                    action["conservative_used"] = action.get("conservative_used", 0) + 1
                return

    def _pull(self, core: ShardCore, pull: Pull, now: float) -> None:
        """Ask the previous owner at once (see the module docstring)."""
        core.start_pull(pull)
        node = self.node_index[pull.owner]
        owner = self.cores[node] or self.leaving.get(node)
        records: list[Any] | None = None
        if owner is not None and self.network.reachable(core.id, pull.owner, now):
            for _ in range(2):
                try:
                    records = owner.serve_pull([pull.key], pull.to, pull.epoch, now)
                    break
                except InFlight:
                    # The request waits for the transfer under way: it lands first.
                    self.network.hurry(pull.owner, core.id, now)
                    continue
                except StaleEpoch:
                    break
        if records is None:
            core.pull_failed(pull)
        else:
            core.take_pulled(records, now)
        core.pull_done(pull)

    # -- replication -----------------------------------------------------------

    def _next_tick(self) -> None:
        self.tick += 1
        interval = self.scenario.replication_interval
        self.at(self.scenario.clock_start + self.tick * interval, self._on_tick)

    def _on_tick(self, now: float, epoch: Epoch) -> None:
        """One replication round on every running member."""
        for n in epoch.alive:
            core = self.cores[n]
            if core is None or (self.outages and self.timeline.paused(n, now)):
                continue  # a stopped process sends nothing: it catches up when it runs
            if core.replication_tick():
                for batch in core.replica_batches(now):
                    self._send_replicas(core, batch, now)
        self._next_tick()

    # -- epochs ----------------------------------------------------------------

    def snapshot(self, epoch: Epoch) -> None:
        super().snapshot(epoch)
        for core in self.cores:
            if core is not None:
                core.sweep_replicas(epoch.end)

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

    # -- membership changes ------------------------------------------------------

    def apply(self, info: ChangeInfo, before: Epoch, after: Epoch) -> dict[str, Any]:
        kind = info.change.kind
        node = info.node_index
        now = info.at
        policy = self.policy[kind]
        action: dict[str, Any] = {
            "policy": policy,
            "states_transferred": 0,
            "states_dropped": 0,
            "states_lost": 0,
        }
        if info.change.cause == "return":
            self._returning(node, before, now, action)
        crashed: tuple[str, ...] = ()
        if kind == "join":
            if self.cores[node] is None:
                self._new_core(node)
        elif kind == "crash":
            lost = self.cores[node]
            assert lost is not None
            action["states_lost"] = len(lost.store)  # swept at the epoch end: all live
            if info.change.cause == "probe":
                # Removed while paused: its process, and what it holds, lives on.
                self.away[node] = lost
            self.cores[node] = None
            self.stores[node] = None
            crashed = (self.timeline.node_ids[node],)
        if kind == "crash" and policy == "conservative":
            action["conservative_keys"] = int((before.owners == node).sum())
            action["conservative_used"] = 0
        view, previous = self.view(after), self.view(before)
        dropped = self._total("keys_dropped")
        promoted = self._total("replicas_promoted")
        # The router pushes to the members that lose keys first, then to the rest.
        members = [n for n in sorted({*before.alive, *after.alive}) if self.cores[n] is not None]
        losers = [n for n in members if n in before.alive]
        for n in [*losers, *(n for n in members if n not in losers)]:
            core = self.cores[n]
            assert core is not None
            core.apply(view, previous, crashed, now, now)
            if kind == "crash" and core.crashes:
                crash = core.crashes[-1]
                self.crash_actions.setdefault((crash.view.epoch, crash.crashed), action)
            self.send(core, core.transfers(now), action, "states_transferred")
        action["states_dropped"] = self._total("keys_dropped") - dropped
        if kind == "crash" and policy == "replica":
            action["replicas_promoted"] = self._total("replicas_promoted") - promoted
        self.leaving.clear()
        if kind == "leave":
            self.leaving[node] = self.cores[node]  # type: ignore[assignment]
            self.cores[node] = None
            self.stores[node] = None
        return action

    def _total(self, stat: str) -> int:
        return sum(getattr(c.stats, stat) for c in self.cores if c is not None)

    def _returning(self, node: int, current: Epoch, now: float, action: dict[str, Any]) -> None:
        """A member removed while paused is back: before it rejoins, it learns of its
        removal and hands what it held back to the keys' current owners (the
        core's hand-back, merged keeping the more restrictive state); or, with
        ``modes.returning = "discard"``, it comes back as a new process."""
        core = self.away.pop(node, None)
        action["states_handed_back"] = 0
        action["states_discarded"] = 0
        if core is None:
            return
        if self.policy["return"] != "hand_back" or not current.alive:
            action["states_discarded"] = len(core.store.export(now))
            return
        dropped = core.stats.keys_dropped
        core.apply(self.view(current), None, (core.id,), now, now)
        action["states_discarded"] = core.stats.keys_dropped - dropped
        self.send(core, core.transfers(now), action, "states_handed_back")
        self.cores[node] = core
        self.stores[node] = core.store


def core_elapsed(now: float) -> float:
    """The simulation's monotonic clock is its virtual clock."""
    return now
