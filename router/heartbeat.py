"""Whether a router worker still runs: the supervisor's ping of its event loop.

A worker that exits is seen at once (``Popen.poll``); one that hangs is not.
A worker paused (SIGSTOP), stuck in a blocking call or spinning in a loop
keeps its sockets: the kernel goes on handing it a share of the public port's
new connections, which then wait forever, and a hung leader stops the health
checks and the lease renewals the nodes decide under, so after a lease every
node answers per ``on_error``. (An exploratory tester found the supervisor
never noticed one.)

So each worker gets one end of a socket pair at its start, and its event loop
echoes every byte it reads there (:func:`answer_pings`). The supervisor sends
a byte every ``interval`` seconds; an echo proves the worker's event loop
runs, whatever the worker is doing (serving, or draining after a SIGTERM,
which closes its listening sockets: a first version probed ``/healthz`` on
the admin socket, whose copy in the supervisor kept taking connections that
no one read, and killed a worker finishing its requests; the review caught
it). A worker that has echoed once and then leaves a ping unanswered for
``timeout`` seconds is hung; the supervisor kills it (SIGKILL: a paused
process does not act on SIGTERM) and starts it again.

Two things must not count as a hang. A worker still starting (loading a
state file, asking its seeds) echoes nothing yet and is not judged: it
answers pings once it serves, and the supervisor's other rules cover a start
that fails. And a supervisor that was itself paused, with its workers or not,
finds every ping old when it resumes: a step that comes ``pause_gap`` seconds
or more after the one before starts the wait again, so that only time the
supervisor was running to see counts.

No threads (``subprocess``'s ``preexec_fn`` forbids them) and no event loop in
the parent: non-blocking sends and reads of a socket pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import socket

#: What the supervisor sends; the worker sends back what it reads.
PING = b"?"
#: Seconds between two steps beyond which the supervisor did not run (paused).
PAUSE_GAP = 1.0


def answer_pings(sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
    """The worker's side: echo each ping from ``loop`` until the supervisor's end
    closes. Registered as the worker starts serving, so a worker still starting
    is not judged."""
    sock.setblocking(False)

    def echo() -> None:
        try:
            data = sock.recv(64)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the supervisor is gone: nothing to answer
            loop.remove_reader(sock.fileno())
            return
        with contextlib.suppress(OSError):
            sock.send(data)

    loop.add_reader(sock.fileno(), echo)


class Heartbeat:
    """The supervisor's side for one worker's life: ping, read the echo, judge
    how long a ping has waited."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        interval: float,
        timeout: float,
        pause_gap: float = PAUSE_GAP,
    ) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.interval = interval
        self.timeout = timeout
        self.pause_gap = pause_gap
        self._sent_at = -math.inf
        self._last_step: float | None = None
        #: When the oldest ping still unanswered was sent (None: none is).
        self._waiting_since: float | None = None
        #: When the worker last echoed (None: not yet, and until it has it is
        #: not judged).
        self.answered_at: float | None = None

    def step(self, now: float) -> None:
        """Take an echo that came; send the next ping when one is due."""
        if self._last_step is not None and now - self._last_step >= self.pause_gap:
            self.forgive(now)  # this process did not run meanwhile
        self._last_step = now
        try:
            data = self.sock.recv(64)
        except BlockingIOError:
            data = None  # nothing yet
        except OSError:
            data = b""
        if data:
            self.answered_at = now
            self._waiting_since = None
        if self._waiting_since is not None or now - self._sent_at < self.interval:
            return
        self._sent_at = self._waiting_since = now
        with contextlib.suppress(OSError):  # a full buffer or a worker gone: unanswered
            self.sock.send(PING)

    def forgive(self, now: float) -> None:
        """The supervisor did not run for a while: a wait that spanned it starts now."""
        if self._waiting_since is not None:
            self._waiting_since = now

    def hung_for(self, now: float) -> float | None:
        """Seconds the worker has left a ping unanswered, once that is ``timeout``
        or more after it had answered; else None."""
        if self.answered_at is None or self._waiting_since is None:
            return None
        waited = now - self._waiting_since
        return waited if waited >= self.timeout else None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()
