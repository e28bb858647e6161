"""Errors raised by the ring layer, and the validation of its wire format."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["EmptyRingError", "check_fields"]


class EmptyRingError(LookupError):
    """A key was looked up on a ring that has no members.

    A subclass of ``LookupError`` so callers that already treat "no such
    thing" uniformly keep working, while the router can catch this case
    specifically and answer 503 (nothing to route to) rather than 500.
    """


def check_fields(
    data: object, what: str, allowed: frozenset[str], required: tuple[str, ...]
) -> None:
    """Refuse a wire object that is not a mapping, has unknown fields or lacks one.

    A typo (``"wieght"``) must not quietly become a default: what a node or a
    router does not understand is safer refused than half-applied.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(data).__name__}")
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"{what} has unknown field(s): {', '.join(sorted(map(str, unknown)))}")
    for name in required:
        if name not in data:
            raise ValueError(f"{what} is missing required field {name!r}")
