"""Rate-limit response fields and 429 bodies, as draft-ietf-httpapi-ratelimit-headers-10 says.

``RateLimit-Policy`` lists every rule that applied (``"api";q=100;w=60``,
section 3) and ``RateLimit`` gives each one's remaining quota and the seconds
until more of it is available (``"api";r=42;t=17``, section 4). How a rule
becomes a policy item:

* ``q`` is never below any ``r`` a client can see (section 3.1.1: the quota
  allocated). A token bucket or GCRA rule with ``burst`` B holds B units and
  refills them in ``B / rate`` seconds, so ``10/minute`` with burst 20 is
  advertised as ``q=20;w=120``: the same sustained rate, and ``r`` (at most
  B) never exceeds ``q``.
* ``w`` must be a whole number of seconds (section 3.1.3: "Sub-second
  precision is not supported"), so a window that is not one is scaled to the
  smallest whole number of seconds that holds a whole number of windows, and
  ``q`` with it: ``10/0.1s`` is ``q=100;w=1``, ``10/1.5s`` is ``q=20;w=3``.
* ``t`` is :attr:`node.decision.Decision.available_after` rounded up (section
  4.1.2: "the number of seconds until additional quota ... is made
  available"): 12 for a drained ``5/minute`` bucket, not the 60 it takes to be
  whole again.
* ``Retry-After`` (on a 429 only) is never earlier than the ``t`` of any rule
  that denied (section 6: it "SHOULD NOT reference a point in time earlier
  than the reset parameter"), nor than the true retry time.

The legacy ``X-RateLimit-*`` fields describe the most restrictive rule only,
since they hold one value each; they repeat its ``q``, ``r`` and ``t``, with
``X-RateLimit-Reset`` either in delta-seconds (``t`` itself) or as the Unix
time of that moment (``legacy_reset="epoch"``, what GitHub's API and
flask-limiter/slowapi send).

A 429 body is either ``application/problem+json`` (RFC 9457) with the draft's
``quota-exceeded`` problem type and every violated policy (section 5.1), or
ringlimit's plain JSON; both keep the same ringlimit members.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from fractions import Fraction
from functools import lru_cache
from typing import Any, NamedTuple

from uvicorn.protocols.http.httptools_impl import HEADER_RE, HEADER_VALUE_RE

from node.decision import Decision, Verdict, service_refused
from node.rules import Rule
from node.shadow import denied_names, has_shadow

#: Names the shadow rules that would have denied a request they let through.
SHADOW_HEADER = b"ringlimit-shadow"
#: Says that the cluster's usual limiter did not decide a request, and why: on
#: the answer to the client and on the request the application behind a node
#: gets (docs/redis.md, docs/rebalancing.md). The values are the decision API's
#: reasons, hyphenated: ``backend-unavailable`` (Redis down, the node's local
#: fallback decided), ``backend-error`` (Redis answered that check with an error)
#: and ``owner-unreachable`` (admitted uncounted: the key's owner did not answer).
DEGRADED_HEADER = b"x-ringlimit-degraded"

#: Section 5.1 and 10.2.1 of the draft.
QUOTA_EXCEEDED = "https://iana.org/assignments/http-problem-types#quota-exceeded"
QUOTA_EXCEEDED_TITLE = "Request cannot be satisfied as assigned quota has been exceeded"
PROBLEM_JSON = b"application/problem+json"
PLAIN_JSON = b"application/json"

_ceil = math.ceil

#: Periods are read to the millisecond; finer fractions are float noise (0.1 is not exact).
_PERIOD_DENOMINATOR = 1000


def whole_seconds(seconds: float) -> int:
    """Round up, so a client that waits this long is never early."""
    return max(0, math.ceil(seconds - 1e-9))


def retry_after_value(retry_after: float) -> str:
    """``Retry-After`` in whole seconds, never earlier than the true retry time."""
    return str(max(1, math.ceil(retry_after)))


@lru_cache(maxsize=4096)
def quota_window(rule: Rule) -> tuple[int, int]:
    """``(q, w)`` of a rule's policy item: whole seconds, and ``q >= capacity``.

    Buckets advertise their capacity over the time it takes to refill it;
    windows their limit over their period. A window that is not a whole number
    of seconds (n/d in lowest terms) becomes n seconds and ``q * d``: the same
    rate, in the units the draft allows.
    """
    period = Fraction(rule.period).limit_denominator(_PERIOD_DENOMINATOR)
    if rule.algorithm in ("token_bucket", "gcra"):
        quota = rule.capacity
        window = period * quota / rule.limit
    else:
        quota = rule.limit
        window = period
    return quota * window.denominator, window.numerator


def policy_item(rule: Rule) -> str:
    quota, window = quota_window(rule)
    return f'"{rule.name}";q={quota};w={window}'


def policy_value(rules: tuple[Rule, ...] | list[Rule]) -> str:
    if type(rules) is tuple:
        return _policy_bytes(rules).decode()
    return ", ".join(policy_item(r) for r in rules)


@lru_cache(maxsize=1024)
def _policy_bytes(rules: tuple[Rule, ...]) -> bytes:
    """``RateLimit-Policy`` of a tuple of rules (rules are immutable: computed once)."""
    return ", ".join(policy_item(r) for r in rules).encode()


def ratelimit_value(decisions: tuple[Decision, ...]) -> str:
    return ", ".join(
        f'"{d.rule}";r={d.remaining};t={whole_seconds(d.available_after)}' for d in decisions
    )


def retry_after_seconds(verdict: Verdict) -> int | None:
    """Whole seconds for ``Retry-After`` on a denial; ``None`` when retrying cannot help.

    At least the acting decision's retry time rounded up, and at least the
    ``t`` of every denying rule (draft section 6).
    """
    decision = verdict.decision
    if verdict.allowed or decision.retry_after is None:
        return None
    seconds = max(1, math.ceil(decision.retry_after))
    for d in verdict.decisions:
        if not d.allowed:
            seconds = max(seconds, whole_seconds(d.available_after))
    return seconds


def rate_limit_headers(
    rules: tuple[Rule, ...] | list[Rule],
    verdict: Verdict,
    *,
    legacy: bool = True,
    legacy_reset: str = "epoch",
    now: float | None = None,
) -> list[tuple[bytes, bytes]]:
    """The headers for a decided request, as raw ASGI header pairs.

    ``now`` (Unix time) is needed only for ``legacy_reset="epoch"``. Shadow
    rules are left out of the rate-limit fields (a client must not slow down
    for a limit that is not enforced); the ones that would have denied are
    named in ``RingLimit-Shadow``.
    """
    if has_shadow(rules):
        return _with_shadow(
            tuple(rules), verdict, legacy=legacy, legacy_reset=legacy_reset, now=now
        )
    decision = verdict.decision
    headers = [
        (
            b"ratelimit-policy",
            _policy_bytes(rules) if type(rules) is tuple else policy_value(rules).encode(),
        ),
        (b"ratelimit", ratelimit_value(verdict.decisions).encode()),
    ]
    if legacy:
        headers += legacy_headers(rules, decision, legacy_reset, now)
    retry = retry_after_seconds(verdict)
    if retry is not None:
        headers.append((b"retry-after", str(retry).encode()))
    return headers


def legacy_headers(
    rules: tuple[Rule, ...] | list[Rule], decision: Decision, reset: str, now: float | None
) -> list[tuple[bytes, bytes]]:
    """``X-RateLimit-Limit/-Remaining/-Reset`` of one decision, matching its policy item."""
    limit = decision.limit
    for rule in rules:
        if rule.name == decision.rule:
            limit = quota_window(rule)[0]
            break
    if reset == "delta":
        value = whole_seconds(decision.available_after)
    else:
        if now is None:
            raise ValueError("legacy_reset='epoch' needs the current Unix time")
        value = math.ceil(now + decision.available_after - 1e-9)
    return [
        (b"x-ratelimit-limit", str(limit).encode()),
        (b"x-ratelimit-remaining", str(decision.remaining).encode()),
        (b"x-ratelimit-reset", str(value).encode()),
    ]


#: The legacy fields' names: each holds one value, so an answer carries one of each.
LEGACY_NAMES = frozenset({b"x-ratelimit-limit", b"x-ratelimit-remaining", b"x-ratelimit-reset"})

Field = tuple[bytes, bytes]


def settle_legacy(app: Sequence[Field], ours: Sequence[Field]) -> tuple[list[Field], list[Field]]:
    """``(app, ours)`` with one set of ``X-RateLimit-*`` fields between them.

    An application behind a node (or an upstream) may send legacy fields of its
    own quota; added to ours, an answer carried two ``X-RateLimit-Remaining``,
    which a client reads as one unparseable value (RFC 9110 section 5.3 joins
    them with a comma). They describe the most restrictive quota, so the
    application's set is kept when its remaining is below ours, and ours
    otherwise (its remaining unreadable or missing included). ``RateLimit`` and
    ``RateLimit-Policy`` are lists of named policies: both sides' are kept.
    """
    if not any(name.lower() in LEGACY_NAMES for name, _ in app):
        return list(app), list(ours)
    if not any(name in LEGACY_NAMES for name, _ in ours):
        return list(app), list(ours)  # legacy fields off here: the app's are the only ones
    theirs = _remaining(app)
    if theirs is not None and theirs < (_remaining(ours) or 0):
        return list(app), [field for field in ours if field[0] not in LEGACY_NAMES]
    return [field for field in app if field[0].lower() not in LEGACY_NAMES], list(ours)


def _remaining(fields: Iterable[Field]) -> int | None:
    for name, value in fields:
        if name.lower() == b"x-ratelimit-remaining":
            text = value.strip()
            return int(text) if text.isdigit() and len(text) < 20 else None
    return None


def _with_shadow(
    rules: tuple[Rule, ...],
    verdict: Verdict,
    *,
    legacy: bool,
    legacy_reset: str,
    now: float | None,
) -> list[tuple[bytes, bytes]]:
    enforced = tuple(r for r in rules if not r.shadow)
    headers: list[tuple[bytes, bytes]] = []
    if enforced:
        decisions = tuple(d for r, d in zip(rules, verdict.decisions, strict=True) if not r.shadow)
        headers = rate_limit_headers(
            enforced,
            Verdict(verdict.allowed, verdict.decision, decisions),
            legacy=legacy,
            legacy_reset=legacy_reset,
            now=now,
        )
    denied = denied_names(verdict)
    if denied:
        headers.append((SHADOW_HEADER, ", ".join(f'"{name}"' for name in denied).encode()))
    return headers


def denial_body(verdict: Verdict) -> dict[str, object]:
    """ringlimit's own JSON for a denial: the acting rule, and every violated one.

    ``error`` is ``rate_limited`` when the count denied (a 429), and
    ``limiter_unavailable`` when the service did (a 503: a closed rule its
    backend or store could not decide), as the router's 503 for a closed rule
    whose owner cannot be reached says it: before, an outage's 503 said
    ``rate_limited``, and a client branching on ``error`` took it for an
    exhausted quota.
    """
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
        "error": (
            "limiter_unavailable"
            if service_refused(decision.reason, decision.retry_after)
            else "rate_limited"
        ),
        "rule": decision.rule,
        "limit": decision.limit,
        "retry_after": None if decision.retry_after is None else round(decision.retry_after, 3),
        "detail": detail,
    }
    if decision.reason:
        body["reason"] = decision.reason
    body["violated_rules"] = violated(verdict)
    return body


def violated(verdict: Verdict) -> list[str]:
    return [d.rule for d in verdict.decisions if not d.allowed]


def problem_body(verdict: Verdict, status: int) -> dict[str, Any]:
    """RFC 9457 problem details for a denial.

    A 429 uses the draft's ``quota-exceeded`` type with ``violated-policies``
    naming every rule that denied (section 5.1). A 503 (a rule that fails
    closed while its backend is down) exceeded no quota, so it is a plain
    ``about:blank`` problem. ringlimit's own members follow as extensions, so a
    client written against the plain JSON body reads the same fields.
    """
    own = denial_body(verdict)
    if status == 429:
        problem: dict[str, Any] = {
            "type": QUOTA_EXCEEDED,
            "title": QUOTA_EXCEEDED_TITLE,
            "status": status,
            "detail": own["detail"],
            "violated-policies": violated(verdict),
        }
    else:
        problem = {
            "type": "about:blank",
            "title": "Service Unavailable",
            "status": status,
            "detail": own["detail"],
        }
    return {**problem, **{k: v for k, v in own.items() if k != "detail"}}


def denial_response(verdict: Verdict, status: int, format: str) -> tuple[dict[str, Any], bytes]:
    """``(body, content type)`` of a denial in the configured format."""
    if format == "json":
        return denial_body(verdict), PLAIN_JSON
    return problem_body(verdict, status), PROBLEM_JSON


#: Entries a :class:`HeaderCache` keeps per rule set before it starts again.
_CACHE_ENTRIES = 4096
#: Rule sets a :class:`HeaderCache` keeps plans for.
_CACHE_PLANS = 1024

Headers = tuple[tuple[bytes, bytes], ...]

#: What uvicorn refuses in a field's name and value, checked once per rendered
#: entry: its lines are written as they are (:attr:`Rendered.lines`), past the
#: front door's own per-field checks.
_BAD_NAME = HEADER_RE
_BAD_VALUE = HEADER_VALUE_RE


class Rendered(NamedTuple):
    """One decision's rate-limit fields, in the two forms a server takes.

    ``fields`` are ASGI header pairs, for any server; ``lines`` are the same
    fields as an HTTP/1.1 response writes them (``name: value`` and CRLF each),
    checked as uvicorn checks a field, for a server that takes them whole
    (node/asgi.py's :data:`~node.asgi.RESPONSE_FIELDS` extension: a node's
    front door), which then skips its per-field checks and lookups.
    """

    fields: Headers
    lines: bytes


def rendered(fields: Headers) -> Rendered:
    """``fields`` with their :attr:`Rendered.lines`; ValueError for a field
    uvicorn would refuse (none of ours can be: rule names are checked when
    read, the rest are numbers)."""
    for name, value in fields:
        if _BAD_NAME.search(name) or _BAD_VALUE.search(value):
            raise ValueError(f"invalid response field {name!r}: {value!r}")
    return Rendered(fields, b"".join(b"%s: %s\r\n" % (n.lower(), v) for n, v in fields))


class HeaderCache:
    """:func:`rate_limit_headers`, rendered once per rule set and decided values.

    A proxied request's fields depend only on its rules (``RateLimit-Policy``,
    the legacy limit) and on a few small integers of its verdict (each rule's
    ``r`` and ``t``, the legacy reset, ``Retry-After``): users at the same
    point of their quota get the same bytes. So the fields are rendered once
    per such combination and kept (bounded), and a request costs a dict lookup
    instead of formatting five fields. Answers are tuples, the same object for
    equal inputs: callers copy, never modify them. Rule sets with shadow rules
    are rendered each time (:func:`rate_limit_headers`), their lines once per
    distinct fields.
    """

    __slots__ = ("_plans", "legacy", "legacy_reset")

    def __init__(self, *, legacy: bool = True, legacy_reset: str = "epoch") -> None:
        self.legacy = legacy
        self.legacy_reset = legacy_reset
        #: id(rules) -> (rules, shadowed, rendered): the rules object is kept, so
        #: its id is not reused while the plan exists.
        self._plans: dict[int, tuple[tuple[Rule, ...], bool, dict[Any, Rendered]]] = {}

    def render(self, rules: tuple[Rule, ...], verdict: Verdict, now: float) -> Headers:
        """The same fields as ``rate_limit_headers(rules, verdict, legacy=...,
        legacy_reset=..., now=now)``."""
        return self.rendered(rules, verdict, now).fields

    def rendered(self, rules: tuple[Rule, ...], verdict: Verdict, now: float) -> Rendered:
        """:meth:`render`, with the fields' lines too (:class:`Rendered`)."""
        plan = self._plans.get(id(rules))
        if plan is None or plan[0] is not rules:
            if len(self._plans) >= _CACHE_PLANS:
                self._plans.clear()
            plan = self._plans[id(rules)] = (rules, has_shadow(rules), {})
        entries = plan[2]
        if plan[1]:
            # Shadow rules: the fields are rendered each time, their lines checked
            # once per distinct fields (as the front door checks a field once).
            fields = self._uncached(rules, verdict, now)
            found = entries.get(fields)
            if found is None:
                if len(entries) >= _CACHE_ENTRIES:
                    entries.clear()
                found = entries[fields] = rendered(fields)
            return found
        decision = verdict.decision
        after = decision.available_after
        t = _ceil(after - 1e-9)  # whole_seconds(after), inline
        if t < 0:
            t = 0
        reset = _ceil(now + after - 1e-9) if self.legacy and self.legacy_reset != "delta" else t
        retry = None if verdict.allowed else retry_after_seconds(verdict)
        # Everything the fields are made of (see rate_limit_headers): equal keys,
        # equal bytes.
        key: Any = (decision.rule, decision.limit, decision.remaining, t, reset, retry)
        decisions = verdict.decisions
        if len(decisions) != 1:
            key = (
                key,
                tuple((d.rule, d.remaining, whole_seconds(d.available_after)) for d in decisions),
            )
        found = entries.get(key)
        if found is None:
            if len(entries) >= _CACHE_ENTRIES:
                entries.clear()
            found = entries[key] = rendered(self._uncached(rules, verdict, now))
        return found

    def _uncached(self, rules: tuple[Rule, ...], verdict: Verdict, now: float) -> Headers:
        return tuple(
            rate_limit_headers(
                rules, verdict, legacy=self.legacy, legacy_reset=self.legacy_reset, now=now
            )
        )
