"""Envoy's rate limit service (``envoy.service.ratelimit.v3.RateLimitService``) on the router.

Gateways that ask an external service over gRPC (Envoy, Envoy Gateway, Istio,
Contour, Emissary, Gloo) call ``ShouldRateLimit`` with a domain and a list of
descriptors. Each descriptor is matched against the ``--envoy-config`` of its
domain (router/envoy_config.py); its key is the domain plus its entries, and
it is decided by the key's owner through the decision API's own path
(:meth:`router.decisions.DecisionAPI.route_single`: coalesced, epoch-fenced, retried on
a ring change), so a descriptor and a ``POST /v1/check`` can never disagree.

Several descriptors in one request (see docs/envoy.md, "Several descriptors"):

* never over-admission: a call is OK only if every enforced descriptor's
  consume was allowed by its key's owner, so each key admits at most its limit;
* one enforced key (the usual case) is decided atomically by its owner;
* several enforced keys: the router reads each (a check of cost 0) and, if
  one lacks room, answers OVER_LIMIT consuming nothing. Otherwise it consumes
  the tightest key first (least room left after this call's cost): if a
  concurrent call took its last units meanwhile, the call is denied having
  consumed nothing. Only then are the others consumed, together; if one of
  those ran out in between (a race on two nearly exhausted keys at once), the
  keys that did consume keep it. The engine has no refund (a unit given back
  could land in a later window, or after the key's state moved to another
  node, and over-admit), so the bound is stated instead:
  ``ringlimit_router_envoy_partial_consumptions_total`` counts such calls;
* shadow descriptors are consumed on every call, whether or not an enforced
  descriptor denies it, as envoyproxy/ratelimit increments every descriptor's
  counter (src/redis/fixed_cache_impl.go, DoLimit); they never deny;
* ``requests_per_unit: 0`` (blocked) is over the limit without a node call;
* a descriptor's own ``hits_addend: 0`` is a read, never consumed, and OK at
  the limit too (as envoyproxy/ratelimit answers it; :func:`_as_read`).

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
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf.message import DecodeError

from node.decision import COST_EXCEEDS_CAPACITY, Decision
from node.frontdoor import grpc_connection_cap
from node.headers import policy_value, quota_window, ratelimit_value, whole_seconds
from node.rules import Rule
from node.security import bearer, token_matches
from node.wire import Check
from router.decisions import UNANSWERED
from router.envoy_config import MIN_KEY_LENGTH, UNIT_ENUM, UNITS, EnvoyConfig, Limit
from router.grpc_health import RouterHealth, add_health

if TYPE_CHECKING:
    from router.app import Router

log = logging.getLogger("ringlimit.envoy")

OK = rls_pb2.RateLimitResponse.OK
OVER_LIMIT = rls_pb2.RateLimitResponse.OVER_LIMIT
UINT32_MAX = 2**32 - 1
#: Which response headers to add: the IETF draft's fields, envoy's x-ratelimit-*.
HEADER_SETS = ("draft", "envoy")
#: Names the enforced limits that denied a call because its cost is above them:
#: the call can never pass (the decision API's ``reason: cost_exceeds_capacity``).
NEVER_HEADER = "ringlimit-cost-exceeds-capacity"
#: Names the limits whose owner did not answer (its rule's on_error decided): the
#: proxy path's ``X-Ringlimit-Degraded``, the decision API's ``reason``.
DEGRADED_HEADER = "ringlimit-degraded"
SERVICE = "envoy.service.ratelimit.v3.RateLimitService"


class Unavailable(Exception):
    """No decision could be made: the gateway's failure mode should decide."""


class Invalid(Exception):
    """The request asks for something this service refuses (INVALID_ARGUMENT)."""


@dataclass(frozen=True)
class Malformed:
    """A call whose bytes are not a ``RateLimitRequest`` (answered INVALID_ARGUMENT)."""

    reason: str


def parse_request(data: bytes) -> rls_pb2.RateLimitRequest | Malformed:
    """The call's request, or what is wrong with its bytes.

    gRPC's own deserializer raised on them: the caller got UNKNOWN and the
    router's log a traceback per call, which any client could fill. So the
    servicer is handed the reason instead, and answers INVALID_ARGUMENT as for
    any malformed call."""
    try:
        return rls_pb2.RateLimitRequest.FromString(data)
    except DecodeError as exc:
        return Malformed(str(exc))


def descriptor_key(domain: str, entries: Sequence[tuple[str, str]], max_length: int) -> str:
    """The key a descriptor is counted under: its domain and entries, unambiguous.

    ``edge/remote_address=10.0.0.1/path=%2Flogin``: every part percent-encoded,
    so no two descriptors share a key. Longer than the cluster's key limit, it
    becomes the domain and a SHA-256 of the full key (still one key per descriptor;
    ``#`` is always encoded in the plain form, so the two never meet), cut to fit:
    the domain (at most 64 characters) gives way first, then the digest, never
    below 128 bits (``MIN_KEY_LENGTH``; a shorter limit is refused at start-up).
    A limit of 130 or more keeps the whole of both, the form keys always had.
    """
    key = "/".join(
        [quote(domain, safe=""), *(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in entries)]
    )
    if len(key) > max_length:
        if max_length < MIN_KEY_LENGTH:  # a config adopted at runtime; refused at start
            raise Unavailable(
                f"limits.max_key_length {max_length} leaves no room for a long descriptor's "
                f"hashed key (at least {MIN_KEY_LENGTH})"
            )
        room = max_length - 2
        digits = min(64, room)
        digest = hashlib.sha256(key.encode()).hexdigest()[:digits]
        key = f"{quote(domain, safe='')[: min(64, room - digits)]}/#{digest}"
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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.router = router
        self.envoy = envoy
        self.headers = frozenset(headers)
        self.api_token = api_token
        #: Unix time, for a blocked descriptor's ``duration_until_reset`` only (its
        #: window is aligned on the unit, as the nodes align fixed windows).
        self.clock = clock

    async def ShouldRateLimit(
        self, request: rls_pb2.RateLimitRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> rls_pb2.RateLimitResponse:
        if self.api_token is not None:
            given = dict(context.invocation_metadata() or ()).get("authorization")
            if not token_matches(bearer(given), self.api_token):
                self._count("unauthenticated")
                await context.abort(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing or wrong token (authorization: Bearer)",
                )
        if isinstance(request, Malformed):
            self._count("invalid_argument")
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"not a RateLimitRequest: {request.reason}"
            )
        assert isinstance(request, rls_pb2.RateLimitRequest)
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
        if len(request.descriptors) > config.limits.max_batch:
            # The decision API's bound on checks per request, for the same reason.
            raise Invalid(
                f"{len(request.descriptors)} descriptors; at most {config.limits.max_batch}"
            )
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
            if item.cost > max_cost:
                # Repeated descriptors are one key's one check: their sum is its cost.
                raise Invalid(
                    f"descriptors[{i}]: hits_addend adds up to {item.cost} for a key that "
                    f"earlier descriptors name too; at most {max_cost}"
                )
            plan.append(item)
        return plan, list(items.values())

    # ------------------------------------------------------------------ deciding

    async def decide(self, request: rls_pb2.RateLimitRequest) -> rls_pb2.RateLimitResponse:
        plan, items = self.plan(request)
        blocked = any(
            isinstance(entry, Limit) and entry.blocked and not entry.shadow for entry in plan
        )
        enforced = [item for item in items if not item.rule.shadow]
        shadow = [item for item in items if item.rule.shadow]
        # Shadow items are counted whatever the enforced ones decide (as envoyproxy/
        # ratelimit, which increments every descriptor's key): side by side with them.
        outcomes = await asyncio.gather(
            self._decide_enforced(enforced, blocked),
            *(self._consume(item) for item in shadow),
            return_exceptions=True,
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return self._response(plan)

    async def _ask(self, item: _Item, cost: int) -> dict[str, Any]:
        result = await self.router.decisions.route_single(Check(item.key, (item.rule,), cost))
        data: Any = json.loads(result) if type(result) is bytes else result
        if not isinstance(data, dict) or "error" in data or "allowed" not in data:
            detail = data.get("detail", data.get("error")) if isinstance(data, dict) else data
            raise Unavailable(f"no decision for {item.key!r}: {detail}")
        return data

    async def _consume(self, item: _Item) -> None:
        result = await self._ask(item, item.cost)
        item.result = _as_read(result) if item.cost == 0 else result

    async def _decide_enforced(self, items: list[_Item], blocked: bool) -> None:
        """All or nothing over the enforced items, never over-admitting (module docstring)."""
        if not items:
            return
        if len(items) == 1 and not blocked:
            await self._consume(items[0])  # one key: its owner decides atomically
            return
        peeks = await asyncio.gather(*(self._ask(item, 0) for item in items))
        if blocked or not all(
            _has_room(peek, item.cost) for item, peek in zip(items, peeks, strict=True)
        ):
            for item, peek in zip(items, peeks, strict=True):
                item.result = _as_denied(peek, item)
            return
        # A key whose owner did not answer the read has its rule's on_error answer
        # already: it is not asked again (a paused owner would cost a second
        # --forward-timeout, and may have decided the first time). A key of cost 0
        # (a descriptor's hits_addend 0) is decided by its read: nothing to consume.
        asked: list[int] = []
        for i, peek in enumerate(peeks):
            if peek.get("reason") in UNANSWERED:
                items[i].result = peek
            elif items[i].cost == 0:
                items[i].result = _as_read(peek)
            else:
                asked.append(i)
        if not asked:
            return
        # The tightest key first: a race most likely takes its last units, and then
        # nothing at all is consumed.
        order = sorted(asked, key=lambda i: _slack(peeks[i], items[i].cost))
        first = items[order[0]]
        await self._consume(first)
        assert first.result is not None
        if not first.result["allowed"]:
            for i in order[1:]:
                items[i].result = peeks[i]  # they had room; not consumed
            return
        rest = [items[i] for i in order[1:]]
        await asyncio.gather(*(self._consume(item) for item in rest))
        if not all(item.result is not None and item.result["allowed"] for item in rest):
            self.router.metrics.envoy_partial()

    def _response(self, plan: list[_Item | Limit | None]) -> rls_pb2.RateLimitResponse:
        response = rls_pb2.RateLimitResponse(overall_code=OK)
        shadowed: list[str] = []
        unanswered: list[str] = []
        decided: list[tuple[_Item, dict[str, Any]]] = []
        for entry in plan:
            status = response.statuses.add()
            if entry is None:
                status.code = OK
                continue
            if isinstance(entry, Limit):
                if entry.blocked:
                    self._blocked(status, entry)
                    if entry.shadow:
                        if entry.label not in shadowed:
                            shadowed.append(entry.label)
                    else:
                        response.overall_code = OVER_LIMIT
                    continue
                status.code = OK
                status.limit_remaining = UINT32_MAX
                continue
            result = entry.result
            assert result is not None
            rule = entry.rule
            denied = not result["allowed"] or (
                rule.shadow and rule.name in result.get("shadow_denied", ())
            )
            # Its owner did not answer: on_error decided, and nothing is known of
            # the count. limit_remaining 0 (as the decision API's remaining), no
            # duration_until_reset, and no part in the rate-limit headers (the
            # proxy path sends none on such an answer): ringlimit-degraded names it.
            known = result.get("reason") not in UNANSWERED
            if not known and rule.name not in unanswered:
                unanswered.append(rule.name)
            if rule.shadow:
                status.code = OK  # decided and counted, never denied
                if denied and rule.name not in shadowed:
                    shadowed.append(rule.name)
            else:
                status.code = OVER_LIMIT if denied else OK
                if denied:
                    response.overall_code = OVER_LIMIT
                if known:
                    decided.append((entry, result))
            status.current_limit.requests_per_unit = rule.limit
            status.current_limit.unit = _unit_enum(rule)
            status.current_limit.name = rule.name
            status.limit_remaining = 0 if denied else max(0, int(result.get("remaining", 0)))
            if known:
                _set_duration(status, float(result.get("reset_after") or 0.0))
        self._headers(response, decided, shadowed, unanswered)
        return response

    def _blocked(self, status: rls_pb2.RateLimitResponse.DescriptorStatus, limit: Limit) -> None:
        """``requests_per_unit: 0``: over the limit (OK if shadow), nothing counted."""
        status.code = OK if limit.shadow else OVER_LIMIT
        status.current_limit.requests_per_unit = 0
        status.current_limit.unit = UNIT_ENUM[limit.unit]
        status.current_limit.name = limit.label
        status.limit_remaining = 0
        period = UNITS[limit.unit]
        _set_duration(status, period - self.clock() % period)

    def _headers(
        self,
        response: rls_pb2.RateLimitResponse,
        decided: list[tuple[_Item, dict[str, Any]]],
        shadowed: list[str],
        unanswered: list[str],
    ) -> None:
        add = response.response_headers_to_add
        # A cost above the limit can never pass, whatever the wait: RateLimit's r and t
        # cannot say so (the quota may be whole: r=20;t=0), so this names the limits
        # as the decision API does (reason cost_exceeds_capacity, retry_after null).
        never: list[str] = []
        for item, result in decided:
            if result.get("reason") == COST_EXCEEDS_CAPACITY and item.rule.name not in never:
                never.append(item.rule.name)
        named = (
            ("ringlimit-shadow", shadowed),
            (NEVER_HEADER, never),
            (DEGRADED_HEADER, unanswered),
        )
        for key, names in named:
            if names:
                add.append(base_pb2.HeaderValue(key=key, value=", ".join(f'"{n}"' for n in names)))
        if not decided or not self.headers:
            return
        if "draft" in self.headers:
            # The same functions as the HTTP path (node/headers.py), so both agree for
            # every algorithm: q and w from quota_window, t from available_after. Each
            # policy once, with its tightest key: descriptors of one rule for many
            # values (1000 users) repeated the same policy 1000 times, 64 KB of
            # fields, past Envoy's default limit on a response's headers (60 KiB).
            tightest: dict[str, tuple[_Item, dict[str, Any]]] = {}
            for item, result in decided:
                name = item.rule.name
                held = tightest.get(name)
                if held is None or _tighter(result, held[1]):
                    tightest[name] = (item, result)
            add.append(
                base_pb2.HeaderValue(
                    key="ratelimit-policy",
                    value=policy_value([i.rule for i, _ in tightest.values()]),
                )
            )
            add.append(
                base_pb2.HeaderValue(
                    key="ratelimit",
                    value=ratelimit_value(tuple(_decision(i, r) for i, r in tightest.values())),
                )
            )
        if "envoy" in self.headers:
            # As envoyproxy/ratelimit: the descriptor closest to its limit; the reset is
            # the seconds until its window is whole again (its duration_until_reset).
            item, result = min(decided, key=lambda d: _closeness(d[1]))
            quota, window = quota_window(item.rule)
            add.append(
                base_pb2.HeaderValue(key="x-ratelimit-limit", value=f"{quota}, {quota};w={window}")
            )
            add.append(
                base_pb2.HeaderValue(key="x-ratelimit-remaining", value=str(_remaining(result)))
            )
            add.append(
                base_pb2.HeaderValue(
                    key="x-ratelimit-reset", value=str(whole_seconds(result["reset_after"]))
                )
            )


def _set_duration(status: rls_pb2.RateLimitResponse.DescriptorStatus, seconds: float) -> None:
    status.duration_until_reset.seconds = int(seconds)
    status.duration_until_reset.nanos = int((seconds - int(seconds)) * 1e9)


def _decision(item: _Item, result: dict[str, Any]) -> Decision:
    """A node's answer (JSON) as the Decision node/headers.py renders."""
    retry = result.get("retry_after")
    return Decision(
        allowed=bool(result["allowed"]),
        limit=item.rule.limit,
        remaining=max(0, int(result.get("remaining", 0))),
        reset_after=float(result.get("reset_after") or 0.0),
        retry_after=None if retry is None else float(retry),
        rule=item.rule.name,
        reason=result.get("reason"),
        available_after=float(result.get("available_after") or 0.0),
    )


def _remaining(result: dict[str, Any]) -> int:
    return 0 if not result["allowed"] else max(0, int(result.get("remaining", 0)))


def _closeness(result: dict[str, Any]) -> tuple[int, float]:
    """Orders results closest to their limit first: least remaining, then longest reset."""
    return _remaining(result), -result["reset_after"]


def _tighter(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return _closeness(a) < _closeness(b)


def _slack(peek: dict[str, Any], cost: int) -> float:
    """Room a key has left after this call's cost, judging by its read."""
    return int(peek.get("remaining", 0)) - cost


def _has_room(peek: dict[str, Any], cost: int) -> bool:
    """Would ``cost`` pass, judging by a read (cost 0) of the same key?"""
    if peek.get("reason") in UNANSWERED:
        return bool(peek["allowed"])  # the rule's on_error
    return int(peek.get("remaining", 0)) >= cost


def _as_read(peek: dict[str, Any]) -> dict[str, Any]:
    """A read's answer as the answer to a descriptor of cost 0 (hits_addend 0).

    A node's read says whether one more unit would pass; a cost of 0 asks whether
    the count is above the limit, as envoyproxy/ratelimit answers it (OVER_LIMIT only
    when its counter is past the limit, src/limiter/base_limiter.go). A ringlimit
    counter never is, so a read is allowed, at the limit too; only an owner that did
    not answer keeps its rule's on_error answer. Nor is a read one a shadow limit
    would have denied (nodes count no shadow denial for it either)."""
    if peek.get("reason") in UNANSWERED:
        return peek
    read = {**peek, "allowed": True}
    read.pop("shadow_denied", None)
    return read


def _as_denied(peek: dict[str, Any], item: _Item) -> dict[str, Any]:
    """A read's answer, as the answer to the request that did not get to consume."""
    if item.cost == 0:
        return _as_read(peek)
    if _has_room(peek, item.cost):
        return peek  # this one had room; another descriptor denied the request
    if item.cost > item.rule.capacity and peek.get("reason") not in UNANSWERED:
        # What its owner would have answered the consume (node/algorithms.py).
        return {**peek, "allowed": False, "retry_after": None, "reason": COST_EXCEEDS_CAPACITY}
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


class GrpcPortError(OSError):
    """The gRPC port cannot be bound; the message says which and the flag to change."""


def _add_servicer(servicer: rls_pb2_grpc.RateLimitServiceServicer, server: grpc.aio.Server) -> None:
    """The generated ``add_RateLimitServiceServicer_to_server``, with the request's
    bytes read by :func:`parse_request` (a malformed call is INVALID_ARGUMENT)."""
    handlers = {
        "ShouldRateLimit": grpc.unary_unary_rpc_method_handler(
            servicer.ShouldRateLimit,
            request_deserializer=parse_request,
            response_serializer=rls_pb2.RateLimitResponse.SerializeToString,
        )
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    server.add_registered_method_handlers(SERVICE, handlers)


#: Seconds an HTTP/2 connection with no call in flight is kept (then a graceful
#: GOAWAY: Envoy opens a new one for its next call). Idle connections that had
#: sent their preface held a slot under the connection cap for ever.
MAX_CONNECTION_IDLE = 60.0
#: Seconds between the server's pings on a connection with calls in flight (a
#: ``Watch`` stream), and for an answer to one: a peer gone without closing
#: (a lost host) held its connection for gRPC's default of two hours.
KEEPALIVE_TIME = 60.0
KEEPALIVE_TIMEOUT = 20.0
#: The largest call a client may send, in bytes: gRPC's own default, stated
#: (a call of 1,000 descriptors, the default ``max_batch``, with 4 KB of
#: entries each). A larger one is refused ``RESOURCE_EXHAUSTED`` before it is read.
MAX_MESSAGE = 4 * 1024 * 1024


def server_options(max_connections: int, handshake_timeout: float) -> list[tuple[str, int]]:
    """The gRPC server's channel arguments: its connection budget and timeouts.

    Without them a TCP connection that never spoke (no token needed to open
    one) was kept for gRPC's two-minute handshake deadline, and any number of
    them were accepted: about 20,000 idle sockets took every descriptor of a
    router under ``ulimit -n 20000``, and its HTTP port, decision API and
    connections to nodes with them (docs/envoy.md, "Connections").

    * ``grpc.max_allowed_incoming_connections``: connections over the cap are
      accepted and closed at once (connections already open, Envoy's, go on);
    * ``grpc.server_handshake_timeout_ms``: a connection must send the HTTP/2
      preface and its SETTINGS within ``handshake_timeout`` seconds (the HTTP
      port's ``--header-timeout``), or is closed, freeing its slot;
    * ``grpc.max_connection_idle_ms``: :data:`MAX_CONNECTION_IDLE`;
    * ``grpc.max_receive_message_length``: :data:`MAX_MESSAGE`;
    * keepalive pings (:data:`KEEPALIVE_TIME`), not limited to two without data
      (``grpc.http2.max_pings_without_data``: a ``Watch`` may send nothing for
      hours). A client's own pings are still held to gRPC's default policy (at
      most one every 5 minutes without a call; twice too often is a GOAWAY).
    """
    return [
        ("grpc.max_allowed_incoming_connections", max_connections),
        ("grpc.server_handshake_timeout_ms", max(1, round(handshake_timeout * 1000))),
        ("grpc.max_connection_idle_ms", round(MAX_CONNECTION_IDLE * 1000)),
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.keepalive_time_ms", round(KEEPALIVE_TIME * 1000)),
        ("grpc.keepalive_timeout_ms", round(KEEPALIVE_TIMEOUT * 1000)),
        ("grpc.http2.max_pings_without_data", 0),
    ]


async def start_grpc(
    servicer: rls_pb2_grpc.RateLimitServiceServicer,
    host: str,
    port: int,
    health: RouterHealth | None = None,
    *,
    max_connections: int | None = None,
    handshake_timeout: float = 10.0,
) -> tuple[grpc.aio.Server, int]:
    """A grpc.aio server in the running loop (the router's); returns it and its port.
    With ``health``, it answers ``grpc.health.v1.Health`` too (router/grpc_health.py).
    At most ``max_connections`` connections (None: the default share of the
    descriptors, node/frontdoor.py :func:`grpc_connection_cap`), each with
    ``handshake_timeout`` seconds to begin speaking HTTP/2 (:func:`server_options`).

    gRPC says a port it cannot bind with a RuntimeError (newer versions) or a
    0 for the port (older ones), and never why: both are a :class:`GrpcPortError`
    the CLI prints as one line."""
    cap = grpc_connection_cap(max_connections)
    server = grpc.aio.server(options=server_options(cap, handshake_timeout))
    _add_servicer(servicer, server)
    if health is not None:
        add_health(health, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise GrpcPortError(
            f"cannot listen on {host}:{port} for Envoy's rate limit service (in use, or "
            "not an address of this host); stop what uses it or choose another port "
            "(--grpc-port)"
        )
    await server.start()
    log.info("envoy rate limit service on %s:%d (at most %d connections)", host, bound, cap)
    return server, bound
