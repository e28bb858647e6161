"""A pytest plugin: a backstop behind pytest-timeout for hung tests.

pytest-timeout's signal method raises in the main thread, which an event loop
stuck where no Python code runs never sees (one such hang stalled the whole
suite). Here a C thread (``faulthandler.dump_traceback_later``) watches what
pytest-timeout watches, armed through its timer hooks so that it uses the
timeout pytest-timeout settled on however it was given, and again after a
failed phase (whose timers pytest stops) for what is left of the test: still
running at twice that, it prints every thread's stack and ends the process.
Under pytest-xdist the worker dies, the test is reported as crashed and a new
worker takes the rest, so CI fails in minutes rather than at its own limit.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import IO, Any

import pytest

#: The process's stderr as it was before pytest captured it (a test's fd 2 is
#: a capture file, dropped when the process ends).
_STDERR = pytest.StashKey[IO[str]]()
#: A test's watch, in seconds (twice its timeout), once it has been armed.
_WATCH = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STDERR] = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")  # type: ignore[union-attr]


def pytest_unconfigure(config: pytest.Config) -> None:
    stderr = config.stash.get(_STDERR, None)
    if stderr is not None:
        stderr.close()
        del config.stash[_STDERR]


# optionalhook: pytest-timeout declares these; without it (-p no:timeout) they never run.
@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> None:
    """Armed where pytest-timeout arms its own timer, with the timeout it found
    (``--timeout``, ``PYTEST_TIMEOUT``, the ini file or the test's mark, whichever
    rules), over the span it covers (the whole protocol, or the call alone with
    ``timeout_func_only``). Returns None: pytest-timeout's own timer still runs."""
    seconds = 2 * float(settings.timeout or 0)
    if seconds > 0:
        # With timeout_func_only the call alone is watched: nothing is left
        # to watch again once it has failed.
        item.stash[_WATCH] = 0.0 if settings.func_only else seconds
        faulthandler.dump_traceback_later(seconds, exit=True, file=item.config.stash[_STDERR])


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node: pytest.Item | pytest.Collector) -> None:
    """Watch again, from now, what is left of a test whose phase failed.

    pytest's faulthandler plugin and pytest-timeout both stop their timers
    when a phase fails, for a debugger that might start; without a debugger
    the phases still to run (a failed test's teardown) would run unwatched,
    and a teardown that hangs would stall the run. Not under ``--pdb``.
    """
    if not isinstance(node, pytest.Item) or node.config.getoption("usepdb", False):
        return
    seconds = node.stash.get(_WATCH, 0.0)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=node.config.stash[_STDERR])
