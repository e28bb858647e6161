"""Validation of transferred states (node/store.py ``check_records``), by property.

A record that passes the check must be a state the engine can decide on, evict,
export again and send as JSON; every record a real store exports must pass.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from node.algorithms import REGISTRY
from node.peers import MSGPACK, decode, decode_records, encode
from node.rules import MAX_NAME, Rule
from node.store import MemoryStore, check_records

ALGORITHMS = sorted(REGISTRY)
RULES = {a: Rule(a, 5, 60.0, algorithm=a) for a in ALGORITHMS}

#: JSON values, biased towards the shapes states have (numbers and short lists).
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, 1, -1, 0.0, 5, 1e308, -1e308, 1e17, True, False]),
)
scalars = st.one_of(numbers, st.none(), st.text(max_size=5))
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=3), inner, max_size=2)
    ),
    max_leaves=8,
)
relative_states = st.one_of(st.lists(numbers, max_size=4), json_values)
keys = st.one_of(st.text(max_size=6), st.integers(), st.none())


@settings(max_examples=400, deadline=None)
@given(
    algorithm=st.sampled_from([*ALGORITHMS, "nope"]),
    key=keys,
    relative=relative_states,
    now=st.floats(0, 2e9),
)
def test_a_record_that_passes_can_always_be_decided(
    algorithm: str, key: Any, relative: Any, now: float
) -> None:
    record = [algorithm if algorithm in RULES else "token_bucket", algorithm, key, relative]
    try:
        check_records([record])
    except ValueError as exc:
        assert str(exc).startswith("record 0:")
        return
    rule = RULES[algorithm]
    store = MemoryStore()
    assert store.import_([record], now, {rule.name: rule}) == 1
    for later in (now, now + 0.5, now + 1e6):
        verdict = store.check(key, [rule], later, 0)
        d = verdict.decision
        assert math.isfinite(d.reset_after) and isinstance(d.remaining, int)
        assert d.retry_after is None or math.isfinite(d.retry_after)
        store.check(key, [rule], later, 1)
        assert isinstance(REGISTRY[algorithm].fresh_at(store.get(rule, key), rule), float | int)
        exported = store.export(later)
        json.dumps(exported, allow_nan=False).encode()
        check_records(json.loads(json.dumps(exported)))


@settings(max_examples=100, deadline=None)
@given(
    algorithm=st.sampled_from(ALGORITHMS),
    costs=st.lists(st.tuples(st.integers(0, 3), st.floats(0, 200)), min_size=1, max_size=12),
    start=st.floats(0, 2e9),
)
def test_every_exported_state_passes(
    algorithm: str, costs: list[tuple[int, float]], start: float
) -> None:
    rule = RULES[algorithm]
    store = MemoryStore()
    now = start
    for cost, step in costs:
        now += step
        store.check("k", [rule], now, cost)
        records = json.loads(json.dumps(store.export(now)))
        assert check_records(records) == records


@pytest.mark.parametrize(
    ("records", "match"),
    [
        ({}, "records must be a list"),
        ([["a", "token_bucket", "k", [0.0, 0.0]], 5], "record 1: must be a list"),
        ([["a", "token_bucket", "k", [math.inf, 0.0]]], "record 0: tokens"),
        ([["a", "gcra", "k", [math.nan]]], "record 0: tat must be a finite"),
        ([["a", "token_bucket", "k", [1.0, 1e9]]], "updated_at .* at most 3600 ahead"),
        ([["a", "fixed_window", "k", [0.0, 1.5]]], "count must be an integer"),
        ([["a", "sliding_window", "k", [0.0, 1]]], "must be a list"),
        ([["a", "sliding_log", "k", [0.0] * 100_001]], "at most 100000"),
        ([["a", "token_bucket", 7, [0.0, 0.0]]], "key must be a string"),
        ([["a", "token_bucket", "x" * 300, [0.0, 0.0]]], "key must be a string of 1..256"),
        ([["a", "token_bucket", "\ud800", [0.0, 0.0]]], "surrogates"),
        ([["", "token_bucket", "k", [0.0, 0.0]]], "rule name"),
        ([["a", "magic", "k", [0.0, 0.0]]], "unknown algorithm"),
    ],
)
def test_bad_records_are_named(records: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_records(records, max_key_length=256)


#: Record-like values near every boundary the typed decoder checks.
names = st.one_of(st.sampled_from(["a", "", "n" * MAX_NAME, "n" * (MAX_NAME + 1)]), st.text())
VALID_STATES = {
    "token_bucket": [1.5, -1.0],
    "gcra": [0.5],
    "fixed_window": [-1.0, 3],
    "sliding_log": [-0.5, -0.2],
    "sliding_window": [-1.0, 2, 1],
}
#: Mostly valid records, each with at most a field or two off (a key one
#: character too long, a name of 65, an unknown algorithm, a bad state).
valid_ish = st.builds(
    lambda name, algorithm, key, state: [name, algorithm, key, state],
    names | st.just("a"),
    st.sampled_from(ALGORITHMS),
    st.text(min_size=0, max_size=10) | st.text(min_size=7, max_size=9) | st.integers(),
    st.sampled_from(list(VALID_STATES.values())) | relative_states,
)
records_like = st.one_of(
    valid_ish,
    st.tuples(
        names,
        st.sampled_from([*ALGORITHMS, "nope"]) | st.integers(),
        st.one_of(st.text(max_size=10), st.integers(), st.none()),
        relative_states,
    ).map(list),
    json_values,
)


@settings(max_examples=400, deadline=None)
@given(
    records=st.lists(records_like, max_size=4) | json_values,
    extra=st.sampled_from([{}, {"final": True}, {"to": "n2"}, {"v": 2}]),
)
@example(records=[["n" * (MAX_NAME + 1), "gcra", "k", [0.5]]], extra={})
@example(records=[["a", "gcra", "k" * 9, [0.5]]], extra={})
@example(records=[["a", "gcra", "k" * 8, [0.5]], ["n" * MAX_NAME, "gcra", "k", [0.5]]], extra={})
@example(records=[["a", "gcra", "k", [0.5]]], extra={"to": "n2"})
def test_a_msgpack_body_is_read_as_decode_and_check_records_read_it(
    records: Any, extra: dict[str, Any]
) -> None:
    """decode_records (typed msgspec decoding, then the per-algorithm checks)
    refuses exactly what decode + check_records refuse, with the same words,
    and gives the same body when it accepts (its records as tuples when typed),
    every field included."""
    try:
        body = encode({"from": "A", "epoch": 2, "records": records, **extra})
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError):
        return  # not a msgpack value (an int beyond 64 bits, a lone surrogate)
    try:
        expected: Any = decode(body, MSGPACK)
        expected["records"] = check_records(expected["records"], max_key_length=8)
    except ValueError as exc:  # WireError too
        expected = (type(exc), str(exc))
    try:
        data = decode_records(body, MSGPACK, 8)
    except ValueError as exc:
        assert (type(exc), str(exc)) == expected
        return
    assert [tuple(r) for r in data["records"]] == [tuple(r) for r in records]
    assert {**data, "records": [list(r) for r in data["records"]]} == expected
