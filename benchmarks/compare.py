"""Two versions of the code side by side on one in-process benchmark.

A change to a hot path is judged by what it does next to the code before it,
on the same machine at the same time: this machine is shared and its speed
drifts by more than most changes move (a floor of 28 us per request in one
hour, 33 in the next). So this runs a path benchmark (``requestpath``,
``forwardpath``, ``batchpath`` or ``batchroute``) alternately on two
versions, A B, B A, A B..., and reports for each series the median of each
side and the median (and range) of the per-pair ratios B/A, and, when a
benchmark prints several series (``requestpath``'s off, direct, routed),
each series against the first one, per side: the ratio the bench's node
targets are read from (limited over off).

``--instructions`` counts instructions instead, which the machine's load
cannot move: each version runs once under ``valgrind --tool=callgrind`` at
two request counts with ``PYTHONHASHSEED=0`` (dict layouts, so the counts,
otherwise vary by a few thousand between runs), and the difference of the
totals over the difference of the counts is the cost of one request (one
count per version: ``--pairs`` does not apply). Give it one series
(``--modes direct``): the totals cover everything a run does.

Versions are git revisions, exported with ``git archive`` into a temporary
directory (the repository is not touched), or ``.``: this checkout as it
is, uncommitted changes included. Each run imports its own version
(``PYTHONPATH``).

Run: ``python -m benchmarks.compare A [B] [--pairs N] [--instructions] --
BENCH [its options]``; B defaults to ``.``. For example ``python -m
benchmarks.compare HEAD -- requestpath --requests 20000 --rounds 3 --modes
off,direct``.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

from benchmarks.report import round_ratios

ROOT = Path(__file__).resolve().parent.parent
#: What each path benchmark prints: ``[series: ]N ns per <unit> (fastest ...``.
_LINE = re.compile(r"^(?:(?P<series>[\w-]+): )?(?P<ns>[\d,]+) ns per (?P<unit>\w+)", re.M)
#: The option that sets how much one run does, per benchmark (for --instructions).
COUNT_OPTION = {
    "requestpath": "--requests",
    "forwardpath": "--requests",
    "batchpath": "--batches",
    "batchroute": "--batches",
}
BENCHES = tuple(COUNT_OPTION)
RUN_TIMEOUT = 900.0


class CompareError(Exception):
    """Something this command needs is missing: one line says what."""


def parse(output: str) -> dict[str, float]:
    """Nanoseconds per request (the fastest round) of each series a benchmark printed."""
    found = {
        match["series"] or match["unit"]: float(match["ns"].replace(",", ""))
        for match in _LINE.finditer(output)
    }
    if not found:
        raise CompareError(f"no 'ns per' figure in the benchmark's output: {output[-300:]!r}")
    return found


def collected(stderr: str) -> int:
    """The instruction total callgrind reports at exit."""
    match = re.search(r"Collected : (\d+)", stderr)
    if match is None:
        raise CompareError(f"callgrind reported no total: {stderr[-300:]!r}")
    return int(match.group(1))


def last_line(text: str) -> str:
    """What a failed run said last (its error), not its whole traceback."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else "(nothing on stderr)"


def export(revision: str, into: Path) -> Path:
    """A tree of ``revision`` in the new folder ``into`` (``.``: this checkout as it is)."""
    if revision == ".":
        return ROOT
    try:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", "--format=tar", revision],
            capture_output=True,
            timeout=120,
        )
    except FileNotFoundError:
        raise CompareError("git is not installed; give '.' for this checkout") from None
    if archive.returncode != 0:
        said = last_line(archive.stderr.decode(errors="replace"))
        raise CompareError(f"git archive {revision}: {said}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(into, filter="data")
        else:  # pragma: no cover (git's own archive of this repository)
            tar.extractall(into)
    return into


def run(
    tree: Path, bench: str, argv: Sequence[str], *, under: Sequence[str] = (), seed: str = ""
) -> subprocess.CompletedProcess[str]:
    """``python -m benchmarks.<bench> argv`` on ``tree``'s code (``under``: a
    command it runs under, valgrind's), which must succeed."""
    args = [sys.executable, "-m", f"benchmarks.{bench}", *argv]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    if seed:
        env["PYTHONHASHSEED"] = seed
    done = subprocess.run(
        [*under, *args], cwd=tree, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    if done.returncode != 0:
        raise CompareError(f"{' '.join(args[1:])} failed: {last_line(done.stderr)}")
    return done


def run_once(tree: Path, bench: str, argv: Sequence[str]) -> dict[str, float]:
    """One run of ``bench`` on ``tree``'s code: ns per request by series."""
    return parse(run(tree, bench, argv).stdout)


def instructions(tree: Path, bench: str, argv: Sequence[str], counts: tuple[int, int]) -> float:
    """Instructions per request of ``bench`` on ``tree``'s code, under callgrind."""
    if shutil.which("valgrind") is None:
        raise CompareError("--instructions needs valgrind (apt-get install valgrind)")
    callgrind = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    totals = [
        collected(
            run(
                tree,
                bench,
                [*argv, COUNT_OPTION[bench], str(count), "--rounds", "1"],
                under=callgrind,
                seed="0",
            ).stderr
        )
        for count in counts
    ]
    return (totals[1] - totals[0]) / (counts[1] - counts[0])


def summary(a: list[dict[str, float]], b: list[dict[str, float]]) -> list[str]:
    """The report's lines: ``a`` and ``b`` are the runs of each side, in pairs."""
    series = [name for name in a[0] if all(name in each for each in (*a, *b))]
    if not series:
        raise CompareError(f"the two sides printed no series in common: {list(a[0])}, {list(b[0])}")
    lines = ["| series | A ns | B ns | B/A (median of pairs) | range |", "|---|---|---|---|---|"]
    for name in series:
        ratios = [y[name] / x[name] for x, y in zip(a, b, strict=True)]
        lines.append(
            f"| {name} | {statistics.median(x[name] for x in a):,.0f} "
            f"| {statistics.median(y[name] for y in b):,.0f} "
            f"| {statistics.median(ratios):.3f}x | {min(ratios):.3f}-{max(ratios):.3f}x |"
        )
    first = series[0]
    for name in series[1:]:
        side_a = round_ratios([x[name] for x in a], [x[first] for x in a])
        side_b = round_ratios([y[name] for y in b], [y[first] for y in b])
        lines.append(f"{name}/{first}: A {side_a:.3f}x, B {side_b:.3f}x (medians of runs)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.compare",
        usage="%(prog)s A [B] [--pairs N] [--instructions] -- BENCH [its options]",
        description=__doc__,
    )
    parser.add_argument("a", metavar="A", help="a git revision, or . (this checkout)")
    parser.add_argument("b", metavar="B", nargs="?", default=".", help="likewise (default .)")
    parser.add_argument("--pairs", type=int, default=5, help="interleaved pairs of runs")
    parser.add_argument("--instructions", action="store_true", help="count with callgrind")
    parser.add_argument(
        "--counts", default="2000,12000", help="the two request counts of --instructions"
    )
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        parser.parse_args(argv)  # --help, or a usage error of its own
        parser.error(f"give the benchmark after --, one of {', '.join(BENCHES)}, then its options")
    cut = argv.index("--")
    args = parser.parse_args(argv[:cut])
    if not argv[cut + 1 :] or argv[cut + 1] not in BENCHES:
        parser.error(f"after --: one of {', '.join(BENCHES)}, then its options")
    bench, options = argv[cut + 1], argv[cut + 2 :]
    if not 1 <= args.pairs <= 50:
        parser.error("--pairs must be between 1 and 50")
    try:
        low, high = (int(n) for n in args.counts.split(","))
    except ValueError:
        parser.error("--counts takes two numbers, like 2000,12000")
    if not 0 < low < high:
        parser.error("--counts: the first must be positive and below the second")
    try:
        with tempfile.TemporaryDirectory(prefix="ringlimit-compare-") as scratch:
            # A folder per side: two revisions never share one (HEAD~2 and HEAD^2).
            trees = [
                export(rev, Path(scratch) / side) for rev, side in ((args.a, "a"), (args.b, "b"))
            ]
            print(f"A = {args.a}, B = {args.b}: {bench} {' '.join(options)}")
            if args.instructions:
                for label, tree in zip("AB", trees, strict=True):
                    per = instructions(tree, bench, options, (low, high))
                    print(f"{label}: {per:,.0f} instructions per request")
                return 0
            runs: list[list[dict[str, float]]] = [[], []]
            for pair in range(args.pairs):
                # A B, then B A: neither side always runs second (warmer, or later in a drift).
                for side in (0, 1) if pair % 2 == 0 else (1, 0):
                    runs[side].append(run_once(trees[side], bench, options))
            print(f"{args.pairs} interleaved pairs (the fastest round of each run):")
            print("\n".join(summary(runs[0], runs[1])))
    except CompareError as exc:
        print(f"compare: {exc}", file=sys.stderr)
        return 2
    except subprocess.TimeoutExpired as exc:
        cmd = " ".join(map(str, exc.cmd)) if isinstance(exc.cmd, list) else str(exc.cmd)
        print(f"compare: a run took over {exc.timeout:.0f} s: {cmd}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
