"""The router's admin API: ``/admin/*``.

Ring membership (``GET /admin/ring``, ``POST /admin/nodes``, ``DELETE
/admin/nodes/{id}``) and the rules (``GET``/``PUT /admin/rules``), changes
passed on to the leading router when this one does not lead; the most
limited keys merged across nodes (``GET /admin/top``) and the ring page
(``/admin/ui``). Token-protected (``admin_token``), or loopback-only
without a token (node/security.py's one access check).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from node.asgi import error_body
from node.bodies import read_body
from node.config import HIDDEN_SALT, ClusterConfig, ConfigError, Privacy
from node.peers import CONTROL_LIMITS, INSTANCE_HEADER
from node.security import bearer, refusal
from node.topkeys import NEAR_LIMIT_FRACTION
from node.wire import ApiError, count_param, flag_param, one_param, parse_json
from ring import Member
from ring.analysis import hash_share
from ring.errors import names_text
from ring.member import check_id, check_url, check_weight, same_url
from router.coordinator import CoordinatorError
from router.membership import MembershipError
from router.top import KeyHider, Report, ask_nodes, merge_top, node_status, number, random_salt
from router.ui import HEADERS as UI_HEADERS
from router.ui import PAGE as UI_PAGE

if TYPE_CHECKING:
    from router.app import Router

log = logging.getLogger("ringlimit.router")

#: A call passed to the leading router: how often the lead is looked at while it
#: waits (etcd), and how many moves of the lead it follows before ``503 no_leader``.
LEADER_LOOK = 0.25
LEADER_MOVES = 3
#: ... and how long it waits, at most, while nobody leads (or this router is
#: taking the lead), before ``503 no_leader``: an election is about a ttl.
NO_LEADER_WAIT = 10.0
#: A call passed to a leader that takes no connection waits for the lead to move
#: at most the coordinator's ttl and this many seconds more (etcd revokes expired
#: leases from a loop every 0.5 s; the next router then wins its election).
DEAD_LEADER_SLACK = 2.0
#: The headers of a call passed to the leading router (lower case, as Starlette
#: gives them): a node's join and leave say which process sends them.
PASSED_ON_HEADERS = ("authorization", "content-type", INSTANCE_HEADER.lower())
#: ``PUT /admin/rules``: at most this many bytes, and this many rules (each one
#: is tried on every request's path and method until the rules cache knows it).
MAX_RULES_BODY = 1 << 20
MAX_RULES = 1000


def new_rules(config: ClusterConfig, data: Any) -> ClusterConfig:
    """``config`` with the rules of ``data`` (``{"rules": [...]}``), checked as
    a config file's are; ApiError 400 ``invalid_rules`` saying where and why."""
    if not isinstance(data, dict) or set(data) != {"rules"}:
        raise ApiError(400, "invalid_rules", 'the body must be {"rules": [...]} and nothing else')
    rules = data["rules"]
    if not isinstance(rules, list) or not 1 <= len(rules) <= MAX_RULES:
        raise ApiError(
            400, "invalid_rules", f"rules must be a list of 1 to {MAX_RULES} rule tables"
        )
    try:
        return config.with_rule_tables(rules, source="PUT /admin/rules")
    except ConfigError as exc:
        raise ApiError(400, "invalid_rules", str(exc)) from None


def shown_config(config: ClusterConfig) -> dict[str, Any]:
    """``config`` as the admin API shows it: the privacy salt (the HMAC key that
    hides user ids: with it, a hash can be tested against guessed ids) as
    :data:`~node.config.HIDDEN_SALT`, which a ``PUT`` sent it back keeps."""
    data = config.to_dict()
    if "salt" in data.get("privacy", {}):
        data["privacy"] = {**data["privacy"], "salt": HIDDEN_SALT}
    return data


#: What a running cluster cannot change: a node's backend and balance are its
#: process's (a Redis-backed node has no shard to own keys with, a sticky one
#: no Redis). A config that leaves them out keeps the cluster's.
FIXED_AT_START = ("backend", "balance")


def new_config(current: ClusterConfig, data: Any) -> ClusterConfig:
    """The whole config of ``data`` (a config file's tables, as JSON) to replace
    ``current``, checked as a config file is: ApiError 400 ``invalid_config``
    saying where and why, 409 ``fixed_at_start`` for a backend or balance
    other than the cluster's.

    With etcd, the config recorded there wins over every router's flags and
    file at start (a restarted router must not undo a runtime change), so
    before this call nothing but the rules could change on such a cluster:
    a leaked bypass token could not be revoked (an exploratory tester)."""
    if not isinstance(data, dict):
        raise ApiError(
            400, "invalid_config", "the body must be a config: the config file's tables as JSON"
        )
    given = dict(data)
    for name in FIXED_AT_START:
        given.setdefault(name, getattr(current, name))
    privacy = given.get("privacy")
    if isinstance(privacy, dict) and privacy.get("salt") == HIDDEN_SALT:
        # What GET showed, sent back: the salt stays the one it hides.
        given["privacy"] = {**privacy, "salt": current.privacy.salt}
    try:
        config = ClusterConfig.from_dict(given, source="PUT /admin/config")
    except ConfigError as exc:
        raise ApiError(400, "invalid_config", str(exc)) from None
    if not 1 <= len(config.rules) <= MAX_RULES:
        raise ApiError(400, "invalid_config", f"a config has 1 to {MAX_RULES} rules")
    for name in FIXED_AT_START:
        before, after = getattr(current, name), getattr(config, name)
        if before != after:
            raise ApiError(
                409,
                "fixed_at_start",
                f"{name} {after!r}: the cluster runs {name} {before!r}, which a node takes "
                "from its own flags as it starts; leave it out to keep it",
            )
    return config


class AdminAPI:
    """The admin endpoints of one :class:`router.app.Router`."""

    def __init__(self, router: Router, client: httpx.AsyncClient | None = None) -> None:
        self.router = router
        #: Reaches the nodes' /internal/top (shared with membership when given).
        self._client = client
        self._owns_client = client is None
        self._salt = random_salt()
        self._hider: tuple[Privacy, KeyHider] | None = None

    def routes(self) -> list[Route]:
        return [
            Route("/admin/ring", self.admin_ring, methods=["GET"]),
            Route("/admin/nodes", self.admin_join, methods=["POST"]),
            Route("/admin/nodes/{node_id}", self.admin_leave, methods=["DELETE"]),
            Route("/admin/rules", self.admin_rules, methods=["GET", "PUT"]),
            Route("/admin/config", self.admin_config, methods=["GET", "PUT"]),
            Route("/admin/top", self.admin_top, methods=["GET"]),
            Route("/admin/ui", self.admin_ui, methods=["GET"]),
            Route("/admin/ui/data", self.admin_ui_data, methods=["GET"]),
        ]

    async def close(self) -> None:
        if self._owns_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    # ------------------------------------------------------------------ membership

    def refused(self, request: Request) -> Response | None:
        """The answer refusing an admin call (401/403), or None when it may proceed."""
        status = refusal(
            bearer(request.headers.get("authorization")),
            self.router.settings.admin_token,
            request.client.host if request.client else None,
            request.headers,
        )
        if status == 403:
            return JSONResponse(
                error_body(
                    "forbidden",
                    "the admin API is loopback-only without an admin token (a browser's request: "
                    "from its own page at a loopback address)",
                ),
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
        if (refused := self.refused(request)) is not None:
            return refused
        data = self.router.membership.describe()
        fast = None if self.router.local_sockets is None else self.router.local_sockets.forwarder
        for entry in data["nodes"]:
            # How this router reaches each node: through its Unix socket, or over TCP.
            entry["unix_socket"] = None if fast is None else fast.socket_of(entry["url"])
        return JSONResponse(data)

    def headers(self) -> dict[str, str]:
        """What this router presents to another router's admin API (the leader's)."""
        token = self.router.settings.admin_token
        return {"authorization": f"Bearer {token}"} if token else {}

    async def _leader(self) -> str | Response | None:
        """The leading router's URL, None if this router leads, or an error answer."""
        membership = self.router.membership
        if membership.coordinator is None:
            return self.router.settings.leader_url  # a follower (router/workers.py), or alone
        if membership.leading:
            return None
        try:
            return await membership.coordinator.leader() or ""
        except CoordinatorError as exc:
            return JSONResponse(error_body("coordinator_unavailable", str(exc)), status_code=503)

    async def _to_leader(self, request: Request, body: bytes = b"") -> Response | None:
        """Membership changes are the leader's (with etcd, or when following a
        leading router): pass them on. None: this router makes the change.

        A call passed to a leader that stops answering (paused, cut off) waits
        as long as a join may take (readiness, then pushes: 40 s by default),
        while etcd hands the lead to another router within its ttl. So the
        lead is looked at while the call waits: moved, the call is dropped and
        made where the lead is now, here included. (The deposed leader cannot
        carry out what it was sent: its etcd writes are fenced by its lost
        leader key.)
        """
        membership = self.router.membership
        loop = asyncio.get_running_loop()
        # While nobody leads (a leader's key ran out, the next not yet elected) or
        # this router has won etcd's election and is still taking the lead, the
        # call waits for the outcome rather than answer 503 at once: CI saw a
        # call passed to a paused leader answered no_leader just as this router
        # won (etcd named it; its take-over had not ended).
        deadline = loop.time() + NO_LEADER_WAIT
        moves = 0
        own = False  # etcd named this router's URL as the leader's, and it does not lead
        while True:
            leader = await self._leader()
            if leader is None or isinstance(leader, Response):
                return leader
            if leader and leader != membership.advertise:
                if moves > LEADER_MOVES:
                    break
                moves += 1
                answer = await self._pass_on(request, body, leader)
                if answer is not None:
                    return answer
                continue
            # (Not while this router holds the lead and is still taking it over:
            # a join can hold that up past the wait.)
            coordinator = membership.coordinator
            own = bool(leader) and (coordinator is None or not coordinator.holds_lead())
            if loop.time() >= deadline:
                break
            await asyncio.sleep(LEADER_LOOK)
        detail = "no router leads the cluster right now; retry shortly"
        if own:
            # Two routers given one --advertise: the leader's URL is this one's, so
            # every call here waited 10 s for a leader and said none led (a tester).
            detail = (
                f"the leader advertises {membership.advertise}, this router's own URL, and "
                "this router does not lead: two routers were given the same --advertise?"
            )
            log.warning("%s", detail)
        return JSONResponse(
            error_body("no_leader", detail), status_code=503, headers={"retry-after": "1"}
        )

    async def _pass_on(self, request: Request, body: bytes, leader: str) -> Response | None:
        """The leader's answer to the call; None if the lead moved meanwhile."""
        membership = self.router.membership
        headers = {k: v for k, v in request.headers.items() if k in PASSED_ON_HEADERS}
        call = asyncio.ensure_future(
            membership.client.request(
                request.method,
                # The query too: ``?force=true`` was dropped on its way to the leader.
                leader.rstrip("/") + request.url.path + _query(request),
                content=body,
                headers=headers,
                timeout=httpx.Timeout(
                    membership.ready_timeout + membership.push_timeout, connect=1.0
                ),
            )
        )
        try:
            while not call.done():
                await asyncio.wait({call}, timeout=LEADER_LOOK)
                if not call.done() and membership.coordinator is not None:
                    now = await self._leader()
                    # None: this router leads now; "": nobody yet (the call may
                    # still be answered); a Response: etcd did not say.
                    if now is None or (isinstance(now, str) and now and now != leader):
                        log.warning(
                            "the lead moved from %s while it was passed %s %s: made again",
                            leader,
                            request.method,
                            request.url.path,
                        )
                        return None
            answer = call.result()
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # Nothing reached the leader: it is gone (killed, its host down), and
            # etcd names it until its key's lease runs out. Answered 502 at once,
            # a node's graceful leave ran out of retries before the lead moved.
            if await self._lead_moves_from(leader):
                return None
            return _leader_unreachable(leader, exc)
        except httpx.HTTPError as exc:
            return _leader_unreachable(leader, exc)
        finally:
            call.cancel()
        if answer.status_code == 200 and self.router.settings.leader_url is not None:
            # Route by the new view at once, rather than on the next poll.
            await membership.follow_once(leader, self.headers())
        return Response(
            answer.content,
            status_code=answer.status_code,
            media_type="application/json",
            headers={"x-ringlimit-leader": leader},
        )

    async def _lead_moves_from(self, leader: str) -> bool:
        """Whether the lead leaves ``leader``, which took no connection, within the
        time etcd keeps a dead leader's key (its lease's ttl, and a moment for
        etcd's revoke loop). Without etcd the leader's URL never changes."""
        coordinator = self.router.membership.coordinator
        if coordinator is None:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + coordinator.ttl + DEAD_LEADER_SLACK
        while loop.time() < deadline:
            await asyncio.sleep(LEADER_LOOK)
            now = await self._leader()
            if not isinstance(now, Response) and now != leader:
                return True
        return False

    async def admin_join(self, request: Request) -> Response:
        if (refused := self.refused(request)) is not None:
            return refused
        try:
            raw = await read_body(request, 65536)
            member = parse_join(parse_json(raw, self.router.config))
            if (forwarded := await self._to_leader(request, raw)) is not None:
                return forwarded
            self._check_url_free(member)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        try:
            await self.router.membership.join(member, instance=request.headers.get(INSTANCE_HEADER))
        except MembershipError as exc:
            return JSONResponse(error_body(exc.error, exc.detail), status_code=exc.status)
        return JSONResponse(self.router.membership.describe())

    def _check_url_free(self, member: Member) -> None:
        """Refuse a join at a URL another member (or this router) answers on: the
        readiness check would refuse it too, but only after a round trip."""
        own = [
            *self.router.settings.own_urls,
            *([self.router.settings.advertise] if self.router.settings.advertise else []),
        ]
        if any(same_url(member.url, url) for url in own):
            raise ApiError(409, "url_is_router", f"{member.url} is this router's own URL")
        others = [*self.router.membership.view, *self.router.membership.joining.values()]
        for other in others:
            if other.id != member.id and same_url(other.url, member.url):
                raise ApiError(
                    409, "url_in_use", f"{member.url} is already the URL of node {other.id!r}"
                )

    async def admin_leave(self, request: Request) -> Response:
        if (refused := self.refused(request)) is not None:
            return refused
        try:
            force = flag_param(request.query_params, "force")
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        if (forwarded := await self._to_leader(request)) is not None:
            return forwarded
        membership = self.router.membership
        node_id = request.path_params["node_id"]
        try:
            await membership.leave(
                node_id, force=force, instance=request.headers.get(INSTANCE_HEADER)
            )
        except MembershipError as exc:
            return JSONResponse(error_body(exc.error, exc.detail), status_code=exc.status)
        data = membership.describe()
        if node_id in membership.removed:
            # Out of the ring, but not by a leave: it did not take the leave push (it
            # did not answer, or could not hand every state to its new owners). Said,
            # so neither `nodes remove` nor a leaving node reports a clean leave
            # while the router's log says it was removed as crashed.
            said = (
                f"node {node_id} did not take the leave (it did not answer, or could "
                "not hand every state to its new owners): removed as crashed, its keys "
                "follow the crash policy"
            )
            data["warning"] = f"{said}; {data['warning']}" if "warning" in data else said
        return JSONResponse(data)

    # ------------------------------------------------------------------ rules

    async def admin_rules(self, request: Request) -> Response:
        """``GET /admin/rules``: the cluster's rules; ``PUT`` ``{"rules": [...]}``
        (the config file's ``[[rules]]`` tables, as JSON) makes them the cluster's,
        without a restart (:meth:`router.membership.Membership.change_config`).
        The rest of the config stays as it is."""
        if (refused := self.refused(request)) is not None:
            return refused
        membership = self.router.membership
        if request.method == "GET":
            return JSONResponse({"epoch": membership.view.epoch, "rules": membership.rules_data()})
        return await self._change_config(
            request, new_rules, "invalid_rules", lambda: {"rules": membership.rules_data()}
        )

    async def admin_config(self, request: Request) -> Response:
        """``GET /admin/config``: the cluster's whole config; ``PUT`` one (the
        config file's tables, as JSON) makes it the cluster's without a restart,
        as ``PUT /admin/rules`` does its rules (identity, limits, policies,
        headers, privacy, bypass: every node takes it with the next push)."""
        if (refused := self.refused(request)) is not None:
            return refused
        membership = self.router.membership
        if request.method == "GET":
            config = self.router.config
            whole = request.query_params.get("salt") == "show"  # (followers: the whole)
            shown = config.to_dict() if whole else shown_config(config)
            return JSONResponse({"epoch": membership.view.epoch, "config": shown})
        return await self._change_config(
            request,
            new_config,
            "invalid_config",
            lambda: {"config": shown_config(self.router.config)},
        )

    async def _change_config(
        self,
        request: Request,
        build: Callable[[ClusterConfig, Any], ClusterConfig],
        invalid: str,
        shown: Callable[[], dict[str, Any]],
    ) -> Response:
        """A ``PUT`` of new rules or a new config: ``build`` makes the config from
        the body (ApiError for a bad one), the leader makes it the cluster's
        (:meth:`router.membership.Membership.change_config`), and the answer
        shows what the cluster now has, with the members that did not take it
        yet (the health loop gives it to them, or repairs a restarted one,
        within a health interval)."""
        membership = self.router.membership
        try:
            raw = await read_body(request, MAX_RULES_BODY)
            config = build(self.router.config, parse_json(raw, self.router.config))
            if (forwarded := await self._to_leader(request, raw)) is not None:
                return forwarded
            change = await membership.change_config(config)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        except MembershipError as exc:
            return JSONResponse(error_body(exc.error, exc.detail), status_code=exc.status)
        except ValueError as exc:  # clashes with this router's --envoy-config rules
            return JSONResponse(error_body(invalid, str(exc)), status_code=400)
        return JSONResponse(
            {"epoch": membership.view.epoch, **shown(), "pending": list(change.pending)}
        )

    # ------------------------------------------------------------------ operators

    def _hide(self) -> KeyHider:
        privacy = self.router.config.privacy
        cached = self._hider
        if cached is None or cached[0] is not privacy:
            cached = self._hider = (privacy, KeyHider(privacy, self._salt))
        return cached[1]

    async def _node_reports(self, params: dict[str, str]) -> dict[str, Report]:
        if self._client is None:
            self._client = httpx.AsyncClient(limits=CONTROL_LIMITS)
        return await ask_nodes(
            self._client,
            self.router.membership.view.members,
            dict(self.router.token_header),
            params,
            self.router.settings.admin_timeout,
        )

    async def admin_top(self, request: Request) -> Response:
        """``GET /admin/top?rule=R&n=20``: the most limited keys, merged across nodes."""
        if (refused := self.refused(request)) is not None:
            return refused
        params = request.query_params
        try:
            rule = one_param(params, "rule")
            n = count_param(params, "n", 20, 1000)
        except ApiError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        if rule is not None and self.router.config.rule(rule) is None:
            return JSONResponse(
                error_body("unknown_rule", f"no rule named {rule!r}"), status_code=400
            )
        reports = await self._node_reports({"n": str(n), **({"rule": rule} if rule else {})})
        return JSONResponse(
            {
                "rule": rule,
                "n": n,
                "keys": self.router.config.privacy.show_keys,
                "near_limit": f"allowed with at most {NEAR_LIMIT_FRACTION:.0%} of the limit left",
                "window_seconds": _window(reports),
                "rules": merge_top(
                    reports,
                    [rule] if rule else None,
                    n,
                    self._hide(),
                    self.router.leases.top_report([rule] if rule else None, n),
                ),
                "nodes": node_status(reports),
            }
        )

    async def admin_ui(self, request: Request) -> Response:
        """The ring page (router/ui.py). It holds no data and no secret, so it
        needs no token; without an admin token, admin pages are loopback-only."""
        if (
            self.router.settings.admin_token is None
            and (refused := self.refused(request)) is not None
        ):
            return refused
        return Response(UI_PAGE, media_type="text/html; charset=utf-8", headers=UI_HEADERS)

    async def admin_ui_data(self, request: Request) -> Response:
        """What the ring page shows: nodes, shares, rates, top keys, events."""
        if (refused := self.refused(request)) is not None:
            return refused
        membership = self.router.membership
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
                "keys": self.router.config.privacy.show_keys,
                "nodes": nodes,
                "totals": {
                    "rate": sum(n["rate"] or 0.0 for n in nodes),
                    "denied_rate": sum(n["denied_rate"] or 0.0 for n in nodes),
                },
                "top": merge_top(
                    reports, None, 10, self._hide(), self.router.leases.top_report(None, 10)
                ),
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
        raise ApiError(400, "invalid_request", f"unknown field(s): {names_text(extra)}")
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


def _query(request: Request) -> str:
    query = request.url.query
    return f"?{query}" if query else ""


def _leader_unreachable(leader: str, exc: Exception) -> Response:
    """The answer to a call the leader did not answer (and the lead did not move)."""
    return JSONResponse(
        error_body(
            "leader_unreachable",
            f"the leading router at {leader} did not answer ({type(exc).__name__})",
        ),
        status_code=502,
    )
