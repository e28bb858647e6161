"""The space-saving sketch (node/topkeys.py) against an exact counter."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.rates import RateMeter
from node.topkeys import (
    Entry,
    SpaceSaving,
    TopKeys,
    is_near_limit,
    merge_disjoint,
    merge_windows,
    rank,
)

# Few distinct keys relative to the stream, with a skew: some keys are heavy.
keys = st.sampled_from([f"u{i}" for i in range(40)])
streams = st.lists(
    st.tuples(st.one_of(keys, st.sampled_from(["hot", "hot", "warm"])), st.integers(1, 5)),
    max_size=400,
)
capacities = st.integers(1, 24)


def check_bounds(sketch: SpaceSaving, exact: Counter[str]) -> None:
    total = sum(exact.values())
    assert sketch.total == total
    assert sum(sketch.counts.values()) == total  # counters always sum to the stream
    assert len(sketch.counts) <= sketch.capacity
    # The buckets index exactly the counters, and the tracked minimum is theirs.
    assert {k: c for c, b in sketch._buckets.items() for k in b} == sketch.counts
    assert all(sketch._buckets.values())
    if sketch.counts:
        assert sketch._min == min(sketch.counts.values())
    floor = sketch.floor
    assert floor * sketch.capacity <= total  # the floor is at most N / capacity
    for key, true in exact.items():
        if key in sketch.counts:
            count, error = sketch.counts[key], sketch.errors[key]
            assert count - error <= true <= count
            assert error <= floor
        else:
            assert true <= floor  # an unmonitored key occurred at most floor times
            assert true * sketch.capacity <= total


@given(streams, capacities)
def test_space_saving_error_bounds_hold(stream: list[tuple[str, int]], capacity: int) -> None:
    sketch = SpaceSaving(capacity)
    exact: Counter[str] = Counter()
    for key, weight in stream:
        sketch.add(key, weight)
        exact[key] += weight
    check_bounds(sketch, exact)
    # Every key above N / capacity is reported, and the top is ordered.
    total = sum(exact.values())
    top = sketch.top(capacity)
    for key, true in exact.items():
        if true * capacity > total:
            assert key in {e.key for e in top}
    assert [e.hits for e in top] == sorted((e.hits for e in top), reverse=True)


@given(st.lists(streams, min_size=1, max_size=3), capacities)
def test_merged_windows_keep_the_bounds(
    windows: list[list[tuple[str, int]]], capacity: int
) -> None:
    sketches = []
    exact: Counter[str] = Counter()
    for stream in windows:
        sketch = SpaceSaving(capacity)
        for key, weight in stream:
            sketch.add(key, weight)
            exact[key] += weight
        sketches.append(sketch)
    merged = {e.key: e for e in merge_windows(sketches)}
    floors = sum(s.floor for s in sketches)
    for key, true in exact.items():
        if key in merged:
            assert merged[key].hits - merged[key].error <= true <= merged[key].hits
        else:
            assert true <= floors


@given(st.lists(streams, min_size=1, max_size=4), capacities)
def test_disjoint_merge_is_exact_when_each_key_lives_on_one_node(
    nodes: list[list[tuple[str, int]]], capacity: int
) -> None:
    # Sticky routing: each key is decided by one node only.
    sketches = []
    exact: Counter[str] = Counter()
    for index, stream in enumerate(nodes):
        sketch = SpaceSaving(capacity)
        for key, weight in stream:
            sketch.add(f"{index}:{key}", weight)
            exact[f"{index}:{key}"] += weight
        sketches.append(sketch)
    merged = {e.key: e for e in merge_disjoint(s.entries() for s in sketches)}
    for key, true in exact.items():
        if key in merged:
            assert merged[key].hits - merged[key].error <= true <= merged[key].hits


def test_a_key_reported_by_two_nodes_during_a_handoff_is_summed() -> None:
    old_owner = [Entry("alice", 7, 0), Entry("bob", 2, 0)]
    new_owner = [Entry("alice", 3, 1)]
    merged = rank(merge_disjoint([old_owner, new_owner]), 10)
    assert merged == [Entry("alice", 10, 1), Entry("bob", 2, 0)]


def test_space_saving_keeps_the_heavy_hitter_among_many_one_off_keys() -> None:
    sketch = SpaceSaving(8)
    for i in range(10_000):
        sketch.add("hot" if i % 5 == 0 else f"once{i}")
    top = sketch.top(1)[0]
    assert top.key == "hot"
    assert top.hits - top.error <= 2000 <= top.hits
    assert sum(map(len, sketch._buckets.values())) == len(sketch.counts) == 8


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SpaceSaving(0)


def test_near_limit_is_ten_percent_or_less_remaining() -> None:
    assert is_near_limit(10, 100)
    assert not is_near_limit(11, 100)
    assert is_near_limit(0, 5)
    assert not is_near_limit(1, 5)  # 20 % left
    assert is_near_limit(1, 10)


def test_top_keys_rotate_and_forget_after_two_windows() -> None:
    top = TopKeys(capacity=4, window=60.0, now=0.0)
    for _ in range(3):
        top.record("api", "alice", denied=True)
    top.record("api", "bob", denied=False)
    assert top.top("api", "denied", 5) == [Entry("alice", 3, 0)]
    assert top.top("api", "near_limit", 5) == [Entry("bob", 1, 0)]
    assert not top.rotate(59.0)
    assert top.rotate(60.0)
    top.record("api", "alice", denied=True)
    # The previous window still counts.
    assert top.top("api", "denied", 5) == [Entry("alice", 4, 0)]
    assert top.rules() == ["api"]
    assert top.rotate(120.0)
    assert top.top("api", "denied", 5) == [Entry("alice", 1, 0)]
    # A long silence: both windows are old.
    assert top.rotate(1000.0)
    assert top.top("api", "denied", 5) == []
    assert top.rules() == []


def test_rate_meter_spans_its_window() -> None:
    meter = RateMeter(span=10.0, now=0.0, total=0.0)
    assert meter.rate(0.0, 0.0) == 0.0
    assert meter.rate(2.0, 100.0) == pytest.approx(50.0)
    for t in range(1, 31):
        meter.sample(float(t), t * 20.0)
    assert meter.rate(30.5, 610.0) == pytest.approx(20.0, rel=0.01)
    assert len(meter._samples) <= 12
    meter.sample(5.0, 700.0)  # the clock went back
    assert meter.rate(6.0, 710.0) == pytest.approx(10.0)
    assert meter.rate(7.0, 0.0) == 0.0  # a total that went back (a restart)
