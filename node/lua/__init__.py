"""The Lua scripts of the Redis backend, and how to call them.

Layout. Each algorithm of :mod:`node.algorithms` is one fragment,
``<algorithm>.lua``, that registers ``ALG.<algorithm> = {decide, commit}``.
A script is assembled from text files shipped in this package (read with
:mod:`importlib.resources`, so they are inside the wheel)::

    prelude.lua          EPS, number formatting, the call header (now, cost, slack), TTLs
    <algorithm>.lua ...  one or more algorithm fragments
    check.lua            the dispatcher: decide every rule, then commit all or nothing

:data:`CHECK` holds all five fragments and serves any rule set (several rules
are decided and consumed atomically, in one call, exactly like
:func:`node.limiter.decide_all`); :data:`STANDALONE` holds one script per
algorithm, the same dispatcher with a single fragment, which the backend uses
for the common one-rule check. All scripts share one calling convention:

``KEYS[i]``
    the state key of rule ``i``; every key of one call carries the same hash tag.
``ARGV``
    ``now`` (seconds, Python ``repr`` of a float; ``""`` takes Redis ``TIME``),
    ``cost``, TTL slack in ms, then six per rule: algorithm, limit, period,
    capacity, rate, interval (floats as ``repr``, so they parse to the exact
    values the engine uses).
reply
    ``[now, allowed, *per rule (allowed, remaining, reset_after, retry_after, reason,
    available_after)]``
    with floats as ``'%.17g'`` strings (Redis truncates Lua numbers to integers),
    ``nil`` for no ``retry_after``/``reason``.

State layout (one Redis key per (user key, rule); see the fragments' headers):
token bucket ``"<tokens> <updated_at>"``, GCRA ``"<tat>"``, fixed window
``"<start> <count>"``, sliding window ``"<start> <previous> <current>"`` (plain
strings set with ``PX``), sliding log a sorted set of one entry per admitted unit.
Each write sets a TTL ending when the state is fresh again (the algorithm's
``fresh_at``, rounded up to the millisecond, plus the slack; at most 2^53 ms);
denials and peeks write no state, and touch a TTL only to stretch it to the
state's ``fresh_at`` under a rule tightened since the write (prelude's ``keep``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from node.decision import Decision, Verdict, most_restrictive
from node.rules import ALGORITHMS, Rule

PRELUDE = "prelude"
DISPATCHER = "check"


def source(name: str) -> str:
    """The text of ``<name>.lua`` in this package."""
    return resources.files(__name__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


@dataclass(frozen=True, slots=True)
class Script:
    """An assembled script: its name, text and SHA1 (what ``EVALSHA`` calls)."""

    name: str
    source: str
    sha: str
    algorithms: frozenset[str]


def build(algorithms: Iterable[str], name: str | None = None) -> Script:
    """Assemble prelude + the given algorithm fragments + the dispatcher."""
    algs = list(dict.fromkeys(algorithms))
    unknown = set(algs) - set(ALGORITHMS)
    if unknown or not algs:
        raise ValueError(f"cannot build a script for algorithms {algs!r}")
    parts = [source(PRELUDE), *(source(a) for a in algs), source(DISPATCHER)]
    text = "\n".join(parts)
    sha = hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()
    return Script(name or "check", text, sha, frozenset(algs))


#: Serves any set of rules.
CHECK: Script = build(ALGORITHMS, "check")
#: One script per algorithm, for a single rule.
STANDALONE: dict[str, Script] = {a: build([a], a) for a in ALGORITHMS}
#: Every script, by name.
SCRIPTS: dict[str, Script] = {"check": CHECK, **STANDALONE}


def script_for(rules: Sequence[Rule]) -> Script:
    """The smallest script that decides ``rules``."""
    if len(rules) == 1:
        return STANDALONE[rules[0].algorithm]
    return CHECK


@lru_cache(maxsize=4096)
def rule_args(rule: Rule) -> tuple[str, ...]:
    """A rule's six ARGV entries (cached: rules are immutable and few)."""
    return (
        rule.algorithm,
        str(rule.limit),
        repr(rule.period),
        str(rule.capacity),
        repr(rule.rate),
        repr(rule.interval),
    )


def pack_args(
    now: float | None, cost: int, rules: Sequence[Rule], ttl_slack_ms: int = 0
) -> list[str]:
    """The ARGV of a call; ``now=None`` lets the script read Redis ``TIME``."""
    if isinstance(cost, bool) or not isinstance(cost, int) or cost < 0:
        raise ValueError(f"cost must be an integer >= 0, got {cost!r}")
    if not rules:
        raise ValueError("a check needs at least one rule")
    args = ["" if now is None else repr(float(now)), str(cost), str(int(ttl_slack_ms))]
    for rule in rules:
        args.extend(rule_args(rule))
    return args


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def unpack_reply(reply: Sequence[object], rules: Sequence[Rule]) -> tuple[float, Verdict]:
    """``(now the script used, verdict)`` from a script's reply."""
    decisions: list[Decision] = []
    i = 2
    for rule in rules:
        allowed, remaining, reset_after, retry_after, reason, available = reply[i : i + 6]
        decisions.append(
            Decision(
                bool(allowed),
                rule.limit,
                int(remaining),  # type: ignore[call-overload]
                float(reset_after),  # type: ignore[arg-type]
                None if retry_after is None else float(retry_after),  # type: ignore[arg-type]
                rule.name,
                None if reason is None else _text(reason),  # type: ignore[arg-type]
                float(available),  # type: ignore[arg-type]
            )
        )
        i += 6
    verdict = Verdict(bool(reply[1]), most_restrictive(decisions), tuple(decisions))
    return float(reply[0]), verdict  # type: ignore[arg-type]
