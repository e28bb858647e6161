"""``ringlimit up``: a router and N node processes on 127.0.0.1, supervised.

Every node is its own process (a node is the single authority for its keys
and must not be split into workers). Nodes start fenced: they refuse every
key until the router, seeded with all of them, pushes the first ring view and
the cluster config, so no node ever decides with rules of its own. Each node
is also started with ``--join`` to the router, which makes SIGTERM to it a
graceful leave (it hands its counters off before it exits) and makes a
restarted node register again.

``up`` is a supervisor, not a tripwire: a node that exits is reported in one
line (how it exited, and what the router did about it, read from the
router's ``GET /admin/ring`` events), the cluster keeps serving, and the node
is restarted under the same id and port per the restart policy
(router/restart.py). Only the router's exit stops the cluster: nothing serves
without it.

The children get their own process group, so a Ctrl-C in the terminal
reaches ``up`` alone, which stops the router first and then the nodes (whose
leave then fails fast instead of shuffling counters between dying nodes);
and they are killed by the kernel if ``up`` itself dies without stopping them.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TextIO
from urllib.parse import quote

import httpx

from node.config import ClusterConfig
from node.security import redact_url
from node.unixsocket import MAX_PATH_BYTES
from router.cli import PROXY_FLAGS, SUPERVISOR_ENV
from router.processes import (
    ChildProcess,
    NotReady,
    StopSignals,
    check_port_free,
    child_env,
    die_with_parent,
    http_probe,
    ringlimit_argv,
    stop_all,
    wait_ready,
)
from router.restart import RestartPolicy, decide, recent_restarts

#: How long ``up`` waits for the router to act on a node's exit before saying it did not.
ACTION_WAIT = 30.0
#: How long a restarted node has to rejoin the ring before ``up`` says it did not.
REJOIN_WAIT = 60.0

CRASH_EFFECTS = {
    "replica": "its users go on from their replicas",
    "reset": "its users start with fresh quotas",
    "conservative": "its users start exhausted until their limits refill",
}


class StartError(Exception):
    """``up`` cannot start: one line that says what and where."""


@dataclass
class Child:
    """One supervised process: its command line, its current process, its restarts."""

    name: str
    argv: list[str]
    #: The running incarnation; None once it exited (until it is restarted).
    process: ChildProcess | None = None
    #: Times (monotonic) of the restarts decided for it.
    restarts: list[float] = field(default_factory=list)
    restart_at: float | None = None
    #: The ring's epoch when this incarnation started (events after it are its own).
    epoch_at_start: int = 0
    #: An exit whose report waits for the router's action: (what, next, epoch, deadline).
    report: tuple[str, str, int, float] | None = None
    #: Waiting for a restarted incarnation to rejoin: (epoch, deadline).
    rejoin: tuple[int, float] | None = None


class Cluster:
    """The processes of ``ringlimit up``, supervised and stopped together."""

    def __init__(
        self,
        router_url: str,
        config: ClusterConfig,
        policy: RestartPolicy,
        *,
        env: dict[str, str] | None = None,
        admin_token: str | None = None,
        out: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.router_url = router_url
        self.config = config
        self.policy = policy
        #: Secrets (the Redis URL may hold a password) go through the environment,
        #: not the command line, where any local user could read them.
        self.env = env
        self.out = out or sys.stderr
        self.clock = clock
        self.router: Child | None = None
        self.nodes: list[Child] = []
        self.admin_token = admin_token
        self._client = httpx.Client(
            timeout=1.0,
            headers={"authorization": f"Bearer {admin_token}"} if admin_token else {},
        )

    # ------------------------------------------------------------------ processes

    def start_router(self, argv: list[str]) -> None:
        self.router = Child("router", argv)
        self._spawn(self.router)

    def start_node(self, name: str, argv: list[str]) -> None:
        child = Child(name, argv)
        self.nodes.append(child)
        self._spawn(child)

    def _spawn(self, child: Child) -> None:
        child.process = ChildProcess(
            child.name,
            ringlimit_argv(*child.argv),
            env=child_env(self.env),
            preexec_fn=die_with_parent(os.getpid()),  # up runs no threads: safe
        )

    def _children(self) -> list[Child]:
        return [*([self.router] if self.router else []), *self.nodes]

    def stop(self, timeout: float = 10.0, *, drain: float = 0.0) -> None:
        """The router first, so no request reaches a node that is going away; then
        the nodes, with SIGHUP: they exit without a leave, there being nobody left
        to hand their counters to (SIGTERM would try, and fail, to leave). The
        router's ``drain`` (``--grpc-drain``) comes on top of its time: it was
        killed in the middle of a drain longer than ``timeout`` (a review)."""
        if self.router is not None and self.router.process is not None:
            stop_all([self.router.process], timeout + drain)
        stop_all([c.process for c in self.nodes if c.process is not None], timeout, signal.SIGHUP)
        self._client.close()

    def failed(self) -> str | None:
        """Why the cluster cannot start or go on (a child exited), else None."""
        for child in self._children():
            if child.process is not None and not child.process.alive():
                return f"{child.name} {child.process.exit_text()}"
        return None

    def pids(self) -> dict[str, int]:
        return {c.name: c.process.pid for c in self._children() if c.process is not None}

    # ------------------------------------------------------------------ supervising

    def supervise(self) -> str | None:
        """One round: report exits, restart nodes when due, follow rejoins.

        Returns why the cluster must stop (the router exited), else None.
        """
        now = self.clock()
        router = self.router.process if self.router is not None else None
        if router is not None and not router.alive():
            return f"the {router.describe()}"
        ring: dict[str, Any] | None = None
        for child in self.nodes:
            if child.process is not None and not child.process.alive():
                ring = self._ring()
                self._exited(child, ring, now)
        for child in self.nodes:
            if child.restart_at is not None and now >= child.restart_at:
                self._restart(child, ring if ring is not None else self._ring())
        if any(c.report is not None or c.rejoin is not None for c in self.nodes):
            ring = self._ring()
            for child in self.nodes:
                self._follow(child, ring, now)
        return None

    def _exited(self, child: Child, ring: dict[str, Any] | None, now: float) -> None:
        assert child.process is not None
        what = child.process.describe()
        code = child.process.returncode
        child.process = None
        child.rejoin = None
        event = _last_event(ring, child.name, child.epoch_at_start)
        in_ring = _in_ring(ring, child.name)
        graceful = code == 0 and event is not None and event.get("kind") == "left" and not in_ring
        child.restarts = recent_restarts(self.policy, child.restarts, now)
        decision = decide(self.policy, child.restarts, graceful=graceful, now=now)
        if decision.restart:
            child.restarts.append(now)
            child.restart_at = now + decision.delay
        text = decision.reason
        if event is not None and not in_ring:
            self._say(f"{what}; {self._action(event)}; {text}")
        elif ring is not None and not in_ring:
            # This incarnation never got into the ring (it failed while starting).
            self._say(f"{what} before it joined the ring; {text}")
        elif _only_member(ring, child.name):
            # The router never removes its last member (nobody could take the
            # users): say so now rather than after ACTION_WAIT of waiting for it.
            self._say(
                f"{what}; it is the ring's only node: the router keeps it (there is nobody "
                f"to hand its users to), and requests are answered per on_error until it is "
                f"back; {text}"
            )
        else:
            # The router has not acted yet: it will remove the node on its health
            # checks, or when the restarted node registers (crash, then join).
            child.report = (what, text, _epoch(ring), now + ACTION_WAIT)

    def _restart(self, child: Child, ring: dict[str, Any] | None) -> None:
        child.restart_at = None
        child.epoch_at_start = _epoch(ring)
        child.rejoin = (child.epoch_at_start, self.clock() + REJOIN_WAIT)
        self._spawn(child)

    def _follow(self, child: Child, ring: dict[str, Any] | None, now: float) -> None:
        if child.report is not None:
            what, text, since, deadline = child.report
            event = _first_event(ring, child.name, since, ("crashed", "left"))
            if event is not None:
                child.report = None
                self._say(f"{what}; {self._action(event)}; {text}")
            elif now > deadline:
                child.report = None
                action = (
                    "the router did not answer"
                    if ring is None
                    else f"the router has not removed it within {ACTION_WAIT:g} s"
                )
                self._say(f"{what}; {action}; {text}")
        if child.rejoin is not None and child.report is None:
            since, deadline = child.rejoin
            event = _first_event(ring, child.name, since, ("joined",))
            pid = child.process.pid if child.process is not None else None
            if event is not None:
                child.rejoin = None
                self._say(
                    f"{child.name} is back (pid {pid}): rejoined the ring at epoch {event['epoch']}"
                )
            elif now > deadline:
                child.rejoin = None
                self._say(
                    f"{child.name} (pid {pid}) restarted but has not rejoined the ring "
                    f"within {REJOIN_WAIT:g} s"
                )

    def _action(self, event: dict[str, Any]) -> str:
        """What the router did, in words, from one of its membership events."""
        epoch = event.get("epoch")
        if event.get("kind") == "left":
            moved = (
                "with their counters (in Redis)"
                if self.config.backend == "redis"
                else "with their counters (handoff)"
                if self.config.policies.rebalance == "handoff"
                else "with fresh counters (rebalance policy reset)"
            )
            return (
                f"it left the ring gracefully at epoch {epoch}: its users moved to the "
                f"other nodes {moved}"
            )
        return f"the router removed it as crashed at epoch {epoch}: {self._crash_effect()}"

    def _crash_effect(self) -> str:
        if self.config.backend == "redis":
            # The counts are Redis's; a node held none (crash policies are the
            # in-memory nodes').
            return "its users' counters are in Redis, kept"
        policies = {s.rule.crash_policy or self.config.policies.crash for s in self.config.rules}
        policies = policies or {self.config.policies.crash}
        if len(policies) == 1:
            policy = next(iter(policies))
            return f"crash policy {policy}, {CRASH_EFFECTS.get(policy, 'see docs/rebalancing.md')}"
        per_rule = ", ".join(
            f"{s.rule.name}={s.rule.crash_policy or self.config.policies.crash}"
            for s in self.config.rules
        )
        return f"crash policies {per_rule} (docs/rebalancing.md)"

    def _ring(self) -> dict[str, Any] | None:
        try:
            response = self._client.get(f"{self.router_url}/admin/ring")
            data = response.json()
        except (httpx.HTTPError, ValueError):
            return None
        return data if response.status_code == 200 and isinstance(data, dict) else None

    def _say(self, line: str) -> None:
        print(f"ringlimit: {line}", file=self.out, flush=True)


def _events(ring: dict[str, Any] | None) -> list[dict[str, Any]]:
    events = ring.get("events") if ring else None
    return [e for e in events if isinstance(e, dict)] if isinstance(events, list) else []


def _epoch(ring: dict[str, Any] | None) -> int:
    epoch = ring.get("epoch") if ring else None
    return epoch if isinstance(epoch, int) else 0


def _last_event(ring: dict[str, Any] | None, node: str, since: int) -> dict[str, Any] | None:
    """The router's newest event about ``node`` at an epoch after ``since`` (each
    change makes a new epoch, so epochs order the events)."""
    found = [e for e in _events(ring) if e.get("node") == node and e.get("epoch", 0) > since]
    return found[-1] if found else None


def _first_event(
    ring: dict[str, Any] | None, node: str, since: int, kinds: Iterable[str]
) -> dict[str, Any] | None:
    kinds = tuple(kinds)
    for event in _events(ring):
        if (
            event.get("node") == node
            and event.get("epoch", 0) > since
            and event.get("kind") in kinds
        ):
            return event
    return None


def _only_member(ring: dict[str, Any] | None, node: str) -> bool:
    """Whether ``node`` is the one member of the ring (joining ones aside)."""
    nodes = ring.get("nodes") if ring else None
    members = (
        [n for n in nodes if isinstance(n, dict) and n.get("state") != "joining"]
        if isinstance(nodes, list)
        else []
    )
    return len(members) == 1 and members[0].get("id") == node


def _in_ring(ring: dict[str, Any] | None, node: str) -> bool:
    nodes = ring.get("nodes") if ring else None
    return isinstance(nodes, list) and any(
        isinstance(n, dict) and n.get("id") == node and n.get("state") != "joining" for n in nodes
    )


# ---------------------------------------------------------------------- preflight


#: What a --grpc-port is for, in the one line saying it is taken.
GRPC_ROLE = "Envoy's rate limit service"


def check_ports(
    host: str, ports: Iterable[tuple[int, str]], choose: str = "--port, --node-port"
) -> None:
    """Each port must be free, and asked for once, else one line names it and
    whose it was to be."""
    ports = list(ports)
    wanted: dict[int, str] = {}
    for port, role in ports:
        if port in wanted:
            raise StartError(
                f"port {port} is asked for both {wanted[port]} and {role}; "
                f"choose another port ({choose})"
            )
        wanted[port] = role
    for port, role in ports:
        try:
            check_port_free(host, port)
        except OSError as exc:
            raise StartError(
                f"cannot listen on {host}:{port} for {role}: {exc.strerror or exc}; "
                f"stop what uses it or choose another port ({choose})"
            ) from None


def check_redis(url: str) -> None:
    """``up --backend redis`` with no Redis there is a mistake: say so at once."""
    import redis
    from redis.exceptions import AuthenticationError, AuthorizationError, NoPermissionError

    from node.redis_backend import KEY_PREFIX, PROTOCOL, check_url_options

    try:
        check_url_options(url)
    except ValueError as exc:
        raise StartError(str(exc)) from None
    # (check_url_options has built a connection from it: a URL that is not one
    # is said there.)
    client = redis.Redis.from_url(
        url, socket_connect_timeout=2.0, socket_timeout=2.0, protocol=PROTOCOL
    )
    where = redact_url(url)
    try:
        try:
            client.ping()
            # What a node's probe writes: a read-only replica answers PING, and
            # every check then fell to the nodes' local limiters (a tester).
            client.set(f"{KEY_PREFIX}:probe", b"1", px=1000)
        finally:
            client.close()
    except (AuthenticationError, AuthorizationError) as exc:
        # (A ConnectionError to redis-py: it said "cannot reach" a Redis that answered.)
        raise StartError(
            f"Redis at {where} refused the credentials ({type(exc).__name__}: {exc}); "
            "check the user and password in --redis-url (RINGLIMIT_REDIS_URL)"
        ) from None
    except NoPermissionError as exc:  # the user's ACL, not its password
        raise StartError(
            f"Redis at {where} refused the user a command or key ({exc}); check its ACL: "
            f"ringlimit needs PING, SET, EVALSHA and SCRIPT LOAD on keys '{KEY_PREFIX}:*'"
        ) from None
    except redis.ReadOnlyError as exc:
        raise StartError(
            f"Redis at {where} takes no writes ({exc}): a read-only replica? point "
            "--redis-url (RINGLIMIT_REDIS_URL) at its primary"
        ) from None
    except redis.ResponseError as exc:
        raise StartError(f"Redis at {where} refused ringlimit's probe ({exc})") from None
    except (redis.RedisError, OSError, ValueError) as exc:
        raise StartError(
            f"cannot reach Redis at {where} ({type(exc).__name__}: {exc}); "
            "start redis-server or point --redis-url (RINGLIMIT_REDIS_URL) at one"
        ) from None


# ---------------------------------------------------------------------- run


def run_cluster(args: argparse.Namespace, config: ClusterConfig) -> int:
    """``ringlimit up``: start, supervise until asked to stop (or the router exits), stop."""
    host = "127.0.0.1"
    first_node_port = args.node_port or args.port + 1
    ports = [(args.port, "the router")]
    ports += [(first_node_port + i, f"node n{i + 1}") for i in range(args.nodes)]
    if args.grpc_port:
        ports.append((args.grpc_port, GRPC_ROLE))
    check_ports(
        host, ports, "--port, --node-port, --grpc-port" if args.grpc_port else "--port, --node-port"
    )
    if config.backend == "redis":
        check_redis(args.redis_url)
    policy = RestartPolicy(mode=args.restart, max_restarts=args.max_restarts)
    router_url = f"http://{host}:{args.port}"
    workdir, lock = make_workdir()
    config_file = workdir / "cluster.json"
    config_file.write_text(json.dumps(config.to_dict()))
    cluster = Cluster(
        router_url,
        config,
        policy,
        env={
            **os.environ,
            SUPERVISOR_ENV: "ringlimit up",
            "RINGLIMIT_REDIS_URL": args.redis_url,
            "RINGLIMIT_REDIS_PIPELINE": args.redis_pipeline,
            "RINGLIMIT_REDIS_TIMEOUT": str(args.redis_timeout),
        },
        admin_token=os.environ.get("RINGLIMIT_ADMIN_TOKEN") or None,
    )
    signals = StopSignals()
    try:
        seeds = []
        for i in range(args.nodes):
            node_id, port = f"n{i + 1}", first_node_port + i
            cluster.start_node(node_id, _node_argv(args, config, node_id, host, port, config_file))
            seeds.append(f"{node_id}=http://{host}:{port}")
        cluster.start_router(_router_argv(args, config, host, config_file, seeds))
        ring = _wait_for_ring(router_url, cluster, lambda: signals.stopping)
        if ring is None:
            if signals.stopping:
                return 0  # asked to stop while starting (Ctrl-C, SIGTERM): not a failure
            reason = cluster.failed() or "not ready within 30 s"
            print(f"ringlimit: the cluster did not start: {reason}", file=sys.stderr)
            return 1
        envoy = (
            f"{host}:{args.grpc_port}  config {', '.join(args.envoy_config)}"
            if getattr(args, "grpc_port", None)
            else None
        )
        _print_banner(router_url, ring, config, cluster.pids(), policy, envoy)
        while not signals.stopping:
            problem = cluster.supervise()
            if problem:
                print(f"ringlimit: {problem}; stopping the cluster", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        signals.say()
        cluster.stop(drain=getattr(args, "grpc_drain", None) or 0.0)
        signals.restore()
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()
        lock.close()


#: ``up``'s working folder (its cluster.json, which restarted children read) is
#: ``ringlimit-<pid>-<random>`` in the temporary directory.
WORKDIR_PREFIX = "ringlimit-"
#: The file in it that ``up`` holds locked (flock) while it runs.
WORKDIR_LOCK = "lock"
#: A folder still under its hidden name this many seconds after it was made
#: belongs to an ``up`` that died making it (one names it at once).
HIDDEN_GRACE = 60.0
#: What ``up`` writes in it: a folder holding anything else is not removed.
WORKDIR_FILES = frozenset({"cluster.json", WORKDIR_LOCK})
#: ... and its nodes' Unix sockets (``n1.sock``: node/unixsocket.py).
SOCKET_SUFFIX = ".sock"
_NODE_SOCKET = re.compile(r"n[0-9]+" + re.escape(SOCKET_SUFFIX))


def make_workdir(root: Path | None = None) -> tuple[Path, IO[bytes]]:
    """A working folder for this ``up`` and its lock, held until ``up`` closes it,
    after removing those of ``up`` processes that are gone: one killed with
    SIGKILL (or by the OOM killer) cannot remove its own, and each such stop
    left one behind. A folder is removed only if it is this user's, holds
    nothing ``up`` did not write, and its lock can be taken: the kernel lets it
    go with the process that held it, whatever pid namespace that ran in (an
    ``up`` in another container sharing /tmp names a pid this one cannot see:
    the review). A folder of a version without the lock goes by its pid. So
    does one still under its hidden name (an up killed between making and
    naming it), once it is :data:`HIDDEN_GRACE` seconds old."""
    root = Path(tempfile.gettempdir()) if root is None else root
    for folder in [*root.glob(f"{WORKDIR_PREFIX}*-*"), *root.glob(f".{WORKDIR_PREFIX}*-*")]:
        unnamed = folder.name.startswith(".")
        pid = folder.name[len(WORKDIR_PREFIX) + unnamed :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        if unnamed and (_running(int(pid)) or not _made_before(folder, HIDDEN_GRACE)):
            continue  # (an up making it: named within microseconds, its lock not yet held)
        _remove_workdir(folder, int(pid))
    # Made under a name no sweep reads, and named only once its lock is held:
    # another up starting at the same moment found the lock file not yet locked
    # and removed the folder (the review).
    hidden = Path(tempfile.mkdtemp(prefix=f".{WORKDIR_PREFIX}{os.getpid()}-", dir=root))
    lock = open(hidden / WORKDIR_LOCK, "wb")  # noqa: SIM115 (held while up runs)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    workdir = hidden.with_name(hidden.name[1:])
    os.rename(hidden, workdir)
    return workdir, lock


def _made_before(folder: Path, seconds: float) -> bool:
    """Whether ``folder`` was last changed more than ``seconds`` ago."""
    try:
        return time.time() - folder.stat().st_mtime > seconds
    except OSError:
        return False


def _abandoned(folder: Path, pid: int) -> bool:
    """Whether no running ``up`` holds ``folder``: its lock can be taken (or,
    without one, ``pid`` does not run)."""
    try:
        with open(folder / WORKDIR_LOCK, "rb") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True  # (let go as the file closes)
    except FileNotFoundError:
        return not _running(pid)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's: running
        return True
    return True


def _written_by_up(path: Path) -> bool:
    """A file ``up`` writes in its folder, or a node's socket there (left by a
    node killed with its ``up``)."""
    if path.name in WORKDIR_FILES:
        return path.is_file()
    return bool(_NODE_SOCKET.fullmatch(path.name)) and path.is_socket()


def _remove_workdir(folder: Path, pid: int) -> None:
    """Remove ``folder`` if it is this user's, holds only what ``up`` writes and
    no running ``up`` holds it."""
    try:
        if folder.is_symlink() or folder.stat().st_uid != os.getuid():
            return
        files = list(folder.iterdir())
        if not all(_written_by_up(f) for f in files):
            return
        if not _abandoned(folder, pid):
            return
        for f in files:
            f.unlink()
        folder.rmdir()
    except OSError:
        return  # another up removing it too, or a folder it may not read: left as it is


def _node_argv(
    args: argparse.Namespace,
    config: ClusterConfig,
    node_id: str,
    host: str,
    port: int,
    config_file: Path,
) -> list[str]:
    """A node of ``up``: fenced until the router's first push, and joined to it
    (so SIGTERM is a graceful leave and a restarted node registers again)."""
    router_url = f"http://{host}:{args.port}"
    argv = ["node", "--id", node_id, "--port", str(port), "--host", host, "--fenced"]
    argv += ["--join", router_url]
    argv += ["--config", str(config_file), "--backend", config.backend]
    argv += ["--balance", config.balance]
    socket = config_file.parent / f"{node_id}{SOCKET_SUFFIX}"
    if not getattr(args, "no_unix_sockets", False) and len(os.fsencode(socket)) <= MAX_PATH_BYTES:
        # In the run's folder, gone with it; a TMPDIR too long for a socket's
        # path (the kernel takes 107 bytes) leaves the nodes on TCP alone.
        argv += ["--unix-socket", str(socket)]
    if args.upstream:
        argv += ["--upstream", args.upstream, "--upstream-idle", repr(args.upstream_idle)]
        argv += ["--upstream-timeout", repr(args.upstream_timeout)]
    if args.app:
        argv += ["--app", args.app]
    if args.verbose:
        argv += ["--verbose"]
    return argv


def _router_argv(
    args: argparse.Namespace,
    config: ClusterConfig,
    host: str,
    config_file: Path,
    seeds: list[str],
) -> list[str]:
    """The router of ``up``, seeded with every node."""
    argv = ["router", "--port", str(args.port), "--host", host]
    argv += ["--config", str(config_file), "--backend", config.backend]
    argv += ["--balance", config.balance]
    for seed in seeds:
        argv += ["--node", seed]
    if args.state_file:
        argv += ["--state-file", args.state_file]
    if args.workers > 1:
        argv += ["--workers", str(args.workers)]
    if getattr(args, "pipeline", 1) > 1:
        argv += ["--pipeline", str(args.pipeline)]
    if getattr(args, "grpc_port", None) is not None:
        argv += ["--grpc-port", str(args.grpc_port)]
    for envoy_file in getattr(args, "envoy_config", ()):
        argv += ["--envoy-config", str(Path(envoy_file).resolve())]
    if getattr(args, "envoy_headers", None):
        argv += ["--envoy-headers", args.envoy_headers]
    if getattr(args, "grpc_port", None) is not None:
        # No drain by default: `up` runs one router, so Envoy has nowhere to move
        # its calls, and Ctrl-C should stop the cluster at once.
        drain = getattr(args, "grpc_drain", None)
        argv += ["--grpc-drain", repr(0.0 if drain is None else drain)]
    # Passed on as given (the gRPC cap is refused without --grpc-port: cli.py).
    for flag in (*PROXY_FLAGS, "--grpc-max-connections"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            argv += [flag, repr(value)]
    if args.verbose:
        argv += ["--verbose"]
    return argv


def _wait_for_ring(
    url: str, cluster: Cluster, stopping: Callable[[], bool]
) -> dict[str, Any] | None:
    """The router's first ring once it is healthy; None if a child exited, the
    wait took over 30 s, or ``up`` was asked to stop meanwhile."""
    token = cluster.admin_token
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=1.0, headers=headers) as client:
        healthy = http_probe(client, f"{url}/healthz")

        def ring() -> dict[str, Any] | None:
            if not healthy():
                return None
            try:
                found = client.get(f"{url}/admin/ring").json()
            except (httpx.HTTPError, ValueError):
                return None
            ok = isinstance(found, dict) and "epoch" in found and "nodes" in found
            return found if ok else None

        try:
            return wait_ready(
                ring, timeout=30.0, failed=cluster.failed, stopping=stopping, interval=0.1
            )
        except NotReady:
            return None


def _try_command(config: ClusterConfig, url: str) -> str:
    """A request the cluster limits, as its identity asks for the user id: the
    banner said ``-H 'X-User-Id: alice'`` whatever the config, and under a query
    parameter or another header that request was a 400 (an exploratory tester)."""
    identity = config.identity
    if identity.source == "query":
        return f"curl -i '{url}/hello?{quote(identity.name)}=alice'"
    if identity.source == "client":
        return f"curl -i {url}/hello"
    return f"curl -i -H '{identity.name}: alice' {url}/hello"


def _print_banner(
    url: str,
    ring: dict,
    config: ClusterConfig,
    pids: dict[str, int],
    policy: RestartPolicy,
    envoy: str | None = None,
) -> None:
    """``envoy``: where Envoy's rate limit service listens and its files, for
    ``--grpc-port``: its rules are the router's own (named_only), not ``config``'s,
    so without this line the banner said nothing of them."""
    rules = ", ".join(f"{s.rule.name} ({s.rule.algorithm})" for s in config.rules)
    print(f"ringlimit router: {url}   backend={config.backend} balance={config.balance}")
    print(f"rules: {rules or 'none (every request is admitted)'}")
    if envoy is not None:
        print(f"envoy rate limit service (gRPC): {envoy}")
    print(f"ring epoch {ring['epoch']}:")
    shown: set[str] = set()
    for node in ring["nodes"]:
        if node["id"] in shown:
            continue  # a member whose join (sent again by its node) is still in flight
        shown.add(node["id"])
        pid = pids.get(node["id"])
        state = node.get("state")
        said = f"  ({state})" if state not in (None, "active") else ""
        print(f"  {node['id']}  {node['url']}  weight={node['weight']}  pid={pid}{said}")
    restarted = {
        "always": "reported and restarted",
        "on-crash": "reported, and restarted unless they left gracefully",
        "never": "reported, not restarted",
    }[policy.mode]
    print(
        f"nodes that exit are {restarted} (--restart {policy.mode}, at most "
        f"{policy.max_restarts} per {policy.window:g} s); SIGTERM to a node is a graceful leave"
    )
    print(f"try:  {_try_command(config, url)}     (Ctrl-C stops everything)")
    sys.stdout.flush()
