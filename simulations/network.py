"""A simulated network between the simulated nodes' protocol cores.

Messages are the core's own (``node.shardcore.Transfer``,
``ReplicaBatch``): plain data, passed by reference. The network delays them
(``delay`` seconds of virtual time), drops them (``drop``, a predicate) and
partitions members from each other (:meth:`SimNetwork.cut`). A message that
cannot arrive is reported back to its sender as lost, as a real node learns
from a POST that failed after its retries.

With no delay, a message is delivered at once, inside the event that sent
it: the best case, in which a membership change completes at its instant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: A message and what to do with it: ``arrive(now)`` on delivery, ``lost(now)`` if
#: it cannot arrive.
Handler = Callable[[float], None]
Schedule = Callable[[float, Callable[[float, Any], None]], None]


@dataclass
class SimNetwork:
    """Delivers messages between member ids on a virtual clock."""

    delay: float = 0.0
    #: ``drop(sender, receiver, message)``: True to lose this message.
    drop: Callable[[str, str, Any], bool] | None = None
    partitions: set[frozenset[str]] = field(default_factory=set)
    sent: int = 0
    lost: int = 0
    #: messages on their way, by (sender, receiver): see :meth:`hurry`
    _flying: dict[tuple[str, str], list[Handler]] = field(default_factory=dict)
    #: ``schedule(when, callback)``: run ``callback(when, ...)`` at virtual time ``when``
    #: (the mode that runs the cores sets it: ``Mode.at``).
    schedule: Schedule | None = None

    def cut(self, a: str, b: str) -> None:
        """``a`` and ``b`` can no longer reach each other (both ways)."""
        self.partitions.add(frozenset((a, b)))

    def heal(self, a: str, b: str) -> None:
        self.partitions.discard(frozenset((a, b)))

    def reachable(self, sender: str, receiver: str) -> bool:
        return frozenset((sender, receiver)) not in self.partitions

    def send(
        self,
        sender: str,
        receiver: str,
        message: Any,
        now: float,
        arrive: Handler,
        lost: Handler,
    ) -> None:
        """Send ``message``; ``arrive`` or ``lost`` runs when its fate is known."""
        self.sent += 1
        done = False

        def land(when: float) -> None:
            nonlocal done
            if done:
                return
            done = True
            flying = self._flying.get((sender, receiver))
            if flying is not None and land in flying:
                flying.remove(land)
                if not flying:
                    del self._flying[(sender, receiver)]
            if not self.reachable(sender, receiver) or (
                self.drop is not None and self.drop(sender, receiver, message)
            ):
                self.lost += 1
                lost(when)
            else:
                arrive(when)

        if self.delay <= 0:
            land(now)
        else:
            assert self.schedule is not None, "a delayed network needs a schedule"
            self._flying.setdefault((sender, receiver), []).append(land)
            self.schedule(now + self.delay, lambda when, _epoch: land(when))

    def hurry(self, sender: str, receiver: str, now: float) -> None:
        """Let every message from ``sender`` to ``receiver`` land now.

        A request that waits for a transfer in flight (the node's puller does)
        is answered after it lands: the simulation has no request latency, so
        it lands the transfer first instead.
        """
        for land in list(self._flying.get((sender, receiver), [])):
            land(now)
