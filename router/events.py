"""The router's recent membership events, for operators (the ring page).

A bounded log: the last ``limit`` changes of the ring, each with the epoch
it made, so memory stays constant however long the router runs. Events are
derived from the views themselves (who is in the new view and not in the
old one, and the reverse), so every path that changes the ring (admin calls,
health checks, a view adopted from a node) is recorded the same way.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

from ring import RingView

DEFAULT_LIMIT = 100


class Event(NamedTuple):
    at: float
    epoch: int
    kind: str  # joined | left | crashed | replaced | recovered
    #: The member; for ``recovered``, every member of the view, comma-separated.
    node: str

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "epoch": self.epoch, "kind": self.kind, "node": self.node}


class EventLog:
    def __init__(self, limit: int = DEFAULT_LIMIT, clock: Callable[[], float] = time.time) -> None:
        self.events: deque[Event] = deque(maxlen=limit)
        self.clock = clock

    def change(self, old: RingView, new: RingView, crashed: Collection[str] = ()) -> None:
        """Record what turned ``old`` into ``new``; ``crashed`` names the members
        that were removed as crashed (any other member that is gone left)."""
        at = self.clock()
        before = {m.id: m for m in old}
        after = {m.id: m for m in new}
        for member_id in sorted(after.keys() - before.keys()):
            self.events.append(Event(at, new.epoch, "joined", member_id))
        for member_id in sorted(before.keys() - after.keys()):
            kind = "crashed" if member_id in crashed else "left"
            self.events.append(Event(at, new.epoch, kind, member_id))
        for member_id in sorted(before.keys() & after.keys()):
            if before[member_id] != after[member_id]:  # a new url or weight
                self.events.append(Event(at, new.epoch, "replaced", member_id))

    def recovered(self, view: RingView) -> None:
        """The router started with a ring it did not make (its state file, or the
        nodes' newest view): nothing changed, but an operator wants to know."""
        self.events.append(Event(self.clock(), view.epoch, "recovered", ", ".join(view.ids)))

    def mirror(self, events: list[dict[str, Any]]) -> None:
        """Take another router's events as they are (a follower shows the leading
        router's, so every worker behind one port reports the same history);
        entries that are not events are skipped."""
        taken: list[Event] = []
        for e in events:
            try:
                at, epoch, kind, node = e["at"], e["epoch"], e["kind"], e["node"]
            except (KeyError, TypeError):
                continue
            fields_ok = isinstance(at, int | float) and isinstance(epoch, int)
            if fields_ok and isinstance(kind, str) and isinstance(node, str):
                taken.append(Event(float(at), epoch, kind, node))
        if taken != list(self.events):
            self.events.clear()
            self.events.extend(taken)

    def crashed(self, epoch: int, ids: Collection[str]) -> None:
        """The members ``ids`` removed at ``epoch`` were removed as crashed: a view
        learnt without its crash list (from a node) recorded them as ``left``."""
        for i, e in enumerate(self.events):
            if e.epoch == epoch and e.kind == "left" and e.node in ids:
                self.events[i] = e._replace(kind="crashed")

    def last(self, n: int) -> list[Event]:
        """The ``n`` newest events, newest first."""
        return list(reversed(self.events))[:n]
