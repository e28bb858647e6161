"""Rules: what a limit is, and how users write one.

A rule is pure data. The algorithms read precomputed fields (``rate``,
``interval``, ``capacity``) so that the hot path does no division.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from decimal import Decimal

from ring.errors import given, names_text

ALGORITHMS = ("token_bucket", "gcra", "fixed_window", "sliding_log", "sliding_window")
ALGORITHM_ALIASES = {
    "token-bucket": "token_bucket",
    "tokenbucket": "token_bucket",
    "leaky_bucket": "gcra",
    "leaky-bucket": "gcra",
    "fixed-window": "fixed_window",
    "fixed": "fixed_window",
    "sliding-log": "sliding_log",
    "sliding_window_log": "sliding_log",
    "log": "sliding_log",
    "sliding-window": "sliding_window",
    "sliding_window_counter": "sliding_window",
    "sliding_counter": "sliding_window",
}
ON_ERROR = ("open", "closed")
CRASH_POLICIES = ("reset", "conservative", "replica")
#: Copies of a state kept on the key's successors (crash policy ``replica``).
MAX_REPLICAS = 3

MAX_LIMIT = 10**9
MAX_PERIOD = 366 * 86400.0
#: The shortest period (1 ms, the smallest unit): window starts are moved a period
#: at a time, and a period below a Unix time's float spacing (about 2.4e-7 s
#: today) would never move them (node.algorithms._aligned, _advance).
MIN_PERIOD = 0.001
MAX_NAME = 64
#: The sliding log keeps one timestamp per admitted unit; this bounds its memory.
MAX_LOG_LIMIT = 100_000
#: A rule's ``lease`` setting (docs/hotkeys.md): ``off`` (default) or ``auto``.
LEASE_MODES = ("off", "auto")
#: Algorithms the quota-lease core grants leases for (node/quota.py ``LEASABLE``).
LEASE_ALGORITHMS = ("token_bucket", "gcra", "fixed_window", "sliding_window")

_UNITS = {
    "ms": 0.001,
    "millisecond": 0.001,
    "milliseconds": 0.001,
    "s": 1.0,
    "sec": 1.0,
    "secs": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "min": 60.0,
    "mins": 60.0,
    "minute": 60.0,
    "minutes": 60.0,
    "h": 3600.0,
    "hr": 3600.0,
    "hrs": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
    "days": 86400.0,
}
_UNIT_WORDS = {1.0: "second", 60.0: "minute", 3600.0: "hour", 86400.0: "day"}
# ASCII: \d took any script's digits (a full-width "5/s" was 5 per second).
_RULE_RE = re.compile(r"^\s*(\d+)\s*(?:/|\bper\b)\s*(.+?)\s*$", re.IGNORECASE | re.ASCII)
_DURATION_RE = re.compile(r"^(\d+(?:\.\d+)?|\.\d+)?\s*([a-z]+)$", re.IGNORECASE | re.ASCII)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:\-]+$")


class RuleError(ValueError):
    """A rule that cannot be built; the message names the input and the problem."""


def normalize_algorithm(name: str) -> str:
    key = name.strip().lower()
    key = ALGORITHM_ALIASES.get(key, key)
    if key not in ALGORITHMS:
        raise RuleError(f"unknown algorithm {name!r}: expected one of {', '.join(ALGORITHMS)}")
    return key


def parse_duration(
    text: str,
    *,
    what: str = "duration",
    examples: str = "'100ms', '10s', '5m', '1h', '1d'",
    bare_unit: bool = False,
) -> float:
    """``"10s"`` -> 10.0, ``"5 minutes"`` -> 300.0, ``"1d"`` -> 86400.0 (no range check).

    The one reader of a number and a time unit: a rule's period (with
    ``bare_unit``: ``"minute"`` -> 60.0) and a simulation scenario's durations
    (``simulations/scenario.py``) both go through it, so a unit means the same
    everywhere. ``what`` and ``examples`` word the error for the caller.
    """
    match = _DURATION_RE.match(text.strip())
    if not match or (match.group(1) is None and not bare_unit):
        raise RuleError(f"cannot read {what} {text!r}: expected e.g. {examples}")
    count, unit = match.groups()
    seconds = _UNITS.get(unit.lower())
    if seconds is None:
        raise RuleError(f"unknown time unit {unit!r} in {text!r}: use ms, s, m, h or d")
    return (float(count) if count else 1.0) * seconds


def parse_period(text: str) -> float:
    """``"minute"`` -> 60.0, ``"10s"`` -> 10.0, ``"5 minutes"`` -> 300.0."""
    period = parse_duration(
        text, what="period", examples="'second', '10s', '5 minutes'", bare_unit=True
    )
    if not MIN_PERIOD <= period <= MAX_PERIOD:
        raise RuleError(f"period {text!r} must be at least 1 ms and at most 366 days")
    return period


def describe_period(period: float) -> str:
    word = _UNIT_WORDS.get(period)
    if word:
        return word
    # Positional digits of the shortest repr: no exponent ("1e+06" is not a valid name
    # and does not parse back) and no rounding to 6 digits (as "%g" does).
    text = format(Decimal(repr(period)), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text}s"


@dataclass(frozen=True, slots=True)
class Rule:
    """A limit of ``limit`` units per ``period`` seconds under one algorithm.

    ``burst`` is the bucket capacity of the token bucket and GCRA (it defaults to
    ``limit``); window algorithms count whole windows and ignore it.
    ``on_error`` says what to do when the authority for a key cannot be reached:
    ``open`` admits, ``closed`` denies. ``crash_policy`` overrides the cluster's
    policy for keys whose owner crashed; ``replicas`` is how many successors
    hold a copy of each state (under ``replica``), so that losing that many
    adjacent nodes at once still loses no more than a replication interval.
    """

    name: str
    limit: int
    period: float
    algorithm: str = "token_bucket"
    burst: int = 0
    on_error: str = "open"
    crash_policy: str | None = None
    replicas: int = 1
    #: A shadow rule is decided and counted but never denies (see docs/configuration.md).
    shadow: bool = False
    #: ``"auto"``: the owner may lease hot keys' units to routers (docs/hotkeys.md).
    lease: str = "off"
    #: capacity: the most units a fresh state admits at once.
    capacity: int = field(init=False, repr=False, compare=False)
    #: rate: units regained per second (buckets).
    rate: float = field(init=False, repr=False, compare=False)
    #: interval: seconds per unit (GCRA's emission interval).
    interval: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > MAX_NAME:
            raise RuleError(f"rule name {self.name!r} must be 1-{MAX_NAME} characters")
        if not _NAME_RE.match(self.name):
            raise RuleError(f"rule name {self.name!r} may use only letters, digits and _.:-")
        if isinstance(self.limit, bool) or not isinstance(self.limit, int):
            raise RuleError(
                f"rule {self.name!r}: limit must be an integer, got {given(self.limit)}"
            )
        if not 1 <= self.limit <= MAX_LIMIT:
            raise RuleError(
                f"rule {self.name!r}: limit must be 1..{MAX_LIMIT}, got {given(self.limit)}"
            )
        period = float(self.period)
        if not (math.isfinite(period) and MIN_PERIOD <= period <= MAX_PERIOD):
            raise RuleError(
                f"rule {self.name!r}: period must be from 1 ms to 366 days, got {period}"
            )
        object.__setattr__(self, "period", period)
        object.__setattr__(self, "algorithm", normalize_algorithm(self.algorithm))
        # Only the integer 0 is "not set": "", [] or {} (falsy too) were taken for it.
        burst = self.limit if type(self.burst) is int and self.burst == 0 else self.burst
        if isinstance(burst, bool) or not isinstance(burst, int) or not 1 <= burst <= MAX_LIMIT:
            raise RuleError(f"rule {self.name!r}: burst must be an integer 1..{MAX_LIMIT}")
        object.__setattr__(self, "burst", burst)
        if self.algorithm == "sliding_log" and self.limit > MAX_LOG_LIMIT:
            raise RuleError(
                f"rule {self.name!r}: the sliding log keeps one timestamp per unit, so its "
                f"limit is capped at {MAX_LOG_LIMIT}; use sliding_window for larger limits"
            )
        if self.on_error not in ON_ERROR:
            raise RuleError(f"rule {self.name!r}: on_error must be 'open' or 'closed'")
        if self.crash_policy is not None and self.crash_policy not in CRASH_POLICIES:
            raise RuleError(
                f"rule {self.name!r}: crash_policy must be one of {', '.join(CRASH_POLICIES)}"
            )
        replicas = self.replicas
        if isinstance(replicas, bool) or not isinstance(replicas, int) or not 1 <= replicas <= 3:
            raise RuleError(f"rule {self.name!r}: replicas must be an integer 1..{MAX_REPLICAS}")
        if not isinstance(self.shadow, bool):
            raise RuleError(f"rule {self.name!r}: shadow must be true or false")
        lease: object = self.lease
        if isinstance(lease, bool):
            lease = "auto" if lease else "off"
        if not isinstance(lease, str) or lease.strip().lower() not in LEASE_MODES:
            raise RuleError(
                f"rule {self.name!r}: lease must be 'auto' or 'off', got {given(lease)}"
            )
        lease = lease.strip().lower()
        if lease == "auto" and self.algorithm not in LEASE_ALGORITHMS:
            # Refused loudly rather than silently off: docs/hotkeys.md says why the
            # sliding log cannot be leased exactly.
            raise RuleError(
                f"rule {self.name!r}: lease = 'auto' is not supported for {self.algorithm} "
                f"(leasable: {', '.join(LEASE_ALGORITHMS)})"
            )
        object.__setattr__(self, "lease", lease)
        bucket = self.algorithm in ("token_bucket", "gcra")
        object.__setattr__(self, "capacity", burst if bucket else self.limit)
        object.__setattr__(self, "rate", self.limit / period)
        object.__setattr__(self, "interval", period / self.limit)

    def with_(self, **changes: object) -> Rule:
        return replace(self, **changes)  # type: ignore[arg-type]

    @property
    def spec(self) -> str:
        return f"{self.limit}/{describe_period(self.period)}"

    def to_dict(self) -> dict[str, object]:
        data: dict[str, object] = {
            "name": self.name,
            "limit": self.limit,
            "period": self.period,
            "algorithm": self.algorithm,
            "burst": self.burst,
            "on_error": self.on_error,
        }
        if self.crash_policy is not None:
            data["crash_policy"] = self.crash_policy
        if self.replicas != 1:
            data["replicas"] = self.replicas
        if self.shadow:
            data["shadow"] = True
        if self.lease != "off":
            data["lease"] = self.lease
        return data

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> Rule:
        if not isinstance(data, dict):
            raise RuleError(f"a rule must be an object, got {type(data).__name__}")
        unknown = set(data) - {
            "name",
            "limit",
            "period",
            "algorithm",
            "burst",
            "on_error",
            "crash_policy",
            "replicas",
            "shadow",
            "lease",
        }
        if unknown:
            raise RuleError(f"unknown rule field(s): {names_text(unknown)}")
        try:
            return cls(
                name=data["name"],  # type: ignore[arg-type]
                limit=data["limit"],  # type: ignore[arg-type]
                period=data["period"],  # type: ignore[arg-type]
                algorithm=data.get("algorithm", "token_bucket"),  # type: ignore[arg-type]
                burst=explicit_burst(data.get("burst")),
                on_error=data.get("on_error", "open"),  # type: ignore[arg-type]
                crash_policy=data.get("crash_policy"),  # type: ignore[arg-type]
                replicas=data.get("replicas", 1),  # type: ignore[arg-type]
                shadow=data.get("shadow", False),  # type: ignore[arg-type]
                lease=data.get("lease", "off"),  # type: ignore[arg-type]
            )
        except KeyError as exc:
            raise RuleError(f"rule is missing field {exc.args[0]!r}") from None
        except TypeError as exc:
            raise RuleError(f"bad rule field: {exc}") from None


def parse_rate(text: str) -> tuple[int, float]:
    """``"100/minute"`` -> ``(100, 60.0)``; also ``"5/10s"``, ``"1000 per hour"``."""
    if not isinstance(text, str):
        raise RuleError(f"a rate must be a string like '100/minute', got {given(text)}")
    match = _RULE_RE.match(text)
    if not match:
        raise RuleError(
            f"cannot read rate {text!r}: expected 'N/period' or 'N per period', "
            "e.g. '100/minute', '5/10s', '1000 per hour'"
        )
    digits = match.group(1).lstrip("0")
    # Counted before int(): past 4,300 digits int() raises its own ValueError,
    # which named sys.set_int_max_str_digits and no field (an exploratory tester).
    limit = int(digits) if 0 < len(digits) <= len(str(MAX_LIMIT)) else 0
    if not 1 <= limit <= MAX_LIMIT:
        raise RuleError(f"rate {given(text)}: the count must be 1..{MAX_LIMIT}")
    try:
        period = parse_period(match.group(2))
    except RuleError as exc:
        raise RuleError(f"rate {text!r}: {exc}") from None
    return limit, period


def explicit_burst(burst: object) -> int:
    """A burst given explicitly, or 0 (the rule's default: its limit) when none is.

    0 is the rule's own "not set": given by a user, it would silently mean the
    limit, so it is refused like any other value out of range.
    """
    if burst is None:
        return 0
    if burst == 0:  # 0, and also 0.0 or false, which Rule would take as "not set"
        raise RuleError(f"burst must be an integer 1..{MAX_LIMIT}, got {given(burst)}")
    return burst  # type: ignore[return-value]  # Rule checks its type and range


def default_name(limit: int, period: float) -> str:
    return f"{limit}-per-{describe_period(period)}"


def parse_rule(
    text: str,
    *,
    name: str | None = None,
    algorithm: str = "token_bucket",
    burst: int | None = None,
    on_error: str = "open",
    shadow: bool = False,
) -> Rule:
    """Build a rule from the strings users already know.

    ``"100/minute"`` gets the name ``100-per-minute``; ``"api=100/minute"`` is named
    ``api``. The name is what response headers and metrics show. A trailing
    ``";shadow"`` (``"api=100/minute;shadow"``) makes it a shadow rule.
    """
    spec = text
    head, sep, flag = text.rpartition(";")
    if sep and flag.strip().lower() == "shadow":
        text = spec = head
        shadow = True
    if "=" in text and name is None:
        name, spec = (part.strip() for part in text.split("=", 1))
    limit, period = parse_rate(spec)
    return Rule(
        name=name or default_name(limit, period),
        limit=limit,
        period=period,
        algorithm=algorithm,
        burst=explicit_burst(burst),
        on_error=on_error,
        shadow=shadow,
    )
