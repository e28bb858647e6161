"""An immutable, versioned snapshot of ring membership.

Hashing mode: ketama (``uhashring.HashRing(hash_fn="ketama")``), not
uhashring's default.

The default mode hashes with the full 128-bit md5 integer and places
``160 * weight`` points named ``"<node>-<i>"``: a layout of uhashring's own,
so nothing outside Python/uhashring would agree with us on placement. The ketama mode
reproduces libketama: 40 * weight-share md5 digests per member named
``"<id>-<k>"``, four little-endian 32-bit points cut from each, and a key's
point is the first four bytes of ``md5(key)``, little-endian. A client that
reproduces libketama's continuum, given the same member ids as server names
and the same weights, therefore picks the same owner, so tooling outside
this codebase (in any language) can locate a user's limiter node. Note that
the member *id*, not the url, is the server name that gets hashed.

Known edges of that compatibility, none of which matter at our sizes:

* uhashring picks the first point strictly *after* the key's hash; libketama
  picks the first point *at or after* it. They disagree only when a key
  hashes exactly onto a point (chance ~ points / 2**32 per key, or a key
  spelt like a point name, e.g. ``"n1-0"``).
* uhashring computes each member's digest count with exact integer
  arithmetic, libketama with single-precision floats; they agree for every
  weighting of up to 4 members with weights 1..20, but e.g. libketama gives
  61 equal-weight members 39 digests each instead of 40.

A consequence of ketama's weighting for callers doing handoff: with
*equal* weights, adding or removing a member only moves keys to or from that
member; with *unequal* weights every member's digest count is recomputed from
its share of the total, so a membership change can also move keys between
members that did not change.
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from ._ketama import build_continuum, md5, read_point, unplaced_problem
from .errors import EmptyRingError, check_fields
from .member import Member

__all__ = ["CLUSTER_NAME", "MAX_EPOCH", "MAX_MEMBERS", "RingView", "check_cluster", "check_epoch"]

#: The largest epoch: what the wire formats carry (msgpack's signed 64-bit
#: integers among them). A view past it was applied, then every transfer
#: carrying its epoch failed to encode: the node was wedged at it for good.
MAX_EPOCH = 2**63 - 1


def check_epoch(epoch: object) -> int:
    """``epoch`` when it is an int in 0..:data:`MAX_EPOCH`: TypeError for another
    type, ValueError for a value out of range (every parser of an epoch uses
    this one check, so none lets through what another refuses)."""
    if isinstance(epoch, bool) or not isinstance(epoch, int):
        raise TypeError(f"epoch must be an int, got {type(epoch).__name__}")
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch must be >= 0 and < 2**63, got {epoch}"[:120])
    return epoch


#: A cluster's name (``--cluster``): the rings of one etcd are told apart by it,
#: in etcd's keys and in the pushes that carry them to nodes.
CLUSTER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


def check_cluster(name: object) -> str:
    """``name`` when it is a cluster's name (:data:`CLUSTER_NAME`); else ValueError."""
    if not isinstance(name, str) or not CLUSTER_NAME.match(name):
        raise ValueError(f"cluster name {name!r}: use [A-Za-z0-9._-], 1-64 characters"[:120])
    return name


#: The most members a ring holds. uhashring builds the continuum by sorted
#: insertion, so its cost grows with the square of the points (160 per
#: member): 256 members take ~0.2 s here, 2,500 took 22 s, and a node parsing
#: a view that large from a peer's body stalled long enough to be removed as
#: crashed. Far above any cluster of Python nodes one router tier serves.
MAX_MEMBERS = 256


def check_size(count: int) -> None:
    """ValueError if a ring of ``count`` members is over :data:`MAX_MEMBERS`."""
    if count > MAX_MEMBERS:
        raise ValueError(f"a ring holds at most {MAX_MEMBERS} members; this one has {count}")


_FIELDS = frozenset({"epoch", "nodes"})


@dataclass(frozen=True, slots=True)
class RingView:
    """Who owns which keys, at one epoch.

    A view is a value: every change returns a new view with ``epoch + 1``, so
    a router can swap its current view with one assignment while in-flight
    requests finish on the old one, and two processes can tell whether they
    agree by comparing ``(epoch, members)``. ``members`` is kept sorted by id
    so that equality, hashing and ``to_dict`` do not depend on the order in
    which nodes happened to join.
    """

    epoch: int = 0
    members: tuple[Member, ...] = ()
    _points: list[int] = field(init=False, repr=False, compare=False)
    _owners: list[Member] = field(init=False, repr=False, compare=False)
    _by_id: Mapping[str, Member] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_epoch(self.epoch)
        members = tuple(self.members)
        check_size(len(members))
        for m in members:
            if not isinstance(m, Member):
                raise TypeError(f"members must be Member instances, got {type(m).__name__}")
        members = tuple(sorted(members, key=attrgetter("id")))
        by_id: dict[str, Member] = {}
        for m in members:
            if m.id in by_id:
                raise ValueError(f"duplicate member id {m.id!r}")
            by_id[m.id] = m
        points, owners = build_continuum(members)
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "_points", points)
        object.__setattr__(self, "_owners", owners)
        object.__setattr__(self, "_by_id", by_id)

    def unplaced(self) -> str | None:
        """Why some member owns no point of the continuum, or None when all do
        (a weight too small next to the others': ring/_ketama.py)."""
        return unplaced_problem(
            [(m.id, m.weight) for m in self.members], [m.id for m in self._owners]
        )

    # -- construction -------------------------------------------------------

    @classmethod
    def empty(cls, epoch: int = 0) -> RingView:
        """A ring with no members; every lookup raises ``EmptyRingError``."""
        return cls(epoch=epoch)

    @classmethod
    def of(cls, members: Iterable[Member], epoch: int = 0) -> RingView:
        """A view of ``members`` in any order."""
        return cls(epoch=epoch, members=tuple(members))

    def with_member(self, member: Member) -> RingView:
        """Add ``member``, or replace the member with its id (e.g. new url or weight).

        Always bumps the epoch, even if ``member`` is already present
        unchanged: an epoch counts membership decisions, and peers compare
        epochs to know whether they have seen the latest one.
        """
        others = (m for m in self.members if m.id != member.id)
        return RingView(epoch=self.epoch + 1, members=(*others, member))

    def without_member(self, member_id: str) -> RingView:
        """Remove the member with ``member_id``; ``KeyError`` if there is none.

        Removing an absent member is refused rather than ignored because it
        usually means two controllers disagree about membership.
        """
        if member_id not in self._by_id:
            raise KeyError(f"no member {member_id!r} in ring at epoch {self.epoch}")
        others = tuple(m for m in self.members if m.id != member_id)
        return RingView(epoch=self.epoch + 1, members=others)

    # -- lookups ------------------------------------------------------------

    def owner(self, key: str) -> Member:
        """The member that owns ``key``.

        Router hot path. Measured with timeit (CPython 3.11, 1,000 distinct
        keys): ~0.43 us per call with 3 members, ~0.6 us with 100, against
        ~1.2-1.4 us for ``HashRing.get_node`` on the same rings. The hash is
        inlined (no ``ketama_hash`` call) and the wrap-around is a sentinel
        entry in ``_owners``, so a lookup is one md5, one bisect and one
        index; an empty ring is the only way to reach the IndexError.
        """
        try:
            return self._owners[
                bisect_right(self._points, read_point(md5(key.encode()).digest())[0])
            ]
        except IndexError:
            # The key is a user id: keep it out of the message (and the logs).
            raise EmptyRingError(
                f"cannot place a key: ring at epoch {self.epoch} is empty"
            ) from None

    def owner_id(self, key: str) -> str:
        """The id of the member that owns ``key``."""
        return self.owner(key).id

    def successors(self, key: str, n: int) -> list[Member]:
        """The first ``n`` distinct members clockwise from ``key``, owner first.

        This is the replica set: the same walk uhashring's ``range()`` does,
        so replicas land where any ketama client would look for them. Fewer
        than ``n`` come back when the ring has fewer members.
        """
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        if n == 0:
            return []
        points = self._points
        if not points:
            raise EmptyRingError(f"cannot place a key: ring at epoch {self.epoch} is empty")
        want = min(n, len(self.members))
        owners = self._owners
        count = len(points)
        start = bisect_right(points, read_point(md5(key.encode()).digest())[0])
        found: list[Member] = []
        seen: set[str] = set()
        for step in range(count):
            m = owners[(start + step) % count]
            if m.id not in seen:
                seen.add(m.id)
                found.append(m)
                if len(found) == want:
                    break
        return found

    def member(self, member_id: str) -> Member:
        """The member with ``member_id``; ``KeyError`` if absent."""
        try:
            return self._by_id[member_id]
        except KeyError:
            raise KeyError(f"no member {member_id!r} in ring at epoch {self.epoch}") from None

    @property
    def ids(self) -> tuple[str, ...]:
        """Member ids, sorted."""
        return tuple(self._by_id)

    def __contains__(self, member_id: object) -> bool:
        # Only ids are accepted: ``Member(...) in view`` would otherwise be a
        # silent False, and comparing whole members is what ``member()`` is for.
        if not isinstance(member_id, str):
            raise TypeError(
                f"'in <RingView>' requires a member id (str), got {type(member_id).__name__}"
            )
        return member_id in self._by_id

    def __len__(self) -> int:
        return len(self.members)

    def __iter__(self) -> Iterator[Member]:
        return iter(self.members)

    # -- serialisation ------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``{"epoch": int, "nodes": [member dicts sorted by id]}``."""
        return {"epoch": self.epoch, "nodes": [m.to_dict() for m in self.members]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RingView:
        """Parse untrusted input; any problem is a ``ValueError`` that names it.

        Unknown keys are rejected rather than ignored: a view read from a peer
        or a file decides where every key goes, so a payload we do not fully
        understand is safer refused than half-applied.
        """
        check_fields(data, "ring", _FIELDS, ("epoch", "nodes"))
        nodes = data["nodes"]
        if not isinstance(nodes, list | tuple):
            raise ValueError(f"ring field 'nodes' must be a list, got {type(nodes).__name__}")
        check_size(len(nodes))  # before a member is parsed
        members = []
        for index, node in enumerate(nodes):
            try:
                members.append(Member.from_dict(node))
            except ValueError as exc:
                raise ValueError(f"ring field 'nodes[{index}]': {exc}") from exc
        try:
            return cls(epoch=data["epoch"], members=tuple(members))
        except TypeError as exc:
            raise ValueError(f"ring field 'epoch': {exc}") from exc
        except ValueError as exc:
            raise ValueError(f"ring is invalid: {exc}") from exc
