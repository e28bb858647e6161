"""A node's Unix socket: the way a router on the same host reaches it without TCP.

On one host, a forward over loopback TCP still pays the kernel's TCP work at
both ends of the hop; over a Unix socket the router and the node each spend
a few µs less per request (2.5-9 µs measured), and sticky routing served
0.98-1.18x the requests of TCP per round (docs/performance.md).
The node keeps its TCP port: everything else (clients, peers, the router's
control plane, routers on other hosts) uses it, and the router takes the
socket only once it has checked that the socket answers as the very process
its URL reaches (router/localsockets.py).

Binding is careful because a path outlives its process: ``kill -9`` leaves the
file, which is replaced (nothing answers on it); a path some live process
listens on is refused (two nodes on one path would take each other's
forwards), and so is anything that is not a socket. The kernel takes at most
107 bytes of path; a longer one is refused with its length, rather than
bound to a truncated name. The socket is made ``0600``: only this user's
processes (the router of ``ringlimit up``) connect, and a peer of another user
that reaches it anyway (a mode changed by hand) is refused, root excepted
(node/frontdoor.py).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
from dataclasses import dataclass
from typing import NamedTuple

#: ``sun_path`` is 108 bytes on Linux, one of them the terminating NUL.
MAX_PATH_BYTES = 107
#: Seconds to wait for a live listener's answer when telling it from a stale file.
PROBE_TIMEOUT = 1.0
#: Connections the kernel queues for the socket (uvicorn's default backlog).
BACKLOG = 2048


#: What tells one socket file from another at the same path: its inode number
#: alone does not (a file made after one is removed often gets the number back),
#: with its device and change time (to the nanosecond) it does.
FileIdentity = tuple[int, int, int]


def file_identity(path: str) -> FileIdentity:
    """The identity of the file at ``path`` (``OSError`` if there is none)."""
    found = os.stat(path)
    return (found.st_dev, found.st_ino, found.st_ctime_ns)


_CREDENTIALS = struct.Struct("3i")


def peer_credentials(connected: socket.socket) -> tuple[int, int]:
    """The (pid, uid) of the process at the other end of a connected Unix socket,
    as the kernel saw it connect or listen (``SO_PEERCRED``; for a connection
    to a listener, the process that called ``listen``: a node never hands its
    listener to another). The pid is 0 where that process is in a pid namespace
    this one cannot see."""
    pid, uid, _ = _CREDENTIALS.unpack(
        connected.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
    )
    return pid, uid


class CheckedSocket(NamedTuple):
    """A node's Unix socket as a router checked it (router/localsockets.py): its
    path, the file's identity, and the pid of the process that answered there."""

    path: str
    identity: FileIdentity
    pid: int


class UnixSocketError(ValueError):
    """The socket cannot be bound at that path (the message says why, in one line)."""


@dataclass(frozen=True)
class UnixListener:
    """A bound Unix socket and the identity of the file it made."""

    path: str
    socket: socket.socket
    identity: FileIdentity

    def remove(self) -> None:
        """Remove the socket's file once this process stopped listening on it,
        unless another process listens there now (a node started since on the
        same path keeps its own). The file's device and inode must be this
        socket's, and whoever listens there is asked (a new file may get the
        inode number back; a ``chmod`` changes the change time)."""
        try:
            found = os.lstat(self.path)
        except OSError:
            return
        if not stat.S_ISSOCK(found.st_mode) or (found.st_dev, found.st_ino) != self.identity[:2]:
            return  # another file there now (a chmod changes only the third part)
        try:
            listener = _listener(self.path)
        except OSError:
            return  # gone already, or not ours to judge
        # Nobody listens there (this process's, closed), or this process still does.
        if listener in (None, os.getpid()):
            with contextlib.suppress(OSError):
                os.unlink(self.path)


def bind_unix(path: str) -> UnixListener:
    """A stream socket bound and listening at ``path`` (the server that takes it
    serves it); :class:`UnixSocketError` when the path cannot be this node's."""
    size = len(os.fsencode(path))
    if not path or size > MAX_PATH_BYTES:
        raise UnixSocketError(
            f"--unix-socket {path!r}: a Unix socket's path has 1 to {MAX_PATH_BYTES} bytes; "
            f"this one has {size} (choose a shorter path)"
        )
    _clear_stale(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Made 0600 as it is made (a chmod after the bind follows a symlink put there
    # meanwhile); the process is still starting, no other thread makes files.
    mask = os.umask(0o177)
    try:
        listener.bind(path)
        # Listening from the start: a second node given this path finds it live
        # (bound and not listening, it looked like a file left by a dead process).
        listener.listen(BACKLOG)
        identity = file_identity(path)
    except OSError as exc:
        listener.close()
        raise UnixSocketError(f"--unix-socket {path!r}: cannot bind: {exc.strerror}") from None
    finally:
        os.umask(mask)
    return UnixListener(path, listener, identity)


def _clear_stale(path: str) -> None:
    """Remove a socket file nothing listens on; refuse a live one and anything else."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise UnixSocketError(f"--unix-socket {path!r}: {exc.strerror}") from None
    if not stat.S_ISSOCK(found.st_mode):
        raise UnixSocketError(
            f"--unix-socket {path!r}: something that is not a socket is there; "
            "remove it or choose another path"
        )
    try:
        listener = _listener(path)
    except OSError as exc:
        # Not ours to take (a timeout: a live listener with a full backlog).
        raise UnixSocketError(
            f"--unix-socket {path!r}: cannot tell whether a process listens on it "
            f"({exc.strerror or 'no answer'}); remove it or choose another path"
        ) from None
    if listener is None:
        # Left by a process that is gone (kill -9 does not remove it).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    raise UnixSocketError(
        f"--unix-socket {path!r}: another process listens on it (another node?); "
        "choose another path"
    )


def _listener(path: str) -> int | None:
    """The pid of the process listening on the socket at ``path``; None if nobody
    does (the connection is refused); ``OSError`` if that cannot be told."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return None
    else:
        return peer_credentials(probe)[0]
    finally:
        probe.close()
