"""Secrets: compared in constant time, never logged."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress


def token_matches(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison; no token configured means no check here."""
    if expected is None:
        return True
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def refusal(given: str | None, expected: str | None, host: str | None) -> int | None:
    """The one access check of token-protected endpoints (the router's admin API,
    the node's internal API): None when the call may proceed, else its status.

    With a token configured, the caller must present it (401 otherwise); without
    one, only a caller on this host is served (403 otherwise), so an unconfigured
    cluster is never open to the network.
    """
    if expected is None:
        return None if is_loopback(host) else 403
    return None if token_matches(given, expected) else 401


def bearer(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "bearer" else None


def bypass_matches(token: str | None, digests: tuple[str, ...]) -> bool:
    """Whether ``token`` is one of the bypass tokens, stored only as SHA-256 digests.

    Every digest is compared (no early exit), so timing does not reveal which
    one came close.
    """
    if not token or not digests:
        return False
    digest = hashlib.sha256(token.encode()).hexdigest().encode()
    found = False
    for expected in digests:
        found |= hmac.compare_digest(digest, expected.encode())
    return found


def is_loopback(host: str | None) -> bool:
    if not host:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    # A dual-stack socket (--host ::) sees IPv4 clients as ::ffff:a.b.c.d.
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))
