"""Measuring one row of ``ringlimit bench``: CPU seconds from /proc, and a timed run.

CPU per request is each process's ``utime + stime`` from ``/proc/<pid>/stat``
(descendants included: uvicorn and router workers) across the run, divided by
the requests answered.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks.deployments import BATCH, Row, Settings
from benchmarks.loadgen import Load, LoadResult
from benchmarks.loadgen import run as run_load

# --------------------------------------------------------------------------- CPU


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime in seconds) of a process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15.
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: Sequence[int]) -> float:
    """CPU seconds used so far by ``pids`` and all their descendants (uvicorn workers)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = _stat(int(entry))
            if found is not None:
                stats[int(entry)] = found
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        children.setdefault(ppid, []).append(pid)
    total, seen, todo = 0.0, set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo.extend(children.get(pid, ()))
    return total


def rss(pid: int) -> int:
    """Resident set size of a process in bytes, from /proc/<pid>/statm."""
    with open(f"/proc/{pid}/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# --------------------------------------------------------------------------- measuring


@dataclass
class Run:
    """One timed run of one row."""

    load: LoadResult
    cpu: dict[str, float]  # role -> CPU seconds during the run
    decisions_per_request: int = 1

    @property
    def rps(self) -> float:
        return self.load.rps

    def cpu_us_per_request(self, role: str) -> float | None:
        if role not in self.cpu or not self.load.requests:
            return None
        return self.cpu[role] / self.load.requests * 1e6

    def to_dict(self) -> dict[str, Any]:
        return {
            "load": self.load.to_dict(),
            "cpu_seconds": self.cpu,
            "cpu_us_per_request": {r: self.cpu_us_per_request(r) for r in self.cpu},
        }


def measure(row: Row, load: Load, tool: str) -> Run:
    before = {role: cpu_seconds(pids) for role, pids in row.roles.items()}
    result = run_load(load, tool)
    after = {role: cpu_seconds(pids) for role, pids in row.roles.items()}
    if not load.count and row.limited:
        # Answers not read (cheaper for the load generator): every status >= 400 is a 429.
        result.allowed = result.requests - result.status_errors
        result.denied = result.status_errors
    return Run(result, {r: after[r] - before[r] for r in before}, row.decisions_per_request)


def row_load(row: Row, settings: Settings, prefix: str, duration: float) -> Load:
    return Load(
        url=row.url,
        mode=row.mode,
        users=settings.users,
        prefix=prefix,
        rule="bench",
        count=row.mode != "proxy",
        batch=BATCH,
        duration=duration,
        connections=settings.connections,
        hot_share=row.hot_share,
        cpus=settings.front_cpus(),
    )


def tight_load(row: Row, settings: Settings, prefix: str) -> Load:
    return Load(
        url=row.tight_url,
        mode=row.mode,
        users=settings.tight_users,
        prefix=prefix,
        rule="tight",
        count=True,
        batch=BATCH,
        duration=settings.tight_duration,
        connections=settings.connections,
        cpus=settings.front_cpus(),
    )
