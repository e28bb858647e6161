"""What the top-limited-keys sketch costs on the node's decision path.

Run: ``python -m benchmarks.topkeys [--rounds N]`` (not part of the test suite;
about 20 seconds).

The node's real path for a batch (``Authority.decide_many`` on the memory
backend) decides 100 checks per call, with the sketch (node/topkeys.py) and
without, in three streams: every check allowed far from its limit (the common
case: one comparison each), every check near its limit, and every check
denied (each one updates the sketch). The machine is shared and noisy, so
rounds are interleaved (each round runs both variants, in alternating order)
and the report gives the median time per check and the median and range of
the per-round ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from node.authority import Authority
from node.config import ClusterConfig, ScopedRule
from node.rules import Rule
from node.topkeys import TopKeys

BATCH = 100
CALLS = 200

#: stream -> (limit per hour, units spent per key before timing): far below the
#: limit, near it (5 % left), over it.
STREAMS = {"allowed": (10**9, 0), "near_limit": (1000, 950), "denied": (1, 1)}


def run(stream: str, with_top: bool) -> float:
    limit, spent = STREAMS[stream]
    config = ClusterConfig(rules=(ScopedRule(Rule("api", limit, 3600.0)),))
    rule = config.rule("api")
    assert rule is not None
    authority = Authority.in_memory(config)
    authority.top = TopKeys() if with_top else None
    checks = [(f"user:{i:07d}", (rule,), 1) for i in range(5000)]
    if spent:
        asyncio.run(authority.decide_many([(k, r, spent) for k, r, _ in checks]))
    batches = [checks[i : i + BATCH] for i in range(0, len(checks), BATCH)]

    async def timed() -> float:
        started = time.perf_counter()
        for i in range(CALLS):
            await authority.decide_many(batches[i % len(batches)])
        return time.perf_counter() - started

    return asyncio.run(timed()) / (CALLS * BATCH)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    print(f"{'stream':<12} {'off ns/check':>13} {'on ns/check':>12} {'on/off median':>14} range")
    for stream in STREAMS:
        off: list[float] = []
        on: list[float] = []
        for round_ in range(args.rounds):
            order = (False, True) if round_ % 2 == 0 else (True, False)
            for with_top in order:
                (on if with_top else off).append(run(stream, with_top))
        ratios = [b / a for a, b in zip(off, on, strict=True)]
        print(
            f"{stream:<12} {statistics.median(off) * 1e9:>13.0f} "
            f"{statistics.median(on) * 1e9:>12.0f} {statistics.median(ratios):>14.3f} "
            f"{min(ratios):.3f}-{max(ratios):.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
