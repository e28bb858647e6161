"""The layering docs/architecture.md promises, checked on the source itself.

The pure cores (engine, protocol cores, wire) must stay free of I/O, event
loops and clock reads, so that hypothesis and the simulations can drive
them; simulations must never import a driver or the serving layer; and the
packages import one way: ``ring`` <- ``node`` <- ``router``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: Modules that hold decisions and protocol state and must do no I/O.
PURE = [
    "node/algorithms.py",
    "node/rules.py",
    "node/decision.py",
    "node/limiter.py",
    "node/store.py",
    "node/shardcore.py",
    "node/lease.py",
    "node/quota.py",
    "node/leasing.py",
    "node/wire.py",
    "router/viewlog.py",
    "router/removal.py",
    "router/quotas.py",
    "ring/view.py",
    "ring/member.py",
    "ring/owners.py",
]

#: What a pure module may not import: I/O, event loops, processes, the network.
FORBIDDEN_IN_PURE = {
    "asyncio",
    "socket",
    "subprocess",
    "threading",
    "httpx",
    "aiohttp",
    "uvicorn",
    "starlette",
    "redis",
    "grpc",
    "aetcd",
    "logging",
}

#: Project modules the simulations must not import (drivers and serving).
DRIVERS = {
    "node.shard",
    "node.app",
    "node.middleware",
    "node.server",
    "node.peers",
    "node.authority",
    "router.app",
    "router.membership",
    "router.health",
    "router.nodeclient",
    "router.coordinator",
    "router.forward",
    "router.fastclient",
}


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports at run time, at any depth of the file (relative
    ones resolved; ``if TYPE_CHECKING:`` blocks left out)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found: set[str] = set()
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue  # annotations only: never imported at run time
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
    return found


@pytest.mark.parametrize("module", PURE)
def test_a_pure_core_does_no_io(module: str) -> None:
    used = {name.split(".")[0] for name in imports(ROOT / module)}
    assert not used & FORBIDDEN_IN_PURE, f"{module} imports {sorted(used & FORBIDDEN_IN_PURE)}"


def test_a_pure_core_reads_no_clock() -> None:
    """Time comes in as an argument: ``time.time()`` or ``monotonic()`` inside a
    core would make its tests and the simulations depend on the wall clock."""
    for module in PURE:
        source = (ROOT / module).read_text()
        for call in ("time.time(", "time.monotonic(", "monotonic()", "perf_counter("):
            assert call not in source, f"{module} reads the clock ({call})"


def test_simulations_import_no_driver() -> None:
    for path in sorted((ROOT / "simulations").glob("*.py")):
        used = imports(path)
        bad = {name for name in used if name in DRIVERS}
        assert not bad, f"{path.name} imports {sorted(bad)}"


@pytest.mark.parametrize(
    ("package", "below"),
    [
        ("ring", {"node", "router", "simulations", "benchmarks"}),
        ("node", {"router", "simulations"}),
    ],
)
def test_packages_import_one_way(package: str, below: set[str]) -> None:
    for path in sorted((ROOT / package).rglob("*.py")):
        used = {name.split(".")[0] for name in imports(path)}
        assert not used & below, f"{path.relative_to(ROOT)} imports {sorted(used & below)}"


def test_the_checker_sees_imports() -> None:
    """The checks above are only as good as :func:`imports`: it must see a driver
    import, a relative import and an import inside a function."""
    found = imports(ROOT / "router" / "app.py")
    assert "router.membership" in found
    assert "asyncio" in found
    assert any(
        name.startswith("simulations.") for name in imports(ROOT / "simulations" / "runner.py")
    )
