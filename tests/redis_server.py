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

import contextlib
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import redis

from router.processes import ChildProcess, NotReady, redis_probe, wait_ready
from tests.processes import free_port

__all__ = ["RedisServer", "dying_with_parent", "find_redis_server", "free_port"]

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
        self.process: ChildProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.alive()

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
        # Its own log is --logfile; what it prints before opening it (a bad flag)
        # goes to the start log.
        process = self.process = ChildProcess(
            "redis-server", dying_with_parent(args), log=self.directory / "redis-start.log"
        )

        def exited() -> str | None:
            if process.alive():
                return None
            return f"redis-server {process.exit_text()} on start: {self._log_tail()}"

        try:
            wait_ready(
                redis_probe(self.port),
                timeout=timeout,
                failed=exited,
                interval=0.01,
                what="redis-server did not answer",
            )
        except NotReady as exc:
            self.stop()
            raise RuntimeError(str(exc)) from None

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the process (resumed if it was stopped, SIGTERM, then SIGKILL); a
        no-op when it is not running."""
        process, self.process = self.process, None
        if process is not None:
            process.stop(timeout)

    def _log_tail(self) -> str:
        text = ""
        for path in (self.directory / "redis-start.log", self.log_path):
            with contextlib.suppress(OSError):
                text += path.read_text(errors="replace")
        return text[-2000:] or "(no log)"


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
            wait_ready(
                lambda: True if _cluster_ok(client) else None,
                timeout=10.0,
                interval=0.02,
                what="the one-node cluster did not reach cluster_state:ok",
            )
        yield server
    finally:
        server.stop()
