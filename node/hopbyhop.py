"""Hop-by-hop fields: what a proxy does not pass on (RFC 9110 7.6.1).

ringlimit has two proxies, the router (client -> node) and a node with
``--upstream`` (node -> application). Both drop the fixed hop-by-hop names
and also every name a ``Connection`` field lists: ``Connection: X-Trace``
means X-Trace is for this hop only. A proxy that passed it on would hand a
hop-scoped field (a credential between a load balancer and the router, a
debugging switch) to a server it was never meant for.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "HOP_BY_HOP",
    "NO_CONTENT",
    "PLAIN_CONNECTION",
    "connection_options",
    "passed_on",
    "without_options",
]

#: Fields that describe one connection, never passed on.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

#: Statuses whose answers have no content (RFC 9110 6.4.1): a proxy that
#: gives them ``content-length: 0`` tells a 304's client that the cached
#: representation is empty.
NO_CONTENT = frozenset({204, 304})

#: ``Connection`` values that list no field: the common ones (browsers and most
#: clients send ``keep-alive``), which a proxy skips without parsing.
PLAIN_CONNECTION = frozenset({b"keep-alive", b"close", b"Keep-Alive", b"Close", b""})


def connection_options(values: Iterable[bytes]) -> frozenset[bytes]:
    """The field names that ``Connection`` values list, lowercased, less the
    ``close`` and ``keep-alive`` options (which name no field)."""
    names: set[bytes] = set()
    for value in values:
        if value in PLAIN_CONNECTION:
            continue
        names.update(token.strip().lower() for token in value.split(b","))
    names -= {b"close", b"keep-alive", b""}
    return frozenset(names)


def passed_on(
    fields: list[tuple[bytes, bytes]], dropped: frozenset[bytes]
) -> list[tuple[bytes, bytes]]:
    """``fields`` (names lowercase) less the ``dropped`` names and those their
    ``Connection`` fields list: what a proxy passes on, in one call."""
    listed = without_options(fields, [v for k, v in fields if k == b"connection"])
    return [field for field in listed if field[0] not in dropped]


def without_options(
    fields: list[tuple[bytes, bytes]], connection: Iterable[bytes]
) -> list[tuple[bytes, bytes]]:
    """``fields`` (names lowercase) less those the ``connection`` values list:
    ``fields`` itself when they list none (the common case costs no copy)."""
    names = connection_options(connection)
    if not names:
        return fields
    return [field for field in fields if field[0] not in names]
