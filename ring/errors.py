"""Errors raised by the ring layer."""

from __future__ import annotations

__all__ = ["EmptyRingError"]


class EmptyRingError(LookupError):
    """A key was looked up on a ring that has no members.

    A subclass of ``LookupError`` so callers that already treat "no such
    thing" uniformly keep working, while the router can catch this case
    specifically and answer 503 (nothing to route to) rather than 500.
    """
