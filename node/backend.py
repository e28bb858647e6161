"""Where a node's decisions are made: its own memory, or a shared Redis.

The node's HTTP layer only sees :class:`Backend`; the in-memory backend wraps
:class:`~node.store.MemoryStore` with a clock, and the Redis backend
(``node.redis_backend``) runs the same algorithms as Lua scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from node.clock import Clock
from node.decision import Verdict
from node.rules import Rule
from node.store import MemoryStore

#: One check of a batch: (key, rules, cost).
Check = tuple[str, Sequence[Rule], int]


class Backend(Protocol):
    """Decides checks. ``available`` is False while the backend cannot decide."""

    name: str

    @property
    def available(self) -> bool: ...

    async def check(self, key: str, rules: Sequence[Rule], cost: int) -> Verdict: ...

    async def check_many(self, checks: Sequence[Check]) -> list[Verdict]: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


class MemoryBackend:
    """The default: decisions in this process's memory, no network hop."""

    name = "memory"

    def __init__(self, store: MemoryStore, clock: Clock) -> None:
        self.store = store
        self.clock = clock

    @property
    def available(self) -> bool:
        return True

    async def check(self, key: str, rules: Sequence[Rule], cost: int) -> Verdict:
        return self.store.check(key, rules, self.clock(), cost)

    async def check_many(self, checks: Sequence[Check]) -> list[Verdict]:
        return self.store.check_many(checks, self.clock())

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None
