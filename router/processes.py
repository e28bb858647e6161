"""Child processes: start one, wait until it is ready, signal it, stop it, say how it exited.

Three supervisors start ringlimit processes: ``ringlimit up``
(router/supervisor.py), ``ringlimit bench`` (benchmarks/) and the test
fixtures (tests/processes.py). They share this module so the subtle parts are
written once:

* a stopped (SIGSTOP) process does not act on SIGTERM, so stopping resumes it
  first;
* a child that would not stop within its timeout is killed, with its whole
  process group when it leads one (a router's workers, uvicorn's workers);
* several children are signalled at once and then waited for against one
  deadline, so stopping N children takes one timeout, not N;
* an exit is described in the words of the one-line reports
  (:func:`router.restart.describe_exit`).

Readiness is polled (:func:`wait_ready`) with probes such as
:func:`http_probe` (``GET /healthz``) and :func:`redis_probe` (``PING``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import site
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx

from router.restart import describe_exit

T = TypeVar("T")

#: prctl(2): the signal a child gets when its parent dies.
PR_SET_PDEATHSIG = 1


#: What SIGHUP to a process that starts others (``up``, ``router --workers``)
#: says as it stops them all: they went without a word, exit status 129.
HANGUP_LINE = (
    "ringlimit: SIGHUP: stopping (ringlimit reloads nothing on SIGHUP: new rules go "
    "through `ringlimit rules FILE`)"
)


class StopSignals:
    """SIGTERM, SIGINT and SIGHUP as requests to stop, for a process that starts
    others (``up``, ``router --workers``): the handler only notes it
    (:attr:`stopping`); :meth:`say` writes a SIGHUP's line outside it (a print
    in a handler could reenter one under way); :meth:`restore` puts the
    previous handlers back."""

    HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def __init__(self) -> None:
        self.stopping = False
        self.hangup = False
        self._previous = {s: signal.signal(s, self._note) for s in self.HANDLED}

    def _note(self, signum: int, frame: Any) -> None:
        self.hangup = self.hangup or signum == signal.SIGHUP
        self.stopping = True

    def say(self) -> None:
        if self.hangup:
            print(HANGUP_LINE, file=sys.stderr, flush=True)

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


class NotReady(RuntimeError):
    """A child did not become ready: it exited, or the wait timed out."""


def ringlimit_argv(*args: str) -> list[str]:
    """The command line of a ``ringlimit`` subcommand run by this interpreter.

    ``-P``: not the working directory first on ``sys.path``, as ``-m`` puts it,
    or a ``node/`` or ``router/`` package (or an ``h2.py``) in the directory
    ``ringlimit up`` was run from was imported in place of ringlimit's own and
    every process it started died (an exploratory tester)."""
    return [sys.executable, "-P", "-m", "router", *args]


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's by default) for a child started with
    :func:`ringlimit_argv`, so that it runs the code this process runs.

    ``-P`` keeps the working directory off the child's path: run from a
    checkout that is not the installed copy (``python -m router up`` at its
    root), the children imported the installed copy instead (the review).
    The directory ringlimit was imported from goes first on ``PYTHONPATH``,
    unless it is a site directory: an installed copy, which the child finds
    anyway, and which put first would come before the standard library."""
    env = dict(os.environ if env is None else env)
    root = Path(__file__).resolve().parent.parent
    sites = [*site.getsitepackages(), site.getusersitepackages()]
    if any(root == Path(p).resolve() for p in sites):
        return env
    current = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(root) + (os.pathsep + current if current else "")
    return env


def check_port_free(host: str, port: int) -> None:
    """``OSError`` if something listens on ``host:port`` already: a bind with
    ``SO_REUSEADDR`` (as a single router's, which ignores connections in
    TIME_WAIT) and without ``SO_REUSEPORT``, which fails on any listener there.

    ``up`` checks its ports so (:func:`router.supervisor.check_ports`), and
    ``router --workers`` its public port: its own sockets set ``SO_REUSEPORT``
    and so shared a port whose sockets did the same as the same user; a second
    ``router --workers`` there started without a word, and the kernel split
    the clients between two routers that each led a membership of their own
    (an exploratory tester: ``503 no_nodes`` for 6 of 10 requests)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))


def below_ephemeral(count: int = 1) -> tuple[int, int]:
    """Where to pick a port for a child to bind: below the kernel's ephemeral
    range (``net.ipv4.ip_local_port_range``) when there is room.

    A port the kernel picks (``bind(0)``) is in that range, where any outgoing
    connection on the machine can take it between the check and the moment
    the child binds it: a benchmark's node then fails to start, "Address
    already in use".
    """
    low = 32_768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as handle:
            low = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return (10_000, low - count) if low - count > 10_000 else (20_000, 60_000)


def free_block(
    count: int,
    *,
    within: tuple[int, int] | None = None,
    avoid: set[int] | None = None,
    attempts: int = 50,
) -> int:
    """A port P with P..P+count-1 all free on 127.0.0.1 now, picked at random
    ``within`` a range (:func:`below_ephemeral` by default) and outside
    ``avoid``, to which the block is added: ports handed out before that a
    child may not have bound yet (``up`` binds P and P+1..P+N)."""
    start, end = within or below_ephemeral(count)
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(attempts):
        base = rng.randrange(start, end - count + 1)
        block = range(base, base + count)
        if avoid is not None and any(port in avoid for port in block):
            continue
        sockets = []
        try:
            for port in block:
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        if avoid is not None:
            avoid.update(block)
        return base
    raise RuntimeError(f"no {count} free ports in a row on 127.0.0.1 in {start}-{end}")


def die_with_parent(
    parent: int, *, signum: int = signal.SIGKILL, own_group: bool = True
) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets ``signum`` when the parent dies (Linux), so
    no child outlives a parent killed with ``kill -9``; with ``own_group`` it also
    gets a process group of its own (a terminal's Ctrl-C reaches the parent
    alone, which stops the children in order). ``parent`` is the parent's pid,
    read before the fork.

    Only for a parent that runs no threads (the supervisor of ``ringlimit
    up``): a ``preexec_fn`` runs Python between fork and exec, and makes
    ``subprocess`` fork rather than spawn. ``router --workers``, whose
    supervisor has run gRPC (the etcd check), has each worker call
    :func:`watch_parent` itself; the tests start their children with
    ``setpriv --pdeathsig`` (tests/redis_server.py).
    """

    def setup() -> None:  # pragma: no cover - runs in the child
        if own_group:
            os.setpgrp()
        watch_parent(parent, signum)

    return setup


def watch_parent(parent: int, signum: int) -> None:
    """Get ``signum`` when process ``parent`` dies (Linux); exit at once if it
    has died already (before this took effect, the child was not told)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum)
    if os.getppid() != parent:
        os._exit(1)


class ChildProcess:
    """One child process: started at once, stopped by :meth:`stop` (or :func:`stop_all`).

    ``log``: a file that gets the child's stdout and stderr (None: the child
    writes where this process does). ``new_session``: the child leads its own
    session and process group.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        log: Path | None = None,
        preexec_fn: Callable[[], None] | None = None,
        new_session: bool = False,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log
        self._log: IO[bytes] | None = open(log, "wb") if log is not None else None  # noqa: SIM115 (closed in stop)
        self.popen: subprocess.Popen[bytes] = subprocess.Popen(
            self.argv,
            cwd=cwd,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            preexec_fn=preexec_fn,
            start_new_session=new_session,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def returncode(self) -> int | None:
        """The exit code (negative: the signal that killed it), None while it runs."""
        return self.popen.poll()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_text(self) -> str:
        """``exited with code 1`` / ``killed by SIGKILL`` (``running`` while it runs)."""
        code = self.popen.poll()
        return "running" if code is None else describe_exit(code)

    # ------------------------------------------------------------------ signals

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` if the process is still there (a race with its exit is no error)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(signum)

    def pause(self) -> None:
        """SIGSTOP: the process keeps its sockets but runs nothing (a GC or VM pause)."""
        self.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.send_signal(signal.SIGCONT)

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL to the process alone, and reap it."""
        if self.alive():
            self.send_signal(signal.SIGKILL)
            self.popen.wait(timeout)

    def kill_group(self, timeout: float = 10.0) -> None:
        """SIGKILL to the process's group when it leads one (its own children
        go too), else to the process alone; and reap it."""
        if not self.alive():
            return
        leads_group = False
        with contextlib.suppress(OSError):
            leads_group = os.getpgid(self.pid) == self.pid
        if leads_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        else:
            self.send_signal(signal.SIGKILL)
        self.popen.wait(timeout)

    # ------------------------------------------------------------------ stopping

    def begin_stop(self, how: int = signal.SIGTERM) -> None:
        """Ask it to stop: resumed first (a stopped process would not act on ``how``)."""
        if self.alive():
            self.resume()
            self.send_signal(how)

    def finish_stop(self, deadline: float) -> None:
        """Wait for it until ``deadline`` (monotonic; at least 0.1 s), then kill its group."""
        try:
            self.popen.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill_group()
        self.close_log()

    def stop(self, timeout: float = 10.0, how: int = signal.SIGTERM) -> None:
        """``how`` (SIGTERM: a node leaves gracefully), then SIGKILL after ``timeout``."""
        stop_all([self], timeout, how)

    # ------------------------------------------------------------------ output

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()

    def output(self) -> str:
        """Everything it wrote so far ("" when it writes to this process's outputs)."""
        if self.log_path is None:
            return ""
        if self._log is not None and not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def describe(self) -> str:
        """``n1 (pid 12) exited with code 1``: the start of a one-line exit report."""
        return f"{self.name} (pid {self.pid}) {self.exit_text()}"


def stop_all(
    children: Iterable[ChildProcess], timeout: float = 10.0, how: int = signal.SIGTERM
) -> None:
    """Stop several children together: ``how`` to each, then one shared deadline,
    then SIGKILL to each one still there (and to its process group)."""
    chosen = list(children)
    for child in chosen:
        child.begin_stop(how)
    deadline = time.monotonic() + timeout
    for child in chosen:
        child.finish_stop(deadline)


# ---------------------------------------------------------------------- readiness


def wait_ready(
    probe: Callable[[], T | None],
    *,
    timeout: float,
    failed: Callable[[], str | None] | None = None,
    stopping: Callable[[], bool] | None = None,
    interval: float = 0.05,
    what: str = "not ready",
) -> T | None:
    """Poll ``probe`` until it answers (anything but None) and return the answer.

    Between polls, ``failed()`` names a reason to give up (a child exited: raise
    :class:`NotReady` with it), and ``stopping()`` says the caller was asked to
    stop (return None). After ``timeout`` seconds: ``NotReady("<what> within
    <timeout> s")``.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if stopping is not None and stopping():
            return None
        problem = failed() if failed is not None else None
        if problem:
            raise NotReady(problem)
        answer = probe()
        if answer is not None:
            return answer
        time.sleep(interval)
    raise NotReady(f"{what} within {timeout:g} s")


def http_probe(
    client: httpx.Client, url: str, *, require_ok: bool = True
) -> Callable[[], bool | None]:
    """True once ``GET url`` answers 200 (any HTTP answer when not ``require_ok``)."""

    def probe() -> bool | None:
        try:
            status = client.get(url).status_code
        except httpx.HTTPError:
            return None
        return True if status == 200 or (not require_ok and status < 600) else None

    return probe


def redis_probe(port: int, host: str = "127.0.0.1") -> Callable[[], bool | None]:
    """True once a Redis server on ``port`` answers PING with PONG."""

    def probe() -> bool | None:
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5) as sock:
            sock.sendall(b"PING\r\n")
            if sock.recv(64).startswith(b"+PONG"):
                return True
        return None

    return probe
