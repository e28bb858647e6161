"""Secrets: compared in constant time, never logged."""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import socket
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit


def token_matches(given: str | None, expected: str | None) -> bool:
    """Constant-time comparison; no token configured means no check here."""
    if expected is None:
        return True
    if given is None:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def refusal(
    given: str | None,
    expected: str | None,
    host: str | None,
    headers: Mapping[str, str],
) -> int | None:
    """The one access check of token-protected endpoints (the router's admin API,
    the node's internal API): None when the call may proceed, else its status.

    With a token configured, the caller must present it (401 otherwise); without
    one, only a caller on this host is served (403 otherwise), so an unconfigured
    cluster is never open to the network, nor to the pages a browser on this host
    shows (``headers``, the request's: see :func:`for_another_site`).
    """
    if expected is None:
        return None if is_loopback(host) and not for_another_site(headers) else 403
    return None if token_matches(given, expected) else 401


def for_another_site(headers: Mapping[str, str]) -> bool:
    """Whether the request may come from a browser on this host for a page that
    is not one of this server's at a loopback address.

    A browser is a loopback client to every page it shows: a page of any site may
    send a POST with a text/plain body (no preflight) to ``127.0.0.1``, and one
    whose name its DNS rebinds to ``127.0.0.1`` may even read the answers. So a
    request addressed by a name a page could rebind (:func:`_cannot_be_rebound`)
    is refused, whatever else it carries: a page served over plain HTTP (a
    rebinding page) is not a secure context, so its browser sends no
    ``Sec-Fetch-Site``, and a same-origin GET no ``Origin`` either (an
    exploratory tester read ``/admin/ring`` with ``Host: evil.com`` alone).
    Browsers that do mark their requests (``Sec-Fetch-Site``, ``Origin``) are
    served only for a page of this same origin. Tools, routers and nodes address
    a loopback peer by an address, ``localhost`` or this machine's name, or send
    no ``Host`` (HTTP/1.0), and are not affected.
    """
    return page_of_another_site(
        headers.get("host"), headers.get("origin"), headers.get("sec-fetch-site")
    )


def page_of_another_site(
    authority: str | None, origin: str | None, site: str | None, *, by_name: bool = True
) -> bool:
    """:func:`for_another_site` over the three fields it reads (a caller on the hot
    path finds them in one scan). ``by_name=False`` leaves out the rebinding
    test of the ``Host`` name, a concern of this host's browsers only: what a
    browser marks as another site's (``Sec-Fetch-Site``, or an ``Origin`` that
    is not the request's ``Host``: it sends one of them with every cross-site
    POST) is refused whoever sends it. Tools, routers and nodes send neither."""
    if by_name and authority is not None and not _cannot_be_rebound(_host_name(authority)):
        return True
    if site is not None and site not in ("same-origin", "none"):
        return True
    return origin is not None and origin.partition("://")[2] != (authority or "")


def from_a_web_page(scope: Mapping[str, Any]) -> bool:
    """Whether an ASGI request to a decision API open without a token comes from a
    web page: one a browser marks as another site's, from anywhere, or, from this
    host, one addressed by a name a page could rebind to it
    (:func:`page_of_another_site`). Such a page could spend any user's quota with
    a text/plain POST (no preflight). One scan of the fields and cached parses:
    a router sends every batch through here."""
    host = origin = site = None
    for name, value in scope["headers"]:
        if name == b"host":
            if host is None:
                host = value
        elif name == b"origin":
            if origin is None:
                origin = value.decode("latin-1")
        elif name == b"sec-fetch-site" and site is None:
            site = value.decode("latin-1")
    if (origin is not None or site is not None) and page_of_another_site(
        None if host is None else host.decode("latin-1"), origin, site, by_name=False
    ):
        return True
    if host is None or _safe_host(host):
        return False  # (the client's address is looked at only for a name)
    client = scope.get("client")
    return is_loopback(client[0] if client else None)


@functools.lru_cache(maxsize=256)
def _safe_host(host: bytes) -> bool:
    """Whether a raw ``Host`` value names what no page can rebind (cached as it
    arrives: tools send the same one on every request)."""
    return _cannot_be_rebound(_host_name(host.decode("latin-1")))


def _host_name(authority: str) -> str:
    """The name (or address) of a ``Host`` value, as :func:`_cannot_be_rebound`
    takes it: no port, no brackets, lower case, without a trailing dot (the same
    name: "localhost." was refused)."""
    if authority.startswith("["):
        name = authority[1:].partition("]")[0]  # [::1]:8000
    else:
        name = authority.partition(":")[0]
    return name.lower().removesuffix(".")


@functools.lru_cache(maxsize=256)
def _cannot_be_rebound(name: str) -> bool:
    """A name no page can rebind to this host: ``localhost`` and names under
    ``.localhost`` (RFC 6761 6.3: browsers resolve them themselves; the
    in-process test cluster names its members so), an address (a rebinding
    page needs a DNS name; ``0.0.0.0`` is what a node bound to it and given no
    ``--url`` registers as), or this machine's own name (what such a node
    registers as otherwise, and Debian maps it to 127.0.1.1)."""
    if name == "localhost" or name.endswith(".localhost") or name in _own_names():
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=1)
def _own_names() -> frozenset[str]:
    # gethostname() only: no DNS lookup (getfqdn) on the event loop.
    return frozenset({socket.gethostname().lower()} - {""})


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


@functools.lru_cache(maxsize=256)  # (a peer's address: few per process, parsed once)
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


def redact_url(url: str) -> str:
    """A URL as logs and messages show it: every password replaced by ``***``.

    ``redis://user:secret@host/0`` -> ``redis://user:***@host/0``, and a password
    in the query, which redis-py takes too (``?password=secret``, the usual form
    for a ``unix://`` socket; ``ssl_password``) -> ``?password=***``. Never raises:
    a URL ``urlsplit`` cannot read (an unclosed ``[``) is shown without anything
    before its host or after it, since its error message is what names it.
    """
    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        scheme, sep, rest = url.partition("://")
        host, query, _ = rest.rpartition("@")[2].partition("?")
        return f"{scheme}{sep}{'***@' if '@' in rest else ''}{host}{'?***' if query else ''}"
    # By hand, not urlunsplit: that writes ``unix:///path`` as ``unix:/path``.
    head, mark, query = url.partition("?")
    if password is not None:
        host = parts.netloc.rsplit("@", 1)[1]
        head = head.replace(parts.netloc, f"{parts.username or ''}:***@{host}", 1)
    return f"{head}{mark}{_redact_query(query)}"


def _redact_query(query: str) -> str:
    """``a=1&password=x`` -> ``a=1&password=***``, the rest left byte for byte."""
    fields = []
    for field in query.split("&"):
        name, sep, _ = field.partition("=")
        fields.append(f"{name}=***" if sep and "password" in unquote(name).lower() else field)
    return "&".join(fields)
