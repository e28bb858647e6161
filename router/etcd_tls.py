"""aetcd's client over TLS.

aetcd 1.0 does etcd's users but opens only plaintext channels: its
``connect`` calls ``insecure_channel``. :class:`TlsClient` is that
``connect`` with a secure channel, and nothing else. It sets the attributes
aetcd's ``connect`` sets (its stubs, its watcher, its auth metadata), which is
why pyproject pins aetcd below 1.1; tests/test_coordinator_security.py runs
it against a real etcd serving TLS with client certificates and auth, so a
change there fails them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aetcd
from aetcd import rpc
from aetcd.client import _handle_errors, watcher

__all__ = ["TlsClient"]


class TlsClient(aetcd.Client):  # type: ignore[misc]  # aetcd has no type hints
    """aetcd's client over a TLS channel made with ``credentials``."""

    _is_connecting: bool

    def __init__(self, credentials: Any, **options: Any) -> None:
        super().__init__(**options)
        self._credentials = credentials

    @_handle_errors  # type: ignore[misc]
    async def connect(self) -> None:
        # aetcd 1.0's Client.connect, with secure_channel for insecure_channel.
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            target = f"{self._host}:{self._port}"
            self.channel = rpc.secure_channel(
                target, self._credentials, options=self._options.items()
            )
            if self._username is not None and self._password is not None:
                self.auth_stub = rpc.AuthStub(self.channel)
                request = rpc.AuthenticateRequest(name=self._username, password=self._password)
                response = await self.auth_stub.Authenticate(request, timeout=self._timeout)
                self.metadata = (("token", response.token),)
            self.kvstub = rpc.KVStub(self.channel)
            self.clusterstub = rpc.ClusterStub(self.channel)
            self.leasestub = rpc.LeaseStub(self.channel)
            self.maintenancestub = rpc.MaintenanceStub(self.channel)
            self._watcher = watcher.Watcher(
                rpc.WatchStub(self.channel), timeout=self._timeout, metadata=self.metadata
            )
            self._connected.set()
        finally:
            self._is_connecting = False
