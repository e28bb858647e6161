"""Arrivals: when requests come and from whom, generated with numpy in chunks.

Every mode is fed the very same arrays, so the modes differ only in how they
decide. The arrays depend on the scenario and the seed alone (never on the
machine, the number of worker processes or the chunking of the modes): the
seed feeds ``SeedSequence`` streams, one for the rate timeline and one per
chunk of arrivals (times, then users), so chunks can be made in parallel.
(numpy does not promise the same streams across its major versions; the
golden test would say so.)

Process. The aggregate arrival rate is piecewise constant: one piece for
``poisson``; for ``bursty`` a two-state Markov-modulated Poisson process that
alternates calm and burst periods of exponential length (mean
``burst_duration`` for bursts, ``burst_duration * (1 - f) / f`` for calm,
``f = burst_fraction``), the burst rate being ``burst_factor`` times the calm
rate and both scaled so that the long-run mean is ``rate``. Within a piece
of constant rate, the number of arrivals is Poisson and their times are
uniform: exactly a Poisson process, and easy to cut into chunks.

Users. ``uniform`` draws user indices uniformly; ``zipf`` draws rank ``k``
(1-based) with probability proportional to ``1 / k**exponent`` over exactly
``count`` users (a finite Zipf, unlike ``numpy.random.zipf``). User index
``i`` is the user id ``user-<i>``; low indices are the popular ones. With
``hot_users = h`` and ``hot_share = s``, a share ``s`` of all requests is
redirected to the ``h`` first users, uniformly among them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .pool import map_in_workers
from .scenario import Scenario

#: Expected arrivals per generated chunk (bounds the temporary arrays).
CHUNK_ARRIVALS = 500_000


@dataclass(frozen=True)
class Arrivals:
    """``times`` (absolute virtual seconds, sorted) and ``users`` (indices), same length."""

    times: np.ndarray
    users: np.ndarray

    def __len__(self) -> int:
        return int(self.times.shape[0])


def user_name(index: int) -> str:
    """The key the ring hashes for user ``index``."""
    return f"user-{index}"


def rate_pieces(scenario: Scenario, rng: np.random.Generator) -> list[tuple[float, float, float]]:
    """``(start, end, rate)`` pieces covering the run, in relative seconds."""
    spec = scenario.arrivals
    duration = scenario.duration
    if spec.process == "poisson":
        return [(0.0, duration, spec.rate)]
    f = spec.burst_fraction
    calm_rate = spec.rate / (1.0 - f + f * spec.burst_factor)
    burst_rate = calm_rate * spec.burst_factor
    mean_burst = spec.burst_duration
    mean_calm = spec.burst_duration * (1.0 - f) / f
    pieces: list[tuple[float, float, float]] = []
    t = 0.0
    bursting = bool(rng.random() < f)  # start in the stationary distribution
    while t < duration:
        length = float(rng.exponential(mean_burst if bursting else mean_calm))
        end = min(duration, t + length)
        if end > t:
            pieces.append((t, end, burst_rate if bursting else calm_rate))
        t = end
        bursting = not bursting
    return pieces


class _UserSampler:
    def __init__(self, scenario: Scenario) -> None:
        spec = scenario.users
        self.count = spec.count
        self.hot_users = spec.hot_users
        self.hot_share = spec.hot_share
        self.cdf: np.ndarray | None = None
        if spec.popularity == "zipf":
            ranks = np.arange(1, spec.count + 1, dtype=np.float64)
            weights = ranks ** (-spec.exponent)
            cdf = np.cumsum(weights)
            cdf /= cdf[-1]
            self.cdf = cdf

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.cdf is None:
            users = rng.integers(0, self.count, n, dtype=np.int64)
        else:
            users = np.searchsorted(self.cdf, rng.random(n), side="right")
            np.minimum(users, self.count - 1, out=users)
        if self.hot_share > 0:
            hot = rng.random(n) < self.hot_share
            users[hot] = rng.integers(0, self.hot_users, int(hot.sum()), dtype=np.int64)
        return users.astype(np.int32, copy=False)


def _chunks(scenario: Scenario, seed: int) -> list[tuple[float, float, float, int]]:
    """``(start, end, rate, number)``: the run cut in chunks of constant rate."""
    rate_rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,)))
    out: list[tuple[float, float, float, int]] = []
    for lo, hi, rate in rate_pieces(scenario, rate_rng):
        length = hi - lo
        pieces = max(1, int(np.ceil(rate * length / CHUNK_ARRIVALS)))
        step = length / pieces
        for k in range(pieces):
            a = lo + k * step
            b = hi if k == pieces - 1 else lo + (k + 1) * step
            out.append((a, b, rate, len(out)))
    return out


def _chunk(
    scenario: Scenario, sampler: _UserSampler, seed: int, chunk: tuple[float, float, float, int]
) -> tuple[np.ndarray, np.ndarray]:
    """One chunk's arrivals, from a stream of its own (so chunks can be made in any order)."""
    a, b, rate, number = chunk
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1, number)))
    n = int(rng.poisson(rate * (b - a)))
    times = np.sort(rng.random(n))
    times *= b - a
    times += scenario.clock_start + a
    return times, sampler.draw(rng, n)


# Set around map_in_workers: forked workers inherit it.
_SHARED: tuple[Scenario, _UserSampler, int] | None = None


def _chunk_in_worker(chunk: tuple[float, float, float, int]) -> tuple[np.ndarray, np.ndarray]:
    assert _SHARED is not None
    scenario, sampler, seed = _SHARED
    return _chunk(scenario, sampler, seed, chunk)


def generate(scenario: Scenario, seed: int | None = None, jobs: int = 1) -> Arrivals:
    """All arrivals of the run, deterministic for ``(scenario, seed)``.

    Each chunk draws from its own stream (``SeedSequence(seed, spawn_key=(1, k))``)
    so that ``jobs`` > 1 forked processes give the very same arrays.
    """
    global _SHARED
    seed = scenario.seed if seed is None else seed
    sampler = _UserSampler(scenario)
    chunks = _chunks(scenario, seed)
    _SHARED = (scenario, sampler, seed)
    try:
        parts = map_in_workers(_chunk_in_worker, chunks, jobs)
    finally:
        _SHARED = None
    parts = [(t, u) for t, u in parts if t.size]
    if not parts:
        return Arrivals(np.empty(0, dtype=np.float64), np.empty(0, dtype=np.int32))
    all_times = np.concatenate([t for t, _ in parts])
    # Chunks are disjoint and in order; clamp float rounding at the chunk edges.
    np.maximum.accumulate(all_times, out=all_times)
    np.minimum(all_times, np.nextafter(scenario.end, -np.inf), out=all_times)
    return Arrivals(all_times, np.concatenate([u for _, u in parts]))
