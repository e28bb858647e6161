"""Real router and node processes on 127.0.0.1, for integration tests.

Every process a test starts is registered with the ``procs`` fixture, which
stops it (SIGTERM, then SIGKILL) when the test ends, whatever happened.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Proc:
    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        preexec_fn: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log
        self._log = open(log, "wb")  # noqa: SIM115 (closed in stop)
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "router", *argv],
            cwd=ROOT,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=preexec_fn,
        )

    def alive(self) -> bool:
        return self.popen.poll() is None

    def kill9(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but runs nothing (a GC or VM pause)."""
        self.popen.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.popen.send_signal(signal.SIGCONT)

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            # A stopped process would not act on SIGTERM: resume it first.
            self.popen.send_signal(signal.SIGCONT)
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")


class Procs:
    """Starts ringlimit processes and remembers them so they are always stopped."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[Proc] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> Proc:
        proc = Proc(
            name,
            argv,
            {**self.env, **(env or {})},
            self.tmp / f"{name}-{len(self.started)}.log",
            preexec_fn,
        )
        self.started.append(proc)
        return proc

    def node(self, node_id: str, port: int | None = None, *extra: str) -> tuple[Proc, str]:
        port = port or free_port()
        proc = self.start(node_id, ["node", "--id", node_id, "--port", str(port), *extra])
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        return proc, url

    def router(
        self,
        port: int | None = None,
        *extra: str,
        healthy: bool = True,
        preexec_fn: Callable[[], None] | None = None,
    ) -> tuple[Proc, str]:
        port = port or free_port()
        proc = self.start("router", ["router", "--port", str(port), *extra], preexec_fn=preexec_fn)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, require_ok=healthy)
        return proc, url

    def stop_all(self) -> None:
        for proc in reversed(self.started):
            proc.stop()


def wait_healthy(url: str, proc: Proc, timeout: float = 20.0, require_ok: bool = True) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.output()}")
            try:
                response = client.get(f"{url}/healthz")
                if response.status_code == 200 or (not require_ok and response.status_code < 600):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    raise RuntimeError(f"{proc.name} not healthy after {timeout}s:\n{proc.output()}")


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it is true or ``timeout`` passes (bounded, never forever)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    manager = Procs(tmp_path)
    try:
        yield manager
    finally:
        manager.stop_all()
