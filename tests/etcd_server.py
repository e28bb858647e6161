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
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.redis_server import dying_with_parent, free_port


class EtcdServer:
    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"etcd://127.0.0.1:{self.port}"

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        ]
        log = open(self.directory / "etcd.log", "wb")  # noqa: SIM115 (closed with the process)
        self.process = subprocess.Popen(
            dying_with_parent(args), stdin=subprocess.DEVNULL, stdout=log, stderr=log
        )
        log.close()
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise RuntimeError(f"etcd exited on start: {self.log_tail()}")
                try:
                    if client.get(f"{self.client_url}/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"etcd did not become healthy within {timeout}s: {self.log_tail()}")

    def clear(self) -> None:
        """Delete every key (v3 API over its JSON gateway: no client library needed)."""
        with httpx.Client(timeout=5.0) as client:
            response = client.post(
                f"{self.client_url}/v3/kv/deleterange",
                json={"key": "AA==", "range_end": "AA=="},  # "\\0".."\\0": every key
            )
            response.raise_for_status()

    def get(self, key: str) -> bytes | None:
        """One key's value (the JSON gateway again), or None."""
        import base64

        with httpx.Client(timeout=5.0) as client:
            response = client.post(
                f"{self.client_url}/v3/kv/range",
                json={"key": base64.b64encode(key.encode()).decode()},
            )
            response.raise_for_status()
            kvs = response.json().get("kvs") or []
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)

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
def etcd_endpoint(etcd_server: EtcdServer) -> str:
    etcd_server.clear()
    return etcd_server.endpoint
