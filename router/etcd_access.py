"""How a router reaches a production etcd: TLS, client certificates, a user.

A production etcd serves TLS, often requires a client certificate
(``--client-cert-auth``) and, with auth enabled, a user and password.
:class:`EtcdAccess` holds all of it, read and checked when the router starts
(a missing file or a half-given pair stops the start in one line), and makes
the clients (router/etcd_tls.py for TLS; aetcd itself is imported only when
a client is made, as the coordinator does).

An auth token from etcd expires (``--auth-token-ttl``, 300 s by default, from
its last use). A call refused for it fails once; the coordinator then drops
that client and connects again, which authenticates anew.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EtcdAccess"]


@dataclass(frozen=True)
class EtcdAccess:
    """What a router needs to be let into etcd, and to trust it.

    ``tls``: connect over TLS (endpoints written ``etcds://``), checking etcd's
    certificate against ``ca`` (PEM; None: the system's roots). ``cert`` and
    ``key`` (PEM, both or neither): the router's client certificate.
    ``user`` and ``password``: etcd's auth (both or neither). The password and
    the private key are kept out of ``repr`` and so out of logs.
    """

    tls: bool = False
    ca: bytes | None = None
    cert: bytes | None = None
    key: bytes | None = field(default=None, repr=False)
    user: str | None = None
    password: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both --etcd-cert and --etcd-key")
        if not self.tls and (self.ca or self.cert):
            raise ValueError(
                "certificates need TLS: write the coordinator's endpoints as etcds://HOST:PORT"
            )
        if (self.user is None) != (self.password is None):
            raise ValueError(
                "etcd's auth needs both --etcd-user and RINGLIMIT_ETCD_PASSWORD"
                if self.user is not None
                else "RINGLIMIT_ETCD_PASSWORD is set but --etcd-user is not"
            )

    @classmethod
    def from_files(
        cls,
        *,
        tls: bool,
        ca: str | None = None,
        cert: str | None = None,
        key: str | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> EtcdAccess:
        """Read the PEM files now, so that a missing one stops the start in one line."""
        access = cls(
            tls,
            ca=_read(ca, "--etcd-cacert"),
            cert=_read(cert, "--etcd-cert"),
            key=_read(key, "--etcd-key"),
            user=user or None,
            password=password or None,
        )
        # gRPC takes any bytes and fails only at the handshake, with lines of its
        # own on stderr and "Failed to create security handshaker": check here.
        import ssl

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        try:
            if access.ca is not None:
                context.load_verify_locations(cadata=access.ca.decode("ascii", "replace"))
        except ssl.SSLError as exc:
            why = exc.reason or exc
            raise ValueError(f"--etcd-cacert {ca}: no certificate in it ({why})") from None
        if cert is not None and key is not None:
            try:
                context.load_cert_chain(cert, key, password=lambda: "")  # never a prompt
            except ssl.SSLError as exc:
                why = exc.reason or exc
                raise ValueError(
                    f"--etcd-cert {cert} and --etcd-key {key} do not go together ({why})"
                ) from None
        return access

    def client(self, host: str, port: int, timeout: float) -> Any:
        """An unconnected aetcd client for one endpoint."""
        import aetcd

        options: dict[str, Any] = {
            "host": host,
            "port": port,
            "timeout": timeout,
            "connect_wait_timeout": timeout,
            "username": self.user,
            "password": self.password,
        }
        if not self.tls:
            return aetcd.Client(**options)
        import grpc

        from router.etcd_tls import TlsClient

        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )
        return TlsClient(credentials, **options)


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file")
    return data
