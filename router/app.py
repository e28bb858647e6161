"""The router: the cluster's front door (request dispatch, the proxy, the owner cache).

For every request it extracts the user id, finds the owner on the ring and
forwards the request there (sticky routing), returning the node's answer with
``X-Ringlimit-Node``. A node that refuses a key (it is not the owner at its
newer epoch) makes the router catch up and retry; an unreachable owner makes
each rule's ``on_error`` decide: ``open`` serves the request through the next
node without limiting (marked ``X-Ringlimit-Degraded``), ``closed`` answers 503.

The proxy path is raw ASGI (no Request objects): it is the hot path. So is
the decision API, ``POST /v1/check`` (router/decisions.py). The admin API
(router/admin.py), health and metrics use Starlette.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache, partial
from typing import Any, NamedTuple
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
    control_app,
    error_body,
    odd_target,
    read_all,
    send_json,
)
from node.config import ClusterConfig, Identity
from node.frontdoor import GRPC_DRAIN
from node.headers import denial_response, rate_limit_headers
from node.hopbyhop import HOP_BY_HOP, PLAIN_CONNECTION, connection_options
from node.identity import IdentityResolver, InvalidUserId, preflight_origin
from node.peers import INTERNAL_TOKEN_HEADER
from ring import EmptyRingError, Member, OwnerCache, RingView
from router.admin import AdminAPI, parse_join
from router.coalesce import Coalescer
from router.coordinator import EtcdCoordinator
from router.decisions import DecisionAPI
from router.envoy_config import EnvoyConfig, with_envoy_rules
from router.fastclient import Begun, FastForwarder, _Pool
from router.forward import (
    MAX_ANSWER,
    MAX_ATTEMPTS,
    AiohttpForwarder,
    Answer,
    AnswerTooLarge,
    Forwarder,
    NodeTimeout,
    SchemeForwarder,
    Timeouts,
    Unreachable,
)
from router.leases import ADMIT, DENY, FORWARD, RouterLeases, leased_rule
from router.localsockets import LocalSockets
from router.membership import Membership
from router.metrics import RouterMetrics, merge_workers
from router.protocol import ADMIN_PREFIX, CONTROL_PATHS, ProxyCycle, has_dot_segment
from router.revival import FORGET_AFTER
from router.rotation import Rotation, Search

log = logging.getLogger("ringlimit.router")

#: Request fields the router does not pass on: the hop-by-hop ones, and those it
#: sets itself (``host`` and the framing of the body it forwards).
_NOT_SENT = HOP_BY_HOP | {b"host", b"expect", b"content-length"}
#: The fields that say a request has a body.
_BODY_FRAMING = frozenset({b"content-length", b"transfer-encoding"})
#: Keys whose owner the router remembers (per ring view).
OWNER_CACHE = 100_000

#: A node's answers that :meth:`Router.proxy` looks at before it relays them (a
#: refusal while the ring changes, a lapsed lease or a refused token): the
#: callback path (:meth:`Router.answered_now`) leaves them to it.
_RECONSIDERED = frozenset({421, 503})

__all__ = ["Router", "RouterSettings", "create_router", "parse_join"]


#: A proxied request as the router sends it on, read from the client's once
#: (:meth:`Router._prepare`) for every attempt, whichever way it is proxied
#: (both have its scope): when the router began it (``perf_counter``: the forward's duration);
#: the configuration it is decided under (read once: it may change meanwhile) and
#: its identity resolver; the user; the method; the fields passed on, as bytes
#: (the node's key and the router's own among them); the client's ``host`` (passed
#: on as it came) or None; the path and query as the client sent them; whether it
#: has a body (read by :meth:`Router.proxy`). A tuple: made and unpacked without
#: a Python call, which an object would cost (the request path makes one per request).
_Forward = tuple[
    float,
    ClusterConfig,
    IdentityResolver,
    str,
    str,
    list[tuple[bytes, bytes]],
    bytes | None,
    bytes,
    bool,
]


class _Refusal(NamedTuple):
    """A request refused before it is sent anywhere (400)."""

    #: What the metrics count it as (also the error's name).
    outcome: str
    body: dict[str, Any]


class _Flight:
    """The first attempt of a request :meth:`Router.forward_now` began: its view
    and node; for an ``http://`` node the request as the fast client sends it
    (``pool``, ``payload``) and, once sent (``begun``), its connection and the
    future of its answer (``waiter``: what router/protocol.py's cycle waits on).

    (No ``__init__``: made with its attributes set one by one, it costs no
    Python call.)"""

    __slots__ = ("begun", "member", "payload", "pool", "request", "view", "waiter")

    request: _Forward
    view: RingView
    member: Member
    pool: _Pool | None
    payload: bytes
    begun: Begun | None
    waiter: asyncio.Future[Answer]


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
    #: Seconds after which a member removed as crashed is forgotten (router/revival.py).
    forget_removed_after: float = FORGET_AFTER
    #: Shared membership in etcd (router/coordinator.py); None: this router alone.
    coordinator: EtcdCoordinator | None = None
    #: This router's admin URL as other routers reach it (the leader's address).
    advertise: str | None = None
    timeouts: Timeouts = field(default_factory=Timeouts)
    #: Bytes of a proxied request's body the router holds (``--max-request-body``:
    #: it buffers bodies); ``limits.max_body`` bounds them too, the smaller wins.
    max_buffered_body: int = 1 << 20
    #: Bytes of a node's answer to a proxied request the router holds (it relays
    #: whole answers): past it, ``502 answer_too_large`` (router/forward.py
    #: :class:`AnswerTooLarge`). For the forwarder the router makes; one passed
    #: to :class:`Router` keeps its own.
    max_answer: int = MAX_ANSWER
    health_checks: bool = True
    #: The URLs this router answers on: a join at one of them is refused.
    own_urls: Sequence[str] = ()
    #: Hold single decision-API checks this long (seconds) to send them to their
    #: node as one batch; 0 sends each at once.
    coalesce_window: float = 0.0003
    #: Requests for one node sent together on one connection, at most (router/fastclient.py;
    #: 1: no pipelining).
    pipeline: int = 1
    #: Forward through the Unix socket of a node on this host that offers one and
    #: answers through it as itself (router/localsockets.py); False: TCP always.
    unix_sockets: bool = True
    #: Envoy's rate limit service (router/envoy.py): served on ``grpc_port`` when set.
    envoy: EnvoyConfig | None = None
    grpc_port: int | None = None
    grpc_host: str = "127.0.0.1"
    #: Open gRPC connections at most (None: node/frontdoor.py grpc_connection_cap's
    #: default share of the descriptors), and seconds a new one has to begin
    #: speaking HTTP/2 (the HTTP port's header timeout).
    grpc_max_connections: int | None = None
    grpc_handshake_timeout: float = 10.0
    #: Seconds between the first SIGTERM/SIGINT and the stop, with ``grpc_port``:
    #: health says NOT_SERVING while calls (and HTTP) are still served, so Envoy's
    #: health checks move calls to another router first (router/server.py).
    grpc_drain: float = GRPC_DRAIN
    #: Response headers ShouldRateLimit adds: "draft" (RateLimit fields), "envoy" (x-ratelimit-*).
    envoy_headers: tuple[str, ...] = ()
    #: How long ``/admin/top`` and the ring page wait for each node's answer.
    admin_timeout: float = 2.0
    #: Without a coordinator: the leading router's admin URL, which makes this one a
    #: follower (router/workers.py): admin changes are passed on to it, and its ring
    #: is polled every ``follow_interval`` seconds.
    leader_url: str | None = None
    follow_interval: float = 0.2
    #: The other workers of ``--workers N`` (router/workers.py): name -> admin URL.
    #: ``/metrics`` gathers theirs; a restarted leader recovers the ring from the
    #: nodes their rings name (it may have no state file and no seeds: its nodes
    #: joined it).
    fellows: Mapping[str, str] = field(default_factory=dict)
    #: A leading worker its supervisor started again: it takes the rules the nodes
    #: hold over its flags (else it would push its flags' rules over those applied
    #: at runtime, ``PUT /admin/rules``, the cluster's) and recovers from its fellows;
    #: a state file it cannot read or write is warned of, not fatal (it is at a first start).
    restarted: bool = False
    #: This router's name in ``X-Ringlimit-Router`` on proxied answers (workers: w0, w1...).
    name: str | None = None
    #: Proxied requests without a body skip uvicorn's request cycle (router/protocol.py);
    #: False: every request takes uvicorn's own (for comparison).
    direct_proxy: bool = True


class Router:
    """The router's ASGI application: dispatches each request to the proxy, the
    decision API (:attr:`decisions`), the admin API (:attr:`admin`) or the
    health and metrics endpoints, and owns what they share (the ring's
    membership, the forwarder to the nodes, the owner cache, the metrics)."""

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
            forget_removed_after=settings.forget_removed_after,
            coordinator=settings.coordinator,
            advertise=settings.advertise,
            client=client,
        )
        if settings.envoy is not None:
            self.membership.keep_config = partial(with_envoy_rules, envoy=settings.envoy)
        self.metrics = RouterMetrics()
        self.metrics.watch(lambda: self.membership.view.epoch, lambda: len(self.membership.view))
        self.metrics.watch_membership(
            lambda: self.membership.stats,
            lambda: float(self.membership.suspect_self),
            lambda: float(not self.membership.follows),
        )
        self.metrics.watch_failures(self.membership.failures.snapshot)
        self.membership.view_watchers.append(lambda view: self.metrics.view_changed(view.ids))
        self.metrics.watch_pipelining(lambda: getattr(self.forwarder, "pipelined", {}))
        self.metrics.watch_coalescing(self._coalesced)
        self.metrics.watch_leases(lambda: self.leases.counts)
        self._forwarder: Forwarder | None = None
        self._fast: FastForwarder | None = None
        #: Requests may be forwarded without a task (:meth:`forward_now`): by the fast
        #: client. Read by router/protocol.py, per request.
        self.forwards_now = False
        self.forwarder = forwarder
        #: Read by router/protocol.py, per request.
        self.direct_proxy = settings.direct_proxy
        #: What ``proxy`` reads of the configuration on every request, made from
        #: the configuration object it was last made for (replaced on each change).
        self._config_for: tuple[ClusterConfig, IdentityResolver, bytes] | None = None
        self._turn = itertools.count()
        #: Round-robin mode's turn, past nodes that could not be reached.
        self.rotation = Rotation(search_for=settings.timeouts.refusals)
        self._owners = OwnerCache(OWNER_CACHE)
        #: What authenticates this router to the nodes (their internal token).
        self.token_header = (
            [(INTERNAL_TOKEN_HEADER, settings.internal_token)] if settings.internal_token else []
        )
        self._raw_token_header = [
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in self.token_header
        ]
        self._extra_headers = (
            [(b"x-ringlimit-router", settings.name.encode())] if settings.name else []
        )
        #: Quota leases for hot keys of rules with ``lease = "auto"`` (docs/hotkeys.md).
        self.leases = RouterLeases(
            lambda: self.forwarder, self.token_header, rule_names=lambda: self.config.rule_map
        )
        self.decisions = DecisionAPI(self)
        self.admin = AdminAPI(self, client)
        self.control = control_app(self._routes(), self._lifespan)
        self.grpc_server: Any = None
        #: The port the gRPC service is bound to (when ``grpc_port`` was 0, the one chosen).
        self.grpc_bound: int | None = None
        self.envoy_servicer: Any = None
        #: ``grpc.health.v1`` on the gRPC port (router/grpc_health.py).
        self.grpc_health: Any = None
        #: Said to be stopping (:meth:`begin_stop`): health checks answer so.
        self.stopping = False
        #: Checks of the nodes' Unix sockets, while the router runs (:meth:`start`).
        self.local_sockets: LocalSockets | None = None
        self._local_sockets_task: asyncio.Task[None] | None = None

    def _coalesced(self) -> dict[str, float]:
        coalescer = self.coalescer
        if coalescer is None:
            return {}
        return {"batches": coalescer.batches, "checks": coalescer.items}

    @property
    def coalescer(self) -> Coalescer | None:
        """The decision API's coalescer of single checks (None: each sent at once)."""
        return self.decisions.coalescer

    @coalescer.setter
    def coalescer(self, coalescer: Coalescer | None) -> None:
        self.decisions.coalescer = coalescer

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
            self.forwarder = node_forwarder(self.settings)
        await self.membership.start(
            self.settings.seeds,
            health=self.settings.health_checks,
            fellows=list(self.settings.fellows.values()) if self.settings.restarted else (),
            fellow_headers=self.admin.headers(),
            adopt_config=self.settings.restarted,
            follower=self.settings.leader_url is not None,
            # A worker started again after it served keeps going on a state file
            # it cannot use (warned of): its ring is the nodes' and its fellows'.
            state_required=not self.settings.restarted,
        )
        if self.settings.unix_sockets and self._fast is not None:
            self._check_local_sockets(self._fast)
        if self.settings.leader_url is not None:
            headers = self.admin.headers()
            await self.membership.first_follow(self.settings.leader_url, headers)
            self.membership.follow(self.settings.leader_url, headers, self.settings.follow_interval)
        if self.settings.grpc_port is not None:
            from router.envoy import SERVICE, RateLimitServicer, start_grpc
            from router.grpc_health import RouterHealth

            self.envoy_servicer = RateLimitServicer(
                self,
                self.settings.envoy or EnvoyConfig({}),
                headers=self.settings.envoy_headers,
                api_token=self.settings.api_token,
            )
            self.grpc_health = RouterHealth(lambda: len(self.membership.view) > 0, [SERVICE])
            self.grpc_server, self.grpc_bound = await start_grpc(
                self.envoy_servicer,
                self.settings.grpc_host,
                self.settings.grpc_port,
                self.grpc_health,
                max_connections=self.settings.grpc_max_connections,
                handshake_timeout=self.settings.grpc_handshake_timeout,
            )

    def _check_local_sockets(self, fast: FastForwarder) -> None:
        """Keep ``fast`` going through the Unix sockets of the members that answer
        through theirs as themselves; checked at once when a view brings one."""
        sockets = self.local_sockets = LocalSockets(
            fast, self.membership.nodes.healthz, lambda: list(self.membership.view)
        )
        self.membership.view_watchers.append(sockets.view_changed)
        self._local_sockets_task = asyncio.get_running_loop().create_task(sockets.run())

    def begin_stop(self) -> None:
        """Say the router is stopping while it still serves: gRPC health
        ``NOT_SERVING``, ``/healthz`` 503 ``stopping`` (router/server.py's drain)."""
        self.stopping = True
        if self.grpc_health is not None:
            self.grpc_health.stop()

    async def close(self) -> None:
        self.begin_stop()  # NOT_SERVING through the grace below, if not since the drain
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace=1.0)
            self.grpc_server = None
        if self._local_sockets_task is not None:
            self._local_sockets_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._local_sockets_task
            self._local_sockets_task = None
        await self.leases.close()
        await self.membership.close()
        if self.forwarder is not None:
            await self.forwarder.close()
        await self.admin.close()

    @property
    def forwarder(self) -> Forwarder | None:
        """What sends requests to the nodes (:meth:`start` makes one if none was given)."""
        return self._forwarder

    @forwarder.setter
    def forwarder(self, forwarder: Forwarder | None) -> None:
        # What the request path reads of it, worked out once, not per request.
        self._forwarder = forwarder
        self._fast = _fast_client(forwarder)
        self.forwards_now = self._fast is not None

    @property
    def config(self) -> ClusterConfig:
        return self.membership.config

    def _resolver(self) -> IdentityResolver:
        return self._for_config(self.config)[0]

    def _for_config(self, config: ClusterConfig) -> tuple[IdentityResolver, bytes]:
        """``config``'s identity resolver, and its bypass field's name as it arrives
        (lowercase bytes): made once per configuration, not per request."""
        cached = self._config_for
        if cached is None or cached[0] is not config:
            cached = self._config_for = (
                config,
                IdentityResolver(config.identity),
                config.bypass_header.lower().encode("latin-1"),
            )
        return cached[1], cached[2]

    def _bypass_name(self, config: ClusterConfig) -> bytes:
        """The bypass field's name as it arrives (lowercase bytes)."""
        return self._for_config(config)[1]

    # ------------------------------------------------------------------ ASGI entry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not (
            scope["path"] in CONTROL_PATHS or scope["path"].startswith(ADMIN_PREFIX)
        ):
            if scope["path"][:1] != "/":
                await odd_target(scope, receive, send)  # OPTIONS *, CONNECT host:port
                return
            if scope["path"].startswith("/internal"):
                # The nodes' internal API is never reachable through the front door.
                await send_json(send, 404, error_body("not_found", "no such endpoint"))
                return
            if has_dot_segment(scope["path"]):
                await send_json(
                    send, 400, error_body("invalid_path", "the path has a '.' or '..' segment")
                )
                return
            await self.proxy(scope, receive, send)
        elif scope["type"] == "http" and scope["path"] == "/v1/check":
            if scope["method"] == "POST":
                await self.decisions.check_asgi(scope, receive, send)  # the decision API's hot path
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
        if self.round_robin():
            members = view.members
            if not members:
                raise EmptyRingError(f"cannot place a key: ring at epoch {view.epoch} is empty")
            return self.rotation.next(members)
        # Owners are remembered per view (a dict lookup instead of md5 + bisect).
        return self._owners.owner(view, key)

    def passed_on(self, view: RingView, member: Member) -> bool:
        """Whether a request ``member`` could not be reached for goes to another
        node: in round-robin mode any node decides any key, and an unreachable
        one decided nothing (router/rotation.py). Sticky routing: never."""
        if not self.round_robin():
            return False
        return self.rotation.failed(member, view.members)

    def round_robin(self) -> bool:
        """Whether any node decides any key now: a shared backend (Redis) that is up."""
        membership = self.membership  # (not through the config property: every request's)
        return membership.config.balance == "round-robin" and not membership.backend_degraded

    def owner_map(self, view: RingView) -> dict[str, Member]:
        """The remembered owners under ``view`` (empty in round-robin mode: pick each)."""
        if self.round_robin():
            return {}
        return self._owners.known(view)

    def _prepare(self, scope: Scope) -> _Forward | _Refusal:
        """What a proxied request is sent on as, read from the client's request
        once (identity, the fields passed on, the node's key, the target), or
        why it is refused (400): the first step of both ways a request is
        proxied, :meth:`proxy` and :meth:`forward_now`, so one definition. Does
        not read a body (:meth:`proxy` does, for a request that has one) nor
        count a refusal (whoever answers it does)."""
        started = time.perf_counter()
        config = self.membership.config  # (``self.config`` without the property's call)
        resolver, bypass_name = self._for_config(config)
        try:
            user = resolver.user(scope)
        except InvalidUserId as exc:
            return _Refusal("invalid_user_id", error_body("invalid_user_id", str(exc)))
        if scope["method"] == "OPTIONS" and preflight_origin(scope) is not None:
            # A CORS preflight: decided by its client's address, never charged to
            # a user (node/identity.py preflight_origin).
            user = resolver.preflight_key(scope)
        if not user:
            identity = config.identity
            return _Refusal(
                "missing_user_id",
                error_body(
                    "missing_user_id",
                    f"no user id: expected {identity.source} {identity.name!r} "
                    "(or set identity.fallback_to_client)",
                ),
            )
        if len(user) > config.limits.max_key_length:
            return _Refusal(
                "key_too_long",
                error_body(
                    "key_too_long",
                    f"user id is {len(user)} characters; at most {config.limits.max_key_length}",
                ),
            )
        # Clients may not send ringlimit's internal fields, except the bypass token
        # (whose default name also starts with x-ringlimit-): the node checks it.
        forwarded_for = host = None
        raw: list[tuple[bytes, bytes]] = []
        framed = False
        connection: list[bytes] | None = None
        for header in scope["headers"]:
            k = header[0]
            if k == b"x-forwarded-for":
                # Several fields are one list, in order (RFC 9110 5.3).
                forwarded_for = (
                    header[1] if forwarded_for is None else forwarded_for + b", " + header[1]
                )
            elif k not in _NOT_SENT and (not k.startswith(b"x-ringlimit-") or k == bypass_name):
                raw.append(header)
            elif k in _BODY_FRAMING:
                framed = True
            elif k == b"connection":
                if header[1] not in PLAIN_CONNECTION:
                    connection = [header[1]] if connection is None else [*connection, header[1]]
            elif k == b"host":
                # Passed on as it came (the node's address is the router's business):
                # an application builds its absolute URLs, redirects among them,
                # from the host its client asked for.
                host = header[1]
        if connection is not None:
            # Fields the client meant for this hop only (node/hopbyhop.py), except
            # those the cluster decides by.
            listed = connection_options(connection) - _decided_by(config.identity)
            if listed:
                raw = [header for header in raw if header[0] not in listed]
                if b"x-forwarded-for" in listed:
                    forwarded_for = None
        # Percent-encoded: ASCII on the wire whatever the forwarder's header encoding,
        # so the node decides exactly the key the router placed on the ring.
        raw.append((b"x-ringlimit-key", _quote_key(user)))
        raw += self._raw_token_header
        client = scope.get("client")
        if client:
            # One X-Forwarded-For, the client's chain with its peer appended.
            peer = client[0].encode("latin-1")
            chain = forwarded_for + b", " + peer if forwarded_for else peer
            raw.append((b"x-forwarded-for", chain))
        elif forwarded_for:
            raw.append((b"x-forwarded-for", forwarded_for))
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        method: str = scope["method"]
        return started, config, resolver, user, method, raw, host, target, framed

    def _fast_request(
        self,
        fast: FastForwarder,
        member: Member,
        method: str,
        target: bytes,
        raw: list[tuple[bytes, bytes]],
        body: bytes,
        host: bytes | None,
    ) -> tuple[_Pool, bytes]:
        """What :meth:`FastForwarder.request` would send ``member`` for a request
        (:data:`_Forward`'s fields), built from the client's bytes: the node's pool
        and the whole request."""
        pool, prefix = fast.base(member.url)
        payload = fast.payload(
            method.encode(), prefix.encode() + target if prefix else target, pool, raw, body, host
        )
        return pool, payload

    def _deliver(
        self, send: Send, member: Member, answer: Answer, started: float
    ) -> Callable[[], Awaitable[None]] | None:
        """A node's answer to a proxied request, counted and sent to the client (the
        last step of both ways a request is proxied): None when it left now, else
        what sends it, to await (the client's connection is not taking writes)."""
        self.metrics.forwarded(member.id, answer.status, time.perf_counter() - started)
        return _respond(send, answer, member.id, self._extra_headers)

    def forward_now(self, cycle: ProxyCycle) -> _Flight | Callable[[], Awaitable[None]] | None:
        """Forward a request of router/protocol.py's direct path without a task of
        its own, if it is the common one: no body, no lease, the fast client, its
        node's ``http://`` pool with a connection that takes it now (an idle one,
        or with ``--pipeline``, the one filling in this event-loop step:
        :meth:`FastForwarder.begin`). Then the request is sent here and its answer
        comes to :meth:`answered_now` (a callback of its future): the flight
        returned.

        Why: a task per request (created, first scheduled, its coroutines' frames,
        its wakeup) was a fair part of what a forward costs the router (Python
        3.11 has no eager tasks); docs/performance.md has the figures.

        Otherwise a task serves it, with exactly :meth:`proxy`'s semantics: from
        where this left it (returned: the request prepared, perhaps its node
        picked, whose round-robin turn is not taken twice), or None: from the
        start (no fast client: nothing done here)."""
        fast = self._fast
        if fast is None:
            return None
        scope = cycle.scope
        request = self._prepare(scope)
        if isinstance(request, _Refusal):
            return partial(self.proxy, scope, cycle.receive, cycle.send, request)
        _, config, _, user, method, raw, host, target, framed = request
        if framed or config.leasing:
            return partial(self.proxy, scope, cycle.receive, cycle.send, request)
        view = self.membership.view
        try:
            member = self.pick(view, user)
        except EmptyRingError:
            return partial(self.proxy, scope, cycle.receive, cycle.send, request)
        flight = _Flight()
        flight.request = request
        flight.view = view
        flight.member = member
        flight.pool = None
        flight.begun = None
        if member.url.startswith("http://"):
            flight.pool, flight.payload = pool, payload = self._fast_request(
                fast, member, method, target, raw, b"", host
            )
            begun = fast.begin(pool, payload, method == "HEAD")
            if begun is not None:
                flight.begun = begun
                flight.waiter = begun[1]
                return flight
        return partial(self.proxy, scope, cycle.receive, cycle.send, request, flight)

    def answered_now(
        self, cycle: ProxyCycle, flight: _Flight
    ) -> Callable[[], Awaitable[None]] | None:
        """The node's answer to a request :meth:`forward_now` sent (its future is
        done): relayed here when it is a plain answer and the client's connection
        takes it now (None). Anything else continues in a task, from the same
        point, in :meth:`proxy` (returned): an exception (the retry on a fresh
        connection, a timeout's 504, an unreachable node's ``on_error``), a node's
        refusal while the ring changes (421) or a 503 that may be a lapsed lease or
        a refused token, and an answer the client's connection cannot take yet."""
        try:
            answer = flight.waiter.result()
        except Exception:
            answer = None
        if answer is not None and answer.status not in _RECONSIDERED:
            started = flight.request[0]  # (when the router began it: _Forward's first)
            return self._deliver(cycle.send, flight.member, answer, started)
        return partial(self.proxy, cycle.scope, cycle.receive, cycle.send, flight.request, flight)

    async def proxy(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        prepared: _Forward | _Refusal | None = None,
        flight: _Flight | None = None,
    ) -> None:
        """Proxy a request to its node: the general way, any request, any forwarder.

        ``prepared``: the request as :meth:`_prepare` made it, and ``flight``: its
        first attempt's node (and the request sent there, perhaps answered), when
        :meth:`forward_now` began it and a task goes on from there."""
        request = self._prepare(scope) if prepared is None else prepared
        if isinstance(request, _Refusal):
            self.metrics.outcome("-", request.outcome)
            await send_json(send, 400, request.body)
            return
        started, config, resolver, user, method, raw, host, target, framed = request
        body = b""
        if framed:
            # (A request with a body is never begun by forward_now.)
            read = await self._read_body(scope, config, receive, send)
            if read is None:
                return  # refused (413)
            body = read
        forwarder = self._forwarder
        assert forwarder is not None
        # The fast client, driven directly for http:// members (the router's own
        # forwarder, or one given that is a fast client).
        fast = self._fast
        # The forwarder's fields as text (latin-1: the client's bytes), for any other
        # forwarder or member and for a failover; the fast client gets the bytes.
        headers: list[tuple[str, str]] | None = None
        if (
            flight is None
            and config.leasing
            and await self._leased(
                scope,
                send,
                config,
                resolver,
                user,
                method,
                target.decode("latin-1"),
                raw,
                body,
                started,
                host,
            )
        ):
            return
        membership = self.membership
        member: Member | None = None
        #: Sends refused while the ring changes; nodes passed over as unreachable are
        #: the search's to bound (router/rotation.py), made at the first.
        refused = 0
        search: Search | None = None
        while refused < MAX_ATTEMPTS:
            if refused and time.perf_counter() - started > self.settings.timeouts.refusals:
                break
            # The first attempt's node and request may have been made (forward_now).
            first, flight = flight, None
            if first is not None:
                view = first.view
                member = first.member
            else:
                view = membership.view
                try:
                    member = self.pick(view, user)
                except EmptyRingError:
                    await send_json(send, 503, error_body("no_nodes", "the ring has no nodes"))
                    return
            try:
                if fast is not None and member.url.startswith("http://"):
                    if first is not None and first.pool is not None:
                        pool, payload, begun = first.pool, first.payload, first.begun
                    else:
                        pool, payload = self._fast_request(
                            fast, member, method, target, raw, body, host
                        )
                        begun = None
                    answer = await fast.send(pool, payload, method == "HEAD", begun=begun)
                else:
                    if headers is None:
                        headers = _text(raw, host)
                    # (latin-1: the client's bytes, for the text forwarders)
                    path_qs = target.decode("latin-1")
                    answer = await forwarder.request(method, member.url + path_qs, headers, body)
            except AnswerTooLarge as exc:
                await self._not_answered(send, member, exc)  # decided, not for on_error
                return
            except NodeTimeout as exc:
                # Sent, unanswered (in time, or its connection closed first): the
                # node may have decided (and passed the request on to the
                # application), so it is never sent again. A rule
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
                        f"node {member.id} {exc.what}",
                        **({"rule": closed.name} if closed is not None else {}),
                    ),
                    [(b"x-ringlimit-node", member.id.encode())]
                    if closed is None
                    else [(b"retry-after", b"1"), (b"x-ringlimit-node", member.id.encode())],
                )
                return
            except Unreachable as exc:
                if await self.membership.newer_view(member):
                    refused += 1
                    continue  # our view was stale: the key has another owner now
                if self.passed_on(view, member):
                    if search is None:
                        search = self.rotation.search()
                    if search.again(len(view)):
                        continue  # round-robin: the next node decides it
                unreachable: str | None = str(exc)
            else:
                # (_RECONSIDERED: the statuses looked at here before relaying.)
                if answer.status == 421 and await self.stale(answer, member):
                    refused += 1
                    continue
                unreachable = None
                why = answer.unavailable() if answer.status == 503 else None
                if why == b"lease":
                    # The owner decided nothing (it has not heard from a router within
                    # its lease): as if it were unreachable. Perhaps it was removed and
                    # this router has not been told: look for a newer view first.
                    if await self.membership.newer_view(member):
                        refused += 1
                        continue
                    if await self.membership.renew_lapsed(member):
                        refused += 1
                        continue  # renewed (this router was paused): it decides again
                    self.metrics.outcome(member.id, "lease_expired")
                    unreachable = "lease expired"
                elif why == b"token":
                    # The owner refused this router's internal token: as if it were
                    # unreachable (its on_error decides), and said in the log.
                    self.metrics.outcome(member.id, "token_refused")
                    self.membership.token_refused(member)
                    unreachable = "refused this router's internal token"
            if unreachable is not None:
                await self._owner_unreachable(
                    scope,
                    send,
                    view,
                    member,
                    user,
                    method,
                    target.decode("latin-1"),
                    _text(raw, host),
                    body,
                    unreachable,
                    search,
                )
                return
            later = self._deliver(send, member, answer, started)
            if later is not None:
                await later()
            return
        self.metrics.outcome(member.id if member else "-", "ring_changing")
        await send_json(
            send,
            503,
            error_body("ring_changing", "the ring is changing; retry shortly"),
            [(b"retry-after", b"1")],
        )

    async def _read_body(
        self, scope: Scope, config: ClusterConfig, receive: Receive, send: Send
    ) -> bytes | None:
        """The body of a request that has one; None when it is refused (413,
        answered here)."""
        # The configured client limit applies to proxied bodies too (the router
        # buffers them).
        buffered = self.settings.max_buffered_body
        max_body = min(buffered, config.limits.max_body)
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > max_body:
            body = None  # refused unread (the front door drains what comes)
        else:
            body = await read_all(receive, max_body)
        if body is None:
            self.metrics.outcome("-", "body_too_large")
            bound = (
                "--max-request-body"
                if buffered < config.limits.max_body
                else "max_body"
                if buffered > config.limits.max_body
                else "--max-request-body and max_body"
            )
            await send_json(
                send,
                413,
                error_body("body_too_large", f"request body is over {max_body} bytes ({bound})"),
            )
        return body

    async def _leased(
        self,
        scope: Scope,
        send: Send,
        config: ClusterConfig,
        resolver: IdentityResolver,
        user: str,
        method: str,
        path_qs: str,
        raw: list[tuple[bytes, bytes]],
        body: bytes,
        started: float,
        host: bytes | None,
    ) -> bool:
        """Answer from a quota lease when the request's one rule leases (True: answered).

        Admitted: served through the next node in turn other than the owner,
        marked ``X-Ringlimit-Leased`` (believed with the internal token only),
        so the owner neither decides nor proxies it. Denied: a 429 from here,
        with a node's headers and body. Otherwise False: forward as usual.
        ``raw``: the fields passed on, as bytes (made text only to serve an
        admitted request: most requests here are forwarded as usual), and
        ``host`` the client's, passed on with them.
        """
        rule = leased_rule(config.rules_for(method, scope["path"], resolver.tier(scope)))
        if rule is None or config.balance != "sticky":
            return False
        if config.bypass_sha256 and self._bypass_name(config) in (k for k, _ in raw):
            # A bypass token is checked by the owner, which skips limiting for it:
            # decided here from a lease, it was denied or spent the user's units.
            return False
        view = self.membership.view
        if not view.members:
            return False
        leases = self.leases
        now = leases.clock()
        outcome = leases.decide(rule, user, view.epoch, now)
        owner = self.pick(view, user)
        leases.note(rule, user, owner, view.epoch, now, outcome == FORWARD)
        if outcome == FORWARD:
            return False
        verdict = leases.verdict(rule, user, outcome == ADMIT, now)
        limit_headers = rate_limit_headers(
            (rule,),
            verdict,
            legacy=config.legacy_headers,
            legacy_reset=config.legacy_reset,
            now=time.time(),
        )
        if outcome == DENY:
            self.metrics.outcome("-", "lease_denied")
            denial, content_type = denial_response(verdict, 429, config.denial_format)
            # As the owner's own 429 names it: the authority whose lease decided.
            named = [*limit_headers, (b"x-ringlimit-node", owner.id.encode()), *self._extra_headers]
            await send_json(send, 429, denial, named, content_type)
            return True
        assert self.forwarder is not None
        others = [m for m in view.members if m.id != owner.id] or [owner]
        turn = next(self._turn)
        marked = [*_text(raw, host), ("x-ringlimit-leased", rule.name)]
        for i in range(len(others)):
            member = others[(turn + i) % len(others)]
            try:
                answer = await self.forwarder.request(method, member.url + path_qs, marked, body)
            except NodeTimeout as exc:
                await self._not_answered(send, member, exc)
                return True
            except Unreachable:
                continue  # the unit is spent here: serve it through another node
            self.metrics.outcome(member.id, "lease_admitted")
            self.metrics.forwarded(member.id, answer.status, time.perf_counter() - started)
            later = _respond(send, answer, member.id, [*self._extra_headers, *limit_headers])
            if later is not None:
                await later()
            return True
        await send_json(send, 503, error_body("no_nodes", "no node could serve the request"))
        return True

    async def _not_answered(self, send: Send, member: Member, exc: NodeTimeout) -> None:
        """The node was sent the request and its whole answer did not come back:
        ``504 node_timeout``, or ``502 answer_too_large`` when it answered more
        than the router holds. Either way it may have decided: not sent again."""
        too_large = isinstance(exc, AnswerTooLarge)
        error = "answer_too_large" if too_large else "node_timeout"
        self.metrics.outcome(member.id, error)
        await send_json(
            send,
            502 if too_large else 504,
            error_body(error, f"node {member.id} {exc.what}"),
            [(b"x-ringlimit-node", member.id.encode())],
        )

    async def stale(self, answer: Answer, member: Member) -> bool:
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
        search: Search | None = None,
    ) -> None:
        """The rules' ``on_error`` answers for a node that could not decide: a closed
        rule 503, an open one the request served through another node, unlimited.
        In round-robin mode, not through a node found unreachable a moment ago, and
        not past the end of the request's ``search`` for a reachable node: each was
        a connect timeout, for nodes the search had just tried."""
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
        rotating = self.round_robin()
        for other in view.successors(user, len(view)):
            if other.id == member.id or (rotating and self.rotation.skipped(other)):
                continue
            if search is not None and search.over():
                break
            try:
                answer = await self.forwarder.request(  # type: ignore[union-attr]
                    method,
                    other.url + path_qs,
                    [*headers, ("x-ringlimit-failover", "owner-unreachable")],
                    body,
                )
            except Unreachable:
                if rotating:
                    self.rotation.failed(other, view.members)
                continue
            except AnswerTooLarge as exc:
                await self._not_answered(send, other, exc)
                return
            except NodeTimeout:
                break
            later = _respond(send, answer, other.id, self._extra_headers)
            if later is not None:
                await later()
            return
        await send_json(send, 502, error_body("no_node_available", f"no node answered ({reason})"))

    # ------------------------------------------------------------------ control routes

    def _routes(self) -> list[Route]:
        return [
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            *self.admin.routes(),
        ]

    async def healthz(self, request: Request) -> Response:
        view = self.membership.view
        degraded = self.membership.backend_degraded
        balance = self.config.balance
        # "stopping": draining (router/server.py), still serving but going away.
        status = "stopping" if self.stopping else "ok" if len(view) else "no_nodes"
        return JSONResponse(
            {
                "status": status,
                "epoch": view.epoch,
                "nodes": len(view),
                "backend_degraded": degraded,
                "balance": "sticky" if degraded else balance,
            },
            status_code=200 if status == "ok" else 503,
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        """This router's metrics; a worker's, with ``--workers``, gathers every
        worker's (router/metrics.py :func:`merge_workers`) unless asked for its
        own (``?scope=worker``)."""
        self.metrics.forget_departed(self.membership.view.ids)
        fellows = self.settings.fellows
        own = self.metrics.render(self.settings.name if fellows else None)
        if fellows and request.query_params.get("scope") != "worker":
            names = list(fellows)
            texts = await asyncio.gather(*(self._worker_metrics(fellows[n]) for n in names))
            own = merge_workers(
                {self.settings.name or "?": own, **dict(zip(names, texts, strict=True))}
            )
        return Response(own, media_type="text/plain; version=0.0.4")

    async def _worker_metrics(self, admin_url: str) -> bytes | None:
        """Another worker's own metrics; None if it does not answer in time."""
        try:
            response = await self.membership.client.get(
                admin_url.rstrip("/") + "/metrics",
                params={"scope": "worker"},
                timeout=self.settings.admin_timeout,
            )
        except httpx.HTTPError:
            return None
        return response.content if response.status_code == 200 else None


def node_forwarder(settings: RouterSettings) -> SchemeForwarder:
    """The forwarder a router makes for itself: router/fastclient.py speaks plain
    http only, aiohttp also https, for whichever members are (whatever the
    seeds: members join later, or come from a state file)."""
    return SchemeForwarder(
        FastForwarder(
            timeouts=settings.timeouts, pipeline=settings.pipeline, max_answer=settings.max_answer
        ),
        lambda: AiohttpForwarder(timeouts=settings.timeouts, max_answer=settings.max_answer),
    )


def _text(raw: list[tuple[bytes, bytes]], host: bytes | None = None) -> list[tuple[str, str]]:
    """Header fields as the forwarders take them: latin-1 text of their bytes,
    the client's ``host`` first when it sent one."""
    fields = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in raw]
    if host is not None:
        fields.insert(0, ("host", host.decode("latin-1")))
    return fields


@lru_cache(maxsize=16)
def _decided_by(identity: Identity) -> frozenset[bytes]:
    """Fields a client's ``Connection`` cannot take away: the user id's and the
    tier's. The router reads them before it drops anything and the node after;
    dropped between the two (``Connection: X-User-Tier``), a user would escape
    every tier-scoped rule on the node while the router judged by the tier
    (Traefik's CVE-2024-45410 is this class of flaw)."""
    names = [identity.name] if identity.source == "header" else []
    if identity.tier_header:
        names.append(identity.tier_header)
    return frozenset(name.lower().encode("latin-1") for name in names)


@lru_cache(maxsize=65536)
def _quote_key(user: str) -> bytes:
    """The user id percent-encoded for ``X-Ringlimit-Key`` (users repeat: cached)."""
    return quote(user, safe="").encode()


def _fast_client(forwarder: Forwarder | None) -> FastForwarder | None:
    """The fast client, driven directly for ``http://`` members: the router's own
    forwarder's, or one given that is a fast client."""
    if type(forwarder) is SchemeForwarder:
        return forwarder.fast
    if type(forwarder) is FastForwarder:
        return forwarder
    return None


def _respond(
    send: Send, answer: Answer, node_id: str, extra: list[tuple[bytes, bytes]]
) -> Callable[[], Awaitable[None]] | None:
    """Send a node's ``answer`` to the client, marked with the node (and ``extra``):
    at once when it can go now (None; router/protocol.py's cycle, whose client
    takes writes), else what sends it, to await (not itself a coroutine: none
    made for an answer that leaves at once, nor a layer more per forward)."""
    headers = answer.headers
    cycle = getattr(send, "__self__", None)
    if type(cycle) is ProxyCycle:
        # router/protocol.py: the answer leaves in one write, sized there (the
        # forwarders drop a node's connection and content-length fields).
        headers.append((b"x-ringlimit-node", node_id.encode()))
        if extra:
            headers += extra
        return cycle.relay_now(answer.status, headers, answer.body, answer.sized)
    if not answer.sized:
        headers.append((b"content-length", str(len(answer.body)).encode()))
    headers.append((b"x-ringlimit-node", node_id.encode()))
    if extra:
        headers += extra
    return partial(_send_answer, send, answer.status, headers, answer.body)


async def _send_answer(
    send: Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes
) -> None:
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_router(
    settings: RouterSettings,
    *,
    forwarder: Forwarder | None = None,
    client: httpx.AsyncClient | None = None,
) -> Router:
    """Build a router; the returned object is the ASGI application."""
    return Router(settings, forwarder=forwarder, client=client)
