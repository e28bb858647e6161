"""Round-robin over a shared backend's nodes, past a node that cannot be reached.

In round-robin mode (Redis: every node decides every key against the same
counters) the node a request goes to is a choice, not the key's owner. A node
that cannot be connected to (killed, its host down) decided nothing, so the
request may go to the next one; and until the health loop removes the node
(``--failure-threshold`` probes), the requests after it skip it rather than each
meet the refused connection. Before, each request picked for a dead node was
answered by its rule's ``on_error`` while the other nodes and Redis were well:
an open rule admitted them uncounted (14 admissions on a limit of 5 in the
exploratory run), a closed one answered 503.

Passing over a node that cannot be reached is no ring change: it has its own
bound (:class:`Search`), not the ``MAX_ATTEMPTS`` sends of a request nodes refuse
while the ring changes (router/forward.py). It used those: a request whose turn
met eight dead nodes in a row was answered ``503 ring_changing`` while a ninth
node and Redis were well, and with every node dead the rules' ``on_error`` never
answered.

Sticky routing has no such choice (the owner holds the key's state) and never
comes here.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence

from ring import Member

#: Seconds a node that could not be reached is skipped; then a request tries it again.
SKIP_FOR = 2.0
#: Seconds a request's search past such nodes may last (the router passes its
#: refusal time, ``Timeouts.refusals``).
SEARCH_FOR = 5.0


class Rotation:
    """The next member in turn, skipping those that just failed to connect."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        skip_for: float = SKIP_FOR,
        search_for: float = SEARCH_FOR,
    ) -> None:
        self.clock = clock
        self.skip_for = skip_for
        self.search_for = search_for
        self._turn = itertools.count()
        #: Member id -> until when it is skipped (a few entries at most: members).
        self._down: dict[str, float] = {}

    def search(self) -> Search:
        """A request's search for a node it can reach, from its first that could not
        be: each member once, for at most :attr:`search_for` seconds (the router's
        refusal time). Not less: each node passed over costs a connect timeout and a look
        for a newer view among the others (0.5 s each by default, on hosts that
        are down rather than refusing), and one second from the first failure
        ended the search after two such nodes, with healthy ones left untried."""
        return Search(self.clock, self.search_for)

    def skipped(self, member: Member) -> bool:
        """Whether ``member`` could not be reached a moment ago (it is being skipped)."""
        until = self._down.get(member.id)
        return until is not None and self.clock() < until

    def next(self, members: Sequence[Member]) -> Member:
        member = members[next(self._turn) % len(members)]
        if self._down and member.id in self._down:  # nothing more while all is well
            return self._past_down(members, member)
        return member

    def failed(self, member: Member, members: Sequence[Member]) -> bool:
        """``member`` could not be reached: skip it for :attr:`skip_for` seconds.
        True if another of ``members`` may take the request (one not skipped)."""
        self._forget_expired()
        self._down[member.id] = self.clock() + self.skip_for
        return any(m.id not in self._down for m in members)

    def _past_down(self, members: Sequence[Member], member: Member) -> Member:
        self._forget_expired()
        if member.id not in self._down:
            return member
        start = members.index(member)
        for step in range(1, len(members)):
            other = members[(start + step) % len(members)]
            if other.id not in self._down:
                return other
        return member  # every member skipped: as picked (its failure answers)

    def _forget_expired(self) -> None:
        now = self.clock()
        for member_id in [m for m, until in self._down.items() if until <= now]:
            del self._down[member_id]


class Search:
    """One request's way past nodes that cannot be reached: at most one pass per
    member, within ``budget`` seconds of the first. Worst case, the budget plus one
    connect timeout (a try that began just before it ran out)."""

    __slots__ = ("budget", "clock", "ends", "passed")

    def __init__(self, clock: Callable[[], float], budget: float) -> None:
        self.clock = clock
        self.budget = budget
        self.passed = 0
        self.ends: float | None = None

    def again(self, members: int) -> bool:
        """A node could not be reached and another of ``members`` is not skipped
        (:meth:`Rotation.failed` said so): may the request try it? Else its rules'
        ``on_error`` answers."""
        now = self.clock()
        if self.ends is None:
            self.ends = now + self.budget
        self.passed += 1
        return self.passed < members and now < self.ends

    def over(self) -> bool:
        """Whether the search has run out of time (never, before it began)."""
        return self.ends is not None and self.clock() >= self.ends
