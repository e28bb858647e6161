"""Scenario files: what to simulate, read from TOML and validated up front.

Every problem is a :class:`ScenarioError` whose message names the file, the
key (``events[2].node``) and what is wrong with it, so a typo fails before a
long run starts rather than in the middle of it. Unknown keys are refused: a
misspelt ``hot_shar`` would otherwise silently simulate something else.

The file format is documented in ``docs/simulations.md``; ``to_dict`` echoes
the parsed scenario into the JSON report.
"""

from __future__ import annotations

import math
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.config import MAX_REPLICATION_INTERVAL, MIN_REPLICATION_INTERVAL
from node.files import FileProblem, parse_toml, read_text
from node.lease import MAX_LEASE
from node.rules import Rule, RuleError, parse_rule
from node.rules import parse_duration as parse_unit_duration

#: Every mode the simulator knows, in report order. ``global`` is the reference.
MODES = ("global", "handoff", "reset", "conservative", "replica", "round_robin", "leases")
#: The modes a scenario runs when it names none: ``leases`` joins them when the
#: scenario's one rule says ``lease = "auto"`` (:func:`leases_problem`).
DEFAULT_MODES = MODES[:-1]
#: Modes that route each user to the ring owner of its key.
STICKY_MODES = ("handoff", "reset", "conservative", "replica")
EVENT_TYPES = ("join", "leave", "crash", "restart", "pause")
POPULARITIES = ("uniform", "zipf")
PROCESSES = ("poisson", "bursty")
#: What handoff mode may do with the keys of a crashed node (a crash cannot hand off).
HANDOFF_CRASH_POLICIES = ("reset", "conservative")
#: What a member removed on probes whose process lived on does with its states
#: when it comes back: merge them into the current owners (the node since the
#: removal budget), or throw them away (the node before it).
RETURNING_POLICIES = ("hand_back", "discard")
ON_ERROR = ("open", "closed")

MAX_USERS = 50_000_000
MAX_NODES = 1_000
#: Arrivals a scenario may ask for (rate x duration): five times large_10m's. A
#: rate of 1e8 for 100 s asked for 1e10, about 120 GB, and ended in a
#: MemoryError traceback (or a hang of the pool), not a line.
MAX_ARRIVALS = 50_000_000
#: Replication rounds (the ``replica`` mode, every ``modes.replication_interval``)
#: and probe rounds (the detection replay, every ``detection.health_interval``,
#: run with pauses or partitions) a run may make, each counted once per node it
#: visits (1-4 µs each, the replay's rounds twice: at load and for the run):
#: about a minute of either. An interval of 1 µs over 20 h asked for 7.2e10
#: rounds and never ended.
MAX_NODE_ROUNDS = 20_000_000

if TYPE_CHECKING:
    from .detection import Detection

_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,64}$")


class ScenarioError(ValueError):
    """A scenario that cannot be simulated; the message names file, key and problem."""


# --------------------------------------------------------------------------- parsed form


@dataclass(frozen=True, slots=True)
class NodeSpec:
    id: str
    weight: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "weight": self.weight}


@dataclass(frozen=True, slots=True)
class UsersSpec:
    count: int
    popularity: str = "zipf"
    exponent: float = 1.0
    hot_users: int = 0
    hot_share: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "popularity": self.popularity,
            "exponent": self.exponent,
            "hot_users": self.hot_users,
            "hot_share": self.hot_share,
        }


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    rate: float
    process: str = "poisson"
    burst_factor: float = 10.0
    burst_fraction: float = 0.1
    burst_duration: float = 2.0
    cost: int = 1

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"rate": self.rate, "process": self.process, "cost": self.cost}
        if self.process == "bursty":
            data |= {
                "burst_factor": self.burst_factor,
                "burst_fraction": self.burst_fraction,
                "burst_duration_s": self.burst_duration,
            }
        return data


@dataclass(frozen=True, slots=True)
class EventSpec:
    """One event as written; ``index`` is its position in the file's ``events``."""

    index: int
    at: float
    type: str
    node: str
    weight: int = 1
    graceful: bool = True
    downtime: float = 0.0
    #: pause only: every paused node (``node`` is the first), and for how long
    nodes: tuple[str, ...] = ()
    duration: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        if self.type == "pause":
            return {
                "at_s": self.at,
                "type": self.type,
                "nodes": list(self.nodes),
                "duration_s": self.duration,
            }
        data: dict[str, Any] = {"at_s": self.at, "type": self.type, "node": self.node}
        if self.type == "join":
            data["weight"] = self.weight
        if self.type == "restart":
            data |= {"graceful": self.graceful, "downtime_s": self.downtime}
            if self.weight:
                data["weight"] = self.weight
        return data


@dataclass(frozen=True, slots=True)
class DetectionSpec:
    """The router's failure detection, as ``router/membership.py`` runs it.

    Only ``pause`` events go through it (a ``crash`` event is applied at its
    time, as before). ``budget = false`` is the router before the removal
    budget: every member that failed ``failure_threshold`` probes is removed
    at once, with no quorum, no rate limit and no lease.
    """

    health_interval: float = 1.0
    failure_threshold: int = 3
    health_timeout: float = 0.5
    removal_quorum: float = 0.5
    removal_interval: float = 4.5
    lease: float = 4.5
    budget: bool = True

    @property
    def detection_time(self) -> float:
        """``f·(h + T_h)``: the default lease and removal interval."""
        return self.failure_threshold * (self.health_interval + self.health_timeout)

    def to_dict(self) -> dict[str, Any]:
        return {
            "health_interval_s": self.health_interval,
            "failure_threshold": self.failure_threshold,
            "health_timeout_s": self.health_timeout,
            "removal_quorum": self.removal_quorum,
            "removal_interval_s": self.removal_interval,
            "lease_s": self.lease,
            "budget": self.budget,
        }


#: Longest delivery delay or jitter a scenario may ask for.
MAX_NETWORK_DELAY = 60.0


@dataclass(frozen=True, slots=True)
class PartitionSpec:
    """One timed partition: ``[[network.partitions]]``, ``index`` its position there.

    Members of different ``groups`` cannot reach each other over
    ``[at, until)``; the router and every node no group lists form one more,
    implicit group. So every listed node is apart from the router: for the
    router, a member that stopped answering. Its probes fail and its lease
    runs out exactly as for a ``pause`` of the same length (the process runs
    on, but no request reaches it): see :meth:`Scenario.outage_events`.
    """

    index: int
    at: float
    until: float
    groups: tuple[tuple[str, ...], ...]

    @property
    def cut_off(self) -> tuple[str, ...]:
        """The nodes apart from the router (every listed one)."""
        return tuple(n for group in self.groups for n in group)

    def to_dict(self) -> dict[str, Any]:
        return {"at_s": self.at, "until_s": self.until, "groups": [list(g) for g in self.groups]}


@dataclass(frozen=True, slots=True)
class NetworkSpec:
    """The simulated network between the nodes (``simulations.network.SimNetwork``).

    ``delay`` (+ up to ``jitter``, drawn per message) is how long a handoff
    transfer or replica batch takes to land; ``loss`` the probability that
    one is lost (its sender learns it failed, as from a POST that failed
    after its retries). Draws are a hash of the seed and the message's
    sender, receiver, kind and send time, so they do not depend on which
    arrivals a mode decides (``--full`` gives the same report).
    """

    delay: float = 0.0
    jitter: float = 0.0
    loss: float = 0.0
    partitions: tuple[PartitionSpec, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "delay_s": self.delay,
            "jitter_s": self.jitter,
            "loss": self.loss,
            "partitions": [p.to_dict() for p in self.partitions],
        }


@dataclass(frozen=True, slots=True)
class ReportSpec:
    bucket: float
    window: float
    event_window: float
    event_bucket: float
    agreement_tolerance: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "bucket_s": self.bucket,
            "window_s": self.window,
            "event_window_s": self.event_window,
            "event_bucket_s": self.event_bucket,
            "agreement_tolerance": self.agreement_tolerance,
        }


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    description: str
    source: str
    seed: int
    duration: float
    clock_start: float
    nodes: tuple[NodeSpec, ...]
    users: UsersSpec
    arrivals: ArrivalSpec
    rules: tuple[Rule, ...]
    modes: tuple[str, ...]
    replication_interval: float
    handoff_crash_policy: str
    events: tuple[EventSpec, ...]
    report: ReportSpec
    returning: str = "hand_back"
    detection: DetectionSpec = field(default_factory=DetectionSpec)
    #: the ``[network]`` table (None: none given, an instant and lossless network)
    network: NetworkSpec | None = None
    #: what the reader decided on its own that the user should hear about (a
    #: ``lease = "auto"`` whose leases mode is left out): one line each on stderr
    notes: tuple[str, ...] = ()
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def end(self) -> float:
        return self.clock_start + self.duration

    @property
    def has_pauses(self) -> bool:
        return any(e.type == "pause" for e in self.events)

    def outage_events(self) -> tuple[EventSpec, ...]:
        """The events, and a ``pause`` for each node a partition cuts off from the router.

        The router's probes cannot tell the two apart, so failure detection
        and leases treat them alike. A partition's pause has the index
        ``-1 - k`` for ``network.partitions[k]`` (``source_event`` in the report).
        """
        if self.network is None or not self.network.partitions:
            return self.events
        return self.events + partition_pauses(self.network.partitions)

    def with_seed(self, seed: int) -> Scenario:
        return replace(self, seed=int(seed))

    def check_rounds(self) -> None:
        """ScenarioError if the modes to run make more replication rounds than the
        cap. Asked after ``--modes`` has chosen them: a run without ``replica``
        was refused for the replica mode's rounds (the review of the day's
        changes), ``--modes handoff`` as well as the default run."""
        if "replica" in self.modes:
            problem = replication_rounds_problem(
                self.replication_interval, self.duration, self.nodes, self.events
            )
            if problem:
                raise ScenarioError(f"mode replica: modes.replication_interval: {problem}")

    def with_modes(self, modes: tuple[str, ...]) -> Scenario:
        if "leases" in modes:
            problem = leases_problem(self.rules, self.has_pauses, self.network is not None)
            if problem:
                raise ScenarioError(f"mode leases: {problem}")
        # modes named by hand: what the scenario's own run left out is moot
        chosen = replace(self, modes=_order_modes(modes), notes=())
        chosen.check_rounds()
        return chosen

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "source": self.source,
            "seed": self.seed,
            "duration_s": self.duration,
            "clock_start": self.clock_start,
            "nodes": [n.to_dict() for n in self.nodes],
            "users": self.users.to_dict(),
            "arrivals": self.arrivals.to_dict(),
            "rules": [r.to_dict() for r in self.rules],
            "modes": list(self.modes),
            "replication_interval_s": self.replication_interval,
            "handoff_crash_policy": self.handoff_crash_policy,
            "returning": self.returning,
            "events": [e.to_dict() for e in self.events],
            "detection": self.detection.to_dict(),
            "report": self.report.to_dict(),
        } | ({} if self.network is None else {"network": self.network.to_dict()})


def partition_pauses(partitions: tuple[PartitionSpec, ...]) -> tuple[EventSpec, ...]:
    """The pauses the router sees: one per partition, of every node it cuts off."""
    return tuple(
        EventSpec(
            -1 - p.index, p.at, "pause", p.cut_off[0], nodes=p.cut_off, duration=p.until - p.at
        )
        for p in partitions
    )


def leases_problem(rules: tuple[Rule, ...], pauses: bool, network: bool = False) -> str | None:
    """Why the ``leases`` mode cannot run a scenario (``None``: it can).

    ``network``: the scenario has a ``[network]`` table, which the lease
    simulation does not run its messages through (nor its partitions, which
    are pauses for the router).
    """
    if len(rules) != 1:
        return "the lease simulation takes exactly one rule"
    if rules[0].algorithm == "sliding_log":
        return "the sliding log takes no leases (docs/hotkeys.md)"
    if pauses:
        return "the lease simulation does not model paused nodes"
    if network:
        return "the lease simulation does not model the [network] table"
    return None


def _rounds_problem(
    interval: float, duration: float, nodes: int, rounds: str, key: str
) -> str | None:
    """Why ``duration / interval`` rounds of up to ``nodes`` nodes are too many (None: not)."""
    count = duration / interval
    if count * nodes <= MAX_NODE_ROUNDS:
        return None
    return (
        f"{interval:g} s over scenario.duration {duration:g} s is {count:,.0f} {rounds} "
        f"of up to {nodes:,} nodes, {count * nodes:,.0f} rounds x nodes; at most "
        f"{MAX_NODE_ROUNDS:,} (each costs time): raise {key} or shorten scenario.duration"
    )


def replication_rounds_problem(
    interval: float,
    duration: float,
    nodes: tuple[NodeSpec, ...],
    events: tuple[EventSpec, ...] | list[EventSpec],
) -> str | None:
    """Why the ``replica`` mode's rounds are too many (None: they are not)."""
    members = len(nodes) + sum(e.type == "join" for e in events)
    return _rounds_problem(
        interval, duration, members, "replication rounds", "modes.replication_interval"
    )


def _order_modes(modes: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    wanted = set(modes) | {"global"}
    return tuple(m for m in MODES if m in wanted)


# --------------------------------------------------------------------------- reading


class _Reader:
    """Typed access to one table of the TOML document, with errors that name the key."""

    def __init__(self, source: str, prefix: str, data: Any) -> None:
        self.source = source
        self.prefix = prefix
        if not isinstance(data, Mapping):
            raise self.error("", f"must be a table, got {_kind(data)}")
        self.data = data

    def key(self, name: str) -> str:
        if not name:
            return self.prefix or "<top level>"
        return f"{self.prefix}.{name}" if self.prefix else name

    def error(self, name: str, problem: str) -> ScenarioError:
        return ScenarioError(f"{self.source}: {self.key(name)}: {problem}")

    def only(self, allowed: set[str] | frozenset[str]) -> None:
        unknown = sorted(set(self.data) - set(allowed))
        if unknown:
            raise self.error(
                unknown[0],
                f"unknown key (expected one of: {', '.join(sorted(allowed))})",
            )

    def has(self, name: str) -> bool:
        return name in self.data

    def sub(self, name: str, *, required: bool = True) -> _Reader:
        if name not in self.data:
            if required:
                raise self.error(name, "missing required table")
            return _Reader(self.source, self.key(name), {})
        return _Reader(self.source, self.key(name), self.data[name])

    def string(
        self, name: str, default: str | None = None, *, choices: tuple[str, ...] = ()
    ) -> str:
        value = self.data.get(name, default)
        if value is None:
            raise self.error(name, "missing required key")
        if not isinstance(value, str):
            raise self.error(name, f"must be a string, got {_kind(value)}")
        if choices and value not in choices:
            raise self.error(name, f"must be one of {', '.join(choices)}, got {value!r}")
        return value

    def integer(
        self,
        name: str,
        default: int | None = None,
        *,
        low: int | None = None,
        high: int | None = None,
    ) -> int:
        value = self.data.get(name, default)
        if value is None:
            raise self.error(name, "missing required key")
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(name, f"must be an integer, got {_kind(value)}")
        if low is not None and value < low:
            raise self.error(name, f"must be >= {low}, got {value}")
        if high is not None and value > high:
            raise self.error(name, f"must be <= {high}, got {value}")
        return value

    def number(
        self,
        name: str,
        default: float | None = None,
        *,
        low: float | None = None,
        high: float | None = None,
        low_open: bool = False,
    ) -> float:
        value = self.data.get(name, default)
        if value is None:
            raise self.error(name, "missing required key")
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(name, f"must be a number, got {_kind(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise self.error(name, f"must be finite, got {value}")
        if low is not None and (value <= low if low_open else value < low):
            raise self.error(name, f"must be {'>' if low_open else '>='} {low:g}, got {value:g}")
        if high is not None and value > high:
            raise self.error(name, f"must be <= {high:g}, got {value:g}")
        return value

    def boolean(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if not isinstance(value, bool):
            raise self.error(name, f"must be true or false, got {_kind(value)}")
        return value

    def duration(
        self, name: str, default: float | str | None = None, *, allow_zero: bool = False
    ) -> float:
        value = self.data.get(name, default)
        if value is None:
            raise self.error(name, "missing required key")
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            raise self.error(name, str(exc)) from None
        if seconds < 0 or (seconds == 0 and not allow_zero):
            raise self.error(name, f"must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
        return seconds


def _kind(value: object) -> str:
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, list):
        return "an array"
    return f"{type(value).__name__} {value!r}"


def parse_duration(value: object) -> float:
    """``"100ms"`` -> 0.1, ``"2s"`` -> 2.0, ``"5 min"`` -> 300.0, ``"1d"`` -> 86400.0;
    a bare number is seconds. The units are the cluster config's
    (:func:`node.rules.parse_duration`)."""
    if isinstance(value, bool):
        raise ValueError(
            f"a duration must be a number of seconds or a string like '2s', got {value!r}"
        )
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        # node.rules' reader: the units (ms, s, m, h, d and their words) the
        # cluster config's periods take, with the same meanings
        seconds = parse_unit_duration(
            value, examples="a number of seconds, '100ms', '2s', '5min', '1h', '1d'"
        )
    else:
        raise ValueError(
            f"a duration must be a number of seconds or a string like '2s', got {_kind(value)}"
        )
    if not math.isfinite(seconds):
        raise ValueError(f"duration {value!r} is not finite")
    return seconds


_TOP = frozenset(
    {
        "scenario",
        "cluster",
        "users",
        "arrivals",
        "rules",
        "modes",
        "events",
        "detection",
        "network",
        "report",
    }
)


def load_scenario(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Scenario:
    """Read and validate a scenario file; ``overrides``: ``TABLE.KEY=VALUE`` (TOML) each."""
    path = Path(path)
    try:
        data = parse_toml(read_text(path, "scenario file"), path)
    except FileProblem as exc:
        raise ScenarioError(str(exc)) from None
    for item in overrides:
        _override(data, item)
    return parse_scenario(data, source=str(path))


def _override(data: dict[str, Any], item: str) -> None:
    """Apply ``--set TABLE.KEY=VALUE``; the scenario is validated afterwards as usual."""
    target, sep, text = item.partition("=")
    table, dot, key = target.strip().partition(".")
    if not sep or not dot or not table or not key or "." in key:
        raise ScenarioError(
            f"--set {item!r}: expected TABLE.KEY=VALUE, e.g. detection.budget=false"
        )
    try:
        value = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()  # a bare word: a string (modes.returning=discard)
    section = data.setdefault(table, {})
    if not isinstance(section, dict):
        raise ScenarioError(f"--set {item!r}: {table} is not a table")
    section[key] = value


def parse_scenario(data: Mapping[str, Any], *, source: str = "<scenario>") -> Scenario:
    """Validate an already-decoded scenario document."""
    top = _Reader(source, "", data)
    top.only(_TOP)

    sc = top.sub("scenario")
    sc.only({"name", "description", "duration", "seed", "clock_start"})
    name = sc.string("name")
    description = sc.string("description", "")
    duration = sc.duration("duration")
    seed = sc.integer("seed", 0, low=0)
    clock_start = sc.number("clock_start", 0.0, low=0.0)

    nodes = _read_nodes(top.sub("cluster"))
    users = _read_users(top.sub("users"))
    arrivals = _read_arrivals(top.sub("arrivals"))
    if arrivals.rate * duration > MAX_ARRIVALS:
        raise top.sub("arrivals").error(
            "rate",
            f"{arrivals.rate:g}/s for {duration:g} s is {arrivals.rate * duration:,.0f} "
            f"arrivals; at most {MAX_ARRIVALS:,} (each costs memory in every mode): "
            "lower the rate or the duration",
        )
    rules = _read_rules(top)

    md = top.sub("modes", required=False)
    md.only({"run", "replication_interval", "handoff_crash_policy", "returning"})
    run = md.data.get("run")
    explicit = run is not None
    if run is None:
        run = list(DEFAULT_MODES)
    if not isinstance(run, list) or not all(isinstance(m, str) for m in run):
        raise md.error("run", f"must be an array of mode names, got {_kind(run)}")
    for i, mode in enumerate(run):
        if mode not in MODES:
            raise md.error(
                f"run[{i}]", f"unknown mode {mode!r}: expected one of {', '.join(MODES)}"
            )
    replication_interval = md.duration("replication_interval", "100ms")
    if not MIN_REPLICATION_INTERVAL <= replication_interval <= MAX_REPLICATION_INTERVAL:
        raise md.error(
            "replication_interval",
            f"must be between {MIN_REPLICATION_INTERVAL:g} and {MAX_REPLICATION_INTERVAL:g} s "
            f"(the cluster config's policies.replication_interval), got {replication_interval:g} s",
        )
    handoff_crash = md.string("handoff_crash_policy", "reset", choices=HANDOFF_CRASH_POLICIES)
    returning = md.string("returning", "hand_back", choices=RETURNING_POLICIES)

    detection = _read_detection(top.sub("detection", required=False))
    network = _read_network(top.sub("network"), duration) if top.has("network") else None
    _check_probe_rounds(top, detection, network, duration, len(nodes))
    events = _read_events(top, duration, nodes, detection, network)

    rp = top.sub("report", required=False)
    rp.only({"bucket", "window", "event_window", "event_bucket", "agreement_tolerance"})
    default_bucket = _nice_bucket(duration / 120)
    bucket = rp.duration("bucket", default_bucket)
    window = rp.duration("window", max(r.period for r in rules))
    event_window = rp.duration("event_window", min(duration / 4, 10 * bucket))
    event_bucket = rp.duration("event_bucket", event_window / 20)
    if event_bucket > event_window:
        raise rp.error("event_bucket", "must not exceed event_window")
    tolerance = rp.number("agreement_tolerance", 0.01, low=0.0, high=1.0)
    for key, value in (("bucket", bucket), ("event_bucket", event_bucket)):
        if duration / value > 100_000:
            raise rp.error(
                key, f"too fine: {duration / value:.0f} buckets over the run (max 100000)"
            )

    if "replica" in run and explicit:
        # (The default run is checked once --modes has had its say: Scenario.check_rounds.)
        problem = replication_rounds_problem(replication_interval, duration, nodes, events)
        if problem:
            raise md.error("replication_interval", problem)

    paused = any(e.type == "pause" for e in events)
    notes: list[str] = []
    if "leases" in run:
        problem = leases_problem(rules, paused, network is not None)
        if problem:
            raise md.error("run", f"mode leases: {problem}")
    elif not explicit and rules[0].lease == "auto":
        problem = leases_problem(rules, paused, network is not None)
        if problem is None:
            run = [*run, "leases"]
        else:  # the other modes still run: said, not an error (modes.run naming it is)
            notes.append(
                f"{source}: rules[0].lease = 'auto': the leases mode is left out: {problem}"
            )

    return Scenario(
        name=name,
        description=description,
        source=Path(source).name,
        seed=seed,
        duration=duration,
        clock_start=clock_start,
        nodes=nodes,
        users=users,
        arrivals=arrivals,
        rules=rules,
        modes=_order_modes(run),
        replication_interval=replication_interval,
        handoff_crash_policy=handoff_crash,
        events=events,
        report=ReportSpec(bucket, window, event_window, event_bucket, tolerance),
        returning=returning,
        detection=detection,
        network=network,
        notes=tuple(notes),
        raw=data,
    )


def _nice_bucket(seconds: float) -> float:
    """Round a bucket length to 1, 2 or 5 times a power of ten."""
    if seconds <= 0:
        return 1.0
    exp = math.floor(math.log10(seconds))
    for mult in (1, 2, 5, 10):
        value = mult * 10.0**exp
        if value >= seconds:
            return float(f"{value:.6g}")
    return float(f"{10.0 ** (exp + 1):.6g}")


def _check_id(reader: _Reader, key: str, value: object) -> str:
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise reader.error(
            key, f"node id must be 1-64 letters, digits or _.:- characters, got {_kind(value)}"
        )
    return value


def _read_nodes(cl: _Reader) -> tuple[NodeSpec, ...]:
    cl.only({"nodes", "weights"})
    raw = cl.data.get("nodes")
    if raw is None:
        raise cl.error("nodes", "missing required key (a node count or an array of node ids)")
    if isinstance(raw, int) and not isinstance(raw, bool):
        if not 1 <= raw <= MAX_NODES:
            raise cl.error("nodes", f"must be 1..{MAX_NODES} nodes, got {raw}")
        ids = [f"n{i}" for i in range(1, raw + 1)]
    elif isinstance(raw, list):
        if not raw:
            raise cl.error("nodes", "must name at least one node")
        if len(raw) > MAX_NODES:
            raise cl.error("nodes", f"at most {MAX_NODES} nodes")
        ids = [_check_id(cl, f"nodes[{i}]", v) for i, v in enumerate(raw)]
        seen: set[str] = set()
        for i, node_id in enumerate(ids):
            if node_id in seen:
                raise cl.error(f"nodes[{i}]", f"duplicate node id {node_id!r}")
            seen.add(node_id)
    else:
        raise cl.error("nodes", f"must be a node count or an array of node ids, got {_kind(raw)}")
    weights = cl.sub("weights", required=False)
    for node_id in weights.data:
        if node_id not in ids:
            raise weights.error(node_id, "no such node in cluster.nodes")
    return tuple(
        NodeSpec(node_id, weights.integer(node_id, 1, low=1, high=1000)) for node_id in ids
    )


def _read_users(us: _Reader) -> UsersSpec:
    us.only({"count", "popularity", "exponent", "hot_users", "hot_share"})
    count = us.integer("count", low=1, high=MAX_USERS)
    popularity = us.string("popularity", "zipf", choices=POPULARITIES)
    if popularity == "uniform" and us.has("exponent"):
        raise us.error("exponent", "only applies to popularity = 'zipf'")
    exponent = us.number("exponent", 1.0, low=0.0, high=10.0)
    hot_users = us.integer("hot_users", 0, low=0, high=count)
    hot_share = us.number("hot_share", 0.0, low=0.0, high=1.0)
    if hot_share > 0 and hot_users == 0:
        raise us.error("hot_users", "must be >= 1 when hot_share > 0")
    if hot_users > 0 and not us.has("hot_share"):
        raise us.error("hot_share", "missing: the share of all requests the hot users send")
    return UsersSpec(count, popularity, exponent, hot_users, hot_share)


def _read_arrivals(ar: _Reader) -> ArrivalSpec:
    ar.only({"rate", "process", "burst_factor", "burst_fraction", "burst_duration", "cost"})
    rate = ar.number("rate", low=0.0, low_open=True, high=1e8)
    process = ar.string("process", "poisson", choices=PROCESSES)
    if process == "poisson":
        for key in ("burst_factor", "burst_fraction", "burst_duration"):
            if ar.has(key):
                raise ar.error(key, "only applies to process = 'bursty'")
    factor = ar.number("burst_factor", 10.0, low=1.0)
    fraction = ar.number("burst_fraction", 0.1, low=0.0, high=1.0, low_open=True)
    if fraction >= 1.0:
        raise ar.error("burst_fraction", "must be below 1 (some time must be calm)")
    burst_duration = ar.duration("burst_duration", 2.0)
    cost = ar.integer("cost", 1, low=1, high=1_000_000)
    return ArrivalSpec(rate, process, factor, fraction, burst_duration, cost)


def _read_rules(top: _Reader) -> tuple[Rule, ...]:
    raw = top.data.get("rules")
    if raw is None:
        raise top.error("rules", "missing: at least one [[rules]] table")
    if not isinstance(raw, list) or not raw:
        raise top.error("rules", f"must be one or more [[rules]] tables, got {_kind(raw)}")
    rules: list[Rule] = []
    for i, item in enumerate(raw):
        rd = _Reader(top.source, f"rules[{i}]", item)
        rd.only({"limit", "algorithm", "burst", "name", "on_error", "lease"})
        text = rd.string("limit")
        algorithm = rd.string("algorithm", "token_bucket")
        burst = rd.integer("burst", 0, low=0) or None
        name = rd.string("name", "") or None
        on_error = rd.string("on_error", "open", choices=ON_ERROR)
        try:
            rule = parse_rule(text, name=name, algorithm=algorithm, burst=burst, on_error=on_error)
            rule = rule.with_(lease=rd.string("lease", "off"))
        except RuleError as exc:
            key = (
                "lease"
                if "lease" in str(exc)
                else "algorithm"
                if "algorithm" in str(exc)
                else "limit"
            )
            raise rd.error(key, str(exc)) from None
        if any(r.name == rule.name for r in rules):
            raise rd.error("name", f"duplicate rule name {rule.name!r}; give each rule a name")
        rules.append(rule)
    return tuple(rules)


def _read_detection(dt: _Reader) -> DetectionSpec:
    dt.only(
        {
            "health_interval",
            "failure_threshold",
            "health_timeout",
            "removal_quorum",
            "removal_interval",
            "lease",
            "budget",
        }
    )
    h = dt.duration("health_interval", 1.0)
    f = dt.integer("failure_threshold", 3, low=1, high=1000)
    timeout = dt.duration("health_timeout", 0.5)
    quorum = dt.number("removal_quorum", 0.5, low=0.0, high=0.99)
    detection = f * (h + timeout)
    interval = dt.duration("removal_interval", detection, allow_zero=True)
    lease = dt.duration("lease", detection)
    if lease > MAX_LEASE:
        raise dt.error("lease", f"must be <= {MAX_LEASE:g}s (the node refuses longer grants)")
    budget = dt.boolean("budget", True)
    return DetectionSpec(h, f, timeout, quorum, interval, lease, budget)


def _read_network(nw: _Reader, duration: float) -> NetworkSpec:
    nw.only({"delay", "jitter", "loss", "partitions"})
    delay = nw.duration("delay", 0.0, allow_zero=True)
    jitter = nw.duration("jitter", 0.0, allow_zero=True)
    for key, value in (("delay", delay), ("jitter", jitter)):
        if value > MAX_NETWORK_DELAY:
            raise nw.error(key, f"must be <= {MAX_NETWORK_DELAY:g}s, got {value:g}s")
    loss = nw.number("loss", 0.0, low=0.0, high=1.0)
    raw = nw.data.get("partitions", [])
    if not isinstance(raw, list):
        raise nw.error(
            "partitions", f"must be an array of [[network.partitions]] tables, got {_kind(raw)}"
        )
    partitions: list[PartitionSpec] = []
    for k, item in enumerate(raw):
        pt = _Reader(nw.source, f"network.partitions[{k}]", item)
        pt.only({"at", "until", "groups"})
        at = pt.duration("at", allow_zero=True)
        if at >= duration:
            raise pt.error("at", f"must be before the end of the run ({duration:g}s), got {at:g}s")
        until = pt.duration("until")
        if until <= at:
            raise pt.error("until", f"must be after at ({at:g}s), got {until:g}s")
        groups_raw = pt.data.get("groups")
        if not isinstance(groups_raw, list) or not groups_raw:
            raise pt.error(
                "groups",
                "must be a non-empty array of arrays of node ids, e.g. [['n3']] "
                f"(the router and the unlisted nodes are the other side), got {_kind(groups_raw)}",
            )
        seen: set[str] = set()
        groups: list[tuple[str, ...]] = []
        for g, group in enumerate(groups_raw):
            if not isinstance(group, list) or not group:
                raise pt.error(
                    f"groups[{g}]", f"must be a non-empty array of node ids, got {_kind(group)}"
                )
            ids = []
            for j, value in enumerate(group):
                if value == "router":
                    raise pt.error(
                        f"groups[{g}][{j}]",
                        "the router is always with the nodes no group lists: do not name it",
                    )
                node_id = _check_id(pt, f"groups[{g}][{j}]", value)
                if node_id in seen:
                    raise pt.error(f"groups[{g}][{j}]", f"{node_id!r} is in two groups")
                seen.add(node_id)
                ids.append(node_id)
            groups.append(tuple(ids))
        for earlier in partitions:
            if at < earlier.until and earlier.at < until:
                raise pt.error(
                    "at",
                    f"overlaps network.partitions[{earlier.index}] "
                    f"({earlier.at:g}s-{earlier.until:g}s): one partition at a time",
                )
        partitions.append(PartitionSpec(k, at, until, tuple(groups)))
    return NetworkSpec(delay, jitter, loss, tuple(partitions))


def _check_probe_rounds(
    top: _Reader,
    detection: DetectionSpec,
    network: NetworkSpec | None,
    duration: float,
    nodes: int,
) -> None:
    """Refuse more probe rounds than :data:`MAX_NODE_ROUNDS` before the replay runs them.

    The replay (:func:`simulations.detection.detect`, run while the events are
    read) makes at most ``duration / health_interval`` rounds, and only with
    pauses or partitions. Each event may add one member.
    """
    raw = top.data.get("events", [])
    raw = raw if isinstance(raw, list) else []
    pauses = any(isinstance(e, Mapping) and e.get("type") == "pause" for e in raw)
    if not pauses and (network is None or not network.partitions):
        return
    problem = _rounds_problem(
        detection.health_interval,
        duration,
        nodes + len(raw),
        "probe rounds",
        "detection.health_interval",
    )
    if problem:
        raise top.sub("detection", required=False).error("health_interval", problem)


def _read_events(
    top: _Reader,
    duration: float,
    nodes: tuple[NodeSpec, ...],
    detection: DetectionSpec,
    network: NetworkSpec | None = None,
) -> tuple[EventSpec, ...]:
    raw = top.data.get("events", [])
    if not isinstance(raw, list):
        raise top.error("events", f"must be an array of [[events]] tables, got {_kind(raw)}")
    events: list[EventSpec] = []
    for i, item in enumerate(raw):
        ev = _Reader(top.source, f"events[{i}]", item)
        kind = ev.string("type", choices=EVENT_TYPES)
        if kind == "pause":
            events.append(_read_pause(ev, i, duration))
            continue
        allowed = {"at", "type", "node"}
        if kind == "join":
            allowed |= {"weight"}
        if kind == "restart":
            allowed |= {"graceful", "downtime", "weight"}
        ev.only(allowed)
        at = ev.duration("at", allow_zero=True)
        if at >= duration:
            raise ev.error("at", f"must be before the end of the run ({duration:g}s), got {at:g}s")
        node = _check_id(ev, "node", ev.data.get("node"))
        # a join defaults to weight 1; a restart keeps the node's weight unless it names one
        weight = (
            ev.integer("weight", 1 if kind == "join" else 0, low=1, high=1000)
            if ev.has("weight") or kind == "join"
            else 0
        )
        graceful = ev.boolean("graceful", True)
        downtime = ev.duration("downtime", 0.0, allow_zero=True)
        if kind == "restart" and at + downtime >= duration:
            raise ev.error(
                "downtime", f"the node would rejoin at {at + downtime:g}s, after the run ends"
            )
        events.append(EventSpec(i, at, kind, node, weight, graceful, downtime))
    cuts = () if network is None else partition_pauses(network.partitions)
    _check_membership(top, [*events, *cuts], nodes, detection, duration)
    return tuple(events)


def _read_pause(ev: _Reader, index: int, duration: float) -> EventSpec:
    ev.only({"at", "type", "node", "nodes", "duration"})
    at = ev.duration("at", allow_zero=True)
    if at >= duration:
        raise ev.error("at", f"must be before the end of the run ({duration:g}s), got {at:g}s")
    if ev.has("node") == ev.has("nodes"):
        raise ev.error("nodes", "a pause names either node = 'id' or nodes = ['id', ...]")
    if ev.has("node"):
        ids = [_check_id(ev, "node", ev.data["node"])]
    else:
        raw = ev.data["nodes"]
        if not isinstance(raw, list) or not raw:
            raise ev.error("nodes", f"must be a non-empty array of node ids, got {_kind(raw)}")
        ids = [_check_id(ev, f"nodes[{j}]", v) for j, v in enumerate(raw)]
        for j, node_id in enumerate(ids):
            if node_id in ids[:j]:
                raise ev.error(f"nodes[{j}]", f"duplicate node id {node_id!r}")
    length = ev.duration("duration")
    return EventSpec(index, at, "pause", ids[0], nodes=tuple(ids), duration=length)


def _check_membership(
    top: _Reader,
    events: list[EventSpec],
    nodes: tuple[NodeSpec, ...],
    detection: DetectionSpec,
    duration: float,
) -> None:
    """Replay the membership changes: joins must be new, removals must be members,
    a paused node must be a member when its pause starts and not be paused already."""
    weights = {n.id: n.weight for n in nodes}
    try:
        changes = expand_events(events, weights, detection, duration)
    except PauseError as exc:
        if exc.source < 0:  # a partition's pause (Scenario.outage_events)
            where = f"network.partitions[{-1 - exc.source}]"
            raise _Reader(top.source, where, {}).error("groups", str(exc)) from None
        raise _Reader(top.source, f"events[{exc.source}]", {}).error("nodes", str(exc)) from None
    members = {n.id for n in nodes}
    for change in changes:
        ev = _Reader(top.source, f"events[{change.source}]", {})
        if change.kind == "join":
            if change.node in members:
                what = "rejoins" if change.restart or change.cause == "return" else "joins"
                raise ev.error(
                    "node", f"{change.node!r} {what} at {change.at:g}s but is already a member"
                )
            members.add(change.node)
        else:
            if change.node not in members:
                raise ev.error(
                    "node",
                    f"{change.node!r} is not a member at {change.at:g}s (nothing to {change.kind})",
                )
            if len(members) == 1 and change.cause == "event":
                raise ev.error(
                    "node", f"removing {change.node!r} at {change.at:g}s would leave the ring empty"
                )
            members.remove(change.node)


class PauseError(ValueError):
    """A pause that cannot happen (its node is not a member then, or already paused)."""

    def __init__(self, source: int, message: str) -> None:
        super().__init__(message)
        self.source = source


@dataclass(frozen=True, slots=True)
class Change:
    """One membership change on the ring, after expanding restarts and pauses.

    ``kind`` is ``join``, ``leave`` (graceful) or ``crash``. A restart is a
    leave (or a crash when ``graceful = false``) followed, ``downtime`` later,
    by a join of the same id with empty state. ``cause`` says who made it:
    ``event`` (the scenario's own event), ``probe`` (the router's failure
    detection removed a paused member, see :mod:`simulations.detection`) or
    ``return`` (such a member rejoins when it answers again, after handing
    back or discarding what it held, per ``modes.returning``).
    """

    at: float
    kind: str
    node: str
    weight: int
    source: int
    restart: bool
    cause: str = "event"


def expand_events(
    events: list[EventSpec] | tuple[EventSpec, ...],
    weights: dict[str, int],
    detection: DetectionSpec | None = None,
    duration: float = math.inf,
) -> list[Change]:
    """Membership changes in time order (file order breaks ties).

    With ``pause`` events, the router's probe rounds are replayed (through the
    real removal budget) to find which paused members it removes and when
    they return: :func:`simulations.detection.detect`.
    """
    return expand_with_detection(events, weights, detection, duration)[0]


def expand_with_detection(
    events: list[EventSpec] | tuple[EventSpec, ...],
    weights: dict[str, int],
    detection: DetectionSpec | None = None,
    duration: float = math.inf,
) -> tuple[list[Change], Detection | None]:
    """:func:`expand_events`, and what the probes did (None without pauses)."""
    scheduled = _scheduled(events)
    pauses = [ev for ev in events if ev.type == "pause"]
    if not pauses:
        return _with_weights(scheduled, weights), None
    from .detection import detect

    found = detect(weights, scheduled, pauses, detection or DetectionSpec(), duration)
    found.changes = _with_weights(found.changes, weights)
    return found.changes, found


def _scheduled(events: list[EventSpec] | tuple[EventSpec, ...]) -> list[Change]:
    """The events' own membership changes, time-sorted (file order breaks ties)."""
    staged: list[tuple[float, int, Change]] = []
    order = 0
    for ev in events:
        if ev.type == "join":
            change = Change(ev.at, "join", ev.node, ev.weight or 1, ev.index, False)
            staged.append((ev.at, order, change))
        elif ev.type in ("leave", "crash"):
            staged.append((ev.at, order, Change(ev.at, ev.type, ev.node, 0, ev.index, False)))
        elif ev.type == "restart":
            kind = "leave" if ev.graceful else "crash"
            staged.append((ev.at, order, Change(ev.at, kind, ev.node, 0, ev.index, True)))
            order += 1
            back = ev.at + ev.downtime
            staged.append((back, order, Change(back, "join", ev.node, ev.weight, ev.index, True)))
        order += 1
    staged.sort(key=lambda item: (item[0], item[1]))
    return [change for _, _, change in staged]


def _with_weights(changes: list[Change], weights: dict[str, int]) -> list[Change]:
    """A joining node's weight comes from its join event; a restarted or returning
    node keeps its weight unless the restart names a new one."""
    weights = dict(weights)
    out: list[Change] = []
    for change in changes:
        if change.kind == "join":
            weight = change.weight or weights.get(change.node, 1)
            weights[change.node] = weight
            change = replace(change, weight=weight)
        else:
            change = replace(change, weight=weights.get(change.node, 1))
        out.append(change)
    return out
