"""Router to node over a Unix socket: binding it, checking it, falling back to TCP.

The binding rules (node/unixsocket.py) on real sockets; the forwarder's choice
between a checked socket and TCP (router/fastclient.py) against a server that
says which way each request came; and real router and node processes on
127.0.0.1, where a node's socket path taken by another process must not take
the node's forwards (router/localsockets.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from node.server import tcp_listeners
from node.unixsocket import (
    MAX_PATH_BYTES,
    CheckedSocket,
    UnixSocketError,
    bind_unix,
    file_identity,
)
from ring import Member
from router.fastclient import FastForwarder
from router.localsockets import CHECK_INTERVAL, LocalSockets
from tests.processes import Procs, free_port, wait_for, wait_healthy, wait_until

pytestmark = pytest.mark.anyio


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A folder with a short path (pytest's ``tmp_path`` can pass the 107 bytes a
    socket's path may have)."""
    path = Path(tempfile.mkdtemp(prefix="rl-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------- binding


def test_a_socket_left_by_a_dead_process_is_replaced(short_dir: Path) -> None:
    path = str(short_dir / "n1.sock")
    with socket.socket(socket.AF_UNIX) as left:
        left.bind(path)  # bound, never listening: what kill -9 leaves
    listener = bind_unix(path)
    try:
        assert file_identity(path) == listener.identity
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
    finally:
        listener.socket.close()
        listener.remove()
    assert not os.path.exists(path)


def test_a_path_a_live_process_listens_on_is_refused(short_dir: Path) -> None:
    path = str(short_dir / "n1.sock")
    with socket.socket(socket.AF_UNIX) as live:
        live.bind(path)
        live.listen()
        with pytest.raises(UnixSocketError, match="another process listens on it"):
            bind_unix(path)
        assert os.path.exists(path)  # left to its owner


def test_a_node_still_starting_holds_its_path(short_dir: Path) -> None:
    """Bound, a node listens at once: a second node given the path while the
    first one starts finds it live (bound and not listening, it looked like a
    file a dead process left, and was taken)."""
    path = str(short_dir / "n1.sock")
    first = bind_unix(path)
    try:
        with pytest.raises(UnixSocketError, match="another process listens on it"):
            bind_unix(path)
    finally:
        first.socket.close()
        first.remove()


def test_what_is_not_a_socket_is_left_alone(short_dir: Path) -> None:
    path = short_dir / "n1.sock"
    path.write_text("data")
    with pytest.raises(UnixSocketError, match="not a socket"):
        bind_unix(str(path))
    assert path.read_text() == "data"


@pytest.mark.parametrize("size", [0, MAX_PATH_BYTES + 1])
def test_a_path_the_kernel_would_cut_is_refused(short_dir: Path, size: int) -> None:
    base = str(short_dir) + "/"
    path = (base + "x" * max(0, size - len(base)))[:size]
    with pytest.raises(UnixSocketError, match=f"1 to {MAX_PATH_BYTES} bytes; this one has {size}"):
        bind_unix(path)


def test_removing_keeps_a_newer_processs_socket(short_dir: Path) -> None:
    path = str(short_dir / "n1.sock")
    first = bind_unix(path)
    first.socket.close()
    os.unlink(path)
    # Another process on the path since (its file may well get the same inode).
    with subprocess.Popen(
        [sys.executable, "-c", LISTENER, path], stdout=subprocess.PIPE, stdin=subprocess.PIPE
    ) as newer:
        try:
            assert newer.stdout is not None and newer.stdout.readline() == b"listening\n"
            first.remove()
            assert os.path.exists(path)
        finally:
            newer.kill()
            newer.wait(10)
    # A file that is no socket is not this node's either.
    os.unlink(path)
    Path(path).write_text("data")
    first.remove()
    assert Path(path).read_text() == "data"
    os.unlink(path)
    # Its own file, once nobody listens there, goes.
    again = bind_unix(path)
    again.socket.close()
    again.remove()
    assert not os.path.exists(path)


#: Listens on the socket at argv[1] until its stdin closes.
LISTENER = """
import socket, sys
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
print("listening", flush=True)
sys.stdin.read()
"""


# ---------------------------------------------------------------- the forwarder


class TwoWays:
    """An HTTP server on TCP and on a Unix socket, answering which one each
    request came by (``tcp`` or ``unix``), one request per connection."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []

    def answer(self, way: bytes):  # type: ignore[no-untyped-def]
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await reader.readuntil(b"\r\n\r\n")
                writer.write(
                    b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                    % (len(way), way)
                )
                await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        return handle

    async def listen_tcp(self) -> str:
        server = await asyncio.start_server(self.answer(b"tcp"), "127.0.0.1", 0)
        self.servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    async def listen_unix(self, path: str, way: bytes = b"unix") -> asyncio.Server:
        server = await asyncio.start_unix_server(self.answer(way), path)
        self.servers.append(server)
        return server


@pytest.fixture
async def two_ways() -> AsyncIterator[TwoWays]:
    ways = TwoWays()
    try:
        yield ways
    finally:
        for server in ways.servers:
            server.close()


async def _drop_pools(forwarder: FastForwarder, url: str) -> None:
    """Once its connections are closed (the server closes each), the node's pool
    is dropped and made again at the next request."""
    pool = forwarder.base(url)[0]
    await wait_until(pool.unused, 5)
    forwarder._forget_unused()
    assert forwarder.base(url)[0] is not pool


async def _way(forwarder: FastForwarder, url: str) -> bytes:
    answer = await forwarder.request("GET", url + "/", [], None)
    assert answer.status == 200
    return answer.body


async def test_the_forwarder_goes_through_the_checked_socket_and_back_to_tcp(
    two_ways: TwoWays, short_dir: Path
) -> None:
    url = await two_ways.listen_tcp()
    path = str(short_dir / "n1.sock")
    server = await two_ways.listen_unix(path)
    forwarder = FastForwarder()
    try:
        assert await _way(forwarder, url) == b"tcp"
        forwarder.through(url, CheckedSocket(path, file_identity(path), os.getpid()))
        assert forwarder.socket_of(url) == path
        assert await _way(forwarder, url) == b"unix"
        # A pool made again for the node (pools without connections are dropped)
        # keeps going through it.
        await _drop_pools(forwarder, url)
        assert await _way(forwarder, url) == b"unix"

        # The socket stops answering (its node closed it): TCP, by itself, and
        # no request fails.
        server.close()
        await server.wait_closed()
        assert await _way(forwarder, url) == b"tcp"
        assert forwarder.socket_of(url) is None
        await _drop_pools(forwarder, url)  # (nor does a pool made again for it)
        assert forwarder.socket_of(url) is None

        forwarder.through(url, None)
        assert await _way(forwarder, url) == b"tcp"
    finally:
        await forwarder.close()


async def test_a_socket_file_made_since_the_check_is_not_used(
    two_ways: TwoWays, short_dir: Path
) -> None:
    """Another process on the checked path (a node started again, another node)
    made a new file: not the one checked, so not used until checked in turn."""
    url = await two_ways.listen_tcp()
    path = str(short_dir / "n1.sock")
    first = await two_ways.listen_unix(path)
    forwarder = FastForwarder()
    try:
        forwarder.through(url, CheckedSocket(path, file_identity(path), os.getpid()))
        assert await _way(forwarder, url) == b"unix"
        first.close()
        await first.wait_closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        await asyncio.sleep(0.05)  # (kernels before 6.13 keep change times to a clock tick)
        await two_ways.listen_unix(path, b"another")
        assert await _way(forwarder, url) == b"tcp"
        assert forwarder.socket_of(url) is None
    finally:
        await forwarder.close()


async def test_a_socket_answered_by_another_process_than_the_checked_one_is_not_used(
    two_ways: TwoWays, short_dir: Path
) -> None:
    """The file is the one checked, but the process that accepts is not the one
    that answered the check (a file handed over, a race with a restart): the
    kernel says who accepted, and TCP is used."""
    url = await two_ways.listen_tcp()
    path = str(short_dir / "n1.sock")
    await two_ways.listen_unix(path)
    forwarder = FastForwarder()
    try:
        forwarder.through(url, CheckedSocket(path, file_identity(path), os.getpid() + 1))
        assert await _way(forwarder, url) == b"tcp"
        assert forwarder.socket_of(url) is None
    finally:
        await forwarder.close()


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        pytest.param("::", marks=pytest.mark.skipif(not _ipv6(), reason="no IPv6 here")),
    ],
)
def test_a_node_listens_where_the_event_loop_would_have(host: str) -> None:
    """With a Unix socket the node binds its TCP sockets itself; as
    ``loop.create_server`` does: every address of a name, IPv6 ones IPv6-only
    (``::`` took IPv4 too when uvicorn's ``bind_socket`` was used)."""
    port = free_port()
    listeners = tcp_listeners(host, port)
    try:
        families = {listener.family for listener in listeners}
        assert families == ({socket.AF_INET6} if host == "::" else families | {socket.AF_INET})
        for listener in listeners:
            assert listener.getsockname()[1] == port
            if listener.family == socket.AF_INET6:
                assert listener.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY) == 1
            listener.listen()
        with pytest.raises(ValueError, match=f"cannot listen on {host}:{port}"):
            tcp_listeners(host, port)
    finally:
        for listener in listeners:
            listener.close()


# ---------------------------------------------------------------- the check


async def _health_server(path: str, health: dict[str, object]) -> asyncio.Server:
    """A Unix socket answering ``/healthz`` with ``health``."""
    body = json.dumps(health).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    return await asyncio.start_unix_server(handle, path)


@pytest.mark.parametrize(
    ("through", "taken"),
    [
        ({"node": "n1", "instance": "a1"}, True),
        ({"node": "n1", "instance": "b2"}, False),  # n1, but another process of it
        ({"node": "n2", "instance": "a1"}, False),  # another node
        (None, False),  # nothing listens there
    ],
    ids=["same_process", "another_process", "another_node", "nobody"],
)
async def test_a_socket_is_taken_only_if_it_answers_as_the_process_the_url_reaches(
    short_dir: Path, through: dict[str, object] | None, taken: bool
) -> None:
    path = str(short_dir / "n1.sock")
    member = Member("n1", "http://127.0.0.1:9")
    over_url = {"node": "n1", "instance": "a1", "unix_socket": path}

    asked: list[Member] = []

    async def healthz(member: Member, within: float) -> dict[str, object]:
        asked.append(member)
        return over_url

    server = await _health_server(path, through) if through is not None else None
    if server is None:
        with socket.socket(socket.AF_UNIX) as left:
            left.bind(path)  # a file, nothing listening
    forwarder = FastForwarder()
    try:
        sockets = LocalSockets(forwarder, healthz, lambda: [member])
        forwarder.through(member.url, CheckedSocket(path, file_identity(path), os.getpid()))
        assert await sockets.check(member) == (path if taken else None)
        assert forwarder.socket_of(member.url) == (path if taken else None)
        # A node that names no socket (restarted without one) is reached over TCP.
        over_url.pop("unix_socket")
        assert await sockets.check(member) is None
        # A node on another host names a path of its own host: not looked at.
        elsewhere = Member("n1", "http://10.0.0.9:9")
        over_url["unix_socket"] = path
        assert await LocalSockets(forwarder, healthz, lambda: [elsewhere]).check(elsewhere) is None
        assert elsewhere not in asked
    finally:
        await forwarder.close()
        if server is not None:
            server.close()


async def test_a_view_with_a_new_member_is_checked_at_once(short_dir: Path) -> None:
    """The checks run every few seconds; a member a new view brings is checked
    when the view comes (its users' first requests go through its socket)."""
    path = str(short_dir / "n2.sock")
    server = await _health_server(path, {"node": "n2", "instance": "a1"})
    first, newcomer = Member("n1", "http://127.0.0.1:9"), Member("n2", "http://127.0.0.1:10")
    view = [first]

    async def healthz(member: Member, within: float) -> dict[str, object]:
        if member == newcomer:
            return {"node": "n2", "instance": "a1", "unix_socket": path}
        return {"node": "n1", "instance": "b2"}

    forwarder = FastForwarder()
    sockets = LocalSockets(forwarder, healthz, lambda: list(view), interval=3600)
    task = asyncio.create_task(sockets.run())
    try:
        await asyncio.sleep(0.1)  # (the first round, of n1 alone)
        view.append(newcomer)
        sockets.view_changed([first])  # nobody new: no round
        await asyncio.sleep(0.2)
        assert forwarder.socket_of(newcomer.url) is None
        sockets.view_changed(view)
        await wait_until(lambda: forwarder.socket_of(newcomer.url) == path, 5)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await forwarder.close()
        server.close()


# ---------------------------------------------------------------- real processes

RULES = """
[[rules]]
name = "five"
rate = "5/hour"
"""


def _ring_socket(router_url: str, node_id: str) -> str | None:
    nodes = httpx.get(router_url + "/admin/ring", timeout=5).json()["nodes"]
    return next(node.get("unix_socket") for node in nodes if node["id"] == node_id)


def _unix_connections(path: str) -> int:
    """Connected sockets on ``path`` (/proc/net/unix: the listener's accepted ones)."""
    with open("/proc/net/unix") as table:
        rows = [line.split() for line in table.read().splitlines()[1:]]
    return sum(1 for row in rows if len(row) >= 8 and row[7] == path and row[5] == "03")


def _statuses(router_url: str, user: str, count: int) -> list[int]:
    with httpx.Client(timeout=5) as client:
        return [
            client.get(router_url + "/", headers={"X-User-Id": user}).status_code
            for _ in range(count)
        ]


def _after(seconds: float, function, *args):  # type: ignore[no-untyped-def]
    time.sleep(seconds)
    return function(*args)


def _at_once(router_url: str, user: str, count: int) -> list[int]:
    """``count`` requests at the same moment: the router opens new connections
    to the node for them (one idle connection serves one at a time)."""

    async def send() -> list[int]:
        limits = httpx.Limits(max_connections=count)
        async with httpx.AsyncClient(timeout=5, limits=limits) as client:
            answers = await asyncio.gather(
                *(client.get(router_url + "/", headers={"X-User-Id": user}) for _ in range(count))
            )
        return sorted(answer.status_code for answer in answers)

    return asyncio.run(send())


def test_a_router_forwards_through_a_nodes_socket_only_while_it_answers_as_that_node(
    procs: Procs, short_dir: Path
) -> None:
    config = short_dir / "cluster.toml"
    config.write_text(RULES)
    path = str(short_dir / "n1.sock")
    _, node_url = procs.node("n1", None, "--config", str(config), "--unix-socket", path)
    _, router_url = procs.router(None, "--config", str(config), "--node", f"n1={node_url}")
    _, tcp_router = procs.router(
        None, "--config", str(config), "--node", f"n1={node_url}", "--no-unix-sockets"
    )
    assert wait_for(lambda: _ring_socket(router_url, "n1") == path, 15)
    assert _ring_socket(tcp_router, "n1") is None

    assert _statuses(router_url, "alice", 3) == [200] * 3
    # The forwards came through the socket: the router keeps their connection
    # (a check's own lasts a moment, and not twice 0.2 s apart).
    assert min(_unix_connections(path), _after(0.2, _unix_connections, path)) >= 1
    assert _statuses(tcp_router, "alice", 3) == [200, 200, 429]

    # Another process takes the path (the node's file removed, and a node of the
    # same id started on it: two containers sharing a folder, or a mistake). It
    # answers there as n1, but not as the process the router's URL reaches.
    os.unlink(path)
    impostor_port = free_port()
    impostor = procs.start(
        "impostor",
        ["node", "--id", "n1", "--port", str(impostor_port), "--unix-socket", path],
    )
    wait_healthy(f"http://127.0.0.1:{impostor_port}", impostor)
    # Decided by n1 still, on new connections too (the file is not the one
    # checked): alice has no request left; the impostor would give her five.
    assert _at_once(router_url, "alice", 20) == [429] * 20
    assert _at_once(router_url, "bob", 20) == [200] * 5 + [429] * 15
    # Checked again (past an interval), the socket is found answering as another
    # process: TCP still (a check that took it would show the path again).
    time.sleep(CHECK_INTERVAL + 1)
    assert _ring_socket(router_url, "n1") is None
    assert _at_once(router_url, "alice", 20) == [429] * 20
    assert _at_once(router_url, "carol", 20) == [200] * 5 + [429] * 15


def test_a_node_killed_leaves_its_socket_and_starts_again_on_it(
    procs: Procs, short_dir: Path
) -> None:
    path = str(short_dir / "n1.sock")
    port = free_port()
    proc, _ = procs.node("n1", port, "--unix-socket", path)
    proc.kill9()
    assert os.path.exists(path)
    again, _ = procs.node("n1", port, "--unix-socket", path)
    transport = httpx.HTTPTransport(uds=path)
    with httpx.Client(transport=transport, timeout=5) as client:
        assert client.get("http://localhost/healthz").json()["node"] == "n1"
        # A peer on the socket is on this host, as a loopback one: the internal API
        # (no token configured) serves it, as it refuses any other (403).
        assert client.get("http://localhost/internal/status").status_code == 200
    again.stop()
    assert not os.path.exists(path)  # removed at a clean stop


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to connect as another user")
def test_a_peer_of_another_user_is_not_served(procs: Procs, short_dir: Path) -> None:
    """A process of another user that reaches the socket anyway (its mode changed
    by hand) is not served: the connection closes unanswered. Root is served."""
    path = str(short_dir / "n1.sock")
    procs.node("n1", None, "--unix-socket", path)
    os.chmod(short_dir, 0o755)
    os.chmod(path, 0o666)
    assert _read_as(path, uid=65534) == b""
    assert _read_as(path, uid=0).startswith(b"HTTP/1.1 200")


def _read_as(path: str, uid: int) -> bytes:
    """What a process of user ``uid`` reads back from ``GET /healthz`` on the
    socket at ``path``: a forked child that only connects, writes and reads
    (an interpreter of another user's cannot be run: pyenv's is root's), waited
    for at most 10 s, then killed."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child)
        code = 1
        try:
            os.close(read_end)
            os.setgid(uid)
            os.setuid(uid)
            with socket.socket(socket.AF_UNIX) as client:
                client.settimeout(5)
                client.connect(path)
                try:
                    client.sendall(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
                    os.write(write_end, client.recv(65536))
                except (BrokenPipeError, ConnectionResetError):
                    pass  # closed by the node before the request went
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 10)
        assert ready, "the child did not finish in 10 s"
        read = os.read(read_end, 65536)
    finally:
        os.close(read_end)
        deadline = time.monotonic() + 10
        while (done := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        if done[0] == 0:
            os.kill(child, signal.SIGKILL)
            done = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(done[1]) == 0
    return read
