"""Decisions per second, from samples of a running total.

A node samples its decision counters once per sweep (about every second)
and answers the rate over the last ``span`` seconds, so any router (or
several) can ask at any time and get the same figure: no state on the
asker's side, no first-poll gap.
"""

from __future__ import annotations

from collections import deque


class RateMeter:
    """A running total's rate over roughly the last ``span`` seconds."""

    def __init__(self, span: float = 10.0, now: float = 0.0, total: float = 0.0) -> None:
        if span <= 0:
            raise ValueError(f"span must be positive, got {span}")
        self.span = span
        self._samples: deque[tuple[float, float]] = deque([(now, total)], maxlen=4096)

    def sample(self, now: float, total: float) -> None:
        samples = self._samples
        if samples and now < samples[-1][0]:
            # The clock went back: older samples would give a negative interval.
            samples.clear()
        samples.append((now, total))
        # Keep the newest sample at least ``span`` old, so the rate spans ``span``.
        while len(samples) > 2 and samples[1][0] <= now - self.span:
            samples.popleft()

    def rate(self, now: float, total: float) -> float:
        """Per second between the oldest kept sample and (``now``, ``total``)."""
        then, before = self._samples[0]
        elapsed = now - then
        if elapsed <= 0 or total < before:
            return 0.0
        return (total - before) / elapsed
