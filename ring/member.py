"""One node of the cluster, as the ring sees it, and the rules for what may name one."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from .errors import check_fields, given

__all__ = ["MAX_WEIGHT", "Member", "check_id", "check_url", "check_weight", "same_url"]

_FIELDS = frozenset({"id", "url", "weight"})

#: What a member id may be: it is hashed into the ring, put in URL paths
#: (``DELETE /admin/nodes/<id>``), headers (``X-Ringlimit-Node``), metric labels
#: and logs. A ``/``, ``?`` or ``#`` would address something else in a path;
#: ``.`` and ``..`` are rewritten by URL normalisation. ``:`` is allowed (it is
#: safe in a path segment) so that libketama's ``host:port`` server names work as
#: ids (ring/view.py: clients outside this codebase can then place keys alike).
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,64}", re.ASCII)
#: The heaviest member: ketama gives each member a share of the continuum's points,
#: so beyond a few hundred times the lightest one the light members get none.
MAX_WEIGHT = 1000
#: Longest URL accepted for a member.
MAX_URL_LENGTH = 2048


def check_id(value: object) -> str:
    """``value`` if it is a valid member id, else ``ValueError`` saying why."""
    if not isinstance(value, str):
        raise ValueError(f"member id must be a string, got {type(value).__name__}")
    if not ID_PATTERN.fullmatch(value) or set(value) == {"."}:
        shown = value if len(value) <= 80 else value[:80] + "..."
        raise ValueError(
            f"member id {shown!r} is invalid: 1 to 64 characters from A-Z a-z 0-9 . _ : - "
            "(and not only dots)"
        )
    return value


def check_weight(value: object) -> int:
    """``value`` if it is a valid weight (an int from 1 to ``MAX_WEIGHT``)."""
    # bool is an int subclass; weight=True is a bug, not a weight of 1.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"weight must be an int, got {type(value).__name__}")
    if not 1 <= value <= MAX_WEIGHT:
        raise ValueError(f"weight must be from 1 to {MAX_WEIGHT}, got {given(value)}")
    return value


def check_url(value: object) -> str:
    """``value`` if it is a URL a member can be reached at, else ``ValueError``.

    ``http`` or ``https``, a host, an optional port in 1..65535, and nothing
    after it but an optional ``/``: the router appends request paths to it, so
    a path, query, fragment or user info would send requests elsewhere.
    """
    if not isinstance(value, str):
        raise ValueError(f"url must be a string, got {type(value).__name__}")
    shown = value if len(value) <= 80 else value[:80] + "..."
    if len(value) > MAX_URL_LENGTH or not value.isascii() or not value.isprintable():
        raise ValueError(f"url {shown!r} must be printable ASCII of at most {MAX_URL_LENGTH}")
    if any(c.isspace() for c in value):
        raise ValueError(f"url {shown!r} must not contain whitespace")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"url {shown!r} is invalid: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"url {shown!r} must start with http:// or https://")
    if not parts.hostname:
        raise ValueError(f"url {shown!r} has no host")
    if "@" in parts.netloc:
        raise ValueError(f"url {shown!r} must not carry user info")
    if port == 0 or parts.netloc.endswith(":"):
        raise ValueError(f"url {shown!r} has no valid port (1..65535)")
    if parts.path not in ("", "/") or parts.query or parts.fragment or "?" in value or "#" in value:
        raise ValueError(f"url {shown!r} must have no path, query or fragment")
    return value


def same_url(a: str, b: str) -> bool:
    """Whether two member URLs reach the same place (scheme, host, port; case-blind)."""
    return _url_key(a) == _url_key(b)


def _url_key(url: str) -> tuple[str, str, int | None]:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return (url, "", None)
    scheme = parts.scheme.lower()
    default = {"http": 80, "https": 443}.get(scheme)
    host = (parts.hostname or "").lower()
    if host in ("localhost", "::1"):
        host = "127.0.0.1"
    return (scheme, host, port if port is not None else default)


@dataclass(frozen=True, slots=True)
class Member:
    """A node that can own keys.

    Only ``id`` and ``weight`` decide placement; ``url`` is where to reach the
    node. Keeping the two apart means a node can move to a new address (a
    restart on another port, say) without a single key changing owner.

    ``id`` is hashed verbatim into the continuum and used in paths and
    headers, so it is restricted to a safe charset (:data:`ID_PATTERN`);
    an id with stray whitespace is rejected rather than stripped: guessing
    would hide a configuration mistake. The url is checked by
    :meth:`from_dict` and :func:`check_url` at every entry point of untrusted
    input (admin API, ``--node``, ``--url``, state file, pushed views).
    """

    id: str
    url: str
    weight: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.id, str):
            raise TypeError(f"member id must be a str, got {type(self.id).__name__}")
        if not self.id or self.id != self.id.strip():
            raise ValueError(
                f"member id must be non-empty with no leading/trailing whitespace, got {self.id!r}"
            )
        check_id(self.id)
        if not isinstance(self.url, str):
            raise TypeError(f"member {self.id!r}: url must be a str, got {type(self.url).__name__}")
        if isinstance(self.weight, bool) or not isinstance(self.weight, int):
            raise TypeError(
                f"member {self.id!r}: weight must be an int, got {type(self.weight).__name__}"
            )
        if self.weight < 1:
            raise ValueError(f"member {self.id!r}: weight must be >= 1, got {self.weight}")
        try:
            check_weight(self.weight)
        except ValueError as exc:
            raise ValueError(f"member {self.id!r}: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form; always includes ``weight`` so it round-trips explicitly."""
        return {"id": self.id, "url": self.url, "weight": self.weight}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Member:
        """Parse untrusted input (a config file, a peer's message, the admin API).

        Everything wrong with the input is a ``ValueError`` here, including
        wrong types and a url that is not a plain ``http(s)://host[:port]``,
        so callers need one ``except`` for "bad payload". Unknown keys are
        rejected: a misspelt ``"wieght"`` would otherwise quietly become
        weight 1 and move keys.
        """
        check_fields(data, "member", _FIELDS, ("id", "url"))
        try:
            member = cls(id=data["id"], url=data["url"], weight=data.get("weight", 1))
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
        try:
            check_url(member.url)
        except ValueError as exc:
            raise ValueError(f"member {member.id!r}: {exc}") from None
        if member.url.endswith("/"):
            # Request paths are appended to it: "http://h:8001/" sent "//x" for "/x".
            member = cls(id=member.id, url=member.url[:-1], weight=member.weight)
        return member

    @classmethod
    def parse(cls, member_id: object, url: object, weight: object = 1) -> Member:
        """A member from separate untrusted values (CLI flags): ``ValueError`` if bad."""
        return cls.from_dict({"id": member_id, "url": url, "weight": weight})
