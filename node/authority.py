"""The one place a node decides: ownership first, then the backend.

The middleware (proxied requests) and the decision API both call
:meth:`Authority.decide`, so the two paths can never disagree.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from node.backend import Backend, MemoryBackend
from node.clock import Clock, system_clock
from node.config import ClusterConfig
from node.decision import Verdict
from node.metrics import NodeMetrics
from node.rules import Rule
from node.shard import Shard
from node.store import MemoryStore


class Authority:
    """Decides for the keys this node owns.

    ``shard`` is present when the node is the single authority for a slice of
    keys (sticky mode); with a shared backend (Redis) any node may decide any
    key and there is no shard.
    """

    def __init__(
        self,
        config: ClusterConfig,
        backend: Backend,
        *,
        shard: Shard | None = None,
        metrics: NodeMetrics | None = None,
        node_id: str = "local",
    ) -> None:
        self.config = config
        self.backend = backend
        self.shard = shard
        self.metrics = metrics
        self.node_id = node_id

    @classmethod
    def in_memory(
        cls, config: ClusterConfig, *, clock: Clock = system_clock, store: MemoryStore | None = None
    ) -> Authority:
        return cls(config, MemoryBackend(store or MemoryStore(), clock))

    async def decide(self, key: str, rules: Sequence[Rule], cost: int = 1) -> Verdict:
        """Raises :class:`node.shard.NotOwner` for a key another node owns."""
        started = time.perf_counter()
        if self.shard is not None:
            await self.shard.admit(key, rules)
        verdict = await self.backend.check(key, rules, cost)
        metrics = self.metrics
        if metrics is not None:
            metrics.observe(time.perf_counter() - started)
            metrics.count(verdict.decision.rule, verdict.allowed)
        return verdict

    async def decide_many(self, checks: Sequence[tuple[str, Sequence[Rule], int]]) -> list[Verdict]:
        started = time.perf_counter()
        shard = self.shard
        if shard is not None:
            waited = False
            for key, rules, _ in checks:
                waited |= await shard.admit(key, rules)
            if waited:
                # A view may have arrived while one key was pulled: every key must
                # still be ours when the batch is decided (no await from here on).
                for key, _, _ in checks:
                    shard.check_owner(key)
        verdicts = await self.backend.check_many(checks)
        metrics = self.metrics
        if metrics is not None:
            metrics.observe(time.perf_counter() - started)
            tally: dict[tuple[str, bool], int] = {}
            for verdict in verdicts:
                outcome = (verdict.decision.rule, verdict.allowed)
                tally[outcome] = tally.get(outcome, 0) + 1
            for (rule, allowed), n in tally.items():
                metrics.count(rule, allowed, n)
        return verdicts
