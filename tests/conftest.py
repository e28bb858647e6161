from __future__ import annotations

import compileall
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

pytest_plugins = ["tests.processes", "tests.redis_server", "tests.etcd_server", "tests.watchdog"]

# CI machines are shared and slow: no per-example deadline, and a profile that
# keeps the default run bounded. HYPOTHESIS_PROFILE=thorough runs more examples.
settings.register_profile(
    "default", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True
)
settings.register_profile(
    "thorough", deadline=None, max_examples=2000, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def anyio_backend() -> str:
    """The event loop of every ``pytest.mark.anyio`` test: asyncio, which routers
    and nodes run on (anyio's own fixture adds trio when it is installed)."""
    return "asyncio"


#: The packages the processes the tests start import (tests.sample_app among them).
PACKAGES = ("ring", "node", "router", "simulations", "benchmarks", "tests")


def pytest_configure(config: pytest.Config) -> None:
    """Compile the project's modules once, before any worker starts, when this
    run's Python writes no bytecode (``PYTHONDONTWRITEBYTECODE``, set on the
    machine this was measured on).

    The suite starts some 700 Python processes (routers, nodes, the CLI). With
    no bytecode written, each of them compiled ringlimit's ~100 modules from
    source (0.1-0.2 s of CPU per process: the user and system time of
    ``python -c "import router.cli, router.server"``, with and without the
    ``__pycache__`` folders), since the variable stops writes, not reads. The
    files go where Python puts them (``__pycache__``, ignored by git); a
    checkout that cannot take them only runs slower, as before.

    Left to be compiled from source, as before: a module the compiler warns
    about (compiled here, its warnings would be seen by nobody; loaded, they
    reach the run's warnings summary), and a file changed in the last two
    seconds (bytecode is matched to its source by whole-second mtime and
    size: a same-size edit within that second would run the old code).
    """
    if not sys.dont_write_bytecode or hasattr(config, "workerinput"):
        return  # bytecode is written as modules load; or a worker: the controller did it
    root = Path(__file__).resolve().parent.parent
    settled = time.time() - 2.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for package in PACKAGES:
            for source in (root / package).rglob("*.py"):
                if source.stat().st_mtime < settled:
                    compileall.compile_file(source, quiet=2)
