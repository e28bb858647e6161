"""``RateLimitMiddleware``: rate limiting for any ASGI application.

It is what the node puts in front of the application it serves, and it is
usable on its own::

    app = RateLimitMiddleware(app, rules=["100/minute"])

The middleware never buffers the application's response; it only adds the
rate-limit fields to its start message, or answers 429 itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

from node.asgi import (
    RESPONSE_FIELDS,
    ASGIApp,
    Message,
    Receive,
    Scope,
    Send,
    error_body,
    send_json,
)
from node.authority import Authority
from node.clock import Clock, system_clock
from node.config import ClusterConfig, ScopedRule
from node.decision import (
    BACKEND_ERROR,
    BACKEND_UNAVAILABLE,
    SERVICE_REFUSED_HEADERS,
    Verdict,
    service_refused,
)
from node.headers import (
    DEGRADED_HEADER,
    HeaderCache,
    Rendered,
    denial_response,
    settle_legacy,
)
from node.identity import IdentityResolver, InvalidUserId, header_text, preflight_origin
from node.peers import INTERNAL_TOKEN_HEADER
from node.rules import Rule, parse_rule
from node.security import bypass_matches, is_loopback, token_matches
from node.shard import LeaseExpired, NotOwner

KEY_HEADER = b"x-ringlimit-key"
FAILOVER_HEADER = b"x-ringlimit-failover"
#: A router admitted this request from a quota lease (docs/hotkeys.md): serve, do not decide.
LEASED_HEADER = b"x-ringlimit-leased"
TOKEN_HEADER = INTERNAL_TOKEN_HEADER.lower().encode()
#: Fields a router adds that the application behind a node never sees (and the
#: node's own mark, which only the node may set: a client's is dropped).
_OWN_FIELDS = frozenset({KEY_HEADER, TOKEN_HEADER, FAILOVER_HEADER, LEASED_HEADER, DEGRADED_HEADER})
#: ``X-Ringlimit-Degraded`` of a decision the backend's fallback made, by reason.
_DEGRADED = {BACKEND_UNAVAILABLE: b"backend-unavailable", BACKEND_ERROR: b"backend-error"}
#: What the middleware looks for in a request's fields (see :class:`_Prepared`).
_KEY, _TOKEN, _FAILOVER, _BYPASS, _TIER, _LEASED, _FORGED = range(7)


class _Prepared:
    """What the middleware derives from one configuration: the fields it looks
    for (one dict lookup per request field), the identity resolver and the
    rendered rate-limit fields (node/headers.py's :class:`HeaderCache`)."""

    __slots__ = ("config", "headers", "max_key_length", "resolver", "watched")

    def __init__(self, config: ClusterConfig, resolver: IdentityResolver) -> None:
        self.config = config
        self.resolver = resolver
        self.max_key_length = config.limits.max_key_length
        self.headers = HeaderCache(legacy=config.legacy_headers, legacy_reset=config.legacy_reset)
        # Lowest precedence first: a name that is two things is the earlier one of
        # key, token, failover, bypass, tier (the order the fields were tested in).
        watched: dict[bytes, int] = {}
        tier_name = (config.identity.tier_header or "").lower().encode()
        if tier_name:
            watched[tier_name] = _TIER
        watched[config.bypass_header.lower().encode()] = _BYPASS
        watched[FAILOVER_HEADER] = _FAILOVER
        watched[LEASED_HEADER] = _LEASED
        watched[DEGRADED_HEADER] = _FORGED
        watched[TOKEN_HEADER] = _TOKEN
        watched[KEY_HEADER] = _KEY
        self.watched = watched


class RateLimitMiddleware:
    """Decide every HTTP request before the application sees it.

    Behind a ringlimit router the user id arrives in ``X-Ringlimit-Key``
    (believed only with ``trust_router``, the default when an ``authority`` is
    passed in as a node does, and then only with the internal token when one is
    configured); otherwise it is extracted as the configuration's identity
    section says.

    A refusal (400, 421, 429, 503) is answered without reading the request's
    body: a denied upload is not uploaded first (with ``Expect: 100-continue``
    not at all), and the server drops what the client still sends (a node's
    front door reads a bounded rest, or closes the connection).
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        authority: Authority | None = None,
        rules: Sequence[str | Rule] = (),
        internal_token: str | None = None,
        trust_router: bool | None = None,
        wall_clock: Clock = system_clock,
    ) -> None:
        # Believe X-Ringlimit-Key/-Failover only behind a ringlimit router (a node, which
        # passes its authority in). Standalone, any client could write them and pick
        # another user's quota or skip limiting altogether.
        self.trust_router = authority is not None if trust_router is None else trust_router
        if authority is None:
            parsed = [r if isinstance(r, Rule) else parse_rule(r) for r in rules]
            authority = Authority.in_memory(
                ClusterConfig(rules=tuple(ScopedRule(r) for r in parsed))
            )
        self.app = app
        self.authority = authority
        self.internal_token = internal_token
        #: Unix time, for ``X-RateLimit-Reset`` as a timestamp (``headers.legacy_reset``).
        self.wall_clock = wall_clock
        self._resolver_for: tuple[object, IdentityResolver] | None = None
        self._prepared: _Prepared | None = None

    def _for(self, config: ClusterConfig) -> _Prepared:
        """What the hot path derives from ``config``, derived once per configuration."""
        prepared = self._prepared
        if prepared is None or prepared.config is not config:
            prepared = self._prepared = _Prepared(config, self._resolver(config))
        return prepared

    def _resolver(self, config: ClusterConfig) -> IdentityResolver:
        cached = self._resolver_for
        if cached is None or cached[0] is not config.identity:
            cached = (config.identity, IdentityResolver(config.identity))
            self._resolver_for = cached
        return cached[1]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        authority = self.authority
        config = authority.config
        prepared = self._prepared
        if prepared is None or prepared.config is not config:
            prepared = self._for(config)
        routed_key = token = failover = bypass = tier = leased = None
        forged = False
        watched = prepared.watched
        headers = scope["headers"]
        for name, value in headers:
            kind = watched.get(name)
            if kind is None:
                continue
            if kind == _KEY:
                routed_key = value
            elif kind == _TOKEN:
                token = value
            elif kind == _FAILOVER:
                failover = value
            elif kind == _BYPASS:
                bypass = value
            elif kind == _LEASED:
                leased = value
            elif kind == _FORGED:
                forged = True
            elif tier is None:
                # The first, read as a router reads it (IdentityResolver.tier: UTF-8,
                # else latin-1): the rules it judged the request by are decided here.
                tier = header_text(value)
        if (
            routed_key is not None
            or token is not None
            or failover is not None
            or leased is not None
            or forged
        ):
            # ringlimit's own fields (the internal token above all) never reach the app.
            scope["headers"] = [field for field in headers if field[0] not in _OWN_FIELDS]
        trusted = self.trust_router and (
            token_matches(
                token.decode("latin-1") if token is not None else None, self.internal_token
            )
            if self.internal_token is not None
            # Without a token only a router on this host is believed: a client that
            # reaches the node directly cannot pick another user's key or skip limiting.
            else (routed_key is not None or failover is not None) and _from_loopback(scope)
        )
        if token is not None and not trusted and self.internal_token is not None:
            # A router's request with another internal token than this node's (a
            # token rotated on the router alone): decided as a client's, it was
            # refused 421 not_owner for every key this node does not own, which
            # the router passed on to its clients with the node's internals.
            # Nothing is decided; the router answers as for an unreachable owner.
            if authority.metrics is not None:
                authority.metrics.error("internal_token_refused")
            await send_json(
                send,
                503,
                error_body(
                    "internal_token_refused",
                    "this node requires the cluster's internal token "
                    "(RINGLIMIT_INTERNAL_TOKEN) and the request carried another; nothing "
                    "was decided",
                ),
                TOKEN_REFUSED_HEADERS,
            )
            return
        if failover is not None and trusted:
            # The owner of this key is unreachable and its rules say fail open.
            # Marked on the answer and on the request the application gets.
            degraded = [(DEGRADED_HEADER, failover)]
            scope["headers"] = [*scope["headers"], *degraded]
            await self.app(scope, receive, _adding(send, degraded))
            return
        if leased is not None and trusted:
            # Admitted by the router from a lease the key's owner granted: decided already.
            if routed_key is not None:
                key = unquote(routed_key.decode("latin-1"), errors="replace")
                scope.setdefault("state", {})["ringlimit"] = {"key": key, "leased": True}
            await self.app(scope, receive, send)
            return
        if bypass is not None and bypass_matches(bypass.decode("latin-1"), config.bypass_sha256):
            await self.app(scope, receive, _adding(send, [(b"x-ringlimit-bypass", b"1")]))
            return
        if routed_key is not None and trusted:
            text = routed_key.decode("latin-1")
            user: str | None = unquote(text, errors="replace") if "%" in text else text
        elif scope["method"] == "OPTIONS" and preflight_origin(scope) is not None:
            # A CORS preflight: by its client's address (node/identity.py).
            user = prepared.resolver.preflight_key(scope)
        else:
            try:
                user = prepared.resolver.user(scope)
            except InvalidUserId as exc:
                await send_json(send, 400, error_body("invalid_user_id", str(exc)))
                return
        if not user:
            await send_json(
                send,
                400,
                error_body(
                    "missing_user_id",
                    f"no user id: expected {config.identity.source} {config.identity.name!r}",
                ),
            )
            return
        if len(user) > prepared.max_key_length:
            await send_json(
                send,
                400,
                error_body(
                    "key_too_long",
                    f"user id is {len(user)} characters; at most "
                    f"{config.limits.max_key_length} are allowed",
                ),
            )
            return
        rules = config.rules_for(scope["method"], scope["path"], tier)
        if not rules:
            await self.app(scope, receive, send)
            return
        try:
            # Decided without a coroutine when nothing has to wait (Authority.decide_now);
            # an authority without it (a stand-in) is always awaited.
            verdict = authority.decide_now(user, rules, 1) if type(authority) is Authority else None
            mark = None  # (decide_now decides in memory: never a fallback's decision)
            if verdict is None:
                verdict = await authority.decide(user, rules, 1)
                mark = degraded_mark(verdict)
        except NotOwner as exc:
            await send_json(send, 421, not_owner_body(exc), not_owner_headers(exc))
            return
        except LeaseExpired as exc:
            if authority.metrics is not None:
                authority.metrics.error("lease_expired")
            await send_json(send, 503, lease_expired_body(exc), LEASE_EXPIRED_HEADERS)
            return
        if mark is not None:
            await self._degraded(scope, receive, send, prepared, user, rules, verdict, mark)
            return
        if verdict.allowed:
            state = scope.get("state")  # a server's scope has one: no setdefault's spare {}
            if state is None:
                state = scope["state"] = {}
            state["ringlimit"] = {"key": user, "verdict": verdict}
            extensions = scope.get("extensions")
            added = extensions.get(RESPONSE_FIELDS) if extensions else None
            if added is not None:
                # A node's front door adds the fields itself (node/asgi.py).
                # Keyed by this middleware: one nested in another adds its own.
                added[self] = prepared.headers.rendered(rules, verdict, self.wall_clock())
                await self.app(scope, receive, send)
            else:
                fields = prepared.headers.render(rules, verdict, self.wall_clock())
                await self.app(scope, receive, _adding(send, fields))
            return
        fields = prepared.headers.render(rules, verdict, self.wall_clock())
        status, body, content_type, extra = denial(config, verdict)
        await send_json(send, status, body, (*fields, *extra), content_type)

    async def _degraded(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        prepared: _Prepared,
        user: str,
        rules: tuple[Rule, ...],
        verdict: Verdict,
        mark: bytes,
    ) -> None:
        """Answer a request the backend's fallback decided (Redis down, or its
        error reply to this check): as any other, plus ``X-Ringlimit-Degraded`` on
        the answer and, when allowed, on the request the application gets (and
        ``degraded`` in its ``scope["state"]["ringlimit"]``). Without it a 200
        the node's fresh local limiter admitted looked like one Redis counted; only
        the decision API said ``reason: backend_unavailable``."""
        fields = prepared.headers.rendered(rules, verdict, self.wall_clock())
        marked = Rendered(
            (*fields.fields, (DEGRADED_HEADER, mark)),
            fields.lines + b"%s: %s\r\n" % (DEGRADED_HEADER, mark),
        )
        if not verdict.allowed:
            status, body, content_type, extra = denial(prepared.config, verdict)
            await send_json(send, status, body, (*marked.fields, *extra), content_type)
            return
        state = scope.setdefault("state", {})
        state["ringlimit"] = {"key": user, "verdict": verdict, "degraded": mark.decode()}
        scope["headers"] = [*scope["headers"], (DEGRADED_HEADER, mark)]
        extensions = scope.get("extensions")
        added = extensions.get(RESPONSE_FIELDS) if extensions else None
        if added is not None:
            added[self] = marked
            await self.app(scope, receive, send)
        else:
            await self.app(scope, receive, _adding(send, marked.fields))


def degraded_mark(verdict: Verdict) -> bytes | None:
    """``X-Ringlimit-Degraded``'s value when a backend's fallback decided any of
    ``verdict``'s rules (a rule that can never pass keeps its own reason)."""
    for decision in verdict.decisions:
        mark = _DEGRADED.get(decision.reason) if decision.reason is not None else None
        if mark is not None:
            return mark
    return None


def denial(
    config: ClusterConfig, verdict: Verdict
) -> tuple[int, dict[str, Any], bytes, tuple[tuple[bytes, bytes], ...]]:
    """``(status, body, content type, extra headers)`` of a denied request.

    A rule that fails closed while its backend is down, answered this check
    with an error (backend_error) or found no room for a new key in the store
    (store_full): the service, not the client, is the problem, so 503 rather
    than 429. (An open rule decided by the local fallback carries the same
    reason but a real retry time: that client is over its limit, a 429.) The
    503 says when to try again, as the cluster's other 503s do; a 429's
    ``Retry-After`` is among its rate-limit fields.
    """
    decision = verdict.decision
    if service_refused(decision.reason, decision.retry_after):
        body, content_type = denial_response(verdict, 503, config.denial_format)
        return 503, body, content_type, SERVICE_REFUSED_HEADERS
    body, content_type = denial_response(verdict, 429, config.denial_format)
    return 429, body, content_type, ()


def not_owner_body(exc: NotOwner) -> dict[str, object]:
    return error_body(
        "not_owner",
        "this node does not own the key at its newest ring epoch; refresh the ring and retry",
        epoch=exc.epoch,
        owner=exc.owner,
    )


#: Tells a router that the node decided nothing: the owner is, for now, unavailable.
LEASE_EXPIRED_HEADERS = [(b"x-ringlimit-unavailable", b"lease"), (b"retry-after", b"1")]
#: ... because the router's internal token is not this node's.
TOKEN_REFUSED_HEADERS = [(b"x-ringlimit-unavailable", b"token")]


def lease_expired_body(exc: LeaseExpired) -> dict[str, object]:
    return error_body(
        "lease_expired",
        "this node has not heard from its router within its lease and decides nothing "
        f"until it does ({exc})",
    )


def not_owner_headers(exc: NotOwner) -> list[tuple[bytes, bytes]]:
    return [(b"x-ringlimit-epoch", str(exc.epoch).encode())]


def _from_loopback(scope: Scope) -> bool:
    client = scope.get("client")
    return client is None or _loopback(client[0])


#: ``is_loopback`` parses the address each time; a node sees few distinct peers.
_loopback = lru_cache(maxsize=1024)(is_loopback)


def _adding(send: Send, headers: Sequence[tuple[bytes, bytes]]) -> Send:
    # Not ``async def``: it hands back ``send``'s own awaitable, so a response's
    # messages cost no coroutine of their own.
    def send_with_headers(message: Message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            # A copy: the message is the app's, which may send the same one again.
            app, ours = settle_legacy(message.get("headers", ()), headers)
            message = {**message, "headers": [*app, *ours]}
        return send(message)

    return send_with_headers
