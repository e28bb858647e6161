"""``ringlimit simulate SCENARIO.toml [--json OUT] [--plots DIR] [--seed N]``.

The ``ringlimit`` console script mounts this as its ``simulate`` subcommand
(``add_arguments`` + ``run``); ``python -m simulations`` runs it directly.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from node.files import check_output_dir, check_output_file, reader_gone

from .scenario import MODES, ScenarioError, load_scenario

SCENARIO_DIR = Path(__file__).parent / "scenarios"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "scenario",
        metavar="SCENARIO.toml",
        help="scenario file, or the name of a bundled one (e.g. 'scale_out'; see --list)",
        nargs="?",
    )
    parser.add_argument("--json", metavar="OUT", help="write the JSON report to OUT")
    parser.add_argument(
        "--plots", metavar="DIR", help="write PNG plots into DIR (needs matplotlib)"
    )
    parser.add_argument("--seed", type=int, metavar="N", help="override the scenario's seed")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="override one scenario setting before it is validated, VALUE in TOML "
        "(e.g. --set detection.budget=false --set modes.returning=discard); repeatable",
    )
    parser.add_argument(
        "--modes",
        metavar="LIST",
        help=f"comma-separated modes to run (default: the scenario's; 'global' always runs): "
        f"{', '.join(MODES)}",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="worker processes (default: one per core, or 1 for small runs)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="decide every arrival in every sticky mode, not only those of users a change moves "
        "(identical results, slower; a self-check)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress or timing lines on stderr"
    )
    parser.add_argument("--list", action="store_true", help="list the bundled scenarios and exit")


def resolve(name: str) -> Path:
    path = Path(name)
    if path.exists() or path.suffix == ".toml" or "/" in name:
        return path
    bundled = SCENARIO_DIR / f"{name}.toml"
    return bundled if bundled.exists() else path


def run(args: argparse.Namespace) -> int:
    if args.list:
        for path in sorted(SCENARIO_DIR.glob("*.toml")):
            try:
                sc = load_scenario(path)
                print(f"{path.stem:16} {sc.description}")
            except ScenarioError as exc:
                print(f"{path.stem:16} INVALID: {exc}")
        return 0
    if not args.scenario:
        print("ringlimit simulate: a scenario file is required (or --list)", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(resolve(args.scenario), overrides=args.set)
        if args.modes is not None:
            wanted = tuple(m.strip() for m in args.modes.split(",") if m.strip())
            if not wanted:  # "--modes ,,," ran the reference alone, and exited 0
                raise ScenarioError(
                    f"--modes {args.modes!r} names no mode; expected {', '.join(MODES)}"
                )
            unknown = [m for m in wanted if m not in MODES]
            if unknown:
                raise ScenarioError(
                    f"--modes: unknown mode(s) {', '.join(unknown)}; expected {', '.join(MODES)}"
                )
            try:
                scenario = scenario.with_modes(wanted)
            except ScenarioError as exc:
                raise ScenarioError(f"--modes: {exc}") from None
        else:
            scenario.check_rounds()
    except ScenarioError as exc:
        print(f"ringlimit simulate: {exc}", file=sys.stderr)
        return 2
    for note in scenario.notes:
        print(f"ringlimit simulate: {note}", file=sys.stderr)
    if args.seed is not None and args.seed < 0:
        print("ringlimit simulate: --seed must be >= 0", file=sys.stderr)
        return 2
    if args.jobs is not None and args.jobs < 1:
        print("ringlimit simulate: --jobs must be >= 1", file=sys.stderr)
        return 2
    try:  # before the run, not after it: a bad path lost every result
        if args.json:
            check_output_file(Path(args.json), "--json")
        if args.plots:
            check_output_dir(Path(args.plots), "--plots")
    except ValueError as exc:
        print(f"ringlimit simulate: {exc}", file=sys.stderr)
        return 2
    # Optional dependencies are checked before a long run, each in one line.
    # numpy is a core dependency (reinstalling ringlimit brings it back); matplotlib
    # comes with the `sim` extra.
    for module, why, install in (
        ("numpy", "simulations need", "pip install ringlimit"),
        ("matplotlib", "--plots needs", "pip install 'ringlimit[sim]'"),
    ):
        if (module == "numpy" or args.plots) and importlib.util.find_spec(module) is None:
            print(f"ringlimit simulate: {why} {module}: {install}", file=sys.stderr)
            return 2

    from .pool import WorkerDied, exit_on_sigterm
    from .report import format_report, write_json
    from .runner import say, simulate

    verbose = not args.quiet
    try:
        with exit_on_sigterm():
            result = simulate(
                scenario,
                seed=args.seed,
                jobs=args.jobs,
                progress=verbose,
                log=lambda m: say(m, verbose),
                full=args.full,
            )
    except ScenarioError as exc:
        print(f"ringlimit simulate: {exc}", file=sys.stderr)
        return 2
    except WorkerDied as exc:
        print(f"ringlimit simulate: {exc}", file=sys.stderr)
        return 1
    print(format_report(result.report))
    try:
        if args.json:
            path = write_json(result.report, args.json)
            say(f"wrote {path}", verbose)
        if args.plots:
            from .plots import write_plots

            for path in write_plots(result.report, args.plots):
                say(f"wrote {path}", verbose)
    except OSError as exc:  # since the check (a full disk, a folder removed)
        print(f"ringlimit simulate: cannot write {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations",
        description="Simulate rebalancing policies of a ringlimit cluster on a virtual clock.",
    )
    add_arguments(parser)
    try:
        code = run(parser.parse_args(argv))
        sys.stdout.flush()  # here, not at exit, where a reader gone is a traceback again
        return code
    except KeyboardInterrupt:  # (as `ringlimit simulate` answers a Ctrl-C)
        return 130
    except BrokenPipeError:  # (`python -m simulations --list | head -2`: as ringlimit does)
        return reader_gone()
