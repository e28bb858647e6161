"""envoyproxy/ratelimit's YAML configuration, read as users already write it.

One file per domain::

    domain: edge
    descriptors:
      - key: remote_address            # no value: one limit per distinct address
        rate_limit: {unit: minute, requests_per_unit: 60}
      - key: path
        value: /login
        shadow_mode: true
        rate_limit: {name: login, unit: second, requests_per_unit: 5,
                     replaces: [{name: other}]}
        descriptors:
          - key: user
            rate_limit: {unlimited: true}

Each descriptor with a ``rate_limit`` becomes a ringlimit rule (a fixed
window aligned on the unit, as envoyproxy/ratelimit counts), marked
``named_only`` so that it never applies to proxied requests, and ``shadow``
when ``shadow_mode`` is set; ``requests_per_unit: 0`` (envoyproxy/ratelimit's
blocklist idiom) becomes a blocked :class:`Limit`, decided by the router.
Matching a request's descriptor walks the tree as envoyproxy/ratelimit does:
at each entry the exact ``key_value`` first, then a value ending in ``*`` as
a prefix, then the bare key (any value).

Every error names the file, the line and the field. Fields whose semantics
ringlimit does not implement are refused, never ignored.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from node.config import ClusterConfig, ConfigError, ScopedRule
from node.files import FileProblem, read_text
from node.rules import MAX_NAME, Rule, RuleError
from ring.errors import given

#: Seconds per unit, as envoyproxy/ratelimit divides time (month: 30 days, year: 365).
UNITS = {
    "second": 1.0,
    "minute": 60.0,
    "hour": 3600.0,
    "day": 86400.0,
    "week": 7 * 86400.0,
    "month": 30 * 86400.0,
    "year": 365 * 86400.0,
}
#: The rls.proto enum value of each unit (RateLimitResponse.RateLimit.Unit).
UNIT_ENUM = {"second": 1, "minute": 2, "hour": 3, "day": 4, "month": 5, "year": 6, "week": 7}

_TOP = ("domain", "descriptors")
_DESCRIPTOR = ("key", "value", "rate_limit", "descriptors", "shadow_mode", "detailed_metric")
_RATE_LIMIT = ("unit", "requests_per_unit", "unlimited", "name", "replaces")
#: Known envoyproxy/ratelimit fields that ringlimit refuses, and why.
_REFUSED = {
    "detailed_metric": "per-value metrics would give Prometheus unbounded label "
    "cardinality; ringlimit counts per rule (leave it out or set it to false)",
    "quota_mode": "quota mode is not supported",
    "value_to_metric": "per-value metric names are not supported",
    "share_threshold": "shared wildcard thresholds are not supported",
}
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:\-]")
#: A descriptor's key longer than ``limits.max_key_length`` is hashed
#: (router/envoy.py, ``descriptor_key``): ``/#`` and at least this many hex digits
#: of its SHA-256 (128 bits) must fit, so a shorter limit is refused at start-up.
MIN_DIGEST_HEX = 32
MIN_KEY_LENGTH = len("/#") + MIN_DIGEST_HEX


@dataclass(frozen=True)
class Limit:
    """What one configured descriptor says: a rule, unlimited, or blocked.

    ``blocked`` is ``requests_per_unit: 0``, envoyproxy/ratelimit's blocklist
    idiom: always over the limit. It has no rule (a ringlimit rule admits at
    least 1), so it is decided by the router without asking a node and counts
    nothing. ``label`` is the name it would have as a rule (``current_limit.name``).
    """

    rule: Rule | None
    unit: str
    requests_per_unit: int
    replaces: tuple[str, ...] = ()
    name: str | None = None
    blocked: bool = False
    shadow: bool = False
    label: str = ""

    @property
    def unlimited(self) -> bool:
        return self.rule is None and not self.blocked


@dataclass
class DescriptorNode:
    limit: Limit | None = None
    children: dict[str, DescriptorNode] = field(default_factory=dict)
    #: (prefix, node) for values ending in ``*``, longest prefix first.
    wildcards: list[tuple[str, str, DescriptorNode]] = field(default_factory=list)

    def find(self, key: str, value: str) -> DescriptorNode | None:
        node = self.children.get(f"{key}_{value}")
        if node is not None:
            return node
        for wkey, prefix, wnode in self.wildcards:
            if wkey == key and value.startswith(prefix):
                return wnode
        return self.children.get(key)


@dataclass(frozen=True)
class EnvoyDomain:
    name: str
    source: str
    root: DescriptorNode

    def limit_for(self, entries: Sequence[tuple[str, str]]) -> Limit | None:
        """The limit of a request's descriptor, as envoyproxy/ratelimit finds it."""
        node = self.root
        for i, (key, value) in enumerate(entries):
            found = node.find(key, value)
            if found is None:
                return None
            if i == len(entries) - 1:
                return found.limit
            node = found
        return None


@dataclass(frozen=True)
class EnvoyConfig:
    domains: dict[str, EnvoyDomain]

    @property
    def rules(self) -> tuple[ScopedRule, ...]:
        return tuple(ScopedRule(rule, named_only=True) for rule in self._rules())

    def _rules(self) -> Iterable[Rule]:
        seen: set[str] = set()
        for domain in self.domains.values():
            stack = [domain.root]
            while stack:
                node = stack.pop()
                rule = node.limit.rule if node.limit is not None else None
                if rule is not None and rule.name not in seen:
                    seen.add(rule.name)
                    yield rule
                stack.extend(node.children.values())
                stack.extend(n for _, _, n in node.wildcards)


def with_envoy_rules(config: ClusterConfig, envoy: EnvoyConfig) -> ClusterConfig:
    """``config`` with the envoy rules added (so the router pushes them to every node).

    A rule already in ``config`` with the same definition is kept once (``ringlimit
    up`` hands the router a config file that may hold them); a clash is an error, and
    so is a ``limits.max_key_length`` too short for a hashed descriptor key.
    """
    if envoy.domains and config.limits.max_key_length < MIN_KEY_LENGTH:
        raise ConfigError(
            f"limits.max_key_length is {config.limits.max_key_length}: Envoy descriptors "
            f"need at least {MIN_KEY_LENGTH} (a long descriptor's key is '/#' and "
            f"{MIN_DIGEST_HEX} hex digits of its SHA-256)"
        )
    have = {s.rule.name: s for s in config.rules}
    added = []
    for scoped in envoy.rules:
        existing = have.get(scoped.rule.name)
        if existing is None:
            added.append(scoped)
        elif existing != scoped:
            raise ConfigError(
                f"rule name {scoped.rule.name!r} is used by the config and by an envoy config"
            )
    return config.with_(rules=(*config.rules, *added)) if added else config


def load_envoy_configs(paths: Sequence[str | Path], *, on_error: str = "open") -> EnvoyConfig:
    """Read each file (one domain each); a domain given twice is an error."""
    domains: dict[str, EnvoyDomain] = {}
    names: dict[str, str] = {}
    for path in paths:
        domain = load_envoy_config(path, on_error=on_error)
        if domain.name in domains:
            raise ConfigError(
                f"{path}: domain {domain.name!r} is already defined in "
                f"{domains[domain.name].source}"
            )
        for rule in EnvoyConfig({domain.name: domain})._rules():
            if rule.name in names:
                raise ConfigError(
                    f"{path}: rate limit name {rule.name!r} is also used in {names[rule.name]}"
                )
            names[rule.name] = str(path)
        domains[domain.name] = domain
    return EnvoyConfig(domains)


def load_envoy_config(path: str | Path, *, on_error: str = "open") -> EnvoyDomain:
    path = Path(path)
    try:
        text = read_text(path)
    except FileProblem as exc:
        raise ConfigError(str(exc)) from None
    return parse_envoy_config(text, str(path), on_error=on_error)


def parse_envoy_config(text: str, source: str, *, on_error: str = "open") -> EnvoyDomain:
    try:
        document = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(f"{source}: {where}not valid YAML: {problem}") from None
    except RecursionError:
        # PyYAML composes nested collections recursively: a few hundred levels
        # deep (no real descriptor tree is) ran out of stack with a traceback.
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    try:
        return _Reader(source, on_error).domain(document)
    except RecursionError:
        raise ConfigError(f"{source}: descriptors nested too deeply") from None


#: What YAML resolves a plain scalar to: read as its text by :meth:`_Reader.string`
#: (``2001-02-30`` resolves to a timestamp that is not a date: still the text).
_IMPLICIT_TAGS = frozenset(
    f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "timestamp")
)
_NULL_TAG = "tag:yaml.org,2002:null"
_STR_TAG = "tag:yaml.org,2002:str"
#: The tag a plain scalar's text resolves to (SafeLoader's own resolver).
_RESOLVER = yaml.resolver.Resolver()


class _Reader:
    def __init__(self, source: str, on_error: str) -> None:
        self.source = source
        self.on_error = on_error
        self.domain_name = ""
        self.names: set[str] = set()
        #: Each rule name given so far (derived or explicit): where, and its line.
        self.rule_names: dict[str, tuple[str, int]] = {}
        self.replaced: list[tuple[str, yaml.Node]] = []

    def fail(self, node: yaml.Node | None, where: str, problem: str) -> ConfigError:
        line = f"line {node.start_mark.line + 1}: " if node is not None else ""
        return ConfigError(f"{self.source}: {line}{where}: {problem}")

    def mapping(
        self, node: yaml.Node, where: str, allowed: Sequence[str]
    ) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            raise self.fail(node, where, "must be a mapping")
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if not isinstance(key, str):
                raise self.fail(key_node, where, "keys must be strings")
            if key in out:
                raise self.fail(key_node, f"{where}.{key}", "given twice")
            if key in _REFUSED and not (key == "detailed_metric" and _false(value_node)):
                raise self.fail(key_node, f"{where}.{key}", f"not supported: {_REFUSED[key]}")
            if key not in allowed and key not in _REFUSED:
                raise self.fail(
                    key_node,
                    f"{where}.{key}",
                    f"unknown field (expected one of: {', '.join(allowed)})",
                )
            out[key] = (key_node, value_node)
        return out

    def scalar(self, node: yaml.Node, where: str, kind: str) -> object:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, where, f"must be {kind}")
        try:
            return yaml.constructor.SafeConstructor().construct_object(node)
        except (yaml.YAMLError, ValueError, TypeError) as exc:
            # An unknown tag (``!custom``, ``!!python/object``), a date that is
            # not one (``2001-02-30``), ``!!int abc``: each escaped as a traceback
            # or an error naming neither the file nor the line.
            problem = getattr(exc, "problem", None) or str(exc)
            raise self.fail(node, where, f"must be {kind}: {problem}"[:300]) from None

    def string(self, node: yaml.Node, where: str) -> str:
        """The scalar's text as written, as envoyproxy/ratelimit (Go's yaml into a
        string field) reads it: ``value: 02134`` is "02134", not the octal number
        1116 that YAML 1.1 resolves it to, and ``1.10`` stays "1.10"."""
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, where, "must be a string")
        if node.tag == _NULL_TAG:
            raise self.fail(node, where, f"must be a string, got {given(node.value)}")
        implicit = node.tag in _IMPLICIT_TAGS and node.tag in (
            _STR_TAG,
            _RESOLVER.resolve(yaml.ScalarNode, node.value, (True, False)),
        )
        if not implicit:
            self.scalar(node, where, "a string")  # an explicit tag: it must construct
        return str(node.value)

    def boolean(self, node: yaml.Node, where: str) -> bool:
        value = self.scalar(node, where, "true or false")
        if not isinstance(value, bool):
            raise self.fail(node, where, f"must be true or false, got {given(node.value)}")
        return value

    def domain(self, document: yaml.Node | None) -> EnvoyDomain:
        if document is None:
            raise ConfigError(f"{self.source}: empty file: expected 'domain' and 'descriptors'")
        top = self.mapping(document, "top level", _TOP)
        if "domain" not in top:
            raise self.fail(document, "top level", "missing 'domain'")
        self.domain_name = self.string(top["domain"][1], "domain")
        if not self.domain_name:
            raise self.fail(top["domain"][1], "domain", "must not be empty")
        root = DescriptorNode()
        if "descriptors" in top:
            self.descriptors(top["descriptors"][1], "descriptors", root, ())
        for name, node in self.replaced:
            if name not in self.names:
                raise self.fail(node, "replaces", f"no rate limit is named {name!r} in this file")
        return EnvoyDomain(self.domain_name, self.source, root)

    def descriptors(
        self, node: yaml.Node, where: str, parent: DescriptorNode, path: tuple[str, ...]
    ) -> None:
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            return
        if not isinstance(node, yaml.SequenceNode):
            raise self.fail(node, where, "must be a list of descriptors")
        for i, item in enumerate(node.value):
            self.descriptor(item, f"{where}[{i}]", parent, path)

    def descriptor(
        self, node: yaml.Node, where: str, parent: DescriptorNode, path: tuple[str, ...]
    ) -> None:
        fields = self.mapping(node, where, _DESCRIPTOR)
        if "key" not in fields:
            raise self.fail(node, where, "missing 'key'")
        key = self.string(fields["key"][1], f"{where}.key")
        if not key:
            raise self.fail(fields["key"][1], f"{where}.key", "must not be empty")
        value = self.string(fields["value"][1], f"{where}.value") if "value" in fields else ""
        shadow = (
            self.boolean(fields["shadow_mode"][1], f"{where}.shadow_mode")
            if "shadow_mode" in fields
            else False
        )
        child = DescriptorNode()
        if value.endswith("*"):
            if any(k == key and p == value[:-1] for k, p, _ in parent.wildcards):
                raise self.fail(node, where, f"descriptor {key}={value} is given twice")
            parent.wildcards.append((key, value[:-1], child))
            parent.wildcards.sort(key=lambda w: -len(w[1]))
        else:
            entry = f"{key}_{value}" if value else key
            if entry in parent.children:
                raise self.fail(
                    node, where, f"descriptor {key}={value or '*'} is given twice at this level"
                )
            parent.children[entry] = child
        here = (*path, f"{key}_{value}" if value else key)
        if "rate_limit" in fields:
            child.limit = self.rate_limit(
                fields["rate_limit"][1], f"{where}.rate_limit", here, shadow
            )
        elif shadow:
            raise self.fail(
                fields["shadow_mode"][0], f"{where}.shadow_mode", "needs a rate_limit to shadow"
            )
        if "descriptors" in fields:
            self.descriptors(fields["descriptors"][1], f"{where}.descriptors", child, here)

    def rate_limit(self, node: yaml.Node, where: str, path: tuple[str, ...], shadow: bool) -> Limit:
        fields = self.mapping(node, where, _RATE_LIMIT)
        name = self.string(fields["name"][1], f"{where}.name") if "name" in fields else None
        if name is not None:
            if not name:
                raise self.fail(
                    fields["name"][1], f"{where}.name", "must not be empty (leave it out)"
                )
            if name in self.names:
                raise self.fail(fields["name"][1], f"{where}.name", f"{name!r} is used twice")
            self.names.add(name)
        replaces: list[str] = []
        if "replaces" in fields:
            seq = fields["replaces"][1]
            if not isinstance(seq, yaml.SequenceNode):
                raise self.fail(seq, f"{where}.replaces", "must be a list of {name: ...}")
            for i, item in enumerate(seq.value):
                entry = self.mapping(item, f"{where}.replaces[{i}]", ("name",))
                if "name" not in entry:
                    raise self.fail(item, f"{where}.replaces[{i}]", "missing 'name'")
                replaced = self.string(entry["name"][1], f"{where}.replaces[{i}].name")
                replaces.append(replaced)
                self.replaced.append((replaced, entry["name"][1]))
        unlimited = (
            self.boolean(fields["unlimited"][1], f"{where}.unlimited")
            if "unlimited" in fields
            else False
        )
        if unlimited:
            if "requests_per_unit" in fields or "unit" in fields:
                raise self.fail(node, where, "'unlimited: true' takes no unit or requests_per_unit")
            if shadow:
                raise self.fail(node, where, "an unlimited descriptor has nothing to shadow")
            return Limit(None, "", 0, tuple(replaces), name)
        if "unit" not in fields or "requests_per_unit" not in fields:
            raise self.fail(node, where, "needs 'unit' and 'requests_per_unit' (or unlimited)")
        unit = self.string(fields["unit"][1], f"{where}.unit").lower()
        if unit not in UNITS:
            raise self.fail(
                fields["unit"][1],
                f"{where}.unit",
                f"unknown unit {unit!r} (expected one of: {', '.join(UNITS)})",
            )
        count = self.scalar(fields["requests_per_unit"][1], f"{where}.requests_per_unit", "an int")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise self.fail(
                fields["requests_per_unit"][1],
                f"{where}.requests_per_unit",
                f"must be an integer >= 0, got {given(fields['requests_per_unit'][1].value)}",
            )
        rule_name = _rule_name(name or ".".join((self.domain_name, *path)))
        # Two descriptors under one name would be one rule: the first one's limit
        # enforced for both (``a`` > ``b`` and ``a.b`` both derive ``edge.a.b``; an
        # explicit name may equal another descriptor's derived one).
        named = fields["name"][1] if name is not None else node
        if rule_name in self.rule_names:
            other, line = self.rule_names[rule_name]
            raise self.fail(
                named,
                where,
                f"rule name {rule_name!r} is also the name of {other} (line {line}); "
                "give one of them its own rate_limit.name",
            )
        self.rule_names[rule_name] = (where.removesuffix(".rate_limit"), named.start_mark.line + 1)
        if count == 0:
            # envoyproxy/ratelimit's "block everything": over the limit on every hit.
            return Limit(
                None, unit, 0, tuple(replaces), name, blocked=True, shadow=shadow, label=rule_name
            )
        try:
            rule = Rule(
                name=rule_name,
                limit=count,
                period=UNITS[unit],
                algorithm="fixed_window",
                on_error=self.on_error,
                shadow=shadow,
            )
        except RuleError as exc:
            raise self.fail(node, where, str(exc)) from None
        return Limit(rule, unit, count, tuple(replaces), name)


def _false(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.value.lower() in ("false", "no", "off")


def _rule_name(text: str) -> str:
    """A valid, stable rule name for a descriptor path (long ones end in a hash)."""
    name = _NAME_CHARS.sub("_", text)
    if len(name) > MAX_NAME or name != text:
        digest = hashlib.sha256(text.encode()).hexdigest()[:10]
        name = f"{name[: MAX_NAME - 11]}~{digest}".replace("~", "-")
    return name
