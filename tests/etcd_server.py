"""A pytest plugin: a real ``etcd`` (Debian's etcd-server) for the coordinator's tests.

Fixtures:

``etcd_server`` (session)
    one single-member etcd on free 127.0.0.1 ports, its data in a temporary
    directory; always stopped at the end of the session. Without an ``etcd``
    binary the tests are skipped (``.ci/run`` installs it).
``etcd_endpoint`` (function)
    ``etcd://127.0.0.1:PORT`` after deleting every key, so each test starts
    from an empty store.
"""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx
import pytest

from router.processes import ChildProcess, NotReady, http_probe, wait_ready
from tests.processes import free_port
from tests.redis_server import dying_with_parent


class EtcdServer:
    """One etcd; with ``tls`` (PEM files: ``ca``, ``cert``, ``key``) it serves
    its clients over TLS and requires a client certificate signed by ``ca``.
    ``extra_args`` go to etcd as they are (``--auth-token-ttl``, say)."""

    def __init__(
        self,
        binary: str,
        directory: Path,
        *,
        tls: dict[str, Path] | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.binary = binary
        self.directory = directory
        self.tls = tls
        self.extra_args = list(extra_args)
        self.port = free_port()
        self.peer_port = free_port()
        self.process: ChildProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"{'etcds' if self.tls else 'etcd'}://127.0.0.1:{self.port}"

    @property
    def client_url(self) -> str:
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def http(self) -> httpx.Client:
        """A client of its JSON gateway (with a client certificate, under TLS)."""
        if self.tls is None:
            return httpx.Client(timeout=5.0)
        context = ssl.create_default_context(cafile=str(self.tls["ca"]))
        context.load_cert_chain(str(self.tls["cert"]), str(self.tls["key"]))
        return httpx.Client(timeout=5.0, verify=context)

    def start(self, timeout: float = 20.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        args = [
            self.binary,
            "--name",
            "test",
            "--data-dir",
            str(self.directory / "data"),
            "--listen-client-urls",
            self.client_url,
            "--advertise-client-urls",
            self.client_url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"test={peer}",
            "--log-level",
            "warn",
            *self.extra_args,
        ]
        if self.tls is not None:
            args += ["--cert-file", str(self.tls["cert"]), "--key-file", str(self.tls["key"])]
            args += ["--trusted-ca-file", str(self.tls["ca"]), "--client-cert-auth"]
        process = self.process = ChildProcess(
            "etcd", dying_with_parent(args), log=self.directory / "etcd.log"
        )

        def exited() -> str | None:
            return None if process.alive() else f"etcd exited on start: {self.log_tail()}"

        try:
            with self.http() as client:
                wait_ready(
                    http_probe(client, f"{self.client_url}/health"),
                    timeout=timeout,
                    failed=exited,
                    what="etcd did not become healthy",
                )
        except NotReady as exc:
            timed_out = process.alive()  # else exited() said why, with the log
            self.stop()
            raise RuntimeError(f"{exc}: {self.log_tail()}" if timed_out else str(exc)) from None

    def clear(self) -> None:
        """Delete every key (v3 API over its JSON gateway: no client library needed)."""
        with self.http() as client:
            response = client.post(
                f"{self.client_url}/v3/kv/deleterange",
                json={"key": "AA==", "range_end": "AA=="},  # "\\0".."\\0": every key
            )
            response.raise_for_status()

    def get(self, key: str) -> bytes | None:
        """One key's value (the JSON gateway again), or None."""
        import base64

        with self.http() as client:
            response = client.post(
                f"{self.client_url}/v3/kv/range",
                json={"key": base64.b64encode(key.encode()).decode()},
            )
            response.raise_for_status()
            kvs = response.json().get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def stop(self) -> None:
        """Stop etcd (resumed if it was stopped, SIGTERM, then SIGKILL)."""
        process, self.process = self.process, None
        if process is not None:
            process.stop(10.0)

    def log_tail(self) -> str:
        try:
            return (self.directory / "etcd.log").read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    server = EtcdServer(binary, tmp_path_factory.mktemp("etcd"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of the test's own (started), for a test that stops it, restarts
    it or takes its data away: the session's etcd serves the other tests."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    server = EtcdServer(binary, tmp_path)
    try:
        server.start()
        yield server
    finally:
        server.stop()


@pytest.fixture
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    etcd_server.clear()
    return etcd_server.endpoint
