"""``ringlimit bench``: every deployment side by side, under the same load, on 127.0.0.1.

Rows (all started by this command, all stopped by it, also on Ctrl-C):

1. ``direct``       one node, limiter off (no rules): what one HTTP hop costs, the floor;
2. ``sticky``       router -> nodes, sticky routing, in-memory limiter (ringlimit);
3. ``redis``        router -> nodes (round-robin), every decision in one Redis (Lua),
                    the best version of that design: hiredis, and concurrent checks
                    coalesced into pipelined EVALSHA round trips (``--redis-pipeline on``);
   ``redis_naive``  the same, one EVALSHA round trip per check (``--redis-pipeline off``);
4. ``round_robin``  router -> nodes, round-robin, local limiters (reference only: each
                    node counts alone, so a user gets up to N times the limit);
5. ``slowapi``      what a Python user would deploy instead: Starlette + slowapi/limits
                    with Redis storage, one uvicorn process with two workers (the OS
                    spreads connections over them: round-robin without a router hop);
6. the decision API through the sticky router: single checks with coalescing on
   (``api_single``) and off (``api_single_nc``, a second router over the same
   nodes), and batches of 100 (``api_batch``).

Load: wrk with ``benchmarks/wrk_users.lua`` when installed, else the built-in
generator (``benchmarks/loadgen.py``); users drawn uniformly from a fixed
population (``--users``). Every row runs ``--repeats`` times, rounds interleaved
(alternating order), and the table gives medians; ratios are medians of
per-round ratios (this machine is shared and noisy: ratios measured side by
side matter, absolute numbers drift). CPU per request is each process's
``utime + stime`` from ``/proc/<pid>/stat`` (children included) across the run,
divided by the requests answered.

Exactness: a second, short run per row against a tight rule (``--tight-limit``
per hour, ``--tight-users`` fresh users, many requests each) must allow exactly
users x limit.

Then: the engine benchmark (``benchmarks.engine``: ours vs ``limits``), bytes
per token-bucket key at ``--memory-keys`` keys, and a handoff: ``--handoff-keys``
token-bucket states on node A, moved to node B by removing A gracefully.

``--quick`` shrinks everything (about a minute); the default takes a few minutes.

This module is the command (its options and the order of the steps); the
rows are started by benchmarks/deployments.py, measured by
benchmarks/measure.py, reported by benchmarks/report.py (pure), and the
handoff is benchmarks/handoff.py.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.deployments import (
    ROOT,
    ROWS,
    Processes,
    Settings,
    start_rows,
)
from benchmarks.handoff import run_handoff
from benchmarks.loadgen import run as run_load
from benchmarks.loadgen import wrk_available
from benchmarks.measure import Run, measure, row_load, tight_load
from benchmarks.placement import Placement
from benchmarks.progress import Progress
from benchmarks.report import (
    add_ratios,
    check_exactness,
    default_notes,
    markdown,
    print_report,
    summarise_row,
    targets,
)
from node.files import check_output_file

__all__ = [
    "DEFAULT_MARKDOWN",
    "ROWS",
    "add_arguments",
    "main",
    "missing_extras",
    "one_line",
    "run",
    "run_engine",
    "run_memory",
    "settings_from",
]

DEFAULT_MARKDOWN = Path(__file__).resolve().with_name("results.md")


def one_line(exc: BaseException, limit: int = 400) -> str:
    """A failure as one line: what failed, with the tail of any output folded in."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_engine(settings: Settings) -> dict[str, Any]:
    from benchmarks import engine

    keys = engine.make_keys(settings.engine_keys)
    with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull):
        runs = engine.measure_throughput(
            keys,
            settings.engine_hits,
            settings.engine_seconds,
            min_rounds=1 if settings.engine_seconds < 5 else 3,
            max_rounds=15,
        )
    medians = {name: statistics.median(v) for name, v in runs.items()}
    ratios = []
    for ours, theirs, target in engine.COMPARISONS:
        per_round = [a / b for a, b in zip(runs[ours], runs[theirs], strict=True)]
        ratios.append(
            {
                "ours": ours,
                "theirs": theirs,
                "target": target,
                "ratio": statistics.median(per_round),
                "per_round": per_round,
            }
        )
    return {"medians": medians, "ratios": ratios, "keys": settings.engine_keys}


def run_memory(n: int) -> dict[str, Any]:
    """Bytes per token-bucket key in a node's store (tracemalloc), key string included."""
    from benchmarks import engine

    keys = engine.make_keys(n)
    key_bytes = statistics.mean(sys.getsizeof(k) for k in keys[:1000])
    store_bytes = engine.measure_memory("token_bucket", keys)
    return {
        "keys": n,
        "store_bytes_per_key": store_bytes,
        "key_string_bytes": key_bytes,
        "bytes_per_key": store_bytes + key_bytes,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration", type=float, help="seconds per timed run (default 5; --quick: 2)"
    )
    parser.add_argument(
        "--connections",
        type=int,
        default=50,
        help="concurrent connections of the load generator (default 50; with --scale, per "
        "router worker)",
    )
    parser.add_argument("--repeats", type=int, help="interleaved rounds (default 3; --quick: 1)")
    parser.add_argument("--json", metavar="OUT", help="also write every number to OUT")
    parser.add_argument(
        "--markdown",
        metavar="OUT",
        help=f"write the markdown report here (default: {DEFAULT_MARKDOWN.relative_to(ROOT)} "
        "unless --quick; '-' for none)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a fast, rough run (about a minute): short runs, one round, 100k keys for "
        "memory and handoff, a short engine run; does not overwrite the default markdown",
    )
    parser.add_argument("--users", type=int, default=10_000, help="user population (default 10000)")
    parser.add_argument("--nodes", type=int, default=2, help="nodes per cluster (default 2)")
    parser.add_argument(
        "--loadgen",
        choices=["auto", "wrk", "python"],
        default="auto",
        help="wrk when installed (auto, the default), or the built-in Python generator",
    )
    parser.add_argument(
        "--rows", help=f"comma-separated subset of: {', '.join(ROWS)} (default: all)"
    )
    parser.add_argument("--handoff-keys", type=int, help="default 1000000 (--quick: 100000)")
    parser.add_argument("--memory-keys", type=int, help="default 1000000 (--quick: 100000)")
    parser.add_argument("--engine-seconds", type=float, help="default 20 (--quick: 2)")
    parser.add_argument(
        "--crash-policy",
        choices=["replica", "conservative", "reset"],
        help="the ringlimit clusters' crash policy (default: ringlimit's own, replica, which "
        "streams every changed state to a second node)",
    )
    parser.add_argument(
        "--skip-engine",
        action="store_true",
        help="no engine comparison with limits and no memory measurement",
    )
    parser.add_argument("--skip-envoy", action="store_true", help="no ShouldRateLimit (gRPC) row")
    parser.add_argument("--skip-handoff", action="store_true", help="no handoff measurement")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="run the load generator and the routers on one half of this process's CPUs, "
        "the nodes, Redis and the applications on the other (benchmarks/placement.py; "
        "with --scale too)",
    )
    parser.add_argument(
        "--scale",
        metavar="K,K,...",
        help="only the scaling runs (benchmarks/scale.py): for each K, K router workers and 2K "
        "nodes, sticky vs Redis, e.g. --scale 1,2,4",
    )


#: Each flag's smallest value (and whether it is a count), checked before anything
#: starts: a 0 quietly became the default ("or default"), inf and NaN were a
#: traceback after the clusters had started, and 0 connections or users were
#: refused by wrk alone (an 18 EB allocation).
LOWEST = {
    "duration": 1.0,
    "repeats": 1,
    "connections": 1,
    "users": 1,
    "nodes": 1,
    "handoff_keys": 1,
    "memory_keys": 1,
    "engine_seconds": 0.1,
}
#: ... and largest.
HIGHEST = {
    "duration": 3600.0,
    "repeats": 100,
    "connections": 10_000,
    "users": 10_000_000,
    "nodes": 64,
    "handoff_keys": 20_000_000,
    "memory_keys": 20_000_000,
    "engine_seconds": 3600.0,
}


def _check_numbers(args: argparse.Namespace) -> None:
    for name, low in LOWEST.items():
        value = getattr(args, name, None)
        if value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if not (low <= value <= HIGHEST[name] and math.isfinite(value)):
            shown = f"{value:g}" if isinstance(value, float) else str(value)[:40]
            raise ValueError(
                f"{flag} {shown}: must be from {_number(low)} to {_number(HIGHEST[name])}"
            )


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"


def settings_from(args: argparse.Namespace) -> Settings:
    _check_numbers(args)
    quick = bool(args.quick)
    settings = Settings(
        duration=args.duration if args.duration is not None else (2.0 if quick else 5.0),
        warmup=0.5 if quick else 1.0,
        repeats=args.repeats if args.repeats is not None else (1 if quick else 3),
        connections=args.connections,
        users=args.users,
        nodes=args.nodes,
        tight_duration=1.0 if quick else 2.0,
        engine_seconds=args.engine_seconds
        if args.engine_seconds is not None
        else (2.0 if quick else 20.0),
        engine_keys=2_000 if quick else 10_000,
        engine_hits=3 if quick else 10,
        memory_keys=0
        if args.skip_engine
        else (
            args.memory_keys if args.memory_keys is not None else (100_000 if quick else 1_000_000)
        ),
        handoff_keys=0
        if args.skip_handoff
        else (
            args.handoff_keys
            if args.handoff_keys is not None
            else (100_000 if quick else 1_000_000)
        ),
        tool=args.loadgen,
        crash_policy=args.crash_policy,
        envoy=not getattr(args, "skip_envoy", False),
    )
    if getattr(args, "pin", False):
        settings.placement = Placement.of_this_process()  # (before anything starts)
    if args.rows is not None:
        chosen = tuple(r.strip() for r in args.rows.split(",") if r.strip())
        if not chosen:  # "--rows ," ran every row
            raise ValueError(f"--rows {args.rows!r} names no row; known: {', '.join(ROWS)}")
        unknown = [r for r in chosen if r not in ROWS]
        if unknown:
            raise ValueError(
                f"--rows: unknown row(s) {', '.join(unknown)}; known: {', '.join(ROWS)}"
            )
        settings.rows = chosen
    if args.skip_engine:
        settings.engine_seconds = 0
    if settings.duration < 1:
        raise ValueError("--duration must be at least 1 second")
    return settings


def missing_extras(settings: Settings) -> list[str]:
    """The ``bench`` extra's modules this run needs and cannot import."""
    import importlib.util

    needed = []
    if settings.engine_seconds:
        needed.append("limits")
    if "slowapi" in settings.rows:
        needed += ["limits", "slowapi"]
    return [m for m in dict.fromkeys(needed) if importlib.util.find_spec(m) is None]


def run(args: argparse.Namespace) -> int:
    """``ringlimit bench``: check what the run needs, run every step, print and write the report."""
    settings = settings_from(args)
    scaling = getattr(args, "scale", None) is not None  # "--scale ''" ran the whole bench
    if scaling:
        from benchmarks.scale import parse_scale

        parse_scale(args.scale)  # before anything starts
    missing = [] if scaling else missing_extras(settings)
    if missing:
        raise ValueError(
            f"the benchmark needs {' and '.join(missing)}: pip install 'ringlimit[bench]'"
        )
    tool = settings.tool
    if tool == "wrk" and not wrk_available():
        raise ValueError("--loadgen wrk: wrk is not installed")
    tool_name = "wrk" if tool == "wrk" or (tool == "auto" and wrk_available()) else "python"
    needs_redis = bool(set(settings.rows) & {"redis", "redis_naive", "slowapi"}) or settings.envoy
    if needs_redis and not _have("redis-server"):
        raise ValueError("redis-server is not on the PATH (needed by the redis and slowapi rows)")
    # Before the run, not after it: a path that cannot be written lost every number.
    if args.json:
        check_output_file(Path(args.json), "--json")
    if scaling:
        from benchmarks.scale import run_command

        return run_command(args, settings, tool_name)
    quick = bool(args.quick)
    markdown_path = _markdown_path(args.markdown, quick)
    if markdown_path is not None:
        check_output_file(markdown_path, "--markdown")

    # A SIGTERM stops us like Ctrl-C: through the finally below, which stops everything.
    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    workdir = make_workdir()
    procs = Processes(workdir, settings.placement)
    progress = Progress(_expected_seconds(settings), enabled=not args.no_progress)
    started = time.time()
    report = _new_report(settings, command_line(args), tool_name, started)
    try:
        _run_rows(procs, settings, workdir, progress, report)
        _run_extras(procs, settings, workdir, progress, report)
    except KeyboardInterrupt:
        progress.close()
        print("\nringlimit bench: interrupted; stopping everything it started", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # a process that would not start, a load generator that failed
        progress.close()
        print(f"ringlimit bench: {one_line(exc)}", file=sys.stderr)
        return 1
    finally:
        progress.close()
        procs.stop_all()
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)
    report["meta"]["seconds"] = time.time() - started
    report["meta"]["loadavg_after"] = _loadavg()
    report["notes"] += default_notes(report)
    report["targets"] = [t.to_dict() for t in targets(report)]
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    if markdown_path is not None:
        markdown_path.write_text(markdown(report))
        print(f"wrote {markdown_path}")
    return 0


def _markdown_path(option: str | None, quick: bool) -> Path | None:
    """Where the markdown report goes: ``--markdown`` (``-``: nowhere), else
    benchmarks/results.md for a full run in a checkout."""
    if option == "-":
        return None
    if option:
        return Path(option)
    if quick:
        return None
    # Outside a source checkout (an installed wheel) the report goes to the
    # working directory, not into site-packages.
    in_checkout = (ROOT / "pyproject.toml").exists()
    return DEFAULT_MARKDOWN if in_checkout else Path("ringlimit-bench.md")


def _expected_seconds(settings: Settings) -> float:
    """Roughly how long the run takes (the progress bar's 100%)."""
    rows_n = len(settings.rows)
    tight_n = len([r for r in settings.rows if r != "direct"])
    return (
        rows_n * (settings.warmup + 1)
        + settings.repeats * rows_n * (settings.duration + 0.5)
        + tight_n * (settings.tight_duration + 0.5)
        + 8
        + settings.engine_seconds * 1.3
        + settings.memory_keys / 100_000
        + settings.handoff_keys / 40_000
        + (_envoy_seconds(settings) if settings.envoy else 0)
    )


def _envoy_seconds(settings: Settings) -> float:
    return settings.repeats * 2 * (settings.duration + 1) + 12


def command_line(args: argparse.Namespace) -> str:
    """The ``ringlimit bench`` command that ran, with every option it was given
    (the report named ``--quick`` alone: a run of two rows, or with steps
    skipped, read as the whole benchmark)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    words = ["ringlimit bench"]
    for name, default in defaults.items():
        value = getattr(args, name, default)
        if value == default or name in ("json", "markdown", "no_progress"):
            continue
        flag = "--" + name.replace("_", "-")  # (every option is named as its flag)
        shown = f"{value:g}" if isinstance(value, float) else str(value)
        words.append(flag if value is True else f"{flag} {shlex.quote(shown)}")
    return " ".join(words)


def _new_report(settings: Settings, command: str, tool_name: str, started: float) -> dict[str, Any]:
    placement = settings.placement
    return {
        "meta": {
            "command": command,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "tool": tool_name,
            "connections": settings.connections,
            "users": settings.users,
            "nodes": settings.nodes,
            "repeats": settings.repeats,
            "duration": settings.duration,
            "load_rate": settings.load_rate,
            "crash_policy": settings.crash_policy or "replica (ringlimit's default)",
            "tight": f"{settings.tight_limit}/hour x {settings.tight_users} users",
            "loadavg_before": _loadavg(),
            "hiredis": _hiredis(),
            "placement": None if placement is None else placement.to_dict(),
        },
        "rows": {},
        "runs": {},
        "exactness": {},
        "notes": [],
    }


def _run_rows(
    procs: Processes,
    settings: Settings,
    workdir: Path,
    progress: Progress,
    report: dict[str, Any],
) -> None:
    """The table: start the rows, warm each up, time them in interleaved rounds
    (alternating order), run the exactness checks, stop them, summarise."""
    tool = settings.tool
    with progress.step("starting processes", 8):
        rows = start_rows(procs, settings, workdir)
    runs: dict[str, list[Run]] = {key: [] for key in rows}
    for key, row in rows.items():
        with progress.step(f"warm-up: {key}", settings.warmup + 1):
            run_load(row_load(row, settings, "w", settings.warmup), tool)
    order = list(rows)
    for r in range(settings.repeats):
        for key in order if r % 2 == 0 else order[::-1]:
            with progress.step(f"round {r + 1}/{settings.repeats}: {key}", settings.duration + 0.5):
                load = row_load(rows[key], settings, "w", settings.duration)
                runs[key].append(measure(rows[key], load, tool))
    for key, row in rows.items():
        if not row.limited:
            continue
        with progress.step(f"exactness: {key}", settings.tight_duration + 0.5):
            result = run_load(tight_load(row, settings, f"t{key}-"), tool)
        report["exactness"][key] = check_exactness(
            key, result.to_dict(), row.tight_factor, settings.tight_users, settings.tight_limit
        )
    procs.stop_all()
    for key, row_runs in runs.items():
        dicts = []
        for one in row_runs:
            d = one.to_dict()
            d["decisions_per_request"] = one.decisions_per_request
            dicts.append(d)
        report["runs"][key] = dicts
        summary = summarise_row(key, dicts)
        summary["limited"] = rows[key].limited
        report["rows"][key] = summary
    add_ratios(report["rows"])


def _run_extras(
    procs: Processes,
    settings: Settings,
    workdir: Path,
    progress: Progress,
    report: dict[str, Any],
) -> None:
    """After the table: Envoy's gRPC row, the engine, memory per key, the handoff."""
    if settings.envoy:
        from benchmarks.envoy import run_envoy

        with progress.step("envoy: ShouldRateLimit, sticky vs Redis", _envoy_seconds(settings)):
            report["envoy"] = run_envoy(settings, procs, workdir)
    if settings.engine_seconds > 0:
        with progress.step("engine: ours vs limits", settings.engine_seconds * 1.3):
            report["engine"] = run_engine(settings)
    if settings.memory_keys:
        with progress.step(
            f"memory at {settings.memory_keys:,} keys", settings.memory_keys / 100_000
        ):
            report["memory"] = run_memory(settings.memory_keys)
    if settings.handoff_keys:
        with progress.step(
            f"handoff of {settings.handoff_keys:,} keys", settings.handoff_keys / 40_000
        ):
            report["handoff"] = run_handoff(procs, workdir, settings.handoff_keys)
        rss_per_key = report["handoff"].get("node_rss_bytes_per_key")
        if report.get("memory") and rss_per_key:
            memory = report["memory"]
            memory["node_rss_bytes_per_key"] = rss_per_key
            memory["detail"] = (
                f"store {memory['store_bytes_per_key']:.0f} + key string "
                f"{memory['key_string_bytes']:.0f}; a real node's RSS grew "
                f"{rss_per_key:.0f} B/key"
            )


def _have(binary: str) -> bool:
    import shutil

    return shutil.which(binary) is not None


def _hiredis() -> str | None:
    """hiredis's version when redis-py parses replies with it (as the nodes will)."""
    try:
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return None
    if not HIREDIS_AVAILABLE:
        return None
    import hiredis

    return str(hiredis.__version__)


def _loadavg() -> str:
    with contextlib.suppress(OSError), open("/proc/loadavg", encoding="ascii") as f:
        return " ".join(f.read().split()[:3])
    return "?"


def make_workdir() -> Path:
    """The run's folder (logs, config, the nodes' Unix sockets): in the temporary
    directory, unless a node's socket there would pass the 107 bytes a socket's
    path may have; then in /tmp. A TMPDIR that long failed the start of the
    nodes of the Unix-socket rows (``ringlimit up`` runs its nodes on TCP then)."""
    from node.unixsocket import MAX_PATH_BYTES

    workdir = Path(tempfile.mkdtemp(prefix="ringlimit-bench-"))
    if len(os.fsencode(workdir / "s9999.sock")) <= MAX_PATH_BYTES:
        return workdir
    workdir.rmdir()
    return Path(tempfile.mkdtemp(prefix="ringlimit-bench-", dir="/tmp"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
