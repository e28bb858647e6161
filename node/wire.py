"""The decision API on the wire: one check type, one parser, one encoder.

``POST /v1/check`` is spoken by clients to a router, by a router to the nodes
(a batch per node) and by router/envoy.py on behalf of Envoy. Everything that
shapes those bytes lives here, so the router and the node cannot drift apart:

* :class:`Check`, the one validated check (a plain tuple: the hot path builds
  thousands per batch);
* :func:`parse_json` and :func:`parse_checks`, which turn a body into checks
  or an :class:`ApiError` (a clear 4xx, never a 500; nothing is decided unless
  the whole request is valid);
* :func:`result_dict` and :func:`node_batch_body`, a node's answer per check;
* the batch framing: a node answers one result per line
  (:func:`node_batch_body`) so that a router can split and merge several
  nodes' answers without decoding them (:func:`split_results`,
  :func:`checks_payload`, :func:`forward_payload`, :func:`batch_body`);
* :func:`dumps`, the one JSON encoding of the API (as Starlette's
  ``JSONResponse`` writes it).

Pure: no I/O (node/bodies.py reads a request's body).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from json.encoder import encode_basestring as _jstr
from math import floor as _floor
from typing import Any, NamedTuple

import msgspec

from node.config import ClusterConfig
from node.decision import Verdict
from node.rules import Rule
from node.shadow import denied_names
from node.strictjson import GivenTwice, NumberTooLong, loads_unique
from ring.errors import encodable, given, names_text


class ApiError(Exception):
    """A refused request: its status and the JSON body ``{"error", "detail"}``."""

    def __init__(self, status: int, error: str, detail: str) -> None:
        # encodable: a detail quoting client text must not make its answer a 500.
        detail = encodable(detail)
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail

    def body(self) -> dict[str, str]:
        return {"error": self.error, "detail": self.detail}


class Check(NamedTuple):
    """A valid check: the key, the rules it is decided by, and its cost.

    A tuple, so it is what :meth:`node.authority.Authority.decide_many` takes
    as it is, and the fast parser can build it with ``tuple.__new__``.
    """

    key: str
    rules: tuple[Rule, ...]
    cost: int


#: ``Check(key, rules, cost)`` without NamedTuple's argument handling (the hot path).
_check = partial(tuple.__new__, Check)

#: One decision-API result: a node's, as the JSON bytes it sent, or the router's own.
Result = bytes | dict[str, Any]


#: ``json.dumps`` with non-default arguments builds an encoder per call.
_ENCODER = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def dumps(data: Any) -> str:
    """JSON as Starlette's JSONResponse encodes it (the API's one encoding)."""
    return _ENCODER.encode(data)


# ---------------------------------------------------------------------- parsing


def parse_json(body: bytes, config: ClusterConfig) -> Any:
    """The decoded body, or 413 (too large) / 400 (not JSON)."""
    if len(body) > config.limits.max_body:
        raise ApiError(
            413, "body_too_large", f"body is {len(body)} bytes; at most {config.limits.max_body}"
        )
    try:
        return loads_unique(body)
    except (GivenTwice, NumberTooLong) as exc:
        raise ApiError(400, "invalid_request", str(exc)) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    except RecursionError:
        # Deeply nested arrays/objects exhaust the decoder's stack: bad input, not a 500.
        raise ApiError(400, "invalid_json", "body is nested too deeply") from None


class _Item(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """One check of a batch, as msgspec decodes it. Not tracked by the garbage
    collector (``gc=False``: its fields are a str, a str or None and an int, which
    can form no cycle): a router decoding thousands per second otherwise triggers
    a collection every few batches."""

    key: str
    rule: str | None = None
    cost: int | None = None  # null or absent: 1 (see CHECK_FIELDS)


class _Batch(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    checks: list[_Item]


class _RawBatch(msgspec.Struct, gc=False):
    checks: list[msgspec.Raw]


_decode_batch = msgspec.json.Decoder(_Batch).decode
_decode_raw = msgspec.json.Decoder(_RawBatch).decode


def decode_checks(body: bytes, config: ClusterConfig) -> tuple[list[Check], bool]:
    """The checks a decision-API body asks for, and whether it was a batch.

    :func:`parse_json` then :func:`parse_checks`, with a fast path for the
    common body, a valid batch: msgspec decodes it and checks the types of
    every field in C (about 15x faster than ``json.loads`` and a Python
    loop). Any other body (a single check, or anything msgspec or the range
    checks refuse) goes through the JSON path, which decides and words the
    error, so the answers are the same.
    """
    if len(body) <= config.limits.max_body:
        try:
            items = _decode_batch(body).checks
        except (msgspec.MsgspecError, ValueError, RecursionError):
            pass  # not a plain batch: the JSON path says what is wrong
        else:
            if 0 < len(items) <= config.limits.max_batch:
                checks = _fast_structs(items, config, body)
                if checks is not None:
                    return checks, True
    return parse_checks(parse_json(body, config), config)


def raw_checks(body: bytes) -> list[msgspec.Raw]:
    """Each check of a batch body :func:`decode_checks` took, as its JSON text
    (a router forwards them as they came, without encoding them again)."""
    return _decode_raw(body).checks


def _fast_structs(items: list[_Item], config: ClusterConfig, body: bytes) -> list[Check] | None:
    """:func:`_fast_items` for decoded structs (whose fields have their types).

    msgspec keeps the last of a field given twice, without a word; so the
    body's quotes are counted against the strings the structs hold (each
    field's name, each key and rule): with no backslash in the body, a quote
    can only open or close a string, so equal counts mean no field was given
    twice. Anything else (an escape, a null given for a field) takes the
    JSON path, which finds a field given twice exactly. One count of one
    byte over the body: ~1% of what a batch costs a node.
    """
    rule_of = config.rule_map.get
    default = config.default_rules
    max_key = config.limits.max_key_length
    max_cost = config.limits.max_cost
    single: dict[str, tuple[Rule, ...]] = {}
    out: list[Check] = []
    append = out.append
    strings = 1 + 2 * len(items)  # "checks"; each "key" and its value
    for item in items:
        key = item.key
        cost = item.cost
        if cost is None:
            cost = 1
        else:
            strings += 1
        if not key or len(key) > max_key or not key.isascii() or not 0 <= cost <= max_cost:
            return None
        name = item.rule
        if name is None:
            if not default:
                return None
            rules = default
        else:
            strings += 2
            found = single.get(name)
            if found is None:
                rule = rule_of(name)
                if rule is None:
                    return None
                found = single[name] = (rule,)
            rules = found
        append(_check((key, rules, cost)))
    if body.count(b'"') != 2 * strings or b"\\" in body:
        return None
    return out


def parse_checks(data: Any, config: ClusterConfig) -> tuple[list[Check], bool]:
    """The checks a decision-API body asks for, and whether it was a batch.

    The common, valid body takes a fast path; anything unusual (an unknown
    field, a non-ASCII key, a missing rule, any invalid value) goes through
    the strict parser, which decides and words the error.
    """
    if type(data) is dict:
        items = data.get("checks")
        if items is None:
            if "checks" not in data:
                fast = _fast_items([data], config)
                if fast is not None:
                    return fast, False
        elif type(items) is list and len(data) == 1 and 0 < len(items) <= config.limits.max_batch:
            fast = _fast_items(items, config)
            if fast is not None:
                return fast, True
    return _parse_checks_strict(data, config)


def _fast_items(items: list[Any], config: ClusterConfig) -> list[Check] | None:
    """The checks of ``items`` when all are plainly valid, else None (no error words)."""
    rule_of = config.rule_map.get
    default = config.default_rules
    max_key = config.limits.max_key_length
    max_cost = config.limits.max_cost
    single: dict[str, tuple[Rule, ...]] = {}
    out: list[Check] = []
    append = out.append
    for item in items:
        if type(item) is not dict:
            return None
        key = item.get("key")
        if type(key) is not str or not key or len(key) > max_key or not key.isascii():
            return None
        cost = item.get("cost")
        if cost is None:
            cost = 1
        name = item.get("rule")
        if len(item) != 1 + ("cost" in item) + ("rule" in item):
            return None  # an unknown field
        if type(cost) is not int or not 0 <= cost <= max_cost:
            return None
        if name is None:
            if not default:
                return None
            rules = default
        else:
            if type(name) is not str:
                return None
            found = single.get(name)
            if found is None:
                rule = rule_of(name)
                if rule is None:
                    return None
                found = single[name] = (rule,)
            rules = found
        append(_check((key, rules, cost)))
    return out


#: The fields of a check. A null in any of them is the field left out, as is a
#: null ``checks`` at the top of a body: clients in many languages write an
#: absent optional as null (Jackson, System.Text.Json, Go's pointers without
#: ``omitempty``), and before, ``"rule": null`` was the default rules while
#: ``"cost": null`` was a 400. An unknown field is refused even when null: a
#: typo is still a typo.
CHECK_FIELDS = frozenset({"key", "rule", "cost"})


def _parse_checks_strict(data: Any, config: ClusterConfig) -> tuple[list[Check], bool]:
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object")
    if data.get("checks") is not None:
        extra = {
            f for f, v in data.items() if f != "checks" and (v is not None or f not in CHECK_FIELDS)
        }
        if extra:
            raise ApiError(400, "invalid_request", f"unknown field(s): {names_text(extra)}")
        items = data["checks"]
        if not isinstance(items, list):
            raise ApiError(400, "invalid_request", "'checks' must be an array")
        if not items:
            raise ApiError(400, "invalid_request", "'checks' is empty")
        if len(items) > config.limits.max_batch:
            raise ApiError(
                413,
                "batch_too_large",
                f"'checks' has {len(items)} items; at most {config.limits.max_batch}",
            )
        return [parse_check(item, config, f"checks[{i}]") for i, item in enumerate(items)], True
    if "checks" in data:  # null: a single check
        data = {f: v for f, v in data.items() if f != "checks"}
    return [parse_check(data, config, "body")], False


def parse_check(item: Any, config: ClusterConfig, where: str) -> Check:
    """One check object, or the :class:`ApiError` that says what is wrong at ``where``."""
    if not isinstance(item, dict):
        raise ApiError(400, "invalid_request", f"{where} must be an object")
    extra = set(item) - CHECK_FIELDS
    if extra:
        raise ApiError(400, "invalid_request", f"{where}: unknown field(s): {names_text(extra)}")
    key = item.get("key")
    if key is None:
        raise ApiError(400, "invalid_key", f"{where}.key is required (null or absent)")
    if not isinstance(key, str) or not key:
        raise ApiError(400, "invalid_key", f"{where}.key must be a non-empty string")
    if len(key) > config.limits.max_key_length:
        raise ApiError(
            400,
            "key_too_long",
            f"{where}.key is {len(key)} characters; at most {config.limits.max_key_length}",
        )
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        # A lone surrogate (JSON "\\ud800") cannot be hashed onto the ring.
        raise ApiError(
            400, "invalid_key", f"{where}.key is not valid Unicode (lone surrogate)"
        ) from None
    cost = item.get("cost")
    if cost is None:
        cost = 1
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise ApiError(400, "invalid_cost", f"{where}.cost must be an integer, got {given(cost)}")
    if not 0 <= cost <= config.limits.max_cost:
        raise ApiError(
            400,
            "invalid_cost",
            f"{where}.cost must be 0..{config.limits.max_cost}, got {given(cost)}",
        )
    name = item.get("rule")
    if name is None:
        rules = config.default_rules
        if not rules:
            raise ApiError(
                400, "no_rule", f"{where}: no rule named and no default (unscoped) rule configured"
            )
    else:
        if not isinstance(name, str):
            raise ApiError(400, "invalid_rule", f"{where}.rule must be a string")
        rule = config.rule(name)
        if rule is None:
            known = ", ".join(sorted(config.rule_map)) or "none"
            raise ApiError(
                404, "unknown_rule", f"{where}: no rule named {name[:64]!r} (known: {known})"
            )
        rules = (rule,)
    return Check(key, rules, cost)


def one_param(params: Mapping[str, str], name: str) -> str | None:
    """A query parameter's value; ApiError 400 ``invalid_<name>`` when it is given
    more than once (``?force=true&force=false`` was a graceful leave: Starlette's
    ``get`` takes the last, and another reader may take the first)."""
    getlist = getattr(params, "getlist", None)
    if getlist is not None and len(getlist(name)) > 1:
        raise ApiError(400, f"invalid_{name}", f"{name} is given more than once")
    return params.get(name)


def count_param(params: Mapping[str, str], name: str, default: int, high: int) -> int:
    """A count in a query string (``?n=20``): ASCII digits only, 1..``high``;
    ApiError 400 ``invalid_<name>`` otherwise.

    Not ``int()``, which also takes Unicode digits (``%D9%A1``, an Arabic-Indic
    one, was n=1), signs, spaces and underscores (``2_0``).
    """
    text = one_param(params, name)
    if text is None:
        return default
    if text.isascii() and text.isdigit() and len(text) <= len(str(high)):
        count = int(text)
        if 1 <= count <= high:
            return count
    raise ApiError(400, f"invalid_{name}", f"{name} must be an integer from 1 to {high}")


def flag_param(params: Mapping[str, str], name: str) -> bool:
    """A yes/no in a query string (``?force=true``): ``true``/``1`` or
    ``false``/``0``, absent is false; ApiError 400 ``invalid_<name>`` otherwise,
    so that ``?force=yes`` is not quietly a no."""
    text = one_param(params, name)
    if text is None or text in ("false", "0"):
        return False
    if text in ("true", "1"):
        return True
    raise ApiError(400, f"invalid_{name}", f"{name} must be true or false (or 1 or 0)")


# ---------------------------------------------------------------------- results


def result_dict(verdict: Verdict, node: str) -> dict[str, Any]:
    """A decision-API result: the deciding (most restrictive) rule's answer."""
    result = verdict.decision.to_dict()
    result["allowed"] = verdict.allowed
    result["node"] = node
    if len(verdict.decisions) > 1:
        result["decisions"] = [d.to_dict() for d in verdict.decisions]
    denied = denied_names(verdict)
    if denied:
        result["shadow_denied"] = denied
    return result


class _Plain(msgspec.Struct, gc=False):
    """The common result (one rule that decides alone, no reason): the fields of
    :func:`result_dict`, in its order, for msgspec to write."""

    allowed: bool
    limit: int
    remaining: int
    reset_after: float
    retry_after: float | None
    rule: str
    available_after: float
    node: str


_encode_result = msgspec.json.Encoder().encode


def node_batch_body(verdicts: Iterable[Verdict], node: str) -> bytes:
    """A node's batch answer: :func:`result_dict` of each verdict, one per line
    (:func:`lines_body`), the same JSON values in the same order.

    The batch hot path. The common result is a :class:`_Plain`, which msgspec
    writes in C with no dict built, its times rounded as :func:`to_micros`
    rounds them (inline: three calls per result cost more than the rounding).
    Any other result (several rules, a reason, a time that is not finite) is
    :func:`dumps` of :func:`result_dict`. Against the f-string formatter this
    replaced: 33,175 -> 30,749 instructions per decision of a node's batch
    (callgrind, ``benchmarks.batchpath``, 20 vs 220 batches); encoding the whole
    list at once saved 1,150 more on the node but cost the router 1,750 to
    split (msgspec, not lines), so results are encoded one by one.
    """
    items: list[bytes] = []
    append = items.append
    encode = _encode_result
    for verdict in verdicts:
        allowed, d, decisions = verdict
        d_allowed, limit, remaining, reset, retry, name, reason, available = d
        if not reason and d_allowed == allowed and len(decisions) == 1:
            try:
                append(
                    encode(
                        _Plain(
                            allowed,
                            limit,
                            remaining,
                            _floor(reset * 1e6 + 0.5) / 1e6,
                            None if retry is None else _floor(retry * 1e6 + 0.5) / 1e6,
                            name,
                            _floor(available * 1e6 + 0.5) / 1e6,
                            node,
                        )
                    )
                )
                continue
            except (OverflowError, ValueError):
                pass  # a time that is not finite: result_dict says it as it can
        append(dumps(result_dict(verdict, node)).encode())
    return lines_body(items)


def unreachable_result(
    check: Check, node_id: str, reason: str = "owner_unreachable"
) -> dict[str, Any]:
    """The router's own result for a check whose owner did not answer (refused
    the connection, or took longer than the forward timeout): the rules'
    ``on_error`` decides (any ``closed`` rule denies).

    Nothing is known of the count, so ``remaining`` is 0 whichever way it went:
    the least a client may count on. It was the whole limit when the rule failed
    open, which told a client (and Envoy, whose ``limit_remaining`` is this
    number) that it had its full quota while its owner was away; the proxy path
    sends no rate-limit fields at all on such an answer."""
    closed = any(r.on_error == "closed" for r in check.rules)
    rule = check.rules[0]
    return {
        "allowed": not closed,
        "limit": rule.limit,
        "remaining": 0,
        "reset_after": 0.0,
        "retry_after": None,
        "rule": rule.name,
        "available_after": 0.0,
        "node": node_id,
        "reason": reason,
    }


# ---------------------------------------------------------------------- batch framing

#: A node's batch answer: ``{"results":[`` NL result (NL ``,`` result)* NL ``]}``.
#: Still plain JSON; the lines let a router split it without decoding it.
RESULTS_HEAD = '{"results":[\n'
RESULTS_SEP = "\n,"
RESULTS_TAIL = "\n]}"
_LINES_HEAD = RESULTS_HEAD.encode()
_LINES_SEP = RESULTS_SEP.encode()
_LINES_TAIL = RESULTS_TAIL.encode()


def lines_body(results: Iterable[bytes]) -> bytes:
    """A node's batch answer of these encoded results, one per line."""
    return _LINES_HEAD + _LINES_SEP.join(results) + _LINES_TAIL


def split_results(body: bytes) -> list[Any]:
    """The results of a node's batch answer, undecoded (bytes) when it has one
    per line, decoded otherwise. ``ValueError`` (or ``KeyError``/``TypeError``)
    for a malformed answer."""
    if body.startswith(_LINES_HEAD):
        if not body.endswith(_LINES_TAIL):
            raise ValueError("truncated batch answer")
        return body[len(_LINES_HEAD) : -len(_LINES_TAIL)].split(_LINES_SEP)
    answered = json.loads(body)["results"]
    if not isinstance(answered, list):
        raise ValueError("results is not a list")
    return answered


def checks_payload(checks: Sequence[Check], indices: Iterable[int]) -> bytes:
    """The batch body a router sends a node for ``checks[i]`` of ``indices``, formatted
    directly: ``{"checks": [{"key", "cost", "rule" (when the check names one rule)}, ...]}``."""
    return ('{"checks":[' + ",".join([_check_text(checks[i]) for i in indices]) + "]}").encode()


def _check_text(check: Check) -> str:
    # Keys as UTF-8, not ASCII escapes: a key of 256 "é" is 512 bytes as a client
    # sends it and was 1,536 escaped, so a valid client batch (524 KB of them)
    # became a 1.5 MB body the node refused (413) for every check in it.
    rules = check.rules
    if len(rules) == 1:
        return (
            f'{{"key":{_jstr(check.key)},"cost":{int(check.cost)},"rule":{_jstr(rules[0].name)}}}'
        )
    return f'{{"key":{_jstr(check.key)},"cost":{int(check.cost)}}}'


def forward_payload(
    checks: Sequence[Check], raw: Sequence[msgspec.Raw | None], indices: Iterable[int]
) -> bytes:
    """:func:`checks_payload`, passing each check on as the client's own JSON text
    ``raw[i]`` (from :func:`raw_checks`) where there is one: nothing is encoded
    again. A check whose ``raw[i]`` is None is written out as :func:`checks_payload`
    does."""
    parts: list[bytes | msgspec.Raw] = []
    append = parts.append
    for i in indices:
        text = raw[i]
        append(_check_text(checks[i]).encode() if text is None else text)
    return b'{"checks":[' + b",".join(parts) + b"]}"


def forwardable(
    checks: Sequence[Check], body: bytes, default: tuple[Rule, ...]
) -> list[msgspec.Raw | None]:
    """For :func:`forward_payload`, the checks :func:`decode_checks` read from
    ``body``: the text of each that names its rule (:func:`raw_checks`); None for a
    check on the ``default`` rules, which a router sends naming the rule it chose
    (a node decides by the router's rules, as for every check), and for one with
    a ``null`` in it (or that may have one: a key that spells it), which is
    written out again from what the router read, without it: a node of an
    earlier version refuses a null ``cost``, and in a merged batch its 400 failed
    every other client's checks. A body with no ``null`` anywhere (the usual one)
    spares looking in each check's text: a copy of each, 18% of the router's
    instructions per batch of 100 (``python -m benchmarks.compare 46df2d1
    25637a9 --instructions -- batchroute``). ``msgspec`` errors as
    :func:`raw_checks`'s."""
    raw = raw_checks(body)
    if b"null" not in body:
        return [None if c.rules is default else r for c, r in zip(checks, raw, strict=True)]
    return [
        None if c.rules is default or b"null" in bytes(r) else r
        for c, r in zip(checks, raw, strict=True)
    ]


def batch_body(results: Iterable[Result]) -> bytes:
    """A router's batch answer: the nodes' results as they sent them, its own encoded."""
    if type(results) is list:
        try:
            return b'{"results":[' + b",".join(results) + b"]}"  # all the nodes' bytes
        except TypeError:
            pass  # some are the router's own (dicts): encode those
    return (
        b'{"results":['
        + b",".join(r if type(r) is bytes else dumps(r).encode() for r in results)
        + b"]}"
    )
