"""The ``ringlimit`` command.

    ringlimit up        a router and N in-memory nodes on 127.0.0.1 (the quick start)
    ringlimit router    one router (multi-host use)
    ringlimit node      one node (multi-host use; --join registers it with a router)
    ringlimit nodes     list, add and remove nodes through a router's admin API
    ringlimit rules     show the cluster's rules, or apply a file's (no restart)
    ringlimit config    show the cluster's whole config, or apply a file's (no restart)
    ringlimit simulate  rebalancing simulations on a virtual clock
    ringlimit bench     the side-by-side benchmark

Secrets (admin and internal tokens) are best given through the environment
(``RINGLIMIT_ADMIN_TOKEN``, ``RINGLIMIT_INTERNAL_TOKEN``) so they do not show in
process lists; they are never logged.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import socket
import sys
import urllib.parse
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from node.config import (
    BACKENDS,
    BALANCES,
    HIDDEN_SALT,
    MAX_REDIS_TIMEOUT,
    MIN_REDIS_TIMEOUT,
    REBALANCE_POLICIES,
    REDIS_TIMEOUT,
    UPSTREAM_IDLE,
    UPSTREAM_TIMEOUT,
    ClusterConfig,
    ConfigError,
    Policies,
    ScopedRule,
    config_of,
    load_config,
    load_config_data,
)
from node.files import reader_gone
from node.frontdoor import (
    GRPC_DRAIN,
    KEEP_ALIVE,
    MIN_BODY_RATE,
    RESERVED_FDS,
    REUSE_IDLE,
    FrontDoor,
)
from node.lease import MAX_LEASE
from node.peers import excerpt, one_line
from node.rules import ALGORITHMS, CRASH_POLICIES, RuleError, parse_rule
from ring import Member
from ring.errors import given
from ring.member import check_id, check_url, check_weight
from ring.view import MAX_MEMBERS
from router import __version__
from router.restart import RESTART_MODES
from router.revival import FORGET_AFTER

if TYPE_CHECKING:
    import httpx

    from node.asgi import ASGIApp
    from node.backend import Backend
    from router.app import RouterSettings
    from router.coordinator import EtcdCoordinator
    from router.viewlog import MembershipError

DEFAULT_RULE = "10/minute"


class CommandError(Exception):
    """An expected failure (something unreachable, a port taken): one line, no traceback."""


#: Subcommands imported only when they run (numpy and friends are slow to load).
LAZY_COMMANDS = {"simulate": "simulations.cli", "bench": "benchmarks.bench"}
#: What to install when an optional dependency of a command is missing.
EXTRAS = {"simulate": "sim", "bench": "bench"}
#: The modules each of those extras provides: a command whose import fails for want
#: of one of them names its extra; any other ImportError is a bug, and is raised.
EXTRA_MODULES = {"simulate": frozenset({"matplotlib"}), "bench": frozenset({"limits", "slowapi"})}


#: Where ``nodes`` and ``rules`` find the router unless told.
ROUTER_URL = "http://127.0.0.1:8000"
ROUTER_HELP = f"the router's URL (default {ROUTER_URL})"
WEIGHT_HELP = "the node's share of the ring relative to the others', 1 to 1000 (default 1)"
VERBOSE_HELP = "log at INFO level (default: warnings only)"
#: ``--redis-url`` without the flag or ``RINGLIMIT_REDIS_URL``.
REDIS_URL = "redis://127.0.0.1:6379/0"


def _unix_sockets_argument(parser: argparse.ArgumentParser, *, up: bool) -> None:
    parser.add_argument(
        "--no-unix-sockets",
        action="store_true",
        help=(
            "give the nodes no Unix socket: the router reaches them over TCP"
            if up
            else "forward over TCP even to a node on this host that offers a Unix socket "
            "(by default the router forwards through it once it answers as that node)"
        ),
    )


def _pipeline_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pipeline",
        type=_pipeline_depth,
        default=1,
        metavar="N",
        help="send up to N requests for one node made at the same moment on one connection, "
        "in one write (HTTP/1.1 pipelining: fewer system calls on router and node, but a "
        "request may wait behind a slower one); for applications that answer quickly and "
        "evenly (default 1: off)",
    )


#: The highest TCP port.
MAX_PORT = 65535


def _port(lowest: int) -> Callable[[str], int]:
    """An argparse type: a TCP port from ``lowest`` (0 where the system may choose
    one, or where 0 means "the default") to 65535. Checked here, any integer was
    taken and socket.bind's OverflowError came out as a traceback."""

    def port(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = -1
        if not lowest <= number <= MAX_PORT:
            raise argparse.ArgumentTypeError(
                f"must be a port from {lowest} to {MAX_PORT}, got {given(value)}"
            )
        return number

    return port


def _join_timeout(value: str) -> float:
    """``--join-timeout``: seconds above 0, at most a day. 0 and negative ones
    gave up at once, NaN never (its deadline comparison is always false)."""
    from node.server import MAX_JOIN_TIMEOUT

    try:
        seconds = float(value)
    except ValueError:
        seconds = math.nan
    if not 0 < seconds <= MAX_JOIN_TIMEOUT:
        raise argparse.ArgumentTypeError(
            f"must be seconds above 0 and at most {MAX_JOIN_TIMEOUT:g}, got {given(value)}"
        )
    return seconds


def _pipeline_depth(value: str) -> int:
    """``--pipeline``: a whole number from 1 (off) to 64."""
    try:
        depth = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {value!r}") from None
    if not 1 <= depth <= 64:
        raise argparse.ArgumentTypeError("must be from 1 (off) to 64")
    return depth


def _coordinator_ttl(value: str) -> int:
    """``--coordinator-ttl``: whole seconds from 2 to 3600 (router/coordinator.py
    ``lease_ttl``), refused at parse time rather than rounded without a word."""
    from router.coordinator import lease_ttl

    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {value!r}") from None
    try:
        return lease_ttl(seconds)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _configure_logging(verbose: bool) -> None:
    """WARNING, or INFO with ``-v``; each line names the worker that wrote it
    under ``router --workers`` (``w1``). httpx's line per request stays out:
    with ``-v`` a follower's poll of its leader and the lease renewals wrote
    about 500 lines a minute, and the membership events drowned in them (an
    exploratory tester)."""
    from router.workers import worker_role

    role = worker_role()
    tag = f"{role.name} " if role is not None else ""
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format=f"%(asctime)s {tag}%(name)s %(levelname)s %(message)s",
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv[0] if argv else None)
    args = parser.parse_args(argv)
    args.argv = argv  # ``router --workers N`` starts N copies of this command
    _configure_logging(getattr(args, "verbose", False))
    if not hasattr(args, "run"):
        parser.print_help()
        return 2
    if getattr(args, "coordinator", None):
        # gRPC's core logs lines of its own on stderr (a failed TLS handshake to
        # etcd is several); the router says what failed in one. Set before gRPC
        # is first imported, which reads it; GRPC_VERBOSITY in the environment wins.
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    try:
        code = int(args.run(args) or 0)
        sys.stdout.flush()  # here, not at exit, where a reader gone is a traceback again
        return code
    except (ConfigError, RuleError, ValueError) as exc:
        print(f"ringlimit: error: {exc}", file=sys.stderr)
        return 2
    except CommandError as exc:
        print(f"ringlimit: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``ringlimit rules | head``): as other commands
        # take it, quietly.
        return reader_gone()


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (what was wrong, where to read
    more) rather than the whole usage first: a bad argument is one line, as every
    other failure of the command is. Subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        one_line = " ".join(message.split())
        self.exit(2, f"{self.prog}: error: {one_line} (see {self.prog} --help)\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; ``command`` is the subcommand about to run, so that the heavy
    ones (simulate, bench) are imported only when they are used."""
    parser = _Parser(
        prog="ringlimit",
        description="A rate-limiting cluster: sticky routing to in-memory limiter nodes.",
    )
    parser.add_argument("--version", action="version", version=f"ringlimit {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    up = commands.add_parser("up", help="start a router and N nodes on 127.0.0.1")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--port", type=_port(1), default=8000, help="router port (default 8000)")
    up.add_argument(
        "--node-port", type=_port(0), default=0, help="first node port (default: router port + 1)"
    )
    _config_arguments(up)
    _envoy_arguments(up)
    _fronting_arguments(up)
    _proxy_arguments(up)
    _backend_arguments(up)
    up.add_argument("--state-file", help="where the router keeps its ring (default: none)")
    _pipeline_argument(up)
    _unix_sockets_argument(up, up=True)
    up.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="router processes on the router port (SO_REUSEPORT), one membership: passed to "
        "`ringlimit router --workers` (default 1)",
    )
    up.add_argument(
        "--restart",
        choices=RESTART_MODES,
        default="always",
        help="which nodes that exit are restarted under the same id and port: always (default: "
        "crashed ones and ones that left gracefully, as in a rolling restart), on-crash, never",
    )
    up.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        metavar="N",
        help="restart a node at most N times per 60 s (with a doubling backoff); past that it "
        "stays down and the cluster serves without it (default 5)",
    )
    up.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    up.set_defaults(run=_run_up)

    router = commands.add_parser("router", help="start one router")
    router.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1; 0.0.0.0 for every interface: "
        "then set RINGLIMIT_ADMIN_TOKEN and RINGLIMIT_INTERNAL_TOKEN)",
    )
    router.add_argument(
        "--port", type=_port(0), default=8000, help="default 8000; 0: any free port"
    )
    router.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="ID=URL",
        help="a seed node (repeatable); nodes may also join later (ringlimit node --join)",
    )
    router.add_argument("--state-file", help="ring state kept across router restarts")
    router.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="N router processes on this port (SO_REUSEPORT), one membership: worker 0 leads "
        "(or etcd elects one, with --coordinator); a worker that exits is restarted "
        "(default 1)",
    )
    router.add_argument(
        "--worker-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --workers: a worker that served and then echoes none of the supervisor's "
        "pings (twice a second) for this long is paused or hung; it is killed and started "
        "again (default 5; 0: never; else at least 2)",
    )
    router.add_argument(
        "--health-interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="pause between rounds of health probes of the nodes (default 1)",
    )
    router.add_argument(
        "--failure-threshold",
        type=int,
        default=3,
        metavar="N",
        help="failed probes in a row before a node is due for removal (default 3)",
    )
    router.add_argument(
        "--health-timeout",
        type=float,
        default=0.5,
        metavar="SECONDS",
        help="one health probe's timeout (default 0.5)",
    )
    _proxy_arguments(router)
    router.add_argument(
        "--lease",
        type=float,
        default=None,
        metavar="SECONDS",
        help="lease granted to nodes per health probe; a node decides only while its lease "
        "runs, and is removed only after it ended (default: the detection time, "
        "failure-threshold x (health-interval + health-timeout); with --coordinator, at "
        "least what a take-over needs: the ttl + 1.5 s + a probe round)",
    )
    router.add_argument(
        "--removal-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="remove at most one member per this many seconds on health checks alone "
        "(default: the detection time)",
    )
    router.add_argument(
        "--removal-quorum",
        type=float,
        default=0.5,
        metavar="FRACTION",
        help="remove members on health checks only while more than this fraction of the ring "
        "answers, and never below it (default 0.5: a majority)",
    )
    router.add_argument(
        "--forget-removed-after",
        type=float,
        default=FORGET_AFTER,
        metavar="SECONDS",
        help="stop probing a member removed as crashed this long after its removal; it comes "
        "back only by registering again (--join) after that (default 3600; probes back off "
        "from a minute after the removal)",
    )
    _pipeline_argument(router)
    _unix_sockets_argument(router, up=False)
    router.add_argument(
        "--coalesce-window",
        type=float,
        default=300.0,
        metavar="MICROSECONDS",
        help="hold single decision-API checks up to this long to batch them per node "
        "(default 300; 0 turns coalescing off; uvloop counts whole milliseconds: at "
        "500 or less the window is the event loop's current pass; docs/envoy.md)",
    )
    router.add_argument(
        "--coordinator",
        default=os.environ.get("RINGLIMIT_COORDINATOR"),
        metavar="etcd[s]://HOST:PORT[,HOST:PORT...]",
        help="keep the ring in etcd, shared by every router of the cluster; one router leads "
        "(changes, health checks, leases) and the others follow (also RINGLIMIT_COORDINATOR)",
    )
    etcd = router.add_argument_group(
        "etcd's TLS and auth",
        "for a coordinator written etcds:// (TLS) and an etcd with auth enabled; the "
        "password only from RINGLIMIT_ETCD_PASSWORD, never a flag (docs/configuration.md)",
    )
    for flag, what in (
        ("cacert", "the CA that signed etcd's certificate (default: the system's roots)"),
        ("cert", "this router's client certificate, for an etcd with --client-cert-auth"),
        ("key", "the private key of --etcd-cert"),
    ):
        variable = f"RINGLIMIT_ETCD_{flag.upper()}"
        etcd.add_argument(
            f"--etcd-{flag}",
            default=os.environ.get(variable),
            metavar="PEM",
            help=f"{what} (also {variable})",
        )
    etcd.add_argument(
        "--etcd-user",
        default=os.environ.get("RINGLIMIT_ETCD_USER"),
        metavar="NAME",
        help="etcd's user, with RINGLIMIT_ETCD_PASSWORD (also RINGLIMIT_ETCD_USER)",
    )
    router.add_argument(
        "--cluster",
        default="default",
        help="the cluster's name: its key prefix in etcd (default 'default')",
    )
    router.add_argument(
        "--advertise",
        metavar="URL",
        help="this router's URL as the other routers reach it (admin calls go to the leader "
        "there; default http://HOST:PORT)",
    )
    router.add_argument(
        "--coordinator-ttl",
        type=_coordinator_ttl,
        default=2,
        metavar="SECONDS",
        help="the leader's etcd lease, whole seconds from 2 to 3600: another router takes over "
        "about this long after it is lost (default 2; the nodes' default lease grows to "
        "outlast a take-over: ttl + 1.5 s + a probe round)",
    )
    router.add_argument(
        "--no-health-checks",
        action="store_true",
        help="do not remove unresponsive nodes from this router (run health checks on one "
        "router of a cluster: the one that takes admin changes)",
    )
    _config_arguments(router)
    _envoy_arguments(router)
    _backend_arguments(router, connects=False)
    _front_door_arguments(router)
    router.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    router.set_defaults(run=_run_router)

    node = commands.add_parser("node", help="start one node")
    node.add_argument("--id", required=True, help="node id (stable across restarts)")
    node.add_argument(
        "--host",
        default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1; 0.0.0.0 for every interface: "
        "then set RINGLIMIT_INTERNAL_TOKEN)",
    )
    node.add_argument("--port", type=_port(1), required=True, help="the port to listen on")
    node.add_argument(
        "--join",
        metavar="ROUTER_URL[,ROUTER_URL...]",
        help="register with this router; with several (the routers of one cluster on etcd), "
        "the join and the graceful leave on SIGTERM try each in turn (from the one that "
        "answered last; one that never answers holds half the time left), so either works "
        "while one router is down or paused",
    )
    node.add_argument(
        "--join-timeout",
        type=_join_timeout,
        default=120.0,
        metavar="SECONDS",
        help="give up joining (and exit 1) after this long (default 120, at most 86400)",
    )
    node.add_argument("--url", help="the URL the router should use (default http://HOST:PORT)")
    node.add_argument("--weight", type=int, default=1, help=WEIGHT_HELP)
    node.add_argument(
        "--unix-socket",
        metavar="PATH",
        help="listen on this Unix socket too: a router on this host forwards through it "
        "rather than TCP, once it has checked the socket answers as this node "
        "(docs/configuration.md)",
    )
    node.add_argument("--max-keys", type=int, help="cap on states held (see docs)")
    node.add_argument(
        "--fenced",
        action="store_true",
        help="refuse every key until a router sends a ring view (implied by --join)",
    )
    _config_arguments(node)
    _fronting_arguments(node)
    _backend_arguments(node)
    _front_door_arguments(node)
    node.add_argument("-v", "--verbose", action="store_true", help=VERBOSE_HELP)
    node.set_defaults(run=_run_node)

    nodes = commands.add_parser("nodes", help="list, add or remove nodes through a router")
    nodes.add_argument(
        "action",
        choices=["list", "add", "remove"],
        help="list the ring, add a node (ID URL) or remove one (ID: a graceful leave)",
    )
    nodes.add_argument("node_id", nargs="?", help="node id (add, remove)")
    nodes.add_argument("node_url", nargs="?", help="node URL (add)")
    nodes.add_argument("--router", default=ROUTER_URL, help=ROUTER_HELP)
    nodes.add_argument("--weight", type=int, default=1, help=f"add: {WEIGHT_HELP}")
    nodes.add_argument(
        "--force",
        action="store_true",
        help="remove: remove the ring's last node too (every request then gets 503 no_nodes)",
    )
    _admin_timeout_argument(nodes)
    nodes.set_defaults(run=_run_nodes)

    _show_or_apply(
        commands,
        "rules",
        "show the cluster's rules, or make a config file's [[rules]] the cluster's "
        "(no restart; docs/configuration.md)",
        "a config file (TOML or JSON) whose [[rules]] replace the cluster's; "
        "without it (or with 'list' or 'show', as `nodes list`), the rules are shown "
        "(a file of that name: ./list)",
        _run_rules,
    )
    _show_or_apply(
        commands,
        "config",
        "show the cluster's whole config, or make a config file the cluster's "
        "(no restart: identity, limits, policies, headers, privacy, bypass and rules)",
        "a config file (TOML or JSON) that replaces the cluster's config; its "
        "backend and balance, if it gives them, must be the cluster's; without it "
        "(or with 'list' or 'show'), the config is shown",
        _run_config,
    )

    _lazy_command(commands, command, "simulate", "run a rebalancing simulation")
    _lazy_command(commands, command, "bench", "the side-by-side benchmark")
    return parser


def _lazy_command(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    chosen: str | None,
    name: str,
    help: str,
) -> None:
    """A subcommand imported only when it is the one about to run (``simulations``,
    ``benchmarks``: both ship in the wheel; numpy and friends are slow to load).
    Only a missing module of the command's extra (``EXTRA_MODULES``) becomes a
    one-line "pip install" hint; any other ImportError is raised."""
    parser = commands.add_parser(name, help=help)
    if chosen != name:
        return
    try:
        module = importlib.import_module(LAZY_COMMANDS[name])
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] not in EXTRA_MODULES[name]:
            raise
        parser.set_defaults(run=_missing(name, exc))
        return
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)


def _missing(name: str, exc: ImportError) -> Callable[[argparse.Namespace], int]:
    """One line naming what is missing and the extra that installs it."""

    def run(args: argparse.Namespace) -> int:
        print(
            f"ringlimit {name}: {exc.name or exc} is not installed: "
            f"pip install 'ringlimit[{EXTRAS[name]}]'",
            file=sys.stderr,
        )
        return 2

    return run


def _config_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("rules and policies")
    group.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="SPEC",
        help=f"a rule such as '100/minute' or 'api=5/10s' (repeatable; default {DEFAULT_RULE} "
        "when neither --rule nor --config is given)",
    )
    group.add_argument(
        "--algorithm",
        default="token_bucket",
        help=f"for --rule: {', '.join(ALGORITHMS)} (default token_bucket)",
    )
    group.add_argument(
        "--burst",
        type=int,
        help="for --rule: bucket capacity of token_bucket and gcra (default: the limit)",
    )
    group.add_argument(
        "--on-error",
        choices=["open", "closed"],
        default="open",
        help="for --rule and --envoy-config: when a key's owner cannot be reached, allow "
        "(open, the default) or answer 503 (closed)",
    )
    group.add_argument(
        "--config",
        help="a config file, TOML or JSON of the same structure (docs/configuration.md)",
    )
    group.add_argument(
        "--rebalance-policy",
        choices=REBALANCE_POLICIES,
        help="what a join or a graceful leave does with counters: handoff (default, or the "
        "config's policies.rebalance) or reset",
    )
    group.add_argument(
        "--crash-policy",
        choices=CRASH_POLICIES,
        help="what a crash does with counters: replica (default, or the config's "
        "policies.crash), conservative or reset",
    )
    group.add_argument(
        "--replication-interval",
        type=float,
        metavar="SECONDS",
        help="for the replica policy: seconds between copies to successors (default 0.1, or "
        "the config's policies.replication_interval)",
    )
    group.add_argument(
        "--user-header",
        help="take the user id from this header (default X-User-Id, or the config's identity)",
    )


def _envoy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Envoy's rate limit service (docs/envoy.md)")
    group.add_argument(
        "--grpc-port",
        type=_port(0),
        metavar="P",
        help="serve envoy.service.ratelimit.v3.RateLimitService on this port",
    )
    group.add_argument(
        "--envoy-config",
        action="append",
        default=[],
        metavar="FILE",
        help="an envoyproxy/ratelimit YAML config, one domain per file (repeatable)",
    )
    group.add_argument(
        "--envoy-headers",
        default=None,
        metavar="SETS",
        help="response headers ShouldRateLimit asks Envoy to add: 'draft' (RateLimit-Policy, "
        f"RateLimit), 'envoy' (x-ratelimit-*), both comma-separated, or '' (default: "
        f"${ENVOY_HEADERS_ENV}, else none)",
    )
    group.add_argument(
        "--grpc-max-connections",
        type=int,
        metavar="N",
        help="open gRPC connections at most (default: a quarter of the client connections' "
        "half of ulimit -n, at least 16; the HTTP port's default cap is the rest)",
    )
    group.add_argument(
        "--grpc-drain",
        type=float,
        metavar="SECONDS",
        help="after the first SIGTERM or Ctrl-C, gRPC health says NOT_SERVING and both ports "
        f"go on serving this long before the router stops (default {GRPC_DRAIN:g}: Envoy's "
        "health checks in docs/envoy.md find it within that; `up`: 0); a second signal "
        "stops at once",
    )


#: ``--envoy-headers`` of a ``ringlimit router`` started without the flag (``up``
#: passes the flag on its router's command line).
ENVOY_HEADERS_ENV = "RINGLIMIT_ENVOY_HEADERS"


def envoy_header_sets(args: argparse.Namespace) -> tuple[str, ...]:
    """The header sets asked for (flag, else environment); ValueError names unknown ones."""
    from router.envoy import HEADER_SETS

    spec, where = args.envoy_headers, "--envoy-headers"
    if spec is None:
        spec, where = os.environ.get(ENVOY_HEADERS_ENV, ""), f"${ENVOY_HEADERS_ENV}"
    headers = tuple(h.strip() for h in spec.split(",") if h.strip())
    unknown = [h for h in headers if h not in HEADER_SETS]
    if unknown:
        raise ValueError(
            f"{where}: unknown set(s) {', '.join(unknown)} (expected {', '.join(HEADER_SETS)})"
        )
    return headers


def _proxy_arguments(parser: argparse.ArgumentParser) -> None:
    """What the router's proxy waits for and holds (``router``, and ``up`` for its router)."""
    parser.add_argument(
        "--forward-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="seconds a node (and the application behind it) has to answer a forwarded "
        "request (default 3: below the crash detection time, so no client waits on a paused "
        "node longer than it takes to notice it)",
    )
    parser.add_argument(
        "--max-request-body",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes of a proxied request's body the router holds (default 1 MiB, as nginx's "
        "client_max_body_size): it buffers bodies, and answers 413 past this or past the "
        "config's limits.max_body, the smaller",
    )
    parser.add_argument(
        "--max-answer",
        type=int,
        default=None,
        metavar="BYTES",
        help="bytes of a node's answer the router holds (default 16 MiB: router/forward.py "
        "MAX_ANSWER): it relays whole answers, and answers 502 answer_too_large past this",
    )


#: The flags of :func:`_proxy_arguments`, as ``up`` passes them to its router.
PROXY_FLAGS = ("--forward-timeout", "--max-request-body", "--max-answer")


def _fronting_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("what the nodes serve")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--upstream", metavar="URL", help="forward allowed requests to this URL")
    choice.add_argument("--app", metavar="MODULE:ATTR", help="serve this ASGI application")
    group.add_argument(
        "--upstream-idle",
        type=float,
        default=UPSTREAM_IDLE,
        metavar="SECONDS",
        help=f"seconds an idle connection to the upstream is reused (default {UPSTREAM_IDLE:g}: "
        "below the 5 s keep-alive of uvicorn, Node.js and Apache; keep it below your "
        "upstream's, or a POST can meet a connection it is closing and get a 502)",
    )
    group.add_argument(
        "--upstream-timeout",
        type=float,
        default=UPSTREAM_TIMEOUT,
        metavar="SECONDS",
        help=f"seconds a request to the upstream may take, from connecting to its answer's "
        f"last byte (default {UPSTREAM_TIMEOUT:g}): past it, a 502, or an answer already "
        "begun is cut off",
    )


def _backend_arguments(parser: argparse.ArgumentParser, *, connects: bool = True) -> None:
    """``connects``: the command starts nodes, which talk to Redis. A router never
    does (it only balances differently in Redis mode), so it takes no ``--redis-*``
    flag rather than one it would ignore."""
    group = parser.add_argument_group("backend")
    group.add_argument(
        "--backend",
        choices=BACKENDS,
        help="memory (default) or redis"
        + ("" if connects else " (the nodes' backend: redis balances round-robin)"),
    )
    if connects:
        _redis_arguments(group)
    group.add_argument("--balance", choices=BALANCES, help="sticky (default) or round-robin")


def _redis_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument(
        "--redis-url",
        metavar="URL",
        default=os.environ.get("RINGLIMIT_REDIS_URL", REDIS_URL),
        help=f"redis: where Redis is (default $RINGLIMIT_REDIS_URL, else {REDIS_URL})",
    )
    group.add_argument(
        "--redis-pipeline",
        choices=["on", "off"],
        default=os.environ.get("RINGLIMIT_REDIS_PIPELINE", "on"),
        help="redis: concurrent checks share pipelined round trips (on, the default) or "
        "each check is its own round trip (off: the naive baseline)",
    )
    group.add_argument(
        "--redis-timeout",
        metavar="SECONDS",
        default=os.environ.get("RINGLIMIT_REDIS_TIMEOUT", str(REDIS_TIMEOUT)),
        help=f"redis: how long a node waits for a reply (and a connection) before it "
        f"decides locally and treats Redis as down until a probe answers "
        f"(default {REDIS_TIMEOUT})",
    )


def _redis_pipeline(args: argparse.Namespace) -> bool:
    """``--redis-pipeline``; argparse checks choices only of values given as flags,
    so the environment's default is checked here."""
    if args.redis_pipeline not in ("on", "off"):
        raise ValueError(
            f"--redis-pipeline (or RINGLIMIT_REDIS_PIPELINE) must be on or off, "
            f"got {given(args.redis_pipeline)}"
        )
    return bool(args.redis_pipeline == "on")


def _redis_timeout(args: argparse.Namespace) -> float:
    """``--redis-timeout`` (or ``RINGLIMIT_REDIS_TIMEOUT``), checked here so that a
    bad value from either place is the same one-line error, bounds included."""
    problem = ValueError(
        f"--redis-timeout (or RINGLIMIT_REDIS_TIMEOUT) must be seconds from "
        f"{MIN_REDIS_TIMEOUT:g} to {MAX_REDIS_TIMEOUT:g}, got {given(args.redis_timeout)}"
    )
    try:
        timeout = float(args.redis_timeout)
    except ValueError:
        raise problem from None
    if not MIN_REDIS_TIMEOUT <= timeout <= MAX_REDIS_TIMEOUT:
        raise problem
    return timeout


def _front_door_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connections (docs/configuration.md)")
    group.add_argument(
        "--max-connections",
        type=int,
        help="open client connections at most (default: half of what ulimit -n leaves "
        f"after {RESERVED_FDS} kept for the process itself, at least 16)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send a request's headers (default 10)",
    )
    group.add_argument(
        "--keep-alive",
        type=float,
        default=KEEP_ALIVE,
        help=f"seconds an idle keep-alive connection is kept (default {KEEP_ALIVE:g}; "
        f"keep it at {REUSE_IDLE + 1:g} or more: routers and nodes reuse one for {REUSE_IDLE:g})",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=10.0,
        help="seconds a request's body has after its headers, plus one per "
        f"{MIN_BODY_RATE} bytes received (default 10)",
    )


#: The router's numeric flags and their ranges: (flag, low, high, bounds), where
#: ``bounds`` says which ends are allowed, as an interval is written ("[]": both,
#: "(]": not the low one...). Out of range, each used to be taken as it was: a
#: forward timeout of 0 answered every check "owner_timeout" (allowed, under
#: on_error = open), a health timeout of 0 blamed the seeds for not answering.
ROUTER_NUMBERS = (
    ("--health-interval", 0.0, 3600.0, "(]"),
    ("--failure-threshold", 1, 1000, "[]"),
    ("--health-timeout", 0.0, 3600.0, "(]"),
    ("--forward-timeout", 0.0, 3600.0, "(]"),
    # Answers to proxied requests (the decision API's are bounded by its own limits).
    ("--max-answer", 1 << 20, 1 << 40, "[]"),
    ("--max-request-body", 1, 1 << 40, "[]"),
    ("--lease", 0.0, MAX_LEASE, "(]"),
    ("--removal-interval", 0.0, 86400.0, "[]"),
    ("--removal-quorum", 0.0, 1.0, "[)"),
    ("--forget-removed-after", 0.0, 1e9, "(]"),
    ("--coalesce-window", 0.0, 1e6, "[]"),
    ("--grpc-max-connections", 1, 1 << 24, "[]"),
    ("--grpc-drain", 0.0, 3600.0, "[]"),
    ("--worker-timeout", 0.0, 3600.0, "[]"),
    # --coordinator-ttl: whole seconds, checked by its type (_coordinator_ttl).
)


def _check_grpc_only(args: argparse.Namespace) -> None:
    """ValueError if a flag of the gRPC port is given without ``--grpc-port``:
    it was ignored without a word (a review)."""
    given = [
        flag
        for flag in ("--grpc-drain", "--grpc-max-connections")
        if getattr(args, flag[2:].replace("-", "_"), None) is not None
    ]
    if given and getattr(args, "grpc_port", None) is None:
        raise ValueError(f"{' and '.join(given)} need(s) --grpc-port and --envoy-config")


def _number(value: float) -> str:
    """A bound as said in an error: an int whole (1048576, not 1.04858e+06)."""
    return str(value) if isinstance(value, int) else f"{value:g}"


def _check_router_numbers(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first of :data:`ROUTER_NUMBERS` out of its range
    (a flag left at None, its default, is not checked)."""
    for flag, low, high, bounds in ROUTER_NUMBERS:
        value = getattr(args, flag[2:].replace("-", "_"), None)  # (``up`` has a few)
        if value is None:
            continue
        above = value >= low if bounds[0] == "[" else value > low
        below = value <= high if bounds[1] == "]" else value < high
        if not (above and below and math.isfinite(value)):
            low_text = f"{'at least' if bounds[0] == '[' else 'above'} {_number(low)}"
            high_text = f"{'at most' if bounds[1] == ']' else 'below'} {_number(high)}"
            raise ValueError(f"{flag} must be {low_text} and {high_text}, got {given(value)}")
    if getattr(args, "no_health_checks", True):
        return
    # The lease the nodes will be granted: given, or the detection time (with
    # etcd, at least what a take-over of the lead needs: router/coordinator.py).
    from router.coordinator import node_lease

    renewal = args.health_interval + args.health_timeout
    ttl = args.coordinator_ttl if getattr(args, "coordinator", None) else None
    detection = args.failure_threshold * renewal
    lease = args.lease if args.lease is not None else node_lease(detection, renewal, ttl)
    if lease > MAX_LEASE:
        raise ValueError(
            f"the default lease, --failure-threshold x (--health-interval + --health-timeout)"
            f"{' (or what a take-over needs)' if ttl is not None else ''} "
            f"= {lease:g} s, is over the {MAX_LEASE:g} s a node accepts: set --lease"
        )
    if lease < renewal:
        raise ValueError(
            f"--lease ({lease:g} s) must outlast a probe round, --health-interval + "
            f"--health-timeout ({renewal:g} s): nodes would stop deciding between probes"
        )


def _warn_short_lease(args: argparse.Namespace) -> None:
    """A ``--lease`` that a take-over of the lead outlasts: said once at start."""
    from router.coordinator import takeover_lease

    if not args.coordinator or args.lease is None or args.no_health_checks:
        return
    renewal = args.health_interval + args.health_timeout
    needed = takeover_lease(args.coordinator_ttl, renewal)
    if args.lease < needed:
        print(
            f"ringlimit: warning: --lease {args.lease:g} s is shorter than a take-over of the "
            f"lead needs (--coordinator-ttl {args.coordinator_ttl} + 1.5 s + a probe round = "
            f"{needed:g} s): each time the leading router is lost, every node's lease lapses "
            "and every rule's on_error answers until another leads",
            file=sys.stderr,
        )


#: FrontDoor's fields as the flags that set them, for its errors.
_FRONT_DOOR_FLAGS = {
    "keep_alive": "--keep-alive",
    "header_timeout": "--header-timeout",
    "max_connections": "--max-connections",
    "body_timeout": "--body-timeout",
}


def _front_door(args: argparse.Namespace) -> FrontDoor:
    try:
        return FrontDoor(
            keep_alive=args.keep_alive,
            header_timeout=args.header_timeout,
            max_connections=args.max_connections,
            body_timeout=args.body_timeout,
            grpc=getattr(args, "grpc_port", None) is not None,
            grpc_max_connections=getattr(args, "grpc_max_connections", None),
        )
    except ValueError as exc:
        field, _, rest = str(exc).partition(" ")
        raise ValueError(f"{_FRONT_DOOR_FLAGS.get(field, field)} {rest}") from None


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    """The config from --config, then flags on top (flags win)."""
    config = load_config(args.config) if args.config else ClusterConfig()
    specs = list(args.rule) or ([] if args.config else [DEFAULT_RULE])
    rules = [
        ScopedRule(
            parse_rule(spec, algorithm=args.algorithm, burst=args.burst, on_error=args.on_error)
        )
        for spec in specs
    ]
    changes: dict[str, object] = {}
    if rules:
        every = (*config.rules, *rules)
        changes["rules"] = every
        names = [scoped.rule.name for scoped in every]
        for spec, scoped in zip(specs, rules, strict=True):
            if names.count(scoped.rule.name) > 1:  # said where it is, not only what
                raise ConfigError(
                    f"--rule {spec}: rule name {scoped.rule.name!r} is used twice"
                    + (f" (also in {args.config}: name it, 'NAME=RATE')" if args.config else "")
                )
    policies = config.policies
    interval = args.replication_interval
    if args.rebalance_policy or args.crash_policy or interval is not None:
        changes["policies"] = Policies(
            rebalance=args.rebalance_policy or policies.rebalance,
            crash=args.crash_policy or policies.crash,
            replication_interval=policies.replication_interval if interval is None else interval,
        )
    if args.user_header:
        from dataclasses import replace

        try:
            changes["identity"] = replace(config.identity, source="header", name=args.user_header)
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("identity.name", "--user-header", 1)) from None
    backend = getattr(args, "backend", None)
    if backend:
        changes["backend"] = backend
        if backend == "redis" and not getattr(args, "balance", None):
            changes["balance"] = "round-robin"
    if getattr(args, "balance", None):
        changes["balance"] = args.balance
    return config.with_(**changes) if changes else config


def _tokens() -> tuple[str | None, str | None]:
    return _token("RINGLIMIT_ADMIN_TOKEN"), _token("RINGLIMIT_INTERNAL_TOKEN")


def _token(variable: str) -> str | None:
    """A token from the environment (empty: none). Visible ASCII only: it travels in
    an HTTP header, where anything else was either a crash at start (the router
    encodes its internal token as latin-1) or a token no request could match."""
    value = os.environ.get(variable) or None
    if value is not None and not (value.isascii() and value.isprintable() and " " not in value):
        raise ValueError(
            f"{variable} must be visible ASCII characters (no spaces or control characters)"
        )
    return value


def _run_router(args: argparse.Namespace) -> int:
    from router.app import RouterSettings
    from router.envoy_config import load_envoy_configs, with_envoy_rules
    from router.forward import MAX_ANSWER, Timeouts

    config = cluster_config(args)
    admin_token, internal_token = _tokens()
    envoy = (
        load_envoy_configs(args.envoy_config, on_error=args.on_error) if args.envoy_config else None
    )
    if envoy is not None:
        config = with_envoy_rules(config, envoy)
    if (envoy is None) != (args.grpc_port is None):
        print(
            "ringlimit: --grpc-port and --envoy-config go together (where Envoy asks, "
            "and the limits it asks about)",
            file=sys.stderr,
        )
        return 2
    try:
        headers = envoy_header_sets(args)
        _check_grpc_only(args)
    except ValueError as exc:
        print(f"ringlimit: {exc}", file=sys.stderr)
        return 2
    seeds = [_parse_seed(spec) for spec in args.node]
    front_door = _front_door(args)  # checked before anything starts: a bad value is one line
    _check_router_numbers(args)
    import signal

    from router.processes import watch_parent
    from router.workers import worker_role

    role = worker_role()
    if role is not None and role.parent:
        # SIGTERM if the supervisor dies without stopping this worker (kill -9).
        watch_parent(role.parent, signal.SIGTERM)
    if role is None:
        _warn_keep_alive(front_door)  # once, not again by each worker
        _warn_short_lease(args)
        _warn_no_rules(config, args)
    if role is None and args.workers != 1:
        return _run_workers(args)
    if role is None and args.worker_timeout is not None:
        # Ignored without a word by a single router, which has no supervisor.
        raise ValueError(
            "--worker-timeout applies to --workers N (N > 1): a single router has no supervisor"
        )
    settings = RouterSettings(
        config=config,
        seeds=seeds,
        admin_token=admin_token,
        internal_token=internal_token,
        api_token=_token("RINGLIMIT_API_TOKEN"),
        # Ignored with a coordinator (said at start): etcd holds the ring, and a
        # file written anyway went stale, for a router started later without etcd.
        state_file=None if args.coordinator else args.state_file,
        health_interval=args.health_interval,
        failure_threshold=args.failure_threshold,
        health_timeout=args.health_timeout,
        timeouts=Timeouts()
        if args.forward_timeout is None
        else Timeouts(total=args.forward_timeout),
        max_answer=MAX_ANSWER if args.max_answer is None else args.max_answer,
        max_buffered_body=(
            RouterSettings.max_buffered_body
            if args.max_request_body is None
            else args.max_request_body
        ),
        lease=args.lease,
        removal_interval=args.removal_interval,
        removal_quorum=args.removal_quorum,
        forget_removed_after=args.forget_removed_after,
        coordinator=_coordinator(args),
        advertise=args.advertise or f"http://{_reachable(args.host)}:{args.port}",
        health_checks=not args.no_health_checks,
        coalesce_window=args.coalesce_window / 1e6,
        pipeline=args.pipeline,
        unix_sockets=not args.no_unix_sockets,
        envoy=envoy,
        grpc_port=args.grpc_port,
        grpc_host=args.host,
        grpc_max_connections=args.grpc_max_connections,
        grpc_handshake_timeout=args.header_timeout,
        grpc_drain=GRPC_DRAIN if args.grpc_drain is None else args.grpc_drain,
        envoy_headers=headers,
        own_urls=_own_urls(args.host, args.port),
    )
    _warn_modes(config)
    if settings.coordinator is not None and not _etcd_reachable(settings.coordinator):
        return 1
    if role is None:
        _check_port(args.host, args.port, "the router")
        if args.grpc_port:  # 0: any free port, always one
            from router.supervisor import GRPC_ROLE

            if args.grpc_port == args.port:
                raise CommandError(
                    f"--grpc-port {args.grpc_port} is the router's --port: "
                    "gRPC needs a port of its own"
                )
            _check_port(args.host, args.grpc_port, GRPC_ROLE, choose="--grpc-port")
        _check_state_file(args)
        _serve_router(settings, args)
        return 0
    from dataclasses import replace

    from router.workers import ping_socket, worker_sockets

    follower = role.leader_url is not None
    settings = replace(
        settings,
        name=role.name,
        advertise=role.admin_url,
        leader_url=role.leader_url,
        # One worker makes the first view (etcd or seeds); a follower learns it.
        seeds=seeds if role.index == 0 else [],
        state_file=None if follower else settings.state_file,
        health_checks=settings.health_checks and not follower,
        fellows=role.fellows,
        # A leader started again after a crash recovers the ring and the rules the
        # cluster has (from its fellows and the nodes) rather than its flags'.
        restarted=role.restarted and not follower and settings.coordinator is None,
    )
    _serve_router(settings, args, worker_sockets(role), ping_socket(role))
    return 0


def _check_workers(count: int) -> None:
    from router.workers import MAX_WORKERS

    if not 1 <= count <= MAX_WORKERS:
        raise ValueError(f"--workers {count}: must be from 1 to {MAX_WORKERS}")


def _run_workers(args: argparse.Namespace) -> int:
    """``--workers N``: a supervisor of N router processes (router/workers.py)."""
    from router.workers import WORKER_TIMEOUT, Supervisor, WorkerStartError

    _check_workers(args.workers)
    if args.worker_timeout is None:
        args.worker_timeout = WORKER_TIMEOUT
    elif 0 < args.worker_timeout < 2:
        # A worker's event loop stalls for a second under a heavy load on a small
        # host: at 1 s a busy worker was killed as hung, once in six runs of
        # wrk -c500 on two cores (the day's-end tester).
        raise ValueError(
            f"--worker-timeout {args.worker_timeout:g}: must be 0 (never) or at least 2 seconds"
        )
    if args.grpc_port is not None:
        raise ValueError(
            "--grpc-port serves from one process: run it with --workers 1 (or a router of its own)"
        )
    if args.advertise:
        raise ValueError(
            "--advertise names one router: with --workers each worker advertises its own "
            "admin port on --host"
        )
    coordinated = bool(args.coordinator)
    if coordinated:
        coordinator = _coordinator(args)
        if coordinator is not None and not _etcd_reachable(coordinator):
            return 1  # one line here, rather than N workers failing in a loop
    _check_state_file(args)
    try:
        supervisor = Supervisor(
            args.argv,
            args.workers,
            host=args.host,
            port=args.port,
            admin_host=args.host if coordinated else "127.0.0.1",
            advertise_host=_reachable(args.host) if coordinated else "127.0.0.1",
            coordinated=coordinated,
            worker_timeout=args.worker_timeout,
        )
    except OSError as exc:
        print(f"ringlimit: cannot bind {args.host}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        return supervisor.run()
    except WorkerStartError as exc:
        print(f"ringlimit: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(
            f"ringlimit: cannot bind {args.host}:{args.port}: {exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1


def _serve_router(
    settings: RouterSettings,
    args: argparse.Namespace,
    sockets: list[socket.socket] | None = None,
    ping: socket.socket | None = None,
) -> None:
    """Serve; a router that cannot start (no seed answers, a bad state file, etcd
    gone) says so in one line."""
    from router.app import create_router
    from router.coordinator import CoordinatorError
    from router.envoy import GrpcPortError
    from router.membership import MembershipError
    from router.server import serve_router

    try:
        serve_router(
            create_router(settings),
            host=args.host,
            port=args.port,
            sockets=sockets,
            front_door=_front_door(args),
            ping=ping,
        )
    except MembershipError as exc:
        raise _cannot_start(exc) from None
    except GrpcPortError as exc:
        raise CommandError(f"the router could not start: {exc}") from None
    except CoordinatorError as exc:
        raise CommandError(
            f"the router could not start: {exc}; check --coordinator (RINGLIMIT_COORDINATOR) "
            "and that etcd is running"
        ) from None


def _check_state_file(args: argparse.Namespace) -> None:
    """One line, before anything starts or is sent, if ``--state-file`` cannot be
    read back and written over. Found at the first save instead, a router had
    already taken the ring from its seeds and pushed its rules to their nodes,
    a live cluster's: the users of a changed algorithm were given a fresh quota
    twice (an exploratory tester: 10 admissions under a limit of 5); and
    ``--workers`` restarted its first worker until it gave up (nine lines)."""
    if args.coordinator or not args.state_file:
        return  # with etcd the file is not used (said at start)
    from pathlib import Path

    from router.statefile import check_state_file
    from router.viewlog import MembershipError

    try:
        check_state_file(Path(args.state_file))
    except MembershipError as exc:
        raise _cannot_start(exc) from None


def _cannot_start(exc: MembershipError) -> CommandError:
    hint = (
        "check --state-file"
        if exc.error == "bad_state_file"
        else "check the --node seeds (ID=URL) and that those nodes are running"
    )
    return CommandError(f"the router could not start: {exc.detail}; {hint}")


def _coordinator(args: argparse.Namespace) -> EtcdCoordinator | None:
    from router.coordinator import EtcdCoordinator, parse_endpoints
    from router.etcd_access import EtcdAccess
    from router.workers import worker_role

    if not args.coordinator:
        given = [
            f"--etcd-{f}" for f in ("cacert", "cert", "key", "user") if getattr(args, f"etcd_{f}")
        ]
        if given:
            verb = "needs" if len(given) == 1 else "need"
            raise SystemExit(f"ringlimit: {', '.join(given)} {verb} --coordinator")
        unused = [
            flag
            for flag, value, default in (
                ("--cluster", args.cluster, "default"),
                ("--coordinator-ttl", args.coordinator_ttl, 2),
                ("--advertise", args.advertise, None),
            )
            if value != default
        ]
        role = worker_role()
        if unused and (role is None or (role.index == 0 and not role.restarted)):
            # Said once (a single router, or the first worker's first start), not
            # refused (a compose file may pass them whether or not it sets
            # RINGLIMIT_COORDINATOR): they were taken in silence, and a router meant
            # for a cluster ran on a ring of its own (an exploratory tester).
            print(
                f"ringlimit: {', '.join(unused)} ignored without --coordinator "
                "(this router keeps a ring of its own)",
                file=sys.stderr,
            )
        return None
    if args.state_file:
        print(
            "ringlimit: --state-file is ignored with --coordinator (etcd holds the ring)",
            file=sys.stderr,
        )
    try:
        access = EtcdAccess.from_files(
            tls=args.coordinator.startswith("etcds://"),
            ca=args.etcd_cacert,
            cert=args.etcd_cert,
            key=args.etcd_key,
            user=args.etcd_user,
            password=os.environ.get("RINGLIMIT_ETCD_PASSWORD"),
        )
        return EtcdCoordinator(
            parse_endpoints(args.coordinator),
            cluster=args.cluster,
            ttl=args.coordinator_ttl,
            access=access,
        )
    except ValueError as exc:
        raise SystemExit(f"ringlimit: {exc}") from None


def _etcd_reachable(coordinator: EtcdCoordinator) -> bool:
    """Before serving: one line, not a traceback, when etcd is not there."""
    import asyncio

    from router.coordinator import CoordinatorError

    async def check() -> None:
        try:
            await coordinator.connect()
        finally:
            await coordinator.close()

    try:
        asyncio.run(check())
    except CoordinatorError as exc:
        print(
            f"ringlimit: cannot start the router: {exc} (check --coordinator, the --etcd-* "
            "flags and that etcd runs)",
            file=sys.stderr,
        )
        return False
    return True


def _reachable(host: str) -> str:
    """A bind address other hosts cannot use as such (0.0.0.0) -> this host's name."""
    if host in ("0.0.0.0", "::", ""):
        return socket.gethostname()
    return f"[{host}]" if ":" in host else host


def _check_upstream_seconds(args: argparse.Namespace) -> None:
    """``--upstream-idle`` and ``--upstream-timeout``: seconds, as the front
    door's timeouts are (at most an hour)."""
    for flag, seconds in (
        ("--upstream-idle", args.upstream_idle),
        ("--upstream-timeout", args.upstream_timeout),
    ):
        if not 0 < seconds <= 3600:
            raise ValueError(f"{flag} {seconds:g}: must be above 0 and at most 3600 seconds")


def _check_upstream(url: str | None) -> None:
    """``--upstream``: an http(s) URL with a host (a path prefix is kept). Anything
    else was taken, the cluster started, and every allowed request failed.
    A URL with an '@', '?' or '#' is named by its scheme and host alone: what
    else it holds (user info, a query, a fragment) may be a secret, and a '#'
    or '/' in a password moves it out of what a parser takes for user info."""
    if url is None:
        return
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"--upstream: not a URL ({exc})") from None
    shown = (
        url
        if not any(mark in url for mark in "@?#")
        else f"{parts.scheme}://{parts.hostname or ''}/..."
    )
    try:
        parts.port  # noqa: B018 (raises ValueError for a port out of range)
    except ValueError:
        raise ValueError(
            f"--upstream {shown!r}: its port is not a number from 1 to 65535"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--upstream {shown!r}: expected http://HOST[:PORT][/PATH] (or https://)")
    if parts.query or parts.fragment or url.rstrip().endswith(("?", "#")):
        # Each request's path goes after the URL: GET /ok reached the upstream as
        # /?v=1/ok, the client's path inside the query.
        raise ValueError(
            f"--upstream {shown!r}: a query or fragment cannot be kept (each request's "
            "path and query go after the URL); expected http://HOST[:PORT][/PATH]"
        )
    if "@" in parts.netloc:
        # aiohttp sends them as Authorization, and refused (a 500 for every
        # request) when the client sent its own.
        raise ValueError(
            f"--upstream {shown!r}: credentials in the URL are not supported (they would "
            "clash with the clients' own Authorization); expected http://HOST[:PORT][/PATH]"
        )


def _run_node(args: argparse.Namespace) -> int:
    from node.app import NodeSettings, create_app
    from node.server import serve_node
    from node.upstream import UpstreamApp, load_app

    check_id(args.id)
    if args.url is not None:
        check_url(args.url)
    check_weight(args.weight)
    _check_upstream(args.upstream)
    _check_upstream_seconds(args)
    routers: list[str] = []
    if args.join is not None:
        routers = [part.strip() for part in args.join.split(",")]
        for router_url in routers:
            check_url(router_url)
    front_door = _front_door(args)
    _warn_keep_alive(front_door)
    config = cluster_config(args)
    if not routers:  # (a --join node takes the cluster's rules)
        _warn_no_rules(config, args)
    admin_token, internal_token = _tokens()
    app: ASGIApp | None = None
    if args.upstream:
        app = UpstreamApp(
            args.upstream, timeout=args.upstream_timeout, idle_timeout=args.upstream_idle
        )
    elif args.app:
        app = load_app(args.app)
    pipeline = _redis_pipeline(args)
    timeout = _redis_timeout(args)
    backend = None
    if config.backend == "redis":
        backend = _redis_backend(
            args.redis_url, pipeline=pipeline, timeout=timeout, max_keys=args.max_keys
        )
    settings = NodeSettings(
        node_id=args.id,
        config=config,
        internal_token=internal_token,
        max_keys=args.max_keys,
        sticky=config.backend == "memory" and config.balance == "sticky",
        fenced=bool(args.fenced or args.join),
        unix_socket=args.unix_socket,
    )
    node = create_app(settings, backend=backend, app=app)
    _check_port(args.host, args.port, f"node {args.id}")
    return serve_node(
        node,
        host=args.host,
        port=args.port,
        join=routers,
        advertise=args.url,
        weight=args.weight,
        admin_token=admin_token,
        join_timeout=args.join_timeout,
        front_door=front_door,
        # `ringlimit up` stops its nodes with SIGHUP (router/supervisor.py): not
        # worth a line from each at every Ctrl-C.
        say_hangup=os.environ.get(SUPERVISOR_ENV) is None,
    )


def _redis_backend(url: str, *, pipeline: bool, timeout: float, max_keys: int | None) -> Backend:
    """Redis, and the local limiter that decides while it is away, capped by
    ``--max-keys`` as a memory node's store is."""
    from node.backend import MemoryBackend
    from node.clock import system_clock
    from node.redis_backend import FallbackBackend, RedisBackend
    from node.store import MemoryStore

    return FallbackBackend(
        RedisBackend(url, pipeline=pipeline, timeout=timeout),
        MemoryBackend(MemoryStore(max_keys=max_keys), system_clock),
    )


def _run_up(args: argparse.Namespace) -> int:
    from router.supervisor import StartError, run_cluster

    config = cluster_config(args)
    _check_upstream(args.upstream)
    _check_upstream_seconds(args)
    _check_router_numbers(args)  # those of its router that ``up`` takes
    _redis_pipeline(args)
    _warn_redis_timeout(_redis_timeout(args), args.forward_timeout, config)
    if not 1 <= args.nodes <= MAX_MEMBERS:
        raise ValueError(
            f"--nodes {args.nodes}: must be from 1 to {MAX_MEMBERS} (a ring's most members)"
        )
    _check_node_ports(args)
    _check_workers(args.workers)
    if args.workers > 1 and args.grpc_port is not None:
        raise ValueError(
            "--grpc-port serves from one process: run `up` with --workers 1 "
            "(or a router of its own for Envoy)"
        )
    if bool(args.envoy_config) != (args.grpc_port is not None):
        raise ValueError(
            "--grpc-port and --envoy-config go together (where Envoy asks, and the limits "
            "it asks about)"
        )
    if args.envoy_config:
        from router.envoy_config import load_envoy_configs, with_envoy_rules

        # Read here too, so a bad file is one line before any process starts.
        envoy_rules = with_envoy_rules(
            config, load_envoy_configs(args.envoy_config, on_error=args.on_error)
        )
    _warn_no_rules(envoy_rules if args.envoy_config else config, args)
    headers = envoy_header_sets(args)
    if args.envoy_headers and args.grpc_port is None:
        raise ValueError("--envoy-headers needs --grpc-port and --envoy-config")
    _check_grpc_only(args)
    # (No round-robin warning here: the router `up` starts prints it.)
    args.envoy_headers = ",".join(headers)
    try:
        return run_cluster(args, config)
    except StartError as exc:
        raise CommandError(str(exc)) from None


def _check_node_ports(args: argparse.Namespace) -> None:
    """``up``'s nodes listen on consecutive ports from --node-port (or --port + 1):
    the last one too must be a port (65536 was a traceback from socket.bind)."""
    flag, given = ("--node-port", args.node_port) if args.node_port else ("--port", args.port)
    first = args.node_port or args.port + 1
    last = first + args.nodes - 1
    if last > MAX_PORT:
        raise ValueError(
            f"{flag} {given} with --nodes {args.nodes}: node "
            f"ports {first}..{last} go past {MAX_PORT}; choose a lower {flag}"
        )


def _run_nodes(args: argparse.Namespace) -> int:
    if args.action == "add" and (not args.node_id or not args.node_url):
        raise ValueError("usage: ringlimit nodes add ID URL")
    if args.action == "remove" and not args.node_id:
        raise ValueError("usage: ringlimit nodes remove ID [--force]")
    # Words past what the action takes were dropped without a word.
    if args.action == "list" and args.node_id is not None:
        raise ValueError("usage: ringlimit nodes list (it takes no ID or URL)")
    if args.action == "remove" and args.node_url is not None:
        raise ValueError("usage: ringlimit nodes remove ID [--force] (it takes no URL)")
    if args.force and args.action != "remove":
        raise ValueError("--force goes with ringlimit nodes remove")
    if args.action == "add":
        Member.parse(args.node_id, args.node_url, args.weight)
    elif args.action == "remove":
        check_id(args.node_id)
    body: dict[str, Any] | None = None
    if args.action == "list":
        method, path = "GET", "/admin/ring"
    elif args.action == "add":
        method, path = "POST", "/admin/nodes"
        body = {"id": args.node_id, "url": args.node_url, "weight": args.weight}
    else:
        method, path = "DELETE", f"/admin/nodes/{args.node_id}"
        if args.force:
            path += "?force=true"

    def lines(data: dict[str, Any]) -> list[str]:
        found = [f"epoch {data['epoch']}"]
        for node in data["nodes"]:
            found.append(
                f"  {node['id']:<10} {node['url']:<32} weight={node['weight']} {node['state']}"
            )
        return found

    return _admin_call(
        args.router, method, path, body, lines, command="ringlimit nodes", timeout=args.timeout
    )


#: Words ``ringlimit rules`` takes for "show the rules" when no such file exists.
SHOW_WORDS = ("list", "show")


def _show_or_apply(
    commands: Any, name: str, help: str, file_help: str, run: Callable[[argparse.Namespace], int]
) -> None:
    """A command that shows what the cluster has, or applies a file: ``rules``, ``config``."""
    command = commands.add_parser(name, help=help)
    command.add_argument("file", nargs="?", help=file_help)
    command.add_argument("--router", default=ROUTER_URL, help=ROUTER_HELP)
    _admin_timeout_argument(command)
    command.set_defaults(run=run)


def _file_to_apply(args: argparse.Namespace, command: str) -> str | None:
    """The file ``ringlimit COMMAND FILE`` applies; None to show (no file, or
    ``list``/``show``, as ``nodes list`` says it). A read must never turn into
    a write: a file of such a name here is refused (``./list`` applies it)."""
    if args.file in SHOW_WORDS:
        if os.path.lexists(args.file):
            raise ValueError(
                f"{args.file!r} names a file here too: `ringlimit {command} ./{args.file}` "
                f"applies it, `ringlimit {command}` shows the {command}"
            )
        return None
    return str(args.file) if args.file is not None else None


def _say_pending(what: str, data: dict[str, Any]) -> None:
    """The members that did not take new ``what`` (``rules``, ``config``), on
    stderr: stdout stays what ``ringlimit WHAT`` reads back."""
    if data.get("pending"):
        print(
            f"ringlimit {what}: not taken yet by "
            + ", ".join(map(str, data["pending"]))
            + f" (the router's health loop gives them the {what}, or repairs them)",
            file=sys.stderr,
        )


def _salt_kept(data: Any) -> Any:
    """``data`` as the router reads it: a salt shown hidden (what `ringlimit
    config` printed, sent back) keeps the cluster's, so it is not checked here."""
    privacy = data.get("privacy") if isinstance(data, dict) else None
    if isinstance(privacy, dict) and privacy.get("salt") == HIDDEN_SALT:
        return {**data, "privacy": {k: v for k, v in privacy.items() if k != "salt"}}
    return data


def _run_config(args: argparse.Namespace) -> int:
    """Show the cluster's whole config, or make a file's the cluster's."""
    body = None
    args.file = _file_to_apply(args, "config")
    if args.file is not None:
        data = load_config_data(args.file)  # ConfigError: one line, naming the file
        config_of(_salt_kept(data), args.file)  # checked here first, naming the file
        if not isinstance(data, dict) or not data.get("rules"):
            raise ValueError(f"{args.file}: no [[rules]]: a cluster's config has its rules")
        body = data

    def lines(data: dict[str, Any]) -> list[str]:
        config = data["config"]
        if not isinstance(config, dict):
            raise ValueError("not a config")
        return [json.dumps(config, indent=2)]

    def applied(data: dict[str, Any]) -> list[str]:
        _say_pending("config", data)
        return lines(data)

    return _admin_call(
        args.router,
        "GET" if body is None else "PUT",
        "/admin/config",
        body,
        lines if body is None else applied,
        command="ringlimit config",
        timeout=args.timeout,
    )


def _run_rules(args: argparse.Namespace) -> int:
    """Show the cluster's rules, or make a file's [[rules]] the cluster's."""
    body = None
    unapplied: list[str] = []  # what a file sets besides its rules
    args.file = _file_to_apply(args, "rules")
    if args.file is not None:
        data = load_config_data(args.file)  # ConfigError: one line, naming the file
        config = config_of(data, args.file)
        body = {"rules": [scoped.to_dict() for scoped in config.rules]}
        if not body["rules"]:
            raise ValueError(f"{args.file}: no [[rules]] to apply")
        if isinstance(data, dict):
            # Checked, and left as they are: an operator who changed [limits] in
            # the file saw exit 0 and no hint that nothing of it was applied.
            unapplied = [
                f"[{name}]" if isinstance(value, dict) else name
                for name, value in sorted(data.items())
                if name != "rules"
            ]

    def lines(data: dict[str, Any]) -> list[str]:
        # The rules alone: what `ringlimit rules > rules.json` saves, this applies.
        rules = data["rules"]
        if not isinstance(rules, list) or not all(isinstance(rule, dict) for rule in rules):
            raise ValueError("not a list of rules")  # (a router's answer has one)
        return [json.dumps({"rules": rules}, indent=2)]

    def applied(data: dict[str, Any]) -> list[str]:
        if unapplied:
            print(
                f"ringlimit rules: {args.file}: {', '.join(unapplied)} not applied: "
                "`ringlimit rules` changes the [[rules]] alone; `ringlimit config FILE` "
                "applies the whole file",
                file=sys.stderr,
            )
        _say_pending("rules", data)
        return lines(data)

    if body is None:
        return _admin_call(
            args.router,
            "GET",
            "/admin/rules",
            None,
            lines,
            command="ringlimit rules",
            timeout=args.timeout,
        )
    return _admin_call(
        args.router,
        "PUT",
        "/admin/rules",
        body,
        applied,
        command="ringlimit rules",
        timeout=args.timeout,
    )


#: Set in the environment of the nodes `ringlimit up` starts (router/supervisor.py).
SUPERVISOR_ENV = "RINGLIMIT_SUPERVISOR"

#: The longest an admin command waits for its whole answer, by default: a join
#: waits for its node's readiness and its handoff (docs/operations.md).
ADMIN_TIMEOUT = 60.0
#: The most of an admin answer a command reads (a ring of thousands of nodes is
#: well under it).
MAX_ADMIN_ANSWER = 16 * 1024 * 1024


def _admin_timeout_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=ADMIN_TIMEOUT,
        metavar="SECONDS",
        help=f"the longest to wait for the router's whole answer (default {ADMIN_TIMEOUT:g})",
    )


def _admin_call(
    router: str,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    lines: Callable[[dict[str, Any]], list[str]],
    *,
    command: str,
    timeout: float = ADMIN_TIMEOUT,
) -> int:
    """One call to a router's admin API, the answer printed by ``lines``; a
    router that cannot be reached, refuses or answers junk is one line, and so
    is one that has not answered whole within ``timeout`` (a whole answer:
    httpx's timeouts are per read, and a router paused or sending a byte a
    second held the command for minutes). A ``warning`` in the answer goes to
    stderr, in one line."""
    import httpx

    if not 0 < timeout <= 3600:
        raise ValueError(f"--timeout {timeout:g}: must be above 0 and at most 3600 seconds")
    admin_token, _ = _tokens()
    headers = {"authorization": f"Bearer {admin_token}"} if admin_token else {}
    base = router.rstrip("/")
    try:  # (httpx connects to port 99999 and says "connection refused")
        urllib.parse.urlsplit(base).port  # noqa: B018 (it checks)
    except ValueError as exc:
        raise CommandError(
            f"cannot reach the router at {base} (not a usable URL: {exc}); check --router"
        ) from None
    # Connected but not answered whole in time: the router may be busy with the
    # change itself (a join waits for the node's readiness), so a change asked
    # for may still be made. It said "cannot reach the router" and blamed
    # --router while the router was waiting on the node (an exploratory tester).
    # (`rules FILE` said to see `nodes list`, which shows no rules: a tester)
    section = path.removeprefix("/admin/").partition("/")[0]
    shows = section if section in ("rules", "config") else "nodes list"
    late = CommandError(
        f"the router at {base} gave no whole answer within --timeout {timeout:g} s"
        + (
            f"; the change may still be made: see `ringlimit {shows}`"
            if method != "GET"
            else "; check that the router is running and not paused"
        )
    )
    try:
        response = _within(
            timeout, late, lambda: _fetch(base + path, method, body, headers, timeout)
        )
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        if isinstance(exc, httpx.TimeoutException) and not isinstance(exc, httpx.ConnectTimeout):
            raise late from None
        raise CommandError(
            f"cannot reach the router at {base} ({_http_problem(exc)}); "
            "check --router and that the router is running"
        ) from None
    data = _json_object(response)
    status = response.status_code
    if status != 200 and data is not None and _is_admin_error(data):
        hint = ""
        if status == 401:
            hint = f" ({command} sends RINGLIMIT_ADMIN_TOKEN from the environment)"
        elif status == 404 and urllib.parse.urlsplit(base).path not in ("", "/"):
            # `--router http://host:port/admin` said only "not_found: Not Found".
            hint = " (check --router: the router's URL, without a path)"
        detail = data.get("detail")
        said = one_line(data["error"]) + ("" if detail is None else f": {one_line(str(detail))}")
        print(f"ringlimit: {said}{hint}", file=sys.stderr)
        return 1
    try:
        if status != 200 or data is None or data.get("error") in _LIMITED_PATH_ERRORS:
            raise ValueError("not an admin API's answer")
        printed = lines(data)
    except (ValueError, KeyError, TypeError):
        raise CommandError(
            f"{base} answered HTTP {status}, not as a ringlimit router's admin API "
            f"({excerpt(response)}); check --router (the router's URL, not a node's)"
        ) from None
    print("\n".join(printed))
    if isinstance(data.get("warning"), str):
        print(f"ringlimit: warning: {one_line(data['warning'])}", file=sys.stderr)
    return 0


def _fetch(
    url: str, method: str, body: Any, headers: dict[str, str], timeout: float
) -> httpx.Response:
    """One admin call's whole answer (at most MAX_ADMIN_ANSWER bytes)."""
    import httpx

    with (
        # Connecting gets half the time, so a router that cannot be reached (its
        # packets dropped) is said as such before the whole answer's deadline.
        httpx.Client(
            timeout=httpx.Timeout(timeout, connect=min(timeout / 2, 10.0)), headers=headers
        ) as client,
        client.stream(method, url, json=body) as streamed,
    ):
        content = bytearray()
        for chunk in streamed.iter_bytes():
            content += chunk
            if len(content) > MAX_ADMIN_ANSWER:
                raise CommandError(
                    f"{url} answered more than {MAX_ADMIN_ANSWER} bytes; check --router"
                )
    # (Decoded already: the content type alone, for its charset.)
    kept = [(k, v) for k, v in streamed.headers.multi_items() if k.lower() == "content-type"]
    return httpx.Response(streamed.status_code, headers=kept, content=bytes(content))


def _within(seconds: float, late: Exception, call: Callable[[], Any]) -> Any:
    """``call()``'s result, or ``late`` raised once ``seconds`` have passed.

    httpx's timeouts bound each read, not an answer: a router that sends a
    byte now and then (its status line included) held a command for as long
    as it liked. The call runs in a daemon thread that a command, exiting,
    leaves behind."""
    import threading

    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as exc:  # handed to the caller's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, name="admin-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise late
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _json_object(response: httpx.Response) -> dict[str, Any] | None:
    """The answer's JSON object; None for any other body (not JSON, not UTF-8, a
    list, nested deeper than the parser's recursion: a RecursionError)."""
    try:
        data = response.json()
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def _is_admin_error(data: dict[str, Any]) -> bool:
    """A router's error answer, ``{"error": "code", "detail": ...}``, and not a
    limited path's (a node's, see :data:`_LIMITED_PATH_ERRORS`)."""
    error = data.get("error")
    return isinstance(error, str) and error not in _LIMITED_PATH_ERRORS


#: Errors only a limited path answers (a node's, which takes /admin/... as a
#: request to the app it fronts): a CLI pointed at a node is told so, not these.
_LIMITED_PATH_ERRORS = frozenset({"missing_user_id", "invalid_user_id"})


def _http_problem(exc: Exception) -> str:
    """A short reason for an HTTP failure: 'connection refused', 'timed out', ..."""
    import httpx

    if isinstance(exc, httpx.TimeoutException):
        return "timed out"
    if isinstance(exc, httpx.ConnectError):
        text = str(exc)
        if "refused" in text.lower():
            return "connection refused"
        return f"cannot connect: {text}" if text else "cannot connect"
    if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
        return f"not a usable URL: {exc}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _check_port(host: str, port: int, role: str, *, choose: str = "--port") -> None:
    from router.supervisor import StartError, check_ports

    try:
        check_ports(host, [(port, role)], choose=choose)
    except StartError as exc:
        raise CommandError(str(exc)) from None


def _parse_seed(spec: str) -> Member:
    node_id, sep, url = spec.partition("=")
    if not sep:
        raise ValueError(f"--node {spec!r}: expected ID=http://HOST:PORT")
    try:
        return Member.parse(node_id, url)
    except ValueError as exc:
        raise ValueError(f"--node {spec!r}: {exc}") from None


def _own_urls(host: str, port: int) -> tuple[str, ...]:
    """The URLs a router bound to ``host:port`` answers on (for refusing joins at them)."""
    hosts = {host}
    if host in ("127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""):
        hosts |= {"127.0.0.1", "localhost"}
    return tuple(
        f"{scheme}://{f'[{h}]' if ':' in h else h}:{port}"
        for h in sorted(hosts)
        if h
        for scheme in ("http", "https")
    )


def _warn_no_rules(config: ClusterConfig, args: argparse.Namespace) -> None:
    """A ``--config`` with no ``[[rules]]`` (and no ``--rule``) limits nothing: said
    at start, where it was silent (an empty file started an unlimited cluster;
    ``ringlimit rules FILE`` refuses such a file)."""
    if os.environ.get(SUPERVISOR_ENV):
        return  # `up` said it, naming the user's file (its router reads a copy)
    if not config.rules and not getattr(args, "coordinator", None):  # (etcd's rules, then)
        print(
            f"ringlimit: warning: no rules: {args.config} has no [[rules]] and no --rule "
            "was given, so every request is admitted (add rules, or `ringlimit rules FILE` "
            "later)",
            file=sys.stderr,
        )


def _warn_keep_alive(front_door: FrontDoor) -> None:
    said = front_door.reuse_warning()
    if said is not None:
        print(f"ringlimit: warning: {said}", file=sys.stderr)


def _warn_redis_timeout(
    redis_timeout: float, forward_timeout: float | None, config: ClusterConfig
) -> None:
    """``up`` with a Redis timeout not below its router's forward timeout: while
    Redis hangs the router gives up on the node first, so clients get 504s where
    the node would have answered by its rules' on_error. Said, not refused: each
    value is valid, and a Redis that answers in time never shows it (as the
    keep-alive warning). A router and nodes started apart cannot see both values
    (docs/redis.md says so)."""
    from router.forward import Timeouts

    forward = Timeouts.total if forward_timeout is None else forward_timeout
    if config.backend == "redis" and redis_timeout >= forward:
        print(
            f"ringlimit: warning: --redis-timeout {redis_timeout:g} is not below the "
            f"router's --forward-timeout {forward:g}: while Redis hangs, clients get 504 "
            "node_timeout before a node gives up on Redis and answers by on_error; keep "
            "it below",
            file=sys.stderr,
        )


def _warn_modes(config: ClusterConfig) -> None:
    if config.backend == "memory" and config.balance == "round-robin":
        print(
            "ringlimit: round-robin with local limiters: each node counts alone, so a user may "
            "get up to N times the limit. For demonstrations and benchmarks only.",
            file=sys.stderr,
        )


if __name__ == "__main__":
    raise SystemExit(main())
