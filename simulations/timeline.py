"""The membership timeline: ring views per epoch and every user's owner.

Built once per run and shared (read-only) by every mode: the ring is the real
``ring.RingView``, and owners are looked up with its public ``owner_id``,
once per user per epoch, into a numpy array. Modes then route a chunk of
requests with one fancy index instead of one md5 per request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ring import Member, RingView

from .arrivals import user_name
from .detection import Detection
from .pool import map_in_workers
from .scenario import Change, Scenario, ScenarioError, expand_with_detection


@dataclass
class Epoch:
    """The ring between two membership changes."""

    index: int
    start: float  # absolute virtual time the epoch starts
    end: float  # absolute virtual time the next change happens (or the run ends)
    view: RingView
    #: node indices of the members, sorted by id (round-robin order)
    alive: list[int]
    #: owners[user] = node index of the ring owner (-1: the ring is empty)
    owners: np.ndarray
    _owner_list: list[int] | None = field(default=None, repr=False)

    def owner_list(self) -> list[int]:
        """``owners`` as a Python list (fast scalar indexing in handoff selectors)."""
        if self._owner_list is None:
            self._owner_list = self.owners.tolist()
        return self._owner_list


@dataclass
class ChangeInfo:
    """A change with what it did to the ring."""

    index: int
    change: Change
    at: float  # absolute virtual time
    node_index: int
    members_before: int
    members_after: int
    keys_moved: int
    moved_fraction: float
    ideal_fraction: float
    ideal_equal: float
    #: moved keys whose new owner is not the joining node / whose old owner is not the
    #: leaving one (non-zero only with unequal weights: ketama re-shares every member's points)
    moved_elsewhere: int


@dataclass
class Timeline:
    scenario: Scenario
    node_ids: list[str]
    names: list[str]
    epochs: list[Epoch]
    changes: list[ChangeInfo]
    #: affected[user]: some change moves the user's key (owner differs between epochs),
    #: or its owner is paused at some time
    affected: np.ndarray
    #: what the router's probes did (None: the scenario has no pauses)
    detection: Detection | None = None
    #: (node index, start, end, until) per paused node, absolute times: the process
    #: is stopped in [start, end), and its keys answered per on_error in [start, until)
    outages: list[tuple[int, float, float, float]] = field(default_factory=list)

    def paused(self, node: int, now: float) -> bool:
        """Whether ``node``'s process is stopped at ``now`` (it sends nothing)."""
        return any(n == node and start <= now < end for n, start, end, _ in self.outages)

    @property
    def change_times(self) -> np.ndarray:
        return np.array([c.at for c in self.changes], dtype=np.float64)

    def node_index(self, node_id: str) -> int:
        return self.node_ids.index(node_id)


def _owners(view: RingView, names: list[str], index: dict[str, int]) -> np.ndarray:
    if not len(view):
        return np.full(len(names), -1, dtype=np.int32)
    owner_id = view.owner_id
    return np.fromiter(
        map(index.__getitem__, map(owner_id, names)), dtype=np.int32, count=len(names)
    )


# Set around map_in_workers: forked workers inherit it.
_SHARED: tuple[list[RingView], list[str], dict[str, int]] | None = None


def _owners_of(i: int) -> np.ndarray:
    assert _SHARED is not None
    views, names, index = _SHARED
    return _owners(views[i], names, index)


def _all_owners(
    views: list[RingView], names: list[str], index: dict[str, int], jobs: int
) -> list[np.ndarray]:
    """Every view's owner array; the views are spread over ``jobs`` forked processes."""
    global _SHARED
    _SHARED = (views, names, index)
    try:
        return map_in_workers(_owners_of, range(len(views)), jobs)
    finally:
        _SHARED = None


def build_timeline(scenario: Scenario, jobs: int = 1) -> Timeline:
    """Views, owners and key movement for every epoch of the run.

    ``jobs`` > 1 looks owners up in that many forked processes (one view each).
    """
    changes, detection = expand_with_detection(
        scenario.outage_events(),
        {n.id: n.weight for n in scenario.nodes},
        scenario.detection,
        scenario.duration,
    )
    node_ids: list[str] = [n.id for n in scenario.nodes]
    for change in changes:
        if change.node not in node_ids:
            node_ids.append(change.node)
    index = {node_id: i for i, node_id in enumerate(node_ids)}
    names = [user_name(i) for i in range(scenario.users.count)]

    def url(node_id: str) -> str:
        return f"sim://{node_id}"

    try:
        view = RingView.of(Member(n.id, url(n.id), n.weight) for n in scenario.nodes)
    except ValueError as exc:
        raise ScenarioError(f"{scenario.source}: cluster: {exc}") from None
    views = [view]
    for change in changes:
        try:
            if change.kind == "join":
                view = view.with_member(Member(change.node, url(change.node), change.weight))
            else:
                view = view.without_member(change.node)
        except (ValueError, KeyError) as exc:
            raise ScenarioError(f"{scenario.source}: events[{change.source}]: {exc}") from None
        views.append(view)
    owners = _all_owners(views, names, index, jobs)

    start = scenario.clock_start
    bounds = [start, *(start + c.at for c in changes), scenario.end]
    epochs = [
        Epoch(i, bounds[i], bounds[i + 1], v, sorted(index[m.id] for m in v), owners[i])
        for i, v in enumerate(views)
    ]
    affected = np.zeros(len(names), dtype=bool)
    infos: list[ChangeInfo] = []
    for i, change in enumerate(changes):
        before, after = views[i], views[i + 1]
        old, new = owners[i], owners[i + 1]
        node = index[change.node]
        moved = old != new
        affected |= moved
        keys_moved = int(moved.sum())
        if change.kind == "join":
            ideal = change.weight / sum(m.weight for m in after)
            ideal_equal = 1.0 / len(after)
            elsewhere = int((moved & (new != node)).sum())
        else:
            ideal = change.weight / sum(m.weight for m in before)
            ideal_equal = 1.0 / len(before)
            elsewhere = int((moved & (old != node)).sum())
        infos.append(
            ChangeInfo(
                index=i,
                change=change,
                at=start + change.at,
                node_index=node,
                members_before=len(before),
                members_after=len(after),
                keys_moved=keys_moved,
                moved_fraction=keys_moved / len(names),
                ideal_fraction=ideal,
                ideal_equal=ideal_equal,
                moved_elsewhere=elsewhere,
            )
        )
    outages: list[tuple[int, float, float, float]] = []
    if detection is not None:
        for outage in detection.outages:
            node = index[outage.node]
            lo, hi = start + outage.start, start + outage.until
            outages.append((node, lo, start + outage.end, hi))
            # Its keys are answered per on_error meanwhile: those users are decided.
            for epoch in epochs:
                if epoch.start < hi and epoch.end > lo:
                    affected |= epoch.owners == node
    return Timeline(scenario, node_ids, names, epochs, infos, affected, detection, outages)
