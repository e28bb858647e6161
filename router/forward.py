"""The forwarding client: the router's hot path to the nodes.

aiohttp, not httpx: measured on this machine, an ``httpx.AsyncClient`` costs
about 3 ms of router CPU per forwarded request and ``aiohttp.ClientSession``
about 0.4 ms. httpx stays the client of the control plane, the CLI and tests.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import httpx
import yarl

from node.frontdoor import REUSE_IDLE
from node.hopbyhop import HOP_BY_HOP, NO_CONTENT, without_options


class Unreachable(Exception):
    """The node could not be reached: the request never got to it."""


class NodeTimeout(Exception):
    """The request was sent but the node did not answer in time.

    Not :class:`Unreachable`: the node may have decided (and the application
    may have run), so the router must neither retry nor fail over.
    """

    #: What the node did, for the client's error detail ("node n2 ...").
    what = "did not answer in time"


class AnswerLost(NodeTimeout):
    """The request was sent and its connection closed (or broke) before the whole
    answer came back: as for a timeout, the node may have decided, and passed the
    request to the application, so it is neither sent again nor failed over.

    Not :class:`Unreachable`, which the router answers by routing the request
    again (a newer view) or, for a rule that fails open, by sending it to
    another node: a POST whose owner died as it answered (or whose connection a
    middlebox cut) ran twice in the application.
    """

    what = "closed the connection before answering"


class AnswerTooLarge(NodeTimeout):
    """The node answered with more than the router holds (``--max-answer``): the
    router relays whole answers, so it stops reading, closes the connection and
    answers ``502 answer_too_large``. As for a timeout, the node decided and may
    have passed the request on, so it is neither sent again nor failed over."""

    def __init__(self, limit: int) -> None:
        super().__init__(limit)
        self.what = f"answered more than the {limit} bytes the router holds (--max-answer)"


#: Bytes of a node's answer the router holds by default (``--max-answer``). The
#: router relays whole answers; without a cap, one answer that never ended
#: (an application streaming) grew the router by gigabytes within its 3 s forward
#: timeout (tests/test_answer_cap.py).
MAX_ANSWER = 16 << 20
#: (Answers to ``post_json``, the decision API's batches and quotas, are not
#: capped: a node answers one result per check, so their size follows from the
#: request's own limits, ``max_body`` and ``max_batch``.)


@dataclass(frozen=True)
class Timeouts:
    connect: float = 0.5
    #: Below the default crash detection time (3 x (1 + 0.5) s), so a client whose
    #: owner paused is answered before the owner is removed. Raise it (with
    #: --forward-timeout) for applications that take longer to answer.
    total: float = 3.0
    #: How long after a request (or a check) arrived the router may still send it
    #: again because a node refused it while the ring changes; past it the client
    #: gets ``ring_changing`` (503, Retry-After: 1). Every refusal is followed by
    #: a wait that brings the router or the node up to date (at most one health
    #: interval's repair, 2.5 s by default), so this bounds how long a client waits
    #: on a ring that keeps changing; :data:`MAX_ATTEMPTS` bounds the sends.
    refusals: float = 5.0


#: How many times the router sends a request (or a check) while nodes refuse it
#: because the ring is changing, before it answers ``ring_changing``. A router
#: whose view leads or trails the nodes' can be refused twice per change (once
#: by a node behind it, once by one ahead of it), and the repair of a restarted
#: node is two changes (crash, then rejoin) after the restarted node's own
#: refusal: five. Eight leaves room for a third change; :attr:`Timeouts.refusals`
#: bounds the time. (Four answered 503 to a follower router in CI, refused by
#: the restarted node, the interim owner behind the crash, the interim owner past
#: the rejoin, and the restarted node before the rejoin reached it.)
MAX_ATTEMPTS = 8


@dataclass(slots=True)
class Answer:
    """A node's answer. ``headers``: its fields (names lowercase) less the framing
    and hop-by-hop ones every forwarder drops (``connection`` and those it lists,
    ``keep-alive``, ``transfer-encoding``, ``content-length``, ``date``, ``server``,
    and trailers): the router relays them without looking for those
    (router/protocol.py ``relay``).

    ``sized``: the router must not give the answer a ``content-length`` of its
    body. An answer to a HEAD keeps the node's (the length of what it would
    have sent, RFC 9110 8.6); a 204 or a 304 has none (a 304's is optional, and
    uvicorn's cycle would wait for that many bytes of body); the router sizes
    every other answer by its body.
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    sized: bool = False

    def lease_expired(self) -> bool:
        """The node decided nothing: its lease ran out (node/lease.py)."""
        return self.unavailable() == b"lease"

    def unavailable(self) -> bytes | None:
        """Why a node decided nothing (a 503's ``x-ringlimit-unavailable``): ``lease``
        (its lease ran out), ``token`` (this router's internal token is not its)."""
        for k, v in self.headers:
            if k == b"x-ringlimit-unavailable":
                return v
        return None


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

    def __init__(
        self,
        *,
        timeouts: Timeouts = Timeouts(),
        pool_size: int = 512,
        idle_timeout: float = REUSE_IDLE,
        max_answer: int = MAX_ANSWER,
    ) -> None:
        self.timeouts = timeouts
        self.max_answer = max_answer
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeouts.total, sock_connect=timeouts.connect),
            connector=aiohttp.TCPConnector(
                # An idle connection is reused for less than a node keeps it
                # (node/frontdoor.py REUSE_IDLE): aiohttp sends a POST once only.
                limit=pool_size,
                limit_per_host=pool_size,
                keepalive_timeout=idle_timeout,
            ),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
        )

    async def request(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        capped: bool = True,
    ) -> Answer:
        """The node's whole answer; ``capped``: its body at most ``max_answer``
        bytes (:class:`AnswerTooLarge`)."""
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
                payload = await self._read(response, self.max_answer if capped else sys.maxsize)
                return relayed(response.status, response.raw_headers, payload, method == "HEAD")
        except aiohttp.ConnectionTimeoutError as exc:
            raise Unreachable(type(exc).__name__) from None
        except (aiohttp.ServerTimeoutError, TimeoutError) as exc:
            raise NodeTimeout(type(exc).__name__) from None
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
            # Sent; aiohttp sends again on a fresh connection only what it judges
            # safe to (an idempotent request on a connection the node closed idle).
            raise AnswerLost(type(exc).__name__) from None
        except aiohttp.ClientConnectorError as exc:  # no connection was made
            raise Unreachable(type(exc).__name__) from None
        except aiohttp.ClientOSError as exc:
            # On a connection made: a reset after the node read the request is one
            # (a review found it taken for Unreachable, which a round-robin router
            # sends to the next node, and an open rule's failover to another: the
            # request decided twice, run twice by the application).
            raise AnswerLost(type(exc).__name__) from None
        except aiohttp.ClientConnectionError as exc:
            raise Unreachable(type(exc).__name__) from None

    @staticmethod
    async def _read(response: aiohttp.ClientResponse, limit: int) -> bytes:
        """The whole body, or :class:`AnswerTooLarge` past ``limit`` bytes (the
        connection is then closed, not reused)."""
        chunks: list[bytes] = []
        taken = 0
        async for chunk in response.content.iter_any():
            taken += len(chunk)
            if taken > limit:
                response.close()
                raise AnswerTooLarge(limit) from None
            chunks.append(chunk)
        return b"".join(chunks)

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        return await self.request(
            "POST", url, [("content-type", "application/json"), *headers], payload, False
        )

    async def close(self) -> None:
        await self._session.close()


#: A node's fields the router does not relay: hop-by-hop, framing, and the two
#: it sets itself.
NOT_RELAYED = HOP_BY_HOP | {b"content-length", b"date", b"server"}


def relayed(status: int, raw: Iterable[tuple[bytes, bytes]], body: bytes, head: bool) -> Answer:
    """A node's answer as :class:`Answer` says, from its raw fields (the fast
    client, router/fastclient.py, does the same as it parses)."""
    headers: list[tuple[bytes, bytes]] = []
    connection: list[bytes] = []
    length: bytes | None = None
    for name, value in raw:
        name = name.lower()
        if name not in NOT_RELAYED:
            headers.append((name, value))
        elif name == b"content-length":
            length = value
        elif name == b"connection":
            connection.append(value)
    headers = without_options(headers, connection)
    if length is not None and head:
        headers.append((b"content-length", length))
    return Answer(status, headers, body, head or status in NO_CONTENT)


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


class SchemeForwarder:
    """The router's forwarder: ``http://`` nodes through the fast client
    (router/fastclient.py), ``https://`` ones through aiohttp, made when the
    first is met.

    A router chose one of the two once, from its seeds: one started without
    ``https://`` seeds (a worker beside the leader, a restart that recovers
    its ring from ``--state-file``, a router whose members were added later)
    could not reach an ``https://`` member at all, and under an ``open`` rule
    admitted everything that member owned (found by an exploratory tester).
    """

    def __init__(self, fast: Any, make_tls: Callable[[], AiohttpForwarder]) -> None:
        #: The fast client, which the router's proxy path drives directly.
        self.fast = fast
        self._make_tls = make_tls
        self._tls: AiohttpForwarder | None = None

    @property
    def pipelined(self) -> dict[str, int]:
        counts: dict[str, int] = self.fast.pipelined
        return counts

    def tls(self) -> AiohttpForwarder:
        if self._tls is None:
            self._tls = self._make_tls()
        return self._tls

    async def request(
        self,
        method: str,
        url: str,
        headers: list[tuple[str, str]],
        body: bytes | None,
        capped: bool = True,
    ) -> Answer:
        client = self.fast if url.startswith("http://") else self.tls()
        answer: Answer = await client.request(method, url, headers, body, capped)
        return answer

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        client = self.fast if url.startswith("http://") else self.tls()
        answer: Answer = await client.post_json(url, payload, headers)
        return answer

    async def close(self) -> None:
        await self.fast.close()
        if self._tls is not None:
            await self._tls.close()


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
        except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
            # Sent, and the connection closed before the answer came back.
            raise AnswerLost(type(exc).__name__) from None
        except httpx.TransportError as exc:
            raise Unreachable(type(exc).__name__) from None
        head = method == "HEAD"
        return relayed(response.status_code, response.headers.raw, response.content, head)

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        return await self.request(
            "POST", url, [("content-type", "application/json"), *headers], payload
        )

    async def close(self) -> None:
        return None
