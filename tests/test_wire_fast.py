"""The decision API's fast paths give exactly what the plain paths give.

node/wire.py decodes a batch with msgspec (:func:`decode_checks`), lets a
router forward each check's own JSON text (:func:`raw_checks`,
:func:`forward_payload`) and formats results without ``json.dumps``
(:func:`node_batch_body`, which a router splits with :func:`split_results`).
Each is checked here against the path it shortcuts,
on many random bodies and verdicts, valid and not.
"""

from __future__ import annotations

import json
import math
import random
from typing import Any

import pytest

from node.config import ClusterConfig
from node.decision import Decision, Verdict, to_micros
from node.wire import (
    ApiError,
    _Plain,
    checks_payload,
    decode_checks,
    dumps,
    forward_payload,
    forwardable,
    node_batch_body,
    parse_checks,
    parse_json,
    raw_checks,
    result_dict,
    split_results,
)

CONFIGS = [
    ClusterConfig.from_dict(
        {
            "rules": [
                {"name": "bench", "rate": "1000/second"},
                {"name": "other", "rate": "5/minute", "paths": ["/x/*"]},
            ],
            "limits": {"max_key_length": 8, "max_batch": 5, "max_cost": 1000},
        }
    ),
    # No default rule: a check that names none is refused.
    ClusterConfig.from_dict({"rules": [{"name": "bench", "rate": "10/second", "paths": ["/a/*"]}]}),
]
KEYS = ["u1", "abc", "a" * 9, "a" * 8, "x y", "a]}b", "\\u0041", "é", "", "a,b", "\\ud800", "\x7f"]
RULES = ['"bench"', '"other"', '"nope"', "null", '""', "1"]
COSTS = ["0", "1", "5", "1000", "1001", "-1", "1.0", "true", "01", "99999999999999999999", "null"]


def _item(rng: random.Random) -> str:
    fields = []
    if rng.random() < 0.95:
        fields.append(f'"key"{rng.choice(["", " "])}:"{rng.choice(KEYS)}"')
    if rng.random() < 0.6:
        fields.append('"rule":' + rng.choice(RULES))
    if rng.random() < 0.4:
        fields.append('"cost":' + rng.choice(COSTS))
    if rng.random() < 0.1:
        fields.append('"rule":"bench"')
    if rng.random() < 0.05:
        fields.append('"x":1')
    if rng.random() < 0.5:
        rng.shuffle(fields)
    return "{" + rng.choice([",", ", ", " ,\n"]).join(fields) + "}"


def _body(rng: random.Random) -> bytes:
    if rng.random() < 0.1:
        return _item(rng).encode()  # a single check
    items = [_item(rng) for _ in range(rng.choice([0, 1, 2, 3, 5, 6]))]
    text = rng.choice(['{"checks":[', ' { "checks" : [ ']) + ",".join(items) + "]}"
    if rng.random() < 0.1:
        text = text[: rng.randrange(len(text) + 1)]
    if rng.random() < 0.05:
        text = text.replace('"checks"', '"checks":[],"checks"', 1)
    return text.encode()


def _outcome(body: bytes, config: ClusterConfig, fast: bool) -> Any:
    try:
        if fast:
            return decode_checks(body, config)
        return parse_checks(parse_json(body, config), config)
    except ApiError as exc:
        return (exc.status, exc.error, exc.detail)


def test_decode_checks_answers_as_the_json_path() -> None:
    rng = random.Random(15)
    accepted = 0
    for i in range(20_000):
        body = _body(rng)
        config = CONFIGS[i % 2]
        fast = _outcome(body, config, fast=True)
        assert fast == _outcome(body, config, fast=False), body
        if type(fast) is tuple and fast[1] is True:
            accepted += 1
            checks = fast[0]
            raw = forwardable(checks, body, config.default_rules)
            # (a body with no null anywhere spares looking for one in each check)
            assert raw == [
                None if c.rules is config.default_rules or b"null" in bytes(r) else r
                for c, r in zip(checks, raw_checks(body), strict=True)
            ]
            forwarded = forward_payload(checks, raw, range(len(checks)))
            # What a node makes of the forwarded text is what the router decided on.
            assert decode_checks(forwarded, config) == (checks, True)
            assert decode_checks(checks_payload(checks, range(len(checks))), config) == (
                checks,
                True,
            )
    assert accepted > 500


@pytest.mark.parametrize(
    "body",
    [
        b'{"checks":[{"key":"a","key":"b"}]}',
        b'{"checks":[{"key":"a","rule":"bench","rule":"other"}]}',
        b'{"checks":[{"key":"a","cost":1,"cost":2}]}',
        b'{"checks":[{"key":"u1"},{"key":"a","rule":"bench","key":"b"}]}',
        b'{"checks":[{"key":"a"}],"checks":[{"key":"b"}]}',
        rb'{"checks":[{"key":"a","k\u0065y":"b"}]}',
        b'{"key":"a","key":"b"}',
        b'{"key":"a","cost":1,"cost":1}',
        rb'{"key":"a","k\ud800":1,"k\ud800":2}',
    ],
)
def test_a_field_given_twice_is_refused_on_both_paths(body: bytes) -> None:
    """msgspec and ``json.loads`` both keep the last of a field given twice; a
    proxy in front may keep the first. The fast path counts the body's quotes
    to find it (node/wire.py ``_fast_structs``); the JSON path's decoder
    refuses it (node/strictjson.py)."""
    for config in CONFIGS[:1]:
        for fast in (True, False):
            status, error, detail = _outcome(body, config, fast=fast)
            assert (status, error) == (400, "invalid_request"), detail
            assert "is given twice in one object" in detail
            if b"ud800" in body:  # quoted once: its escape, not escaped again
                assert "the field 'k\\ud800' is given" in detail, detail


def test_a_forwarded_batch_carries_no_null_a_node_of_an_earlier_version_refuses() -> None:
    """A router passes a check that names its rule on as the client's own text.
    ``"cost": null`` is the field left out since this version; a node of the one
    before refused it (400 invalid_cost), and in a batch the router merged from
    several clients that 400 failed every other client's checks too."""
    config = CONFIGS[0]
    rule = config.rules[0].rule.name
    body = b'{"checks":[{"key":"a","rule":"%s","cost":null},{"key":"b","rule":"%s"}]}' % (
        rule.encode(),
        rule.encode(),
    )
    checks, _ = decode_checks(body, config)
    raw = forwardable(checks, body, config.default_rules)
    assert raw[0] is None and raw[1] is not None  # the other is passed on as sent
    forwarded = forward_payload(checks, raw, range(len(checks)))
    assert b"null" not in forwarded
    assert decode_checks(forwarded, config) == (checks, True)


@pytest.mark.parametrize(
    "body",
    [
        rb'{"checks":[{"key":"\ud800"}]}',
        b'{"checks":[{"key":"\xed\xa0\x80"}]}',
        b'{"checks":[{"key":"a","key":"b"}],"checks":[{"key":"c"}]}',
        rb'{"checks":[{"key":"\u00e9"}]}',
        b'{"checks":[{"key":"a","cost":18446744073709551617}]}',
        b'{"checks":[{"key":"a","rule":null}]}',
        b'{"checks":[{"key":"a"}]} x',
        b'{"checks":[{"key":"a","cost":1e0}]}',
        b'{"checks":null}',
        b'{"checks":[{"key":"a","rule":null,"cost":null}]}',
        b'{"checks":[{"key":"a","cost":null}],"key":null,"rule":null,"cost":null}',
        b'{"checks":[{"key":"a"}],"cost":null,"x":null}',
        b'{"checks":null,"key":"a","cost":null}',
        b'{"checks":[{"key":"a","checks":null}]}',
        b'{"key":null}',
        b"[]",
        b'{"checks":[' * 5000,
        b'\xef\xbb\xbf{"checks":[{"key":"a"}]}',
    ],
)
def test_decode_checks_edge_cases(body: bytes) -> None:
    config = CONFIGS[0]
    assert _outcome(body, config, fast=True) == _outcome(body, config, fast=False)


def test_a_batch_answer_says_what_result_dict_says() -> None:
    """Every result of a node's batch answer, split as a router splits it, is
    :func:`result_dict`'s JSON value: the common ones (which msgspec writes) and
    the rest (several rules, a reason), in order."""
    rng = random.Random(11)
    times = [0.0, -0.0, 1.0, 0.5, 1e-5, 0.00009999996, 0.0001, 123.4567895, 1e9, 1e10]
    times += [-1.0, 5e-7, 4.9e-7, 999999999.9999996, 1e300, 2.5e-6, 1.0000005]

    def pick() -> float:
        if rng.random() < 0.002:
            return math.inf
        return rng.choice([*times, rng.random() * 10 ** rng.randint(-8, 10), -rng.random()])

    def decision(allowed: bool) -> Decision:
        retry = None if allowed or rng.random() < 0.1 else pick()
        reset = pick()
        available = reset if rng.random() < 0.3 else pick()
        rule = rng.choice(["bench", 'a"b', "é", "\u2028"])
        reason = rng.choice([None] * 8 + ["store_full", "bypass"])
        limit, remaining = rng.randint(1, 1000), rng.randint(0, 1000)
        return Decision(allowed, limit, remaining, reset, retry, rule, reason, available)

    written = 0
    for _ in range(2_000):
        verdicts = []
        for _ in range(rng.randint(1, 30)):
            decisions = tuple(decision(rng.random() < 0.7) for _ in range(rng.choice([1, 1, 1, 2])))
            allowed = all(d.allowed for d in decisions)
            verdicts.append(Verdict(allowed, decisions[-1], decisions))
        try:
            want = [json.loads(dumps(result_dict(v, "n-é"))) for v in verdicts]
        except ValueError:  # a time that is not finite: JSON cannot say it
            with pytest.raises(ValueError):
                node_batch_body(verdicts, "n-é")
            continue
        body = node_batch_body(verdicts, "n-é")
        assert json.loads(body) == {"results": want}
        assert [json.loads(r) for r in split_results(body)] == want
        written += len(verdicts)
    assert written > 10_000


def test_a_plain_result_has_result_dicts_fields_in_its_order() -> None:
    """``_Plain`` is result_dict's shape for one plain verdict, written by
    msgspec: a field added to (or moved in) one and not the other fails here."""
    decision = Decision(False, 10, 0, 1.5, 0.25, "api", None, 0.25)
    verdict = Verdict(False, decision, (decision,))
    want = result_dict(verdict, "n1")
    (line,) = split_results(node_batch_body([verdict], "n1"))
    assert list(json.loads(line)) == list(want)
    assert list(json.loads(line)) == list(_Plain.__struct_fields__)


@pytest.mark.parametrize(
    ("seconds", "written"),
    [
        (0.0, 0.0),
        (-0.0, 0.0),
        (0.1234564, 0.123456),
        (0.1234566, 0.123457),
        (1e-7, 0.0),
        (7.5e-6, 8e-6),
        (86400.0000004, 86400.0),
        (math.inf, math.inf),
        (1e303, 1e303),
    ],
)
def test_times_are_written_to_the_microsecond(seconds: float, written: float) -> None:
    assert to_micros(seconds) == written
    assert math.isnan(to_micros(math.nan))
