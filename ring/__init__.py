"""Consistent-hash ring with versioned membership.

The bottom layer of ringlimit: it knows nothing about HTTP, nodes or the
router, only which member owns a key at a given epoch. See ``ring.view`` for
why the ring is ketama-compatible.
"""

from .analysis import KeyMove, diff, moved_fraction, ownership
from .errors import EmptyRingError
from .member import Member
from .owners import OwnerCache
from .view import RingView

__all__ = [
    "EmptyRingError",
    "KeyMove",
    "Member",
    "OwnerCache",
    "RingView",
    "diff",
    "moved_fraction",
    "ownership",
]
