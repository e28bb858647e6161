"""Envoy's rate limit service (``envoy.service.ratelimit.v3.RateLimitService``) on the router.

Gateways that ask an external service over gRPC (Envoy, Envoy Gateway, Istio,
Contour, Emissary, Gloo) call ``ShouldRateLimit`` with a domain and a list of
descriptors. Each descriptor is matched against the ``--envoy-config`` of its
domain (router/envoy_config.py); its key is the domain plus its entries, and
it is decided by the key's owner through the decision API's own path
(:meth:`router.decisions.DecisionAPI.route_single`: coalesced, epoch-fenced, retried on
a ring change), so a descriptor and a ``POST /v1/check`` can never disagree.

Several descriptors in one request: nothing is consumed unless every enforced
descriptor has room. With one distinct key the node decides it atomically; with
several (they may live on several nodes) the router first reads each one's
remaining quota (a check of cost 0), answers OVER_LIMIT without consuming if
one lacks room, and only then consumes them all. See docs/envoy.md for what a
race between those two steps can cost (never over-admission).

Failures: an unreachable owner applies the rule's ``on_error`` (open: OK,
closed: OVER_LIMIT), as for HTTP. When no decision can be made at all (no
nodes, the ring kept changing, a node timed out or answered garbage) the call
fails with UNAVAILABLE, so the gateway's ``failure_mode_deny`` decides.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from node.headers import whole_seconds
from node.rules import Rule
from node.security import bearer, token_matches
from node.wire import Check
from router.envoy_config import UNIT_ENUM, EnvoyConfig, Limit

if TYPE_CHECKING:
    from router.app import Router

log = logging.getLogger("ringlimit.envoy")

OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
UINT32_MAX = 2**32 - 1
#: Which response headers to add: the IETF draft's fields, envoy's x-ratelimit-*.
HEADER_SETS = ("draft", "envoy")


class Unavailable(Exception):
    """No decision could be made: the gateway's failure mode should decide."""


class Invalid(Exception):
    """The request asks for something this service refuses (INVALID_ARGUMENT)."""


def descriptor_key(domain: str, entries: Sequence[tuple[str, str]], max_length: int) -> str:
    """The key a descriptor is counted under: its domain and entries, unambiguous.

    ``edge/remote_address=10.0.0.1/path=%2Flogin``: every part percent-encoded,
    so no two descriptors share a key. Longer than the cluster's key limit, it
    becomes the domain and a SHA-256 of the full key (still one key per descriptor).
    """
    key = "/".join(
        [quote(domain, safe=""), *(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in entries)]
    )
    if len(key) > max_length:
        key = f"{quote(domain, safe='')[:64]}/#{hashlib.sha256(key.encode()).hexdigest()}"
    return key


@dataclass
class _Item:
    """One decision of a call: a rule on a key (repeated descriptors add up)."""

    rule: Rule
    key: str
    cost: int
    result: dict[str, Any] | None = None


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):
    def __init__(
        self,
        router: Router,
        envoy: EnvoyConfig,
        *,
        headers: Sequence[str] = (),
        api_token: str | None = None,
    ) -> None:
        self.router = router
        self.envoy = envoy
        self.headers = frozenset(headers)
        self.api_token = api_token

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest, context: grpc.aio.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        if self.api_token is not None:
            given = dict(context.invocation_metadata() or ()).get("authorization")
            if not token_matches(bearer(given), self.api_token):
                self._count("unauthenticated")
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong token (authorization: Bearer)",
                )
        try:
            response = await self.decide(request)
        except Invalid as exc:
            self._count("invalid_argument")
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Unavailable as exc:
            self._count("unavailable")
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        self._count("over_limit" if response.overall_code == OVER_LIMIT else "ok")
        return response

    def _count(self, code: str) -> None:
        self.router.metrics.envoy_call(code)

    # ------------------------------------------------------------------ planning

    def plan(
        self, request: rls_pb2.RateLimitRequest
    ) -> tuple[list[_Item | Limit | None], list[_Item]]:
        """Per descriptor: its decision item, an unlimited Limit, or None (no limit);
        and the distinct items to decide."""
        if not request.domain:
            raise Invalid("rate limit domain must not be empty")
        if not request.descriptors:
            raise Invalid("rate limit descriptor list must not be empty")
        config = self.router.config
        max_cost = config.limits.max_cost
        default_cost = request.hits_addend or 1
        domain = self.envoy.domains.get(request.domain)
        limits: list[Limit | None] = []
        for i, descriptor in enumerate(request.descriptors):
            if descriptor.HasField("limit"):
                raise Invalid(
                    f"descriptors[{i}]: limit overrides are not supported (ringlimit decides "
                    "with the limits of its --envoy-config)"
                )
            entries = [(e.key, e.value) for e in descriptor.entries]
            limits.append(domain.limit_for(entries) if domain is not None and entries else None)
        replaced = {name for limit in limits if limit is not None for name in limit.replaces}
        plan: list[_Item | Limit | None] = []
        items: dict[tuple[str, str], _Item] = {}
        for i, (descriptor, limit) in enumerate(zip(request.descriptors, limits, strict=True)):
            if limit is None or (limit.name is not None and limit.name in replaced):
                plan.append(None)
                continue
            if limit.rule is None:
                plan.append(limit)
                continue
            cost = (
                descriptor.hits_addend.value if descriptor.HasField("hits_addend") else default_cost
            )
            if cost > max_cost:
                raise Invalid(f"descriptors[{i}]: hits_addend {cost} is above {max_cost}")
            entries = [(e.key, e.value) for e in descriptor.entries]
            key = descriptor_key(request.domain, entries, config.limits.max_key_length)
            item = items.get((limit.rule.name, key))
            if item is None:
                item = items[(limit.rule.name, key)] = _Item(limit.rule, key, 0)
            item.cost += cost
            plan.append(item)
        return plan, list(items.values())

    # ------------------------------------------------------------------ deciding

    async def decide(self, request: rls_pb2.RateLimitRequest) -> rls_pb2.RateLimitResponse:
        plan, items = self.plan(request)
        if len(items) == 1:
            items[0].result = await self._ask(items[0], items[0].cost)
        elif items:
            # Read first: consume nothing unless every enforced item has room.
            peeks = await asyncio.gather(*(self._ask(item, 0) for item in items))
            room = all(
                item.rule.shadow or _has_room(peek, item.cost)
                for item, peek in zip(items, peeks, strict=True)
            )
            if room:
                results = await asyncio.gather(*(self._ask(item, item.cost) for item in items))
            else:
                results = [
                    peek if item.rule.shadow else _as_denied(peek, item.cost)
                    for item, peek in zip(items, peeks, strict=True)
                ]
            for item, result in zip(items, results, strict=True):
                item.result = result
        return self._response(plan)

    async def _ask(self, item: _Item, cost: int) -> dict[str, Any]:
        result = await self.router.decisions.route_single(Check(item.key, (item.rule,), cost))
        data: Any = json.loads(result) if type(result) is bytes else result
        if not isinstance(data, dict) or "error" in data or "allowed" not in data:
            detail = data.get("detail", data.get("error")) if isinstance(data, dict) else data
            raise Unavailable(f"no decision for {item.key!r}: {detail}")
        return data

    def _response(self, plan: list[_Item | Limit | None]) -> rls_pb2.RateLimitResponse:
        response = rls_pb2.RateLimitResponse(overall_code=OK)
        shadowed: list[str] = []
        decided: list[tuple[_Item, dict[str, Any]]] = []
        for entry in plan:
            status = response.statuses.add()
            if entry is None:
                status.code = OK
                continue
            if isinstance(entry, Limit):
                status.code = OK
                status.limit_remaining = UINT32_MAX
                continue
            result = entry.result
            assert result is not None
            rule = entry.rule
            denied = not result["allowed"] or (
                rule.shadow and rule.name in result.get("shadow_denied", ())
            )
            if rule.shadow:
                status.code = OK  # decided and counted, never denied
                if denied and rule.name not in shadowed:
                    shadowed.append(rule.name)
            else:
                status.code = OVER_LIMIT if denied else OK
                if denied:
                    response.overall_code = OVER_LIMIT
                decided.append((entry, result))
            status.current_limit.requests_per_unit = rule.limit
            status.current_limit.unit = _unit_enum(rule)
            status.current_limit.name = rule.name
            status.limit_remaining = 0 if denied else max(0, int(result.get("remaining", 0)))
            reset = float(result.get("reset_after") or 0.0)
            status.duration_until_reset.seconds = int(reset)
            status.duration_until_reset.nanos = int((reset - int(reset)) * 1e9)
        self._headers(response, decided, shadowed)
        return response

    def _headers(
        self,
        response: rls_pb2.RateLimitResponse,
        decided: list[tuple[_Item, dict[str, Any]]],
        shadowed: list[str],
    ) -> None:
        add = response.response_headers_to_add
        if shadowed:
            add.append(
                base_pb2.HeaderValue(
                    key="ringlimit-shadow", value=", ".join(f'"{n}"' for n in shadowed)
                )
            )
        if not decided or not self.headers:
            return
        if "draft" in self.headers:
            add.append(
                base_pb2.HeaderValue(
                    key="ratelimit-policy",
                    value=", ".join(
                        f'"{i.rule.name}";q={i.rule.limit};w={whole_seconds(i.rule.period)}'
                        for i, _ in decided
                    ),
                )
            )
            add.append(
                base_pb2.HeaderValue(
                    key="ratelimit",
                    value=", ".join(
                        f'"{i.rule.name}";r={_remaining(r)};t={whole_seconds(r["reset_after"])}'
                        for i, r in decided
                    ),
                )
            )
        if "envoy" in self.headers:
            # As envoyproxy/ratelimit: the descriptor closest to its limit.
            item, result = min(decided, key=lambda d: (_remaining(d[1]), -d[1]["reset_after"]))
            window = whole_seconds(item.rule.period)
            add.append(
                base_pb2.HeaderValue(
                    key="x-ratelimit-limit",
                    value=f"{item.rule.limit}, {item.rule.limit};w={window}",
                )
            )
            add.append(
                base_pb2.HeaderValue(key="x-ratelimit-remaining", value=str(_remaining(result)))
            )
            add.append(
                base_pb2.HeaderValue(
                    key="x-ratelimit-reset", value=str(whole_seconds(result["reset_after"]))
                )
            )


def _remaining(result: dict[str, Any]) -> int:
    return 0 if not result["allowed"] else max(0, int(result.get("remaining", 0)))


def _has_room(peek: dict[str, Any], cost: int) -> bool:
    """Would ``cost`` pass, judging by a read (cost 0) of the same key?"""
    if peek.get("reason") == "owner_unreachable":
        return bool(peek["allowed"])  # the rule's on_error
    return int(peek.get("remaining", 0)) >= cost


def _as_denied(peek: dict[str, Any], cost: int) -> dict[str, Any]:
    """A read's answer, as the answer to the request that did not get to consume."""
    if _has_room(peek, cost):
        return peek  # this one had room; another descriptor denied the request
    return {**peek, "allowed": False}


def _unit_enum(rule: Rule) -> int:
    for unit, seconds in (
        ("second", 1.0),
        ("minute", 60.0),
        ("hour", 3600.0),
        ("day", 86400.0),
        ("week", 7 * 86400.0),
        ("month", 30 * 86400.0),
        ("year", 365 * 86400.0),
    ):
        if rule.period == seconds:
            return UNIT_ENUM[unit]
    return 0


async def start_grpc(
    servicer: RateLimitServicer, host: str, port: int
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server in the running loop (the router's); returns it and its port."""
    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(servicer, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"cannot bind the gRPC port {host}:{port}")
    await server.start()
    log.info("envoy rate limit service on %s:%d", host, bound)
    return server, bound
