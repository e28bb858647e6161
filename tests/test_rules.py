"""Rules: parsing what users write, and validating what a rule may be."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.rules import (
    ALGORITHMS,
    MAX_LIMIT,
    MAX_LOG_LIMIT,
    MAX_PERIOD,
    Rule,
    RuleError,
    normalize_algorithm,
    parse_period,
    parse_rate,
    parse_rule,
)

# --------------------------------------------------------------------------- parsing


@pytest.mark.parametrize(
    ("text", "limit", "period"),
    [
        ("100/minute", 100, 60.0),
        ("10/second", 10, 1.0),
        ("5/10s", 5, 10.0),
        ("1000 per hour", 1000, 3600.0),
        ("50000/day", 50000, 86400.0),
        ("7/500ms", 7, 0.5),
        ("3 / 5 minutes", 3, 300.0),
        ("2 PER Hour", 2, 3600.0),
        ("1/1.5s", 1, 1.5),
        (" 9/d ", 9, 86400.0),
    ],
)
def test_parse_rate(text: str, limit: int, period: float) -> None:
    assert parse_rate(text) == (limit, period)


@pytest.mark.parametrize(
    ("text", "name", "limit", "period"),
    [
        ("100/minute", "100-per-minute", 100, 60.0),
        ("10/second", "10-per-second", 10, 1.0),
        ("5/10s", "5-per-10s", 5, 10.0),
        ("1000 per hour", "1000-per-hour", 1000, 3600.0),
        ("50000/day", "50000-per-day", 50000, 86400.0),
        ("api=100/minute", "api", 100, 60.0),
        (" login = 5 per minute ", "login", 5, 60.0),
    ],
)
def test_parse_rule_names_and_values(text: str, name: str, limit: int, period: float) -> None:
    rule = parse_rule(text)
    assert (rule.name, rule.limit, rule.period) == (name, limit, period)
    assert rule.algorithm == "token_bucket"
    assert rule.burst == limit  # burst defaults to the limit
    assert rule.on_error == "open"


def test_parse_rule_options() -> None:
    rule = parse_rule("100/minute", algorithm="leaky-bucket", burst=20, on_error="closed")
    assert rule.algorithm == "gcra"
    assert rule.burst == rule.capacity == 20
    assert rule.on_error == "closed"
    assert parse_rule("100/minute", name="search").name == "search"


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("abc", "cannot read rate"),
        ("", "cannot read rate"),
        ("100", "cannot read rate"),
        ("100/", "cannot read rate"),
        ("/minute", "cannot read rate"),
        ("-5/minute", "cannot read rate"),
        ("1.5/minute", "cannot read rate"),
        ("0/minute", "count must be"),
        (f"{MAX_LIMIT + 1}/minute", "count must be"),
        ("100/fortnight", "unknown time unit 'fortnight'"),
        ("100/0s", "must be at least 1 ms"),
        ("100/0.0001s", "must be at least 1 ms"),
        ("100/367d", "at most 366 days"),
        ("100/s10", "cannot read period"),
    ],
)
def test_bad_rates_name_the_string_and_the_problem(text: str, problem: str) -> None:
    with pytest.raises(RuleError) as info:
        parse_rate(text)
    message = str(info.value)
    assert repr(text) in message, message
    assert problem in message, message
    # parse_rule goes through the same checks.
    with pytest.raises(RuleError, match=r"rate|period"):
        parse_rule(text)


@pytest.mark.parametrize("text", ["100/10 10s", "5/1 0 s", "5/1 0 minutes"])
def test_digits_split_by_spaces_are_rejected_not_glued(text: str) -> None:
    with pytest.raises(RuleError, match="cannot read period"):
        parse_rate(text)


def test_parse_rate_rejects_non_strings() -> None:
    with pytest.raises(RuleError, match="must be a string"):
        parse_rate(100)  # type: ignore[arg-type]


def test_parse_period() -> None:
    assert parse_period("minute") == 60.0
    assert parse_period("10s") == 10.0
    assert parse_period("5 minutes") == 300.0
    assert parse_period("250ms") == 0.25
    with pytest.raises(RuleError, match="'10 lightyears'"):
        parse_period("10 lightyears")


UNITS = {
    "ms": 0.001,
    "s": 1.0,
    "second": 1.0,
    "seconds": 1.0,
    "m": 60.0,
    "minute": 60.0,
    "min": 60.0,
    "h": 3600.0,
    "hour": 3600.0,
    "hours": 3600.0,
    "d": 86400.0,
    "day": 86400.0,
}


@given(
    limit=st.integers(1, MAX_LIMIT),
    count=st.one_of(st.none(), st.integers(1, 300)),
    unit=st.sampled_from(sorted(UNITS)),
    sep=st.sampled_from(["/", " / ", " per ", " PER "]),
)
def test_parse_rate_property(limit: int, count: int | None, unit: str, sep: str) -> None:
    period = (count or 1) * UNITS[unit]
    text = f"{limit}{sep}{count or ''}{unit}"
    if period > MAX_PERIOD:
        with pytest.raises(RuleError, match="366 days"):
            parse_rate(text)
    else:
        assert parse_rate(text) == (limit, period)


@pytest.mark.parametrize("text", ["5/1000000s", "5/1234567s", "5/0.001s", "5/0.0012345s"])
def test_valid_rates_get_a_valid_name_and_a_spec_that_parses_back(text: str) -> None:
    rule = parse_rule(text)
    assert parse_rate(rule.spec) == (rule.limit, rule.period)


def test_spec_round_trips_for_common_periods() -> None:
    for text in ["100/minute", "10/second", "5/10s", "1000/hour", "50000/day", "3/250ms"]:
        rule = parse_rule(text)
        assert parse_rate(rule.spec) == (rule.limit, rule.period), rule.spec


# --------------------------------------------------------------------------- validation


def test_rule_precomputes_capacity_rate_and_interval() -> None:
    bucket = Rule("b", 100, 60.0, "token_bucket", burst=10)
    assert bucket.capacity == 10
    assert bucket.rate == pytest.approx(100 / 60)
    assert bucket.interval == pytest.approx(0.6)
    window = Rule("w", 100, 60.0, "fixed_window", burst=10)
    assert window.capacity == 100  # windows ignore burst
    assert Rule("i", 5, 10).period == 10.0  # an int period becomes a float
    assert isinstance(Rule("i", 5, 10).period, float)


@pytest.mark.parametrize("alias", ["token-bucket", "TokenBucket", " token_bucket "])
def test_algorithm_aliases(alias: str) -> None:
    assert normalize_algorithm(alias) == "token_bucket"
    assert Rule("a", 1, 1.0, alias).algorithm == "token_bucket"


def test_every_algorithm_name_is_accepted() -> None:
    for name in ALGORITHMS:
        assert Rule("a", 1, 1.0, name).algorithm == name


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"limit": 0}, "limit must be 1.."),
        ({"limit": -1}, "limit must be 1.."),
        ({"limit": MAX_LIMIT + 1}, "limit must be 1.."),
        ({"limit": 2.5}, "limit must be an integer"),
        ({"limit": True}, "limit must be an integer"),
        ({"limit": "10"}, "limit must be an integer"),
        ({"period": 0}, "period must be from 1 ms"),
        ({"period": 1e-7}, "period must be from 1 ms"),
        ({"period": -1.0}, "period must be from 1 ms"),
        ({"period": math.inf}, "period must be from 1 ms"),
        ({"period": math.nan}, "period must be from 1 ms"),
        ({"period": MAX_PERIOD * 1.01}, "period must be from 1 ms"),
        ({"name": ""}, "must be 1-64 characters"),
        ({"name": "x" * 65}, "must be 1-64 characters"),
        ({"name": "has space"}, "may use only"),
        ({"name": "a/b"}, "may use only"),
        ({"algorithm": "magic"}, "unknown algorithm 'magic'"),
        ({"burst": -3}, "burst must be"),
        ({"burst": 1.5}, "burst must be"),
        # Falsy, but not the integer 0 that means "not set": taken for the limit before.
        ({"burst": ""}, "burst must be"),
        ({"burst": []}, "burst must be"),
        ({"burst": {}}, "burst must be"),
        ({"burst": 0.0}, "burst must be"),
        ({"burst": False}, "burst must be"),
        ({"crash_policy": ""}, "crash_policy must be"),
        ({"on_error": ""}, "on_error must be"),
        ({"lease": ""}, "lease must be"),
        ({"burst": MAX_LIMIT + 1}, "burst must be"),
        ({"on_error": "maybe"}, "on_error must be"),
        ({"crash_policy": "panic"}, "crash_policy must be"),
        (
            {"algorithm": "sliding_log", "limit": MAX_LOG_LIMIT + 1},
            "use sliding_window for larger limits",
        ),
    ],
)
def test_rule_validation(kwargs: dict[str, object], problem: str) -> None:
    base: dict[str, object] = {"name": "api", "limit": 10, "period": 60.0}
    base.update(kwargs)
    with pytest.raises(RuleError) as info:
        Rule(**base)  # type: ignore[arg-type]
    assert problem in str(info.value), str(info.value)


def test_an_unknown_field_name_utf8_cannot_carry_makes_an_error_that_can() -> None:
    with pytest.raises(RuleError) as info:
        Rule.from_dict({"name": "a", "limit": 1, "period": 1.0, "\ud800": 1})
    assert "'\\ud800'" in str(info.value)
    str(info.value).encode("utf-8")


def test_valid_edges() -> None:
    assert Rule("a", MAX_LIMIT, MAX_PERIOD).limit == MAX_LIMIT
    assert Rule("a", MAX_LOG_LIMIT, 1.0, "sliding_log").limit == MAX_LOG_LIMIT
    assert Rule("a.b:c-d_e", 1, 0.001).name == "a.b:c-d_e"
    assert Rule("a", 1, 1.0, crash_policy="replica").crash_policy == "replica"


def test_rules_are_immutable_and_hashable() -> None:
    rule = Rule("a", 1, 1.0)
    with pytest.raises(AttributeError):
        rule.limit = 2  # type: ignore[misc]
    assert rule == Rule("a", 1, 1.0)
    assert len({rule, Rule("a", 1, 1.0)}) == 1
    assert rule.with_(limit=2).limit == 2
    with pytest.raises(RuleError):
        rule.with_(limit=0)


@given(
    limit=st.integers(1, MAX_LIMIT),
    period=st.floats(0.001, MAX_PERIOD),
    algorithm=st.sampled_from(ALGORITHMS),
    burst=st.integers(0, 1000),
    on_error=st.sampled_from(["open", "closed"]),
    crash_policy=st.sampled_from([None, "reset", "conservative", "replica"]),
)
def test_to_dict_from_dict_round_trip(
    limit: int, period: float, algorithm: str, burst: int, on_error: str, crash_policy: str | None
) -> None:
    if algorithm == "sliding_log":
        limit = min(limit, MAX_LOG_LIMIT)
    rule = Rule("r", limit, period, algorithm, burst, on_error, crash_policy)
    again = Rule.from_dict(rule.to_dict())
    assert again == rule
    assert (again.capacity, again.rate, again.interval) == (rule.capacity, rule.rate, rule.interval)


def test_from_dict_errors() -> None:
    with pytest.raises(RuleError, match="must be an object"):
        Rule.from_dict(["a"])  # type: ignore[arg-type]
    with pytest.raises(RuleError, match=r"unknown rule field.*colour"):
        Rule.from_dict({"name": "a", "limit": 1, "period": 1, "colour": "red"})
    with pytest.raises(RuleError, match="missing field 'period'"):
        Rule.from_dict({"name": "a", "limit": 1})
    with pytest.raises(RuleError, match="limit must be an integer"):
        Rule.from_dict({"name": "a", "limit": "1", "period": 1})
