"""Routers on an etcd that serves TLS, requires client certificates and has auth on.

One real etcd for the module (tests/etcd_server.py) with a CA of its own
(``trustme``), ``--client-cert-auth``, a user with a password whose one role
reads and writes ringlimit's prefix only, and auth tokens that expire after
a second of disuse, so that a test can outlive one.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trustme

from node.clock import FrozenClock
from node.config import ClusterConfig
from ring import Member, RingView
from router.coordinator import CoordinatorError, EtcdCoordinator, ViewRecord, parse_endpoints
from router.etcd_access import EtcdAccess
from router.testing import ROUTER_URL, InProcessCluster, node_url
from tests.etcd_server import EtcdServer
from tests.processes import ROOT, Procs, wait_until
from tests.test_coordinator import coordinated
from tests.test_rebalancing import make_config

pytestmark = [pytest.mark.anyio, pytest.mark.etcd]

SECOND = "http://router2.localhost"
PASSWORD = "s3cret pass"  # a space: passed whole, never split


@dataclass
class SecureEtcd:
    server: EtcdServer
    #: PEM files: the CA etcd trusts and the router's client certificate and key.
    ca: Path
    cert: Path
    key: Path
    #: A client certificate from a CA etcd does not trust.
    stranger_cert: Path
    stranger_key: Path
    stranger_ca: Path

    def access(self, **changes: object) -> EtcdAccess:
        files: dict[str, object] = {
            "ca": str(self.ca),
            "cert": str(self.cert),
            "key": str(self.key),
            "user": "router",
            "password": PASSWORD,
        }
        files.update(changes)
        return EtcdAccess.from_files(tls=True, **files)  # type: ignore[arg-type]

    def coordinator(self, **changes: object) -> EtcdCoordinator:
        return EtcdCoordinator(
            parse_endpoints(self.server.endpoint),
            cluster="secure",
            ttl=2.0,
            timeout=2.0,
            access=self.access(**changes),
        )


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


@pytest.fixture(scope="module")
def secure_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureEtcd]:
    binary = shutil.which("etcd")
    if binary is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    directory = tmp_path_factory.mktemp("secure-etcd")

    def write(name: str, blob: trustme.Blob) -> Path:
        path = directory / name
        blob.write_to_path(str(path))
        return path

    ca, stranger = trustme.CA(), trustme.CA()
    served, router, other = (
        ca.issue_cert("127.0.0.1"),
        ca.issue_cert("ringlimit-router"),
        stranger.issue_cert("ringlimit-router"),
    )
    tls = {
        "ca": write("ca.pem", ca.cert_pem),
        "cert": write("etcd.pem", served.cert_chain_pems[0]),
        "key": write("etcd.key", served.private_key_pem),
    }
    server = EtcdServer(binary, directory, tls=tls, extra_args=["--auth-token-ttl", "1"])
    server.start()
    try:
        with server.http() as client:
            # Routers log in as a user whose one role reads and writes /ringlimit/...
            # only: what docs/configuration.md says they need.
            prefix = {"key": b64("/ringlimit/"), "range_end": b64("/ringlimit0")}
            for path, body in (
                ("user/add", {"name": "root", "password": "root-only"}),
                ("role/add", {"name": "root"}),
                ("user/grant", {"user": "root", "role": "root"}),
                ("role/add", {"name": "ringlimit"}),
                ("role/grant", {"name": "ringlimit", "perm": {"permType": 2, **prefix}}),
                ("user/add", {"name": "router", "password": PASSWORD}),
                ("user/grant", {"user": "router", "role": "ringlimit"}),
                ("enable", {}),
            ):
                client.post(f"{server.client_url}/v3/auth/{path}", json=body).raise_for_status()
        yield SecureEtcd(
            server,
            tls["ca"],
            write("router.pem", router.cert_chain_pems[0]),
            write("router.key", router.private_key_pem),
            write("stranger.pem", other.cert_chain_pems[0]),
            write("stranger.key", other.private_key_pem),
            write("stranger-ca.pem", stranger.cert_pem),
        )
    finally:
        server.stop()


async def test_two_routers_lead_follow_and_change_the_ring_over_tls_and_auth(
    secure_etcd: SecureEtcd,
) -> None:
    """Every call a coordinated router makes (the lease and its keep-alive, the
    campaign, commits, the watch) over TLS, with a client certificate, as a user."""

    def options(url: str) -> dict[str, object]:
        return coordinated(secure_etcd.coordinator(), url)

    async with InProcessCluster(
        2, make_config(), clock=FrozenClock(), router_options=options(ROUTER_URL)
    ) as cluster:
        second = cluster.new_router(SECOND, seeds=[], **options(SECOND))
        await second.start()
        try:
            first, other = cluster.router.membership, second.membership
            await wait_until(lambda: first.leading != other.leading)
            follower = SECOND if first.leading else ROUTER_URL
            cluster._make_node("n3")
            response = await cluster.client.post(
                f"{follower}/admin/nodes", json={"id": "n3", "url": node_url("n3")}
            )
            assert response.status_code == 200, response.text
            await wait_until(lambda: first.view.epoch == other.view.epoch == 2)
            assert "n3" in first.view and first.view == other.view
            # Longer than an auth token lives: the leader's keep-alive renews it.
            await asyncio.sleep(2.5)
            assert first.leading != other.leading
        finally:
            await second.close()


async def test_an_expired_auth_token_is_renewed(secure_etcd: SecureEtcd) -> None:
    """etcd forgets a token a second after its last use here (300 s by default):
    the next call is refused once, and the coordinator connects (so
    authenticates) again."""
    coordinator = secure_etcd.coordinator()
    try:
        await coordinator.connect()
        before = await coordinator.load()
        raw = secure_etcd.access().client("127.0.0.1", secure_etcd.server.port, 2.0)
        await raw.connect()
        try:
            await asyncio.sleep(2.5)
            # The token did expire: a client that does not connect again is refused...
            with pytest.raises(Exception, match="invalid auth token"):
                await raw.get(b"x")
        finally:
            await raw.close()
        # ... and the coordinator is not.
        assert await coordinator.load() == before
    finally:
        await coordinator.close()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"password": "wrong"}, "authentication failed"),
        ({"cert": None, "key": None}, "etcd not reachable"),
        ({"cert": "stranger_cert", "key": "stranger_key"}, "etcd not reachable"),
        ({"ca": "stranger_ca"}, "CERTIFICATE_VERIFY_FAILED"),
        ({"user": None, "password": None}, "permission denied"),
    ],
    ids=["wrong-password", "no-client-cert", "untrusted-client-cert", "untrusted-etcd", "no-user"],
)
async def test_a_refusal_is_one_error_saying_why(
    secure_etcd: SecureEtcd, changes: dict[str, str | None], says: str
) -> None:
    files = {
        k: (str(getattr(secure_etcd, v)) if v and hasattr(secure_etcd, v) else v)
        for k, v in changes.items()
    }
    coordinator = secure_etcd.coordinator(**files)
    try:
        with pytest.raises(CoordinatorError, match=says) as refused:
            await coordinator.connect()
            await coordinator.load()
        assert "\n" not in str(refused.value) and PASSWORD not in str(refused.value)
    finally:
        await coordinator.close()


async def test_a_watch_made_on_an_expired_token_sees_changes(secure_etcd: SecureEtcd) -> None:
    """etcd answers a watch made on an expired token with one created and
    cancelled at once, which aetcd takes for created: silent for ever."""
    watching, writer = secure_etcd.coordinator(), secure_etcd.coordinator()
    seen: list[int] = []

    async def watch() -> None:
        async for record in watching.watch(0):
            seen.append(record.view.epoch)

    task = None
    try:
        await watching.connect()
        await watching.load()
        await asyncio.sleep(2.5)  # its token expires, unused
        task = asyncio.create_task(watch())
        await asyncio.sleep(0.5)
        await writer.connect()
        current = await writer.load()  # the module's etcd: perhaps a ring already
        epoch = current.view.epoch + 1 if current is not None else 1
        view = RingView.of([Member("n1", "http://n1")], epoch=epoch)
        record = ViewRecord(view, RingView.empty(), (), ClusterConfig(), True)
        expected = current.revision if current is not None else 0
        assert await writer.commit(record, expected=expected) is not None
        await wait_until(lambda: seen == [epoch], 5.0)
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await watching.close()
        await writer.close()


async def test_plaintext_to_a_tls_etcd_is_refused(secure_etcd: SecureEtcd) -> None:
    plain = secure_etcd.server.endpoint.replace("etcds://", "etcd://")
    coordinator = EtcdCoordinator(parse_endpoints(plain), timeout=1.0)
    try:
        with pytest.raises(CoordinatorError, match="etcd not reachable"):
            await coordinator.connect()
    finally:
        await coordinator.close()


# --------------------------------------------------------------------------- access, unit


def test_access_refuses_half_pairs_and_certificates_without_tls(tmp_path: Path) -> None:
    pem = tmp_path / "a.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    with pytest.raises(ValueError, match="--etcd-cert and --etcd-key"):
        EtcdAccess.from_files(tls=True, cert=str(pem))
    with pytest.raises(ValueError, match="etcds://"):
        EtcdAccess.from_files(tls=False, ca=str(pem))
    with pytest.raises(ValueError, match="RINGLIMIT_ETCD_PASSWORD"):
        EtcdAccess.from_files(tls=False, user="root")
    with pytest.raises(ValueError, match="--etcd-user is not"):
        EtcdAccess.from_files(tls=False, password="x")
    with pytest.raises(ValueError, match=r"--etcd-cacert .*missing\.pem: No such file"):
        EtcdAccess.from_files(tls=True, ca=str(tmp_path / "missing.pem"))
    (tmp_path / "junk").write_text("junk")
    with pytest.raises(ValueError, match="not a PEM file"):
        EtcdAccess.from_files(tls=True, key=str(tmp_path / "junk"), cert=str(pem))
    with pytest.raises(ValueError, match="do not go together"):
        EtcdAccess.from_files(tls=True, cert=str(pem), key=str(pem))
    access = EtcdAccess.from_files(tls=False, user="root", password=PASSWORD)
    assert PASSWORD not in repr(access) and "root" in repr(access)


def test_the_client_key_is_kept_out_of_repr() -> None:
    """The password was kept out of ``repr`` (and so out of logs and tracebacks),
    the router's private key was not: its PEM was in it."""
    access = EtcdAccess(
        tls=True,
        cert=b"-----BEGIN CERTIFICATE-----\nPUBLIC\n",
        key=b"-----BEGIN PRIVATE KEY-----\nS3CRETKEY\n",
    )
    assert "S3CRETKEY" not in repr(access) and "PUBLIC" in repr(access)


# --------------------------------------------------------------------------- the CLI


def test_a_router_process_on_a_secure_etcd(secure_etcd: SecureEtcd, procs: Procs) -> None:
    """The flags and RINGLIMIT_ETCD_PASSWORD reach etcd; the password does not
    reach the log."""
    _, url = procs.node("n1", None)
    procs.env["RINGLIMIT_ETCD_PASSWORD"] = PASSWORD
    flags = ["--etcd-cacert", str(secure_etcd.ca), "--etcd-cert", str(secure_etcd.cert)]
    flags += ["--etcd-key", str(secure_etcd.key), "--etcd-user", "router", "--cluster", "cli"]
    process, router = procs.router(
        None, "--coordinator", secure_etcd.server.endpoint, *flags, "--node", f"n1={url}"
    )
    ring = httpx.get(f"{router}/admin/ring", timeout=5.0).json()
    assert ring["coordinator"]["leading"] is True and [n["id"] for n in ring["nodes"]] == ["n1"]
    assert httpx.get(f"{router}/x", headers={"X-User-Id": "u"}, timeout=5.0).status_code == 200
    assert PASSWORD not in process.output()


@pytest.mark.parametrize(
    ("flags", "env", "says"),
    [
        (["--etcd-user", "root"], {}, "--etcd-user needs --coordinator"),
        (["--coordinator", "etcds://127.0.0.1:1", "--etcd-user", "root"], {}, "PASSWORD"),
        (["--coordinator", "etcd://127.0.0.1:1", "--etcd-cacert", "ca.pem"], {}, "etcds://"),
        (["--coordinator", "etcds://127.0.0.1:1", "--etcd-cacert", "nope.pem"], {}, "nope.pem"),
        (["--coordinator", "etcds://127.0.0.1:1"], {"RINGLIMIT_ETCD_USER": "x"}, "PASSWORD"),
    ],
)
def test_bad_etcd_flags_are_one_line(
    tmp_path: Path, flags: list[str], env: dict[str, str], says: str
) -> None:
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("RINGLIMIT_ETCD")}
    result = subprocess.run(
        [sys.executable, "-m", "router", "router", "--port", "0", *flags],
        cwd=tmp_path,
        env={**environ, **env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr


def test_a_router_without_the_client_certificate_etcd_wants_is_one_line(
    secure_etcd: SecureEtcd, tmp_path: Path
) -> None:
    """gRPC's own lines stay quiet (GRPC_VERBOSITY), the router's says why."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("RINGLIMIT_", "GRPC_"))}
    flags = ["--coordinator", secure_etcd.server.endpoint, "--etcd-cacert", str(secure_etcd.ca)]
    result = subprocess.run(
        [sys.executable, "-m", "router", "router", "--port", "0", *flags],
        cwd=tmp_path,
        env={**environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "TLS handshake failed" in result.stderr and "--etcd-cert" in result.stderr


def test_etcd_only_flags_without_a_coordinator_are_said_to_be_ignored() -> None:
    """``--cluster``, ``--coordinator-ttl`` and ``--advertise`` without
    ``--coordinator`` were taken in silence: a router meant for a cluster ran on
    a ring of its own (an exploratory tester). Said in one line (not refused: a
    compose file may pass them whether or not it sets RINGLIMIT_COORDINATOR)."""
    from router.cli import _coordinator, build_parser

    flags = ["--cluster", "prod", "--coordinator-ttl", "10", "--advertise", "http://r:1"]
    args = build_parser().parse_args(["router", *flags])
    args.coordinator = None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _coordinator(args) is None
    assert err.getvalue() == (
        "ringlimit: --cluster, --coordinator-ttl, --advertise ignored without --coordinator "
        "(this router keeps a ring of its own)\n"
    )
    quiet = build_parser().parse_args(["router"])
    quiet.coordinator = None
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert _coordinator(quiet) is None
    assert err.getvalue() == ""
