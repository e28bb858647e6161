"""Errors a background loop survives: counted, and logged without flooding.

A health loop or a replication loop must outlive any one failure (a bug, a
peer answering garbage, a full disk), but it must not hide it either: every
error is counted by kind (exposed on ``/metrics``) and logged with its
traceback, at most one line per kind every ``every`` seconds, saying how many
were not logged in between. :meth:`Failures.warn` puts the same limit on
warnings that a peer or a client can cause once per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

__all__ = ["Failures"]


class Failures:
    def __init__(
        self,
        logger: logging.Logger,
        *,
        every: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.every = every
        self.clock = clock
        #: Errors so far, by kind (what ``/metrics`` shows).
        self.counts: dict[str, int] = {}
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def record(self, kind: str, exc: BaseException) -> bool:
        """Count ``exc`` under ``kind``; log it unless one was logged recently.

        Returns whether it was logged (for tests)."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        skipped = self._due(kind)
        if skipped is None:
            return False
        self.logger.error(
            "%s failed: %s: %s%s",
            kind,
            type(exc).__name__,
            exc,
            f" ({skipped} more since the last report)" if skipped else "",
            exc_info=(type(exc), exc, exc.__traceback__),
        )
        return True

    def warn(self, kind: str, message: str, *args: object, level: int = logging.WARNING) -> bool:
        """Log a warning (or a line at ``level``), at most one of ``kind`` every
        ``every`` seconds (saying how many were not logged in between): for
        events a peer or a client can repeat once per request, which are counted
        elsewhere. Returns whether it was logged."""
        skipped = self._due(kind)
        if skipped is None:
            return False
        if skipped:
            message += f" ({skipped} more since the last report)"
        self.logger.log(level, message, *args)
        return True

    def _due(self, kind: str) -> int | None:
        """None if a line of ``kind`` was logged within ``every`` seconds (this one is
        counted as not logged); else how many were not logged since the last."""
        now = self.clock()
        last = self._logged_at.get(kind)
        if last is not None and now - last < self.every:
            self._unlogged[kind] = self._unlogged.get(kind, 0) + 1
            return None
        self._logged_at[kind] = now
        return self._unlogged.pop(kind, 0)

    def snapshot(self) -> dict[str, int]:
        return dict(self.counts)
