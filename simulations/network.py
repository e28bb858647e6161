"""A simulated network between the simulated nodes' protocol cores.

Messages are the core's own (``node.shardcore.Transfer``,
``ReplicaBatch``): plain data, passed by reference. The network delays them
(``delay`` seconds of virtual time), drops them (``drop``, a predicate) and
partitions members from each other (:meth:`SimNetwork.cut`). A message that
cannot arrive is reported back to its sender as lost, as a real node learns
from a POST that failed after its retries.

With no delay, a message is delivered at once, inside the event that sent
it: the best case, in which a membership change completes at its instant.

A scenario's ``[network]`` table (:func:`from_spec`) adds per-message jitter,
a loss probability and timed partitions (:meth:`SimNetwork.split`); a paused
node is cut off from everyone while its process is stopped. Random draws
are a hash of the seed and the message's identity (sender, receiver, kind,
send time), not a stream: a mode that decides only some arrivals sends
fewer messages, and the ones it does send must meet the same fate.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scenario import NetworkSpec

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
    #: each message takes ``delay`` plus up to ``jitter`` more (drawn per message)
    jitter: float = 0.0
    #: probability that a message is lost (drawn per message)
    loss: float = 0.0
    seed: int = 0
    #: ``(start, end, groups)``: see :meth:`split`
    splits: list[tuple[float, float, tuple[frozenset[str], ...]]] = field(default_factory=list)
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

    def split(self, start: float, end: float, groups: list[frozenset[str]]) -> None:
        """Over ``[start, end)``, members of different ``groups`` cannot reach each
        other; the ids no group names form one more group."""
        self.splits.append((start, end, tuple(groups)))

    def reachable(self, sender: str, receiver: str, now: float | None = None) -> bool:
        """Whether a message can pass now (``now`` None: ignore timed splits)."""
        if frozenset((sender, receiver)) in self.partitions:
            return False
        if now is None:
            return True
        for start, end, groups in self.splits:
            if start <= now < end and _group(groups, sender) != _group(groups, receiver):
                return False
        return True

    def draw(self, what: str, sender: str, receiver: str, message: Any, now: float) -> float:
        """A uniform number in [0, 1) that depends only on the message's identity."""
        text = f"{self.seed}|{what}|{sender}|{receiver}|{type(message).__name__}|{now!r}"
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return float(struct.unpack(">Q", digest)[0] >> 11) / float(1 << 53)

    def _lost(self, sender: str, receiver: str, message: Any, sent: float, now: float) -> bool:
        if not self.reachable(sender, receiver, sent) or not self.reachable(sender, receiver, now):
            return True
        if self.loss > 0 and self.draw("loss", sender, receiver, message, sent) < self.loss:
            return True
        return self.drop is not None and self.drop(sender, receiver, message)

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
            if self._lost(sender, receiver, message, now, when):
                self.lost += 1
                lost(when)
            else:
                arrive(when)

        delay = self.delay
        if self.jitter > 0:
            delay += self.jitter * self.draw("jitter", sender, receiver, message, now)
        if delay <= 0:
            land(now)
        else:
            assert self.schedule is not None, "a delayed network needs a schedule"
            self._flying.setdefault((sender, receiver), []).append(land)
            self.schedule(now + delay, lambda when, _epoch: land(when))

    def hurry(self, sender: str, receiver: str, now: float) -> None:
        """Let every message from ``sender`` to ``receiver`` land now.

        A request that waits for a transfer in flight (the node's puller does)
        is answered after it lands: the simulation has no request latency, so
        it lands the transfer first instead.
        """
        for land in list(self._flying.get((sender, receiver), [])):
            land(now)


def _group(groups: tuple[frozenset[str], ...], member: str) -> int:
    for i, group in enumerate(groups):
        if member in group:
            return i
    return -1


def from_spec(spec: NetworkSpec | None, seed: int, clock_start: float) -> SimNetwork:
    """The network a scenario's ``[network]`` table describes (None: instant, lossless)."""
    if spec is None:
        return SimNetwork()
    network = SimNetwork(delay=spec.delay, jitter=spec.jitter, loss=spec.loss, seed=seed)
    for partition in spec.partitions:
        network.split(
            clock_start + partition.at,
            clock_start + partition.until,
            [frozenset(group) for group in partition.groups],
        )
    return network
