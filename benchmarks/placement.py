"""Where the benchmark's processes run: ``ringlimit bench --pin``.

Unpinned, the kernel spreads the load generator, the routers and the nodes
over the CPUs as it likes, and on a small machine they keep displacing each
other. On the 2-core machine of docs/performance.md ("Where the processes
run") the nodes on one CPU, and the load generator and the router on the
other, was the best of the five placements tried by hand (1.17-1.32x the
sticky requests per second of none; the others 0.55-1.05x); in ``ringlimit
bench``, six interleaved pairs, it gave 0.93-1.20x (median 1.06x). So
``--pin`` splits this process's CPUs in two *tiers*, as an operator running
router and nodes on one host would give each its own cores:

* the **front**: load generators (wrk, the built-in one, the gRPC one) and
  routers, which talk to each other;
* the **back**: nodes, redis-server and the applications of the comparison
  rows (slowapi's uvicorn workers), which the front talks to.

Every row of a run is placed by the same rule, the floor's included (wrk in
the front, its node in the back), so a ratio compares placements of the same
kind. The benchmark's own process is left where it is: it waits while a row
runs.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

#: Tier names, as the report's metadata says them.
FRONT, BACK = "front", "back"

#: Programs of the back tier, by the name of the file run (``redis-server``).
_BACK_PROGRAMS = frozenset({"redis-server"})


@dataclass(frozen=True)
class Placement:
    """The CPUs of each tier."""

    front: frozenset[int]
    back: frozenset[int]

    @classmethod
    def split(cls, cpus: Collection[int]) -> Placement:
        """``cpus`` in two: the lower half (rounded up) for the front, the rest for
        the back. ``ValueError`` (one line) with fewer than two."""
        ordered = sorted(cpus)
        if len(ordered) < 2:
            raise ValueError(
                f"--pin needs at least 2 CPUs to split in two tiers; this process may use "
                f"{len(ordered)}"
            )
        half = (len(ordered) + 1) // 2
        return cls(frozenset(ordered[:half]), frozenset(ordered[half:]))

    @classmethod
    def of_this_process(cls) -> Placement:
        """This process's CPUs in two; ``ValueError`` (one line) without
        ``taskset`` (util-linux), which places the children."""
        if shutil.which("taskset") is None:
            raise ValueError("--pin needs taskset (util-linux) on the PATH")
        return cls.split(os.sched_getaffinity(0))

    def tier(self, argv: Sequence[str]) -> str:
        """The tier of a process run as ``argv``: a ringlimit node, a redis-server
        or an application server is the back; anything else (a router, a load
        generator) the front."""
        if Path(argv[0]).name in _BACK_PROGRAMS:
            return BACK
        if "-m" in argv:
            module = argv[argv.index("-m") + 1 :][:2]
            if module[:1] == ["uvicorn"]:
                return BACK  # an application served for a comparison row
            if module == ["router", "node"]:
                return BACK  # a ringlimit node (router/processes.py ringlimit_argv)
        return FRONT

    def cpus(self, argv: Sequence[str]) -> frozenset[int]:
        return self.front if self.tier(argv) == FRONT else self.back

    def pinned(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run on its tier's CPUs."""
        return pinned_argv(self.cpus(argv), argv)

    def to_dict(self) -> dict[str, list[int]]:
        return {FRONT: sorted(self.front), BACK: sorted(self.back)}


def pinned_argv(cpus: frozenset[int] | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run on ``cpus`` (as it is when None), through ``taskset``, which
    sets the affinity and then runs the program in its place (the same pid;
    every thread and child inherits it). Not a ``preexec_fn``: the benchmark
    has threads of its own, and a child forked from a process with threads
    may deadlock before it runs anything."""
    if cpus is None:
        return list(argv)
    return ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus))), *argv]
