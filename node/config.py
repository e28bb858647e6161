"""The cluster's configuration: which rules apply to which request, and how.

One :class:`ClusterConfig` describes everything a node needs to decide the
same way as every other node: the rules and their scopes (path pattern,
method, user tier), where the user id and tier come from, which response
headers to send, the bypass tokens and the rebalancing policies. The router
pushes it to the nodes with every ring view, so a node never decides with
rules of its own.

It is loaded from flags or from a TOML file; every error names the file, the
key and what is wrong, at start-up rather than at the first request.
"""

from __future__ import annotations

import fnmatch
import hashlib
import ipaddress
import json
import logging
import posixpath
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from node.files import FileProblem, parse_json, parse_toml, read_text
from node.hopbyhop import HOP_BY_HOP
from node.rules import (
    CRASH_POLICIES,
    MAX_LIMIT,
    Rule,
    RuleError,
    explicit_burst,
    parse_period,
    parse_rate,
)
from ring.errors import given, names_text, shown

#: ``headers.legacy_reset``: ``X-RateLimit-Reset`` as a Unix time, or in seconds.
LEGACY_RESETS = ("epoch", "delta")
#: ``headers.denial_body``: RFC 9457 problem details, or ringlimit's plain JSON.
DENIAL_FORMATS = ("problem", "json")

IDENTITY_SOURCES = ("header", "query", "client")
REBALANCE_POLICIES = ("handoff", "reset")
BACKENDS = ("memory", "redis")
#: Seconds a node waits for Redis (a reply, a connection) before it decides
#: locally and treats Redis as down until a probe answers: tight, so an outage
#: costs milliseconds, and configurable (``--redis-timeout``) because a
#: CPU-starved node can miss it with Redis healthy (docs/redis.md).
REDIS_TIMEOUT = 0.1
#: Seconds an idle connection to a node's upstream is reused (``--upstream-idle``):
#: below the 5 s keep-alive of uvicorn, Node.js and Apache. (Not the cluster's own
#: REUSE_IDLE, node/frontdoor.py, though equal: that one follows ringlimit's servers.)
UPSTREAM_IDLE = 4.0
#: Seconds a request to a node's upstream may take, from connecting to its
#: answer's last byte (``--upstream-timeout``): past it, a 502 if the answer had
#: not begun, else the answer is cut off.
UPSTREAM_TIMEOUT = 30.0
MIN_REDIS_TIMEOUT = 0.001
#: ``policies.replication_interval``'s range, in seconds (the simulator's
#: ``modes.replication_interval`` takes the same).
MIN_REPLICATION_INTERVAL = 0.001
MAX_REPLICATION_INTERVAL = 60.0
MAX_REDIS_TIMEOUT = 60.0
BALANCES = ("sticky", "round-robin")
SHOW_KEYS = ("plain", "hashed")
_CACHE_LIMIT = 4096


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and why."""


_PATH_PARAMETERS = re.compile(r";[^/]*")
log = logging.getLogger("ringlimit.config")

#: An HTTP method: a token (RFC 9110 5.6.2); anything else can match no request.
_METHOD = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
#: A control character (Cc): what no path pattern holds (format characters such
#: as ZWNJ, or NBSP, are text: str.isprintable() refuses those too).
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: The most ``paths`` patterns of one rule, and of a whole config, and the longest
#: pattern: a rule's patterns are compiled into one regular expression as a node
#: first matches a request against it (about 40 us per pattern). One rule of
#: 100,000 patterns (in a 1 MiB rules call) held every node's event loop for
#: 2.3 s at its first request, long enough to be suspected by the router's
#: probes (an exploratory tester).
MAX_PATTERNS = 256
MAX_CONFIG_PATTERNS = 4096
MAX_PATTERN_LENGTH = 1024
#: What :func:`fnmatch.translate` makes of a part that matches nothing.
_NEVER = "(?!)"


def _digest(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path_forms(path: str) -> tuple[str, ...]:
    """The spellings of ``path`` that a rule's ``paths`` patterns are tried on.

    An application behind the router may read several spellings as one path:
    nginx and Werkzeug merge repeated slashes, Express ignores a trailing
    slash, Tomcat and Spring drop ``;`` parameters, IIS reads ``\\`` as ``/``,
    and a node reached directly may resolve dot segments. A limit on
    ``/api/login`` must not be escaped by ``//api/login``, ``/api/login/``
    or ``/api/login;jsessionid=1``, so a pattern is tried on the path as it
    arrived (ASGI's, percent-decoded), on its canonical form (those
    spellings undone) and on that form with a trailing slash. Matching more
    spellings can only apply a limit to more requests, never to fewer.
    """
    if not path.startswith("/"):
        return (path,)
    if not (path.endswith("/") or "//" in path or "/." in path or ";" in path or "\\" in path):
        return (path, path + "/")  # already canonical: most paths, cheaply
    canonical = path.replace("\\", "/")
    if ";" in canonical:
        canonical = _PATH_PARAMETERS.sub("", canonical)
    # normpath merges slashes, resolves dot segments and drops a trailing slash,
    # but keeps POSIX's two leading slashes: hence the lstrip.
    canonical = "/" + posixpath.normpath(canonical).lstrip("/")
    slashed = canonical if canonical == "/" else canonical + "/"
    return tuple(dict.fromkeys((path, canonical, slashed)))


@dataclass(frozen=True)
class ScopedRule:
    """A rule and the requests it applies to (an empty scope matches everything)."""

    rule: Rule
    paths: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    tiers: tuple[str, ...] = ()
    #: Applies only where it is named (decision API, Envoy's gRPC API): never to a
    #: proxied request and never as a default. Rules from ``--envoy-config`` are so.
    named_only: bool = False

    @property
    def is_default(self) -> bool:
        return not (self.paths or self.methods or self.tiers or self.named_only)

    def matches(self, method: str, paths: tuple[str, ...], tier: str | None) -> bool:
        """Whether the scope takes this request, ``paths`` being its path's
        :func:`path_forms` (any one matching a pattern is enough)."""
        if self.named_only:
            return False
        if self.methods and method.upper() not in self.methods:
            return False
        if self.tiers and (tier is None or tier not in self.tiers):
            return False
        if not self.paths:
            return True
        match = self._paths_match
        return any(match(path) for path in paths)

    @cached_property
    def _paths_match(self) -> Callable[[str], re.Match[str] | None]:
        """Every pattern of ``paths`` in one regular expression: one match per
        spelling of a path, however many patterns (``fnmatchcase`` each)."""
        joined = "|".join(f"(?:{fnmatch.translate(pattern)})" for pattern in self.paths)
        return re.compile(joined).match

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = self.rule.to_dict()
        for name in ("paths", "methods", "tiers"):
            if getattr(self, name):
                data[name] = list(getattr(self, name))
        if self.named_only:
            data["named_only"] = True
        return data


#: Fields HTTP itself reads, or a proxy sets, which ``bypass.header`` may not name.
_HTTP_FIELDS = frozenset(
    {"host", "content-length", "expect", "x-forwarded-for", "forwarded"}
    | {name.decode() for name in HOP_BY_HOP}
)


def _field_taken(name: str, identity: Identity) -> str | None:
    """Why the (lower-case) field ``name`` cannot carry a bypass token, or None.

    A token there would be no secret, or never arrive: every HTTP/1.1 client
    sends ``Host`` with a value anyone may copy, a router writes
    ``X-Forwarded-For``, hop-by-hop fields stop at the router, and in the
    identity or tier field a user id equal to a token would bypass the limits
    (configs with ``header = "Host"`` were taken; an exploratory tester)."""
    if name in _HTTP_FIELDS:
        return "HTTP or a proxy uses it"
    if identity.source == "header" and name == identity.name.lower():
        return "it is identity.name (the field the user id comes from)"
    if identity.tier_header and name == identity.tier_header.lower():
        return "it is identity.tier_header"
    return None


@dataclass(frozen=True)
class Identity:
    """Where the user id comes from.

    ``source`` is a request header (``name`` is the header), a query parameter
    (``name`` is the parameter) or the client address. The client address
    honours ``X-Forwarded-For`` only when the peer is a trusted proxy: anyone
    else could write that header and pick another user's quota.
    """

    source: str = "header"
    name: str = "X-User-Id"
    fallback_to_client: bool = False
    trusted_proxies: tuple[str, ...] = ()
    tier_header: str | None = "X-User-Tier"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"identity.name must be a non-empty string, got {given(self.name)}")
        if self.tier_header is not None and not isinstance(self.tier_header, str):
            raise ConfigError(
                f"identity.tier_header must be a string, got {given(self.tier_header)}"
            )
        if self.source == "header":
            check_header_name(self.name, "identity.name")
        if self.tier_header:
            check_header_name(self.tier_header, "identity.tier_header")
        if not isinstance(self.fallback_to_client, bool):
            raise ConfigError(
                "identity.fallback_to_client must be true or false, "
                f"got {given(self.fallback_to_client)}"
            )
        if self.source not in IDENTITY_SOURCES:
            raise ConfigError(
                f"identity.source must be one of {', '.join(IDENTITY_SOURCES)},"
                f" got {given(self.source)}"
            )
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ConfigError(
                    f"identity.trusted_proxies: {proxy!r} is not an IP address or network"
                ) from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "name": self.name,
            "fallback_to_client": self.fallback_to_client,
            "trusted_proxies": list(self.trusted_proxies),
            "tier_header": self.tier_header,
        }


#: A field name as HTTP writes it (RFC 9110 5.1: a token).
_FIELD_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def check_header_name(name: str, where: str) -> None:
    """ConfigError unless ``name`` can be a request's field name: one that cannot
    ("X Bad", "X:Bad") was taken, and no request could ever carry it (a bypass
    that never matched, a user id never found: every request then refused or
    counted as its client address, without a word at start)."""
    if not _FIELD_NAME.fullmatch(name):
        raise ConfigError(
            f"{where} {given(name)} is not a header name (letters, digits and !#$%&'*+-.^_`|~ only)"
        )


@dataclass(frozen=True)
class Policies:
    """What happens to counters when the ring changes (see docs/rebalancing.md)."""

    rebalance: str = "handoff"
    crash: str = "replica"
    replication_interval: float = 0.1

    def __post_init__(self) -> None:
        if self.rebalance not in REBALANCE_POLICIES:
            raise ConfigError(
                f"policies.rebalance must be one of {', '.join(REBALANCE_POLICIES)}, "
                f"got {given(self.rebalance)}"
            )
        if self.crash not in CRASH_POLICIES:
            raise ConfigError(
                f"policies.crash must be one of {', '.join(CRASH_POLICIES)},"
                f" got {given(self.crash)}"
            )
        if not MIN_REPLICATION_INTERVAL <= self.replication_interval <= MAX_REPLICATION_INTERVAL:
            raise ConfigError(
                f"policies.replication_interval must be between {MIN_REPLICATION_INTERVAL:g} "
                f"and {MAX_REPLICATION_INTERVAL:g} s"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rebalance": self.rebalance,
            "crash": self.crash,
            "replication_interval": self.replication_interval,
        }


#: The most each of ``[limits]`` may be set to, and why: a key travels in a
#: header, percent-encoded (up to 12 bytes per character), under the 64 KiB cap
#: on a request's head; a batch's checks and a body are held in memory whole;
#: a cost above any rule's limit (10^9 at most) is always denied.
LIMITS_CEILINGS = {
    "max_key_length": 4096,
    "max_batch": 100_000,
    "max_body": 1 << 30,
    "max_cost": MAX_LIMIT,
}


@dataclass(frozen=True)
class Limits:
    """Explicit bounds on what a client may send (themselves bounded:
    :data:`LIMITS_CEILINGS`)."""

    max_key_length: int = 256
    max_batch: int = 1000
    max_body: int = 1 << 20
    max_cost: int = 1_000_000_000

    def __post_init__(self) -> None:
        for name, ceiling in LIMITS_CEILINGS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"limits.{name} must be a positive integer, got {given(value)}")
            if value > ceiling:
                raise ConfigError(f"limits.{name} must be at most {ceiling:,}, got {value:,}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_key_length": self.max_key_length,
            "max_batch": self.max_batch,
            "max_body": self.max_body,
            "max_cost": self.max_cost,
        }


#: What the admin API shows in place of ``privacy.salt`` (router/admin.py).
HIDDEN_SALT = "<hidden>"


@dataclass(frozen=True)
class Privacy:
    """How user ids leave the cluster on operator endpoints (``GET /admin/top``, the page).

    ``hashed`` shows ``HMAC-SHA256(salt, id)`` (16 hex digits) instead of the
    id: an operator can still tell users apart and follow one across
    refreshes, but ids never leave the cluster, and without the salt a hash
    cannot be tested against a guessed id. Without a ``salt`` each router
    draws a random one at start (hashes then change when it restarts).
    """

    show_keys: str = "plain"
    salt: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.show_keys not in SHOW_KEYS:
            raise ConfigError(
                f"privacy.show_keys must be one of {', '.join(SHOW_KEYS)},"
                f" got {given(self.show_keys)}"
            )
        if self.salt is not None and (not isinstance(self.salt, str) or not self.salt):
            raise ConfigError("privacy.salt must be a non-empty string")
        if self.salt == HIDDEN_SALT:
            # A config `ringlimit config` showed, used as it is: a public string as
            # the key that hides user ids (the review of the day's changes).
            raise ConfigError(
                f"privacy.salt {HIDDEN_SALT!r} is what `ringlimit config` shows in place "
                "of the salt: put the real salt in the file (or leave it out)"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"show_keys": self.show_keys, **({"salt": self.salt} if self.salt else {})}


def hash_token(token: str) -> str:
    """How bypass tokens are stored: only their SHA-256, never the token itself."""
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass(frozen=True)
class ClusterConfig:
    rules: tuple[ScopedRule, ...] = ()
    identity: Identity = field(default_factory=Identity)
    policies: Policies = field(default_factory=Policies)
    limits: Limits = field(default_factory=Limits)
    privacy: Privacy = field(default_factory=Privacy)
    legacy_headers: bool = True
    #: ``X-RateLimit-Reset`` as a Unix time ("epoch") or in seconds ("delta").
    legacy_reset: str = "epoch"
    #: 429 bodies: RFC 9457 problem details ("problem") or ringlimit's JSON ("json").
    denial_format: str = "problem"
    bypass_header: str = "X-Ringlimit-Bypass"
    bypass_sha256: tuple[str, ...] = ()
    backend: str = "memory"
    balance: str = "sticky"
    _by_name: dict[str, Rule] = field(init=False, repr=False, compare=False)
    #: Some rule says ``lease = "auto"``: the router's proxy path consults its leases.
    leasing: bool = field(init=False, repr=False, compare=False)
    _defaults: tuple[Rule, ...] = field(init=False, repr=False, compare=False)
    _cache: dict[tuple[str, str, str | None], tuple[Rule, ...]] = field(
        init=False, repr=False, compare=False
    )
    #: Each distinct set of matching rules, as one tuple (see :meth:`rules_for`).
    _sets: dict[tuple[Rule, ...], tuple[Rule, ...]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_name: dict[str, Rule] = {}
        for scoped in self.rules:
            if scoped.rule.name in by_name:
                raise ConfigError(f"rule name {scoped.rule.name!r} is used twice")
            by_name[scoped.rule.name] = scoped.rule
        object.__setattr__(self, "leasing", any(r.lease == "auto" for r in by_name.values()))
        for digest in self.bypass_sha256:
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ConfigError("bypass.token_sha256 entries must be 64 lowercase hex digits")
        check_header_name(self.bypass_header, "bypass.header")
        bypass = self.bypass_header.lower()
        if bypass.startswith("x-ringlimit-") and bypass != "x-ringlimit-bypass":
            raise ConfigError(
                f"bypass.header {self.bypass_header!r}: names starting with X-Ringlimit- are "
                "ringlimit's own fields (only X-Ringlimit-Bypass may be used)"
            )
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {', '.join(BACKENDS)}")
        if self.balance not in BALANCES:
            raise ConfigError(f"balance must be one of {', '.join(BALANCES)}")
        if self.legacy_reset not in LEGACY_RESETS:
            raise ConfigError(
                f"headers.legacy_reset must be one of {', '.join(LEGACY_RESETS)}, "
                f"got {given(self.legacy_reset)}"
            )
        if self.denial_format not in DENIAL_FORMATS:
            raise ConfigError(
                f"headers.denial_body must be one of {', '.join(DENIAL_FORMATS)}, "
                f"got {given(self.denial_format)}"
            )
        object.__setattr__(self, "_by_name", by_name)
        object.__setattr__(self, "_defaults", tuple(s.rule for s in self.rules if s.is_default))
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "_sets", {})

    # ------------------------------------------------------------------ lookups

    def rule(self, name: str) -> Rule | None:
        return self._by_name.get(name)

    @property
    def rule_map(self) -> Mapping[str, Rule]:
        return self._by_name

    @property
    def default_rules(self) -> tuple[Rule, ...]:
        """The rules with no scope: what the decision API applies when no rule is named."""
        return self._defaults

    def rules_for(self, method: str, path: str, tier: str | None) -> tuple[Rule, ...]:
        """Every rule whose scope matches this request (all of them must allow it).

        Requests that match the same rules get the same tuple object, whatever
        their paths: callers key caches on it (node/headers.py's HeaderCache
        keeps a plan of rendered fields per tuple). A tuple per path made a
        plan per path: a node serving 1,000 paths grew by 1 MB a second
        towards 1,024 plans of 4,096 rendered entries, about 4 GB.
        """
        key = (method, path, tier)
        found = self._cache.get(key)
        if found is None:
            paths = path_forms(path)
            found = self._one_tuple(
                tuple(s.rule for s in self.rules if s.matches(method, paths, tier))
            )
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[key] = found
        return found

    def _one_tuple(self, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
        """The tuple already handed out for this set of rules, or ``rules`` (kept
        apart from the path cache, which clears: sets are few, paths are not)."""
        sets = self._sets
        found = sets.get(rules)
        if found is None:
            if len(sets) >= _CACHE_LIMIT:
                sets.clear()
            found = sets[rules] = rules
        return found

    def with_(self, **changes: Any) -> ClusterConfig:
        return replace(self, **changes)

    def with_rule_tables(self, rules: Any, *, source: str, strict: bool = True) -> ClusterConfig:
        """This config with ``rules`` (``[[rules]]`` tables, as a file holds them)
        for its own, checked as a file's are: ConfigError says where and why.
        The rest stays (PUT /admin/rules, and the routers that take its result,
        not ``strict``: see :meth:`from_dict`)."""
        return ClusterConfig.from_dict(
            {**self.to_dict(), "rules": rules}, source=source, strict=strict
        )

    @cached_property
    def digest(self) -> str:
        """A short hash of the whole config: a node reports the one it holds in
        ``/healthz``, and the leading router pushes its config again to a node
        whose digest is not its own (one that missed a change of rules, which
        moves no epoch)."""
        return _digest(self.to_dict())

    @cached_property
    def rules_digest(self) -> str:
        """A short hash of the rules alone: routers that follow a leader compare
        it with the leader's, and fetch its rules only when they differ."""
        return _digest([scoped.to_dict() for scoped in self.rules])

    # ------------------------------------------------------------------ wire format

    def to_dict(self) -> dict[str, Any]:
        return {
            "rules": [s.to_dict() for s in self.rules],
            "identity": self.identity.to_dict(),
            "policies": self.policies.to_dict(),
            "limits": self.limits.to_dict(),
            "privacy": self.privacy.to_dict(),
            "headers": {
                "legacy": self.legacy_headers,
                "legacy_reset": self.legacy_reset,
                "denial_body": self.denial_format,
            },
            "bypass": {"header": self.bypass_header, "token_sha256": list(self.bypass_sha256)},
            "backend": self.backend,
            "balance": self.balance,
        }

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], *, source: str = "config", strict: bool = True
    ) -> ClusterConfig:
        """``strict=False`` for a config another ringlimit process already took
        (an etcd record, a push, a leader's rules): a rule that can match nothing
        is then logged, not refused, so that a version that checks more does not
        refuse the records and pushes of the version it upgrades (a node that
        refused its router's push would be removed as crashed)."""
        return _Parser(source, strict=strict).config(data)


def load_config(path: str | Path) -> ClusterConfig:
    """Read a TOML (or JSON) config file; errors name the file, the key and the problem."""
    return config_of(load_config_data(path), path)


def load_config_data(path: str | Path) -> Any:
    """A config file's document, before it is read as a config (ConfigError if
    it cannot be parsed): what it sets, for a caller that uses part of it."""
    path = Path(path)
    try:
        text = read_text(path)
        return parse_json(text, path) if path.suffix == ".json" else parse_toml(text, path)
    except FileProblem as exc:
        raise ConfigError(str(exc)) from None


def config_of(data: Any, path: str | Path) -> ClusterConfig:
    """:func:`load_config` of a document already read from ``path``."""
    return _Parser(str(path)).config(data)


def _off_if_empty(value: Any) -> Any:
    """None for "" (a setting switched off), anything else as it is, for its own check."""
    return None if isinstance(value, str) and not value else value


def unencodable(data: Any) -> str | None:
    """Where in ``data`` (``rules[0].tiers[1]``) a string UTF-8 cannot carry is
    (a key or a value), or None.

    A config is pushed to every node as JSON bytes: one lone surrogate in a tier
    or a path (JSON ``"\\ud800"``) was taken, then every push of it failed to
    encode. Walked with a stack, not recursion: a body nested deeper than
    Python's recursion limit is answered, not a RecursionError.
    """
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return where or "top level"
        elif isinstance(value, Mapping):
            for key, item in value.items():
                path = f"{where}.{shown(key)}" if where else shown(key)
                stack.append((path, key))
                stack.append((path, item))
        elif isinstance(value, list | tuple):
            stack.extend((f"{where}[{i}]", item) for i, item in enumerate(value))
    return None


class _Parser:
    """Turns plain data into a config, remembering where each value came from."""

    _TOP = {
        "rules",
        "identity",
        "policies",
        "limits",
        "privacy",
        "headers",
        "bypass",
        "backend",
        "balance",
    }

    def __init__(self, source: str, *, strict: bool = True) -> None:
        self.source = source
        self.strict = strict
        #: ``paths`` patterns read so far, across the rules.
        self.patterns = 0

    def fail(self, where: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.source}: {where}: {problem}")

    def useless(self, where: str, problem: str) -> None:
        """A value that can match nothing: refused, or (not strict) logged."""
        if self.strict:
            raise self.fail(where, problem)
        log.warning("%s: %s: %s (kept: it limits nothing)", self.source, where, problem)

    def beyond(self, where: str, problem: str) -> None:
        """A value past a size limit, or one refused since: refused, or (not
        strict: a config another ringlimit process took, perhaps of a version
        without the limit) logged."""
        if self.strict:
            raise self.fail(where, problem)
        log.warning(
            "%s: %s: %s (kept: another ringlimit process took it)", self.source, where, problem
        )

    def table(self, data: Any, where: str, allowed: Iterable[str]) -> Mapping[str, Any]:
        if data is None:
            return {}
        if not isinstance(data, Mapping):
            raise self.fail(where, f"must be a table, got {type(data).__name__}")
        unknown = set(data) - set(allowed)
        if unknown:
            raise self.fail(where, f"unknown key(s) {names_text(unknown)}")
        return data

    def number(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(where, f"must be a number, got {given(value)}")
        return float(value)

    def strings(self, value: Any, where: str) -> tuple[str, ...]:
        if value is None:
            return ()
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(where, "must be a list of strings")
        return tuple(value)

    def config(self, data: Mapping[str, Any]) -> ClusterConfig:
        if not isinstance(data, Mapping):
            # Not table()'s None-is-empty: a null config would wipe every rule.
            raise self.fail("top level", f"must be a table, got {type(data).__name__}")
        if (where := unencodable(data)) is not None:
            raise self.fail(where, "not valid Unicode (a lone surrogate)")
        data = self.table(data, "top level", self._TOP)
        rules_data = data.get("rules", [])
        if not isinstance(rules_data, list):
            raise self.fail("rules", "must be an array of tables ([[rules]])")
        rules = tuple(self.scoped_rule(r, f"rules[{i}]") for i, r in enumerate(rules_data))
        if self.patterns > MAX_CONFIG_PATTERNS:
            self.beyond(
                "rules",
                f"{self.patterns:,} paths patterns in all; at most {MAX_CONFIG_PATTERNS:,}",
            )
        ident = self.table(
            data.get("identity"),
            "identity",
            {"source", "name", "fallback_to_client", "trusted_proxies", "tier_header"},
        )
        pol = self.table(
            data.get("policies"), "policies", {"rebalance", "crash", "replication_interval"}
        )
        lim = self.table(
            data.get("limits"),
            "limits",
            {"max_key_length", "max_batch", "max_body", "max_cost"},
        )
        headers = self.table(
            data.get("headers"), "headers", {"legacy", "legacy_reset", "denial_body"}
        )
        priv = self.table(data.get("privacy"), "privacy", {"show_keys", "salt"})
        bypass = self.table(data.get("bypass"), "bypass", {"header", "token_sha256", "tokens"})
        try:
            identity = Identity(
                source=ident.get("source", "header"),
                name=ident.get("name", "X-User-Id"),
                fallback_to_client=ident.get("fallback_to_client", False),
                trusted_proxies=self.strings(
                    ident.get("trusted_proxies"), "identity.trusted_proxies"
                ),
                # An empty tier header switches tiers off (TOML has no null); only
                # "": 0, [] or {} (falsy too) quietly switched them off as well.
                tier_header=_off_if_empty(ident.get("tier_header", "X-User-Tier")),
            )
            policies = Policies(
                rebalance=pol.get("rebalance", "handoff"),
                crash=pol.get("crash", "replica"),
                replication_interval=self.number(
                    pol.get("replication_interval", 0.1), "policies.replication_interval"
                ),
            )
            limits = Limits(**lim)
            privacy = Privacy(show_keys=priv.get("show_keys", "plain"), salt=priv.get("salt"))
            hashes = list(self.strings(bypass.get("token_sha256"), "bypass.token_sha256"))
            # Plain tokens are accepted for convenience and hashed at once.
            hashes += [hash_token(t) for t in self.strings(bypass.get("tokens"), "bypass.tokens")]
            legacy = headers.get("legacy", True)
            if not isinstance(legacy, bool):
                raise self.fail("headers.legacy", f"must be true or false, got {given(legacy)}")
            bypass_header = bypass.get("header", "X-Ringlimit-Bypass")
            if not isinstance(bypass_header, str) or not bypass_header:
                raise self.fail(
                    "bypass.header", f"must be a header name, got {given(bypass_header)}"
                )
            taken = _field_taken(bypass_header.lower(), identity)
            if taken:
                self.beyond(
                    "bypass.header", f"{bypass_header!r}: {taken}; choose a field of its own"
                )
            return ClusterConfig(
                rules=rules,
                identity=identity,
                policies=policies,
                limits=limits,
                privacy=privacy,
                legacy_headers=legacy,
                legacy_reset=headers.get("legacy_reset", "epoch"),
                denial_format=headers.get("denial_body", "problem"),
                bypass_header=bypass_header,
                bypass_sha256=tuple(h.lower() for h in hashes),
                backend=data.get("backend", "memory"),
                # As the docs and `--backend redis` say: a shared backend balances
                # round-robin unless told otherwise (a file's backend = "redis"
                # alone routed by owner, on nodes that own no keys: the review).
                balance=data.get(
                    "balance", "round-robin" if data.get("backend") == "redis" else "sticky"
                ),
            )
        except ConfigError as exc:
            if str(exc).startswith(self.source):
                raise
            raise ConfigError(f"{self.source}: {exc}") from None
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{self.source}: {exc}") from None

    def scoped_rule(self, data: Any, where: str) -> ScopedRule:
        data = self.table(
            data,
            where,
            {
                "name",
                "rate",
                "limit",
                "period",
                "algorithm",
                "burst",
                "on_error",
                "crash_policy",
                "replicas",
                "shadow",
                "lease",
                "named_only",
                "paths",
                "methods",
                "tiers",
            },
        )
        if "rate" in data:
            if "limit" in data or "period" in data:
                raise self.fail(where, "give either 'rate' or 'limit' and 'period', not both")
            try:
                limit, period = parse_rate(data["rate"])
            except RuleError as exc:
                raise self.fail(f"{where}.rate", str(exc)) from None
        else:
            if "limit" not in data or "period" not in data:
                raise self.fail(where, "needs 'rate' (e.g. '100/minute') or 'limit' + 'period'")
            limit = data["limit"]
            raw_period = data["period"]
            if isinstance(raw_period, str):
                try:
                    period = parse_period(raw_period)
                except RuleError as exc:
                    raise self.fail(f"{where}.period", str(exc)) from None
            else:
                period = self.number(raw_period, f"{where}.period")
        name = data.get("name")
        if name is None:
            raise self.fail(where, "needs a 'name' (shown in headers and metrics)")
        algorithm = data.get("algorithm", "token_bucket")
        if not isinstance(algorithm, str):
            raise self.fail(f"{where}.algorithm", f"must be a string, got {given(algorithm)}")
        try:
            rule = Rule(
                name=name,
                limit=limit,
                period=period,
                algorithm=algorithm,
                burst=explicit_burst(data.get("burst")),
                on_error=data.get("on_error", "open"),
                crash_policy=data.get("crash_policy"),
                replicas=data.get("replicas", 1),
                shadow=data.get("shadow", False),
                lease=data.get("lease", "off"),
            )
        except RuleError as exc:
            raise self.fail(_rule_field(where, str(exc)), str(exc)) from None
        methods = tuple(m.upper() for m in self.strings(data.get("methods"), f"{where}.methods"))
        for i, method in enumerate(methods):
            if method == "*" or not _METHOD.fullmatch(method):
                self.useless(
                    f"{where}.methods[{i}]",
                    f"{method!r} is not an HTTP method (leave methods out for all of them)",
                )
        paths = self.strings(data.get("paths"), f"{where}.paths")
        if len(paths) > MAX_PATTERNS:
            self.beyond(
                f"{where}.paths",
                f"{len(paths):,} patterns; at most {MAX_PATTERNS} per rule (a '*' covers many)",
            )
        self.patterns += len(paths)
        for i, pattern in enumerate(paths):
            if len(pattern) > MAX_PATTERN_LENGTH:
                self.beyond(
                    f"{where}.paths[{i}]",
                    f"{len(pattern):,} characters; at most {MAX_PATTERN_LENGTH:,}",
                )
            if not pattern.startswith(("/", "*")) or _CONTROL.search(pattern):
                self.useless(
                    f"{where}.paths[{i}]",
                    f"{pattern!r} can match no path: a pattern is a path only (such as"
                    " '/v1/*'), starts with '/' or '*' and holds no control character",
                )
            if _NEVER in fnmatch.translate(pattern):
                # fnmatch's translation of an empty range ('[z-a]'): nothing matches.
                self.useless(
                    f"{where}.paths[{i}]",
                    f"{pattern!r} can match no path: a character range is empty",
                )
        tiers = self.strings(data.get("tiers"), f"{where}.tiers")
        if "" in tiers:
            self.useless(f"{where}.tiers[{tiers.index('')}]", "a tier is a non-empty string")
        named_only = data.get("named_only", False)
        if not isinstance(named_only, bool):
            raise self.fail(
                f"{where}.named_only", f"must be true or false, got {given(named_only)}"
            )
        return ScopedRule(
            rule=rule,
            paths=paths,
            methods=methods,
            tiers=tiers,
            named_only=named_only,
        )


_RULE_FIELDS = (
    (": limit must", "limit"),
    ("limit is capped", "limit"),
    (": period must", "period"),
    ("unknown algorithm", "algorithm"),
    ("burst must", "burst"),
    (": on_error must", "on_error"),
    (": crash_policy must", "crash_policy"),
    (": replicas must", "replicas"),
    (": shadow must", "shadow"),
    (": lease must", "lease"),
    (": lease = ", "lease"),
)


def _rule_field(where: str, message: str) -> str:
    """``rules[1]`` -> ``rules[1].burst`` when the rule's error names a field."""
    if message.startswith("rule name"):
        return f"{where}.name"
    for phrase, key in _RULE_FIELDS:
        if phrase in message:
            return f"{where}.{key}"
    return where
