"""Ketama continuum construction and the per-key hash.

The continuum is built by ``uhashring.HashRing(hash_fn="ketama")`` so that
placement is uhashring's by construction, not by a reimplementation that
could drift. Lookups do not go through uhashring, though: its ``get_node``
costs about 1.2 us per call, about 0.7 us of it in a generic ``hashi``
(``str()``, an OpenSSL md5 context, per-byte shifts for any replica) and the
rest in attribute chasing. The view copies the finished points into flat
lists and does the same md5 + bisect itself.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from uhashring import HashRing

from .member import Member

try:
    # CPython's bundled MD5 has no per-call OpenSSL context setup, which for
    # keys this short makes it about twice as fast as hashlib's. The digest is
    # MD5 either way, so the fallback changes speed, never placement.
    from _md5 import md5 as _md5
except ImportError:  # pragma: no cover - CPython builds without the builtin
    import hashlib

    def _md5(data: bytes) -> Any:
        return hashlib.md5(data, usedforsecurity=False)


__all__ = ["REPLICAS", "VNODES", "build_continuum", "ketama_hash", "md5", "read_point"]

# libketama's constants: 40 md5 digests per (equal-weight) server, 4 points cut
# from each digest. Passed explicitly so a change of uhashring's defaults
# cannot move every key in the cluster.
VNODES = 40
REPLICAS = 4

md5: Callable[[bytes], Any] = _md5
#: Reads a continuum point from the first four digest bytes, little-endian,
#: which is what libketama's ``ketama_hashi`` does.
read_point: Callable[[bytes], tuple[int]] = struct.Struct("<I").unpack_from


def ketama_hash(key: str) -> int:
    """Where ``key`` lands on the continuum (same value as uhashring's ``hashi``)."""
    return read_point(md5(key.encode()).digest())[0]


def build_continuum(members: Sequence[Member]) -> tuple[list[int], list[Member]]:
    """Return ``(points, owners)``: sorted distinct points and who owns each.

    ``owners`` has one extra trailing entry, a copy of ``owners[0]``, so a key
    hashing past the last point wraps to the first without a branch on the
    hot path: ``owners[bisect_right(points, h)]`` is always in range.

    ``members`` must already be in canonical (id) order: uhashring resolves
    a collision between two members' points in favour of whichever it saw
    last, so the order is part of placement.
    """
    if not members:
        return [], []
    points, ids = _placement(tuple((m.id, m.weight) for m in members))
    by_id = {m.id: m for m in members}
    return points, [by_id[i] for i in ids]


@lru_cache(maxsize=16)
def _placement(members: tuple[tuple[str, int], ...]) -> tuple[list[int], tuple[str, ...]]:
    """The continuum of ``(id, weight)`` pairs: points and their owners' ids.

    Kept for the last few memberships: uhashring inserts each point in
    order, a cost that grows with the square of the points (~0.2 s for 256
    members), and the same membership comes back many times (every node
    parses each view a router pushes, the view before it, the views a
    crash was decided under, in every transfer). A member's url is not part
    of placement, so views that differ only in urls share one entry. The
    points list is shared: nothing may change it.
    """
    ring = HashRing(
        {member_id: {"weight": weight} for member_id, weight in members},
        hash_fn="ketama",
        vnodes=VNODES,
        replicas=REPLICAS,
    )
    points: list[int] = []
    owners: list[str] = []
    # get_points() repeats a point that two members both hashed to, each time
    # naming the surviving owner; keeping one copy gives the same bisect result.
    for point, node_id in ring.get_points():
        if points and points[-1] == point:
            continue
        points.append(point)
        owners.append(node_id)
    owners.append(owners[0])
    return points, tuple(owners)


def unplaced_problem(members: Sequence[tuple[str, int]], owners: Sequence[str]) -> str | None:
    """Why some of ``members`` own no point of the continuum (None if all do).

    Ketama gives each member ``floor(40 * N * weight / total_weight)`` digests,
    so a small weight next to large ones can round down to zero: such a
    member is listed in the view yet never receives traffic or replicas. A
    join or a start that would make one is a configuration error, refused
    (router/membership.py); a leave or a crash removal that makes one is
    carried out (a dead member cannot be kept for the sake of another's
    weight) and said.
    """
    placed = set(owners)
    idle = [(i, w) for i, w in members if i not in placed]
    if not idle:
        return None
    total = sum(weight for _, weight in members)
    names = ", ".join(f"{i!r} (weight {w})" for i, w in idle[:5])
    return (
        f"member(s) {names} get no point on the ketama continuum, so no keys: each member "
        f"gets floor({VNODES} * {len(members)} members * weight / total weight {total}) "
        "digests; raise their weight or lower the others"
    )
