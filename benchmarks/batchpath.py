"""A node's CPU per decision on the decision API's batch path, in process.

One node of an in-process two-node cluster (router/testing.py) answers
batches of 100 checks of keys it owns (10,000 users over the two nodes, as
in the bench's batch row), straight through ``Node._answer_checks``: the
body's decoding, the ownership checks, the decisions, metrics and top keys,
and the encoded answer; no sockets, no router. What it leaves out (HTTP, the
event loop's I/O) is the same before and after a change to that path, so two
commits compare side by side here without the cluster's noise.

Run: ``python -m benchmarks.batchpath [--batches N] [--rounds R]``, which
prints nanoseconds per decision (the fastest round and the median). For a
figure that the machine's load cannot move, count instructions: run it under
``valgrind --tool=callgrind`` with two values of ``--batches`` and ``--rounds
1``, and divide the difference of the two totals by the difference of the
decisions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Callable, Coroutine
from typing import Any

from node.config import ClusterConfig
from router.testing import InProcessCluster

CONFIG = {"rules": [{"name": "bench", "limit": 1000, "period": "1s"}]}
USERS = 10_000
BATCH = 100
#: Distinct bodies, sent round-robin (so the answers' keys vary as in the bench).
BODIES = 50


async def measure(batches: int, rounds: int) -> list[float]:
    """Seconds per decision of each round of ``batches`` batches."""
    async with InProcessCluster(2, ClusterConfig.from_dict(CONFIG)) as cluster:
        node = cluster.nodes["n1"]
        view = cluster.router.membership.view
        keys = [f"user:{i}" for i in range(USERS) if view.owner_id(f"user:{i}") == "n1"]
        bodies = [
            json.dumps(
                {
                    "checks": [
                        {"key": keys[(b * BATCH + j) % len(keys)], "rule": "bench"}
                        for j in range(BATCH)
                    ]
                }
            ).encode()
            for b in range(BODIES)
        ]
        answer = node._answer_checks
        status, _, payload = await answer(bodies[0])
        if status != 200:
            raise RuntimeError(f"the node refused the batch: {payload[:300]!r}")
        seconds: list[float] = []
        for _ in range(rounds):
            started = time.perf_counter()
            for i in range(batches):
                await answer(bodies[i % BODIES])
            seconds.append((time.perf_counter() - started) / (batches * BATCH))
        return seconds


def main(argv: list[str] | None = None) -> None:
    run("python -m benchmarks.batchpath", __doc__, measure, argv)


def run(
    prog: str,
    doc: str | None,
    measure: Callable[[int, int], Coroutine[Any, Any, list[float]]],
    argv: list[str] | None,
) -> None:
    """The command line of a batch path's measurement (this one, and the router's
    benchmarks/batchroute.py): ``measure(batches, rounds)`` gives seconds per decision."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    parser.add_argument("--batches", type=int, default=200, help="batches per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    per = asyncio.run(measure(args.batches, args.rounds))
    print(
        f"{min(per) * 1e9:,.0f} ns per decision (fastest of {len(per)} rounds; "
        f"median {statistics.median(per) * 1e9:,.0f})"
    )


if __name__ == "__main__":
    main()
