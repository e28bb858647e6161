"""The router: the cluster's front door.

For every request it extracts the user id, finds the owner on the ring and
forwards the request there (sticky routing), returning the node's answer with
``X-Ringlimit-Node``. A node that refuses a key (it is not the owner at its
newer epoch) makes the router catch up and retry; an unreachable owner makes
each rule's ``on_error`` decide: ``open`` serves the request through the next
node without limiting (marked ``X-Ringlimit-Degraded``), ``closed`` answers 503.

The proxy path is raw ASGI (no Request objects): it is the hot path. The
control endpoints (decision API, admin API, health, metrics) use Starlette.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any
from urllib.parse import quote

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from node.asgi import (
    Receive,
    Scope,
    Send,
    drain,
    error_body,
    json_http_errors,
    odd_target,
    send_json,
)
from node.config import ClusterConfig, Privacy
from node.identity import IdentityResolver, InvalidUserId
from node.peers import INTERNAL_TOKEN_HEADER
from node.security import bearer, refusal, token_matches
from node.topkeys import NEAR_LIMIT_FRACTION
from node.wire import (
    ApiError,
    Check,
    Result,
    batch_body,
    checks_payload,
    dumps,
    parse_checks,
    parse_json,
    read_body,
    split_results,
    unreachable_result,
)
from ring import EmptyRingError, Member, RingView
from ring.analysis import hash_share
from ring.member import check_id, check_url, check_weight, same_url
from router.coalesce import Coalescer
from router.coordinator import CoordinatorError, EtcdCoordinator
from router.envoy_config import EnvoyConfig
from router.fastclient import FastForwarder
from router.forward import (
    AiohttpForwarder,
    Answer,
    Forwarder,
    NodeTimeout,
    Timeouts,
    Unreachable,
)
from router.membership import Membership, MembershipError
from router.metrics import RouterMetrics
from router.top import KeyHider, Report, ask_nodes, merge_top, node_status, number, random_salt
from router.ui import HEADERS as UI_HEADERS
from router.ui import PAGE as UI_PAGE

log = logging.getLogger("ringlimit.router")

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"expect",
        b"content-length",
    }
)
CONTROL_PATHS = frozenset({"/healthz", "/metrics", "/v1/check"})
MAX_ATTEMPTS = 3
#: Keys whose owner the router remembers (per ring view).
OWNER_CACHE = 100_000
#: A coalesced check that must be routed again (the node refused it: ring change).
_RETRY = object()


@dataclass
class RouterSettings:
    config: ClusterConfig = field(default_factory=ClusterConfig)
    seeds: Sequence[Member] = ()
    admin_token: str | None = None
    #: When set, the decision API requires ``Authorization: Bearer <token>``: anyone
    #: who can call it can spend any user's quota.
    api_token: str | None = None
    internal_token: str | None = None
    state_file: str | None = None
    health_interval: float = 1.0
    failure_threshold: int = 3
    health_timeout: float = 0.5
    ready_timeout: float = 10.0
    #: Seconds of lease per renewal (None: the detection time); router/removal.py
    #: and node/lease.py say why.
    lease: float | None = None
    removal_interval: float | None = None
    removal_quorum: float = 0.5
    #: Shared membership in etcd (router/coordinator.py); None: this router alone.
    coordinator: EtcdCoordinator | None = None
    #: This router's admin URL as other routers reach it (the leader's address).
    advertise: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    max_buffered_body: int = 1 << 20
    health_checks: bool = True
    #: The URLs this router answers on: a join at one of them is refused.
    own_urls: Sequence[str] = ()
    #: Hold single decision-API checks this long (seconds) to send them to their
    #: node as one batch; 0 sends each at once.
    coalesce_window: float = 0.0003
    #: Envoy's rate limit service (router/envoy.py): served on ``grpc_port`` when set.
    envoy: EnvoyConfig | None = None
    grpc_port: int | None = None
    grpc_host: str = "127.0.0.1"
    #: Response headers ShouldRateLimit adds: "draft" (RateLimit fields), "envoy" (x-ratelimit-*).
    envoy_headers: tuple[str, ...] = ()
    #: How long ``/admin/top`` and the ring page wait for each node's answer.
    admin_timeout: float = 2.0
    #: Without a coordinator: the leading router's admin URL, which makes this one a
    #: follower (router/workers.py): admin changes are passed on to it, and its ring
    #: is polled every ``follow_interval`` seconds.
    leader_url: str | None = None
    follow_interval: float = 0.2
    #: This router's name in ``X-Ringlimit-Router`` on proxied answers (workers: w0, w1...).
    name: str | None = None


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        *,
        membership: Membership | None = None,
        forwarder: Forwarder | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.settings = settings
        self.membership = membership or Membership(
            settings.config,
            internal_token=settings.internal_token,
            state_file=settings.state_file,
            ready_timeout=settings.ready_timeout,
            health_interval=settings.health_interval,
            failure_threshold=settings.failure_threshold,
            health_timeout=settings.health_timeout,
            lease=settings.lease,
            removal_interval=settings.removal_interval,
            removal_quorum=settings.removal_quorum,
            coordinator=settings.coordinator,
            advertise=settings.advertise,
            client=client,
        )
        self.metrics = RouterMetrics()
        self.metrics.watch(lambda: self.membership.view.epoch, lambda: len(self.membership.view))
        self.metrics.watch_membership(
            lambda: self.membership.stats, lambda: float(self.membership.suspect_self)
        )
        self.metrics.watch_failures(self.membership.failures.snapshot)
        self.forwarder: Forwarder | None = forwarder
        #: Reaches the nodes' /internal/top (shared with membership when given).
        self._client = client
        self._owns_client = client is None
        self._salt = random_salt()
        self._hider: tuple[Privacy, KeyHider] | None = None
        self._resolver_for: tuple[object, IdentityResolver] | None = None
        self._turn = itertools.count()
        self._owners: tuple[RingView | None, dict[str, Member]] = (None, {})
        self._token_header = (
            [(INTERNAL_TOKEN_HEADER, settings.internal_token)] if settings.internal_token else []
        )
        self._extra_headers = (
            [(b"x-ringlimit-router", settings.name.encode())] if settings.name else []
        )
        self._raw_token = (
            [(INTERNAL_TOKEN_HEADER.lower().encode(), settings.internal_token.encode())]
            if settings.internal_token
            else []
        )
        self.coalescer = (
            Coalescer(self._send_coalesced, window=settings.coalesce_window)
            if settings.coalesce_window > 0
            else None
        )
        self.control = Starlette(
            routes=self._routes(), lifespan=self._lifespan, exception_handlers=json_http_errors()
        )
        self.grpc_server: Any = None
        #: The port the gRPC service is bound to (when ``grpc_port`` was 0, the one chosen).
        self.grpc_bound: int | None = None
        self.envoy_servicer: Any = None

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.start()
        try:
            yield
        finally:
            await self.close()

    async def start(self) -> None:
        if self.forwarder is None:
            tls = any(m.url.startswith("https://") for m in self.settings.seeds)
            # router/fastclient.py speaks plain http only; aiohttp also https.
            self.forwarder = (
                AiohttpForwarder(timeouts=self.settings.timeouts)
                if tls
                else FastForwarder(timeouts=self.settings.timeouts)
            )
        await self.membership.start(self.settings.seeds, health=self.settings.health_checks)
        if self.settings.leader_url is not None:
            headers = self._admin_headers()
            await self.membership.first_follow(self.settings.leader_url, headers)
            self.membership.follow(self.settings.leader_url, headers, self.settings.follow_interval)
        if self.settings.grpc_port is not None:
            from router.envoy import RateLimitServicer, start_grpc

            self.envoy_servicer = RateLimitServicer(
                self,
                self.settings.envoy or EnvoyConfig({}),
                headers=self.settings.envoy_headers,
                api_token=self.settings.api_token,
            )
            self.grpc_server, self.grpc_bound = await start_grpc(
                self.envoy_servicer, self.settings.grpc_host, self.settings.grpc_port
            )

    async def close(self) -> None:
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
            self.grpc_server = None
        await self.membership.close()
        if self.forwarder is not None:
            await self.forwarder.close()
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    @property
    def config(self) -> ClusterConfig:
        return self.membership.config

    def _resolver(self) -> IdentityResolver:
        identity = self.config.identity
        cached = self._resolver_for
        if cached is None or cached[0] is not identity:
            cached = self._resolver_for = (identity, IdentityResolver(identity))
        return cached[1]

    # ------------------------------------------------------------------ ASGI entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not (
            scope["path"] in CONTROL_PATHS or scope["path"].startswith("/admin/")
        ):
            if scope["path"][:1] != "/":
                await odd_target(scope, receive, send)  # OPTIONS *, CONNECT host:port
                return
            if scope["path"].startswith("/internal"):
                # The nodes' internal API is never reachable through the front door.
                await drain(receive)
                await send_json(send, 404, error_body("not_found", "no such endpoint"))
                return
            await self.proxy(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == "/v1/check":
            if scope["method"] == "POST":
                await self.check_asgi(scope, receive, send)  # the decision API's hot path
            else:
                await send_json(
                    send,
                    405,
                    error_body("method_not_allowed", "Method Not Allowed"),
                    [(b"allow", b"POST")],
                )
        else:
            await self.control(scope, receive, send)

    # ------------------------------------------------------------------ routing

    def pick(self, view: RingView, key: str) -> Member:
        """The node for ``key``: its owner, or the next in turn in round-robin mode.

        Round-robin is only for a shared backend (Redis): while that backend
        is down the nodes fall back to local limiters, so the router routes
        stickily again and each user's fallback limiter lives on one node.
        ``EmptyRingError`` when the view has no members.
        """
        if self.config.balance == "round-robin" and not self.membership.backend_degraded:
            members = view.members
            if not members:
                raise EmptyRingError(f"cannot place a key: ring at epoch {view.epoch} is empty")
            return members[next(self._turn) % len(members)]
        # Owners are remembered per view (a dict lookup instead of md5 + bisect).
        cache = self._owners
        if cache[0] is not view:
            cache = self._owners = (view, {})
        owners = cache[1]
        member = owners.get(key)
        if member is None:
            member = view.owner(key)
            if len(owners) >= OWNER_CACHE:
                owners.clear()
            owners[key] = member
        return member

    def _owner_map(self, view: RingView) -> dict[str, Member]:
        """The remembered owners under ``view`` (empty in round-robin mode: pick each)."""
        if self.config.balance == "round-robin" and not self.membership.backend_degraded:
            return {}
        cache = self._owners
        if cache[0] is not view:
            cache = self._owners = (view, {})
        return cache[1]

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        resolver = self._resolver()
        config = self.config
        try:
            user = resolver.user(scope)
        except InvalidUserId as exc:
            await drain(receive)
            self.metrics.outcome("-", "invalid_user_id")
            await send_json(send, 400, error_body("invalid_user_id", str(exc)))
            return
        if not user:
            await drain(receive)
            self.metrics.outcome("-", "missing_user_id")
            identity = config.identity
            await send_json(
                send,
                400,
                error_body(
                    "missing_user_id",
                    f"no user id: expected {identity.source} {identity.name!r} "
                    "(or set identity.fallback_to_client)",
                ),
            )
            return
        if len(user) > config.limits.max_key_length:
            await drain(receive)
            self.metrics.outcome("-", "key_too_long")
            await send_json(
                send,
                400,
                error_body(
                    "key_too_long",
                    f"user id is {len(user)} characters; at most {config.limits.max_key_length}",
                ),
            )
            return
        # The configured client limit applies to proxied bodies too (the router buffers them).
        max_body = min(self.settings.max_buffered_body, config.limits.max_body)
        body = await _read_all(receive, max_body)
        if body is None:
            self.metrics.outcome("-", "body_too_large")
            await send_json(
                send,
                413,
                error_body("body_too_large", f"request body is over {max_body} bytes"),
            )
            return
        # Clients may not send ringlimit's internal fields, except the bypass token
        # (whose default name also starts with x-ringlimit-): the node checks it.
        bypass_name = config.bypass_header.lower().encode("latin-1")
        forwarded_for = None
        headers = []
        for k, v in scope["headers"]:
            if k == b"x-forwarded-for":
                forwarded_for = v.decode("latin-1")
            elif k not in HOP_BY_HOP and (not k.startswith(b"x-ringlimit-") or k == bypass_name):
                headers.append((k.decode("latin-1"), v.decode("latin-1")))
        # Percent-encoded: ASCII on the wire whatever the forwarder's header encoding,
        # so the node decides exactly the key the router placed on the ring.
        headers.append(("x-ringlimit-key", _quote_key(user)))
        headers += self._token_header
        client = scope.get("client")
        if client:
            # One X-Forwarded-For, the client's chain with its peer appended.
            chain = f"{forwarded_for}, {client[0]}" if forwarded_for else client[0]
            headers.append(("x-forwarded-for", chain))
        elif forwarded_for:
            headers.append(("x-forwarded-for", forwarded_for))
        target = scope.get("raw_path") or scope["path"].encode()
        path_qs = target.decode("latin-1")
        if scope.get("query_string"):
            path_qs += "?" + scope["query_string"].decode("latin-1")
        method = scope["method"]
        assert self.forwarder is not None
        member: Member | None = None
        for _ in range(MAX_ATTEMPTS):
            view = self.membership.view
            try:
                member = self.pick(view, user)
            except EmptyRingError:
                await send_json(send, 503, error_body("no_nodes", "the ring has no nodes"))
                return
            try:
                answer = await self.forwarder.request(method, member.url + path_qs, headers, body)
            except NodeTimeout:
                # Sent, unanswered: the node may have decided (and passed the
                # request on to the application), so it is never sent again. A rule
                # that fails closed answers 503 as for an unreachable owner; an open
                # one cannot admit without resending, so the client gets a 504.
                self.metrics.outcome(member.id, "node_timeout")
                rules = config.rules_for(method, scope["path"], resolver.tier(scope))
                closed = next((r for r in rules if r.on_error == "closed"), None)
                await send_json(
                    send,
                    504 if closed is None else 503,
                    error_body(
                        "node_timeout" if closed is None else "limiter_unavailable",
                        f"node {member.id} did not answer in time",
                        **({"rule": closed.name} if closed is not None else {}),
                    ),
                    [(b"x-ringlimit-node", member.id.encode())],
                )
                return
            except Unreachable as exc:
                if await self.membership.newer_view(member):
                    continue  # our view was stale: the key has another owner now
                await self._owner_unreachable(
                    scope, send, view, member, user, method, path_qs, headers, body, str(exc)
                )
                return
            if answer.status == 421 and await self._stale(answer, member):
                continue
            if answer.status == 503 and _lease_expired(answer):
                # The owner decided nothing (it has not heard from a router within
                # its lease): as if it were unreachable. Perhaps it was removed and
                # this router has not been told: look for a newer view first.
                self.metrics.outcome(member.id, "lease_expired")
                if await self.membership.newer_view(member):
                    continue
                await self._owner_unreachable(
                    scope, send, view, member, user, method, path_qs, headers, body, "lease expired"
                )
                return
            self.metrics.forwarded(member.id, answer.status, time.perf_counter() - started)
            await _respond(send, answer, member.id, self._extra_headers)
            return
        self.metrics.outcome(member.id if member else "-", "ring_changing")
        await send_json(
            send,
            503,
            error_body("ring_changing", "the ring is changing; retry shortly"),
            [(b"retry-after", b"1")],
        )

    async def _stale(self, answer: Answer, member: Member) -> bool:
        """A node refused a key: bring the router or the node up to date. Retry?"""
        epoch_value = next((v for k, v in answer.headers if k == b"x-ringlimit-epoch"), None)
        if epoch_value is None:
            return False
        node_epoch = int(epoch_value)
        self.metrics.outcome(member.id, "not_owner")
        if node_epoch > self.membership.view.epoch:
            await self.membership.catch_up(node_epoch, member.url)
        elif node_epoch < self.membership.view.epoch:
            await self.membership.refresh_node(member, node_epoch)
        else:
            await asyncio.sleep(0.01)
        return True

    async def _owner_unreachable(
        self,
        scope: Scope,
        send: Send,
        view: RingView,
        member: Member,
        user: str,
        method: str,
        path_qs: str,
        headers: list[tuple[str, str]],
        body: bytes,
        reason: str,
    ) -> None:
        config = self.config
        rules = config.rules_for(method, scope["path"], self._resolver().tier(scope))
        closed = [r for r in rules if r.on_error == "closed"]
        if closed:
            self.metrics.outcome(member.id, "unreachable_closed")
            await send_json(
                send,
                503,
                error_body(
                    "limiter_unavailable",
                    f"node {member.id} owning this user is unreachable ({reason}) and rule "
                    f"{closed[0].name!r} fails closed",
                    rule=closed[0].name,
                    node=member.id,
                ),
                [(b"retry-after", b"1"), (b"x-ringlimit-node", member.id.encode())],
            )
            return
        self.metrics.outcome(member.id, "unreachable_open")
        for other in view.successors(user, len(view)):
            if other.id == member.id:
                continue
            try:
                answer = await self.forwarder.request(  # type: ignore[union-attr]
                    method,
                    other.url + path_qs,
                    [*headers, ("x-ringlimit-failover", "owner-unreachable")],
                    body,
                )
            except Unreachable:
                continue
            except NodeTimeout:
                break
            await _respond(send, answer, other.id, self._extra_headers)
            return
        await send_json(send, 502, error_body("no_node_available", f"no node answered ({reason})"))

    # ------------------------------------------------------------------ control routes

    def _routes(self) -> list[Route]:
        return [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/admin/ring", self.admin_ring, methods=["GET"]),
            Route("/admin/nodes", self.admin_join, methods=["POST"]),
            Route("/admin/nodes/{node_id}", self.admin_leave, methods=["DELETE"]),
            Route("/admin/top", self.admin_top, methods=["GET"]),
            Route("/admin/ui", self.admin_ui, methods=["GET"]),
            Route("/admin/ui/data", self.admin_ui_data, methods=["GET"]),
        ]

    async def healthz(self, request: Request) -> Response:
        view = self.membership.view
        degraded = self.membership.backend_degraded
        balance = self.config.balance
        return JSONResponse(
            {
                "status": "ok" if len(view) else "no_nodes",
                "epoch": view.epoch,
                "nodes": len(view),
                "backend_degraded": degraded,
                "balance": "sticky" if degraded else balance,
            },
            status_code=200 if len(view) else 503,
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def check_asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/check``, the decision API: each check goes to its owner; a batch
        is split and merged. Raw ASGI (no Starlette): this is the hot path."""
        config = self.config
        limit = config.limits.max_body
        if self.settings.api_token is not None and not self._api_allowed(scope):
            await drain(receive)
            await _send_json_bytes(
                send,
                401,
                dumps(
                    error_body("unauthorized", "the decision API needs its token (Bearer)")
                ).encode(),
            )
            return
        try:
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ApiError(
                    413, "body_too_large", f"body is {declared.decode()} bytes; at most {limit}"
                )
            body = await _read_all(receive, limit)
            if body is None:
                raise ApiError(413, "body_too_large", f"body is over {limit} bytes")
            checks, batch = parse_checks(parse_json(body, config), config)
        except ApiError as exc:
            await _send_json_bytes(send, exc.status, dumps(exc.body()).encode())
            return
        status, payload = await self.answer_checks(checks, batch)
        await _send_json_bytes(send, status, payload)

    async def answer_checks(self, checks: Sequence[Check], batch: bool) -> tuple[int, bytes]:
        """The status and JSON body answering valid checks."""
        if batch:
            results = await self.route_checks(checks)
            return 200, batch_body(results)
        result = await self.route_single(checks[0])
        if type(result) is bytes:
            return 200, result  # a node's decision
        assert isinstance(result, dict)
        if "error" in result:
            # No decision: say so with the status too, not a 200 carrying an error
            # (the request was valid here; the node could not answer it).
            status = {"ring_changing": 503, "no_nodes": 503, "node_timeout": 504}.get(
                result["error"], 502
            )
        else:
            status = (
                503
                if result.get("reason") == "owner_unreachable" and not result["allowed"]
                else 200
            )
        return status, dumps(result).encode()

    async def route_single(self, check: Check) -> Result:
        """One check; concurrent singles for the same node leave as one batch."""
        if self.coalescer is None:
            return (await self.route_checks([check]))[0]
        try:
            member = self.pick(self.membership.view, check.key)
        except EmptyRingError:
            return (await self.route_checks([check]))[0]
        result = await self.coalescer.submit(member.id, (member, check))
        if result is _RETRY:
            return (await self.route_checks([check]))[0]
        return result  # type: ignore[no-any-return]

    async def _send_coalesced(self, node_id: str, items: list[tuple[Member, Check]]) -> list[Any]:
        checks = [check for _, check in items]
        results: list[Result | None] = [None] * len(checks)
        retry: list[int] = []
        await self._run_group(items[0][0], list(range(len(checks))), checks, results, retry)
        out: list[Any] = list(results)
        for index in retry:
            out[index] = _RETRY
        return out

    async def route_checks(self, checks: Sequence[Check]) -> list[Result]:
        """One result per check, in order: a node's answer as JSON bytes, or the
        router's own (an error, an unreachable owner) as a dict."""
        results: list[Result | None] = [None] * len(checks)
        pending = list(range(len(checks)))
        for _ in range(MAX_ATTEMPTS):
            if not pending:
                break
            view = self.membership.view
            groups: dict[str, list[int]] = {}
            members: dict[str, Member] = {}
            if not len(view):
                for index in pending:
                    results[index] = {"error": "no_nodes", "detail": "the ring has no nodes"}
                return _complete(results)
            owners = self._owner_map(view)
            for index in pending:
                key = checks[index].key
                member = owners.get(key)
                if member is None:
                    member = self.pick(view, key)
                groups.setdefault(member.id, []).append(index)
                members[member.id] = member
            retry: list[int] = []
            await asyncio.gather(
                *(
                    self._run_group(members[m], idx, checks, results, retry)
                    for m, idx in groups.items()
                )
            )
            pending = retry
        for index in pending:
            results[index] = {
                "error": "ring_changing",
                "detail": "the ring is changing; retry shortly",
            }
        return _complete(results)

    async def _run_group(
        self,
        member: Member,
        indices: list[int],
        checks: Sequence[Check],
        results: list[Result | None],
        retry: list[int],
    ) -> None:
        payload = checks_payload(checks, indices)
        assert self.forwarder is not None
        try:
            answer = await self.forwarder.post_json(
                member.url + "/v1/check", payload, self._token_header
            )
        except NodeTimeout:
            for i in indices:
                results[i] = {
                    "error": "node_timeout",
                    "detail": f"node {member.id} did not answer in time",
                }
            self.metrics.outcome(member.id, "node_timeout")
            return
        except Unreachable:
            if await self.membership.newer_view(member):
                retry.extend(indices)  # our view was stale: route them again
                return
            for i in indices:
                results[i] = unreachable_result(checks[i], member.id)
            self.metrics.outcome(member.id, "unreachable")
            return
        if answer.status == 421 and await self._stale(answer, member):
            retry.extend(indices)
            return
        if answer.status == 503 and _lease_expired(answer):
            if await self.membership.newer_view(member):
                retry.extend(indices)
                return
            for i in indices:
                results[i] = unreachable_result(checks[i], member.id)
            self.metrics.outcome(member.id, "lease_expired")
            return
        if answer.status != 200:
            detail = answer.body[:200].decode("utf-8", "replace")
            for i in indices:
                results[i] = {"error": "node_error", "status": answer.status, "detail": detail}
            return
        try:
            answered = split_results(answer.body)
            if len(answered) != len(indices):
                raise ValueError("wrong number of results")
        except (ValueError, KeyError, TypeError) as exc:
            for i in indices:
                results[i] = {
                    "error": "node_error",
                    "status": answer.status,
                    "detail": f"node {member.id} answered a malformed body: {exc}",
                }
            return
        for i, result in zip(indices, answered, strict=True):
            results[i] = result
        self.metrics.checks(member.id, len(indices))

    # ------------------------------------------------------------------ admin

    def _api_allowed(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        return token_matches(
            bearer(given.decode("latin-1") if given is not None else None), self.settings.api_token
        )

    def _admin_refused(self, request: Request) -> Response | None:
        status = refusal(
            bearer(request.headers.get("authorization")),
            self.settings.admin_token,
            request.client.host if request.client else None,
        )
        if status == 403:
            return JSONResponse(
                error_body("forbidden", "the admin API is loopback-only without an admin token"),
                status_code=403,
            )
        if status is not None:
            return JSONResponse(
                error_body(
                    "unauthorized", "missing or wrong admin token (Authorization: Bearer ...)"
                ),
                status_code=401,
                headers={"www-authenticate": "Bearer"},
            )
        return None

    async def admin_ring(self, request: Request) -> Response:
        if (refused := self._admin_refused(request)) is not None:
            return refused
        return JSONResponse(self.membership.describe())

    def _admin_headers(self) -> dict[str, str]:
        token = self.settings.admin_token
        return {"authorization": f"Bearer {token}"} if token else {}

    async def _leader(self) -> str | Response | None:
        """The leading router's URL, None if this router leads, or an error answer."""
        membership = self.membership
        if membership.coordinator is None:
            return self.settings.leader_url  # a follower (router/workers.py), or alone
        if membership.leading:
            return None
        try:
            return await membership.coordinator.leader() or ""
        except CoordinatorError as exc:
            return JSONResponse(error_body("coordinator_unavailable", str(exc)), status_code=503)

    async def _to_leader(self, request: Request, body: bytes = b"") -> Response | None:
        """Membership changes are the leader's (with etcd, or when following a
        leading router): pass them on. None: this router makes the change."""
        membership = self.membership
        leader = await self._leader()
        if leader is None or isinstance(leader, Response):
            return leader
        if not leader or leader == membership.advertise:
            return JSONResponse(
                error_body("no_leader", "no router leads the cluster right now; retry shortly"),
                status_code=503,
                headers={"retry-after": "1"},
            )
        headers = {
            k: v for k, v in request.headers.items() if k in ("authorization", "content-type")
        }
        try:
            answer = await membership.client.request(
                request.method,
                leader.rstrip("/") + request.url.path,
                content=body,
                headers=headers,
                timeout=httpx.Timeout(
                    membership.ready_timeout + membership.push_timeout, connect=1.0
                ),
            )
        except httpx.HTTPError as exc:
            return JSONResponse(
                error_body(
                    "leader_unreachable",
                    f"the leading router at {leader} did not answer ({type(exc).__name__})",
                ),
                status_code=502,
            )
        if answer.status_code == 200 and self.settings.leader_url is not None:
            # Route by the new view at once, rather than on the next poll.
            await membership.follow_once(leader, self._admin_headers())
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type="application/json",
            headers={"x-ringlimit-leader": leader},
        )

    async def admin_join(self, request: Request) -> Response:
        if (refused := self._admin_refused(request)) is not None:
            return refused
        try:
            raw = await read_body(request, 65536)
            member = parse_join(parse_json(raw, self.config))
            if (forwarded := await self._to_leader(request, raw)) is not None:
                return forwarded
            self._check_url_free(member)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        try:
            await self.membership.join(member)
        except MembershipError as exc:
            return JSONResponse(error_body(exc.error, exc.detail), status_code=exc.status)
        return JSONResponse(self.membership.describe())

    def _check_url_free(self, member: Member) -> None:
        """Refuse a join at a URL another member (or this router) answers on: the
        readiness check would refuse it too, but only after a round trip."""
        own = [
            *self.settings.own_urls,
            *([self.settings.advertise] if self.settings.advertise else []),
        ]
        if any(same_url(member.url, url) for url in own):
            raise ApiError(409, "url_is_router", f"{member.url} is this router's own URL")
        others = [*self.membership.view, *self.membership.joining.values()]
        for other in others:
            if other.id != member.id and same_url(other.url, member.url):
                raise ApiError(
                    409, "url_in_use", f"{member.url} is already the URL of node {other.id!r}"
                )

    async def admin_leave(self, request: Request) -> Response:
        if (refused := self._admin_refused(request)) is not None:
            return refused
        if (forwarded := await self._to_leader(request)) is not None:
            return forwarded
        try:
            await self.membership.leave(request.path_params["node_id"])
        except MembershipError as exc:
            return JSONResponse(error_body(exc.error, exc.detail), status_code=exc.status)
        return JSONResponse(self.membership.describe())

    # ------------------------------------------------------------------ operators

    def _hide(self) -> KeyHider:
        privacy = self.config.privacy
        cached = self._hider
        if cached is None or cached[0] is not privacy:
            cached = self._hider = (privacy, KeyHider(privacy, self._salt))
        return cached[1]

    async def _node_reports(self, params: dict[str, str]) -> dict[str, Report]:
        if self._client is None:
            self._client = httpx.AsyncClient()
        return await ask_nodes(
            self._client,
            self.membership.view.members,
            dict(self._token_header),
            params,
            self.settings.admin_timeout,
        )

    async def admin_top(self, request: Request) -> Response:
        """``GET /admin/top?rule=R&n=20``: the most limited keys, merged across nodes."""
        if (refused := self._admin_refused(request)) is not None:
            return refused
        params = request.query_params
        rule = params.get("rule")
        if rule is not None and self.config.rule(rule) is None:
            return JSONResponse(
                error_body("unknown_rule", f"no rule named {rule!r}"), status_code=400
            )
        try:
            n = int(params.get("n", "20"))
            if not 1 <= n <= 1000:
                raise ValueError
        except ValueError:
            return JSONResponse(
                error_body("invalid_n", "n must be an integer from 1 to 1000"), status_code=400
            )
        reports = await self._node_reports({"n": str(n), **({"rule": rule} if rule else {})})
        return JSONResponse(
            {
                "rule": rule,
                "n": n,
                "keys": self.config.privacy.show_keys,
                "near_limit": f"allowed with at most {NEAR_LIMIT_FRACTION:.0%} of the limit left",
                "window_seconds": _window(reports),
                "rules": merge_top(reports, [rule] if rule else None, n, self._hide()),
                "nodes": node_status(reports),
            }
        )

    async def admin_ui(self, request: Request) -> Response:
        """The ring page (router/ui.py). It holds no data and no secret, so it
        needs no token; without an admin token, admin pages are loopback-only."""
        if (
            self.settings.admin_token is None
            and (refused := self._admin_refused(request)) is not None
        ):
            return refused
        return Response(UI_PAGE, media_type="text/html; charset=utf-8", headers=UI_HEADERS)

    async def admin_ui_data(self, request: Request) -> Response:
        """What the ring page shows: nodes, shares, rates, top keys, events."""
        if (refused := self._admin_refused(request)) is not None:
            return refused
        membership = self.membership
        view = membership.view
        reports = await self._node_reports({"n": "10"})
        shares = hash_share(view) if len(view) else {}
        nodes = []
        for entry in membership.describe()["nodes"]:
            report = reports.get(entry["id"])
            nodes.append(
                {
                    **entry,
                    "share": shares.get(entry["id"]),
                    "reachable": report is not None,
                    "rate": number(report, "rate"),
                    "denied_rate": number(report, "denied_rate"),
                    "allowed": number(report, "decisions", "allowed"),
                    "denied": number(report, "decisions", "denied"),
                    "keys": number(report, "keys"),
                    "node_epoch": number(report, "epoch"),
                }
            )
        return JSONResponse(
            {
                "generated_at": time.time(),
                "epoch": view.epoch,
                "keys": self.config.privacy.show_keys,
                "nodes": nodes,
                "totals": {
                    "rate": sum(n["rate"] or 0.0 for n in nodes),
                    "denied_rate": sum(n["denied_rate"] or 0.0 for n in nodes),
                },
                "top": merge_top(reports, None, 10, self._hide()),
                "events": [e.to_dict() for e in membership.events.last(20)],
            },
            headers={"cache-control": "no-store"},
        )


def _window(reports: dict[str, Report]) -> list[float] | None:
    """The history an answer covers: one to two windows of the nodes' sketches."""
    window = next((w for r in reports.values() if (w := number(r, "window")) is not None), None)
    return None if window is None else [window, 2 * window]


def parse_join(data: Any) -> Member:
    """The member an admin join asks for, or an :class:`ApiError` naming the bad field."""
    if not isinstance(data, dict):
        raise ApiError(400, "invalid_request", "body must be an object {id, url, weight}")
    extra = set(data) - {"id", "url", "weight"}
    if extra:
        raise ApiError(
            400, "invalid_request", f"unknown field(s): {', '.join(sorted(map(str, extra)))}"
        )
    for name, check, default in (
        ("id", check_id, None),
        ("url", check_url, None),
        ("weight", check_weight, 1),
    ):
        try:
            check(data.get(name, default))
        except ValueError as exc:
            raise ApiError(400, f"invalid_{name}", str(exc)) from None
    return Member.from_dict({"weight": 1, **data})


@lru_cache(maxsize=65536)
def _quote_key(user: str) -> str:
    """The user id percent-encoded for ``X-Ringlimit-Key`` (users repeat: cached)."""
    return quote(user, safe="")


def _lease_expired(answer: Answer) -> bool:
    return any(k == b"x-ringlimit-unavailable" and v == b"lease" for k, v in answer.headers)


def _complete(results: list[Result | None]) -> list[Result]:
    return [r if r is not None else {} for r in results]


async def _send_json_bytes(send: Send, status: int, payload: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-length", str(len(payload)).encode()),
                (b"content-type", b"application/json"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def _read_all(receive: Receive, limit: int) -> bytes | None:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                await drain(receive)
                return None
            chunks.append(chunk)
        if not message.get("more_body"):
            break
    return b"".join(chunks) if len(chunks) != 1 else chunks[0]


async def _respond(
    send: Send, answer: Answer, node_id: str, extra: list[tuple[bytes, bytes]]
) -> None:
    headers = answer.headers
    headers.append((b"content-length", str(len(answer.body)).encode()))
    headers.append((b"x-ringlimit-node", node_id.encode()))
    if extra:
        headers += extra
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})


def create_router(
    settings: RouterSettings,
    *,
    forwarder: Forwarder | None = None,
    client: httpx.AsyncClient | None = None,
) -> Router:
    """Build a router; the returned object is the ASGI application."""
    return Router(settings, forwarder=forwarder, client=client)
