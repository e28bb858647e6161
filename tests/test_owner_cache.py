"""The owner cache (ring/owners.py) and its two users: node fencing and router picks.

Whatever the cache holds, every answer must be the uncached one under the view
asked about: views change on join, leave, crash and restart, a driver may
assign a view directly (an empty one at epoch 0, say), and two different
views may share an epoch. The property drives a :class:`ShardCore` through
random sequences of all of these with a cache small enough to be cleared
often, and compares each fencing answer with ``view.owner_id``.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from node.config import ClusterConfig
from node.shardcore import OWNER_CACHE, NotOwner, ShardCore
from node.store import MemoryStore
from ring import EmptyRingError, Member, OwnerCache, RingView
from router.app import Router, RouterSettings

IDS = ["n0", "n1", "n2", "n3"]
KEYS = [f"user-{i}" for i in range(30)]
CONFIG = ClusterConfig()


def view(ids: list[str], epoch: int, port: int = 8000) -> RingView:
    return RingView.of([Member(i, f"http://{i}:{port}") for i in ids], epoch=epoch)


def core(node_id: str = "n0") -> ShardCore:
    return ShardCore(node_id, MemoryStore(), lambda: CONFIG)


def fencing(c: ShardCore, key: str) -> tuple[int, str | None] | None:
    """What ``check_owner`` answered: None (decide it) or NotOwner's (epoch, owner)."""
    try:
        c.check_owner(key)
    except NotOwner as exc:
        return (exc.epoch, exc.owner)
    return None


def uncached(c: ShardCore, key: str) -> tuple[int, str | None] | None:
    """The same answer straight from the ring, as check_owner gave it before the cache."""
    v = c.view
    if v is None:
        return None
    if not len(v):
        return (v.epoch, None)
    owner = v.owner_id(key)
    return None if owner == c.id else (v.epoch, owner)


# --------------------------------------------------------------------------- the helper


def test_the_cache_answers_as_the_view_does_and_follows_each_new_view() -> None:
    cache = OwnerCache(100)  # every key stays remembered across the views
    for v in (view(IDS, 1), view(IDS[:2], 2), view(IDS[1:], 3), view(IDS, 4)):
        for key in KEYS:
            assert cache.owner(v, key) == v.owner(key)
            assert cache.owner(v, key) == v.owner(key)  # the remembered answer too


def test_a_different_view_under_the_same_epoch_is_a_new_view() -> None:
    """Keyed on the view object, not the epoch: a view re-made with other members
    (a restarted router's, a test's) must not be answered from the old one."""
    cache = OwnerCache(100)
    a, b = view(["n0", "n1"], 5), view(["n2", "n3"], 5)
    for key in KEYS:
        cache.owner(a, key)
    assert [cache.owner(b, key).id for key in KEYS] == [b.owner_id(key) for key in KEYS]
    assert set(cache.known(b)) == set(KEYS)
    assert cache.known(a) == {}  # back to a: starts over, nothing of b's answers


def test_an_empty_view_raises_and_remembers_nothing() -> None:
    cache = OwnerCache(4)
    empty = RingView.empty(3)
    with pytest.raises(EmptyRingError):
        cache.owner(empty, "user-1")
    assert cache.known(empty) == {}
    with pytest.raises(ValueError):
        OwnerCache(0)


def test_a_full_cache_starts_over_in_the_same_map() -> None:
    """Cleared in place: a batch holding ``known(view).get`` keeps reading the live map."""
    cache = OwnerCache(5)
    v = view(IDS, 1)
    known = cache.known(v)
    for key in KEYS:
        cache.owner(v, key)
        assert len(cache) <= 5
    assert cache.known(v) is known and known
    assert all(known[k] == v.owner(k) for k in known)


def test_the_node_cache_is_small() -> None:
    """~0.8 MB at most: under 1 byte per key of a node holding a million keys."""
    assert OWNER_CACHE <= 8_192


# --------------------------------------------------------------------------- fencing

member_sets = st.lists(st.sampled_from(IDS), max_size=4, unique=True)
steps = st.lists(
    st.one_of(
        st.tuples(st.just("join"), st.sampled_from(IDS)),
        st.tuples(st.just("leave"), st.sampled_from(IDS)),
        st.tuples(st.just("crash"), st.sampled_from(IDS)),
        # A driver sets the view itself (node/app.py: an empty view at epoch 0).
        st.tuples(st.just("assign"), member_sets),
        # Another view under the epoch held (other members, or the same ones re-made).
        st.tuples(st.just("same_epoch"), member_sets),
        st.tuples(st.just("restart"), st.just(None)),
        st.tuples(st.just("check"), st.lists(st.sampled_from(KEYS), min_size=1, max_size=8)),
    ),
    min_size=5,
    max_size=60,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(limit=st.integers(1, 12), first=member_sets, script=steps)
def test_fencing_with_the_cache_answers_as_without_it_across_view_changes(
    limit: int, first: list[str], script: list[tuple[str, object]]
) -> None:
    c = core()
    c.owners = OwnerCache(limit)  # small: cleared often, as under a million keys
    current = view(first, 1)
    c.apply(current, None, (), 0.0, 0.0)
    for kind, arg in script:
        members = list(current.ids)
        if kind == "join" and isinstance(arg, str):
            current = current.with_member(Member(arg, f"http://{arg}:8000"))
            c.apply(current, None, (), 0.0, 0.0)
        elif kind in ("leave", "crash") and isinstance(arg, str) and arg in members:
            current = current.without_member(arg)
            c.apply(current, None, (arg,) if kind == "crash" else (), 0.0, 0.0)
        elif kind == "assign" and isinstance(arg, list):
            current = view(arg, current.epoch + 1)
            c.view = current
        elif kind == "same_epoch" and isinstance(arg, list):
            current = view(arg, current.epoch, port=8001)
            c.view = current
        elif kind == "restart":
            # The process comes back empty; the router pushes it the view it holds.
            c = core()
            c.owners = OwnerCache(limit)
            c.apply(current, None, (), 0.0, 0.0)
        elif kind == "check" and isinstance(arg, list):
            for key in arg:
                assert fencing(c, key) == uncached(c, key), (kind, key, c.view)
        for key in KEYS[:6]:
            assert fencing(c, key) == uncached(c, key), (kind, key, c.view)


def test_fencing_follows_a_view_that_moves_a_remembered_key_away() -> None:
    """The plain case the property generalises: a key this node decided moves to a
    joining member; the very next check refuses it, naming the new owner."""
    c = core("n0")
    before = view(["n0"], 1)
    c.apply(before, None, (), 0.0, 0.0)
    for key in KEYS:
        c.check_owner(key)  # all ours, all remembered
    after = before.with_member(Member("n1", "http://n1:8000"))
    moved = [k for k in KEYS if after.owner_id(k) == "n1"]
    assert moved
    c.apply(after, before, (), 0.0, 0.0)
    for key in moved:
        assert fencing(c, key) == (2, "n1")
    c.view = RingView.empty()
    assert all(fencing(c, key) == (0, None) for key in KEYS)


# --------------------------------------------------------------------------- router


def test_router_picks_are_the_owners_under_each_view() -> None:
    router = Router(RouterSettings())
    views = [view(IDS, 1), view(IDS[:1], 2), view(IDS[2:], 3), view(IDS[:3], 3, port=8001)]
    for v in views:
        known = router.owner_map(v)
        for key in KEYS:
            assert router.pick(v, key) == v.owner(key)
        assert known == {key: v.owner(key) for key in KEYS}
