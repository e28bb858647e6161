"""Forwarding to nodes on this host through their Unix sockets.

A node started with ``--unix-socket PATH`` (node/unixsocket.py) names the path
in its ``/healthz``. Through it, a forward skips the kernel's TCP work at both
ends of the hop (docs/performance.md: 2.5-9 µs of CPU less per request on the
router and 3-9 µs on the node; sticky req/s 0.98-1.18x of TCP's per round). But a
path is only a name: in containers the same path can reach another
container's node, and on one host a node started again, or another node, can
be on it. Forwarding a request to the wrong process would decide it against
the wrong counters, or not at all.

So a socket is used only once it has been *checked*: ``/healthz`` asked through
it answers as the same node and the same process (``instance``) as the
member's URL does, the socket's file is the same before and after the
question, and the kernel names the process that answered (its pid, from
``SO_PEERCRED``). The forwarder then opens a new connection through the socket
only while the file at the path is still that one (device, inode and change
time) and the process listening there is that pid (router/fastclient.py): a
process that binds the path later, or takes over the file, is not used until
it is checked in turn; until then connections go over TCP, which is always
there. When the socket refuses (its node stopped listening on it), the
forwarder goes back to TCP by itself. Checks run for every member of the view
every :data:`CHECK_INTERVAL` seconds, and as soon as a view brings a new one.

Only members whose URL is a loopback address (or ``localhost``) are checked: a
node elsewhere names a path on its own host, which this router must not even
look at. A process in a pid namespace this router cannot see has no pid for
it (0), and is not used.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from node.security import is_loopback
from node.unixsocket import CheckedSocket, file_identity, peer_credentials
from ring import Member
from router.fastclient import FastForwarder

log = logging.getLogger("ringlimit.router")

#: Seconds between two checks of every member's socket.
CHECK_INTERVAL = 5.0
#: Seconds a check waits for each ``/healthz`` answer.
CHECK_TIMEOUT = 1.0
#: What a check sends through a socket, and the bytes of an answer it reads at most.
HEALTHZ_REQUEST = b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n"
MAX_HEALTH_ANSWER = 64 * 1024

Healthz = Callable[[Member, float], Awaitable["dict[str, Any] | None"]]


class LocalSockets:
    """Keeps ``forwarder`` going through the Unix sockets of the members that
    offer one and answer through it as themselves.

    ``healthz(member, within)`` is a member's ``/healthz`` over its URL
    (router/nodeclient.py); ``members()`` the members to check (the view's).
    """

    def __init__(
        self,
        forwarder: FastForwarder,
        healthz: Healthz,
        members: Callable[[], Iterable[Member]],
        *,
        interval: float = CHECK_INTERVAL,
        within: float = CHECK_TIMEOUT,
    ) -> None:
        self.forwarder = forwarder
        self._healthz = healthz
        self._members = members
        self.interval = interval
        self.within = within
        #: Set to check at once (a view with a new member came).
        self._wake = asyncio.Event()
        #: The URLs of the members the last round checked.
        self._urls: set[str] = set()

    def view_changed(self, view: Iterable[Member]) -> None:
        """Check at once if ``view`` has a member the last round did not check
        (a membership view watcher)."""
        if any(member.url not in self._urls for member in view):
            self._wake.set()

    async def run(self) -> None:
        """Check every member, every ``interval`` seconds or when woken; until cancelled."""
        while True:
            self._wake.clear()
            try:
                await self.check_all()
            except Exception:  # (a defect here must not end the checks for good)
                log.exception("checking the nodes' Unix sockets failed")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.interval)

    async def check_all(self) -> None:
        members = list(self._members())
        self._urls = {member.url for member in members}
        await asyncio.gather(*(self.check(member) for member in members))

    async def check(self, member: Member) -> str | None:
        """Check ``member``'s socket and set the forwarder accordingly: the path
        its new connections go through, None for TCP."""
        if not _on_this_host(member.url):
            return None  # (a socket is only ever this host's)
        try:
            socket = await self._checked(member)
        except Exception as exc:  # (a check never stops forwarding)
            log.debug("checking %s's Unix socket failed: %s", member.id, exc)
            socket = None
        was = self.forwarder.socket_of(member.url)
        self.forwarder.through(member.url, socket)
        now = None if socket is None else socket.path
        if now != was:
            if now is None:
                log.info("forwarding to node %s over TCP (%s)", member.id, member.url)
            else:
                log.info("forwarding to node %s through its Unix socket %s", member.id, now)
        return now

    async def _checked(self, member: Member) -> CheckedSocket | None:
        """``member``'s socket if it answers as the process its URL reaches; None if
        it offers none, or it does not."""
        health = await self._healthz(member, self.within)
        if health is None or health.get("node") != member.id:
            return None
        path, instance = health.get("unix_socket"), health.get("instance")
        if not isinstance(path, str) or not path or not isinstance(instance, str):
            return None
        try:
            before = file_identity(path)
        except (OSError, ValueError):
            return None  # not on this host (or not this container's)
        answer = await _healthz_through(path, self.within)
        if answer is None:
            return None
        through, pid = answer
        if through.get("node") != member.id or through.get("instance") != instance or pid <= 0:
            return None
        try:
            after = file_identity(path)
        except OSError:
            return None
        return CheckedSocket(path, before, pid) if after == before else None


def _on_this_host(url: str) -> bool:
    """Whether ``url`` names a loopback address or ``localhost``: a node elsewhere
    names a path on its own host, which this router must not even look at (a
    ``stat`` of a hung network mount would hold its event loop)."""
    host = urlsplit(url).hostname
    return host is not None and (host == "localhost" or is_loopback(host))


async def _healthz_through(path: str, within: float) -> tuple[dict[str, Any], int] | None:
    """``/healthz`` asked through the Unix socket at ``path``, and the pid of the
    process that answered (``SO_PEERCRED`` of the connection: 0 where it is in a
    pid namespace this one cannot see); None without a JSON object in time.

    A request by hand, not httpx's: its transport builds an SSL context (the CA
    bundle loaded) for every socket, on the event loop: 21-26 ms here
    (``python -m timeit -s "import httpx" "httpx.AsyncHTTPTransport(uds='/tmp/x')"``)."""
    try:
        return await asyncio.wait_for(_ask_healthz(path), within)
    except (OSError, TimeoutError, ValueError):
        return None


async def _ask_healthz(path: str) -> tuple[dict[str, Any], int] | None:
    reader, writer = await asyncio.open_unix_connection(path)
    try:
        pid = peer_credentials(writer.get_extra_info("socket"))[0]
        writer.write(HEALTHZ_REQUEST)
        answer = b""
        while len(answer) <= MAX_HEALTH_ANSWER:
            chunk = await reader.read(65536)
            if not chunk:
                break
            answer += chunk
    finally:
        writer.close()
    head, ended, body = answer.partition(b"\r\n\r\n")
    if not ended or not head.startswith(b"HTTP/1.1 200 ") or b"chunked" in head.lower():
        return None  # (a node answers /healthz 200, with a length, and closes)
    data = json.loads(body)
    return (data, pid) if isinstance(data, dict) else None
