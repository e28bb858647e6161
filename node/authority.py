"""The one place a node decides: ownership first, then the backend.

The middleware (proxied requests) and the decision API both call
:meth:`Authority.decide`, so the two paths can never disagree.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Collection, Sequence
from operator import itemgetter
from time import perf_counter

from node.backend import Backend, MemoryBackend
from node.clock import Clock, system_clock
from node.config import ClusterConfig
from node.decision import Verdict
from node.metrics import NodeMetrics
from node.rules import Rule
from node.shadow import denied_names, has_shadow, merge, split
from node.shard import Shard
from node.store import MemoryStore
from node.topkeys import NEAR_LIMIT, TopKeys, worth_noting

#: Parts of checks and verdicts by position, for passes that run in C (``map``).
_KEY = itemgetter(0)
_RULES = itemgetter(1)
_ALLOWED = itemgetter(0)
_DECISION = itemgetter(1)
_RULE = itemgetter(5)
_LIMIT = itemgetter(1)
_REMAINING = itemgetter(2)


def _quiet(verdicts: Sequence[Verdict]) -> bool:
    """Whether every verdict of one-rule checks is allowed with more than a tenth
    of its limit left: then :meth:`Authority.decide_many` would pick none of them
    for top keys or shadow metrics. Passes in C (``map``), no Python per check."""
    decisions = list(map(_DECISION, verdicts))
    return (
        bool(decisions)
        and all(map(_ALLOWED, verdicts))
        and all(map(_ALLOWED, decisions))
        and min(map(_REMAINING, decisions)) * NEAR_LIMIT > max(map(_LIMIT, decisions))
    )


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
        top: TopKeys | None = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.shard = shard
        self.metrics = metrics
        self.node_id = node_id
        #: Denied and near-limit keys per rule (node/topkeys.py), when kept.
        self.top = top

    @classmethod
    def in_memory(
        cls, config: ClusterConfig, *, clock: Clock = system_clock, store: MemoryStore | None = None
    ) -> Authority:
        return cls(config, MemoryBackend(store or MemoryStore(), clock))

    def decide_now(self, key: str, rules: Sequence[Rule], cost: int = 1) -> Verdict | None:
        """:meth:`decide` without a coroutine, when nothing has to be awaited.

        That is every proxied request in the common case: the memory backend,
        no shadow rule, no handoff under way into this node (an ``async def``
        chain would cost a coroutine per level for awaits that never suspend).
        Raises as :meth:`decide` does. ``None``: this one must be awaited
        (``await decide(...)``); nothing was decided, counted or changed.
        """
        backend = self.backend
        if type(backend) is not MemoryBackend or (
            rules[0].shadow if len(rules) == 1 else has_shadow(rules)
        ):
            return None
        started = perf_counter()
        shard = self.shard
        if shard is not None and not shard.admit_now(key, rules):
            return None
        verdict = backend.store.check(key, rules, backend.clock(), cost)
        # _decided, inline: no second call on every request's path. No rule here
        # is a shadow rule, so there is no shadow denial to count.
        metrics = self.metrics
        if metrics is not None:
            metrics.decided(verdict[1].rule, verdict[0], perf_counter() - started)
        top = self.top
        if top is not None and cost and worth_noting(verdict):
            top.note(((key, verdict),))
        return verdict

    async def decide(self, key: str, rules: Sequence[Rule], cost: int = 1) -> Verdict:
        """Raises :class:`node.shard.NotOwner` for a key another node owns."""
        verdict = self.decide_now(key, rules, cost)
        if verdict is not None:
            return verdict
        started = perf_counter()
        if self.shard is not None:
            await self.shard.admit(key, rules)
        backend = self.backend
        if rules[0].shadow if len(rules) == 1 else has_shadow(rules):
            verdict = (await self._with_shadow([(key, rules, cost)]))[0]
        elif type(backend) is MemoryBackend:
            # What MemoryBackend.check does, without a coroutine per request.
            verdict = backend.store.check(key, rules, backend.clock(), cost)
        else:
            verdict = await backend.check(key, rules, cost)
        self._decided(key, verdict, cost, started)
        return verdict

    def _decided(self, key: str, verdict: Verdict, cost: int, started: float) -> None:
        """Metrics and top keys of one decision (``started``: ``perf_counter()`` before)."""
        decision = verdict.decision
        metrics = self.metrics
        if metrics is not None:
            metrics.decided(decision.rule, verdict.allowed, perf_counter() - started)
            # A read (cost 0) is not a request a shadow rule would have denied.
            if cost and (not decision.allowed or len(verdict.decisions) > 1):
                for name in denied_names(verdict):
                    metrics.shadow_denied(name)
        top = self.top
        # A read (cost 0) is not a request either.
        if top is not None and cost and worth_noting(verdict):
            top.note(((key, verdict),))

    async def _with_shadow(
        self, checks: Sequence[tuple[str, Sequence[Rule], int]]
    ) -> list[Verdict]:
        """Decide checks that have shadow rules (see node/shadow.py): the enforced
        rules atomically first, then each shadow rule alone, consuming only when
        the request was allowed."""
        parts = [split(tuple(rules)) for _, rules, _ in checks]
        enforced_checks = [
            (key, enforced, cost)
            for (key, _, cost), (enforced, _) in zip(checks, parts, strict=True)
            if enforced
        ]
        enforced_verdicts = iter(await self.backend.check_many(enforced_checks))
        firsts: list[Verdict | None] = [
            next(enforced_verdicts) if enforced else None for enforced, _ in parts
        ]
        shadow_checks = [
            (key, (rule,), cost if first is None or first.allowed else 0)
            for (key, _, cost), (_, shadow), first in zip(checks, parts, firsts, strict=True)
            for rule in shadow
        ]
        shadow_verdicts = iter(await self.backend.check_many(shadow_checks))
        out = []
        for (_, rules, _), (_, shadow), first in zip(checks, parts, firsts, strict=True):
            decisions = [next(shadow_verdicts).decision for _ in shadow]
            out.append(merge(rules, first, decisions))
        return out

    async def decide_many(self, checks: Sequence[tuple[str, Sequence[Rule], int]]) -> list[Verdict]:
        started = time.perf_counter()
        shard = self.shard
        if shard is not None:
            waited = False
            if not shard.admit_many_now(map(_KEY, checks)):
                admit_now = shard.admit_now
                for key, rules, _ in checks:
                    # A coroutine per check only for what must wait (a handoff under way).
                    if not admit_now(key, rules):
                        waited |= await shard.admit(key, rules)
            if waited:
                # A view may have arrived while one key was pulled: every key must
                # still be ours when the batch is decided (no await from here on).
                for key, _, _ in checks:
                    shard.check_owner(key)
        # Batches share a few rule tuples (one, as a rule: C-level passes tell): ask
        # each distinct one once.
        if len(set(map(id, map(_RULES, checks)))) == 1:
            distinct: Collection[Sequence[Rule]] = (checks[0][1],) if checks else ()
        else:
            distinct = {id(c[1]): c[1] for c in checks}.values()
        shadows = any(map(has_shadow, distinct))
        if shadows:
            plain = [i for i, (_, rules, _) in enumerate(checks) if not has_shadow(rules)]
            shadowed = [i for i, (_, rules, _) in enumerate(checks) if has_shadow(rules)]
            found: list[Verdict | None] = [None] * len(checks)
            for i, verdict in zip(
                plain, await self.backend.check_many([checks[i] for i in plain]), strict=True
            ):
                found[i] = verdict
            for i, verdict in zip(
                shadowed, await self._with_shadow([checks[i] for i in shadowed]), strict=True
            ):
                found[i] = verdict
            verdicts = [v for v in found if v is not None]
        else:
            verdicts = await self.backend.check_many(checks)
        metrics = self.metrics
        top = self.top
        if metrics is None and top is None:
            return verdicts
        if not shadows and len(distinct) == 1 and len(checks[0][1]) == 1 and _quiet(verdicts):
            # The common batch: one rule, every check allowed and none near the limit.
            # Nothing for top keys or shadow metrics, and the tally is one count.
            if metrics is not None:
                metrics.observe(time.perf_counter() - started)
                metrics.count(verdicts[0].decision.rule, True, len(verdicts))
            return verdicts
        # The few checks that may count anywhere but in the tally: denied, near the
        # limit, or decided by several rules, and not a read (cost 0 is not a
        # request). Only batches that are not quiet get here: one call per check.
        picked = [
            (check, v)
            for check, v in zip(checks, verdicts, strict=True)
            if (not v[1][0] or worth_noting(v)) and check[2]
        ]
        if metrics is not None:
            metrics.observe(time.perf_counter() - started)
            # (decision.rule, allowed) per verdict, counted in C.
            names = map(_RULE, map(_DECISION, verdicts))
            tally = Counter(zip(names, map(_ALLOWED, verdicts), strict=True))
            for (name, allowed), n in tally.items():
                metrics.count(name, allowed, n)
            for _, verdict in picked:
                if not verdict.decision.allowed or len(verdict.decisions) > 1:
                    for denied in denied_names(verdict):
                        metrics.shadow_denied(denied)
        if top is not None and picked:
            # Top keys look at what the single path's _decided looks at (not at a
            # shadow rule's lone would-be denial with units to spare).
            top.note([(check[0], v) for check, v in picked if worth_noting(v)])
        return verdicts
