"""Rate-limit response fields: the IETF draft's and the legacy ``X-RateLimit-*``.

``RateLimit-Policy`` lists every rule that applied (``"api";q=100;w=60``) and
``RateLimit`` gives each one's remaining quota and seconds to reset
(``"api";r=42;t=17``), following draft-ietf-httpapi-ratelimit-headers. The legacy
fields describe the most restrictive rule only, since they can hold one value
each; ``X-RateLimit-Reset`` is in delta-seconds, like ``t``.
"""

from __future__ import annotations

import math
from functools import lru_cache

from node.decision import Decision, Verdict
from node.rules import Rule
from node.shadow import denied_names, has_shadow

#: Names the shadow rules that would have denied a request they let through.
SHADOW_HEADER = b"ringlimit-shadow"


def whole_seconds(seconds: float) -> int:
    """Round up, so a client that waits this long is never early."""
    return max(0, math.ceil(seconds - 1e-9))


def retry_after_value(retry_after: float) -> str:
    """``Retry-After`` in whole seconds, never earlier than the true retry time."""
    return str(max(1, math.ceil(retry_after)))


def policy_value(rules: tuple[Rule, ...] | list[Rule]) -> str:
    if type(rules) is tuple:
        return _policy_bytes(rules).decode()
    return ", ".join(f'"{r.name}";q={r.limit};w={whole_seconds(r.period)}' for r in rules)


@lru_cache(maxsize=1024)
def _policy_bytes(rules: tuple[Rule, ...]) -> bytes:
    """``RateLimit-Policy`` of a tuple of rules (rules are immutable: computed once)."""
    return ", ".join(f'"{r.name}";q={r.limit};w={whole_seconds(r.period)}' for r in rules).encode()


def ratelimit_value(decisions: tuple[Decision, ...]) -> str:
    return ", ".join(
        f'"{d.rule}";r={d.remaining};t={whole_seconds(d.reset_after)}' for d in decisions
    )


def rate_limit_headers(
    rules: tuple[Rule, ...] | list[Rule], verdict: Verdict, *, legacy: bool = True
) -> list[tuple[bytes, bytes]]:
    """The headers for a decided request, as raw ASGI header pairs.

    Shadow rules are left out of the rate-limit fields (a client must not slow
    down for a limit that is not enforced); the ones that would have denied are
    named in ``RingLimit-Shadow``.
    """
    if has_shadow(rules):
        return _with_shadow(tuple(rules), verdict, legacy=legacy)
    decision = verdict.decision
    headers = [
        (
            b"ratelimit-policy",
            _policy_bytes(rules) if type(rules) is tuple else policy_value(rules).encode(),
        ),
        (b"ratelimit", ratelimit_value(verdict.decisions).encode()),
    ]
    if legacy:
        headers += [
            (b"x-ratelimit-limit", str(decision.limit).encode()),
            (b"x-ratelimit-remaining", str(decision.remaining).encode()),
            (b"x-ratelimit-reset", str(whole_seconds(decision.reset_after)).encode()),
        ]
    if not verdict.allowed and decision.retry_after is not None:
        headers.append((b"retry-after", retry_after_value(decision.retry_after).encode()))
    return headers


def _with_shadow(
    rules: tuple[Rule, ...], verdict: Verdict, *, legacy: bool
) -> list[tuple[bytes, bytes]]:
    enforced = tuple(r for r in rules if not r.shadow)
    headers: list[tuple[bytes, bytes]] = []
    if enforced:
        decisions = tuple(d for r, d in zip(rules, verdict.decisions, strict=True) if not r.shadow)
        headers = rate_limit_headers(
            enforced, Verdict(verdict.allowed, verdict.decision, decisions), legacy=legacy
        )
    denied = denied_names(verdict)
    if denied:
        headers.append((SHADOW_HEADER, ", ".join(f'"{name}"' for name in denied).encode()))
    return headers


def denial_body(verdict: Verdict) -> dict[str, object]:
    decision = verdict.decision
    if decision.retry_after is None:
        detail = (
            f"this request costs more than rule {decision.rule!r} can ever allow"
            if decision.reason == "cost_exceeds_capacity"
            else f"denied by rule {decision.rule!r} ({decision.reason})"
        )
    else:
        detail = (
            f"rate limit {decision.rule!r} exceeded: {decision.limit} allowed; "
            f"retry in {decision.retry_after:.3f}s"
        )
    body: dict[str, object] = {
        "error": "rate_limited",
        "rule": decision.rule,
        "limit": decision.limit,
        "retry_after": None if decision.retry_after is None else round(decision.retry_after, 3),
        "detail": detail,
    }
    if decision.reason:
        body["reason"] = decision.reason
    return body
