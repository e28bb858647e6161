"""Running a node process: uvicorn with the fast options, and a graceful leave.

On SIGTERM or SIGINT a node that joined through a router asks the router to
remove it *before* it stops serving: the router pushes a view without it, the
node hands every state to the new owners, and only then does it exit. (If
uvicorn handled the signal itself it would close the listening socket first,
and the router could not reach the node to take its state.)

After the leave the node lingers a little (``linger`` seconds) before it
exits: it now refuses every key with its new epoch (421), which is how a
router that was not told about the leave (a second router with a stale
view) learns it, instead of finding the node gone and falling back to the
rule's ``on_error``.

SIGHUP stops a node without a leave: ``ringlimit up`` sends it to its nodes
when it tears the whole cluster down (router first), where there is nobody
left to hand counters to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Sequence
from typing import Any

import httpx
import uvicorn

from node.app import Node
from node.frontdoor import FrontDoor, limited_protocol, raise_fd_limit
from node.keepalive import lazy_keep_alive
from node.memory import tune_gc
from node.peers import INSTANCE_HEADER, said
from node.unixsocket import bind_unix

log = logging.getLogger("ringlimit.node")


def uvicorn_options(front_door: FrontDoor | None = None) -> dict[str, Any]:
    """uvloop and httptools when installed, no access log: the hot-path settings;
    and the connection limits and timeouts of ``front_door`` (node/frontdoor.py)."""
    front_door = front_door or FrontDoor()
    # proxy_headers off: X-Forwarded-For is read by node/identity.py, which believes it
    # only from configured proxies; uvicorn's rewrite of the client address would
    # make the loopback checks of the admin and internal APIs see the header's value.
    options: dict[str, Any] = {
        "access_log": False,
        "log_level": "warning",
        "lifespan": "on",
        "proxy_headers": False,
    }
    try:
        import uvloop  # noqa: F401

        options["loop"] = "uvloop"
    except ImportError:
        options["loop"] = "asyncio"
    try:
        import httptools  # noqa: F401

        options["http"] = _coalescing_protocol(front_door) or "httptools"
    except ImportError:
        options["http"] = "h11"
    options.update(front_door.uvicorn_options(options["http"]))
    return options


class _CoalescedWrites:
    """A transport whose writes made in one event-loop step leave in one ``send``.

    uvicorn writes a response's status line and headers, then its body, as two
    writes: two syscalls, and (worse, on loopback) the peer woken twice and
    reading half a response first. Buffered until the end of the step, the
    whole response leaves at once. Everything else is the real transport's.
    """

    __slots__ = ("_buffer", "_handle", "_loop", "_postponed", "_reads", "_transport", "is_closing")

    #: At most this many answers wait for the ones behind them (a router's whole
    #: batch: ``--pipeline`` is at most 64). A client that keeps its pipeline
    #: full still gets answers, and the real transport's flow control still
    #: holds back a client that does not read them.
    MAX_POSTPONED = 64

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._buffer: list[bytes] = []
        self._handle: asyncio.Handle | None = None
        self._postponed = 0
        self._reads = -1
        #: Asked twice per request by uvicorn's cycle: the real transport's own method (not
        #: through ``__getattr__``, nor a method of this class calling it).
        self.is_closing = transport.is_closing

    def write(self, data: bytes) -> None:
        if not self._buffer:
            self._handle = self._loop.call_soon(self._flush)
        self._buffer.append(data)

    def postpone(self, reads: int) -> None:
        """Flush after the callbacks already scheduled rather than before them.

        A router that pipelines sends several requests in one write; uvicorn
        answers them one at a time, starting the next request's task as the
        previous response completes, which is *after* that response's flush
        was scheduled. Postponed past that task's first step, a response
        leaves together with the next one whenever the next completes without
        waiting (the usual case: a decision and a fast application); a next
        request that waits on I/O delays nothing, since the flush still runs
        in the following loop step. Called once per pipelined response, so it
        cannot spin.

        Only the requests that had arrived when the first postponement was
        made can hold a flush back (``reads``: how many reads the connection
        has had; a router's batch arrives in one): a client that never stops
        pipelining makes the server read again between two answers, and then
        what is buffered leaves. Before that bound, measured, such a client's
        first answer waited ~3.5 s behind every read's parsing. At most
        :attr:`MAX_POSTPONED` times per flush in any case."""
        handle = self._handle
        if handle is None or not self._buffer or self._postponed >= self.MAX_POSTPONED:
            return
        if self._postponed == 0:
            self._reads = reads
        elif reads != self._reads:
            return
        self._postponed += 1
        handle.cancel()
        self._handle = self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._handle = None
        self._postponed = 0
        buffer = self._buffer
        if buffer:
            self._buffer = []
            if not self._transport.is_closing():
                self._transport.write(buffer[0] if len(buffer) == 1 else b"".join(buffer))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _coalescing_protocol(front_door: FrontDoor) -> type | None:
    """uvicorn's httptools protocol on a :class:`_CoalescedWrites` transport,
    within the limits of ``front_door``, with one keep-alive timer per
    connection (node/keepalive.py), as the router's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # pragma: no cover (uvicorn moved it: plain httptools then)
        return None
    return limited_protocol(lazy_keep_alive(HttpToolsProtocol), front_door, wrap=_CoalescedWrites)


#: Seconds a forced exit gives the application to close (:meth:`SignalServer.shutdown`).
FORCED_CLOSE = 2.0


class SignalServer(uvicorn.Server):
    """uvicorn's server with our own signal handling: ``on_signal(server)`` on
    SIGINT and SIGTERM, a stop without more on SIGHUP.

    uvicorn's own handling raises the signal again once ``serve()`` returns:
    SIGTERM's default action then ends the process before the code after
    ``serve()`` runs (a node's leave, a router's ``close()``: its leader key
    resigned, its gRPC calls given their grace)."""

    def __init__(
        self,
        config: uvicorn.Config,
        on_signal: Any,
        *,
        say_hangup: bool = True,
        role: str = "node",
    ) -> None:
        super().__init__(config)
        self._on_signal = on_signal
        #: Log a line on SIGHUP: not under `ringlimit up`, which stops its nodes so.
        self._say_hangup = say_hangup
        #: "node" or "router": whose log says it, and what it means.
        self._role = role

    @contextlib.contextmanager
    def capture_signals(self):  # type: ignore[no-untyped-def,override]
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, self)
        loop.add_signal_handler(signal.SIGHUP, self._exit_now)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown; under a forced exit (a second SIGINT or SIGTERM)
        the application still closes what it opened, within
        :data:`FORCED_CLOSE` seconds. uvicorn skips the lifespan's shutdown
        then, and the loop's end cancelled it: a node logged a CancelledError
        traceback on every double Ctrl-C (an exploratory tester), its tasks
        and clients never closed."""
        await super().shutdown(sockets)
        if self.force_exit:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.lifespan.shutdown(), FORCED_CLOSE)

    def _exit_now(self) -> None:
        # Said: an operator who sends SIGHUP for a reload (nginx's habit) saw the
        # process gone without a word.
        if self._say_hangup:
            logging.getLogger(f"ringlimit.{self._role}").warning(
                "SIGHUP: stopping (ringlimit reloads nothing on SIGHUP: new rules go through "
                "`ringlimit rules FILE`%s)",
                "; a node stops without leaving the ring" if self._role == "node" else "",
            )
        self.should_exit = True


def _turn(left: float, routers: int) -> float:
    """How long one router may hold a join or a leave of ``left`` seconds: all of
    it when it is the only one; else half, so that one that takes the request
    and never answers (a paused process) leaves another router its turn."""
    return left / 2 if routers > 1 else left


#: A ``--join`` node gives up after this many seconds (``--join-timeout``), at
#: most MAX_JOIN_TIMEOUT; and waits at most JOIN_ANSWER_TIMEOUT for one answer
#: (a join waits on the router's readiness check of the node and its pushes).
JOIN_DEADLINE = 120.0
MAX_JOIN_TIMEOUT = 86400.0
JOIN_ANSWER_TIMEOUT = 30.0
#: ... and after this many answers saying the router cannot reach it at its --url.
JOIN_NOT_READY_ATTEMPTS = 3
#: A graceful leave (SIGTERM) retries a busy or failing-over router this often,
#: within this many seconds (below a typical 30 s termination grace period).
LEAVE_ATTEMPTS = 6
LEAVE_DEADLINE = 20.0
#: Seconds to connect to a router before the join or the leave tries the next one.
CONNECT_TIMEOUT = 2.0
#: A ``--join`` node in its own view whose lease no router has renewed for this
#: many seconds of its running registers again (the ring lost it); looked at
#: every STRANDED_CHECK seconds. Each such registration is tried for at most
#: REJOIN_TIMEOUT seconds; the waits after failed ones double up to the max.
STRANDED_AFTER = 10.0
STRANDED_CHECK = 2.0
REJOIN_TIMEOUT = 30.0
REJOIN_BACKOFF_MAX = 300.0
#: A leave waits this long, at most, for a registration in flight to end.
REJOIN_WAIT = 5.0


def tcp_listeners(host: str, port: int) -> list[socket.socket]:
    """The sockets ``loop.create_server(host=host, port=port)`` listens on, as it
    binds them (every address ``host`` resolves to, IPv6 ones IPv6-only, address
    reuse on), for a server given its sockets (``serve(sockets=...)`` binds
    none: uvicorn's ``Config.bind_socket`` binds one address, and dual-stack:
    ``localhost`` left ``::1`` to any other process, ``::`` took IPv4 too).
    ``ValueError`` in one line when one cannot be bound."""
    try:
        found = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    listeners: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(found):
            try:
                listener = socket.socket(family, kind, proto)
            except OSError:
                continue  # a family this kernel lacks (IPv6 disabled), skipped as asyncio does
            listeners.append(listener)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            listener.bind(address)
    except OSError as exc:
        for listener in listeners:
            listener.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    if not listeners:
        raise ValueError(f"cannot listen on {host}:{port}: no address family of it is available")
    return listeners


def _warning_of(response: httpx.Response) -> str | None:
    """The ``warning`` of an admin answer (a leave carried out as a crash), if any."""
    try:
        warning = response.json().get("warning")
    except (ValueError, AttributeError):
        return None
    return warning[:300] if isinstance(warning, str) else None


def serve_node(
    node: Node,
    *,
    host: str,
    port: int,
    join: Sequence[str] = (),
    advertise: str | None = None,
    weight: int = 1,
    admin_token: str | None = None,
    linger: float = 1.0,
    join_timeout: float = JOIN_DEADLINE,
    front_door: FrontDoor | None = None,
    say_hangup: bool = True,
) -> int:
    """Serve until told to stop; the exit status is 1 if a ``--join`` failed.

    ``join``: the routers to join (and later leave) through, tried in turn: a
    failed attempt moves to the next one, so with the routers of one cluster
    on etcd a node joins and leaves while any of them answers.
    """
    url = advertise or f"http://{host}:{port}"
    routers = [r.rstrip("/") for r in ([join] if isinstance(join, str) else join)]
    #: "router": the index in ``routers`` a registration tries first (the one
    #: that answered last, or the one after the last that did not).
    state: dict[str, Any] = {"leaving": False, "router": 0}

    def on_signal(server: SignalServer) -> None:
        if state["leaving"]:
            server.force_exit = True
            return
        state["leaving"] = True
        node.leaving_by_itself = True
        if not routers:
            server.should_exit = True
            return
        if node.epoch == 0 and not state.get("joined"):
            # No router took its join nor gave it a view: it is in no ring, and a leave retried
            # for 20 s against routers it never reached ("graceful leave: ...
            # ConnectError; retrying": an exploratory tester).
            log.warning("not in any ring (no router took this node's join): no leave to make")
            server.should_exit = True
            return
        asyncio.get_running_loop().create_task(_leave_then_exit(server))

    async def _leave_then_exit(server: SignalServer) -> None:
        """Leave through the router, retrying what a router failover or a concurrent
        change answers (bounded: LEAVE_ATTEMPTS within LEAVE_DEADLINE seconds), so a
        graceful leave does not become a crash because a leader was being elected."""
        # A registration in flight (rejoin_when_stranded) ends first, within a
        # bound: landing after the leave, it joined a node on its way out, whose
        # keys then went to the crash policy rather than a handoff.
        watchdog = state.get("watchdog")
        if watchdog is not None and not watchdog.done():
            if state.get("registering"):  # idle, it is cancelled at once
                await asyncio.wait({watchdog}, timeout=REJOIN_WAIT)
            watchdog.cancel()
        # Forced: a node going away by itself goes even if it is the ring's last
        # (ViewLog.leave); refused, its leave would only become a crash.
        path = f"/admin/nodes/{node.settings.node_id}?force=true"
        # Which process leaves: the router keeps a member whose URL answers as
        # another one (a second process started with this node's --id and --url).
        headers = {**_auth(admin_token), INSTANCE_HEADER: node.instance}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + LEAVE_DEADLINE
        status: int | None = None
        problem = "no attempt made"
        async with httpx.AsyncClient() as client:
            for attempt in range(LEAVE_ATTEMPTS):
                # From the router that took the join (or the last registration).
                router = routers[(state["router"] + attempt) % len(routers)]
                # Within what is left of the deadline, and quick to give up on a
                # router that does not accept the connection (a host that is down
                # drops it): the next router gets its turn.
                left = max(0.5, deadline - loop.time())
                # With several routers, one that takes the request and never
                # answers gets half the time left, not all of it: another router
                # still gets its turn (a large handoff answers well within 10 s).
                share = _turn(left, len(routers))
                timeout = httpx.Timeout(share, connect=min(share, CONNECT_TIMEOUT))
                try:
                    response = await client.delete(router + path, headers=headers, timeout=timeout)
                    status = response.status_code
                    problem = f"router {router} answered {status}: {said(response)}"
                    if not _retry_admin_answer(response):
                        break
                except httpx.HTTPError as exc:
                    status, problem = None, f"router {router}: {type(exc).__name__}"
                if loop.time() + 0.5 * (attempt + 1) > deadline:
                    break
                log.warning("graceful leave: %s; retrying", problem)
                await asyncio.sleep(0.5 * (attempt + 1))
        if status == 200:
            warning = _warning_of(response)
            if warning is None:
                log.warning("left the ring: router %s answered 200", router)
            else:
                log.warning("out of the ring: router %s answered 200: %s", router, warning)
            if linger > 0:
                # Fenced by the new view: stale routers are told, not left guessing.
                await asyncio.sleep(linger)
        elif status == 404 or (status == 409 and _error_code(response) == "still_joining"):
            # (still joining: its join is dropped once this node stops answering)
            log.warning("not in the ring (%s): exiting", problem)
        elif status is not None and not _retry_admin_answer_code(status):
            # Not a leave: e.g. 409 last_node from a router of an earlier version,
            # or one passing the call to its leader without ?force=true. It said
            # "left the ring" though the ring kept this node.
            log.warning(
                "graceful leave refused (%s): exiting anyway; the ring keeps this node "
                "until the router removes it",
                problem,
            )
        else:
            log.warning("graceful leave failed (%s); exiting anyway", problem)
        server.should_exit = True

    async def register(server: SignalServer) -> None:
        """Join through the router: bounded in attempts and time, and every way it
        can fail ends in one log line that says what to check."""
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no event)
            await asyncio.sleep(0.02)
        problem = await registered()
        if problem is None:
            # Held here: the loop keeps only a weak reference to a task.
            state["watchdog"] = asyncio.get_running_loop().create_task(rejoin_when_stranded(server))
            return
        log.error("could not join the ring; giving up: %s", problem)
        state["join_failed"] = True
        server.should_exit = True

    async def rejoin_when_stranded(server: SignalServer) -> None:
        """Register again when the ring has lost this node without telling it.

        A router finds a member it removed as crashed again by probing it, but
        it keeps those members in memory only (and forgets them after
        ``--forget-removed-after``). A node paused (or cut off) until it was
        removed, whose router restarted before it woke, was left out for good:
        healthy to its own ``/healthz``, deciding nothing (a chaos run).

        So: when this node's own newest view still lists it (it never learned
        of a removal) or removed it as crashed (ShardCore.may_rejoin; an
        operator's removal or a leave it took does not come back), and no
        router has renewed its lease for :data:`STRANDED_AFTER` seconds of this
        process's running (a pause does not count: a router probing a member it
        still holds renews it within a health interval of its waking), it
        registers again, as at its start; a member the router still holds is
        answered at once. One attempt at a time, each within
        :data:`REJOIN_TIMEOUT`, the waits between failed ones doubling up to
        :data:`REJOIN_BACKOFF_MAX`; never once its leave has begun.
        """
        shard = node.shard
        if shard is None:
            return
        lapsed_since: float | None = None
        wait = STRANDED_AFTER
        while not (server.should_exit or state["leaving"]):
            await asyncio.sleep(STRANDED_CHECK)
            now = shard.monotonic()
            if (
                state["leaving"]
                or not shard.lease.required
                or shard.lease.valid(now)
                or not shard.core.may_rejoin()
            ):
                lapsed_since = None
                continue
            if lapsed_since is None:
                lapsed_since = now
            if now - lapsed_since < wait:
                continue
            log.warning(
                "no router has renewed this node's lease for %.0f s: registering again "
                "(the ring may have lost it)",
                now - lapsed_since,
            )
            state["registering"] = True
            try:
                problem = await registered(REJOIN_TIMEOUT)
            finally:
                state["registering"] = False
            lapsed_since = None
            if problem is None:
                wait = STRANDED_AFTER
            else:
                wait = min(2 * wait, REJOIN_BACKOFF_MAX)
                log.warning("registering again failed: %s; next try in %.0f s", problem, wait)

    async def registered(within: float = join_timeout) -> str | None:
        """One registration through the routers, retried within ``within`` s: None
        once a router lists this node, else what went wrong (also once this
        node's leave has begun: a join must not land after it)."""
        payload = {"id": node.settings.node_id, "url": url, "weight": weight}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        not_ready = 0
        problem = "no attempt made"
        attempt = 0
        async with httpx.AsyncClient() as client:
            while True:
                if state["leaving"]:
                    return "this node is leaving"
                index = state["router"] % len(routers)
                router = routers[index]
                attempt += 1
                # Within the time left: a router that takes the request and never
                # answers held every attempt a fixed 30 s, past --join-timeout. With
                # several routers, such a router gets half the time left, as in the
                # leave, so another gets its turn: a paused first router took a
                # --join-timeout of 20 s whole, and the node gave up without trying
                # the healthy others (an exploratory tester).
                left = max(0.1, deadline - loop.time())
                wait = min(JOIN_ANSWER_TIMEOUT, _turn(left, len(routers)))
                timeout = httpx.Timeout(wait, connect=min(CONNECT_TIMEOUT, wait))
                # The next registration (a re-registration of a stranded node)
                # starts here if this one answers, at the next router if not.
                state["router"] = (index + 1) % len(routers)
                try:
                    response = await client.post(
                        f"{router}/admin/nodes",
                        json=payload,
                        # Which process registers: one whose --url reaches another
                        # process of this node (running, a member) is refused.
                        headers={**_auth(admin_token), INSTANCE_HEADER: node.instance},
                        timeout=timeout,
                    )
                    if response.status_code == 200 and _lists(response, node.settings.node_id):
                        log.warning("joined the ring through %s", router)
                        state["joined"] = True
                        state["router"] = index
                        return None
                    if response.status_code == 200:
                        # Any 200 was taken as joined: a --join at something else
                        # left the node fenced, refusing every key, for good.
                        problem = (
                            f"{router} answered 200, not as a ringlimit router (its answer "
                            "does not list this node); check --join"
                        )
                        break
                    problem = f"router {router} answered {response.status_code}: {said(response)}"
                    if response.status_code == 401:
                        problem += (
                            " (this node joins through the router's admin API: give it "
                            "the router's RINGLIMIT_ADMIN_TOKEN)"
                        )
                    if response.status_code == 504:
                        # The router could not reach this node at its --url.
                        not_ready += 1
                        problem = (
                            f"the router at {router} could not reach this node at {url} "
                            "(check --url / --host: it must be the address the router can use)"
                        )
                    elif not _retry_admin_answer(response):
                        break  # refused for good: a wrong token, id, url, or a conflict
                except httpx.HTTPError as exc:
                    problem = (
                        f"router {router} not reachable ({type(exc).__name__}); check --join "
                        "and that the router is running"
                    )
                if not_ready >= JOIN_NOT_READY_ATTEMPTS or loop.time() > deadline:
                    break
                # Retries are expected (a node may start before its router): quiet
                # unless -v; the outcome is one line either way. Until the deadline
                # (a cap of 30 attempts ended a long --join-timeout after ~50 s).
                log.info("join attempt %d failed: %s; retrying", attempt, problem)
                await asyncio.sleep(max(0.0, min(0.1 * attempt, 2.0, deadline - loop.time())))
        return problem

    raise_fd_limit()
    config = uvicorn.Config(node, host=host, port=port, **uvicorn_options(front_door))
    server = SignalServer(config, on_signal, say_hangup=say_hangup)
    # Bound before the TCP port: a path it cannot take is one line, and no start.
    unix = bind_unix(node.settings.unix_socket) if node.settings.unix_socket else None
    listeners: list[socket.socket] = []
    if unix is not None:
        try:
            listeners = [*tcp_listeners(host, port), unix.socket]
        except ValueError:
            unix.socket.close()
            unix.remove()
            raise

    async def main() -> None:
        task = asyncio.create_task(register(server)) if routers else None
        if unix is None:
            await server.serve()
        else:
            # Both listeners on one server: one front door (its connection caps),
            # one shutdown, and the leave keeps serving either until it is done.
            await server.serve(sockets=listeners)
        if task is not None:
            task.cancel()

    try:
        _run(main())
    finally:
        if unix is not None:
            unix.remove()
    return 1 if state.get("join_failed") else 0


def _lists(response: httpx.Response, node_id: str) -> bool:
    """Whether a join's answer is a router's ring listing the node (``describe()``:
    ``{"epoch": ..., "nodes": [{"id": ...}, ...]}``)."""
    try:
        nodes = response.json().get("nodes")
        return any(isinstance(n, dict) and n.get("id") == node_id for n in nodes)
    except (ValueError, RecursionError, AttributeError, TypeError):
        return False


def _retry_admin_answer_code(status: int) -> bool:
    return status == 429 or status >= 500


def _retry_admin_answer(response: httpx.Response) -> bool:
    """Worth asking again: the router is busy or failing over (429, 5xx), or another
    change went first (409 ``ring_changed``). Other 4xx answers are final."""
    if _retry_admin_answer_code(response.status_code):
        return True
    return response.status_code == 409 and _error_code(response) == "ring_changed"


def _error_code(response: httpx.Response) -> str | None:
    """The ``error`` of a router's JSON answer (None if it has none)."""
    try:
        error = response.json().get("error")
    except (ValueError, AttributeError):
        return None
    return error if isinstance(error, str) else None


def _auth(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def _run(coro: Any) -> None:
    tune_gc()  # a node or router process, built and about to serve
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)
