"""Several rules on one request, decided atomically.

A request passes only if every rule passes; when any rule denies, no rule
consumes (a denied request must not burn quota it was never given). This is
the pure core that both the memory store and the simulations call.
"""

from __future__ import annotations

from collections.abc import Sequence

from node.algorithms import REGISTRY, State
from node.decision import Decision, Verdict, most_restrictive
from node.rules import Rule


def decide_all(
    states: Sequence[State], now: float, rules: Sequence[Rule], cost: int
) -> tuple[list[State], Verdict]:
    """Decide ``cost`` against every rule; return the states to keep and the verdict.

    On denial the returned states are the ones given (unchanged) and each
    allowing rule's decision is recomputed as a peek, so that the headers show
    what is really left rather than what would have been left.
    """
    if cost < 0:
        raise ValueError("cost must be >= 0")
    new_states: list[State] = []
    decisions: list[Decision] = []
    allowed = True
    for state, rule in zip(states, rules, strict=True):
        new, decision = REGISTRY[rule.algorithm].decide(state, now, rule, cost)
        new_states.append(new)
        decisions.append(decision)
        if not decision.allowed:
            allowed = False
    if not allowed:
        if cost:
            for i, (state, rule) in enumerate(zip(states, rules, strict=True)):
                if decisions[i].allowed:
                    decisions[i] = REGISTRY[rule.algorithm].decide(state, now, rule, 0)[1]
        new_states = list(states)
    return new_states, Verdict(allowed, most_restrictive(decisions), tuple(decisions))
