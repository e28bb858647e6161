"""Who is asking: the user id and tier of an ASGI request.

Shared by the router (which hashes the user id onto the ring) and by the
node's middleware (which uses it when it is not behind a router).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import unquote_to_bytes

from node.config import Identity

Headers = Iterable[tuple[bytes, bytes]]


class InvalidUserId(ValueError):
    """A user id that is not valid UTF-8, or given twice: answered with a 400,
    never guessed at.

    Decoding such bytes some other way (latin-1, say) would map two different
    byte strings onto one text id (``\\xe9`` and ``\\xc3\\xa9`` both become
    ``é``), and the two users would share a quota. Every id is text in the
    decision API (JSON), on the ring and in handoffs, so UTF-8 it must be.

    Given twice (two ``X-User-Id`` fields, ``?user=a&user=b``), the limiter and
    the application may each take another one: the limiter took the first,
    Starlette's and Django's ``get`` the last, so ``?user=<new>&user=alice``
    was counted under a fresh key every time and served as alice.
    """


_TWICE = "the user id is given more than once ({}): send it once"


def header_text(value: bytes) -> str:
    """A header value as text: UTF-8 when it is valid UTF-8, else latin-1.

    UTF-8 first so that a user id sent as UTF-8 bytes is the same string as the
    same id in a JSON body of the decision API (and is re-encoded to the same
    bytes when the request is forwarded); latin-1 never fails, for the rest.
    """
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def header(headers: Headers, name: bytes) -> str | None:
    """The first value of a header (``name`` in lower case), see :func:`header_text`."""
    for key, value in headers:
        if key == name:
            return header_text(value)
    return None


def user_text(value: bytes, where: str) -> str:
    """A user id's bytes as text; :class:`InvalidUserId` unless they are UTF-8."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        raise InvalidUserId(f"the user id in {where} is not valid UTF-8") from None


def preflight_origin(scope: Mapping[str, Any]) -> bytes | None:
    """The ``Origin`` of a CORS preflight (``OPTIONS`` with ``Origin`` and
    ``Access-Control-Request-Method``), else None.

    A browser sends a preflight on its own, before the request it asks about,
    and without that request's credentials or custom fields: it has no user id
    (an API whose users send ``X-User-Id`` or an API key refused every
    cross-origin call with ``400 missing_user_id``), and charging it to a user
    would charge a browser's users twice. So it is decided under the same
    rules by its client's address instead (:meth:`IdentityResolver.preflight_key`):
    never unlimited, or two fields would open any endpoint to a flood."""
    if scope["method"] != "OPTIONS":
        return None
    origin = asked = None
    for name, value in scope["headers"]:
        if name == b"origin":
            origin = value
        elif name == b"access-control-request-method":
            asked = value
    return origin if origin is not None and asked is not None else None


class IdentityResolver:
    """Extracts the user id (and tier) as an :class:`Identity` configuration says."""

    def __init__(self, identity: Identity) -> None:
        self.identity = identity
        self._header = identity.name.lower().encode("latin-1")
        self._tier = identity.tier_header.lower().encode("latin-1") if identity.tier_header else b""
        self._networks = tuple(
            ipaddress.ip_network(p, strict=False) for p in identity.trusted_proxies
        )

    def user(self, scope: Mapping[str, Any]) -> str | None:
        """The user id; raises :class:`InvalidUserId` when it is not UTF-8."""
        identity = self.identity
        if identity.source == "header":
            found = None
            wanted = self._header
            for key, value in scope["headers"]:
                if key == wanted:
                    if found is not None:
                        raise InvalidUserId(_TWICE.format(f"header {identity.name!r}"))
                    found = user_text(value, f"header {identity.name!r}")
        elif identity.source == "query":
            found = _query_value(scope.get("query_string", b""), identity.name)
        else:
            found = self.client(scope)
        if not found and identity.fallback_to_client and identity.source != "client":
            found = self.client(scope)
        return found or None

    def preflight_key(self, scope: Mapping[str, Any]) -> str:
        """The key a CORS preflight is decided by (see :func:`preflight_origin`):
        its client's address, apart from every user's own quota."""
        return f"preflight:{self.client(scope) or '-'}"

    def tier(self, scope: Mapping[str, Any]) -> str | None:
        if not self._tier:
            return None
        return header(scope["headers"], self._tier)

    def client(self, scope: Mapping[str, Any]) -> str | None:
        """The client address, believing ``X-Forwarded-For`` only from trusted proxies.

        The address is the right-most entry of the chain (every ``X-Forwarded-For``
        field, in order) that is not itself a trusted proxy: entries further left
        were written by the client.
        """
        client = scope.get("client")
        peer = client[0] if client else None
        if not peer or not self._networks or not self._trusted(peer):
            return peer
        # Every field, in order, as one list (RFC 9110 5.3): a proxy may add its own
        # field rather than append to the client's, which then comes first.
        forwarded = ", ".join(
            header_text(value) for key, value in scope["headers"] if key == b"x-forwarded-for"
        )
        if not forwarded:
            return peer
        for hop in reversed([h.strip() for h in forwarded.split(",") if h.strip()]):
            if not self._trusted(hop):
                return hop
        return peer

    def _trusted(self, address: str) -> bool:
        return _is_trusted(address, self._networks)


@lru_cache(maxsize=1024)
def _is_trusted(address: str, networks: tuple[ipaddress._BaseNetwork, ...]) -> bool:
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)


def _query_value(query_string: bytes, name: str) -> str | None:
    """The value of ``name`` in a query string, percent-decoded as UTF-8; None
    when it is absent or empty, :class:`InvalidUserId` when it is named more
    than once (with a value or without: ``?user=alice&user=`` is alice to us
    and nobody to a framework that takes the last).

    Decoded to bytes first (raw and percent-encoded bytes alike), so that
    ``%E9`` and ``%C3%A9`` stay different (the first is refused), where
    ``parse_qsl`` would turn every invalid sequence into U+FFFD, one user.
    """
    if not query_string:
        return None
    wanted = name.encode()
    where = f"query parameter {name!r}"
    found: bytes | None = None
    for part in query_string.split(b"&"):
        key, _, value = part.partition(b"=")
        if unquote_to_bytes(key.replace(b"+", b" ")) == wanted:
            if found is not None:
                raise InvalidUserId(_TWICE.format(where))
            found = value
    if not found:
        return None
    return user_text(unquote_to_bytes(found.replace(b"+", b" ")), where)
