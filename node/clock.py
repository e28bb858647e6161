"""Clocks are passed in, never read inside an algorithm.

The engine works in float seconds. Wall-clock time (``time.time``) is the
default because fixed and sliding-counter windows are aligned to multiples of
their period, and users expect a per-minute window to start on the minute.
Tests and simulations use :class:`FrozenClock` and move time explicitly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

Clock = Callable[[], float]


#: ``time.time`` itself, not a function that calls it: a node reads it twice on
#: every request (the decision's time, the legacy reset's Unix time), and a
#: Python frame around the C call cost more than the call.
system_clock: Clock = time.time


def boot_clock() -> float:
    """A monotonic clock that keeps counting while the host sleeps (Linux), so a
    suspended machine wakes with its leases expired, as they are at the router."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return time.monotonic()


class FrozenClock:
    """A clock that only moves when told to: deterministic tests without sleeps."""

    __slots__ = ("now",)

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = float(start)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a frozen clock only moves forward; use set() to rewind")
        self.now += seconds
        return self.now

    def set(self, now: float) -> None:
        self.now = float(now)
