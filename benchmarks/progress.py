"""A one-line progress bar for ``ringlimit bench`` (plain lines when stderr is not a terminal)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Iterator


class Progress:
    """A one-line progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: float, enabled: bool = True) -> None:
        self.total = max(total, 1e-9)
        self.done = 0.0
        self.label = ""
        self.step_started = time.monotonic()
        self.step_expected = 0.0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if enabled and self.tty:
            self._thread = threading.Thread(target=self._tick, daemon=True)
            self._thread.start()

    def _fraction(self) -> float:
        within = min(time.monotonic() - self.step_started, self.step_expected)
        return min(1.0, (self.done + within) / self.total)

    def _draw(self) -> None:
        fraction = self._fraction()
        width = 30
        filled = int(fraction * width)
        bar = "#" * filled + "-" * (width - filled)
        sys.stderr.write(f"\r[{bar}] {fraction * 100:3.0f}% {self.label[:60]:<60}")
        sys.stderr.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._draw()

    @contextlib.contextmanager
    def step(self, label: str, expected: float) -> Iterator[None]:
        self.label, self.step_started, self.step_expected = label, time.monotonic(), expected
        if self.enabled:
            if self.tty:
                self._draw()
            else:
                print(f"  [{self._fraction() * 100:3.0f}%] {label}", file=sys.stderr, flush=True)
        try:
            yield
        finally:
            self.done += expected
            self.step_expected = 0.0

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
        if self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 100 + "\r")
            sys.stderr.flush()
