"""Who is asking: the user id and tier of an ASGI request.

Shared by the router (which hashes the user id onto the ring) and by the
node's middleware (which uses it when it is not behind a router).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any
from urllib.parse import parse_qsl

from node.config import Identity

Headers = Iterable[tuple[bytes, bytes]]


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
        identity = self.identity
        if identity.source == "header":
            found = header(scope["headers"], self._header)
        elif identity.source == "query":
            found = _query_value(scope.get("query_string", b""), identity.name)
        else:
            found = self.client(scope)
        if not found and identity.fallback_to_client and identity.source != "client":
            found = self.client(scope)
        return found or None

    def tier(self, scope: Mapping[str, Any]) -> str | None:
        if not self._tier:
            return None
        return header(scope["headers"], self._tier)

    def client(self, scope: Mapping[str, Any]) -> str | None:
        """The client address, believing ``X-Forwarded-For`` only from trusted proxies.

        The address is the right-most entry of the chain that is not itself a
        trusted proxy: entries further left were written by the client.
        """
        client = scope.get("client")
        peer = client[0] if client else None
        if not peer or not self._networks or not self._trusted(peer):
            return peer
        forwarded = header(scope["headers"], b"x-forwarded-for")
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
    if not query_string:
        return None
    for key, value in parse_qsl(query_string.decode("latin-1"), keep_blank_values=False):
        if key == name:
            return value
    return None
