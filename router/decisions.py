"""The router's decision API: ``POST /v1/check`` (and Envoy's ``ShouldRateLimit``).

Each check is decided by its key's owner. A batch is split into one batch per
node (sent concurrently) and the answers merged back in order, the nodes'
results passed on as the bytes they sent (node/wire.py's line framing). Single
checks that arrive together for the same node are coalesced into one batch
(router/coalesce.py). A node that refuses a check because the ring changed
makes the router catch up and route it again; an unreachable owner lets each
rule's ``on_error`` decide.

Raw ASGI (no Starlette): this is a hot path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from node.asgi import Receive, Scope, Send, error_body, read_all, send_json_bytes
from node.config import Limits
from node.decision import SERVICE_REFUSED_HEADERS, service_refused
from node.rules import MAX_NAME, Rule
from node.security import bearer, from_a_web_page, token_matches
from node.wire import (
    ApiError,
    Check,
    Result,
    batch_body,
    checks_payload,
    decode_checks,
    dumps,
    forward_payload,
    forwardable,
    result_dict,
    split_results,
    unreachable_result,
)
from ring import EmptyRingError, Member
from router.coalesce import Coalescer, Merger
from router.forward import MAX_ATTEMPTS, NodeTimeout, Unreachable
from router.leases import ADMIT, FORWARD, leased_rule, with_unspent
from router.rotation import Search

#: Reasons of a result the router made up for an owner that did not answer.
UNANSWERED = frozenset({"owner_unreachable", "owner_timeout"})
#: The answer to a web page's check while no API token is set (as a node's).
_FOR_NO_PAGE = msgspec.json.encode(
    error_body(
        "forbidden",
        "not for web pages: a page of another site, or one addressed by a name a page "
        "could rebind to this host (use 127.0.0.1 or localhost, or set RINGLIMIT_API_TOKEN)",
    )
)

if TYPE_CHECKING:
    from router.app import Router


def _decoded(result: bytes) -> dict[str, Any]:
    """A node's result line as a dict; empty if it is not a JSON object (it is
    passed on as it came, as before)."""
    try:
        decoded = msgspec.json.decode(result)
    except msgspec.DecodeError:
        return {}
    return decoded if type(decoded) is dict else {}


def _service_refused(result: dict[str, Any]) -> bool:
    """Whether a single check's result is a denial its owner's backend or store
    made (node/decision.py :func:`~node.decision.service_refused`)."""
    return result.get("allowed") is False and service_refused(
        result.get("reason"), result.get("retry_after")
    )


class _Again:
    """A coalesced or merged check to route again: its node refused it (the ring is
    changing; ``answer`` None), or could not be reached in round-robin mode, where
    another node may decide it (``answer``: its rules' ``on_error`` answer, for
    when no other node can be reached)."""

    __slots__ = ("answer",)

    def __init__(self, answer: Result | None) -> None:
        self.answer = answer


#: The most single checks coalesced into one batch (fewer when the limits say so).
COALESCED_BATCH = 256


class DecisionAPI:
    """Routes checks to their owners for one :class:`router.app.Router`.

    It reads the router's ring, forwarder and owner cache at each call (they
    change while the router runs), and owns the coalescer of single checks.
    """

    def __init__(self, router: Router) -> None:
        self.router = router
        window = router.settings.coalesce_window
        limits = router.config.limits
        #: The limits the coalescer's and the merger's batch sizes were fitted to.
        self._limits = limits
        #: Holds single checks ``window`` seconds to send them to their node as one batch
        #: (within the node's limits on a batch, as the merger's).
        self.coalescer = (
            Coalescer(
                self._send_coalesced,
                window=window,
                max_batch=min(COALESCED_BATCH, merged_batch(limits)),
            )
            if window > 0
            else None
        )
        #: With coalescing on, batches for a node that meet on the way leave as one
        #: request (router/coalesce.py), within the node's limits on a batch.
        self.merger = (
            Merger(self._send_merged, max_items=merged_batch(limits)) if window > 0 else None
        )

    def _fit(self) -> None:
        """Fit the coalescer's and the merger's batch sizes to the cluster's limits
        when they changed (a config adopted from the nodes or etcd, or changed at
        runtime): a batch over ``limits.max_batch`` would be refused by the node
        (413), failing every check it carried."""
        limits = self.router.config.limits
        if limits is self._limits:
            return
        self._limits = limits
        size = merged_batch(limits)
        if self.coalescer is not None:
            self.coalescer.max_batch = min(COALESCED_BATCH, size)
        if self.merger is not None:
            self.merger.max_items = size

    def allowed(self, scope: Scope) -> bool:
        """Whether the request carries the decision API's token (``api_token``)."""
        given = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        return token_matches(
            bearer(given.decode("latin-1") if given is not None else None),
            self.router.settings.api_token,
        )

    async def check_asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/check``, the decision API: each check goes to its owner; a batch
        is split and merged. Raw ASGI (no Starlette): this is the hot path."""
        config = self.router.config
        limit = config.limits.max_body
        if self.router.settings.api_token is not None:
            if not self.allowed(scope):
                await send_json_bytes(
                    send,
                    401,
                    dumps(
                        error_body("unauthorized", "the decision API needs its token (Bearer)")
                    ).encode(),
                )
                return
        elif from_a_web_page(scope):
            # As a node's (node/app.py): any page a browser showed could spend any
            # user's quota with a text/plain POST (no preflight; an exploratory tester).
            await send_json_bytes(send, 403, _FOR_NO_PAGE)
            return
        try:
            declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise ApiError(
                    413, "body_too_large", f"body is {declared.decode()} bytes; at most {limit}"
                )
            body = await read_all(receive, limit)
            if body is None:
                raise ApiError(413, "body_too_large", f"body is over {limit} bytes")
            checks, batch = decode_checks(body, config)
        except ApiError as exc:
            await send_json_bytes(send, exc.status, dumps(exc.body()).encode())
            return
        if batch:
            try:
                raw: list[Any] | None = forwardable(checks, body, config.default_rules)
            except (msgspec.MsgspecError, ValueError, RecursionError):
                raw = None  # valid for json, not msgspec: encode the checks again
            before = self.unspent_of_reads(checks) if config.leasing else None
            results = await self.route_checks(checks, raw)
            if before:
                self.count_unspent(checks, results, before)
            await send_json_bytes(send, 200, batch_body(results))
            return
        if config.leasing:
            leased = self.leased(checks[0])
            if leased is not None:
                await send_json_bytes(send, 200, leased)
                return
        status, payload, headers = await self.answer_single(checks[0])
        await send_json_bytes(send, status, payload, headers)

    def leased(self, check: Check) -> bytes | None:
        """A single check of cost 1 whose one rule leases, answered from the router's
        quota leases (docs/hotkeys.md); ``None``: route it as usual."""
        rule = leased_rule(check.rules)
        if rule is None or check.cost != 1:
            return None
        router = self.router
        view = router.membership.view
        if not view.members or router.config.balance != "sticky":
            return None
        leases = router.leases
        now = leases.clock()
        outcome = leases.decide(rule, check.key, view.epoch, now)
        owner = router.pick(view, check.key)
        leases.note(rule, check.key, owner, view.epoch, now, outcome == FORWARD)
        if outcome == FORWARD:
            return None
        router.metrics.outcome("-", "lease_admitted" if outcome == ADMIT else "lease_denied")
        # Decided under the owner's lease: the owner is the authority named.
        verdict = leases.verdict(rule, check.key, outcome == ADMIT, now)
        return dumps(result_dict(verdict, owner.id)).encode()

    def unspent_of_reads(self, checks: Sequence[Check]) -> dict[int, tuple[Rule, int]]:
        """For each read (cost 0) of a key this router holds lease units for, by
        index: its leased rule and those units now. Empty when the book is
        (most of the time)."""
        router = self.router
        leases = router.leases
        if router.config.balance != "sticky" or not len(leases.book):
            return {}
        epoch = router.membership.view.epoch
        found: dict[int, tuple[Rule, int]] = {}
        for index, check in enumerate(checks):
            if check.cost:
                continue
            rule = leased_rule(check.rules)
            if rule is not None and (left := leases.unspent(rule, check.key, epoch)):
                found[index] = (rule, left)
        return found

    def count_unspent(
        self,
        checks: Sequence[Check],
        results: list[Result],
        before: dict[int, tuple[Rule, int]],
    ) -> None:
        """Reads of keys this router holds lease units for: the owner's answer
        with those units counted as the key's (``with_unspent``), in place.

        The units are the fewer of before the read was sent and after its
        answer came: a grant whose answer came in meanwhile may have been made
        after the owner answered the read, which then counted its units as the
        key's already (the review). Only reads: a check that consumes was
        decided by the owner, whose ``allowed`` stands (its ``remaining`` counts
        the units out on lease as spent, as docs/hotkeys.md says)."""
        leases = self.router.leases
        epoch = self.router.membership.view.epoch
        for index, (rule, held) in before.items():
            left = min(held, leases.unspent(rule, checks[index].key, epoch))
            if not left:
                continue
            result = results[index]
            decoded = _decoded(result) if type(result) is bytes else result
            if isinstance(decoded, dict):
                results[index] = with_unspent(rule, decoded, left)

    async def answer_single(self, check: Check) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
        """The status, JSON body and extra headers answering one valid check."""
        before = self.unspent_of_reads((check,)) if self.router.config.leasing else None
        result = await self.route_single(check)
        if before:
            counted = [result]
            self.count_unspent((check,), counted, before)
            result = counted[0]
        if type(result) is bytes:
            # A node's decision, passed on as it came. Only one with a reason needs
            # reading (the common answer has no "reason" field at all): a denial its
            # backend or store made is the node's 503, not a 200.
            if b'"reason":' in result and _service_refused(_decoded(result)):
                return 503, result, list(SERVICE_REFUSED_HEADERS)
            return 200, result, []
        assert isinstance(result, dict)
        headers: list[tuple[bytes, bytes]] = []
        if "error" in result:
            # No decision: say so with the status too, not a 200 carrying an error
            # (the request was valid here; the node could not answer it).
            status = {"ring_changing": 503, "no_nodes": 503}.get(result["error"], 502)
            if result["error"] == "ring_changing":
                # As the proxy path says it: the change settles within a second or so.
                headers.append((b"retry-after", b"1"))
        elif result.get("reason") in UNANSWERED and not result["allowed"]:
            # A closed rule whose owner did not answer: as the proxy path's 503 says it.
            status = 503
            headers.append((b"retry-after", b"1"))
        else:  # (the router's own results never carry a backend's or a store's reason)
            status = 200
        return status, dumps(result).encode(), headers

    async def route_single(self, check: Check) -> Result:
        """One check; concurrent singles for the same node leave as one batch."""
        if self.coalescer is None:
            return (await self.route_checks([check]))[0]
        self._fit()
        try:
            member = self.router.pick(self.router.membership.view, check.key)
        except EmptyRingError:
            return (await self.route_checks([check]))[0]
        started = time.perf_counter()
        result = await self.coalescer.submit(member.id, (member, check))
        if type(result) is _Again:
            # Sent once already: the rest of its attempts, and of its time.
            return (await self.route_checks([check], again=result, started=started))[0]
        return result  # type: ignore[no-any-return]

    async def _send_coalesced(self, node_id: str, items: list[tuple[Member, Check]]) -> list[Any]:
        return await self._send_merged(items[0][0], [check for _, check in items], None)

    async def route_checks(
        self,
        checks: Sequence[Check],
        raw: Sequence[Any] | None = None,
        *,
        again: _Again | None = None,
        started: float | None = None,
    ) -> list[Result]:
        """One result per check, in order: a node's answer as JSON bytes, or the
        router's own (an error, an unreachable owner) as a dict. ``raw``: each
        check's JSON text as the client sent it (node/wire.py's ``raw_checks``),
        passed on to the node rather than encoded again. ``again`` and ``started``
        (``perf_counter``): a single check the coalescer sent once already, and
        when it left.

        Checks a node refused (the ring is changing) are sent again at most
        ``MAX_ATTEMPTS`` times in all; checks whose node could not be reached in
        round-robin mode go to the next node within the request's search
        (router/rotation.py), then keep their rules' ``on_error`` answer."""
        router = self.router
        if self.merger is not None:
            self._fit()
        results: list[Result | None] = [None] * len(checks)
        pending = list(range(len(checks)))
        if started is None:
            started = time.perf_counter()
        tries = _Tries(router, started)
        if again is not None:
            results[0] = again.answer
            pending = tries.again(pending, results)
        while pending:
            view = router.membership.view
            groups: dict[str, list[int]] = {}
            members: dict[str, Member] = {}
            if not len(view):
                for index in pending:
                    results[index] = {"error": "no_nodes", "detail": "the ring has no nodes"}
                return _complete(results)
            owner_of = router.owner_map(view).get
            # A key's checks go to one node, which decides them in order: in
            # round-robin mode each pick is the next node, and one key's checks sent
            # to several at once were decided in any order (docs/decision-api.md).
            picked: dict[str, Member] = {}
            for index in pending:
                key = checks[index][0]
                member = owner_of(key) or picked.get(key)
                if member is None:
                    member = picked[key] = router.pick(view, key)
                group = groups.get(member.id)
                if group is None:
                    group = groups[member.id] = []
                    members[member.id] = member
                group.append(index)
            retry: list[int] = []
            await asyncio.gather(
                *(
                    self._run_merged(members[m], idx, checks, results, retry, raw)
                    for m, idx in groups.items()
                )
            )
            pending = tries.again(retry, results)
        return _complete(results)

    async def _run_merged(
        self,
        member: Member,
        indices: list[int],
        checks: Sequence[Check],
        results: list[Result | None],
        retry: list[int],
        raw: Sequence[Any] | None,
    ) -> None:
        """:meth:`_run_group`, through the merger when there is one."""
        merger = self.merger
        if merger is None:
            await self._run_group(member, indices, checks, results, retry, raw)
            return
        answers = await merger.submit(
            member,
            [checks[i] for i in indices],
            None if raw is None else [raw[i] for i in indices],
        )
        for i, answer in zip(indices, answers, strict=True):
            if type(answer) is _Again:
                retry.append(i)
                results[i] = answer.answer
            else:
                results[i] = answer

    async def _send_merged(
        self, member: Member, checks: list[Check], raw: list[Any] | None
    ) -> list[Any]:
        results: list[Result | None] = [None] * len(checks)
        retry: list[int] = []
        await self._run_group(member, list(range(len(checks))), checks, results, retry, raw)
        out: list[Any] = list(results)
        for index in retry:
            out[index] = _Again(results[index])
        return out

    async def _run_group(
        self,
        member: Member,
        indices: list[int],
        checks: Sequence[Check],
        results: list[Result | None],
        retry: list[int],
        raw: Sequence[Any] | None = None,
    ) -> None:
        """Send ``checks[i]`` of ``indices`` to ``member`` as one batch; put its answers
        in ``results``, or the indices to route again in ``retry``: with no result
        when the node refused them (the ring is changing), with their rules'
        ``on_error`` answer when it could not be reached in round-robin mode and
        another node may take them."""
        router = self.router
        if raw is None:
            payload = checks_payload(checks, indices)
        else:
            payload = forward_payload(checks, raw, indices)
        if len(payload) > router.config.limits.max_body and len(indices) > 1:
            # Over what the node takes (the checks as the router writes them name
            # their rule and cost, which a client's need not): in two requests.
            half = len(indices) // 2
            await asyncio.gather(
                self._run_group(member, indices[:half], checks, results, retry, raw),
                self._run_group(member, indices[half:], checks, results, retry, raw),
            )
            return
        assert router.forwarder is not None
        try:
            answer = await router.forwarder.post_json(
                member.url + "/v1/check", payload, router.token_header
            )
        except NodeTimeout:
            # Sent, not answered (in time, or the connection closed first: AnswerLost):
            # the owner may have decided. Nothing is sent again, not even to a new
            # owner under a newer view (no double decision); the rules' on_error
            # answers, as for an owner that cannot be reached (issue 10: a paused owner).
            for i in indices:
                results[i] = unreachable_result(checks[i], member.id, "owner_timeout")
            router.metrics.outcome(member.id, "node_timeout")
            return
        except Unreachable:
            if await router.membership.newer_view(member):
                retry.extend(indices)  # our view was stale: the keys have other owners now
                return
            for i in indices:
                results[i] = unreachable_result(checks[i], member.id)
            if router.passed_on(router.membership.view, member):
                retry.extend(indices)  # the members take turns (round-robin): the next one
                return
            router.metrics.outcome(member.id, "unreachable")
            return
        if answer.status == 421 and await router.stale(answer, member):
            retry.extend(indices)
            return
        if answer.status == 503 and answer.lease_expired():
            if await router.membership.newer_view(member):
                retry.extend(indices)
                return
            if await router.membership.renew_lapsed(member):
                retry.extend(indices)  # renewed (this router was paused): it decides again
                return
            for i in indices:
                results[i] = unreachable_result(checks[i], member.id)
            router.metrics.outcome(member.id, "lease_expired")
            return
        if answer.status == 404 and len(indices) > 1 and b'"unknown_rule"' in answer.body[:64]:
            parts = _by_rules(checks, indices)
            if len(parts) > 1:
                # A rule the node does not know yet (a rules change on its way to
                # it): the node refused the whole batch before deciding any of it,
                # so it is sent again, a request per set of rules; only the checks
                # on that rule fail. (The other callers of a coalesced or merged
                # batch were failed with it.)
                await asyncio.gather(
                    *(self._run_group(member, part, checks, results, retry, raw) for part in parts)
                )
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
        router.metrics.checks(member.id, len(indices))


class _Tries:
    """What one call of :meth:`DecisionAPI.route_checks` has spent: rounds a node
    refused (the ring is changing: at most ``MAX_ATTEMPTS`` sends, within
    ``timeouts.refusals`` of the first), and rounds past nodes that could not be
    reached in round-robin mode (the search's to bound, router/rotation.py)."""

    __slots__ = ("refused", "router", "search", "started")

    def __init__(self, router: Router, started: float) -> None:
        self.router = router
        self.started = started
        self.refused = 0
        self.search: Search | None = None

    def again(self, retry: list[int], results: list[Result | None]) -> list[int]:
        """Of a round's checks to route again (``retry``), those to send now, their
        results cleared; the others keep their answer: ``ring_changing`` for those
        refused too often, their rules' ``on_error`` for those passed over (their
        result already) when the search is over."""
        if not retry:
            return retry  # every check answered: the usual case
        refusals = [i for i in retry if results[i] is None]
        passes = [i for i in retry if results[i] is not None]
        pending: list[int] = []
        if refusals:
            self.refused += 1
            elapsed = time.perf_counter() - self.started
            if self.refused < MAX_ATTEMPTS and elapsed <= self.router.settings.timeouts.refusals:
                pending = refusals
            else:
                for i in refusals:
                    results[i] = {
                        "error": "ring_changing",
                        "detail": "the ring is changing; retry shortly",
                    }
        if passes:
            if self.search is None:
                self.search = self.router.rotation.search()
            if self.search.again(len(self.router.membership.view)):
                pending = sorted(pending + passes)  # a key's checks in their order
            else:  # their on_error answers: counted as an owner that was not reached
                passed = [results[i] for i in passes]
                for node in {r["node"] for r in passed if isinstance(r, dict)}:
                    self.router.metrics.outcome(node, "unreachable")
        for i in pending:
            results[i] = None
        return pending


def merged_batch(limits: Limits) -> int:
    """The most checks a merged request carries: at most ``max_batch``, and few
    enough that its body stays under ``max_body`` however long each check's text
    may be (a key of ``max_key_length`` characters, each escaped as a surrogate
    pair at worst, and a rule name)."""
    longest = 12 * limits.max_key_length + 6 * MAX_NAME + 64
    return max(1, min(limits.max_batch, limits.max_body // longest))


def _complete(results: list[Result | None]) -> list[Result]:
    return [r if r is not None else {} for r in results]


def _by_rules(checks: Sequence[Check], indices: list[int]) -> list[list[int]]:
    """``indices`` grouped by the rules their checks name, in order of first appearance."""
    parts: dict[tuple[str, ...], list[int]] = {}
    for i in indices:
        parts.setdefault(tuple(rule.name for rule in checks[i].rules), []).append(i)
    return list(parts.values())
