"""Many routers, one ring: membership kept in etcd.

Without a coordinator one router owns membership (its state file is the only
record of the ring). With ``--coordinator etcd://host:port[,host:port...]``
every router of a cluster shares one record in etcd, under
``/ringlimit/<cluster>/``:

``view``
    the newest ring view as a JSON record: the view, the one before it, the
    members it removed as crashed, the cluster config, and ``settled`` (false
    from the moment a change is committed until its push protocol is done).
``leader``
    the leading router's admin URL, attached to an etcd lease.

Why it is safe:

* **One history of epochs.** A change is committed with one transaction
  conditioned on the ``view`` key's revision the change was built from
  (:meth:`EtcdCoordinator.commit`). Two routers building on the same view
  cannot both succeed; the loser reloads and retries or reports a conflict.
* **One leader at a time** carries out changes (admin calls reach it through
  any router), runs health checks and grants node leases. Leadership is an
  etcd key on an etcd lease of ``ttl`` seconds. The leader steps down on its
  own once it has not refreshed that lease for 0.8 * ``ttl`` seconds, measured
  from when it *sent* the refresh, so it has stopped acting before etcd can
  expire the key and elect another. Every keep-alive step, and the wait
  between two, runs under that deadline: an etcd that hangs cannot keep a
  leader leading past it. Its commits are fenced by etcd; a node lease it
  grants, which etcd does not see, asks :meth:`EtcdCoordinator.holds_lead`.
* **Roll forward.** The push protocol runs after the commit, so a leader that
  dies mid-change leaves ``settled = false``; the next leader pushes the same
  view again in the same order (pushing a view twice is harmless) and marks
  it settled. Other routers adopt a view once it is settled, or earlier from a
  node that refuses them with a newer epoch (as without a coordinator).

Pure parts (the record's wire form) are plain functions; the etcd client is
passed in and only this module talks to it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

from node.config import ClusterConfig
from node.failures import Failures
from ring import RingView
from ring.errors import given
from ring.view import check_cluster
from router.etcd_access import EtcdAccess

log = logging.getLogger("ringlimit.router")
#: A broken watch is tried again after WATCH_RETRY seconds, doubled per failed
#: try up to MAX_WATCH_RETRY while etcd stays away.
WATCH_RETRY = 0.5
MAX_WATCH_RETRY = 2.0


#: Seconds a closed client waits for the completions of the calls it cancelled.
CLOSE_SETTLE = 0.1


class CoordinatorError(Exception):
    """etcd could not be reached or answered something unusable."""


class NotLeading(CoordinatorError):
    """A write of the leader's refused: another router leads now (or none does)."""


#: ``_leading`` once this router stepped down: a creation revision no key has, so
#: every commit is refused (NotLeading) until it wins again; None (never led:
#: a router's first record, before its campaign) stays unfenced.
_DEPOSED = -1


@dataclass(frozen=True)
class ViewRecord:
    """What etcd holds about the ring: enough for any router to carry on."""

    view: RingView
    previous: RingView | None
    crashed: tuple[str, ...]
    config: ClusterConfig
    settled: bool
    #: etcd's mod revision of the record (0 for one not read from etcd).
    revision: int = 0

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "version": 1,
                "ring": self.view.to_dict(),
                "previous": self.previous.to_dict() if self.previous is not None else None,
                "crashed": list(self.crashed),
                "config": self.config.to_dict(),
                "settled": self.settled,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes, revision: int) -> ViewRecord:
        try:
            data = json.loads(raw)
            if data.get("version") != 1:
                raise ValueError(f"unknown record version {data.get('version')!r}")
            return cls(
                RingView.from_dict(data["ring"]),
                RingView.from_dict(data["previous"]) if data.get("previous") else None,
                tuple(str(c) for c in data.get("crashed", [])),
                ClusterConfig.from_dict(data["config"], source="etcd record", strict=False),
                bool(data["settled"]),
                revision,
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CoordinatorError(f"the ring record in etcd is unreadable: {exc}") from None


#: The coordinator's URL schemes: plaintext, and TLS (router/etcd_access.py).
SCHEMES = ("etcd://", "etcds://")

#: The shortest leader lease (seconds) a router asks etcd for. etcd's lease TTLs
#: are whole seconds, and etcd raises a shorter one to its own minimum, 1.5 election
#: timeouts rounded up: 2 s with its default settings (more with a longer
#: ``--election-timeout``, which :meth:`EtcdCoordinator.lead` logs).
MIN_TTL = 2
#: The longest (an hour): a leader that dies is replaced this long after, at most.
MAX_TTL = 3600


#: The default ttl: a router takes over about this long after the leader is lost
#: (a second and a half more at most), which the nodes' default lease outlasts.
DEFAULT_TTL = 2
#: What a take-over takes past the ttl: etcd revokes expired leases from a loop
#: that runs every 0.5 s, then the follower campaigns, grants the leases and
#: pushes the view (a few round trips; more on a loaded host).
TAKEOVER_SLACK = 1.5


def node_lease(detection: float, probe_round: float, ttl: float | None) -> float:
    """The lease a router grants nodes when ``--lease`` is not given.

    The detection time, so that a crashed node is removed as soon as it is
    found (its lease has ended by then). With etcd, at least what a take-over
    needs: leases run ``lease - probe_round`` past their last renewal at the
    least, and no router renews them while none leads. Shorter, every loss of
    the leading router (kill -9, a host down) lapsed every node's lease and
    every rule's ``on_error`` answered, cluster-wide (an exploratory tester,
    at the former default ttl of 5 s: 0.4-1.1 s of it each time, 56-259
    admissions past the limits of open rules).
    """
    if ttl is None:
        return detection
    return max(detection, takeover_lease(ttl, probe_round))


def takeover_lease(ttl: float, probe_round: float) -> float:
    """The shortest lease that outlasts a take-over after the leader is lost."""
    return ttl + TAKEOVER_SLACK + probe_round


#: The share of the ttl after its last refreshed lease that a leader acts for:
#: it has stopped before etcd can expire its key (at the whole ttl, at the earliest).
STEP_DOWN = 0.8


def lease_ttl(seconds: float) -> int:
    """``seconds`` as the whole number of seconds etcd's leases are counted in.

    Refused (ValueError) unless it is a whole number from :data:`MIN_TTL` to
    :data:`MAX_TTL`: rounded quietly, 0.5 became 2 and 2.7 became 3, so the
    router led and took over on another ttl than the operator asked for,
    without a word.
    """
    if not math.isfinite(seconds) or seconds != int(seconds) or not MIN_TTL <= seconds <= MAX_TTL:
        raise ValueError(
            f"must be a whole number of seconds from {MIN_TTL} to {MAX_TTL} "
            f"(etcd's leases count whole seconds), not {seconds:g}"
        )
    return int(seconds)


def parse_endpoints(spec: str) -> list[tuple[str, int]]:
    """``etcd://h1:2379,h2:2379`` -> ``[("h1", 2379), ("h2", 2379)]`` (or ``etcds://``)."""
    scheme = next((s for s in SCHEMES if spec.startswith(s)), None)
    if scheme is None:
        raise ValueError(
            f"coordinator {spec!r}: expected etcd://HOST:PORT[,HOST:PORT...] (etcds:// for TLS)"
        )
    if "@" in spec:
        # Not echoed: what comes before the "@" is a password.
        raise ValueError(
            f"coordinator {scheme}...: no user or password in the URL; give etcd's user "
            "with --etcd-user and its password in RINGLIMIT_ETCD_PASSWORD"
        )
    endpoints = []
    for part in spec[len(scheme) :].split(","):
        parsed = urlsplit(f"etcd://{part.strip()}")
        try:
            port = parsed.port or 2379
        except ValueError:
            raise ValueError(f"coordinator {spec!r}: bad port in {part!r}") from None
        if not parsed.hostname or parsed.path not in ("", "/"):
            raise ValueError(f"coordinator {spec!r}: expected HOST:PORT, got {given(part)}")
        endpoints.append((parsed.hostname, port))
    return endpoints


class EtcdCoordinator:
    """The ring record and the leadership, in etcd (via ``aetcd``)."""

    def __init__(
        self,
        endpoints: list[tuple[str, int]],
        *,
        cluster: str = "default",
        ttl: float = DEFAULT_TTL,
        timeout: float = 2.0,
        access: EtcdAccess | None = None,
    ) -> None:
        #: The cluster's name: etcd's keys, and the pushes to its nodes, carry it.
        self.cluster = check_cluster(cluster)
        if not endpoints:
            raise ValueError("no etcd endpoint given")
        self.endpoints = endpoints
        self.prefix = f"/ringlimit/{cluster}/".encode()
        try:
            #: The leader's etcd lease (whole seconds): see :func:`lease_ttl`.
            self.ttl = lease_ttl(ttl)
        except ValueError as exc:
            raise ValueError(f"coordinator ttl: {exc}") from None
        self.timeout = timeout
        #: TLS and auth (router/etcd_access.py); None: plaintext, no user.
        self.access = access or EtcdAccess()
        self._client: Any = None
        self._connecting = asyncio.Lock()
        self._reading = asyncio.Lock()
        self._endpoint = 0
        #: etcd's revision at the last :meth:`load` (from the response header,
        #: even when the key is absent): where a watch from "now" really starts.
        self.read_revision = 0
        #: How many times etcd was found behind a revision this router had read:
        #: its data was lost or restored from an older snapshot (revisions never
        #: go back otherwise). Membership forgets the revisions it conditions
        #: its commits on when this moves (router/membership.py).
        self.history_lost = 0
        #: Retries while etcd is away: one line per kind every 10 s, not one per try.
        self._quiet = Failures(log)
        #: While this router leads: the creation revision of its leader key,
        #: which every :meth:`commit` requires to be unchanged (see there).
        self._leading: int | None = None
        #: The creation revision of the leader key this router made last (kept
        #: after it steps down: :meth:`resign` deletes that key, not a successor's).
        self._created: int | None = None
        self._warned_ttl = False
        #: The longest leader lease etcd granted (it raises a ttl below its minimum):
        #: what a take-over may take, which the nodes' default lease outlasts.
        self.granted_ttl = self.ttl
        #: While this router leads: when it must have stopped acting as leader,
        #: 0.8 * ttl after the last refresh of its lease that succeeded (on the
        #: clock :meth:`lead` was given): see :meth:`holds_lead`.
        self._until = float("-inf")
        self._clock: Callable[[], float] = time.monotonic

    def holds_lead(self) -> bool:
        """True while this router leads and its step-down deadline has not passed.

        For an action etcd does not fence, taken just before it is sent (a node
        lease granted): the keep-alive's own step-down at the deadline is a task
        of the event loop, which may run late, and the action's task first.
        """
        return self._leading not in (None, _DEPOSED) and self._clock() < self._until

    @property
    def where(self) -> str:
        return ",".join(f"{host}:{port}" for host, port in self.endpoints)

    def _key(self, name: str) -> bytes:
        return self.prefix + name.encode()

    # ------------------------------------------------------------------ connection

    async def connect(self) -> None:
        """Connect to the first endpoint that answers, from the current one on."""
        async with self._connecting:
            await self._connect()

    async def _connect(self) -> None:
        errors = []
        for i in range(len(self.endpoints)):
            host, port = self.endpoints[(self._endpoint + i) % len(self.endpoints)]
            client = self.access.client(host, port, self.timeout)
            try:
                await client.connect()
                await client.status()
            except Exception as exc:  # aetcd raises several grpc-derived types
                errors.append(f"{host}:{port}: {_why(exc)}")
                with contextlib.suppress(Exception):
                    await client.close()
                continue
            except asyncio.CancelledError:
                # A deadline (the leader's keep-alive) cut the connection short:
                # close its channel rather than leak it (a leaked gRPC channel
                # can hang the event loop's shutdown).
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await asyncio.wait_for(client.close(), timeout=self.timeout)
                raise
            old, self._client = self._client, client
            self._endpoint = (self._endpoint + i) % len(self.endpoints)
            if old is not None:
                await self._close_client(old)
            return
        raise CoordinatorError(f"etcd not reachable at {'; '.join(errors)}")

    async def _connected(self) -> Any:
        """The client, connecting first when there is none.

        One connection at a time: the leader's keep-alive and the watch run
        side by side and both reconnect after etcd comes back. Unserialised,
        the second would close the client the first had just made, under the
        first's call, which would then close the second's, and so on.
        """
        async with self._connecting:
            if self._client is None:
                await self._connect()
            return self._client

    async def _drop(self, client: Any) -> None:
        """Give up ``client`` after a failed call, unless another is already in use."""
        if self._client is client:
            self._client = None
            self._endpoint += 1
        await self._close_client(client)

    async def _close_client(self, client: Any) -> None:
        try:
            await asyncio.wait_for(client.close(), timeout=self.timeout)
        except (Exception, asyncio.CancelledError) as exc:
            # A stray CancelledError (gRPC's, see _stray) is the close failing; this
            # task's own (a shutdown, a caller's deadline) goes on: swallowed, the
            # caller's next attempt ran past its wait_for deadline.
            if not _failed(exc):
                raise

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await self._close_client(client)
            # Closing a channel cancels its calls, but their completions come
            # back a moment later through gRPC's poller thread, to the loop
            # that made them: if that loop has closed by then, gRPC raises
            # "Event loop is closed" in whichever loop runs next (a traceback
            # at exit; a failed test under per-test loops). Let them land.
            await asyncio.sleep(CLOSE_SETTLE)

    async def _call(self, what: str, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """One etcd call; on a connection failure, the next endpoint, once."""
        for attempt in range(2):
            client = await self._connected()
            try:
                return await call(client)
            except CoordinatorError:
                raise
            except (Exception, asyncio.CancelledError) as exc:
                if not _failed(exc):
                    raise
                if attempt == 1:
                    raise CoordinatorError(f"etcd {what} failed: {_why(exc)}") from None
                # Its channel too: a leaked gRPC channel can hang the loop.
                await self._drop(client)
        raise AssertionError("unreachable")  # pragma: no cover

    # ------------------------------------------------------------------ the record

    async def load(self) -> ViewRecord | None:
        """The record in etcd, or None when there is none yet.

        Either way :attr:`read_revision` becomes the store's revision at that
        read (the response header's), which a watch started with ``since=0``
        starts after: a first view committed between an empty read and the
        watch's start is not missed.
        """
        record, _ = await self._load_at()
        return record

    async def _load_at(self) -> tuple[ViewRecord | None, int]:
        """:meth:`load`, and the store's revision at that read."""
        key = self._key("view")
        # One read at a time: the answers are taken in the order etcd gave them,
        # so a revision below the last one read is etcd's going back, never two
        # reads overtaking each other. (Reads are linearizable: any member
        # answers at the cluster's latest revision.)
        async with self._reading:
            got = await self._call("read", lambda c: c.get_range(key, key + b"\0"))
            at = int(got.header.revision)
            self._took_revision(at)
        if not got.kvs:
            return None, at
        kv = got.kvs[0]
        return ViewRecord.from_json(kv.value, kv.mod_revision), at

    def _took_revision(self, at: int) -> None:
        if at < self.read_revision:
            self.history_lost += 1
            log.error(
                "etcd %s is at revision %d, behind the %d this router read before: its data "
                "was lost or restored from an older snapshot; the leading router records its "
                "ring again",
                self.where,
                at,
                self.read_revision,
            )
        self.read_revision = at

    async def commit(self, record: ViewRecord, expected: int) -> ViewRecord | None:
        """Write ``record`` if the view key is still at revision ``expected`` (0: absent).

        Returns the record with its new revision, or None when another router
        changed the ring first (reload and rebuild the change on the new view).

        While this router leads, the write also requires its leader key to be
        the one it created (etcd's election fence). A leader that a pause or a
        partition deposed cannot write a view or rules over its successor's,
        even one built on the latest revision, before its own deadline notices
        or after (until it wins again); it gets :class:`NotLeading`. The first
        record of a cluster is written before anyone leads, unfenced:
        ``expected`` 0 already lets only one router create it.
        """
        key = self._key("view")
        leader_key = self._key("leader")
        raw = record.to_json()
        leading = self._leading

        sent = 0

        async def txn(client: Any) -> tuple[bool, Any]:
            nonlocal sent
            sent += 1
            compare = (
                [client.transactions.create(key) == 0]
                if expected == 0
                else [client.transactions.mod(key) == expected]
            )
            if leading is not None:
                compare.append(client.transactions.create(leader_key) == leading)
            ok, _ = await client.transaction(
                compare=compare, success=[client.transactions.put(key, raw)], failure=[]
            )
            if ok:
                return ok, await client.get(key)
            if sent > 1:
                stored = await client.get(key)
                if stored is not None and stored.value == raw:
                    # This very record: the first send's write, whose answer was
                    # lost (_call sent it again). Taken for a refusal, the leader
                    # would build every later change on a revision it can never
                    # match again.
                    return True, stored
            return ok, (await client.get(leader_key) if leading is not None else None)

        ok, got = await self._call("commit", txn)
        if not ok:
            if leading is not None and (got is None or got.create_revision != leading):
                raise NotLeading("this router no longer leads: etcd's leader key changed")
            return None
        revision = got.mod_revision if got is not None else 0
        return ViewRecord(
            record.view, record.previous, record.crashed, record.config, record.settled, revision
        )

    async def watch(self, since: int = 0) -> AsyncGenerator[ViewRecord, None]:
        """Every record committed after revision ``since`` (the one the caller
        loaded), reconnecting when etcd goes away.

        Each (re)connection watches from the revision after the last one seen,
        so a change made between the caller's load and the watch's start (or
        while reconnecting) is not missed: without it a router could stay on
        an older view until the next change.
        """
        key = self._key("view")
        # since=0: the caller loaded nothing (an empty etcd). Start after that
        # empty read, not from "now": a first view another router committed in
        # between would otherwise be missed until the next change.
        seen = since if since > 0 else self.read_revision
        delay = WATCH_RETRY
        while True:
            watcher = client = None
            try:
                watcher = await self._call("watch", partial(_watch, key, seen))
                client = self._client  # the one the watch runs on
                async for event in watcher:
                    seen = max(seen, event.kv.mod_revision)
                    if event.kv.value:
                        try:
                            yield ViewRecord.from_json(event.kv.value, event.kv.mod_revision)
                        except CoordinatorError as exc:
                            log.warning("%s", exc)
            except CoordinatorError as exc:
                self._quiet.warn("watch", "watching etcd: %s; retrying", exc)
            except (Exception, asyncio.CancelledError) as exc:
                if not _failed(exc):
                    raise
                self._quiet.warn("watch", "watching etcd: %s; retrying", type(exc).__name__)
                if client is not None:
                    await self._drop(client)
            finally:
                # A watch is a gRPC stream: cancel it here, bounded, rather than
                # leave it to the event loop's shutdown (where it can hang).
                if watcher is not None:
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(watcher.cancel(), timeout=self.timeout)
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_WATCH_RETRY)
            # Whatever broke the watch (etcd restarted, the revision compacted away),
            # the record as it is now is read before watching again, from that
            # read's revision: a change made meanwhile is taken now. (Watching
            # "from now" after an error lost a rules change for good: nothing but
            # the next record would have brought it.)
            lost = self.history_lost
            try:
                record, at = await self._load_at()
            except CoordinatorError as exc:
                self._quiet.warn("watch", "reading etcd after the watch broke: %s; retrying", exc)
                continue
            delay = WATCH_RETRY  # etcd answers again
            if lost != self.history_lost:
                # etcd went back (_load_at): watching from the revision seen
                # before would wait for revisions the new history has not reached.
                seen = 0
            if record is not None and record.revision > seen:
                yield record
            seen = max(seen, at)

    # ------------------------------------------------------------------ leadership

    async def leader(self) -> str | None:
        got = await self._call("read leader", lambda c: c.get(self._key("leader")))
        return got.value.decode() if got is not None else None

    async def lead(
        self,
        url: str,
        on_lead: Callable[[], Awaitable[None]],
        on_lose: Callable[[], Awaitable[None]],
        clock: Callable[[], float],
    ) -> None:
        """Campaign for leadership forever; call ``on_lead`` / ``on_lose`` on changes.

        The leader refreshes its etcd lease every ttl/3 seconds and gives up
        leadership (``on_lose``) once 0.8 * ttl seconds have passed since it
        *sent* the last refresh that succeeded: etcd cannot expire the key
        before ttl seconds after that, so this router has stopped acting as
        leader before another can be elected. The whole keep-alive step (the
        refresh, the check that the key is still ours, any reconnection in
        between) runs under that deadline: an etcd that hangs (paused, cut off
        by a partition) cannot keep this router leading past it. And so does
        the wait between two steps, which ends at the deadline at the latest: a
        step whose refresh failed but whose read came back in time used to
        sleep its ttl/3 past the deadline, leading (and granting node leases)
        after etcd could have elected another.
        """
        key = self._key("leader")
        value = url.encode()
        deposed = False
        while True:
            leading = False
            try:
                if deposed:
                    # Stepped down because etcd did not answer: the leader key it
                    # made outlives the outage (an etcd restarted gives every
                    # lease its whole ttl again), and every router, this one
                    # too, waited that out before an election (the lead came
                    # back ttl + 1 s after etcd did). It is this router's to
                    # free, as a clean shutdown resigns: commits are fenced by
                    # the key's creation, node leases by a new leader's wait.
                    await self._vacate(value)
                    deposed = False
                # Before the grant: etcd's ttl starts when it grants the lease.
                sent = clock()
                lease = await self._call("lease", lambda c: c.lease(self.ttl))
                self._granted(int(lease.ttl))

                async def campaign(client: Any, lease: Any = lease) -> int | None:
                    """The creation revision of the leader key this router made
                    (read in the same transaction), or None: another holds it."""
                    ok, answers = await client.transaction(
                        compare=[client.transactions.create(key) == 0],
                        success=[
                            client.transactions.put(key, value, lease),
                            client.transactions.get(key),
                        ],
                        failure=[],
                    )
                    return int(answers[1][0][1].create_revision) if ok else None

                created = await self._call("campaign", campaign)
                won = created is not None
                if won:
                    sent = await self._refresh_now(lease.id, sent, clock)
                if won and clock() - sent >= self.ttl * STEP_DOWN:
                    # Won too late to act safely (a slow etcd): let the lease go.
                    log.warning("won the leadership too late to use it; campaigning again")
                    won = False
                if not won:
                    with contextlib.suppress(Exception):
                        await self._call("lease revoke", partial(_revoke, lease.id))
                    await self._wait_for_vacancy(key)
                    continue
                leading = True
                self._clock, self._until = clock, sent + self.ttl * STEP_DOWN
                self._leading = self._created = created
                log.warning("leading the cluster's membership (etcd %s)", self.where)
                await on_lead()
                while True:
                    await asyncio.sleep(min(self.ttl / 3, max(0.0, self._until - clock())))
                    await self._keep_alive(lease.id, key, value, clock)
            except (CoordinatorError, asyncio.CancelledError) as exc:
                if not _failed(exc):  # this task is cancelled
                    if leading:
                        self._leading = _DEPOSED
                        await on_lose()
                    raise
                why = str(exc) or "etcd's connection was closed under a call"
                if leading:
                    self._leading = _DEPOSED
                    deposed = True
                    log.warning("stepping down as leader: %s", why)
                    await on_lose()
                else:
                    self._quiet.warn("election", "leader election: %s", why)
                await asyncio.sleep(0.5)

    def _granted(self, ttl: int) -> None:
        """Say so, once, when etcd grants a longer lease than the ttl asked for.

        etcd raises a ttl below its minimum (1.5 of its election timeout) to that
        minimum. The step-down deadline still counts from the ttl asked for (the
        shorter, so still safe), but another router takes over only once etcd
        expires the longer lease: a failover slower than the operator set.
        """
        self.granted_ttl = max(self.granted_ttl, ttl)
        if ttl > self.ttl and not self._warned_ttl:
            self._warned_ttl = True
            log.warning(
                "etcd %s granted the leader lease %d s, not the %d s asked for "
                "(--coordinator-ttl is below its minimum, set by its election timeout): "
                "a take-over waits up to %d s",
                self.where,
                ttl,
                self.ttl,
                ttl,
            )

    async def _refresh_now(self, lease_id: int, sent: float, clock: Callable[[], float]) -> float:
        """Refresh a lease just won; returns when the lease's time now counts from.

        The grant was asked for at ``sent``, and the step-down deadline counts
        from there. After a pause of etcd that is already long ago: the new
        leader stepped down at its first keep-alive and left the cluster
        without a leader a while longer. A refresh that succeeds extends the lease from at least
        when it was sent, so the deadline may count from then; one that fails
        or is late changes nothing.
        """
        refreshing = clock()
        try:
            await asyncio.wait_for(
                self._call("lease refresh", partial(_refresh, lease_id)),
                timeout=max(0.0, sent + self.ttl * STEP_DOWN - refreshing),
            )
        except Exception:  # TimeoutError included: the caller's checks decide
            return sent
        return refreshing

    async def _keep_alive(
        self, lease_id: int, key: bytes, value: bytes, clock: Callable[[], float]
    ) -> None:
        """One keep-alive step of the leader.

        Raises :class:`CoordinatorError` (step down) when the leader key is no
        longer ours, or when the deadline (:attr:`_until`, 0.8 * ttl after the
        last successful refresh) passes before this step is done: the refresh,
        then the read of the leader key, each bounded by that deadline (which a
        successful refresh moves on).
        """
        sent = clock()
        try:
            # Through _call, by the lease's id: if the watch replaced a broken
            # client meanwhile, the refresh uses the new one.
            await asyncio.wait_for(
                self._call("lease refresh", partial(_refresh, lease_id)),
                timeout=max(0.0, min(self.ttl / 3, self._until - sent)),
            )
            self._until = sent + self.ttl * STEP_DOWN
        except Exception as exc:  # TimeoutError included
            log.warning("leader lease refresh failed: %s", type(exc).__name__)
        if clock() >= self._until:
            raise CoordinatorError("leader lease not refreshed in time")
        try:
            got = await asyncio.wait_for(
                self._call("read leader", lambda c: c.get(key)), timeout=self._until - clock()
            )
        except TimeoutError:
            raise CoordinatorError("etcd did not answer before the leader lease ran out") from None
        if got is None or got.value != value or got.create_revision != self._leading:
            raise CoordinatorError("leadership taken over")
        if clock() >= self._until:
            raise CoordinatorError("leader lease not refreshed in time")

    async def resign(self, url: str) -> None:
        """Give leadership up at once (a clean shutdown), if this router holds it
        (the key it created, when it led: not a successor's at the same URL)."""
        with contextlib.suppress(CoordinatorError):
            await self._vacate(url.encode())

    async def _vacate(self, value: bytes) -> None:
        """Delete the leader key if this router made it (:meth:`resign`);
        CoordinatorError when etcd cannot be reached."""
        key = self._key("leader")
        created = self._created

        async def txn(client: Any) -> None:
            # Its URL, and the revision it was made at when known: after etcd lost
            # its data, revisions start again, and a successor's key could carry
            # the revision this router's had (a review).
            mine = [client.transactions.value(key) == value]
            if created is not None:
                mine.append(client.transactions.create(key) == created)
            await client.transaction(
                compare=mine,
                success=[client.transactions.delete(key)],
                failure=[],
            )

        await self._call("resign", txn)

    async def _wait_for_vacancy(self, key: bytes) -> None:
        """Wait until the leader key is gone: a lease expiry or a resignation.

        A watch for the key's deletion, so a follower campaigns as soon as
        etcd frees the key (polling every ttl/3 added up to that much to every
        take-over). Bounded: the watch is given up after ``ttl`` and the key
        read again; on a watch error, a short sleep and the same.
        """
        for _ in range(1000):
            got = await self._call("read leader", lambda c: c.get_range(key, key + b"\0"))
            if not got.kvs:
                return
            watcher = None
            try:
                watcher = await self._call(
                    "watch leader", partial(_watch, key, int(got.header.revision))
                )
                if await asyncio.wait_for(_deleted(watcher), timeout=self.ttl):
                    return
            except (CoordinatorError, TimeoutError):
                pass
            except (Exception, asyncio.CancelledError) as exc:
                if not _failed(exc):
                    raise
                self._quiet.warn(
                    "election", "watching the leader key: %s; retrying", type(exc).__name__
                )
                await asyncio.sleep(min(1.0, self.ttl / 3))
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception, asyncio.CancelledError):
                        await asyncio.wait_for(watcher.cancel(), timeout=self.timeout)


def _stray(exc: BaseException) -> bool:
    """``exc`` is a CancelledError that is not this task's cancellation.

    gRPC's asyncio calls raise CancelledError when their channel is closed under
    them, and a failed call closes the shared client (:meth:`EtcdCoordinator._drop`):
    the watch's failure after an etcd restart thus raised one in the leader's
    keep-alive or a follower's campaign, which took it for a cancellation of
    the campaign and ended it. No router campaigned again: the cluster had no
    leader until a router restarted. A real cancellation (a shutdown, a
    ``wait_for`` deadline) has the task's ``cancelling()`` count set.
    """
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


def _failed(exc: BaseException) -> bool:
    """``exc`` says an etcd call failed: any exception, or a stray CancelledError
    (:func:`_stray`). False for this task's own cancellation, which goes on."""
    return isinstance(exc, Exception) or _stray(exc)


async def _deleted(watcher: Any) -> bool:
    """True once the watched key is deleted (False if the watch ends first)."""
    async for event in watcher:
        if event.kind == "DELETE":
            return True
    return False


async def _refresh(lease_id: int, client: Any) -> Any:
    """Refresh a lease; ``CoordinatorError`` if etcd says it has lapsed: etcd answers
    the keep-alive of an expired or revoked lease with a TTL of 0, not an error,
    and counting that as a refresh would let a router lead on a lease that is gone."""
    reply = await client.refresh_lease(lease_id)
    if getattr(reply, "TTL", 1) <= 0:
        raise CoordinatorError(f"lease {lease_id} has lapsed")
    return reply


async def _revoke(lease_id: int, client: Any) -> Any:
    return await client.revoke_lease(lease_id)


async def _watch(key: bytes, seen: int, client: Any) -> Any:
    """A watch of ``key`` from the revision after ``seen`` (0: from now).

    A read first: etcd answers a watch made with an expired auth token with
    a watch created and cancelled at once, which aetcd 1.0 takes for a
    created one (it then waits for events forever). The read fails on that
    token instead, and :meth:`EtcdCoordinator._call` connects again."""
    await client.get(key)
    return await client.watch(key, start_revision=seen + 1 if seen > 0 else None)


def _why(exc: BaseException) -> str:
    """A failed connection, in one line: aetcd's error type and, when gRPC
    gave them, its details (which say "authentication failed" or which
    certificate check failed, where the type alone does not)."""
    details = str(exc).strip().splitlines()
    detail = details[0] if details else ""
    if "TSI_" in detail or "handshake" in detail.lower():
        detail += (
            " (a TLS handshake failed: etcds:// for a TLS etcd, and --etcd-cert/--etcd-key "
            "when it wants a client certificate)"
        )
    return f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
