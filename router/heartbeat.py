"""Whether a router worker still serves: the supervisor's probe of its event loop.

A worker that exits is seen at once (``Popen.poll``); one that hangs is not.
A worker paused (SIGSTOP), stuck in a blocking call or spinning in a loop
keeps its sockets: the kernel goes on handing it a share of the public port's
new connections, which then wait forever, and a hung leader stops the health
checks and the lease renewals the nodes decide under, so after a lease every
node answers per ``on_error``. (An exploratory tester found the supervisor
never noticed one.)

So the supervisor asks each worker for ``/healthz`` on its private admin
socket every ``interval`` seconds. Any answer, whatever its status, proves
the worker's event loop runs: it is the loop that accepts, reads and writes.
A worker that has answered once and then leaves a probe unanswered for
``timeout`` seconds is hung; the supervisor kills it (SIGKILL: a paused
process does not act on SIGTERM) and starts it again.

Two things must not count as a hang. A worker still starting (loading a
state file, asking its seeds) has answered nothing yet and is not judged:
the supervisor's other rules cover a start that fails. And a supervisor that
was itself paused, with its workers or not, finds every probe old when it
resumes: :meth:`Heartbeat.forgive` starts the wait again for a probe that was
in flight across such a gap, so that only time the supervisor was running to
see counts.

The probe is a plain blocking connect with a short timeout (the admin socket
is local and stays listening while its worker lives, so a hung worker's
backlog completes it) and a non-blocking read: no threads, which
``subprocess``'s ``preexec_fn`` forbids, and no event loop in the parent.
"""

from __future__ import annotations

import contextlib
import math
import socket

#: What the supervisor sends; any bytes back prove the worker's loop runs.
PROBE = b"GET /healthz HTTP/1.1\r\nHost: supervisor\r\nConnection: close\r\n\r\n"
#: A connect that takes longer than this (a full backlog) counts as unanswered.
CONNECT_TIMEOUT = 0.25


class Heartbeat:
    """One worker's probe: send one, wait for its answer, judge how long it waits."""

    def __init__(self, address: tuple[str, int], *, interval: float, timeout: float) -> None:
        self.address = address
        self.interval = interval
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._sent_at = -math.inf
        #: When the oldest probe still unanswered was sent (None: none is).
        self._waiting_since: float | None = None
        #: When the worker last answered since its start (None: not yet, and
        #: until it has it is not judged).
        self.answered_at: float | None = None

    def restart(self) -> None:
        """The worker was started (again): nothing is judged until it answers."""
        self._close()
        self._waiting_since = None
        self._sent_at = -math.inf
        self.answered_at = None

    def forgive(self, now: float) -> None:
        """The supervisor did not run for a while: a wait that spanned it starts now."""
        if self._waiting_since is not None:
            self._waiting_since = now

    def step(self, now: float) -> None:
        """Take an answer that came; send the next probe when one is due."""
        if self._sock is not None:
            try:
                data = self._sock.recv(64)
            except BlockingIOError:
                return  # still waiting
            except OSError:
                data = b""
            self._close()
            if data:
                self.answered_at = now
                self._waiting_since = None
        if now - self._sent_at < self.interval:
            return
        self._sent_at = now
        if self._waiting_since is None:
            self._waiting_since = now
        try:
            sock = socket.create_connection(self.address, timeout=CONNECT_TIMEOUT)
        except OSError:
            return  # unanswered: the wait goes on
        try:
            sock.sendall(PROBE)
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        self._sock = sock

    def hung_for(self, now: float) -> float | None:
        """Seconds the worker has left a probe unanswered, once that is ``timeout``
        or more after it had answered; else None."""
        if self.answered_at is None or self._waiting_since is None:
            return None
        waited = now - self._waiting_since
        return waited if waited >= self.timeout else None

    def close(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
