"""How nodes talk to each other: state transfers, pulls and replicas.

Transfers and pulls are control plane (rare, bulk), so they use httpx; the
request hot path never waits on them except for a pull-on-miss during a
handoff. Replicas are not rare: every sticky node sends one body per
successor every ``replication_interval`` for as long as it serves, so they
go through aiohttp (:meth:`Peers.replicate`): measured on this machine, a
small POST costs ~400 us of CPU through an ``httpx.AsyncClient`` and ~80 us
through an ``aiohttp.ClientSession`` (router/forward.py made the same choice).

The wire format. State transfers (``/internal/import``) and replicas
(``/internal/replica``) travel as msgpack (msgspec), with a version field
``"v": WIRE_VERSION``: a million token-bucket states are ~49 MB of msgpack
that encode in ~0.1 s, against ~69 MB of JSON that took ~0.8 s to encode and
~2.5 s to decode. A receiver refuses a msgpack body of another version with
400 ``unsupported_version`` (so a newer peer's format is never half-read), and
still accepts JSON bodies (older peers: no version field, or ``"v": 1``).
Bodies are validated on receipt exactly as before (node/store.py
``check_records``): the format changes the bytes, not the checks. A msgpack
body of states is decoded against the records' type (:func:`decode_records`),
so msgspec checks their shape and strings as it builds them; what it accepts
and refuses is what ``check_records`` accepts and refuses, in the same words
(tests/test_records.py holds them to that).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
from collections.abc import Iterator
from typing import Annotated, Any

import aiohttp
import httpx
import msgspec

from node.frontdoor import REUSE_IDLE
from node.rules import MAX_NAME
from node.store import check_record_states, check_records
from node.strictjson import GivenTwice, loads_unique
from ring.errors import given

INTERNAL_TOKEN_HEADER = "X-Ringlimit-Token"  # noqa: S105 (a header name)
#: Sent by a node with its join and its leave: its process's ``instance`` (what
#: its ``/healthz`` says), so that the router can tell whether the process at the
#: URL it registers is the one asking (router/membership.py ``check_instance``).
INSTANCE_HEADER = "X-Ringlimit-Instance"

#: The internal wire format's version; a msgpack body of any other is refused (400).
WIRE_VERSION = 1
#: The content type of a msgpack body (JSON bodies stay application/json).
MSGPACK = "application/msgpack"

#: A node's httpx pool to its peers; and the router's to its nodes (httpx's own
#: caps): idle connections reused for REUSE_IDLE at most (node/frontdoor.py).
PEER_LIMITS = httpx.Limits(
    max_connections=64, max_keepalive_connections=16, keepalive_expiry=REUSE_IDLE
)
CONTROL_LIMITS = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=REUSE_IDLE
)


def _no_extensions(code: int, data: memoryview) -> Any:
    """msgpack's extension types are not part of the wire format: refused as the
    body's error (one was taken, and its Python repr quoted in a 400's detail)."""
    raise msgspec.DecodeError(f"msgpack extension type {code} is not part of the wire format")


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(ext_hook=_no_extensions).decode


class WireError(ValueError):
    """A body that cannot be read: ``error`` is the machine-readable reason."""

    def __init__(self, error: str, detail: str) -> None:
        super().__init__(detail)
        self.error = error


@contextlib.contextmanager
def bulk() -> Iterator[None]:
    """No cyclic garbage collection while a bulk body is decoded and applied.

    A transfer's records are millions of small lists (acyclic: reference
    counting frees them), and every one would count towards a collection:
    decoding a million records took 1.75 s with the collector on, 0.33 s
    without. Re-enabled afterwards only if it was on.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def encode(payload: dict[str, Any]) -> bytes:
    """``payload`` as a versioned msgpack body."""
    return _encode({"v": WIRE_VERSION, **payload})


def decode(body: bytes, content_type: str | None) -> Any:
    """A peer's body: msgpack (versioned) when its content type says so, else JSON.

    ``WireError`` for a body that does not parse or a msgpack body whose
    version this node does not speak; the caller answers 400.
    """
    if _is_msgpack(content_type):
        try:
            data = _decode(body)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
            raise WireError("invalid_msgpack", f"body is not valid msgpack: {exc}") from None
        if not isinstance(data, dict):
            raise WireError("invalid_request", "body must be a msgpack map")
        version = data.get("v")
        if version != WIRE_VERSION or type(version) is not int:
            raise WireError(
                "unsupported_version",
                f"wire version {_quoted(version)} is not supported: this node speaks "
                f"{WIRE_VERSION}"[:160],
            )
        return data
    try:
        data = loads_unique(body)
    except GivenTwice as exc:
        raise WireError("invalid_request", str(exc)) from None
    except (ValueError, RecursionError) as exc:
        raise WireError("invalid_json", f"body is not valid JSON: {exc}") from None
    if (
        isinstance(data, dict)
        and "v" in data
        and (
            data["v"] != WIRE_VERSION or type(data["v"]) is not int  # (true == 1 in Python)
        )
    ):
        raise WireError(
            "unsupported_version",
            f"wire version {_quoted(data['v'])} is not supported: this node speaks {WIRE_VERSION}"[
                :160
            ],
        )
    return data


def _quoted(value: Any) -> str:
    """A peer's value as an error may quote it: JSON's own kinds as they are, any
    other (msgpack's timestamp, which msgspec reads as a datetime) by its type:
    a Python repr in a 400's detail says nothing to the sender."""
    if value is None or isinstance(value, bool | int | float | str):
        return given(value)
    return f"of type {type(value).__name__}"


def _is_msgpack(content_type: str | None) -> bool:
    # Media types are case-insensitive (RFC 9110 8.3.1): Application/MsgPack was read
    # as JSON and refused as invalid_json.
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == MSGPACK


def decode_records(body: bytes, content_type: str | None, max_key_length: int) -> dict[str, Any]:
    """A body that carries states (``/internal/import``, ``/internal/replica``), as
    :func:`decode` reads it, with its ``records`` checked whole
    (node/store.py :func:`~node.store.check_records`): ``ValueError`` naming the
    first bad record, ``WireError`` for a body that does not parse.

    A msgpack body is decoded against the records' type, so msgspec checks
    their shape, strings and lengths in C as it builds them (records are then
    tuples, not lists), and only the per-algorithm checks run in Python: on
    the receiver, the bulk of a handoff's CPU. A body that does not fit the
    type is read again the general way, so its error says what
    :func:`check_records` says.
    """
    if _is_msgpack(content_type):
        decoder, names = _records_decoder(max_key_length)
        try:
            typed = decoder.decode(body)
        except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
            pass  # msgspec.ValidationError is a DecodeError; decode() says what is wrong
        else:
            if typed.v == WIRE_VERSION:
                check_record_states(typed.records)
                values = msgspec.structs.astuple(typed)
                return {
                    name: value
                    for name, value in zip(names, values, strict=True)
                    if value is not msgspec.UNSET
                }
    data = decode(body, content_type)
    if isinstance(data, dict) and "records" in data:
        data["records"] = check_records(data["records"], max_key_length=max_key_length)
    return data


class _RecordsBody(msgspec.Struct, gc=False, forbid_unknown_fields=True, rename={"sender": "from"}):
    """The fields of a transfer or replica body (node/shardcore.py's ``payload``
    methods), checked by the endpoint that reads them; ``records`` is typed by
    :func:`_records_decoder`'s subclass (with the cluster's key length). A body
    with any other field takes the general path, which keeps every field."""

    v: int
    records: list[Any]
    sender: Any = msgspec.UNSET
    epoch: Any = msgspec.UNSET
    final: Any = msgspec.UNSET
    crashes: Any = msgspec.UNSET
    round: Any = msgspec.UNSET


@functools.lru_cache(maxsize=8)
def _records_decoder(max_key_length: int) -> tuple[msgspec.msgpack.Decoder[Any], tuple[str, ...]]:
    """A decoder for :class:`_RecordsBody` whose records' strings have the
    lengths :func:`check_records` allows (the key's is the cluster's limit),
    and the body's field names in the order of the struct's values."""
    name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
    key = Annotated[str, msgspec.Meta(min_length=1, max_length=max_key_length)]
    record = tuple[name, str, key, list[float | int]]  # type: ignore[valid-type]
    body = msgspec.defstruct(
        "RecordsBody",
        [("records", list[record])],  # type: ignore[valid-type]
        bases=(_RecordsBody,),
        gc=False,
    )
    names = tuple(field.encode_name for field in msgspec.structs.fields(body))
    return msgspec.msgpack.Decoder(body, ext_hook=_no_extensions), names


#: At most this many characters of an answer are quoted in a line that says it
#: was not what was expected (the CLI's, a node's log).
MAX_EXCERPT = 160


def one_line(text: str, limit: int = 1000) -> str:
    """``text`` as part of one line (a failure the CLI prints, a log line):
    whitespace runs (newlines too) as one space, at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def excerpt(response: httpx.Response) -> str:
    """The start of an answer's body, for a line saying it was not what was
    expected; bytes that are not text are replaced. (A web server's HTML page
    made a node's log line about ten lines long.)"""
    text = response.content[: MAX_EXCERPT * 4].decode("utf-8", "replace")
    text = "".join(c if c.isprintable() else " " for c in text)
    return one_line(text, MAX_EXCERPT) or "empty body"


def said(response: httpx.Response) -> str:
    """What an answer says, for one log line: a ringlimit error body's code and
    detail whole (an excerpt cut a join's refusal before its fix: a tester),
    else the start of the body (:func:`excerpt`)."""
    try:
        data = response.json()
    except (ValueError, RecursionError):
        return excerpt(response)
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        detail = data.get("detail")
        text = data["error"] + ("" if detail is None else f": {detail}")
        return one_line("".join(c if c.isprintable() else " " for c in text))
    return excerpt(response)


class PeerError(Exception):
    """A peer did not answer as expected (down, slow, or refused).

    ``status`` is the peer's HTTP status, or None when it did not answer.
    """

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status

    @property
    def transient(self) -> bool:
        """Worth trying again: no answer, a conflict (409) or a server error."""
        return self.status is None or self.status == 409 or self.status >= 500


def _error(response: httpx.Response) -> Any:
    """The ``error`` field of a peer's JSON error body (None if there is none)."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None


class Peers:
    def __init__(
        self,
        *,
        token: str | None = None,
        timeout: float = 2.0,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        headers = {INTERNAL_TOKEN_HEADER: token} if token else {}
        self._headers = headers
        self._timeout = timeout
        self._owned = client is None
        #: Replicas' client, made in the running loop on first use (:meth:`replicate`).
        self._session: aiohttp.ClientSession | None = None
        self._client = client or httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=min(timeout, 0.5)),
            limits=PEER_LIMITS,
        )

    async def post(
        self,
        url: str,
        path: str,
        payload: dict[str, Any],
        *,
        seconds: float | None = None,
        compact: bool = False,
    ) -> dict[str, Any]:
        """POST JSON, or versioned msgpack when ``compact`` (state transfers and
        replicas); ``seconds`` overrides the default timeout for bulk transfers.
        The answer is JSON either way (it is small)."""
        extra: dict[str, Any] = {} if seconds is None else {"timeout": seconds}
        if compact:
            extra["content"] = encode(payload)
            headers = {**self._headers, "content-type": MSGPACK}
        else:
            extra["json"] = payload
            headers = self._headers
        try:
            response = await self._client.post(url.rstrip("/") + path, headers=headers, **extra)
        except httpx.HTTPError as exc:
            raise PeerError(f"{url}{path}: {type(exc).__name__}") from None
        if compact and response.status_code == 400 and _error(response) == "invalid_json":
            # An older peer, which reads JSON only: say it again in JSON.
            return await self.post(url, path, payload, seconds=seconds)
        if response.status_code != 200:
            raise PeerError(f"{url}{path}: HTTP {response.status_code}", response.status_code)
        data: dict[str, Any] = response.json()
        return data

    async def replicate(self, url: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST ``payload`` to ``url``'s ``/internal/replica`` as versioned msgpack:
        what :meth:`post` does with ``compact=True`` (the same body, errors and
        fallback to JSON for an older peer), over aiohttp, which costs a fifth
        of httpx's CPU per call. With a client given to the constructor (tests
        mount nodes in-process on an httpx transport), through that client."""
        if not self._owned:
            return await self.post(url, "/internal/replica", payload, compact=True)
        session = self._session
        if session is None or session.closed:
            session = self._session = aiohttp.ClientSession(
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(
                    total=self._timeout, sock_connect=min(self._timeout, 0.5)
                ),
                connector=aiohttp.TCPConnector(
                    limit=64, limit_per_host=16, keepalive_timeout=REUSE_IDLE
                ),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Content-Type"),
            )
        target = url.rstrip("/") + "/internal/replica"
        status, body = await _send(session, target, encode(payload), MSGPACK)
        if status == 400 and _error_of(body) == "invalid_json":
            # An older peer, which reads JSON only: say it again in JSON.
            status, body = await _send(
                session, target, json.dumps(payload).encode(), "application/json"
            )
        if status != 200:
            raise PeerError(f"{target}: HTTP {status}", status)
        data: dict[str, Any] = json.loads(body)
        return data

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self._owned:
            await self._client.aclose()


async def _send(
    session: aiohttp.ClientSession, url: str, body: bytes, content_type: str
) -> tuple[int, bytes]:
    """One POST through ``session``: the status and the whole answer, or PeerError."""
    try:
        async with session.post(
            url, data=body, headers={"content-type": content_type}, allow_redirects=False
        ) as response:
            return response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise PeerError(f"{url}: {type(exc).__name__}") from None


def _error_of(body: bytes) -> Any:
    """The ``error`` field of a peer's JSON error body (None if there is none)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    return data.get("error") if isinstance(data, dict) else None
