"""The router's HTTP calls to nodes: the control plane's wire, on httpx.

Views and config (``PUT /internal/cluster``), lease offers and grants
(``POST /internal/lease``), readiness and epoch (``GET /healthz``), discovery
(``GET /internal/cluster``) and the leader's ring (``GET /admin/ring``).
Every call answers with data or None; deciding what a failure means is the
membership's (router/membership.py). The internal token is sent per request,
not as a client default, so a client shared with other parts carries no secret.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections.abc import Iterable
from typing import Any, NamedTuple

import httpx

from node.config import ClusterConfig
from node.failures import Failures
from node.peers import INTERNAL_TOKEN_HEADER
from ring import Member, RingView
from router.viewlog import MembershipError

log = logging.getLogger("ringlimit.router")


def push_body(
    view: RingView,
    previous: RingView | None,
    crashed: Iterable[str],
    config: ClusterConfig,
    lease: float | None,
    *,
    established: bool = False,
    cluster: str | None = None,
) -> dict[str, Any]:
    """The body of a view push; ``lease`` makes the nodes require one (None: unchanged).

    ``cluster``: the name of the cluster (``--cluster``, with etcd) whose ring
    this is. A node remembers it and says it; a router of another cluster will
    not take the node, nor the node its pushes, while it is a member here.

    ``established``: every member of ``view`` holds its states (new rules, a
    refresh), so one that never held a view has restarted and refuses it (409
    ``restarted``), to be removed as crashed. Said only where the router knows
    it: a first start, a recovery of a cluster whose nodes all restarted and a
    take-over may find members that are rightly empty.
    """
    payload: dict[str, Any] = {
        "ring": view.to_dict(),
        "previous": previous.to_dict() if previous is not None else None,
        "crashed": list(crashed),
        "config": config.to_dict(),
        "wait": True,
    }
    if lease is not None:
        payload["lease"] = lease
    if established:
        payload["established"] = True
    if cluster is not None:
        payload["cluster"] = cluster
    return payload


class LeaderState(NamedTuple):
    """What a follower polls of the leading router (``GET /admin/ring``)."""

    view: RingView
    events: list[dict[str, Any]]
    rules_digest: str | None
    degraded: bool
    config_digest: str | None


class NodeClient:
    def __init__(self, client: httpx.AsyncClient, internal_token: str | None = None) -> None:
        self.client = client
        self.headers = {INTERNAL_TOKEN_HEADER: internal_token} if internal_token else {}
        #: Warnings a node can cause on every probe: at most one per 10 s per kind.
        self._quiet = Failures(log)

    async def push(
        self,
        members: list[Member],
        epoch: int,
        payload: dict[str, Any],
        *,
        tolerate: bool = False,
        seconds: float | None = None,
    ) -> list[str]:
        """Send a view push; returns the ids that did not take it (raises unless ``tolerate``).

        ``seconds`` bounds a push that carries no handoff (the default, the
        client's push timeout, leaves room for a node to deliver its states).
        """
        results = await asyncio.gather(
            *(self.push_one(m, payload, seconds=seconds) for m in members),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and not tolerate:
            raise errors[0]
        for error in errors:
            log.warning("push of epoch %d: %s", epoch, error)
        return [m.id for m, r in zip(members, results, strict=True) if isinstance(r, BaseException)]

    async def push_one(
        self, member: Member, payload: dict[str, Any], *, seconds: float | None = None
    ) -> None:
        """Send a view push to one member; raises MembershipError if it did not take it.

        One task per member, so that the driver can abandon the push to a member
        being removed as crashed without abandoning the others'.
        """
        extra: dict[str, Any] = {} if seconds is None else {"timeout": seconds}
        try:
            response = await self.client.put(
                member.url.rstrip("/") + "/internal/cluster",
                json=payload,
                headers=self.headers,
                **extra,
            )
        except httpx.HTTPError as exc:
            raise MembershipError(
                502, "push_failed", f"node {member.id} unreachable: {type(exc).__name__}"
            ) from None
        if response.status_code in (401, 403):
            # Not the network: the node requires the internal token, and this
            # router sends none or another (it would otherwise serve on, with the
            # nodes' own rules, suspecting its own network).
            raise MembershipError(
                502,
                "push_failed",
                f"node {member.id} refused this router's internal token (HTTP "
                f"{response.status_code}): set RINGLIMIT_INTERNAL_TOKEN to the nodes' token",
            )
        if response.status_code != 200:
            raise MembershipError(
                502, "push_failed", f"node {member.id} answered HTTP {response.status_code}"
            )

    async def wait_ready(
        self,
        member: Member,
        ready_timeout: float,
        within: float,
        *,
        round_robin: bool = False,
        owner_routed: bool = False,
        cluster: str | None = None,
    ) -> int:
        """Readiness gate: a joining node must answer, as itself, before it is
        given any key. A URL that reaches another member, a router or anything
        else that does not call itself ``member.id`` is refused at once, and so,
        for a router that balances ``round_robin``, is a node that refuses keys
        it does not own (its own limiter, sticky), and for a router of the
        etcd ``cluster``, a node that holds a ring of another named cluster.
        Returns the epoch the node said it holds (0 when it said none)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + ready_timeout
        last = ""
        while True:
            try:
                response = await self.client.get(
                    member.url.rstrip("/") + "/healthz", timeout=within
                )
                status = response.status_code
                if 400 <= status < 500 and status not in (408, 429):
                    # A node answers /healthz 200 from its start: a 404 is a web
                    # server, not a node starting (it was waited on for 10 s, and
                    # then "did not answer", of a URL that did; an exploratory tester).
                    raise MembershipError(
                        409,
                        "wrong_node",
                        f"{member.url} answers /healthz with HTTP {status}: not a "
                        "ringlimit node; check the node's --url",
                    )
                last = f" (its last answer: HTTP {status})"
                if status == 200:
                    health = _fields(response)
                    answered = health.get("node")
                    answered = answered if isinstance(answered, str) else None
                    if answered == member.id:
                        refused = _not_for(member, health, round_robin, owner_routed, cluster)
                        if refused is not None:
                            raise refused
                        return held_epoch(health.get("epoch"))
                    raise MembershipError(
                        409,
                        "wrong_node",
                        f"{member.url} answers as "
                        + (f"node {answered!r}" if answered else "something that is not a node")
                        + f", not as {member.id!r}: check the node's --url and --id",
                    )
            except httpx.HTTPError:
                pass
            if loop.time() > deadline:
                raise MembershipError(
                    504,
                    "not_ready",
                    f"node {member.id} at {member.url} did not answer /healthz within "
                    f"{ready_timeout:g}s{last}",
                )
            await asyncio.sleep(0.05)

    async def lease(
        self, member: Member, grant: str | None, seconds: float, within: float
    ) -> dict[str, Any] | None:
        """A lease probe (``grant`` None: take the node's offer) or grant; None on failure."""
        body: dict[str, Any] = {"grant": grant}
        if grant is not None:
            body["seconds"] = seconds
        try:
            response = await self.client.post(
                member.url.rstrip("/") + "/internal/lease",
                json=body,
                headers=self.headers,
                timeout=within,
            )
            data = response.json()
        except (httpx.HTTPError, ValueError) as exc:
            log.debug("probe of %s failed: %s", member.id, exc)
            return None
        if response.status_code in (401, 403):
            # Not the network: every probe fails so, and the health loop's "members
            # unreachable at once: suspecting this router's own network" said
            # nothing of the token.
            self._quiet.warn(
                "probe_refused",
                "node %s refused this router's internal token (HTTP %d): set "
                "RINGLIMIT_INTERNAL_TOKEN to the nodes' token",
                member.id,
                response.status_code,
            )
            return None
        if response.status_code != 200 or not isinstance(data, dict):
            log.debug("probe of %s: HTTP %d", member.id, response.status_code)
            return None
        return data

    async def answered_as(self, member: Member, within: float) -> str | None:
        """Who answers ``/healthz`` with 200 at the member's URL (a removed member
        back, or another node on its address): the id it gives ("" if it names
        none, as a router does); None if nothing answered so."""
        try:
            response = await self.client.get(member.url.rstrip("/") + "/healthz", timeout=within)
        except httpx.HTTPError:
            return None
        if response.status_code != 200:
            return None
        return node_id(response) or ""

    async def instance(self, member: Member, within: float) -> str | None:
        """The ``instance`` (process) the node at the member's URL says it is, if it
        answers as ``member.id``; None otherwise (no answer, another node, a node
        of a version that says none)."""
        data = await self.healthz(member, within)
        if data is None or data.get("node") != member.id:
            return None
        instance = data.get("instance")
        return instance if isinstance(instance, str) else None

    async def epoch(self, member: Member, within: float) -> int | None:
        """The epoch the member's ``/healthz`` reports (None: no usable answer)."""
        data = await self.healthz(member, within)
        try:
            return None if data is None else int(data.get("epoch", 0))
        except (ValueError, TypeError):
            return None

    async def healthz(self, member: Member, within: float) -> dict[str, Any] | None:
        """The member's ``/healthz`` object (None: no answer, or not a JSON object)."""
        try:
            response = await self.client.get(member.url.rstrip("/") + "/healthz", timeout=within)
            data = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    @typing.overload
    async def discover(
        self, members: list[Member], within: float, *, cluster: str | None = None
    ) -> RingView | None: ...

    @typing.overload
    async def discover(
        self,
        members: list[Member],
        within: float,
        *,
        with_urls: typing.Literal[True],
        cluster: str | None = None,
    ) -> tuple[RingView, str] | None: ...

    async def discover(
        self,
        members: list[Member],
        within: float,
        *,
        with_urls: bool = False,
        cluster: str | None = None,
    ) -> Any:
        """The newest view the members know (and, with ``with_urls``, who knows it).
        With ``cluster``, a member holding another named cluster's ring is not
        asked: a router of cluster "other" seeded with a member of "test"
        recorded test's ring in etcd as its own (the review of the day's changes)."""

        async def ask(member: Member) -> tuple[RingView, str] | None:
            try:
                response = await self.client.get(
                    member.url.rstrip("/") + "/internal/cluster",
                    timeout=within,
                    headers=self.headers,
                )
                data = response.json()
                other = data.get("cluster")
                if cluster is not None and isinstance(other, str) and other != cluster:
                    return None
                ring = data.get("ring")
                return (RingView.from_dict(ring), member.url) if ring else None
            except (httpx.HTTPError, ValueError, TypeError, AttributeError):
                return None

        answers = [a for a in await asyncio.gather(*(ask(m) for m in members)) if a is not None]
        best = max(answers, key=lambda a: a[0].epoch, default=None)
        if best is None:
            return None
        return best if with_urls else best[0]

    async def cluster(self, node_url: str) -> dict[str, Any]:
        """A node's ``/internal/cluster`` answer (its view and config); raises
        httpx.HTTPError or ValueError (not JSON)."""
        response = await self.client.get(
            node_url.rstrip("/") + "/internal/cluster", headers=self.headers
        )
        data: dict[str, Any] = response.json()
        return data

    async def leader_ring(self, leader_url: str, headers: dict[str, str]) -> RingView:
        """The leading router's ring, without its joining members; raises
        httpx.HTTPError, ValueError, KeyError or TypeError."""
        return (await self.leader_state(leader_url, headers)).view

    async def leader_state(self, leader_url: str, headers: dict[str, str]) -> LeaderState:
        """The leading router's ring (without its joining members), its
        membership events, the digests of its config and rules (None from a
        router that does not say) and whether a node reports its shared backend
        down; raises httpx.HTTPError, ValueError, KeyError or TypeError."""
        response = await self.client.get(
            leader_url.rstrip("/") + "/admin/ring", headers=headers, timeout=2.0
        )
        data = response.json()
        nodes = [
            {k: n[k] for k in ("id", "url", "weight")}
            for n in data["nodes"]
            if n.get("state") != "joining"
        ]
        view = RingView.from_dict({"epoch": data["epoch"], "nodes": nodes})
        events = data.get("events")
        digest = data.get("rules_digest")
        whole = data.get("config_digest")
        return LeaderState(
            view,
            [e for e in events if isinstance(e, dict)] if isinstance(events, list) else [],
            digest if isinstance(digest, str) else None,
            data.get("backend_degraded") is True,
            whole if isinstance(whole, str) else None,
        )

    async def leader_config(self, leader_url: str, headers: dict[str, str]) -> Any:
        """The leading router's whole config (``GET /admin/config``); raises
        httpx.HTTPError, ValueError or KeyError."""
        response = await self.client.get(
            leader_url.rstrip("/") + "/admin/config?salt=show", headers=headers, timeout=2.0
        )
        response.raise_for_status()
        return response.json()["config"]

    async def leader_rules(self, leader_url: str, headers: dict[str, str]) -> list[Any]:
        """The leading router's rules (``GET /admin/rules``), as ``[[rules]]``
        tables; raises httpx.HTTPError, ValueError, KeyError or TypeError."""
        response = await self.client.get(
            leader_url.rstrip("/") + "/admin/rules", headers=headers, timeout=2.0
        )
        response.raise_for_status()
        rules = response.json()["rules"]
        if not isinstance(rules, list):
            raise TypeError("rules must be a list")
        return rules


def node_id(response: httpx.Response) -> str | None:
    """The id a /healthz answer gives (nodes say ``node``; routers say nothing)."""
    try:
        data = response.json()
    except ValueError:
        return None
    value = data.get("node") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def _fields(response: httpx.Response) -> dict[str, Any]:
    """A ``/healthz`` answer's fields (none if it is not a JSON object)."""
    try:
        data = response.json()
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _not_for(
    member: Member,
    health: dict[str, Any],
    round_robin: bool,
    owner_routed: bool,
    cluster: str | None,
) -> MembershipError | None:
    """Why a node that answered as itself is not for this router, or None. A
    field a node does not send (a version before it did) refuses nothing.
    ``owner_routed``: the router routes each key to its owner, which keeps its
    state (in-memory, sticky), as a node takes its own shard."""
    sticky = health.get("sticky")
    if sticky is False and owner_routed:
        # It has no shard: a handoff to it was refused (409), and its users'
        # counts were lost when it left (102 over the limit: a day's-end tester).
        return MembershipError(
            409,
            "wrong_backend",
            f"node {member.id} owns no keys (it runs --backend redis, or --balance "
            "round-robin), and this router routes each key to its owner: start the node "
            "with this cluster's --backend and --balance",
        )
    if sticky is True and round_robin:
        # Every request sent to a node that does not own its key was refused
        # (421), and one in 256 ran out of attempts: 503 ring_changing on a
        # steady ring, with nothing logged (an exploratory tester).
        return MembershipError(
            409,
            "wrong_backend",
            f"node {member.id} limits on its own and refuses keys it does not own, and "
            "this router balances round-robin (--backend redis): start the node with "
            "--backend redis and the cluster's --redis-url",
        )
    other = health.get("cluster")
    if cluster is not None and isinstance(other, str) and other != cluster:
        # Taken, its ring (newer) was adopted as this cluster's and committed to
        # etcd: two clusters' routers then shared nodes, two rings had one
        # epoch, and users got a second quota (an exploratory tester).
        return MembershipError(
            409,
            "node_in_another_ring",
            f"node {member.id} holds the ring of cluster {other!r} (epoch "
            f"{held_epoch(health.get('epoch'))}), not {cluster!r}: give it to that "
            "cluster's routers, or restart it empty to join this one",
        )
    return None


def held_epoch(epoch: object) -> int:
    """The epoch a node reported, if it says it holds a view; else 0 (none, a
    bool, junk)."""
    return epoch if type(epoch) is int and epoch > 0 else 0
