"""Comparing views: which keys move, and how evenly keys spread.

These work on an explicit sample of keys rather than on arc lengths of the
continuum because that is what handoff and the simulations actually care
about: the state that has to travel is per key, and a sample of real-looking
keys also exercises the key hash, not just the member points.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .view import RingView

__all__ = ["KeyMove", "diff", "hash_share", "moved_fraction", "ownership"]

#: Points on the continuum are 32-bit (libketama).
_SPACE = 1 << 32


@dataclass(frozen=True, slots=True)
class KeyMove:
    """``key`` changes owner from ``old_owner`` to ``new_owner`` (member ids).

    An owner is ``None`` on the side where the ring was empty, so moves into
    a first member and out of a last one are still reported instead of
    raising.
    """

    key: str
    old_owner: str | None
    new_owner: str | None


def _owner_or_none(view: RingView) -> Callable[[str], str | None]:
    if len(view) == 0:
        return lambda _key: None
    return view.owner_id


def diff(old: RingView, new: RingView, keys: Iterable[str]) -> list[KeyMove]:
    """The keys (in input order) whose owner differs between ``old`` and ``new``.

    Ownership is compared by member id: a member that only changed its url
    still holds the same state, so nothing needs handing off.
    """
    before = _owner_or_none(old)
    after = _owner_or_none(new)
    moves = []
    for key in keys:
        a, b = before(key), after(key)
        if a != b:
            moves.append(KeyMove(key, a, b))
    return moves


def moved_fraction(old: RingView, new: RingView, keys: Iterable[str]) -> float:
    """Share of ``keys`` whose owner changed; 0.0 for no keys (nothing moved)."""
    sample = list(keys)
    if not sample:
        return 0.0
    return len(diff(old, new, sample)) / len(sample)


def ownership(view: RingView, keys: Iterable[str]) -> dict[str, int]:
    """How many of ``keys`` each member owns, including members that own none.

    Zero counts are kept so a starved member shows up in a load-balance
    report instead of silently missing from it. Raises ``EmptyRingError`` if
    there are keys but no members to own them.
    """
    counts = dict.fromkeys(view.ids, 0)
    owner_id = view.owner_id
    for key in keys:
        counts[owner_id(key)] += 1
    return counts


def hash_share(view: RingView) -> dict[str, float]:
    """Each member's share of the hash space: the fraction of keys it owns.

    Exact from the arcs of the continuum (no sampling), for showing the ring
    to an operator; a member's arc ends at each of its points, and the first
    point also owns the wrap-around past the last one.
    """
    shares = dict.fromkeys(view.ids, 0.0)
    points, owners = view._points, view._owners
    previous = points[-1] - _SPACE if points else 0
    for point, owner in zip(points, owners, strict=False):
        shares[owner.id] += (point - previous) / _SPACE
        previous = point
    return shares
