"""Validation of the decision API's input: clear 4xx errors, never a 500.

Every rejection is an :class:`ApiError` that becomes a JSON body saying what
was wrong; nothing is decided (and no state touched) unless the whole request
is valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from node.config import ClusterConfig
from node.rules import Rule


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail

    def body(self) -> dict[str, str]:
        return {"error": self.error, "detail": self.detail}


@dataclass(frozen=True, slots=True)
class CheckRequest:
    key: str
    rules: tuple[Rule, ...]
    cost: int


def parse_json(body: bytes, config: ClusterConfig) -> Any:
    if len(body) > config.limits.max_body:
        raise ApiError(
            413, "body_too_large", f"body is {len(body)} bytes; at most {config.limits.max_body}"
        )
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"body is not valid JSON: {exc}") from None
    except RecursionError:
        # Deeply nested arrays/objects exhaust the decoder's stack: bad input, not a 500.
        raise ApiError(400, "invalid_json", "body is nested too deeply") from None


def parse_checks(data: Any, config: ClusterConfig) -> tuple[list[CheckRequest], bool]:
    """The checks a decision-API body asks for, and whether it was a batch."""
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "body must be a JSON object")
    if "checks" in data:
        extra = set(data) - {"checks"}
        if extra:
            raise ApiError(400, "invalid_request", f"unknown field(s): {', '.join(sorted(extra))}")
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
    return [parse_check(data, config, "body")], False


def parse_check(item: Any, config: ClusterConfig, where: str) -> CheckRequest:
    if not isinstance(item, dict):
        raise ApiError(400, "invalid_request", f"{where} must be an object")
    extra = set(item) - {"key", "rule", "cost"}
    if extra:
        raise ApiError(
            400, "invalid_request", f"{where}: unknown field(s): {', '.join(sorted(extra))}"
        )
    key = item.get("key")
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
    cost = item.get("cost", 1)
    if isinstance(cost, bool) or not isinstance(cost, int):
        raise ApiError(400, "invalid_cost", f"{where}.cost must be an integer, got {cost!r}")
    if not 0 <= cost <= config.limits.max_cost:
        raise ApiError(
            400, "invalid_cost", f"{where}.cost must be 0..{config.limits.max_cost}, got {cost}"
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
    return CheckRequest(key, rules, cost)
