"""Real router and node processes on 127.0.0.1, for integration tests.

Every process a test starts is registered with the ``procs`` fixture, which
stops it (SIGTERM, then SIGKILL) when the test ends, whatever happened.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from router import processes
from router.processes import (
    ChildProcess,
    NotReady,
    below_ephemeral,
    child_env,
    http_probe,
    ringlimit_argv,
    stop_all,
    wait_ready,
)

__all__ = [
    "ROOT",
    "Proc",
    "Procs",
    "free_block",
    "free_port",
    "procs",
    "wait_for",
    "wait_healthy",
    "wait_until",
]

ROOT = Path(__file__).resolve().parent.parent


#: Ports :func:`free_block` handed out in this process: a child may not have bound
#: one yet, so a later call must not hand it out again (cleared when many are).
_HANDED: set[int] = set()


def _port_range(count: int) -> tuple[int, int]:
    """Where this process picks ports: below the kernel's ephemeral range
    (:func:`router.processes.below_ephemeral`), and with pytest-xdist the
    slice of it that is this worker's.

    One slice per worker: two workers that picked the same free port each
    started a child on it, and one test's node joined the other test's
    cluster (CI: "could not join the ring ... missing_user_id").
    """
    start, end = below_ephemeral(count)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        index = int(worker.removeprefix("gw"))
        workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    except ValueError:
        return start, end
    if not 0 <= index < workers:
        return start, end
    size = (end - start) // workers
    return start + index * size, start + (index + 1) * size


def free_block(count: int) -> int:
    """A port P with P..P+count-1 all free on 127.0.0.1 (``up`` uses P and P+1..P+N),
    none handed out before by this process, in this process's range (:func:`_port_range`)."""
    start, end = _port_range(count)
    if len(_HANDED) > (end - start) // 4:
        _HANDED.clear()
    return processes.free_block(count, within=(start, end), avoid=_HANDED)


def free_port() -> int:
    """A port free on 127.0.0.1 now, in this worker's slice below the ephemeral
    range (:func:`free_block`)."""
    return free_block(1)


class Proc(ChildProcess):
    """One ``ringlimit`` process of a test (``python -m router <argv>``), its
    output in ``log``; :meth:`stop` resumes a paused one before SIGTERM."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str],
        log: Path,
        launcher: Sequence[str] = (),
    ) -> None:
        # No preexec_fn here: see tests.redis_server.dying_with_parent. A process
        # that needs a different setting starts through a launcher (prlimit ...).
        super().__init__(name, [*launcher, *ringlimit_argv(*argv)], env=env, cwd=ROOT, log=log)
        #: Whether it registers itself (``node --join``): its SIGTERM is a leave.
        self.joins = "--join" in argv

    def kill9(self) -> None:
        self.kill()

    def stop(self, timeout: float = 15.0, how: int = signal.SIGTERM) -> None:
        super().stop(timeout, how)


class Procs:
    """Starts ringlimit processes and remembers them so they are always stopped."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[Proc] = []
        # (child_env: the tree under test, not whatever copy is installed)
        self.env = child_env({**os.environ, "PYTHONUNBUFFERED": "1"})

    def start(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        launcher: Sequence[str] = (),
    ) -> Proc:
        proc = Proc(
            name,
            argv,
            {**self.env, **(env or {})},
            self.tmp / f"{name}-{len(self.started)}.log",
            launcher,
        )
        self.started.append(proc)
        return proc

    def node(self, node_id: str, port: int | None = None, *extra: str) -> tuple[Proc, str]:
        return self.nodes([node_id], *extra, port=port)[node_id]

    def nodes(
        self, node_ids: Sequence[str], *extra: str, port: int | None = None
    ) -> dict[str, tuple[Proc, str]]:
        """Nodes started at once (a start is about a second of CPU each, so they
        overlap on two cores), each with ``extra`` flags; returns when all answer.
        ``port``: the port of a single node (free ports otherwise)."""
        assert port is None or len(node_ids) == 1
        started: dict[str, tuple[Proc, str]] = {}
        for node_id in node_ids:
            node_port = port or free_port()
            argv = ["node", "--id", node_id, "--port", str(node_port), *extra]
            started[node_id] = (self.start(node_id, argv), f"http://127.0.0.1:{node_port}")
        for proc, url in started.values():
            wait_healthy(url, proc)
        return started

    def router(
        self,
        port: int | None = None,
        *extra: str,
        healthy: bool = True,
        launcher: Sequence[str] = (),
    ) -> tuple[Proc, str]:
        port = port or free_port()
        proc = self.start("router", ["router", "--port", str(port), *extra], launcher=launcher)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, require_ok=healthy)
        return proc, url

    def stop_all(self, timeout: float = 15.0) -> None:
        """The ``--join`` nodes first, together, then the rest (nodes started with
        seeds, routers, ``up``) together.

        A --join node's SIGTERM is a graceful leave through its router, which it
        retries for 10 s while no router answers, handing its keys to the other
        nodes: stopped after a router (in reverse start order, when a test
        restarted its router), each such node spent those 10 s, one after the
        other (33 s of one test's teardown); stopped with the nodes it hands its
        keys to, its handoff could fail and its leave last seconds longer."""
        try:
            stop_all([proc for proc in self.started if proc.joins], timeout)
        finally:
            stop_all([proc for proc in self.started if not proc.joins], timeout)


def wait_healthy(url: str, proc: Proc, timeout: float = 20.0, require_ok: bool = True) -> None:
    """Until ``GET url/healthz`` answers 200 (any answer unless ``require_ok``);
    RuntimeError with the process's output if it exits or the time runs out."""
    with httpx.Client(timeout=1.0) as client:
        try:
            wait_ready(
                http_probe(client, f"{url}/healthz", require_ok=require_ok),
                timeout=timeout,
                failed=lambda: None if proc.alive() else f"{proc.name} exited",
            )
        except NotReady as exc:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.output()}") from None
            raise RuntimeError(
                f"{proc.name} not healthy after {timeout}s:\n{proc.output()}"
            ) from exc


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``predicate`` until it is true or ``timeout`` passes (bounded, never forever)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


async def wait_until(predicate, seconds: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    """:func:`wait_for` inside an event loop (in-process tests), failing if never true."""
    for _ in range(int(seconds / 0.02)):
        if predicate():
            return
        await asyncio.sleep(0.02)
    assert predicate(), "condition not met in time"


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    manager = Procs(tmp_path)
    try:
        yield manager
    finally:
        manager.stop_all()
