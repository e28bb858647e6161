"""What a check answers, for one rule and for several at once."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

#: Reasons a decision can carry besides plain "over the limit".
COST_EXCEEDS_CAPACITY = "cost_exceeds_capacity"
STORE_FULL = "store_full"
BACKEND_UNAVAILABLE = "backend_unavailable"
#: Redis answered this check with an error (a key of another type, say): its
#: rules' on_error decided it, as for an outage, but for this check alone.
BACKEND_ERROR = "backend_error"
#: Reasons of a denial the backend or the store made, not the count.
UNDECIDED = frozenset({BACKEND_UNAVAILABLE, BACKEND_ERROR, STORE_FULL})


def service_refused(reason: str | None, retry_after: float | None) -> bool:
    """Whether a denial is the service's fault, not the client's: a closed rule
    whose backend was down, answered with an error, or whose store had no room
    for a new key. It carries no retry time (an open rule decided by the local
    fallback carries a real one: that client is over its limit). Every front
    door says it the same way: 503, not 429 on the proxy path, and not 200 for
    a single check of the decision API, as for an owner that did not answer."""
    return reason in UNDECIDED and retry_after is None


#: What a service-refused 503 adds: try again soon. A backend outage is probed
#: every half second and a full store sweeps within a second, so, as for any
#: other 503 of the cluster's (``ring_changing``, ``over_capacity``), one second.
SERVICE_REFUSED_HEADERS: tuple[tuple[bytes, bytes], ...] = ((b"retry-after", b"1"),)


def to_micros(seconds: float) -> float:
    """``seconds`` to the microsecond, as the decision API writes its times.

    ``floor(x * 1e6 + 0.5) / 1e6``, not ``round(x, 6)``: a batch writes three
    times per check, and ``round`` with digits goes through a decimal string,
    several times the cost (part of what ``node_batch_body``'s measured saving
    came from). The two can differ, by one microsecond, only for a
    time within a rounding error of a half-microsecond; ``-0.0`` comes out
    ``0.0``. A time that is not finite, or too large to scale, is returned as
    it is.
    """
    try:
        return _floor(seconds * 1e6 + 0.5) / 1e6
    except (OverflowError, ValueError):
        return seconds


_floor = math.floor


class Decision(NamedTuple):
    """One rule's answer.

    ``reset_after``: seconds until the quota is whole again (a fresh state).
    ``retry_after``: seconds until this same request would be allowed; ``None``
    when allowed, and also when it never can be (``reason`` says why).
    ``available_after``: seconds until at least one more unit is available than
    ``remaining`` says (0.0 when the quota is already whole). This is the
    ``t`` parameter of the ``RateLimit`` field, which draft-ietf-httpapi-
    ratelimit-headers-10 section 4.1.2 defines as "the number of seconds until
    additional quota ... is made available"; ``reset_after`` is not, since a
    token bucket refills one token long before it is full again. A denied
    request's ``retry_after`` is never below it (it waits for more units).
    """

    allowed: bool
    limit: int
    remaining: int
    reset_after: float
    retry_after: float | None
    rule: str
    reason: str | None = None
    available_after: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "allowed": self.allowed,
            "limit": self.limit,
            "remaining": self.remaining,
            "reset_after": to_micros(self.reset_after),
            "retry_after": None if self.retry_after is None else to_micros(self.retry_after),
            "rule": self.rule,
            "available_after": to_micros(self.available_after),
            **({"reason": self.reason} if self.reason else {}),
        }


class Verdict(NamedTuple):
    """Several rules' answers to one request: allowed only if every rule allows.

    ``decision`` is the most restrictive of ``decisions`` (see
    :func:`most_restrictive`); ``decisions`` keeps every rule's answer, in rule
    order, for response headers.
    """

    allowed: bool
    decision: Decision
    decisions: tuple[Decision, ...]


def _denied_rank(decision: Decision) -> float:
    return math.inf if decision.retry_after is None else decision.retry_after


def most_restrictive(decisions: Sequence[Decision]) -> Decision:
    """The decision a client should act on.

    Denied beats allowed; among denials, the longest wait (a request that can
    never pass waits forever); among allowances, the fewest remaining, then the
    longest time to a full quota.
    """
    if len(decisions) == 1:
        return decisions[0]
    denied = [d for d in decisions if not d.allowed]
    if denied:
        return max(denied, key=_denied_rank)
    return min(decisions, key=lambda d: (d.remaining, -d.reset_after))
