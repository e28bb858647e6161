"""A pytest plugin: real ``redis-server`` processes for the Redis backend's tests.

Load it with ``-p tests.redis_server`` or ``pytest_plugins = ["tests.redis_server"]``.

Fixtures:

``redis_server`` (session)
    one ``redis-server`` on a free 127.0.0.1 port, without persistence, in a
    temporary directory. The object has ``.url``, ``.port``, ``.running``,
    ``.stop()`` and ``.start()`` (which restarts on the same port, to test a
    Redis that dies mid-traffic and comes back). The process is always stopped
    at the end of the session. Without ``redis-server`` the tests are skipped.
``redis_url`` (function)
    the server's URL, after making sure it runs (a test may have stopped it)
    and ``FLUSHALL``.
``redis_cluster_server`` (session)
    a second server in cluster mode that owns every slot, so that a script
    whose keys span two slots fails with ``CROSSSLOT`` as on a real cluster.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

#: Where redis-server is looked for when it is not on PATH.
FALLBACK_BINARIES = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    for path in FALLBACK_BINARIES:
        if os.access(path, os.X_OK):
            return path
    return None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dying_with_parent(argv: list[str]) -> list[str]:
    """``argv``, run so that it gets SIGTERM if pytest dies without running its
    finalizers (Linux: util-linux's ``setpriv --pdeathsig``).

    Not a ``preexec_fn``: that makes subprocess fork() and run Python in the
    child, and in a test process that has used gRPC (aetcd, the Envoy tests)
    the fork runs gRPC's fork handlers, which once killed the child before its
    exec (CI: "etcd exited on start" with a gRPC epoll error in its log, and
    every etcd test of that worker failed). Without one, subprocess starts the
    child with vfork and exec, which runs no fork handlers.
    """
    setpriv = shutil.which("setpriv")
    if sys.platform.startswith("linux") and setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *argv]
    return argv


class RedisServer:
    """One ``redis-server`` child process on a fixed 127.0.0.1 port."""

    def __init__(
        self,
        binary: str,
        directory: Path,
        *,
        port: int | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = binary
        self.directory = Path(directory)
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def log_path(self) -> Path:
        return self.directory / "redis.log"

    def client(self, **kwargs: object) -> redis.Redis:
        """A synchronous client with short timeouts (the caller closes it)."""
        options: dict[str, object] = {"socket_timeout": 5.0, "socket_connect_timeout": 1.0}
        options.update(kwargs)
        return redis.Redis(host="127.0.0.1", port=self.port, **options)  # type: ignore[arg-type]

    def start(self, timeout: float = 10.0) -> None:
        """Start (or restart, on the same port) and wait until it answers PING."""
        if self.running:
            return
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.directory),
            "--daemonize",
            "no",
            "--loglevel",
            "warning",
            "--logfile",
            str(self.log_path),
            *self.extra_args,
        ]
        self.process = subprocess.Popen(
            dying_with_parent(args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise RuntimeError(f"redis-server exited with {code} on start: {self._log_tail()}")
            if self._answers_ping():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer within {timeout}s")
            time.sleep(0.01)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the process (SIGTERM, then SIGKILL); a no-op when it is not running."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def _answers_ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


def _server_or_skip(
    tmp_path_factory: pytest.TempPathFactory, name: str, **kwargs: object
) -> RedisServer:
    binary = find_redis_server()
    if binary is None:
        pytest.skip(
            "redis-server is not installed (looked on PATH and in "
            f"{', '.join(FALLBACK_BINARIES)}); install it, e.g. apt-get install redis-server, "
            "to run the Redis backend tests"
        )
    return RedisServer(binary, tmp_path_factory.mktemp(name), **kwargs)  # type: ignore[arg-type]


def _first_start(server: RedisServer, attempts: int = 3) -> None:
    """Start on a free port; another process may grab it first, so try a few."""
    for attempt in range(attempts):
        try:
            server.start()
            return
        except RuntimeError:
            if attempt == attempts - 1:
                raise
            server.port = free_port()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _server_or_skip(tmp_path_factory, "redis")
    try:
        _first_start(server)
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    redis_server.start()  # a previous test may have stopped it
    with redis_server.client() as client:
        client.flushall()
    return redis_server.url


def _cluster_ok(client: redis.Redis) -> bool:
    info = client.execute_command("CLUSTER", "INFO")
    if isinstance(info, dict):
        return info.get("cluster_state") in ("ok", b"ok")
    text = info.decode() if isinstance(info, bytes) else str(info)
    return "cluster_state:ok" in text


@pytest.fixture(scope="session")
def redis_cluster_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _server_or_skip(tmp_path_factory, "redis-cluster")
    server.extra_args = [
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        str(server.directory / "nodes.conf"),
        # The bus port defaults to port + 10000, which a high free port overflows.
        "--cluster-port",
        str(free_port()),
    ]
    try:
        _first_start(server)
        with server.client() as client:
            client.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
            deadline = time.monotonic() + 10.0
            while not _cluster_ok(client):
                if time.monotonic() > deadline:
                    raise RuntimeError("the one-node cluster did not reach cluster_state:ok")
                time.sleep(0.02)
        yield server
    finally:
        server.stop()
