"""Shadow rules: decided and counted like any rule, but never denying.

An operator adds a limit with ``shadow = true`` to see, on live traffic, what
it would do before enforcing it. Each shadow rule is decided on its own
state exactly as if it were enforced *alone*: when it allows, it consumes;
when it would deny, it consumes nothing (as an enforced rule's denial would
not) and the denial is reported (a ``RingLimit-Shadow`` header, a
``shadow_denied`` list in decision-API results, a metric) instead of acted
on. So its counter follows the traffic that enforcing it would have let
through, and its would-be denials are the ones enforcing it would cause.

The enforced rules of a request are decided first, atomically, as always; a
request they deny consumes nothing anywhere, so its shadow decisions are
peeks (cost 0). This module is the pure part: splitting rules and merging
the answers into one :class:`~node.decision.Verdict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from node.decision import Decision, Verdict, most_restrictive
from node.rules import Rule


@lru_cache(maxsize=4096)
def split(rules: tuple[Rule, ...]) -> tuple[tuple[Rule, ...], tuple[Rule, ...]]:
    """``(enforced, shadow)``, each in rule order (rules are immutable: cached)."""
    return (
        tuple(r for r in rules if not r.shadow),
        tuple(r for r in rules if r.shadow),
    )


def has_shadow(rules: Sequence[Rule]) -> bool:
    return any(r.shadow for r in rules)


def merge(rules: Sequence[Rule], enforced: Verdict | None, shadow: Sequence[Decision]) -> Verdict:
    """One verdict for ``rules`` from the enforced rules' verdict and each shadow
    rule's own decision (in the order of ``split``).

    The request is allowed when the enforced rules allow it (or there are none).
    ``decisions`` keeps every rule's answer in rule order, a shadow rule's with
    its own ``allowed``; ``decision`` is the most restrictive *enforced* one,
    and only with shadow rules alone the most restrictive shadow one (whose
    ``allowed`` may then be False while the verdict's is True).
    """
    enforced_decisions = iter(enforced.decisions if enforced is not None else ())
    shadow_decisions = iter(shadow)
    decisions = tuple(
        next(shadow_decisions) if rule.shadow else next(enforced_decisions) for rule in rules
    )
    if enforced is not None:
        return Verdict(enforced.allowed, enforced.decision, decisions)
    return Verdict(True, most_restrictive(list(shadow)), decisions)


def shadow_denied(rules: Sequence[Rule], verdict: Verdict) -> list[str]:
    """The names of the shadow rules that would have denied this request."""
    return [
        d.rule
        for rule, d in zip(rules, verdict.decisions, strict=False)
        if rule.shadow and not d.allowed
    ]


def denied_names(verdict: Verdict) -> list[str]:
    """Shadow rules that would have denied, from a verdict alone.

    A decision that denies inside an allowed verdict can only be a shadow
    rule's; in a denied verdict, shadow decisions are peeks and allow.
    """
    if not verdict.allowed:
        return []
    return [d.rule for d in verdict.decisions if not d.allowed]
