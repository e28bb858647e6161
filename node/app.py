"""The node's ASGI application.

A node answers four kinds of request:

* anything that is not its own API goes through :class:`RateLimitMiddleware`
  to the application it fronts (echo, upstream, or the user's app);
* ``POST /v1/check``: the decision API (single or batch);
* ``/internal/*``: ring views, state transfers and replicas from the router
  and the other nodes (token-protected, or loopback-only without a token);
* ``/healthz`` and ``/metrics``.

Everything a node holds is created here and passed in: no module-level state.
A node must run as ONE process: it is the single authority for its keys, and
several worker processes would each hold their own counters for the same keys,
multiplying the limit by the number of workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from math import isfinite
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from node.asgi import (
    ASGIApp,
    Receive,
    Scope,
    Send,
    control_app,
    invalid_detail,
    odd_target,
)
from node.authority import Authority
from node.backend import Backend, MemoryBackend
from node.bodies import read_body
from node.clock import Clock, system_clock
from node.config import ClusterConfig
from node.decision import SERVICE_REFUSED_HEADERS, service_refused
from node.failures import Failures
from node.inline import INLINE, in_a_task, in_task, inline_app
from node.lease import LeaseError
from node.leasing import MAX_SETTLE, LeaseDesk, definition, lease_to_dict
from node.memory import release_free_memory
from node.metrics import DictCollector, NodeMetrics
from node.middleware import (
    LEASE_EXPIRED_HEADERS,
    RateLimitMiddleware,
    lease_expired_body,
    not_owner_body,
    not_owner_headers,
)
from node.peers import INTERNAL_TOKEN_HEADER, Peers, WireError, bulk, decode_records
from node.peers import decode as decode_body
from node.rates import RateMeter
from node.rules import Rule
from node.security import (
    bearer,
    from_a_web_page,
    refusal,
    token_matches,
)
from node.shard import InFlight, LeaseExpired, NoLongerMember, NotOwner, Shard, StaleEpoch
from node.store import MemoryStore
from node.topkeys import DEFAULT_CAPACITY, DEFAULT_WINDOW, KINDS, TopKeys
from node.upstream import UPSTREAM_METRICS, UpstreamApp, echo_app
from node.wire import (
    ApiError,
    count_param,
    decode_checks,
    dumps,
    node_batch_body,
    one_param,
    result_dict,
)
from ring import RingView
from ring.member import check_id
from ring.view import check_cluster, check_epoch

log = logging.getLogger("ringlimit.node")

#: Paths a node answers itself; every other one is the application's. (The node's
#: only ``/v1/`` path is ``/v1/check``: the whole ``/v1/`` prefix, taken once,
#: answered an application's ``/v1/users`` 404 through the cluster.)
CONTROL_PREFIXES = ("/internal/",)
CONTROL_PATHS = frozenset({"/v1/check", "/healthz", "/metrics"})

#: Help of the ``ringlimit_handoff_*`` metrics, one per field of ``HandoffStats``.
#: The owner's side of quota leases for hot keys (node/leasing.py, docs/hotkeys.md).
QUOTA_METRICS = {
    "grants": "Quota leases granted with units (POST /internal/quota).",
    "denial_leases": "Quota leases of 0 units: nothing before refill_at.",
    "units_leased": "Units deducted from states at grant time, leased to routers.",
    "units_refunded": "Unused leased units given back to their state.",
    "units_written_off": "Leased units never returned: settled late, or revoked by a ring change.",
}
HANDOFF_METRICS = {
    "keys_sent": "States handed to new owners (handoffs and answered pulls).",
    "keys_received": "States taken over from other nodes (handoffs and pulls).",
    "keys_dropped": "States dropped: their key moved under the reset policy, their new "
    "owner left, or their rule was unknown.",
    "pulls": "Pulls of a key's state from its previous owner on first use.",
    "pull_failures": "Pulls that failed (the key was decided on what this node knew).",
    "replicas_sent": "State copies sent to successors (crash policy replica).",
    "replicas_promoted": "Replicated states taken over after their owner crashed.",
    "replicas_stale": "Replica batches dropped: older than a round already applied from that node.",
    "replicas_dropped": "Copies of keys not held yet not kept (replicas at --max-keys), per copy.",
    "conservative_keys": "States set exhausted after a crash (crash policy conservative).",
    "views_applied": "Ring views this node applied.",
    "last_transfer_seconds": "Duration of this node's most recent outgoing state transfer.",
}
MAX_INTERNAL_BODY = 512 << 20
#: States the sweep looks at in one go (then it lets requests in).
SWEEP_SLICE = 50_000
#: A sweep round looks at this fraction of the store (1/N) at least: a whole pass
#: takes at most N rounds, so a state stays at most its fresh time plus N rounds
#: (N seconds), whatever the rate new keys arrive at. 30: up to 1.5M states a
#: round is the one slice it always was (a state looked at costs ~0.5 us: a tenth
#: of a 10M-key store a second was half a core); past that, memory stays bounded
#: by the rate of new keys times their fresh time plus 30 s.
SWEEP_PASS = 30
#: The most keys one ``/internal/top`` answer lists per rule and kind.
MAX_TOP = 1000


@dataclass
class NodeSettings:
    node_id: str = "n1"
    config: ClusterConfig = field(default_factory=ClusterConfig)
    internal_token: str | None = None
    max_keys: int | None = None
    sweep_interval: float = 1.0
    handoff_wait: float = 5.0
    #: Own a shard of the ring (memory backend). Without it any node decides any key.
    sticky: bool = True
    #: Refuse every key until a router sends a view (a node that is part of a
    #: cluster must not decide on its own, e.g. right after a restart).
    fenced: bool = False
    #: Counters per rule and kind in the top-limited-keys sketch (node/topkeys.py),
    #: the seconds per window, and how many ranks /metrics exports (0: none).
    top_capacity: int = DEFAULT_CAPACITY
    top_window: float = DEFAULT_WINDOW
    top_metrics: int = 10
    #: A Unix socket the node listens on beside its TCP port (node/unixsocket.py):
    #: ``/healthz`` names it, and a router on this host forwards through it.
    unix_socket: str | None = None


class Node:
    """The parts of a running node, wired together (kept for tests and the CLI)."""

    def __init__(
        self,
        settings: NodeSettings,
        *,
        clock: Clock = system_clock,
        store: MemoryStore | None = None,
        backend: Backend | None = None,
        peers: Peers | None = None,
        app: ASGIApp | None = None,
    ) -> None:
        self.settings = settings
        self.clock = clock
        #: This process, among every process started as this node (``/healthz``
        #: says it; the node's join and leave carry it): a second process started
        #: with this node's id and its --url must not pass for it at the router.
        self.instance = secrets.token_hex(8)
        self.store = store if store is not None else MemoryStore(max_keys=settings.max_keys)
        self.backend = backend if backend is not None else MemoryBackend(self.store, clock)
        self.peers = peers if peers is not None else Peers(token=settings.internal_token)
        self.metrics = NodeMetrics(settings.node_id)
        now = clock()
        self.top = TopKeys(settings.top_capacity, settings.top_window, now=now)
        #: Decisions per second (all, and denied) over the last ~10 s, sampled by the sweep.
        self.rates = {"decided": RateMeter(now=now), "denied": RateMeter(now=now)}
        self.shard: Shard | None = None
        if settings.sticky and isinstance(self.backend, MemoryBackend):
            self.shard = Shard(
                settings.node_id,
                self.store,
                clock,
                self.peers,
                lambda: self.authority.config,
                handoff_wait=settings.handoff_wait,
            )
            if settings.fenced:
                self.shard.view = RingView.empty()
        self.authority = Authority(
            settings.config,
            self.backend,
            shard=self.shard,
            metrics=self.metrics,
            node_id=settings.node_id,
            top=self.top,
        )
        self.store.on_store_full = self._on_full(
            self.store, "key cap of %s reached: new keys are not stored (%d so far)"
        )
        #: Without a shard (shared backend) the node still knows the newest epoch it
        #: was sent, so a router does not mistake it for a restarted node.
        self.pushed_epoch = 0
        #: The name of the cluster whose ring this node holds, as its routers'
        #: pushes say (etcd's ``--cluster``); None before one says it.
        self.cluster: str | None = None
        #: This process asked to leave (a signal: node/server.py): its leave's
        #: view is no news to the operator who sent it.
        self.leaving_by_itself = False
        #: A Redis node's local fallback limiter's store (node/redis_backend.py), if any.
        local = getattr(getattr(self.backend, "local", None), "store", None)
        self.fallback_store: MemoryStore | None = (
            local if isinstance(local, MemoryStore) and local is not self.store else None
        )
        if self.fallback_store is not None:
            self.fallback_store.on_store_full = self._on_full(
                self.fallback_store,
                "the local fallback limiter holds its most states (%s): new keys are decided "
                "as fresh and not stored (%d so far)",
            )
        self.metrics.watch(self.held_keys, lambda: self.epoch)
        if settings.top_metrics > 0:
            self.metrics.watch_top(self._top_gauges)
        if self.shard is not None:
            shard = self.shard
            self.metrics.add_counters(
                "ringlimit_handoff",
                HANDOFF_METRICS,
                lambda: {
                    k: v for k, v in shard.stats.__dict__.items() if isinstance(v, int | float)
                },
            )
        #: Errors the node's background loops survived (with the shard's: /metrics).
        self.failures = Failures(log)
        self.metrics.registry.register(
            DictCollector(
                "ringlimit_background_errors",
                "Errors the node's background loops survived: sweep_loop, replication_loop.",
                self._failure_counts,
            )
        )
        fallbacks = getattr(self.backend, "fallbacks", None)
        if fallbacks is not None:
            backend = self.backend
            self.metrics.add_counters(
                "ringlimit_backend_fallback",
                {
                    "decisions": "Decisions made by the local fallback while the backend was "
                    "down, and of checks it answered with an error."
                },
                lambda: {"decisions": getattr(backend, "fallbacks", 0)},
            )
        self.fronted = app if app is not None else echo_app(settings.node_id)
        if isinstance(app, UpstreamApp):
            upstream = app.stats
            self.metrics.add_counters(
                "ringlimit_upstream", UPSTREAM_METRICS, lambda: dict(vars(upstream))
            )
        # A node deciding in memory is started inline by its front door
        # (node/inline.py): an application not its own is called from a task.
        # (Decided here: an app put in ``self.limited.app`` later is called as it
        # is, inline if the request got that far without waiting.)
        inline = type(self.backend) is MemoryBackend
        fronted = self.fronted
        if inline and not getattr(fronted, INLINE, False):
            fronted = in_task(fronted)
        self.limited = RateLimitMiddleware(
            fronted,
            authority=self.authority,
            internal_token=settings.internal_token,
            wall_clock=clock,
        )
        self.control = control_app(self._routes(), self._lifespan)
        if inline:
            inline_app(self)
        #: Quota leases for hot keys granted from this node's store (docs/hotkeys.md).
        self.desk = LeaseDesk()
        self.metrics.add_counters(
            "ringlimit_quota",
            QUOTA_METRICS,
            lambda: {k: float(v) for k, v in self.desk.stats.__dict__.items()},
        )

    @property
    def epoch(self) -> int:
        return self.shard.epoch if self.shard is not None else self.pushed_epoch

    def _on_full(self, store: MemoryStore, message: str) -> Callable[[Any, str], None]:
        """What ``store`` does at a new key past its cap: count a ``store_full``
        error, and say ``message`` (given the cap and the refusals so far) at most
        once per 10 s (Failures.warn): every 1,000th refusal was a line, 50 a
        second on a full node taking 50,000 new keys a second."""

        def full(rule: Any, key: str) -> None:
            self.metrics.error("store_full")
            self.failures.warn("store_full", message, store.max_keys, store.store_full_events)

        return full

    def held_keys(self) -> int:
        """States held in memory: the store's, and a Redis node's fallback limiter's."""
        fallback = 0 if self.fallback_store is None else len(self.fallback_store)
        return len(self.store) + fallback

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            if path == "/v1/check" and scope["method"] == "POST":
                await self.check_asgi(scope, receive, send)  # the hot path: no Starlette
            elif path.startswith(CONTROL_PREFIXES) or path in CONTROL_PATHS:
                await in_a_task()  # Starlette's (streamed answers need a task)
                await self.control(scope, receive, send)
            elif path[:1] != "/":
                await odd_target(scope, receive, send)  # OPTIONS *, CONNECT host:port
            else:
                await self.limited(scope, receive, send)
        else:
            await self.control(scope, receive, send)

    # ------------------------------------------------------------------ lifecycle

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.backend.start()
        tasks = [asyncio.create_task(self._sweep_forever())]
        if self.shard is not None:
            tasks.append(asyncio.create_task(self.shard.run_replication()))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if self.shard is not None:
                await self.shard.close()
            await self.backend.close()
            await self.peers.close()
            close = getattr(self.fronted, "close", None)
            if close is not None:
                await close()

    def _top_gauges(self) -> list[tuple[str, str, int, float]]:
        n = self.settings.top_metrics
        return [
            (rule, kind, position, float(entry.hits))
            for rule in self.top.rules()
            for kind in KINDS
            for position, entry in enumerate(self.top.top(rule, kind, n), start=1)
        ]

    def _totals(self) -> tuple[dict[str, int], float]:
        totals = self.metrics.decision_totals()
        return totals, float(totals.get("allowed", 0) + totals.get("denied", 0))

    def sample(self, now: float) -> None:
        """Once per sweep: rotate the top-keys window, sample the decision rates."""
        self.top.rotate(now)
        totals, decided = self._totals()
        self.rates["decided"].sample(now, decided)
        self.rates["denied"].sample(now, float(totals.get("denied", 0)))

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval)
            try:
                await self.sweep_once()
            except Exception as exc:  # eviction outlives any one failure, never silently
                self.failures.record("sweep_loop", exc)

    async def sweep_once(self) -> None:
        """One round of the sweep loop: sample the rates, evict fresh states (the
        store's, a Redis node's fallback limiter's, the replicas'), forget rules."""
        now = self.clock()
        self.sample(now)
        rules = self.authority.config.rule_map
        await sweep_paced(self.store, now)
        self.store.forget_rules(rules)
        # A Redis node's local fallback limiter keeps the states of the keys
        # it decided during outages: swept the same way.
        sweep_local = getattr(self.backend, "sweep_local", None)
        if sweep_local is not None:
            sweep_local(rules)
        if self.shard is not None:
            # The copies of other members' states, paced as the store is: they
            # arrive as fast as their owners make new keys.
            for replicas in list(self.shard.core.replicas.values()):
                await sweep_paced(replicas, now)
                replicas.forget_rules(rules, keep_states=False)
        release_free_memory()

    def _failure_counts(self) -> dict[str, float]:
        counts: dict[str, float] = dict(self.failures.counts)
        sources = [self.shard.failures] if self.shard is not None else []
        backend_failures = getattr(self.backend, "failures", None)
        if isinstance(backend_failures, Failures):
            sources.append(backend_failures)
        for failures in sources:
            for kind, n in failures.counts.items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    # ------------------------------------------------------------------ routes

    def _routes(self) -> list[Route]:
        return [
            Route("/v1/check", self.check, methods=["POST"]),
            Route("/healthz", self.healthz, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/internal/cluster", self.get_cluster, methods=["GET"]),
            Route("/internal/cluster", self.put_cluster, methods=["PUT"]),
            Route("/internal/import", self.import_states, methods=["POST"]),
            Route("/internal/pull", self.pull, methods=["POST"]),
            Route("/internal/replica", self.replica, methods=["POST"]),
            Route("/internal/status", self.status, methods=["GET"]),
            Route("/internal/lease", self.lease, methods=["POST"]),
            Route("/internal/top", self.top_keys, methods=["GET"]),
            Route("/internal/quota", self.quota, methods=["POST"]),
        ]

    async def check(self, request: Request) -> Response:
        """``POST /v1/check`` through Starlette (kept for the route table; requests
        are answered by :meth:`check_asgi`, which gives the same answers)."""
        refused = self._refused_check(request.scope)
        if refused is not None:
            return JSONResponse(refused.body(), status_code=refused.status)
        config = self.authority.config
        try:
            body = await read_body(request, config.limits.max_body)
        except ApiError as exc:
            self.metrics.error(exc.error)
            return JSONResponse(exc.body(), status_code=exc.status)
        status, headers, payload = await self._answer_checks(body)
        return Response(
            payload,
            status,
            {k.decode(): v.decode() for k, v in headers},
            media_type="application/json",
        )

    async def check_asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/check``, the decision API, as raw ASGI: a router sends every
        batch here, and Starlette's request, routing and middleware layers cost
        more than parsing the batch does."""
        limit = self.authority.config.limits.max_body
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        chunks: list[bytes] = []
        size = 0
        error: ApiError | None = None
        headers: list[tuple[bytes, bytes]]
        # A node's decision API is the routers' (they send it): anyone else reaching
        # the node could spend any user's quota. With an internal token, the token;
        # without one, as the internal endpoints: loopback only, and not for a web
        # page (a page of any site could POST checks here, text/plain needing no
        # preflight, or rebind its name to 127.0.0.1 and read the answers: an
        # exploratory tester's were answered).
        refused = self._refused_check(scope)
        if refused is not None:
            error = refused
        elif declared is not None and declared.isdigit() and int(declared) > limit:
            error = ApiError(
                413, "body_too_large", f"body is {declared.decode()} bytes; at most {limit}"
            )
        # Refused before its body (a token, a declared length): answered at once. The
        # server reads what is left of the body and drops it (a client sending 2 MB
        # with a wrong token waited for all of it, or the body timeout, for its 401).
        while error is None:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client is gone: decide nothing
            chunk = message.get("body", b"")
            if chunk and error is None:
                size += len(chunk)
                if size > limit:
                    error = ApiError(413, "body_too_large", f"body is over {limit} bytes")
                else:
                    chunks.append(chunk)
            if not message.get("more_body"):
                break
        if error is not None:
            self.metrics.error(error.error)
            status, headers, payload = error.status, [], dumps(error.body()).encode()
        else:
            body = b"".join(chunks) if len(chunks) != 1 else chunks[0]
            status, headers, payload = await self._answer_checks(body)
        headers.append((b"content-length", str(len(payload)).encode()))
        headers.append((b"content-type", b"application/json"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})

    def _refused_check(self, scope: Scope) -> ApiError | None:
        """Who may call the decision API: the token's holders when one is set."""
        token = self.settings.internal_token
        if token is not None:
            given = _given_token(Headers(scope=scope))
            if given is None or not token_matches(given, token):
                return ApiError(401, "unauthorized", "missing or wrong internal token")
            return None
        # Open without a token (to routers and tools, on this host or another), but
        # not to a web page.
        if from_a_web_page(scope):
            return ApiError(
                403,
                "forbidden",
                "not for web pages: a page of another site, or one addressed by a name a "
                "page could rebind to this host (use 127.0.0.1 or localhost, or set "
                "RINGLIMIT_INTERNAL_TOKEN)",
            )
        return None

    async def _answer_checks(self, body: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
        """The status, extra headers and JSON body answering a decision-API body."""
        config = self.authority.config
        shard = self.shard
        try:
            if shard is not None and shard.view is not None and not len(shard.view):
                # Fenced (a restarted node before its router's first push) or in an
                # empty ring: it may not know the cluster's rules either, so the body
                # is not read against them. A restarted node's unknown_rule (404)
                # reached Envoy as UNAVAILABLE; this refusal makes a router refresh
                # and retry.
                raise NotOwner("", shard.epoch, None)
            checks, batch = decode_checks(body, config)
            verdicts = await self.authority.decide_many(checks)
        except ApiError as exc:
            self.metrics.error(exc.error)
            return exc.status, [], dumps(exc.body()).encode()
        except NotOwner as exc:
            self.metrics.error("not_owner")
            return 421, not_owner_headers(exc), dumps(not_owner_body(exc)).encode()
        except LeaseExpired as exc:
            self.metrics.error("lease_expired")
            return 503, list(LEASE_EXPIRED_HEADERS), dumps(lease_expired_body(exc)).encode()
        if batch:
            return 200, [], node_batch_body(verdicts, self.settings.node_id)
        verdict = verdicts[0]
        body = dumps(result_dict(verdict, self.settings.node_id)).encode()
        decision = verdict.decision
        if not verdict.allowed and service_refused(decision.reason, decision.retry_after):
            # The proxy path's status for the same denial, and its Retry-After.
            return 503, list(SERVICE_REFUSED_HEADERS), body
        return 200, [], body

    async def healthz(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "node": self.settings.node_id,
                "instance": self.instance,
                "epoch": self.epoch,
                "backend": self.backend.name,
                "backend_available": self.backend.available,
                # Whether it owns its keys (and refuses others): a router that
                # routes by owner needs one, a round-robin router one that does not
                # (router/nodeclient.py _not_for).
                "sticky": self.shard is not None,
                # The etcd cluster whose ring it holds (None: none, or unnamed).
                "cluster": self.cluster,
                "keys": self.held_keys(),
                "config": self.authority.config.digest,
                # Where a router on this host may reach this process without TCP
                # (router/localsockets.py checks it answers as this instance).
                "unix_socket": self.settings.unix_socket,
            }
        )

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.forget_rules(self.authority.config.rule_map)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    # ------------------------------------------------------------------ internal

    async def lease(self, request: Request) -> Response:
        """The router's health probe: renews the lease it offered last time and
        takes a new offer (node/lease.py). Token-protected like every internal
        call: whoever renews a lease vouches that the node is still a member."""
        if (refused := self._refuse(request)) is not None:
            return refused
        shard = self.shard
        data: dict[str, Any] = {
            "node": self.settings.node_id,
            "epoch": self.epoch,
            "backend_available": self.backend.available,
            "config": self.authority.config.digest,
            "cluster": self.cluster,
        }
        if shard is None:
            return JSONResponse(data)  # a shared backend: no shard, no lease
        try:
            body = await self._internal_json(request)
            grant = body.get("grant")
            now = shard.monotonic()
            if grant is not None:
                seconds = body.get("seconds")
                shard.lease.grant(grant, seconds, now)  # type: ignore[arg-type]
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except LeaseError as exc:
            return JSONResponse(
                {"error": "invalid_lease", "detail": str(exc), **data}, status_code=400
            )
        data["lease_left"] = shard.lease.left(now)
        data["token"] = shard.lease.offer(now)
        return JSONResponse(data)

    def _refuse(self, request: Request) -> Response | None:
        """Internal endpoints: the token when configured, otherwise loopback only."""
        given = _given_token(request.headers)
        status = refusal(
            given,
            self.settings.internal_token,
            request.client.host if request.client else None,
            request.headers,
        )
        if status == 403:
            return JSONResponse(
                {
                    "error": "forbidden",
                    "detail": "internal API is loopback-only without a token (not for web pages)",
                },
                status_code=403,
            )
        if status is not None:
            return JSONResponse(
                {"error": "unauthorized", "detail": "missing or wrong internal token"},
                status_code=401,
            )
        return None

    async def _internal_json(self, request: Request) -> dict[str, Any]:
        body = await read_body(request, MAX_INTERNAL_BODY)
        return self._parse_internal(body, request.headers.get("content-type"))

    def _parse_internal(
        self, body: bytes, content_type: str | None, *, records: bool = False
    ) -> dict[str, Any]:
        """A peer's JSON or versioned msgpack (node/peers.py: the wire format);
        with ``records``, a body of states, whose records are checked whole here
        (``ValueError`` naming the first bad one)."""
        try:
            if records:
                limit = self.authority.config.limits.max_key_length
                data = decode_records(body, content_type, limit)
            else:
                data = decode_body(body, content_type)
        except WireError as exc:
            raise ApiError(400, exc.error, str(exc)) from None
        if not isinstance(data, dict):
            raise ApiError(400, "invalid_request", "body must be a JSON object")
        return data

    async def get_cluster(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        view = self.shard.view if self.shard else None
        return JSONResponse(
            {
                "node": self.settings.node_id,
                "ring": view.to_dict() if view is not None else None,
                "config": self.authority.config.to_dict(),
                "cluster": self.cluster,
            }
        )

    async def put_cluster(self, request: Request) -> Response:
        """A router sends the newest view, the previous one, crashes and the config."""
        if (refused := self._refuse(request)) is not None:
            return refused
        try:
            data = await self._internal_json(request)
            config = ClusterConfig.from_dict(data["config"], source="pushed config", strict=False)
            view = RingView.from_dict(data["ring"])
            # Only absent or null is "no previous view": 0, "" or [] skipped its check.
            raw_previous = data.get("previous")
            previous = None if raw_previous is None else _previous_view(raw_previous)
            crashed = data.get("crashed", [])
            if type(crashed) is not list:
                raise ValueError("crashed must be a list of member ids")
            crashed = [check_id(c) for c in crashed]
            wait = data.get("wait", True)
            if type(wait) is not bool:
                raise ValueError(f"wait must be true or false, got {wait!r}"[:120])
            established = data.get("established", False)
            if type(established) is not bool:
                raise ValueError(f"established must be true or false, got {established!r}"[:120])
            lease = data.get("lease")
            if lease is not None and not (
                isinstance(lease, int | float) and not isinstance(lease, bool) and isfinite(lease)
            ):
                raise ValueError(f"lease must be a number of seconds, got {lease!r}")
            cluster = data.get("cluster")
            if cluster is not None:
                cluster = check_cluster(cluster)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            return JSONResponse(
                {"error": "invalid_request", "detail": invalid_detail("cluster update", exc)},
                status_code=400,
            )
        if (foreign := self._foreign_push(cluster)) is not None:
            return foreign
        if cluster is not None:
            self.cluster = cluster
        if self.shard is None:
            if view.epoch < self.pushed_epoch:
                return JSONResponse({"epoch": self.pushed_epoch, "applied": False, "sent": {}})
            self.authority.config = config
            self.pushed_epoch = view.epoch
            return JSONResponse({"epoch": view.epoch, "applied": True, "sent": {}})
        if view.epoch < self.shard.epoch:
            # A stale router: neither its view nor its rules replace newer ones.
            return JSONResponse({"epoch": self.shard.epoch, "applied": False, "sent": {}})
        me = self.settings.node_id
        if (
            self.shard.epoch == 0
            and me in view
            and (established or (previous is not None and me in previous))
        ):
            # This process never held a view, yet it is sent a change of a ring it
            # was a member of already, or a view whose router says every member
            # holds its states (``established``: new rules, a refresh): a member
            # that restarted and lost its states. Taken, the router (which tells a
            # restart by epoch 0) would never know, and its users would start
            # afresh with no crash policy applied. Refused, the router removes it
            # as crashed and it joins again. (A push that says neither, a
            # router's first start, a recovery of a whole cluster restarted or a
            # take-over, is taken as before: see docs/rebalancing.md.)
            return JSONResponse(
                {
                    "error": "restarted",
                    "detail": f"node {me} restarted and holds none of its states: "
                    "remove it as crashed, then let it join again",
                    "epoch": 0,
                },
                status_code=409,
            )
        self.authority.config = config  # the same epoch may carry new rules
        if lease is not None:
            self.shard.lease.required = lease > 0
        applied = self.shard.apply(view, previous, crashed)
        leaving = self.settings.node_id not in view
        me_out = previous is not None and me in previous and me not in crashed
        if applied and leaving and me_out and not self.leaving_by_itself:
            # Said: removed by `ringlimit nodes remove`, a node ran on silently,
            # its /healthz "ok", as if it still served its keys (an exploratory tester).
            log.warning(
                "out of the ring at epoch %d: this node owns no keys now (its states go "
                "to their new owners); it rejoins only if started again with --join",
                view.epoch,
            )
        sent: dict[str, int] = {}
        if applied or (leaving and wait and self.shard.core.undelivered_states()):
            # (The same view again while leaving with states undelivered: try again.)
            if wait:
                sent = await self.shard.deliver()
            else:
                self.shard.spawn(self.shard.deliver())
        if leaving and wait and (left := self.shard.core.undelivered_states()):
            # A leave is graceful only if every state reached its new owner: the
            # router treats a leaving node that answers otherwise as crashed, so
            # that the keys' replicas count (docs/rebalancing.md, Graceful leave).
            # A 200 here made the leave look clean while the states stayed in an
            # outbox that the node, about to exit, would never deliver.
            return JSONResponse(
                {
                    "error": "handoff_incomplete",
                    "detail": f"{left} state(s) could not be handed to their new owners",
                    "epoch": self.shard.epoch,
                    "sent": sent,
                },
                status_code=503,
            )
        return JSONResponse({"epoch": self.shard.epoch, "applied": applied, "sent": sent})

    def _foreign_push(self, cluster: str | None) -> Response | None:
        """A 409 for a push of another named cluster's router while this node is a
        member of its own cluster's ring (its routers' last view lists it).

        Two clusters on one etcd are told apart by name alone: a push of the
        other's ring, at an epoch of its own, was taken (the same epoch as
        config only), and the node then decided by a ring its routers did not
        have (an exploratory tester). A node out of its ring, or never in one,
        takes any cluster's push (restarted empty, it joins any); a node without
        a shard (a shared backend) keeps no view to tell, so it refuses another
        cluster's push until it is restarted."""
        if cluster is None or self.cluster is None or cluster == self.cluster:
            return None
        view = self.shard.view if self.shard is not None else None
        member = view is not None and self.settings.node_id in view
        if not member and self.shard is not None:
            return None
        return JSONResponse(
            {
                "error": "another_cluster",
                "detail": f"node {self.settings.node_id} is a member of cluster "
                f"{self.cluster!r}, not {cluster!r}: remove it there and restart it empty "
                "to move it",
                "epoch": self.epoch,
            },
            status_code=409,
        )

    async def _internal_call(
        self,
        request: Request,
        what: str,
        handle: Callable[[Shard, dict[str, Any]], dict[str, Any]],
        without_shard: dict[str, Any],
        *,
        records: bool = False,
    ) -> Response:
        """One internal call: token or loopback, a JSON object in, 4xx for bad input.
        ``records``: the body carries states, checked before ``handle`` sees them."""
        if (refused := self._refuse(request)) is not None:
            return refused
        if self.shard is None:
            return JSONResponse(without_shard, status_code=409 if "error" in without_shard else 200)
        try:
            body = await read_body(request, MAX_INTERNAL_BODY)
            # A transfer's records: many acyclic lists, decoded, checked and
            # applied with no cyclic GC, and freed before it is on again (node/peers.py).
            with bulk():
                data = self._parse_internal(
                    body, request.headers.get("content-type"), records=records
                )
                answer = handle(self.shard, data)
                del data
            return JSONResponse(answer)
        except StaleEpoch as exc:
            return JSONResponse({"error": "stale_epoch", "detail": str(exc)}, status_code=409)
        except InFlight as exc:
            return JSONResponse({"error": "in_flight", "detail": str(exc)}, status_code=409)
        except NoLongerMember as exc:
            return JSONResponse({"error": "no_longer_member", "detail": str(exc)}, status_code=409)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            return JSONResponse(
                {"error": "invalid_request", "detail": invalid_detail(what, exc)},
                status_code=400,
            )

    async def import_states(self, request: Request) -> Response:
        def handle(shard: Shard, data: dict[str, Any]) -> dict[str, Any]:
            crashes = data.get("crashes", [])
            if type(crashes) is not list or not all(type(c) is dict for c in crashes):
                raise ValueError("crashes must be a list of objects")
            taken = shard.receive(
                _sender(data),
                _epoch(data),
                data["records"],
                _flag(data, "final"),
                crashes,
            )
            return {"taken": taken}

        return await self._internal_call(
            request, "import", handle, {"error": "not_sticky", "detail": "no shard"}, records=True
        )

    async def pull(self, request: Request) -> Response:
        def handle(shard: Shard, data: dict[str, Any]) -> dict[str, Any]:
            keys = data["keys"]
            if type(keys) is not list or not all(type(k) is str for k in keys):
                raise ValueError("keys must be a list of strings")
            records = shard.serve_pull(keys, _sender(data, "to"), _epoch(data))
            if records:
                return {"records": records}
            # Nothing here: the members this node still looked to for these keys
            # may hold them (ShardCore.earlier_owners; the puller asks them next).
            return {"records": records, "from": shard.core.earlier_owners(keys)}

        return await self._internal_call(request, "pull", handle, {"records": []})

    async def replica(self, request: Request) -> Response:
        def handle(shard: Shard, data: dict[str, Any]) -> dict[str, Any]:
            return {"taken": shard.receive_replicas(_sender(data), data["records"], _round(data))}

        return await self._internal_call(request, "replica", handle, {"taken": 0}, records=True)

    async def top_keys(self, request: Request) -> Response:
        """This node's most limited keys per rule, its decision totals and rates.

        What the router merges for ``GET /admin/top`` and the ring page. Keys
        are plain here (an internal endpoint): the router hashes them on the
        way out when ``privacy.show_keys = "hashed"``.
        """
        if (refused := self._refuse(request)) is not None:
            return refused
        params = request.query_params
        try:
            rule = one_param(params, "rule")
            n = count_param(params, "n", 20, MAX_TOP)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        if rule is not None and self.authority.config.rule(rule) is None:
            return JSONResponse(
                {"error": "unknown_rule", "detail": f"no rule named {rule!r}"}, status_code=400
            )
        now = self.clock()
        totals, decided = self._totals()
        top = self.top
        return JSONResponse(
            {
                "node": self.settings.node_id,
                "epoch": self.epoch,
                "keys": self.held_keys(),
                "window": top.window,
                "decisions": totals,
                "rate": round(self.rates["decided"].rate(now, decided), 3),
                "denied_rate": round(
                    self.rates["denied"].rate(now, float(totals.get("denied", 0))), 3
                ),
                "top": top.report([rule] if rule is not None else None, n),
            }
        )

    async def quota(self, request: Request) -> Response:
        """A router asks for a quota lease on a hot key it routes here (docs/hotkeys.md).

        Body: ``{"epoch", "rule", "definition", "key", "want", "cost",
        "settle": [{"lease", "unused"}]}``.
        Fenced exactly like a decision: a key this node does not own at its
        newest epoch is refused with 421 and the epoch, an expired membership
        lease with 503, and an ask made under another epoch with 409 (its
        lease would be revoked on arrival). The units are deducted from the
        key's state at grant time (node/quota.py), so the owner never admits
        what it leased; settlements of spent or ending leases ride along.
        """
        if (refused := self._refuse(request)) is not None:
            return refused
        shard = self.shard
        if shard is None:
            return JSONResponse(
                {"error": "not_sticky", "detail": "leases need a node that owns its keys"},
                status_code=409,
            )
        config = self.authority.config
        try:
            data = await self._internal_json(request)
            epoch = _epoch(data)
            name = data.get("rule")
            rule = config.rule(name) if type(name) is str else None
            if rule is None:
                raise ApiError(400, "unknown_rule", f"no rule named {name!r}"[:160])
            _leasable(rule, data)
            key = data.get("key")
            if type(key) is not str or not key or len(key) > config.limits.max_key_length:
                raise ApiError(400, "invalid_key", "key must be a non-empty string within limits")
            want, cost = data.get("want", 0), data.get("cost", 1)
            if type(want) is not int or not 0 <= want <= rule.capacity:
                raise ApiError(400, "invalid_want", f"want must be an integer 0..{rule.capacity}")
            if type(cost) is not int or not 1 <= cost <= rule.capacity:
                raise ApiError(400, "invalid_cost", f"cost must be an integer 1..{rule.capacity}")
            settle = data.get("settle", [])
            if type(settle) is not list or len(settle) > MAX_SETTLE:
                raise ApiError(400, "invalid_settle", f"settle must be a list of <= {MAX_SETTLE}")
            settlements = []
            for item in settle:
                lease_id = item.get("lease") if type(item) is dict else None
                unused = item.get("unused") if type(item) is dict else None
                if type(lease_id) is not int or type(unused) is not int or unused < 0:
                    raise ApiError(
                        400, "invalid_settle", "each settlement is {lease: int, unused: int >= 0}"
                    )
                settlements.append((lease_id, unused))
            await shard.admit(key, (rule,))
            shard.check_owner(key)  # no await from here on: the grant is atomic
            # New rules may have come in while the admission waited (a handoff):
            # the grant is of the rule in force now, as the router defines it.
            now_rule = self.authority.config.rule(rule.name)
            if now_rule is None:
                raise ApiError(409, "rule_changed", f"rule {rule.name!r} is gone: no lease")
            rule = _leasable(now_rule, data)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except NotOwner as exc:
            return JSONResponse(
                not_owner_body(exc),
                status_code=421,
                headers={k.decode(): v.decode() for k, v in not_owner_headers(exc)},
            )
        except LeaseExpired as exc:
            return JSONResponse(
                lease_expired_body(exc),
                status_code=503,
                headers={k.decode(): v.decode() for k, v in LEASE_EXPIRED_HEADERS},
            )
        except (KeyError, TypeError, ValueError) as exc:
            return JSONResponse(
                {"error": "invalid_request", "detail": invalid_detail("quota ask", exc)},
                status_code=400,
            )
        desk = self.desk
        desk.set_epoch(shard.epoch)
        if epoch != shard.epoch:
            return JSONResponse(
                {
                    "error": "stale_epoch",
                    "detail": f"asked under epoch {epoch}, node is at {shard.epoch}",
                    "epoch": shard.epoch,
                },
                status_code=409,
                headers={"x-ringlimit-epoch": str(shard.epoch)},
            )
        now = self.clock()
        refunded = sum(
            desk.settle(self.store, rule, key, lease_id, unused, now)
            for lease_id, unused in settlements
        )
        lease = desk.grant(self.store, rule, key, now, want, cost)
        return JSONResponse(
            {
                "node": self.settings.node_id,
                "epoch": shard.epoch,
                "lease": None if lease is None else lease_to_dict(lease),
                "refunded": refunded,
            }
        )

    async def status(self, request: Request) -> Response:
        if (refused := self._refuse(request)) is not None:
            return refused
        data: dict[str, Any] = {"node": self.settings.node_id, "keys": self.held_keys()}
        if self.shard is not None:
            data.update(self.shard.status())
        return JSONResponse(data)


def _sender(data: dict[str, Any], field: str = "from") -> str:
    """A peer's member id in an internal call (ring/member.py's rules)."""
    return check_id(data[field])


def _epoch(data: dict[str, Any]) -> int:
    """The epoch of an internal body (ring/view.py's bounds: one a transfer can carry)."""
    return check_epoch(data["epoch"])


def _round(data: dict[str, Any]) -> tuple[int, int] | None:
    """A replica batch's ``round``: [the sender's incarnation, its round number]
    (absent from a sender that does not number its rounds)."""
    value = data.get("round")
    if value is None:
        return None
    if (
        type(value) not in (list, tuple)
        or len(value) != 2
        or not all(type(n) is int and 0 <= n < 2**63 for n in value)
    ):
        raise ValueError(
            f"round must be [incarnation, number], two integers >= 0, got {value!r}"[:120]
        )
    return value[0], value[1]


def _flag(data: dict[str, Any], field: str) -> bool:
    value = data[field]
    if type(value) is not bool:
        raise ValueError(f"{field} must be true or false, got {value!r}"[:120])
    return value


async def sweep_paced(store: MemoryStore, now: float) -> int:
    """Evict ``store``'s fresh states: at least 1/:data:`SWEEP_PASS` of the store
    per round, in slices of :data:`SWEEP_SLICE` with the event loop let
    in between; returns how many went. A fixed slice per round fell behind for
    good once new keys came faster than a slice per round, and the store grew
    without bound."""
    budget = max(SWEEP_SLICE, -(-len(store) // SWEEP_PASS))
    evicted = 0
    while True:
        evicted += store.sweep(now, budget=min(budget, SWEEP_SLICE))
        budget -= SWEEP_SLICE
        if budget <= 0:
            return evicted
        await asyncio.sleep(0)


def create_app(
    settings: NodeSettings,
    *,
    clock: Clock = system_clock,
    store: MemoryStore | None = None,
    backend: Backend | None = None,
    peers: Peers | None = None,
    app: ASGIApp | None = None,
) -> Node:
    """Build a node; the returned object is the ASGI application."""
    return Node(settings, clock=clock, store=store, backend=backend, peers=peers, app=app)


def _given_token(headers: Headers) -> str | None:
    """The internal token a request carries: ``X-Ringlimit-Token``, else a bearer token."""
    return headers.get(INTERNAL_TOKEN_HEADER) or bearer(headers.get("authorization"))


def _leasable(rule: Rule, ask: dict[str, Any]) -> Rule:
    """``rule``, if a quota ask may have a lease of it: ApiError 409 otherwise."""
    if rule.lease != "auto":
        raise ApiError(409, "lease_off", f"rule {rule.name!r} has lease = 'off'")
    # Absent from a router of an earlier version: granted as before.
    if "definition" in ask and ask["definition"] != definition(rule):
        raise ApiError(
            409,
            "rule_changed",
            f"rule {rule.name!r} is defined otherwise here (new rules are on their way): no lease",
        )
    return rule


def _previous_view(data: Any) -> RingView:
    """A push's ``previous`` view; its errors say it is that field (they named the
    ring's fields alone, as if ``ring`` were wrong: an exploratory tester)."""
    try:
        return RingView.from_dict(data)
    except ValueError as exc:
        raise ValueError(f"previous (the view before this one): {exc}") from None
