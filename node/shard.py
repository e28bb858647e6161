"""A node's shard: the async driver around the authority core.

The protocol itself (fencing by epoch, the outbox and final marks,
pull-on-miss, crash policies, replicas, hand-back, the lease check) is the
I/O-free state machine in node/shardcore.py: read that to change the handoff.
This module runs it in the node process. It owns what the core must not:
the peers (HTTP), retries and sleeps, the in-flight waits of requests that
need a pulled key, background tasks, logging, and the clocks. Every time
the core sees comes from an injected clock: ``clock`` for the engine's
time, ``monotonic`` for the lease and ``timer`` for handoff deadlines and
transfer timings (monotonic too; real elapsed time by default).

See docs/rebalancing.md for what each event costs in the worst case.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from node.clock import Clock, boot_clock
from node.config import ClusterConfig
from node.failures import Failures
from node.inline import in_a_task
from node.lease import Lease
from node.memory import freeze_for_transfer, thaw_after_transfer
from node.peers import PeerError, Peers, bulk
from node.rules import Rule
from node.shardcore import (
    MAX_CRASHES,
    SUCCESSOR_CACHE,
    Crash,
    HandoffStats,
    InFlight,
    LeaseExpired,
    NoLongerMember,
    NotOwner,
    Pull,
    ShardCore,
    StaleEpoch,
    Transfer,
)
from node.store import MemoryStore, Record, check_records
from ring import RingView

__all__ = [
    "SUCCESSOR_CACHE",
    "Crash",
    "HandoffStats",
    "InFlight",
    "LeaseExpired",
    "NoLongerMember",
    "NotOwner",
    "Shard",
    "ShardCore",
    "StaleEpoch",
]

log = logging.getLogger("ringlimit.node")

#: Records per chunk of a handoff (and per replica batch): a chunk is ~0.5 MB of
#: msgpack that the receiver decodes, checks and applies in one go, so its event
#: loop stalls that long, and a lease probe with it; a failure resends one chunk.
#: ``python -m benchmarks.handoff`` (1,000,000 keys) reports the receiver's
#: longest ``/healthz`` wait: 50,000 made it 82-127 ms and took 2.1 s; 10,000
#: makes it 32-40 ms and takes 1.9 s (5,000: 46-61 ms, 2.0 s). Under a
#: saturated host every stall grows, and one past the detection time had a
#: node removed as crashed in the middle of a join.
CHUNK = 10_000
#: With an outbox of this many states the heap is frozen out of the cyclic GC's
#: collections (``gc.freeze()``) until it is delivered.
FREEZE_AT = 10_000
#: Chunks of one handoff in flight at once: two keep sender and receiver busy together.
WINDOW = 2
#: How long a delivery waits for pulls in progress before it sends final marks
#: (:meth:`Shard.deliver`): a pull takes milliseconds unless its peer struggles;
#: one that takes longer brings its state after the marks.
PULLS_WAIT = 1.0
#: A failed delivery is sent again this many times (Shard._redeliver_later), the
#: pauses doubling from REDELIVERY_PAUSE seconds (0.5 s, 1 s, 2 s... at most 10 s).
REDELIVERY_TRIES = 8
REDELIVERY_PAUSE = 0.5
#: Seconds a request waiting for handoffs goes at most without looking again
#: (news wakes it sooner: :meth:`Shard._await_handoffs`).
HANDOFF_RECHECK = 0.5


class Shard:
    """Drives a :class:`ShardCore` for the node: same events, real peers and timers."""

    def __init__(
        self,
        node_id: str,
        store: MemoryStore,
        clock: Clock,
        peers: Peers,
        config: Callable[[], ClusterConfig],
        *,
        handoff_wait: float = 5.0,
        lease: Lease | None = None,
        monotonic: Clock = boot_clock,
        timer: Clock = time.monotonic,
    ) -> None:
        self.core = ShardCore(
            node_id,
            store,
            config,
            handoff_wait=handoff_wait,
            lease=lease,
            incarnation=secrets.randbits(62),
        )
        self.id = node_id
        self.store = store
        self.clock = clock
        self.peers = peers
        self._config = config
        #: The lease's clock (keeps counting while the host sleeps).
        self.monotonic = monotonic
        #: Handoff deadlines and transfer timings (the event loop's time before).
        self.timer = timer
        #: Errors the replication loop survived (/metrics).
        self.failures = Failures(log)
        #: Pulls under way, by key: a second request for the key waits for the first.
        self._pulling: dict[str, asyncio.Future[None]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        #: This shard holds the heap frozen for an outbox still on its way.
        self._frozen = False
        #: The epoch whose failed delivery is being sent again in the background.
        self._redelivering: int | None = None
        #: Resolved (and dropped) when what a request waiting for handoffs looks at
        #: may have changed: a transfer or mark came in, a view, a pull ended
        #: (see :meth:`_await_handoffs`). Made by the first such waiter.
        self._handoff_news: asyncio.Future[None] | None = None
        #: The timer that resolves it at the deadline if no news comes first.
        self._handoff_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the core's state

    @property
    def view(self) -> RingView | None:
        return self.core.view

    @view.setter
    def view(self, view: RingView | None) -> None:
        self.core.view = view

    @property
    def previous(self) -> RingView | None:
        return self.core.previous

    @property
    def epoch(self) -> int:
        return self.core.epoch

    @property
    def stats(self) -> HandoffStats:
        return self.core.stats

    @property
    def lease(self) -> Lease:
        return self.core.lease

    @property
    def handoff_wait(self) -> float:
        return self.core.handoff_wait

    @property
    def _replicas(self) -> dict[str, MemoryStore]:
        return self.core.replicas

    # ------------------------------------------------------------------ deciding

    def check_owner(self, key: str) -> None:
        core = self.core
        core.check_owner(key)
        if core.lease.required:
            core.check_lease(self.monotonic())

    def admit_now(self, key: str, rules: Sequence[Rule]) -> bool:
        """:meth:`admit` without a coroutine, when nothing can make it wait.

        Raises as :meth:`admit` does. True: ``key`` is admitted (fenced, lease
        checked, crash policy applied), decide it now. False: a handoff into
        this node is under way, so the caller must ``await admit(key, rules)``,
        which checks again; nothing was changed yet (only checks ran).
        """
        core = self.core
        if core.view is not None:  # (none: a node alone decides every key)
            core.check_owner(key)  # check_owner, inline: this is every request's path
        if core.lease.required:
            core.check_lease(self.monotonic())
        if core.pending:
            return False
        if core.crashes:
            core.conservative(key, rules, self.clock())
        return True

    def admit_many_now(self, keys: Iterable[str]) -> bool:
        """:meth:`admit_now` for a batch's keys at once, in the common case: no
        handoff under way, no crash remembered, no lease. Raises as
        :meth:`admit_now` would for the first key it refuses. False: not that
        case; nothing was checked, the caller admits key by key."""
        core = self.core
        if core.pending or core.crashes or core.lease.required:
            return False
        core.check_owners(keys)
        return True

    async def admit(self, key: str, rules: Sequence[Rule]) -> bool:
        """Raise :class:`NotOwner` unless this node may decide ``key`` now.

        While a handoff into this node is still under way, make sure the key's
        inherited state is here before anyone decides on it. Returns True when
        it had to wait: a newer view may have arrived meanwhile, so a caller
        deciding several keys must check ownership again just before deciding
        (:meth:`check_owner`, which does not wait).
        """
        if self.admit_now(key, rules):
            return False
        # Pulls go through httpx, which needs a current task (node/inline.py).
        await in_a_task()
        core = self.core
        step = core.inherit(key, rules, self.timer())
        while step is not None:
            if isinstance(step, Pull):
                await self._pull(step)
            else:
                await self._await_handoffs(key, rules)
            # Asked again: the owner pulled may have referred the key to another
            # member (ShardCore.refer), or a newer view came during the wait and
            # the state is to be looked for under it. Each member is asked once per
            # key and view, and a wait ends only when a deadline passes, the marks
            # have come or the view changed, so this ends.
            step = core.inherit(key, rules, self.timer())
        self.check_owner(key)  # the view may have changed during the pull
        if core.crashes:
            core.conservative(key, rules, self.clock())
        return True

    async def _pull(self, pull: Pull) -> None:
        waiting = self._pulling.get(pull.key)
        if waiting is not None:
            await waiting
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pulling[pull.key] = future
        core = self.core
        core.start_pull(pull)
        try:
            deadline = self.timer() + core.handoff_wait
            answer: dict[str, Any] = {}
            while True:
                try:
                    answer = await self.peers.post(pull.url, "/internal/pull", pull.payload())
                    break
                except PeerError as exc:
                    # 409: the peer has not applied this epoch yet, or the key's
                    # state is in a transfer to us right now; no answer or a 5xx:
                    # a hiccup. Wait for either to change, but not past the
                    # deadline, and stop as soon as the peer's transfer has landed
                    # (its final mark came in).
                    if exc.transient and self.timer() < deadline:
                        await asyncio.sleep(0.02 if exc.status == 409 else 0.05)
                        if not core.awaits(pull.owner):
                            break
                        continue
                    raise
            records = check_records(answer.get("records", []))
            if core.take_pulled(records, self.clock(), pull.epoch):
                # A newer view moved the key on during the pull: its state goes
                # to its owner now (deliver held that view's marks for it, for a while).
                self.spawn(self.deliver())
            earlier = answer.get("from")
            if not records and type(earlier) is list:
                core.refer(pull, [m for m in earlier if type(m) is str])
        except (PeerError, KeyError, ValueError, TypeError) as exc:
            core.pull_failed(pull)
            if pull.late and not core.awaits(pull.owner):
                log.warning(
                    "pull of one key from %s failed (%s); deciding on local state; "
                    "its handoff is past its deadline: no longer waited for",
                    pull.owner,
                    exc,
                )
            else:
                # One per key asked about while the previous owner fails: at most
                # a line per 10 s (each is counted: ringlimit_handoff_pull_failures_total).
                self.failures.warn(
                    "pull",
                    "pull of one key from %s failed (%s); deciding on local state",
                    pull.owner,
                    exc,
                )
        finally:
            core.pull_done(pull)
            del self._pulling[pull.key]
            future.set_result(None)
            self._news()  # (a failed pull may end the wait for its owner)

    async def _await_handoffs(self, key: str, rules: Sequence[Rule]) -> None:
        """Until no member's final mark is awaited (their transfers carry a crashed
        member's replicas), every deadline has passed, the view changed, or a
        state for ``key`` has arrived.

        Woken by the news (:meth:`_news`), not by polling: after a crash every
        request for the crashed member's keys waits here until the replicas'
        holders have sent them, thousands at once under load, and each polling
        at 50 Hz was a node busy waking its waiters while the transfers it
        waited for came in (and up to 20 ms late for each). A waiter still
        looks again at least every :data:`HANDOFF_RECHECK` seconds: the
        deadlines pass on ``timer``, which nothing announces."""
        core = self.core
        epoch = core.epoch
        while core.pending and core.epoch == epoch and not core.holds(key, rules):
            left = max(core.pending.values()) - self.timer()
            if left <= 0:
                return  # every deadline has passed
            news = self._handoff_news
            if news is None:
                loop = asyncio.get_running_loop()
                news = self._handoff_news = loop.create_future()
                # One timer for every waiter, for the deadlines (nothing announces
                # them): at the last one, or sooner (``timer`` may not be the loop's).
                # Cancelled by any news: it belongs to this future only.
                self._handoff_timer = loop.call_later(min(left, HANDOFF_RECHECK), self._news)
            # Shielded: a waiter cancelled (its client gone) leaves it to the others.
            await asyncio.shield(news)

    def _news(self) -> None:
        """Wake the requests waiting for handoffs (:meth:`_await_handoffs`): each
        looks again at what it waits for."""
        timer = self._handoff_timer
        if timer is not None:
            # Left running, it would wake the next round's waiters early, and each
            # early round start a timer of its own: a chain per news, for the
            # rest of the wait (100 transfers in: more wake-ups than polling).
            self._handoff_timer = None
            timer.cancel()
        news = self._handoff_news
        if news is not None:
            self._handoff_news = None
            if not news.done():
                news.set_result(None)

    # ------------------------------------------------------------------ views

    def apply(
        self,
        view: RingView,
        previous: RingView | None,
        crashed: Sequence[str] = (),
    ) -> bool:
        """Adopt a newer view: fence, hand off, and set up inheritance.

        Runs without awaiting, so no request can be decided between the
        switch of view and the removal of the keys that moved away.
        """
        with bulk():  # the outbox: a record (two lists) per state that moves away
            handed_back = self.core.apply(view, previous, crashed, self.clock(), self.timer())
            outbox = self.core.outbox
            if handed_back is not None and sum(map(len, outbox.values())) >= FREEZE_AT:
                # The outbox lives until delivered, seconds; every collection in
                # the meantime would walk its millions of lists (measured: 300k
                # allocations after a 1M-key export took 0.57 s with it walked,
                # 0.06 s with it frozen). The whole heap is frozen, the outbox
                # with it; deliver() restores the process's policy.
                if not self._frozen:
                    self._frozen = True
                    freeze_for_transfer()
                else:
                    gc.freeze()  # this outbox too (the hold is already ours)
        self._news()
        if handed_back:
            log.warning(
                "removed from the ring while away: handing %d state(s) back to their owners",
                handed_back,
            )
        return handed_back is not None

    async def deliver(self) -> dict[str, int]:
        """Send every outbox entry to its new owner, with a final mark for each member."""
        if self.core.view is None:
            return {}
        started = self.timer()
        sent: dict[str, int] = {}
        epoch = self.core.epoch
        pulls = [
            future
            for key, future in self._pulling.items()
            if self.core.pulling.get(key, epoch) < epoch
        ]
        if pulls:
            # A pull of an older view still on its way may bring a state this view
            # gives another member: it must go with the final mark to that member
            # (ShardCore.take_pulled), or the member stops waiting and decides the
            # key fresh. Pulls end within their own deadline; this waits less.
            await asyncio.wait(pulls, timeout=PULLS_WAIT)

        async def send(transfer: Transfer) -> None:
            landed = False
            chunks = transfer.chunks(CHUNK)
            arrived: set[int] = set()
            failure: list[PeerError] = []
            window = asyncio.Semaphore(WINDOW)

            async def one(index: int) -> None:
                async with window:
                    if failure:
                        return
                    try:
                        await self._send_chunk(chunks[index])
                    except PeerError as exc:
                        failure.append(exc)
                    else:
                        arrived.add(index)

            try:
                # Every chunk but the last, a few at a time (the receiver applies
                # one while the next is encoded and sent); the last, with the
                # final mark, only once all of them have landed.
                await asyncio.gather(*(one(i) for i in range(len(chunks) - 1)))
                if not failure:
                    await one(len(chunks) - 1)
                if not failure:
                    self.core.delivered(transfer)
                    sent[transfer.to] = len(transfer.records)
                else:
                    log.warning(
                        "handoff of %d keys to %s failed (%s); kept for pulls",
                        len(transfer.records),
                        transfer.to,
                        failure[0],
                    )
                    # What landed stays landed (the receiver merges a state
                    # pulled again with the one it has: never quota twice).
                    done = [r for i in sorted(arrived) for r in chunks[i].records]
                    rest = [
                        r for i in range(len(chunks)) if i not in arrived for r in chunks[i].records
                    ]
                    self.core.partly_delivered(transfer, done, rest, self.clock())
                landed = True
            finally:
                if not landed:
                    # Cancelled (or a bug): no pull may wait for these states any longer.
                    self.core.abandon(transfer)

        try:
            await asyncio.gather(*(send(t) for t in self.core.transfers(self.clock())))
        finally:
            if self._frozen and not self.core.in_flight:
                # Nothing on its way any more (delivered, or back in the outbox for pulls).
                self._frozen = False
                thaw_after_transfer()
            self.core.stats.last_transfer_seconds = self.timer() - started
        self._redeliver_if_owed()
        return sent

    def _redeliver_if_owed(self) -> None:
        """:meth:`_redeliver_later`, if a failed delivery left something owed to a
        member of the current view, this node being one."""
        view = self.core.view
        if view is not None and self.id in view and self.core.owes_handoff():
            self._redeliver_later()

    def _redeliver_later(self) -> None:
        """Send what a failed delivery left in the outbox again, in the background.

        Until it lands its new owner pulls each key it is asked about, and it
        waits for this node's final mark: with every request on the slow path
        (``admit``), and past its deadline only for as long as this node
        answers its pulls. Delivered, the final mark ends that. Tried
        :data:`REDELIVERY_TRIES` times with growing pauses, while the view lasts
        (a newer view sends the outbox again itself).
        """
        epoch = self.core.epoch
        if self._redelivering == epoch:
            return
        self._redelivering = epoch
        self.spawn(self._redeliver(epoch))

    async def _redeliver(self, epoch: int) -> None:
        try:
            for attempt in range(REDELIVERY_TRIES):
                await asyncio.sleep(min(REDELIVERY_PAUSE * 2**attempt, 10.0))
                if self.core.epoch != epoch or not self.core.owes_handoff():
                    return
                await self.deliver()  # schedules no other round: this one runs
        finally:
            if self._redelivering == epoch:
                self._redelivering = None

    async def _send_chunk(self, chunk: Transfer) -> None:
        """One chunk of a handoff, tried three times; ``PeerError`` if it never lands."""
        for attempt in range(3):
            try:
                await self.peers.post(
                    chunk.url,
                    "/internal/import",
                    chunk.payload(),
                    # Time in proportion to the size (a chunk is bounded, a
                    # forwarded batch is not), never below the default.
                    seconds=max(5.0, len(chunk.records) / 20_000),
                    compact=True,
                )
                return
            except PeerError:
                if attempt == 2 or self._dropped(chunk):
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))

    def _dropped(self, chunk: Transfer) -> bool:
        """Whether a newer view dropped the chunk's receiver: not tried again (its
        states go to their owner under that view: ShardCore.partly_delivered).
        A node whose leave had a paused member's removal folded in went on
        trying that member, 3 tries of 5 s, and exited 15 s late (a tester)."""
        view = self.core.view
        return view is not None and chunk.epoch < view.epoch and chunk.to not in view

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Cancel the background work (deliveries, redeliveries, forwards) at shutdown."""
        # Requests still waiting for handoffs look again now (and end with the
        # server), and no future of this loop outlives it in a shard kept for the next.
        self._news()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    # ------------------------------------------------------------------ peers' calls

    def receive(
        self,
        sender: str,
        epoch: int,
        records: list[Record],
        final: bool,
        crashes: Sequence[dict[str, Any]] = (),
    ) -> int:
        now = self.clock()
        if len(crashes) > MAX_CRASHES:
            raise ValueError(
                f"a transfer carries at most {MAX_CRASHES} crashes; this one has {len(crashes)}"
            )
        incoming = [Crash.from_wire(data, now) for data in crashes]
        received = self.core.receive(sender, epoch, records, final, incoming, now)
        self._news()
        if received.forwards:
            self.spawn(self._forward(received.forwards))
        if received.dropped:
            log.warning(
                "%d state(s) from %s dropped: their rule is unknown here", received.dropped, sender
            )
        return received.taken

    async def _forward(self, transfers: list[Transfer]) -> None:
        """Pass states on to their owners, without a final mark (not a handoff of ours)."""
        for transfer in transfers:
            try:
                await self.peers.post(
                    transfer.url, "/internal/import", transfer.payload(), compact=True
                )
                self.core.delivered(transfer)
            except PeerError as exc:
                log.warning(
                    "passing %d state(s) on to %s failed: %s",
                    len(transfer.records),
                    transfer.to,
                    exc,
                )
                self.core.undelivered(transfer, self.clock())
                # Back in the outbox (say its member left meanwhile: 409
                # no_longer_member): sent again, as a failed delivery is.
                self._redeliver_if_owed()

    def serve_pull(self, keys: Sequence[str], to: str, epoch: int) -> list[Record]:
        """Give up the named keys' states to their new owner (from the outbox or the store)."""
        return self.core.serve_pull(keys, to, epoch, self.clock())

    def receive_replicas(
        self, origin: str, records: list[Record], round: tuple[int, int] | None = None
    ) -> int:
        return self.core.receive_replicas(origin, records, self.clock(), round)

    # ------------------------------------------------------------------ replication

    def replication_wanted(self) -> bool:
        return self.core.replication_wanted()

    async def replicate_once(self) -> int:
        """Send every state changed since the last round to its key's successors
        (as many as the state's rule asks for: ``replicas``)."""
        sent = 0
        self.core.release_settled(self.timer())
        # In slices of CHUNK keys: a round's records and bodies stay bounded (a
        # million changed keys at once held ~200 B per key of garbage, which a
        # busy heap does not give back). Keys that fail wait for the next round.
        failed: list[Record] = []
        try:
            # The keys changed before the round began, and no more: one body per
            # successor per interval (ShardCore.replica_round).
            left = self.core.replica_round()
            while left > 0:
                left -= CHUNK
                with bulk():
                    batches = self.core.replica_batches(self.clock(), CHUNK)
                for batch in batches:
                    try:
                        await self.peers.replicate(batch.url, batch.payload())
                        sent += len(batch.records)
                    except PeerError as exc:
                        log.debug("replication to %s failed: %s", batch.to, exc)
                        failed += batch.records
                del batches
        finally:
            self.core.replicas_failed(failed)
        self.core.stats.replicas_sent += sent
        return sent

    async def run_replication(self) -> None:
        while True:
            interval = self._config().policies.replication_interval
            await asyncio.sleep(interval)
            if self.core.replication_tick():
                try:
                    await self.replicate_once()
                except Exception as exc:  # the loop outlives any one failure, never silently
                    self.failures.record("replication_loop", exc)

    def status(self) -> dict[str, Any]:
        return self.core.status()
