"""``ringlimit router --workers N``: N router processes behind one public port.

One router process is one core. With ``--workers N`` a small parent process
(this module's :class:`Supervisor`) starts N workers, each a whole router
(``python -m router router ...`` with the same arguments), and gives each

* its own listening socket on the public port, bound with ``SO_REUSEPORT``:
  the kernel spreads new connections over the workers' sockets;
* a private admin socket with a port of its own (on 127.0.0.1, or on ``--host``
  with ``--coordinator``), whose URL is the worker's address for the other
  workers: a worker that does not lead passes admin calls to the leader there.

The sockets are bound by the parent, so a port in use is one line before any
worker starts, and passed to the workers as inherited file descriptors
(:func:`worker_sockets`). The parent closes its copy of a public socket once
the worker has it: a worker that dies takes its socket out of the port's
group, and the kernel stops sending it connections. Admin sockets stay open in
the parent so that a restarted worker keeps its admin URL.

Exactly one worker leads membership:

* with ``--coordinator`` every worker is an ordinary router of the etcd
  cluster (router/coordinator.py elects one of them, or a router elsewhere);
* without, worker 0 leads (state file, health checks, leases, admin changes)
  and the others are followers: no health checks, no state file, admin calls
  forwarded to worker 0 (``RouterSettings.leader_url``), and new views learnt
  from the nodes' refusals (a newer epoch: catch up) and from a poll of
  worker 0's ring every ``FOLLOW_INTERVAL`` seconds.

The parent restarts a worker that exits, and kills (SIGKILL) and restarts one
that stops echoing its pings for ``--worker-timeout`` seconds: paused or
hung, it keeps its sockets, so no exit would ever show it
(router/heartbeat.py). It restarts a worker (one line each time) unless it never
served (it could not start: a seed that does not answer, a bad flag; a single
router would have exited too) or the workers keep dying at start
(``CRASH_LOOP`` exits within ``CRASH_WINDOW`` seconds of their start): then
it stops them all and exits 1. ``router --workers`` checks a state file
before it starts any worker, so a bad one is one line, as for a single
router. A leading worker
started again after it had served does not die on a state file it cannot read
or write (a full disk, a read-only mount): it warns, and takes the ring from
the other workers and the nodes; at a first start such a file is fatal. SIGTERM or
SIGINT to the parent stops every worker (SIGTERM each, then SIGKILL after a
grace period) and exits 0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

from router.heartbeat import Heartbeat
from router.processes import StopSignals, check_port_free, child_env, ringlimit_argv

#: Environment of a worker: its index, inherited socket fds and the leader's URL.
WORKER_ENV = "RINGLIMIT_WORKER"
#: A worker that exits this soon after its start counts towards a crash loop.
CRASH_WINDOW = 5.0
CRASH_LOOP = 3
#: Seconds a worker has to stop after SIGTERM before it is killed.
STOP_GRACE = 15.0
#: Default seconds a worker that served may leave a ping unanswered before it is
#: killed and started again (router/heartbeat.py); uvicorn's supervisor waits 5 too.
WORKER_TIMEOUT = 5.0
#: Seconds between pings of one worker.
PING_INTERVAL = 0.5
#: The most workers one supervisor starts. A worker is a core's worth of router;
#: each one's role names every worker's admin URL in its environment, and at
#: 10,000 workers that environment was past the kernel's limit (E2BIG, which the
#: CLI then reported as a port it could not bind).
MAX_WORKERS = 256


class WorkerStartError(Exception):
    """A worker process could not be started (the system refused the spawn)."""


@dataclass(frozen=True)
class WorkerRole:
    """What a worker process is told by its parent (through ``RINGLIMIT_WORKER``)."""

    index: int
    count: int
    public_fd: int
    admin_fd: int
    #: This worker's admin URL (its ``--advertise``).
    admin_url: str
    #: Without a coordinator: worker 0's admin URL for the others (None for worker 0).
    leader_url: str | None
    #: Started again after it had served (the parent restarts a worker that dies).
    #: A worker that died at its first start (a bad ``--state-file``, say) is
    #: started again as at first: strict, so that it keeps failing in one line.
    restarted: bool = False
    #: Every worker's admin URL, by index (this one's included): a leader started
    #: again learns from the others' rings which nodes to recover its own from
    #: (it may have no state file), and ``/metrics`` gathers every worker's.
    admin_urls: tuple[str, ...] = ()
    #: The worker's end of its socket pair with the supervisor, whose pings its
    #: event loop echoes (router/heartbeat.py); -1: none (``--worker-timeout 0``).
    ping_fd: int = -1
    #: The supervisor's pid: the worker asks for SIGTERM when it dies
    #: (:func:`router.processes.watch_parent`; 0: not asked).
    parent: int = 0

    def encode(self) -> str:
        return ";".join(
            [
                str(self.index),
                str(self.count),
                str(self.public_fd),
                str(self.admin_fd),
                self.admin_url,
                self.leader_url or "",
                "1" if self.restarted else "",
                ",".join(self.admin_urls),
                str(self.ping_fd),
                str(self.parent),
            ]
        )

    @classmethod
    def decode(cls, value: str) -> WorkerRole:
        index, count, public_fd, admin_fd, admin_url, leader_url, restarted, urls, ping, parent = (
            value.split(";")
        )
        return cls(
            int(index),
            int(count),
            int(public_fd),
            int(admin_fd),
            admin_url,
            leader_url or None,
            restarted=bool(restarted),
            admin_urls=tuple(url for url in urls.split(",") if url),
            ping_fd=int(ping),
            parent=int(parent),
        )

    @property
    def name(self) -> str:
        """The worker's name in ``X-Ringlimit-Router``, log lines and metrics."""
        return f"w{self.index}"

    @property
    def fellows(self) -> dict[str, str]:
        """The other workers: name -> admin URL."""
        return {f"w{i}": url for i, url in enumerate(self.admin_urls) if i != self.index}


def worker_role() -> WorkerRole | None:
    """This process's role when a supervisor started it as a worker, else None."""
    value = os.environ.get(WORKER_ENV)
    return WorkerRole.decode(value) if value else None


def worker_sockets(role: WorkerRole) -> list[socket.socket]:
    """The public and admin sockets inherited from the parent."""
    return [socket.socket(fileno=role.public_fd), socket.socket(fileno=role.admin_fd)]


def ping_socket(role: WorkerRole) -> socket.socket | None:
    """The worker's end of its socket pair with the parent (None: not pinged)."""
    return socket.socket(fileno=role.ping_fd) if role.ping_fd >= 0 else None


def bind_public(host: str, port: int) -> socket.socket:
    """A socket on the public port that other workers' sockets may share."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def bind_admin(host: str) -> socket.socket:
    """A worker's private socket, on a port the kernel picks."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def served(admin: socket.socket) -> bool:
    """Whether a worker started on ``admin`` got as far as serving: a worker
    listens on its sockets once its start succeeded (router/server.py), and the
    parent's copy of the admin socket stays listening after the worker dies."""
    return bool(admin.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@dataclass
class _Worker:
    index: int
    admin: socket.socket
    process: subprocess.Popen[bytes] | None = None
    started: float = 0.0
    quick_exits: int = 0
    heartbeat: Heartbeat | None = None
    #: Killed as hung: its exit is collected by the next passes, not waited for.
    killed: bool = False


class Supervisor:
    """Starts the workers, restarts one that exits, stops them all when told."""

    def __init__(
        self,
        argv: Sequence[str],
        count: int,
        *,
        host: str,
        port: int,
        admin_host: str,
        advertise_host: str,
        coordinated: bool,
        worker_timeout: float = WORKER_TIMEOUT,
    ) -> None:
        self.argv = list(argv)
        self.count = count
        self.host = host
        self.port = port
        self.advertise_host = advertise_host
        self.coordinated = coordinated
        self.workers = [_Worker(i, bind_admin(admin_host)) for i in range(count)]
        self.worker_timeout = worker_timeout

    def admin_url(self, index: int) -> str:
        return _url(self.advertise_host, self.workers[index].admin.getsockname()[1])

    def _role(self, worker: _Worker, public: socket.socket, ping_fd: int) -> WorkerRole:
        leader = None if self.coordinated or worker.index == 0 else self.admin_url(0)
        return WorkerRole(
            worker.index,
            self.count,
            public.fileno(),
            worker.admin.fileno(),
            self.admin_url(worker.index),
            leader,
            restarted=worker.process is not None and served(worker.admin),
            admin_urls=tuple(self.admin_url(other.index) for other in self.workers),
            ping_fd=ping_fd,
            parent=os.getpid(),
        )

    def start(self, worker: _Worker) -> None:
        if worker.heartbeat is not None:
            worker.heartbeat.close()  # the last life's
            worker.heartbeat = None
        public = bind_public(self.host, self.port)
        ours: socket.socket | None = None
        theirs: socket.socket | None = None
        try:
            if self.worker_timeout > 0:
                ours, theirs = socket.socketpair()
            if self.port == 0:
                self.port = public.getsockname()[1]
            fds = [public.fileno(), worker.admin.fileno()]
            if theirs is not None:
                fds.append(theirs.fileno())
            role = self._role(worker, public, theirs.fileno() if theirs is not None else -1)
            try:
                worker.process = subprocess.Popen(
                    ringlimit_argv(*self.argv),
                    env=child_env({**os.environ, WORKER_ENV: role.encode()}),
                    pass_fds=fds,
                    # No preexec_fn: a worker asks for SIGTERM when the supervisor
                    # dies (kill -9) itself, as it starts (role.parent). Python run
                    # between fork and exec, in a process that had run gRPC (the
                    # etcd check; a test's), saw a start die of SIGABRT, a gRPC
                    # poller's epoll fd closed under it; and without it subprocess
                    # spawns, not forks.
                )
            except OSError as exc:  # EAGAIN (a process limit), ENOMEM, E2BIG
                raise WorkerStartError(
                    f"cannot start router worker {worker.index}: {exc.strerror or exc}"
                ) from None
        except BaseException:
            if ours is not None:
                ours.close()
            raise
        finally:
            public.close()  # the worker holds it now; when it dies, so does its socket
            if theirs is not None:
                theirs.close()
        worker.started = time.monotonic()
        worker.killed = False
        if ours is not None:
            worker.heartbeat = Heartbeat(ours, interval=PING_INTERVAL, timeout=self.worker_timeout)
        print(
            f"ringlimit router: worker {worker.index} pid {worker.process.pid} on "
            f"{_url(self.host, self.port)}, admin {role.admin_url}"
            + (" (leads)" if role.leader_url is None and not self.coordinated else ""),
            file=sys.stderr,
            flush=True,
        )

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT/SIGHUP (0) or a crash loop (1)."""
        signals = StopSignals()
        try:
            if self.port:
                check_port_free(self.host, self.port)
            for worker in self.workers:
                self.start(worker)
            while not signals.stopping:
                for worker in self.workers:
                    if signals.stopping or worker.process is None:
                        continue
                    code = worker.process.poll()
                    if code is None:
                        self._kill_if_hung(worker)
                    elif not self._restart(worker, code):
                        return 1
                time.sleep(0.1)
            return 0
        finally:
            signals.say()
            self.stop()
            signals.restore()
            for worker in self.workers:
                if worker.heartbeat is not None:
                    worker.heartbeat.close()
                worker.admin.close()

    def _kill_if_hung(self, worker: _Worker) -> None:
        """Ping a running worker; kill one that stopped answering. Its exit is
        collected by a later pass, not waited for here: a process hung in the
        kernel (a write to a dead disk) dies only when that returns, and a wait
        here held every other worker and the supervisor's own SIGTERM."""
        heartbeat, process = worker.heartbeat, worker.process
        if heartbeat is None or process is None or worker.killed:
            return
        now = time.monotonic()
        heartbeat.step(now)
        waited = heartbeat.hung_for(now)
        if waited is None:
            return
        print(
            f"ringlimit router: worker {worker.index} (pid {process.pid}) answered no ping "
            f"for {waited:.1f} s (paused or hung); killing it",
            file=sys.stderr,
            flush=True,
        )
        with contextlib.suppress(ProcessLookupError):
            process.kill()  # SIGKILL: a paused process would hold SIGTERM
        worker.killed = True

    def _restart(self, worker: _Worker, code: int) -> bool:
        """One line for the exit; restart it unless it is crash-looping (False)."""
        how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
        if not served(worker.admin):
            # It never got as far as serving: restarting it would say the same
            # again (every 10 s, forever, for a seed that does not answer).
            print(
                f"ringlimit router: worker {worker.index} {how} before it served; "
                "stopping every worker",
                file=sys.stderr,
                flush=True,
            )
            return False
        quick = time.monotonic() - worker.started < CRASH_WINDOW
        worker.quick_exits = worker.quick_exits + 1 if quick else 0
        if worker.quick_exits >= CRASH_LOOP:
            print(
                f"ringlimit router: worker {worker.index} {how}, {CRASH_LOOP} times within "
                f"{CRASH_WINDOW:g} s of its start; stopping every worker",
                file=sys.stderr,
                flush=True,
            )
            return False
        print(
            f"ringlimit router: worker {worker.index} {how}; restarting it "
            "(the other workers kept serving)",
            file=sys.stderr,
            flush=True,
        )
        self.start(worker)
        return True

    def stop(self) -> None:
        running = [w for w in self.workers if w.process and w.process.poll() is None]
        for worker in running:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
                # A paused worker would hold the SIGTERM until it is killed at the
                # end of the grace (15 s): resumed, it stops as the others do.
                worker.process.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        deadline = time.monotonic() + STOP_GRACE
        for worker in running:
            process = worker.process
            assert process is not None
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                # Said: a worker killed here went without a word (an exploratory
                # tester saw one, twice in eleven stops, and could not tell why).
                print(
                    f"ringlimit router: worker {worker.index} (pid {process.pid}) did not stop "
                    f"within {STOP_GRACE:g} s of SIGTERM; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                process.kill()
                process.wait()
