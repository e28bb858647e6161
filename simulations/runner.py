"""Run a scenario: arrivals, ring timeline, every mode (in parallel), report.

Modes are independent given the arrivals and the ring timeline, so they run
in worker processes forked after both are built (the workers inherit them,
nothing is pickled on the way in) and send back their per-arrival verdicts.
A mode's result does not depend on which worker ran it or in which order,
so parallel and serial runs give identical reports.
"""

from __future__ import annotations

import multiprocessing
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from .arrivals import Arrivals, generate
from .metrics import build_report
from .modes import ModeResult, complete, decisions_needed, run_mode
from .pool import fork_pool
from .scenario import Scenario
from .timeline import Timeline, build_timeline

#: Below this many decisions (arrivals x modes) forking workers is not worth it.
PARALLEL_THRESHOLD = 2_000_000
#: Relative cost of one decision per mode (replication and routing overheads),
#: used to start the heaviest modes first so that the workers finish together.
_COST = {
    "global": 1.0,
    "round_robin": 1.1,
    "replica": 1.8,
    "reset": 1.3,
    "conservative": 1.3,
    "leases": 2.5,
}


@dataclass
class SimulationResult:
    scenario: Scenario
    arrivals: Arrivals
    timeline: Timeline
    results: dict[str, ModeResult]
    report: dict[str, Any]


class Progress:
    """A progress bar on stderr: redrawn in place on a terminal, a line per 10% otherwise."""

    def __init__(self, total: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = max(1, total)
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = self.enabled and self.stream.isatty()
        self.started = time.perf_counter()
        self.last_draw = 0.0
        self.last_tenth = -1

    def update(self, done: int, *, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.perf_counter()
        if not force and now - self.last_draw < 0.2:
            return
        self.last_draw = now
        share = min(1.0, done / self.total)
        elapsed = now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - done) / rate if rate > 0 else 0.0
        width = 30
        filled = int(share * width)
        line = (
            f"[{'#' * filled}{'.' * (width - filled)}] {share:6.1%} "
            f"{done / 1e6:7.2f}M/{self.total / 1e6:.2f}M decisions "
            f"{rate / 1e6:5.2f}M/s ETA {eta:4.0f}s"
        )
        if self.tty:
            self.stream.write("\r" + line)
            self.stream.flush()
        else:
            tenth = int(share * 10)
            if tenth > self.last_tenth:
                self.last_tenth = tenth
                self.stream.write(line + "\n")
                self.stream.flush()

    def finish(self, done: int) -> None:
        self.update(done, force=True)
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


def say(message: str, enabled: bool = True) -> None:
    if enabled:
        print(message, file=sys.stderr, flush=True)


# The workers' view of the run, set before forking so that children inherit it.
_SHARED: tuple[Timeline, Arrivals, Any, bool] | None = None


def _worker(mode: str, slot: int) -> ModeResult:
    assert _SHARED is not None, "worker started without shared state (needs the fork start method)"
    timeline, arrivals, counters, full = _SHARED

    def progress(n: int) -> None:
        counters[slot] += n

    return run_mode(mode, timeline, arrivals, progress, full)


def _run_parallel(
    modes: list[str], timeline: Timeline, arrivals: Arrivals, jobs: int, bar: Progress, full: bool
) -> dict[str, ModeResult] | None:
    """The modes on ``jobs`` workers; None if they could not be forked."""
    global _SHARED
    ctx = multiprocessing.get_context("fork")
    counters = ctx.RawArray("q", len(modes))
    _SHARED = (timeline, arrivals, counters, full)
    try:
        # A worker runs modes until none is left (see fork_pool): retired after
        # one mode each, they were replaced by forks of this whole process from
        # the pool's thread, only to be ended with the pool.
        workers = fork_pool(jobs)
        if workers is None:
            return None
        with workers:
            pending = [workers.pool.apply_async(_worker, (mode, i)) for i, mode in enumerate(modes)]
            done = workers.gather(pending, tick=lambda: bar.update(sum(counters)))
            results = dict(zip(modes, done, strict=True))
    finally:
        _SHARED = None
    bar.finish(sum(counters))
    return results


def _run_serial(
    modes: list[str], timeline: Timeline, arrivals: Arrivals, bar: Progress, full: bool
) -> dict[str, ModeResult]:
    done = [0]

    def progress(n: int) -> None:
        done[0] += n
        bar.update(done[0])

    results = {mode: run_mode(mode, timeline, arrivals, progress, full) for mode in modes}
    bar.finish(done[0])
    return results


def default_jobs(decisions: int, modes: int) -> int:
    if decisions < PARALLEL_THRESHOLD:
        return 1
    return max(1, min(modes, os.cpu_count() or 1))


def simulate(
    scenario: Scenario,
    *,
    seed: int | None = None,
    jobs: int | None = None,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    full: bool = False,
) -> SimulationResult:
    """Run every mode of ``scenario`` on the same arrivals and score them.

    ``full`` makes sticky modes decide every arrival rather than only those of
    users some change moves (same results, slower; see :mod:`simulations.modes`).
    """
    if seed is not None:
        scenario = scenario.with_seed(seed)
    note = log or (lambda _m: None)
    t0 = time.perf_counter()
    cores = os.cpu_count() or 1
    expected = scenario.arrivals.rate * scenario.duration
    arrivals = generate(scenario, jobs=(jobs or cores) if expected > PARALLEL_THRESHOLD else 1)
    t1 = time.perf_counter()
    note(
        f"arrivals: {len(arrivals):,} requests from {scenario.users.count:,} users "
        f"in {t1 - t0:.1f}s"
    )
    owner_jobs = jobs if jobs is not None else cores
    if scenario.users.count * len(scenario.events) < 200_000:
        owner_jobs = 1
    timeline = build_timeline(scenario, jobs=owner_jobs)
    t2 = time.perf_counter()
    note(
        f"ring: {len(timeline.epochs)} epochs x {scenario.users.count:,} owner lookups "
        f"in {t2 - t1:.1f}s"
    )
    needed = {m: decisions_needed(m, timeline, arrivals, full) for m in scenario.modes}
    modes = sorted(needed, key=lambda m: -needed[m] * _COST.get(m, 1.2))
    verdicts = len(arrivals) * len(modes)
    decisions = sum(needed.values())
    if jobs is None:
        # several rules go through MemoryStore.check and decide_all: a few times slower
        jobs = default_jobs(decisions * (1 if len(scenario.rules) == 1 else 4), len(modes))
    jobs = max(1, min(jobs, len(modes)))
    if jobs > 1 and "fork" not in multiprocessing.get_all_start_methods():
        jobs = 1
    bar = Progress(decisions, enabled=progress)
    parallel = _run_parallel(modes, timeline, arrivals, jobs, bar, full) if jobs > 1 else None
    if parallel is None:
        jobs = 1
        results = _run_serial(modes, timeline, arrivals, bar, full)
    else:
        results = parallel
    t3 = time.perf_counter()
    reference = results["global"]
    results = {m: complete(results[m], reference, timeline) for m in scenario.modes}
    modes_s = t3 - t2
    note(
        f"modes: {decisions:,} simulated decisions in {modes_s:.1f}s "
        f"= {decisions / modes_s if modes_s else 0:,.0f} decisions/s ({jobs} worker(s)); "
        f"{verdicts:,} verdicts ({len(arrivals):,} arrivals x {len(modes)} modes)"
    )
    run: dict[str, Any] = {
        "decisions": decisions,
        "verdicts": verdicts,
        "full": full,
        "workers": jobs,
        "arrivals_s": round(t1 - t0, 3),
        "ring_s": round(t2 - t1, 3),
        "modes_s": round(modes_s, 3),
        "decisions_per_s": round(decisions / modes_s) if modes_s else None,
        "per_mode": {
            m: {
                "seconds": round(r.seconds, 3),
                "decisions": r.decisions,
                "decisions_per_s": round(r.decisions / r.seconds) if r.seconds else None,
            }
            for m, r in results.items()
        },
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    report = build_report(scenario, timeline, arrivals, results, run, jobs=jobs)
    t4 = time.perf_counter()
    run["metrics_s"] = round(t4 - t3, 3)
    run["total_s"] = round(t4 - t0, 3)
    return SimulationResult(scenario, arrivals, timeline, results, report)
