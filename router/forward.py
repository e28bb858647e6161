"""The forwarding client: the router's hot path to the nodes.

aiohttp, not httpx: measured on this machine, an ``httpx.AsyncClient`` costs
about 3 ms of router CPU per forwarded request and ``aiohttp.ClientSession``
about 0.4 ms. httpx stays the client of the control plane, the CLI and tests.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import httpx
import yarl


class Unreachable(Exception):
    """The node could not be reached: the request never got to it."""


class NodeTimeout(Exception):
    """The request was sent but the node did not answer in time.

    Not :class:`Unreachable`: the node may have decided (and the application
    may have run), so the router must neither retry nor fail over.
    """


@dataclass(frozen=True)
class Timeouts:
    connect: float = 0.5
    #: Below the default crash detection time (3 x (1 + 0.5) s), so a client whose
    #: owner paused is answered before the owner is removed. Raise it (with
    #: --forward-timeout) for applications that take longer to answer.
    total: float = 3.0


#: How many times the router sends a request (or a check) while nodes refuse it
#: because the ring is changing, before it answers ``ring_changing``. Four: the
#: repair of a restarted node is two changes (crash, then rejoin), and a request
#: that races both can be refused by the restarted node, by the interim owner
#: (already past the rejoin), and by the restarted node again (not yet told of
#: the rejoin the router learnt from the interim owner): three refusals, each
#: followed by a wait that brings the router or the node up to date. Three
#: attempts answered 503 there (a follower router in CI, once).
MAX_ATTEMPTS = 4


@dataclass(slots=True)
class Answer:
    """A node's answer. ``headers``: its fields (names lowercase) less the framing
    and hop-by-hop ones every forwarder drops (``connection``, ``keep-alive``,
    ``transfer-encoding``, ``content-length``, ``date``, ``server``): the router
    relays them without looking for those (router/protocol.py ``relay``)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def lease_expired(self) -> bool:
        """The node decided nothing: its lease ran out (node/lease.py)."""
        return any(k == b"x-ringlimit-unavailable" and v == b"lease" for k, v in self.headers)


class Forwarder(Protocol):
    """What the router needs of a client: one request, answered in full."""

    async def request(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes | None
    ) -> Answer: ...

    async def post_json(
        self, url: str, payload: bytes, headers: list[tuple[str, str]]
    ) -> Answer: ...

    async def close(self) -> None: ...


class AiohttpForwarder:
    """The production client: pooled keep-alive; create it inside the running loop."""

    def __init__(self, *, timeouts: Timeouts = Timeouts(), pool_size: int = 512) -> None:
        self.timeouts = timeouts
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeouts.total, sock_connect=timeouts.connect),
            connector=aiohttp.TCPConnector(
                limit=pool_size, limit_per_host=pool_size, keepalive_timeout=30
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def request(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes | None
    ) -> Answer:
        try:
            # encoded=True: the path goes out exactly as the router checked it (yarl
            # would otherwise resolve "/x/%2e%2e/internal" into "/internal").
            async with self._session.request(
                method,
                yarl.URL(url, encoded=True),
                headers=_for_aiohttp(headers),
                data=body,
                allow_redirects=False,
            ) as response:
                payload = await response.read()
                out = [
                    (k.lower(), v)
                    for k, v in response.raw_headers
                    if k.lower() not in _DROP_RESPONSE
                ]
                return Answer(response.status, out, payload)
        except aiohttp.ConnectionTimeoutError as exc:
            raise Unreachable(type(exc).__name__) from None
        except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
            raise NodeTimeout(type(exc).__name__) from None
        except aiohttp.ClientConnectionError as exc:
            raise Unreachable(type(exc).__name__) from None

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        return await self.request(
            "POST", url, [("content-type", "application/json"), *headers], payload
        )

    async def close(self) -> None:
        await self._session.close()


_DROP_RESPONSE = frozenset(
    {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"date", b"server"}
)


def _for_aiohttp(headers: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Header values are latin-1 text of the client's bytes; aiohttp writes UTF-8.

    Re-decode a non-ASCII value that is UTF-8 on the wire so that aiohttp sends
    the client's bytes unchanged (otherwise ``é`` would arrive double-encoded).
    """
    if all(v.isascii() for _, v in headers):
        return headers
    out = []
    for name, value in headers:
        if not value.isascii():
            with contextlib.suppress(UnicodeEncodeError, UnicodeDecodeError):
                value = value.encode("latin-1").decode("utf-8")
        out.append((name, value))
    return out


class HttpxForwarder:
    """The same contract over an httpx client: lets tests wire the router to nodes
    in-process (``httpx.ASGITransport`` mounts, no sockets)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def request(
        self, method: str, url: str, headers: list[tuple[str, str]], body: bytes | None
    ) -> Answer:
        # Header values are latin-1 text of the client's bytes: send those bytes back.
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        try:
            response = await self._client.request(method, url, headers=raw, content=body)
        except (httpx.ReadTimeout, httpx.WriteTimeout) as exc:
            raise NodeTimeout(type(exc).__name__) from None
        except httpx.TransportError as exc:
            raise Unreachable(type(exc).__name__) from None
        out = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in _DROP_RESPONSE]
        return Answer(response.status_code, out, response.content)

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        return await self.request(
            "POST", url, [("content-type", "application/json"), *headers], payload
        )

    async def close(self) -> None:
        return None
