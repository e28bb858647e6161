"""One node of the cluster, as the ring sees it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import check_fields

__all__ = ["Member"]

_FIELDS = frozenset({"id", "url", "weight"})


@dataclass(frozen=True, slots=True)
class Member:
    """A node that can own keys.

    Only ``id`` and ``weight`` decide placement; ``url`` is where to reach the
    node. Keeping the two apart means a node can move to a new address (a
    restart on another port, say) without a single key changing owner.

    ``id`` is hashed verbatim into the continuum, so an id that differs only
    by stray whitespace would silently be a different node with different
    keys. That is rejected rather than stripped: guessing would hide a
    configuration mistake.
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
        if not isinstance(self.url, str):
            raise TypeError(f"member {self.id!r}: url must be a str, got {type(self.url).__name__}")
        # bool is an int subclass; weight=True is a bug, not a weight of 1.
        if isinstance(self.weight, bool) or not isinstance(self.weight, int):
            raise TypeError(
                f"member {self.id!r}: weight must be an int, got {type(self.weight).__name__}"
            )
        if self.weight < 1:
            raise ValueError(f"member {self.id!r}: weight must be >= 1, got {self.weight}")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready form; always includes ``weight`` so it round-trips explicitly."""
        return {"id": self.id, "url": self.url, "weight": self.weight}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Member:
        """Parse untrusted input (a config file, a peer's message).

        Everything wrong with the input is a ``ValueError`` here, including
        wrong types, so callers need one ``except`` for "bad payload".
        Unknown keys are rejected: a misspelt ``"wieght"`` would otherwise
        quietly become weight 1 and move keys.
        """
        check_fields(data, "member", _FIELDS, ("id", "url"))
        try:
            return cls(id=data["id"], url=data["url"], weight=data.get("weight", 1))
        except TypeError as exc:
            raise ValueError(str(exc)) from exc
