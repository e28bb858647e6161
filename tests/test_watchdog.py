"""tests/watchdog.py ends a test that pytest-timeout cannot interrupt."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

HUNG = """
import signal, time
import pytest

{mark}
def test_hangs_where_no_signal_reaches_it():
    # pytest-timeout's SIGALRM is blocked, as if the loop were stuck in C.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)
"""


@pytest.mark.parametrize(
    ("mark", "options", "env"),
    [
        pytest.param("@pytest.mark.timeout(1)", [], {}, id="mark"),
        pytest.param("@pytest.mark.timeout(timeout=1)", [], {}, id="mark-keyword"),
        pytest.param("", ["--timeout", "1"], {}, id="command-line"),
        pytest.param("", [], {"PYTEST_TIMEOUT": "1"}, id="environment"),
    ],
)
def test_a_hang_beyond_pytest_timeout_ends_its_process(
    tmp_path: Path, mark: str, options: list[str], env: dict[str, str]
) -> None:
    """However the timeout is given, the watchdog uses the one pytest-timeout settled on."""
    (tmp_path / "test_hung.py").write_text(HUNG.replace("{mark}", mark))
    started = time.monotonic()
    done = _pytest(tmp_path, options, env)
    took = time.monotonic() - started
    assert done.returncode != 0
    assert "Timeout (0:00:02)!" in done.stderr, done.stderr[-2000:]
    assert "test_hangs_where_no_signal_reaches_it" in done.stderr
    assert took < 30, took  # 2 s after the test started, not the 60 s of its sleep


QUICK_THEN_SLOW = """
import time
import pytest

@pytest.mark.timeout(1)
def test_a_quick_one():
    pass

@pytest.mark.timeout(0)
def test_then_a_slow_one_without_a_timeout():
    time.sleep(3)  # past the first test's watchdog (2 s), had it not been cancelled
"""


@pytest.mark.parametrize("plugins", [[], ["-p", "no:timeout"]], ids=["timeout", "no-timeout"])
def test_a_test_that_ends_cancels_its_watchdog(tmp_path: Path, plugins: list[str]) -> None:
    """The watchdog is cancelled with pytest-timeout's timer; and without
    pytest-timeout (``-p no:timeout``) the plugin loads and stays idle."""
    (tmp_path / "test_quick_then_slow.py").write_text(QUICK_THEN_SLOW)
    done = _pytest(tmp_path, plugins)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 passed" in done.stdout


def _pytest(
    tests: Path, options: list[str], env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """pytest with the watchdog, in one process, on the test files in ``tests``.

    Only pytest-timeout is loaded besides (unless ``options`` turn it off): the
    other installed plugins (hypothesis, xdist, anyio...) took 1.5 s of each run."""
    plugins = [] if "no:timeout" in options else ["-p", "pytest_timeout"]
    return subprocess.run(
        [
            *(sys.executable, "-m", "pytest", *plugins, "-p", "tests.watchdog", *options),
            *("-p", "no:cacheprovider", "--rootdir", str(tests), str(tests)),
        ],
        cwd=ROOT,
        env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=50,
    )


FAILS_THEN_TEARDOWN_HANGS = """
import signal, time
import pytest

@pytest.fixture
def hangs_in_teardown():
    yield
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)

@pytest.mark.timeout(1)
def test_fails_then_its_teardown_hangs(hangs_in_teardown):
    assert False
"""


def test_a_failed_tests_hanging_teardown_is_still_watched(tmp_path: Path) -> None:
    """A failure stops pytest-timeout's and faulthandler's timers (for a
    debugger): the watchdog watches the rest of the test again."""
    (tmp_path / "test_teardown_hangs.py").write_text(FAILS_THEN_TEARDOWN_HANGS)
    started = time.monotonic()
    done = _pytest(tmp_path, [])
    took = time.monotonic() - started
    assert done.returncode != 0
    assert "Timeout (0:00:02)!" in done.stderr, done.stderr[-2000:]
    assert "hangs_in_teardown" in done.stderr
    assert took < 30, took  # 2 s after the failure, not the 60 s of the teardown
