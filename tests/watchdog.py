"""A pytest plugin: a backstop behind pytest-timeout for hung tests.

pytest-timeout's signal method raises in the main thread, which an event loop
stuck where no Python code runs never sees (one such hang stalled the whole
suite). Here a C thread (``faulthandler.dump_traceback_later``) watches every
test, setup and teardown included: still running at twice its timeout, it
prints every thread's stack and ends the process. Under pytest-xdist the
worker dies, the test is reported as crashed and a new worker takes the rest,
so CI fails in minutes rather than at its own limit.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Iterator
from typing import IO

import pytest

#: The process's stderr as it was before pytest captured it (a test's fd 2 is
#: a capture file, dropped when the process ends).
_STDERR = pytest.StashKey[IO[str]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_STDERR] = os.fdopen(os.dup(sys.__stderr__.fileno()), "w")  # type: ignore[union-attr]


def pytest_unconfigure(config: pytest.Config) -> None:
    stderr = config.stash.get(_STDERR, None)
    if stderr is not None:
        stderr.close()
        del config.stash[_STDERR]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    seconds = 2 * _timeout(item)
    if seconds > 0:
        faulthandler.dump_traceback_later(seconds, exit=True, file=item.config.stash[_STDERR])
    try:
        yield
    finally:
        if seconds > 0:
            faulthandler.cancel_dump_traceback_later()


def _timeout(item: pytest.Item) -> float:
    """The test's pytest-timeout: its ``timeout`` mark, else the ini setting."""
    marker = item.get_closest_marker("timeout")
    try:
        if marker is not None and marker.args:
            return float(marker.args[0])
        return float(item.config.getini("timeout") or 0)
    except (ValueError, TypeError):
        return 0.0
