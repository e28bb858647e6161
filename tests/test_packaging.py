"""The wheel holds every command of the CLI: built, installed in a fresh venv, run.

A fresh venv (no system site-packages) gets the wheel and its declared
dependencies from the package index, and every subcommand runs from a
directory outside the checkout, so nothing can come from the source tree:
``ringlimit simulate`` on the smallest bundled scenario, ``--help`` of every
subcommand, and the one-line errors that name the extra to install when an
optional dependency (matplotlib for ``--plots``; limits/slowapi for ``bench``)
is missing. About 15 seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest
from uv import find_uv_bin

from router.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.packaging, pytest.mark.timeout(900)]


def subcommands() -> list[str]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    raise AssertionError("the ringlimit parser has no subcommands")


def run(argv: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bin directory of a fresh venv holding only the wheel and its dependencies.

    Built and installed with uv (the test extra's), not pip: the same wheel
    and the same declared dependencies, in seconds where pip took a minute
    or more of a CI worker (most of it unpacking and compiling 36 packages).
    """
    uv = find_uv_bin()
    tmp = tmp_path_factory.mktemp("wheel")
    built = run([uv, "build", "-q", "--wheel", "-o", str(tmp), str(ROOT)], cwd=tmp)
    assert built.returncode == 0, built.stderr
    (wheel,) = tmp.glob("ringlimit-*.whl")
    venv = tmp / "venv"
    made = run([uv, "venv", "-q", "--python", sys.executable, str(venv)], cwd=tmp)
    assert made.returncode == 0, made.stderr
    bin_dir = venv / "bin"
    installs = [uv, "pip", "install", "-q", "--python", str(bin_dir / "python"), str(wheel)]
    pip = run(installs, cwd=tmp)
    assert pip.returncode == 0, pip.stderr
    return bin_dir


def test_the_wheel_ships_every_package(installed: Path) -> None:
    probe = run(
        [
            str(installed / "python"),
            "-c",
            "import benchmarks.bench, simulations.cli, node.lua, router.cli, ring; "
            "import simulations, pathlib; "
            "print(sorted(p.name for p in "
            "(pathlib.Path(simulations.__file__).parent / 'scenarios').glob('*.toml')))",
        ],
        cwd=installed,
    )
    assert probe.returncode == 0, probe.stderr
    assert "tiny.toml" in probe.stdout
    # Imported from the venv, not from this checkout.
    where = run(
        [str(installed / "python"), "-c", "import router; print(router.__file__)"], cwd=installed
    )
    assert str(ROOT) not in where.stdout and "site-packages" in where.stdout


def test_every_subcommand_answers_help(installed: Path) -> None:
    names = subcommands()
    assert {"up", "router", "node", "nodes", "simulate", "bench"} <= set(names)
    top = run([str(installed / "ringlimit"), "--help"], cwd=installed)
    assert top.returncode == 0, top.stderr
    for name in names:
        result = run([str(installed / "ringlimit"), name, "--help"], cwd=installed)
        assert result.returncode == 0, (name, result.stderr)
        assert result.stdout.startswith(f"usage: ringlimit {name}"), (name, result.stdout)
        assert not result.stderr, (name, result.stderr)


def test_simulate_runs_the_smallest_scenario(installed: Path) -> None:
    result = run([str(installed / "ringlimit"), "simulate", "tiny", "--quiet"], cwd=installed)
    assert result.returncode == 0, result.stderr
    assert "scenario tiny" in result.stdout and "global" in result.stdout


def test_missing_extras_are_one_line_naming_the_extra(installed: Path, tmp_path: Path) -> None:
    python = str(installed / "python")
    absent = run(
        [
            python,
            "-c",
            "import importlib.util as u; print(u.find_spec('matplotlib'), "
            "u.find_spec('limits'), u.find_spec('slowapi'))",
        ],
        cwd=installed,
    )
    assert absent.stdout.split() == ["None", "None", "None"], absent.stdout
    plots = run(
        [str(installed / "ringlimit"), "simulate", "tiny", "--plots", str(tmp_path)],
        cwd=installed,
    )
    assert plots.returncode == 2
    assert plots.stderr.strip().count("\n") == 0, plots.stderr
    assert "matplotlib" in plots.stderr and "ringlimit[sim]" in plots.stderr
    bench = run([str(installed / "ringlimit"), "bench", "--quick"], cwd=installed, timeout=60)
    assert bench.returncode == 2
    assert bench.stderr.strip().count("\n") == 0, bench.stderr
    assert "ringlimit[bench]" in bench.stderr and "Traceback" not in bench.stderr
