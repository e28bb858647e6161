"""When ``ringlimit up`` restarts a node that exited: a pure function of (policy,
history, exit, now).

A supervisor that restarts whatever exits, at once and forever, turns a node
that cannot start (its port taken, a bad flag) into a busy loop, and a node
that crashes every few seconds into a stream of ring changes, each of which
costs its users a crash policy. So restarts back off (the delay doubles with
every restart in the window) and are bounded (at most ``max_restarts`` within
any ``window`` seconds; past that the node stays down and the cluster serves
without it). See docs/rebalancing.md, "Under ringlimit up".
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import dataclass

#: ``always``: restart nodes that crashed and nodes that left gracefully (a rolling
#: restart: each comes back empty and rejoins); ``on-crash``: only crashed ones;
#: ``never``: report only.
RESTART_MODES = ("always", "on-crash", "never")


@dataclass(frozen=True)
class RestartPolicy:
    mode: str = "always"
    max_restarts: int = 5
    window: float = 60.0
    backoff: float = 0.5
    max_backoff: float = 8.0

    def __post_init__(self) -> None:
        if self.mode not in RESTART_MODES:
            raise ValueError(f"--restart must be one of {', '.join(RESTART_MODES)}")
        if self.max_restarts < 0 or self.window <= 0:
            raise ValueError("restart budget: max_restarts >= 0 and window > 0")
        if not 0 <= self.backoff <= self.max_backoff:
            raise ValueError("restart backoff: 0 <= backoff <= max_backoff")


@dataclass(frozen=True)
class Decision:
    restart: bool
    #: Seconds to wait before the restart (0 when there is none).
    delay: float
    #: Why, in words for the one-line report.
    reason: str


def decide(
    policy: RestartPolicy, restarts: Sequence[float], *, graceful: bool, now: float
) -> Decision:
    """Whether (and after how long) to restart a process that just exited.

    ``restarts`` are the times of the earlier restarts decided for this process;
    ``graceful`` says it left the ring gracefully (SIGTERM, handoff done).
    """
    if policy.mode == "never":
        return Decision(False, 0.0, "not restarted (--restart never)")
    if graceful and policy.mode == "on-crash":
        return Decision(False, 0.0, "not restarted: it left gracefully (--restart on-crash)")
    recent = recent_restarts(policy, restarts, now)
    if len(recent) >= policy.max_restarts:
        return Decision(
            False,
            0.0,
            f"not restarted: already restarted {len(recent)} "
            f"{'time' if len(recent) == 1 else 'times'} within "
            f"{policy.window:g} s (the cluster goes on without it)",
        )
    delay = min(policy.max_backoff, policy.backoff * 2 ** len(recent))
    return Decision(
        True,
        delay,
        f"restarting it in {delay:g} s (restart {len(recent) + 1} of at most "
        f"{policy.max_restarts} within {policy.window:g} s)",
    )


def recent_restarts(policy: RestartPolicy, restarts: Sequence[float], now: float) -> list[float]:
    """The restarts that still count at ``now`` (within the policy's window): all
    :func:`decide` reads. A supervisor keeps only these: the times of every
    restart of a node that exits now and then, for as long as ``up`` runs,
    grew without bound and were all read at each exit."""
    return [t for t in restarts if now - t < policy.window]


def describe_exit(returncode: int) -> str:
    """``exited with code 1`` or ``killed by SIGKILL``, from a Popen return code."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"
