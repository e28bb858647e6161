"""Decisions per second and memory per key of the engine, next to the ``limits`` library.

Run: ``python -m benchmarks.engine [--seconds N] [--json OUT]`` (not part of the
test suite; takes about 1.5-2 minutes by default).

Throughput. Each engine decides the same requests: one rule ("100/minute"),
``--keys`` keys ("user:NNNNNNN") hit round-robin, ``--hits`` times each, on a
fresh store, after one untimed pass that creates the keys. At 11 hits per key
(of 100 allowed per minute) every engine allows every request, so each
measures the same (allowed) path whatever its speed. This engine goes through
``MemoryStore.check``, the node's real path, reading a moving clock
(``time.time``) per decision as ``MemoryBackend.check`` does; ``limits`` runs
``hit()`` on its in-memory strategies, which read ``time.time`` themselves.
The machine is shared and noisy, so runs are interleaved (every round runs
every engine once, in alternating order) and the report gives medians, and
for each comparison the median and range of the per-round ratios.

Memory. For each algorithm: ``--memory-keys`` keys, one request each, in a
fresh store, measured with tracemalloc (the key strings are built before
tracing starts; their own size is added in the "with key" column, since the
store is what keeps them alive). tracemalloc slows allocation several times,
so this part takes most of the run. ``--rss`` adds the resident-memory growth
of the same store built untraced.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable

import limits
from limits.storage import MemoryStorage
from limits.strategies import (
    FixedWindowRateLimiter,
    MovingWindowRateLimiter,
    SlidingWindowCounterRateLimiter,
)

from node.rules import ALGORITHMS, parse_rule
from node.store import MemoryStore

RATE = "100/minute"

OURS = {name: name for name in ALGORITHMS}
THEIRS = {
    "limits:fixed_window": FixedWindowRateLimiter,
    "limits:moving_window": MovingWindowRateLimiter,
    "limits:sliding_window_counter": SlidingWindowCounterRateLimiter,
}
#: (ours, theirs, target ratio). The brief set no target for the last two: 1x there
#: means "not slower than the library's version of the same algorithm".
COMPARISONS = [
    ("token_bucket", "limits:fixed_window", 5.0),
    ("gcra", "limits:fixed_window", 5.0),
    ("sliding_log", "limits:moving_window", 3.0),
    ("fixed_window", "limits:fixed_window", 1.0),
    ("sliding_window", "limits:sliding_window_counter", 1.0),
]
MEMORY_TARGETS = {"token_bucket": 200.0}


def make_keys(n: int) -> list[str]:
    return [f"user:{i:07d}" for i in range(n)]


# --------------------------------------------------------------------------- throughput


def ours_runner(algorithm: str) -> Callable[[list[str], int], float]:
    def run(keys: list[str], hits: int) -> float:
        rule = parse_rule(RATE, algorithm=algorithm)
        rules = (rule,)
        store = MemoryStore()
        check = store.check
        clock = time.time
        for key in keys:  # untimed: create the keys
            check(key, rules, clock(), 1)
        gc.collect()
        perf = time.perf_counter
        start = perf()
        for _ in range(hits):
            for key in keys:
                check(key, rules, clock(), 1)
        elapsed = perf() - start
        return hits * len(keys) / elapsed

    return run


def theirs_runner(strategy: type) -> Callable[[list[str], int], float]:
    def run(keys: list[str], hits: int) -> float:
        item = limits.parse(RATE)
        storage = MemoryStorage()
        hit = strategy(storage).hit
        for key in keys:
            hit(item, key)
        gc.collect()
        perf = time.perf_counter
        start = perf()
        for _ in range(hits):
            for key in keys:
                hit(item, key)
        elapsed = perf() - start
        storage.timer.cancel()
        return hits * len(keys) / elapsed

    return run


def measure_throughput(
    keys: list[str], hits: int, budget: float, min_rounds: int, max_rounds: int
) -> dict[str, list[float]]:
    runners: dict[str, Callable[[list[str], int], float]] = {}
    runners.update({name: ours_runner(alg) for name, alg in OURS.items()})
    runners.update({name: theirs_runner(cls) for name, cls in THEIRS.items()})
    names = list(runners)
    results: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    rounds = max_rounds
    for r in range(max_rounds):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            results[name].append(runners[name](keys, hits))
        spent = time.perf_counter() - started
        if r == 0:
            rounds = int(min(max_rounds, max(min_rounds, budget // max(spent, 1e-9))))
            print(f"  round 1 took {spent:.1f}s; running {rounds} rounds", flush=True)
        else:
            print(f"  round {r + 1}/{rounds} done ({spent:.0f}s)", flush=True)
        if r + 1 >= rounds:
            break
    return results


# --------------------------------------------------------------------------- memory


def measure_memory(algorithm: str, keys: list[str]) -> float:
    """Traced bytes per key of a store holding one state per key (keys not counted)."""
    rule = parse_rule(RATE, algorithm=algorithm)
    rules = (rule,)
    gc.collect()
    tracemalloc.start()
    try:
        store = MemoryStore()
        check = store.check
        now = 1_700_000_000.0
        for key in keys:
            now += 1e-6  # a moving clock: every state gets its own float
            check(key, rules, now, 1)
        assert len(store) == len(keys)
        current, _peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del store, check
    gc.collect()
    return current / len(keys)


def _rss() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * 4096


def _rss_child(algorithm: str, n: int) -> float:
    keys = make_keys(n)
    rule = parse_rule(RATE, algorithm=algorithm)
    rules = (rule,)
    gc.collect()
    before = _rss()
    store = MemoryStore()
    check = store.check
    now = 1_700_000_000.0
    for key in keys:
        now += 1e-6
        check(key, rules, now, 1)
    gc.collect()
    return (_rss() - before) / n


def measure_rss(algorithm: str, n: int) -> float:
    """Resident-memory growth per key of the same store, untraced (Linux only).

    tracemalloc counts requested sizes; pymalloc hands out 16-byte-aligned blocks (a
    24-byte float takes 32) and keeps freed arenas, so this runs in a fresh interpreter.
    """
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.engine", "--rss-child", algorithm, str(n)],
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip())


# --------------------------------------------------------------------------- report


def mark(ok: bool) -> str:
    return "pass" if ok else "SHORT"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--seconds", type=float, default=30.0, help="time budget of the throughput part"
    )
    parser.add_argument("--json", metavar="OUT", help="also write the results to OUT")
    parser.add_argument("--keys", type=int, default=10_000, help="keys hit round-robin")
    parser.add_argument("--hits", type=int, default=10, help="timed hits per key per run")
    parser.add_argument("--min-rounds", type=int, default=3)
    parser.add_argument("--max-rounds", type=int, default=15)
    parser.add_argument(
        "--memory-keys", type=int, default=1_000_000, help="keys for bytes/key (0: skip)"
    )
    parser.add_argument(
        "--rss", action="store_true", help="also measure resident memory per key (slower)"
    )
    parser.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rss_child:
        print(_rss_child(args.rss_child[0], int(args.rss_child[1])))
        return 0

    print(
        f"ringlimit engine vs limits {limits.__version__}; Python {platform.python_version()}; "
        f"rule {RATE}; {args.keys} keys x {args.hits} hits per run",
        flush=True,
    )
    keys = make_keys(args.keys)
    runs = measure_throughput(keys, args.hits, args.seconds, args.min_rounds, args.max_rounds)
    medians = {name: statistics.median(v) for name, v in runs.items()}

    print("\nDecisions per second (median over rounds; min-max)")
    for name, values in runs.items():
        print(f"  {name:32s} {medians[name]:>12,.0f}   ({min(values):,.0f}-{max(values):,.0f})")

    print("\nRatios (ours / limits): median of per-round ratios [range]; ratio of medians")
    ratios = []
    for ours, theirs, target in COMPARISONS:
        per_round = [a / b for a, b in zip(runs[ours], runs[theirs], strict=True)]
        ratio = statistics.median(per_round)
        of_medians = medians[ours] / medians[theirs]
        ok = ratio >= target
        ratios.append(
            {
                "ours": ours,
                "theirs": theirs,
                "target": target,
                "ratio": ratio,
                "ratio_of_medians": of_medians,
                "per_round": per_round,
                "pass": ok,
            }
        )
        print(
            f"  {ours:15s} vs {theirs:30s} {ratio:5.2f}x [{min(per_round):.2f}-"
            f"{max(per_round):.2f}]; {of_medians:5.2f}x   target >= {target:g}x  {mark(ok)}"
        )

    memory: dict[str, dict[str, float | bool | None]] = {}
    if args.memory_keys:
        n = args.memory_keys
        print(f"\nMemory per key at {n:,} keys (tracemalloc; one request per key)", flush=True)
        mem_keys = make_keys(n)
        key_bytes = statistics.mean(sys.getsizeof(k) for k in mem_keys[:1000])
        for algorithm in ALGORITHMS:
            per_key = measure_memory(algorithm, mem_keys)
            target = MEMORY_TARGETS.get(algorithm)
            total = per_key + key_bytes
            ok = None if target is None else total < target
            rss = measure_rss(algorithm, n) if args.rss else None
            memory[algorithm] = {
                "store_bytes_per_key": per_key,
                "key_string_bytes": key_bytes,
                "with_key_bytes_per_key": total,
                "rss_store_bytes_per_key": rss,
                "target": target,
                "pass": ok,
            }
            verdict = "" if target is None else f"target < {target:g}  {mark(bool(ok))}"
            extra = "" if rss is None else f" (RSS: {rss:.0f} in the store)"
            print(
                f"  {algorithm:15s} {per_key:7.1f} B/key in the store, {total:7.1f} with the "
                f"key string{extra}  {verdict}",
                flush=True,
            )

    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(
                {
                    "python": platform.python_version(),
                    "limits": limits.__version__,
                    "rule": RATE,
                    "keys": args.keys,
                    "hits_per_key": args.hits,
                    "throughput": {
                        name: {"median": medians[name], "runs": runs[name]} for name in runs
                    },
                    "ratios": ratios,
                    "memory": memory,
                },
                out,
                indent=2,
            )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
