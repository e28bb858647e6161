"""The Redis baseline: every node decides on one shared Redis, by Lua script.

:class:`RedisBackend` runs the engine's algorithms as the Lua scripts of
:mod:`node.lua` (same arithmetic, same decisions; see that module for the
script layout, KEYS/ARGV and the state layout). One check is one ``EVALSHA``:
all rules of a request are decided and consumed atomically inside Redis;
:meth:`RedisBackend.check_many` pipelines its calls in one round trip.

Pipelining. With ``pipeline=True`` (what ``ringlimit node --backend redis``
runs by default; ``--redis-pipeline off`` for one round trip per check),
concurrent checks share round trips: each check is queued, and whatever is
queued while the previous round trip is in flight goes out as one pipeline of
``EVALSHA`` calls (:class:`node.roundtrips.RoundTrips`; no timer, so a lone
check is not delayed). Every check is still its own atomic script with its own
outcome: an error reply (say ``WRONGTYPE``) fails that check only, ``NOSCRIPT``
replies are reloaded and re-run alone, and a round trip that finds Redis
unavailable fails its checks, and every check queued behind it, with
:class:`BackendUnavailable`, as one call does without pipelining.

Keys. ``<prefix>:{<user key>}:<rule name>:<algorithm code>``, e.g.
``rl:{alice}:api:tb``. The user key is the Redis-Cluster hash tag, so every
key one script touches lives in one slot. ``%``, ``{`` and ``}`` in user keys
are percent-encoded (and the empty key is written ``%``, which no encoded key
can be), so the tag is exactly the encoded user key: no user can reach
another user's slot or keys. The algorithm code in the name keeps states of
different shapes apart when a rule changes algorithm (the memory store drops
such states too).

Time. By default the script reads Redis ``TIME``, so all nodes share one
clock. A ``clock`` passed to the constructor is injected instead (tests).
TTLs are relative (``PX``): the time until the state is fresh again, on the
caller's clock, plus ``ttl_slack``.

Failure. Timeouts are tight (``timeout``, default 100 ms, for connecting and
for each reply), nothing is retried except one ``SCRIPT LOAD`` after
``NOSCRIPT`` (a restarted or flushed Redis), and an unreachable, timing-out,
loading, read-only or out-of-memory Redis, or one that refuses writes (a failed
snapshot: ``MISCONF``; too few replicas: ``NOREPLICAS``), or one that refuses
the node's user (an ACL's ``NOPERM``, a wrong password) or its database, or a
server that does not speak the Redis protocol at all (``InvalidResponse``), raises
:class:`BackendUnavailable`. Any other error reply (``WRONGTYPE`` on a key
something else wrote) is that check's alone: :meth:`RedisBackend.check` raises
it, :meth:`RedisBackend.check_each` returns it in that check's place.
At most ``max_connections`` calls are in Redis at once; the rest queue (for at
most ``queue_timeout``), and queued calls fail at once when one in flight
finds Redis unavailable, so a dead Redis is never tried by a pile of waiters.

:class:`FallbackBackend` wraps a primary (this backend) and the local
:class:`~node.backend.MemoryBackend`: when the primary is unavailable, each
rule's ``on_error`` decides (``open``: the local in-memory limiter,
``closed``: deny), and a background probe switches back once Redis answers.
A check that got an error reply of its own is decided the same way, alone
(``reason="backend_error"``), and Redis keeps deciding every other check.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Container, Sequence
from typing import Any, Protocol, TypeVar
from urllib.parse import parse_qsl, urlsplit

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ClusterDownError,
    InvalidResponse,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

try:
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # redis-py before 7: no maintenance notifications
    MaintNotificationsConfig = None  # type: ignore[assignment,misc]

from node.algorithms import REGISTRY
from node.backend import Check, MemoryBackend
from node.clock import Clock
from node.config import REDIS_TIMEOUT
from node.decision import (
    BACKEND_ERROR,
    BACKEND_UNAVAILABLE,
    COST_EXCEEDS_CAPACITY,
    Decision,
    Verdict,
    most_restrictive,
)
from node.failures import Failures
from node.lua import SCRIPTS, Script, pack_args, script_for, unpack_reply
from node.roundtrips import RoundTrips
from node.rules import MAX_LIMIT, MAX_PERIOD, Rule
from node.security import redact_url

logger = logging.getLogger("ringlimit.redis")

T = TypeVar("T")

#: One EVALSHA of a pipeline: (script, KEYS, ARGV).
Call = tuple[Script, list[str], list[str]]

#: Short algorithm codes used in key names.
ALGORITHM_CODES = {
    "token_bucket": "tb",
    "gcra": "gcra",
    "fixed_window": "fw",
    "sliding_log": "log",
    "sliding_window": "sw",
}

_ESCAPES = str.maketrans({"%": "%25", "{": "%7B", "}": "%7D"})

#: Errors that mean "Redis cannot decide now" rather than "this call is wrong".
_UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,  # refused, reset, closed, pool exhausted, LOADING
    RedisTimeoutError,
    ReadOnlyError,  # a replica after failover
    OutOfMemoryError,  # maxmemory with noeviction
    ClusterDownError,  # CLUSTERDOWN, MASTERDOWN
    TryAgainError,
    OSError,
    asyncio.TimeoutError,
    NoPermissionError,  # an ACL refusing the node's user, for every check alike
    AuthenticationWrongNumberOfArgsError,
    # What answers is not Redis (an HTTP server, a TLS port without TLS): every
    # connection's first reply is garbled, so no check can pass. Before, each
    # check raised it (a 500 with a traceback per request, on_error ignored, the
    # node said Redis was fine) and a node starting with such a URL exited.
    InvalidResponse,
)
#: Refusals of the node's user (AuthenticationError: a wrong password, NOAUTH). To
#: the checks an outage (none can pass), but one a configuration change ends, not
#: time: the log names the user and what to fix.
_REFUSALS: tuple[type[BaseException], ...] = (
    NoPermissionError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
)
#: What the probe peeks at (cost 0, nothing written): a key no user's can be
#: (``%`` only ever starts ``%25``, ``%7B``, ``%7D`` or the empty key's ``%``).
_PROBE_KEY = "%probe"
_PROBE_RULE = Rule("probe", 1, 1.0)
_PING_ERRORS: tuple[type[BaseException], ...] = (RedisError, *_UNAVAILABLE_ERRORS)
#: Replies of a Redis that cannot take a write now: a script running too long, a
#: dataset loading, a replica (READONLY), a failed RDB snapshot with
#: stop-writes-on-bgsave-error (MISCONF), fewer replicas than min-replicas-to-write.
_UNAVAILABLE_PREFIXES = (
    "BUSY",
    "LOADING",
    "MASTERDOWN",
    "CLUSTERDOWN",
    "TRYAGAIN",
    "READONLY",
    "MISCONF",
    "NOREPLICAS",
)

#: Replies to the SELECT of the URL's database, which opens every connection: a
#: number beyond the server's ``databases``, any but 0 on a Redis Cluster. Like a
#: refused user, an outage to the checks (no connection opens) that a
#: configuration change ends; before, it ended the node's start with a traceback.
_DATABASE_REFUSALS = ("DB index is out of range", "SELECT is not allowed in cluster mode")
#: The reply of a Redis that lacks a command ringlimit runs (renamed or disabled by
#: its config, or a proxy without scripting). No check can pass, whatever its key:
#: an outage, not one key's error (before: every check was "that key's"
#: backend_error, the node said Redis was fine, and round-robin went on).
_MISSING_COMMAND = "unknown command"


def _script_reply(reply: Any, keys: Sequence[str]) -> Any:
    """``reply`` if it is shaped as a script's reply for ``keys`` (two values, then
    six per rule), else :class:`InvalidResponse`: a server that speaks RESP but is
    not Redis (one that answers ``:1`` to everything) is an outage, not a check's
    error; its replies were a ``TypeError`` and a 500 per request (the review of
    the day's changes)."""
    if type(reply) is not list or len(reply) != 2 + 6 * len(keys):
        kind = f"a list of {len(reply)}" if type(reply) is list else type(reply).__name__
        raise InvalidResponse(f"EVALSHA answered {kind}, not a ringlimit script's reply")
    return reply


#: The default prefix of every key ringlimit writes (``rl:{alice}:api:tb``, and
#: the probe's ``rl:probe``).
KEY_PREFIX = "rl"

#: The protocol a node speaks to Redis unless its URL says ``?protocol=3``: RESP2,
#: as redis-py spoke before 8. redis-py 8 says ``HELLO 3`` on every connect and
#: has no fallback, so a Redis without HELLO (before 6, one that renamed it, some
#: proxies) was an outage for good, its log naming a command ringlimit never
#: sends (an exploratory tester). The scripts' replies are the same in both (a
#: script speaks RESP2 unless it says otherwise).
PROTOCOL = 2


class CorruptState(ResponseError):
    """A check whose stored state holds values no script writes (NaN, infinity, a
    time centuries away: a key written by hand, by another application, a bad
    migration): that check's error, as a ``WRONGTYPE`` is, decided by its rules'
    ``on_error``. Its answer was a 500 with a traceback (``int(nan)`` in the
    headers), and in a decision-API batch its node's other checks failed too,
    though counted (an exploratory tester); a finite time far away locked its
    user out with a 100-digit ``Retry-After``."""


#: The longest wait a script computes from a state some rule wrote: twice the
#: longest horizon a rule may have (a bucket of MAX_LIMIT units refilled one per
#: MAX_PERIOD, ~3e16 s). Not the current rule's: a GCRA state made under an
#: earlier rule (10/day, then 100/minute) keeps its time until it passes, as in
#: memory, and was taken for a corrupt one (the review of the day's changes);
#: nor one a clock stepped back lengthened. Past it, no rule wrote the state.
#: The price: a corrupt state within it (a time centuries away) is decided as
#: it stands, its user told to retry that far off, until it is deleted.
MAX_WAIT = 2.0 * MAX_LIMIT * MAX_PERIOD


def _out_of_range(verdict: Verdict, rules: Sequence[Rule]) -> str | None:
    """What in ``verdict`` no script computes from a state a rule wrote, or None:
    a wait that is not a number (NaN, infinity), below 0 or past :data:`MAX_WAIT`,
    or more remaining than the rule holds."""
    for decision, rule in zip(verdict.decisions, rules, strict=True):
        waits = (decision.reset_after, decision.retry_after, decision.available_after)
        for wait in waits:
            if wait is not None and not -1.0 <= wait <= MAX_WAIT:  # (NaN fails both)
                return f"rule {rule.name!r}: a wait of {wait!r} s from its stored state"
        if not 0 <= decision.remaining <= max(rule.capacity, rule.limit):
            return f"rule {rule.name!r}: {decision.remaining!r} remaining from its stored state"
    return None


class BackendUnavailable(Exception):
    """The backend cannot decide now (unreachable, timed out, loading, read-only)."""


def hash_tag(user_key: str) -> str:
    """The Redis-Cluster hash tag of a user key: the key, percent-encoded.

    The result never contains ``}`` (so Redis's tag, which ends at the first
    ``}``, is the whole of it), is never empty (an empty tag would make Redis
    hash the whole key name), and different keys give different tags.
    """
    if not user_key:
        return "%"
    if "%" in user_key or "{" in user_key or "}" in user_key:
        return user_key.translate(_ESCAPES)
    return user_key


def state_key(prefix: str, user_key: str, rule: Rule) -> str:
    """The Redis key of ``rule``'s state for ``user_key``: ``rl:{alice}:api:tb``."""
    return f"{prefix}:{{{hash_tag(user_key)}}}:{rule.name}:{ALGORITHM_CODES[rule.algorithm]}"


def _is_unavailable(exc: BaseException) -> bool:
    if isinstance(exc, _UNAVAILABLE_ERRORS):
        return True
    return isinstance(exc, ResponseError) and (
        str(exc).startswith((*_UNAVAILABLE_PREFIXES, _MISSING_COMMAND)) or _refuses_database(exc)
    )


def _refuses_database(exc: BaseException) -> bool:
    return isinstance(exc, ResponseError) and str(exc).startswith(_DATABASE_REFUSALS)


#: The largest database number Redis's SELECT takes (a 32-bit integer).
MAX_DATABASE = 2**31 - 1
#: A connection name Redis's CLIENT SETNAME takes: printable ASCII, no spaces.
_CLIENT_NAME = re.compile(r"[!-~]*")

#: Query parameters of a Redis URL that redis-py lets win over what the node sets
#: itself, each with what sets it instead.
NODE_SETS = {
    "socket_timeout": "--redis-timeout",
    "socket_connect_timeout": "--redis-timeout",
    "timeout": "--redis-timeout",
    "max_connections": "the node (its call slots and pipeline depth)",
    "retry_on_timeout": "the node (a timed-out check is never sent again)",
}


def check_url_options(url: str) -> None:
    """ValueError for a query parameter of ``url`` that would quietly override what
    the node sets (redis-py's query arguments win over the client's own): a
    ``?socket_timeout=30`` kept a node waiting on a paused Redis for 30 s while
    its ``--redis-timeout`` said 0.25, and ``?max_connections=`` broke the pool
    the node sizes to its call slots. Other parameters (``db``, ``protocol``,
    ``health_check_interval``...) are Redis's to take."""
    try:
        query = urlsplit(url).query
    except ValueError as exc:  # "Invalid IPv6 URL" alone named neither flag nor URL
        raise ValueError(f"--redis-url {redact_url(url)}: {exc}") from None
    given = sorted(
        {name for name, _ in parse_qsl(query, keep_blank_values=True) if name in NODE_SETS}
    )
    if given:
        said = "; ".join(f"{name} is set by {NODE_SETS[name]}" for name in given)
        raise ValueError(
            f"--redis-url {redact_url(url)}: remove ?{'&'.join(given)} from the URL "
            f"({said}; in the URL it would override that quietly)"
        )
    parts = urlsplit(url)
    database = parts.path.replace("/", "")
    if (
        parts.scheme in ("redis", "rediss")
        and database
        and not (database.isascii() and database.isdigit())
    ):
        # redis-py ignores a path that is not a number and uses database 0.
        raise ValueError(
            f"--redis-url {redact_url(url)}: the database (the URL's path) must be "
            f"a number, got {parts.path!r}"
        )
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name == "client_name" and not _CLIENT_NAME.fullmatch(value):
            raise ValueError(
                f"--redis-url {redact_url(url)}: ?client_name= must be printable ASCII "
                f"without spaces (Redis refuses others at every connect), got {value!r}"
            )
    try:
        # Builds a connection without connecting: redis-py hands every query
        # parameter it does not parse itself to the connection class, so one it
        # does not know (``?foo=1``, ``ssl_*`` on ``redis://``) failed only at the
        # first connect, as a traceback that stopped the node's start.
        pool = BlockingConnectionPool.from_url(url)
        pool.make_connection()
    except ValueError as exc:  # not a Redis URL at all (a scheme, a port)
        raise ValueError(
            f"--redis-url {redact_url(url)} is not a valid Redis URL ({exc}); expected "
            "redis://[USER:PASSWORD@]HOST[:PORT][/DB], rediss://... or unix://PATH"
        ) from None
    except Exception as exc:  # whatever redis-py makes of an option
        found = re.search(r"unexpected keyword argument '([^']*)'", str(exc))
        if found is not None:
            said = (
                f"redis-py takes no ?{found.group(1)} in a {parts.scheme}:// URL (query "
                "parameters are redis-py's connection options)"
            )
        else:  # an option out of range (?protocol=9), or of a kind it cannot use
            said = f"redis-py cannot use its options ({type(exc).__name__}: {exc})"[:300]
        raise ValueError(f"--redis-url {redact_url(url)}: {said}") from None
    database_number = pool.connection_kwargs.get("db", 0)  # (the path's, or ?db=)
    if not 0 <= database_number <= MAX_DATABASE:
        # Redis answers such a SELECT "value is out of range", which is no
        # outage: it ended the node's start with a traceback (a tester).
        raise ValueError(
            f"--redis-url {redact_url(url)}: the database must be from 0 to the server's "
            f"`databases` less one (16 by default), got {database_number}"
        )


class RedisBackend:
    """Decisions in a shared Redis, by Lua script (see the module docstring).

    ``timeout`` bounds connecting and each reply (``connect_timeout``
    overrides the first). At most ``max_connections`` calls are in Redis at
    once; more wait in a queue, for at most ``queue_timeout`` (by default 1 s,
    or twice ``timeout`` if that is longer): that wait is
    this process's own load, not Redis's, so it is not held to ``timeout``
    (a burst of a thousand checks would otherwise look like an outage). A call
    that was queued while another found Redis unavailable fails at once
    instead of trying too. ``ttl_slack`` (seconds) is added to every key's
    TTL: with an injected ``clock`` that runs apart from Redis's own, it keeps
    Redis from expiring a state the injected clock still needs.

    ``pipeline=True`` coalesces concurrent checks into pipelined round trips
    (see the module docstring): at most ``pipeline_depth`` round trips in
    flight (each on its own connection), at most ``max_batch`` checks in each;
    a check queued longer than ``queue_timeout`` fails as overloaded, as a
    check waiting for a call slot does without pipelining.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        prefix: str = KEY_PREFIX,
        clock: Clock | None = None,
        timeout: float = REDIS_TIMEOUT,
        connect_timeout: float | None = None,
        max_connections: int = 64,
        queue_timeout: float | None = None,
        ttl_slack: float = 0.0,
        pipeline: bool = False,
        pipeline_depth: int = 1,
        max_batch: int = 256,
    ) -> None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise ValueError(f"prefix {prefix!r} must be non-empty and free of braces")
        if queue_timeout is None:
            # A queued check waits for the call (or round trip) ahead of it, which
            # may take up to ``timeout``: a slow but healthy Redis must not look
            # overloaded before it looks slow.
            queue_timeout = max(1.0, 2 * timeout)
        if min(timeout, queue_timeout, connect_timeout or timeout) <= 0:
            raise ValueError("timeouts must be positive")
        if max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        if ttl_slack < 0:
            raise ValueError("ttl_slack must be >= 0")
        if not 1 <= pipeline_depth <= max_connections:
            raise ValueError("pipeline_depth must be between 1 and max_connections")
        check_url_options(url)
        self.url = url
        #: The URL as logs and errors show it: never with its password.
        self.where = redact_url(url)
        self.prefix = prefix
        self.clock = clock
        self.timeout = timeout
        self.queue_timeout = queue_timeout
        self._slack_ms = round(ttl_slack * 1000)
        self.max_connections = max_connections
        self._slots = asyncio.Semaphore(max_connections)
        #: Bumped by every call that finds Redis unavailable.
        self._failures = 0
        #: The last availability failure, described (what a queued call says).
        self._last_failure = f"redis at {self.where}: unavailable"
        options: dict[str, Any] = {"protocol": PROTOCOL}
        if MaintNotificationsConfig is not None:
            # Off: with them on ("auto", redis-py 8's default with RESP3) the pool
            # skips its check of an idle connection before handing it out, so one
            # the server closed (its `timeout`, a proxy, a NAT) failed the next
            # check, and the node fell back to local limits as if Redis were down.
            options["maint_notifications_config"] = MaintNotificationsConfig(enabled=False)
        pool = BlockingConnectionPool.from_url(
            url,
            # Room beyond the call slots for start() and the probe's PING.
            max_connections=max_connections + 2,
            timeout=timeout,
            socket_timeout=timeout,
            socket_connect_timeout=connect_timeout or timeout,
            retry=Retry(NoBackoff(), 0),
            **options,
        )
        self.redis: Redis = Redis.from_pool(pool)
        #: The ACL user the node logs in as (what a refusal names).
        self.user = pool.connection_kwargs.get("username") or "default"  # (?username= too)
        self._available = True
        #: The round trips checks share (None: one round trip per check).
        self.round_trips: RoundTrips[Call] | None = None
        if pipeline:
            self.round_trips = RoundTrips(
                self._send_round,
                depth=pipeline_depth,
                max_batch=max_batch,
                queue_timeout=queue_timeout,
                overloaded=self._overloaded,
            )

    @property
    def pipelined(self) -> bool:
        return self.round_trips is not None

    # ------------------------------------------------------------------ protocol

    @property
    def available(self) -> bool:
        """False after a call found Redis unavailable, until one succeeds again."""
        return self._available

    def key(self, user_key: str, rule: Rule) -> str:
        return state_key(self.prefix, user_key, rule)

    async def check(self, key: str, rules: Sequence[Rule], cost: int) -> Verdict:
        script = script_for(rules)
        keys = [state_key(self.prefix, key, rule) for rule in rules]
        now = None if self.clock is None else self.clock()
        args = pack_args(now, cost, rules, self._slack_ms)
        if self.round_trips is not None:
            return self._verdict(await self.round_trips.call((script, keys, args)), rules)
        execute = self.redis.execute_command

        async def call() -> Any:
            try:
                reply = await execute("EVALSHA", script.sha, len(keys), *keys, *args)
            except NoScriptError:
                await execute("SCRIPT", "LOAD", script.source)
                reply = await execute("EVALSHA", script.sha, len(keys), *keys, *args)
            return _script_reply(reply, keys)

        return self._verdict(await self._run(call), rules)

    async def check_many(self, checks: Sequence[Check]) -> list[Verdict]:
        """Every check in one pipelined round trip (each still atomic on its own);
        raises the first check's error reply, if any, after all were decided."""
        verdicts: list[Verdict] = []
        for outcome in await self.check_each(checks):
            if isinstance(outcome, ResponseError):
                raise outcome
            verdicts.append(outcome)
        return verdicts

    async def check_each(self, checks: Sequence[Check]) -> list[Verdict | ResponseError]:
        """:meth:`check_many`, with a check's error reply (``WRONGTYPE``) in its place:
        the other checks of the round trip were decided (and consumed), so a caller
        can answer each. An unavailable Redis still raises :class:`BackendUnavailable`.
        """
        if not checks:
            return []
        now = None if self.clock is None else self.clock()
        calls: list[Call] = []
        for key, rules, cost in checks:
            keys = [state_key(self.prefix, key, rule) for rule in rules]
            calls.append((script_for(rules), keys, pack_args(now, cost, rules, self._slack_ms)))
        if self.round_trips is not None:
            # Queued together, so they share a round trip (with whatever else is queued).
            submit = self.round_trips.submit
            replies: list[Any] = await asyncio.gather(
                *[submit(c) for c in calls], return_exceptions=True
            )
            for reply in replies:
                if isinstance(reply, BaseException) and not isinstance(reply, ResponseError):
                    raise reply
        else:

            async def call() -> list[Any]:
                replies = await self._pipeline_reloading(calls)
                for reply in replies:
                    if isinstance(reply, Exception) and _is_unavailable(reply):
                        raise reply
                return replies

            replies = await self._run(call)
        outcomes: list[Verdict | ResponseError] = []
        for reply, (_key, rules, _cost) in zip(replies, checks, strict=True):
            if isinstance(reply, ResponseError):
                outcomes.append(reply)
                continue
            try:
                outcomes.append(self._verdict(reply, rules))
            except CorruptState as exc:
                outcomes.append(exc)  # that check's alone
        return outcomes

    async def start(self) -> None:
        """Load every script, then open the connections checks will use.

        Best effort: a down Redis is logged and shows in ``available``, it does
        not raise. Opening the connections now keeps a first burst of checks
        from connecting dozens of sockets at once under the connect timeout.
        """
        try:
            await self._load(SCRIPTS.values())
        except Exception as exc:
            if not _is_unavailable(exc):
                raise
            self._available = False
            logger.warning("%s (at start)", self._describe(exc))
            return
        self._available = True
        await self._warm()

    @property
    def _connections_used(self) -> int:
        """How many connections checks hold at once: one per call slot, or, when
        pipelined, one per round trip in flight (``pipeline_depth``, 1 by default).

        What :meth:`_warm` opens. Pipelined nodes opened ``max_connections`` (64)
        too, and kept them idle: under a Redis ``maxclients`` of 100, two nodes
        took every connection and a third was refused at start for good.
        """
        if self.round_trips is not None:
            return self.round_trips.depth
        return self.max_connections

    async def _warm(self) -> None:
        """Open the connections checks will use, one at a time; stop at a failure."""
        pool = self.redis.connection_pool
        held: list[Any] = []
        try:
            while len(held) < self._connections_used:
                held.append(await pool.get_connection())
        except _PING_ERRORS as exc:
            logger.debug("warming connections to redis at %s: %s", self.where, exc)
        finally:
            for connection in held:
                await pool.release(connection)

    async def close(self) -> None:
        """Close every connection; never raises for a slow or gone Redis."""
        if self.round_trips is not None:
            await self.round_trips.close()
        try:
            await self.redis.aclose()
        except _PING_ERRORS as exc:
            # Every socket's close was started; only waiting for one timed out.
            logger.debug("closing connections to redis at %s: %s", self.where, exc)

    # ------------------------------------------------------------------ helpers

    async def ping(self) -> bool:
        """Whether Redis takes a write now, within the timeouts; never raises.

        A PING, then a write of a probe key that expires at once: a Redis that
        answers PING but refuses writes (a replica: READONLY; a failed snapshot:
        MISCONF; too few replicas: NOREPLICAS; full: OOM) cannot decide. On PING
        alone the node was switched back every probe and down again by its next
        check, logging both, for as long as the refusal lasted.
        """
        was_available = self._available
        if not was_available:
            # Connections pooled before the outage are dead (a restarted Redis
            # closed them) or the wrong ones to try: refused by a full Redis
            # (maxclients), the last released, so the first taken, while the open
            # ones idled and kept Redis full (before: the probe failed on it for
            # good). Every probe while down connects afresh. Idle connections only:
            # one in use may carry a check whose script Redis is running, which
            # cut here would be decided again by the fallback (a review).
            with contextlib.suppress(*_PING_ERRORS):
                await self.redis.connection_pool.disconnect(inuse_connections=False)
        try:
            await self.redis.ping()
            await self.redis.set(f"{self.prefix}:probe", b"1", px=1000)
            # And a check's own commands and keys, as a peek that writes nothing: an
            # ACL without EVALSHA, or without the prefix's keys, lets PING and SET
            # through (before: taken back every probe, down again at the next check).
            rules = (_PROBE_RULE,)
            probe = (
                script_for(rules),
                [state_key(self.prefix, _PROBE_KEY, _PROBE_RULE)],
                pack_args(None if self.clock is None else self.clock(), 0, rules),
            )
            (reply,) = await self._pipeline_reloading([probe])
            if isinstance(reply, Exception):
                raise reply
        except _PING_ERRORS:
            self._available = False
            return False
        if not was_available:
            await self._warm()
        self._available = True
        return True

    async def _run(self, call: Callable[[], Awaitable[T]]) -> T:
        """Run ``call`` in a call slot; map availability failures to BackendUnavailable."""
        slots = self._slots
        if slots.locked():
            await self._queue()
        else:
            await slots.acquire()  # free: returns without suspending
        try:
            result = await call()
        except Exception as exc:
            self._raise_unavailable(exc)
            raise
        finally:
            slots.release()
        self._available = True
        return result

    async def _queue(self) -> None:
        failures = self._failures
        try:
            async with asyncio.timeout(self.queue_timeout):
                await self._slots.acquire()
        except TimeoutError:
            self._available = False
            raise BackendUnavailable(
                f"redis at {self.where}: no call slot free within {self.queue_timeout}s "
                f"({self.max_connections} calls in flight; overloaded)"
            ) from None
        if failures != self._failures:
            self._slots.release()
            raise BackendUnavailable(
                f"{self._last_failure} (while this call was queued, a call in flight failed)"
            )

    async def _send_round(self, calls: list[Call]) -> list[Any]:
        """One coalesced round trip: a reply, or the exception that fails it, per call."""
        try:
            replies = await self._pipeline_reloading(calls)
        except Exception as exc:
            self._raise_unavailable(exc)
            raise
        self._available = True
        for i, reply in enumerate(replies):
            if isinstance(reply, Exception) and _is_unavailable(reply):
                replies[i] = self._unavailable(reply)
        return replies

    def _overloaded(self) -> BackendUnavailable:
        self._available = False
        return BackendUnavailable(
            f"redis at {self.where}: queued for more than {self.queue_timeout}s "
            f"({self.round_trips.queued if self.round_trips else 0} checks queued; overloaded)"
        )

    async def _pipeline_reloading(self, calls: Sequence[Call]) -> list[Any]:
        """One pipeline; calls that got ``NOSCRIPT`` are loaded and run once more."""
        replies = await self._pipeline(calls)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # A call that got NOSCRIPT did nothing, so running it again is safe.
            await self._load({calls[i][0] for i in missing})
            again = await self._pipeline([calls[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        for reply, (_script, keys, _args) in zip(replies, calls, strict=True):
            if not isinstance(reply, Exception):
                _script_reply(reply, keys)
        return replies

    async def _pipeline(self, calls: Sequence[Call]) -> list[Any]:
        async with self.redis.pipeline(transaction=False) as pipe:
            for script, keys, args in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
            return list(await pipe.execute(raise_on_error=False))

    async def _load(self, scripts: Any) -> None:
        async with self.redis.pipeline(transaction=False) as pipe:
            for script in scripts:
                pipe.execute_command("SCRIPT", "LOAD", script.source)
            replies = await pipe.execute(raise_on_error=False)
        # The first error reply as Redis gave it: redis-py's own raise puts the
        # command (a script's head) before the message, which hid its prefix from
        # _is_unavailable (MISCONF, unknown command).
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply

    def _verdict(self, reply: Any, rules: Sequence[Rule]) -> Verdict:
        """The verdict in a script's reply, whose shape was checked as it arrived
        (:func:`_script_reply`); values a ringlimit script never sends (a RESP
        server's strings where numbers go) make Redis unavailable, as a reply of
        the wrong shape does, rather than a ``ValueError`` and a 500 per request."""
        try:
            verdict = unpack_reply(reply, rules)[1]
        except (ValueError, TypeError) as exc:
            invalid = InvalidResponse(
                f"EVALSHA answered values that are not a ringlimit script's reply ({exc})"
            )
            raise self._unavailable(invalid)  # noqa: B904 (its cause is the reply)
        problem = _out_of_range(verdict, rules)
        if problem is not None:
            raise CorruptState(problem)
        return verdict

    def _raise_unavailable(self, exc: Exception) -> None:
        """Turn an availability failure into :class:`BackendUnavailable`; else return."""
        if _is_unavailable(exc):
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: Exception) -> BackendUnavailable:
        """Record an availability failure: queued checks fail at once, not try too."""
        self._available = False
        self._failures += 1
        # What a call that waited meanwhile says too: the cause, not only "failed".
        self._last_failure = described = self._describe(exc)
        if self.round_trips is not None:
            self.round_trips.fail_queued(
                lambda: BackendUnavailable(
                    f"{described} (while this call was queued, a call in flight failed)"
                )
            )
        failure = BackendUnavailable(described)
        failure.__cause__ = exc
        return failure

    def _describe(self, exc: BaseException) -> str:
        """What a log line says of an availability failure. A refusal of the node's
        user names it and what it needs: that is a configuration to fix, not an
        outage to wait out (the URL is shown without its password, as ever)."""
        if isinstance(exc, _REFUSALS):
            fix = (
                f"check the ACL of user {self.user!r} (ringlimit needs PING, SET, EVALSHA "
                f"and SCRIPT LOAD, on keys '{self.prefix}:*')"
                if isinstance(exc, NoPermissionError)
                else f"check the password in --redis-url and the ACL of user {self.user!r}"
            )
            return (
                f"redis at {self.where} refused user {self.user!r} "
                f"({type(exc).__name__}: {exc}): {fix}"
            )
        if isinstance(exc, ResponseError) and str(exc).startswith(_MISSING_COMMAND):
            # Without its arguments ("with args beginning with: ..."): a user's key.
            missing = str(exc).split(", with args", 1)[0]
            return (
                f"redis at {self.where} runs no command ringlimit needs ({missing}): "
                "ringlimit needs PING, SET, EVALSHA and SCRIPT LOAD (renamed or disabled "
                "by rename-command in its config? a proxy without scripting?)"
            )
        if isinstance(exc, InvalidResponse):
            return (
                f"redis at {self.where} does not speak the Redis protocol ({exc}): is "
                "--redis-url the address of a Redis server (not, say, an HTTP one)?"
            )
        if _refuses_database(exc):
            database = self.redis.connection_pool.connection_kwargs.get("db", 0)
            return (
                f"redis at {self.where} refused database {database} ({exc}): check the "
                "database in --redis-url (a number below the server's `databases`; 0 on "
                "a Redis Cluster)"
            )
        return f"redis at {self.where}: {type(exc).__name__}: {exc}"


class Primary(Protocol):
    """What :class:`FallbackBackend` needs of its primary."""

    name: str

    @property
    def available(self) -> bool: ...

    async def check(self, key: str, rules: Sequence[Rule], cost: int) -> Verdict: ...

    async def check_many(self, checks: Sequence[Check]) -> list[Verdict]: ...

    async def check_each(self, checks: Sequence[Check]) -> list[Verdict | ResponseError]: ...

    def key(self, user_key: str, rule: Rule) -> str: ...

    async def ping(self) -> bool: ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...


def _degraded(decision: Decision, reason: str) -> Decision:
    # "can never pass" stays the reason: it is true whichever limiter decides.
    if decision.reason == COST_EXCEEDS_CAPACITY:
        return decision
    return decision._replace(reason=reason)


class FallbackBackend:
    """A primary backend (Redis) that degrades to local limits when it fails.

    While the primary answers, every check goes to it. When it raises
    :class:`BackendUnavailable`, ``available`` turns False and checks are
    decided here, with no further call to the primary: rules with
    ``on_error="open"`` by the local in-memory limiter, rules with
    ``on_error="closed"`` denied (``retry_after`` None); every such decision
    carries ``reason="backend_unavailable"`` (except ``cost_exceeds_capacity``,
    which stays). As with several rules anywhere, a request consumes only if
    every rule allows, so a closed rule's denial keeps the open rules from
    consuming. A probe task (started by :meth:`start`) pings the primary every
    ``probe_interval`` seconds while it is down and switches back when it
    answers. ``fallbacks`` counts checks decided locally, ``outages`` the
    switches to local.

    A check the primary answers with an error reply of its own (``WRONGTYPE``:
    something else wrote that key) is decided here the same way, with
    ``reason="backend_error"``, while every other check stays the primary's (no
    switch: Redis is fine); a warning names the key, at most one per 10 s.
    """

    def __init__(
        self, primary: Primary, local: MemoryBackend, *, probe_interval: float = 0.5
    ) -> None:
        if probe_interval <= 0:
            raise ValueError("probe_interval must be positive")
        self.primary = primary
        self.local = local
        self.probe_interval = probe_interval
        self.name = primary.name
        self.fallbacks = 0
        self.outages = 0
        self._up = True
        self._down_since = 0.0
        self._fallbacks_at_down = 0
        self._went_down = asyncio.Event()
        #: Probe errors (an outage makes one per probe interval): counted on the
        #: node's /metrics, logged without flooding.
        self.failures = Failures(logger)
        self._probe: asyncio.Task[None] | None = None

    @property
    def available(self) -> bool:
        """False while checks are decided locally."""
        return self._up

    async def check(self, key: str, rules: Sequence[Rule], cost: int) -> Verdict:
        if self._up:
            try:
                return await self.primary.check(key, rules, cost)
            except BackendUnavailable as exc:
                self._switch_down(exc)
            except ResponseError as exc:
                return self._check_failed((key, rules, cost), exc, self.local.clock())
        return self._decide_locally(key, rules, cost, self.local.clock())

    async def check_many(self, checks: Sequence[Check]) -> list[Verdict]:
        if self._up:
            try:
                outcomes = await self.primary.check_each(checks)
            except BackendUnavailable as exc:
                self._switch_down(exc)
            else:
                now = self.local.clock()
                return [
                    self._check_failed(check, outcome, now)
                    if isinstance(outcome, ResponseError)
                    else outcome
                    for check, outcome in zip(checks, outcomes, strict=True)
                ]
        now = self.local.clock()
        return [self._decide_locally(key, rules, cost, now) for key, rules, cost in checks]

    def _check_failed(self, check: Check, exc: ResponseError, now: float) -> Verdict:
        """A check Redis answered with an error: decided by its rules' on_error.

        Not an outage (Redis decides every other check), and not the client's
        fault, so neither a switch to local nor a 500: the on_error its rules chose
        for a Redis that cannot decide, for this check alone. The warning names the
        keys to repair (repr: a decision-API key may hold a line break); a line per
        request would flood the log.
        """
        key, rules, cost = check
        self.failures.warn(
            "backend_error",
            "%s answered the check of %s with an error (%s: %s): decided by its rules' "
            "on_error (reason backend_error) until that key is repaired (did something "
            "other than ringlimit write it?)",
            self.name,
            ", ".join(repr(self.primary.key(key, rule)) for rule in rules),
            type(exc).__name__,
            exc,
        )
        return self._decide_locally(key, rules, cost, now, BACKEND_ERROR)

    def sweep_local(self, rules: Container[str], budget: int = 50_000) -> int:
        """Evict the local limiter's states that are fresh again, and the tables of
        rules no longer in force (as the node sweeps its own store); returns how
        many states went. Without it every key decided locally during an outage
        stayed for the node's life."""
        store = self.local.store
        evicted = store.sweep(self.local.clock(), budget=budget)
        store.forget_rules(rules)
        return evicted

    async def start(self) -> None:
        await self.local.start()
        await self.primary.start()
        if not self.primary.available:
            self._switch_down(BackendUnavailable("unavailable at start"))
        if self._probe is None:
            self._probe = asyncio.create_task(self._probe_loop(), name="ringlimit-redis-probe")

    async def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
            self._probe = None
        await self.primary.close()
        await self.local.close()

    # ------------------------------------------------------------------ local decisions

    def _decide_locally(
        self,
        key: str,
        rules: Sequence[Rule],
        cost: int,
        now: float,
        reason: str = BACKEND_UNAVAILABLE,
    ) -> Verdict:
        if cost < 0:
            raise ValueError("cost must be >= 0")
        if not rules:
            raise ValueError("a check needs at least one rule")
        self.fallbacks += 1
        store = self.local.store
        if all(rule.on_error == "open" for rule in rules):
            verdict = store.check(key, rules, now, cost)
            decisions = [_degraded(d, reason) for d in verdict.decisions]
            return Verdict(verdict.allowed, most_restrictive(decisions), tuple(decisions))
        # A closed rule denies, so nothing consumes; the open rules say what they
        # would (allowing ones as peeks, as node.limiter.decide_all does).
        decisions = []
        for rule in rules:
            if rule.on_error == "open":
                decide = REGISTRY[rule.algorithm].decide
                state = store.get(rule, key)
                decision = decide(state, now, rule, cost)[1]
                if decision.allowed and cost:
                    decision = decide(state, now, rule, 0)[1]
                decisions.append(_degraded(decision, reason))
            else:
                decisions.append(Decision(False, rule.limit, 0, 0.0, None, rule.name, reason))
        return Verdict(False, most_restrictive(decisions), tuple(decisions))

    # ------------------------------------------------------------------ switching

    def _switch_down(self, exc: BaseException) -> None:
        if not self._up:
            return
        self._up = False
        self.outages += 1
        self._down_since = time.monotonic()
        self._fallbacks_at_down = self.fallbacks
        self._went_down.set()
        logger.warning(
            "%s backend unavailable (%s): deciding locally (open rules by the in-memory "
            "limiter, closed rules denied) until it answers again",
            self.name,
            exc,
        )

    def _switch_up(self) -> None:
        if self._up:
            return
        self._up = True
        self._went_down.clear()
        logger.warning(
            "%s backend available again after %.1fs; %d checks were decided locally",
            self.name,
            time.monotonic() - self._down_since,
            self.fallbacks - self._fallbacks_at_down,
        )

    async def _probe_loop(self) -> None:
        while True:
            await self._went_down.wait()
            await asyncio.sleep(self.probe_interval)
            if self._up:
                continue
            try:
                answered = await self.primary.ping()
            except Exception as exc:  # a probe must never die; the next one tries again
                self.failures.record("backend_probe", exc)  # counted; logged at most every 10 s
                answered = False
            if answered:
                self._switch_up()
