"""``ringlimit up`` as a supervisor, as real processes: a node killed with -9 or
SIGTERM is reported in one line, the cluster keeps serving, the node comes back,
and every user's count stays exact.

``up`` runs in its own session; it stops every child on SIGTERM, its children
die with it if it is killed (PR_SET_PDEATHSIG), and the test still kills every
process it saw as a last resort.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.processes import ROOT, free_block, wait_for
from tests.test_cli import alive, children_of

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not os.path.isdir("/proc"), reason="needs /proc to find child processes"),
]

LIMIT = 5


class Up:
    """A ``ringlimit up`` subprocess, its output in a file, and every pid it ever had."""

    def __init__(
        self,
        tmp: Path,
        port: int,
        *extra: str,
        env: dict[str, str] | None = None,
        nodes: int = 3,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tmp / "up.log"
        argv = ["up", "--nodes", str(nodes), "--port", str(port), *extra]
        with open(self.log, "wb") as out:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "router", *argv],
                cwd=ROOT,
                # TMPDIR: the test's own (``up`` killed with -9 cannot remove its
                # folder there, and /tmp collected one per run).
                env={**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp), **(env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.seen: set[int] = set()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def pid_of(self, name: str) -> int | None:
        """The pid of the child running ``name`` (a node id, or 'router')."""
        for pid in children_of(self.popen.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            self.seen.add(pid)
            named = (name == "router" and b"router" in argv[3:4]) or name.encode() in argv
            if named and alive(pid):
                return pid
        return None

    def wait_output(self, pattern: str, timeout: float) -> re.Match[str]:
        found = wait_for(lambda: re.search(pattern, self.output(), re.M), timeout, 0.1)
        match = re.search(pattern, self.output(), re.M)
        assert found and match, f"no {pattern!r} in:\n{self.output()}"
        return match

    def stop(self) -> int | None:
        """SIGTERM to ``up`` alone; then, whatever happened, nothing of it is left."""
        for name in ("router", "n1", "n2", "n3"):
            self.pid_of(name)
        code = None
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            code = self.popen.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)
        gone = wait_for(lambda: not any(alive(pid) for pid in self.seen), 10)
        for pid in self.seen:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        assert gone, f"processes left running: {[p for p in self.seen if alive(p)]}"
        return code


@pytest.fixture
def up_factory(tmp_path: Path) -> Iterator[list[Up]]:
    started: list[Up] = []
    try:
        yield started
    finally:
        for up in started:
            with contextlib.suppress(Exception):
                up.stop()


def send(client: httpx.Client, user: str) -> httpx.Response:
    return client.get(f"/sv/{user}", headers={"X-User-Id": user})


def line_for(up: Up, pattern: str, timeout: float = 60.0) -> str:
    match = up.wait_output(pattern, timeout)
    return match.group(0)


def test_up_survives_kill_9_and_sigterm_of_nodes_with_exact_counts(
    tmp_path: Path, up_factory: list[Up]
) -> None:
    port = free_block(4)
    up = Up(
        tmp_path,
        port,
        *("--rule", f"{LIMIT}/hour", "--algorithm", "sliding_log", "--on-error", "closed"),
    )
    up_factory.append(up)
    up.wait_output(r"^try:", 60)
    assert up.popen.poll() is None, up.output()
    allowed: dict[str, int] = {}
    owner: dict[str, str] = {}
    with httpx.Client(base_url=up.url, timeout=10.0) as client:
        # Exhausted users (all 5 spent, and one more refused) and half-used ones (2 of 5).
        exhausted = [f"sv-x-{i}" for i in range(45)]
        half = [f"sv-h-{i}" for i in range(30)]
        for user in exhausted:
            codes = [send(client, user) for _ in range(LIMIT + 1)]
            assert [r.status_code for r in codes] == [200] * LIMIT + [429], user
            owner[user] = codes[0].headers["x-ringlimit-node"]
            allowed[user] = LIMIT
        for user in half:
            codes = [send(client, user) for _ in range(2)]
            assert [r.status_code for r in codes] == [200, 200], user
            owner[user] = codes[0].headers["x-ringlimit-node"]
            allowed[user] = 2
        assert {owner[u] for u in exhausted} == {"n1", "n2", "n3"}, "users cover every node"
        # Replication (every 0.1 s) lands before the crash: the replica bound of
        # docs/rebalancing.md (what n2 admitted in its last interval) is then 0.
        time.sleep(1.0)

        # --- kill -9 of n2: reported, the cluster keeps serving, n2 comes back.
        victim = up.pid_of("n2")
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = next(u for u in exhausted if owner[u] == "n1")
        served = [send(client, survivor).status_code for _ in range(3)]
        assert served == [429] * 3, "n1's users are served while n2 is down"
        report = line_for(up, rf"^ringlimit: n2 \(pid {victim}\) killed by SIGKILL; .*$")
        reported = time.monotonic() - killed_at
        assert "removed it as crashed" in report and "crash policy replica" in report, report
        assert "restarting it in 0.5 s (restart 1 of at most 5" in report, report
        back = line_for(up, r"^ringlimit: n2 is back \(pid (\d+)\): rejoined the ring at .*$")
        crash_back = time.monotonic() - killed_at
        assert str(victim) not in back
        for user in exhausted:
            assert send(client, user).status_code == 429, (user, owner[user])
        for user in half:
            assert send(client, user).status_code == 200, user
            allowed[user] += 1

        # --- SIGTERM of n3, then of n1: graceful leaves (handoff), each reported,
        # each node back before the next goes: a rolling restart of the rest.
        timings = []
        for name in ("n3", "n1"):
            leaver = up.pid_of(name)
            assert leaver is not None
            os.kill(leaver, signal.SIGTERM)
            termed_at = time.monotonic()
            report = line_for(up, rf"^ringlimit: {name} \(pid {leaver}\) exited with code 0; .*$")
            left = time.monotonic() - termed_at
            assert "left the ring gracefully" in report and "with their counters" in report
            assert "restarting it" in report, report
            line_for(up, rf"^ringlimit: {name} is back \(pid \d+\): rejoined the ring at .*$")
            timings.append((left, time.monotonic() - termed_at))
            for user in exhausted:
                assert send(client, user).status_code == 429, (user, owner[user])
            for user in half:
                assert send(client, user).status_code == 200, (user, owner[user])
                allowed[user] += 1
        for user in half:
            assert send(client, user).status_code == 429, (user, owner[user])
        ring = client.get("/admin/ring").json()
    assert sorted(n["id"] for n in ring["nodes"]) == ["n1", "n2", "n3"]
    # After the seeds' first view (epoch 1): the crash, the rejoin, two leaves and rejoins.
    events = [(e["kind"], e["node"]) for e in ring["events"] if e["epoch"] > 1]
    assert events == [
        ("crashed", "n2"),
        ("joined", "n2"),
        ("left", "n3"),
        ("joined", "n3"),
        ("left", "n1"),
        ("joined", "n1"),
    ]
    assert all(count == LIMIT for count in allowed.values())
    print(
        f"\nkill -9: reported after {reported:.1f} s, back after {crash_back:.1f} s; "
        + "".join(f"SIGTERM: reported after {a:.1f} s, back after {b:.1f} s; " for a, b in timings)
        + f"{len(allowed)} users, {sum(allowed.values())} admitted "
        f"(expected {LIMIT * len(allowed)})"
    )
    assert "Traceback" not in up.output()
    # The router's exit is the one that stops the cluster: one line, exit 1, no
    # process left (SIGTERM to `up` is tests/test_cli.py's).
    router = up.pid_of("router")
    assert router is not None
    os.kill(router, signal.SIGKILL)
    line_for(
        up, rf"^ringlimit: the router \(pid {router}\) killed by SIGKILL; stopping the cluster$"
    )
    assert up.popen.wait(30) == 1
    assert up.stop() == 1


def test_up_with_restart_never_reports_the_health_check_removal_and_dies_with_its_children(
    tmp_path: Path, up_factory: list[Up]
) -> None:
    port = free_block(4)
    up = Up(tmp_path, port, "--restart", "never", "--rule", f"{LIMIT}/hour")
    up_factory.append(up)
    up.wait_output(r"^try:", 60)
    assert "reported, not restarted (--restart never" in up.output()
    with httpx.Client(base_url=up.url, timeout=10.0) as client:
        users = [f"sv-n-{i}" for i in range(12)]
        owners = {u: send(client, u).headers["x-ringlimit-node"] for u in users}
        time.sleep(1.0)
        victim = up.pid_of("n2")
        assert victim is not None
        os.kill(victim, signal.SIGKILL)
        report = line_for(up, rf"^ringlimit: n2 \(pid {victim}\) killed by SIGKILL; .*$")
        assert "removed it as crashed at epoch 2" in report, report
        assert report.endswith("not restarted (--restart never)"), report
        assert up.pid_of("n2") is None
        for user in users:  # n2's users are served by the others, with their replicas
            response = send(client, user)
            assert response.status_code == 200, (user, owners[user])
            assert response.headers["x-ringlimit-node"] in {"n1", "n3"}
    children = [pid for name in ("router", "n1", "n3") if (pid := up.pid_of(name))]
    assert len(children) == 3
    # kill -9 of `up` itself: the kernel stops its children (no orphaned cluster).
    up.popen.send_signal(signal.SIGKILL)
    up.popen.wait(10)
    assert wait_for(lambda: not any(alive(pid) for pid in children), 10), [
        pid for pid in children if alive(pid)
    ]
    # Its working folder is left; the next `up` removes it (one was left per kill).
    left = list(tmp_path.glob(f"ringlimit-{up.popen.pid}-*"))
    assert len(left) == 1 and (left[0] / "cluster.json").is_file(), list(tmp_path.iterdir())
    again = Up(tmp_path, free_block(2), "--rule", f"{LIMIT}/hour", nodes=1)
    up_factory.append(again)
    again.wait_output(r"^try:", 60)
    assert not left[0].exists()
    assert again.stop() == 0
    assert not list(tmp_path.glob("ringlimit-*"))  # its own, removed as it stopped


def test_up_with_workers_and_a_token_replaces_every_node_with_exact_counts(
    tmp_path: Path, up_factory: list[Up]
) -> None:
    """``up --workers 2`` with an admin token: a rolling replacement (a new node
    joins through the port, then an old one gets SIGTERM and is not restarted)
    of all three nodes keeps every user's count, whichever worker routes."""
    from tests.processes import Procs, free_port

    token = "up-admin-secret"
    env = {"RINGLIMIT_ADMIN_TOKEN": token}
    port = free_block(4)
    up = Up(
        tmp_path,
        port,
        *("--workers", "2", "--restart", "on-crash"),
        *("--rule", f"{LIMIT}/hour", "--algorithm", "sliding_log", "--on-error", "closed"),
        env=env,
    )
    up_factory.append(up)
    up.wait_output(r"^try:", 60)
    assert "ring epoch 1:" in up.output() and token not in up.output()
    procs = Procs(tmp_path)
    procs.env.update(env)
    try:
        allowed: dict[str, int] = {}
        routers: set[str] = set()
        users = [f"sv-r-{i}" for i in range(40)]

        def spend(client: httpx.Client, times: int) -> None:
            for user in users:
                for _ in range(times):
                    response = send(client, user)
                    assert response.status_code in (200, 429), response.text
                    routers.add(response.headers.get("x-ringlimit-router", "?"))
                    allowed[user] = allowed.get(user, 0) + (response.status_code == 200)

        # A new connection per request: the kernel spreads them over both workers.
        limits = httpx.Limits(max_keepalive_connections=0)
        with httpx.Client(base_url=up.url, timeout=10.0, limits=limits) as client:
            spend(client, 2)
            for old, new in (("n1", "n4"), ("n2", "n5"), ("n3", "n6")):
                procs.node(new, free_port(), "--join", up.url)
                assert wait_for(lambda new=new: new in _ids(up.url, token), 30.0), _ids(
                    up.url, token
                )
                leaver = up.pid_of(old)
                assert leaver is not None
                os.kill(leaver, signal.SIGTERM)
                report = line_for(
                    up, rf"^ringlimit: {old} \(pid {leaver}\) exited with code 0; .*$"
                )
                assert "left the ring gracefully" in report and "not restarted" in report, report
                spend(client, 1)
            spend(client, 3)  # 2 + 3 + 3 = 8 asked, LIMIT = 5 granted
        assert _ids(up.url, token) == ["n4", "n5", "n6"]
        assert routers == {"w0", "w1"}, routers
        assert all(count == LIMIT for count in allowed.values()), {
            u: n for u, n in allowed.items() if n != LIMIT
        }
        assert "Traceback" not in up.output()
    finally:
        procs.stop_all()


def _ids(url: str, token: str) -> list[str]:
    try:
        ring = httpx.get(
            f"{url}/admin/ring", headers={"authorization": f"Bearer {token}"}, timeout=5.0
        ).json()
        return sorted(n["id"] for n in ring["nodes"] if n["state"] == "active")
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def test_up_says_at_once_that_its_only_node_is_kept(tmp_path: Path, up_factory: list[Up]) -> None:
    """The router never removes its last member; ``up`` used to wait 30 s for a
    removal that could not come before saying anything."""
    port = free_block(2)
    up = Up(tmp_path, port, "--restart", "never", "--rule", f"{LIMIT}/hour", nodes=1)
    up_factory.append(up)
    up.wait_output(r"^try:", 60)
    victim = up.pid_of("n1")
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    killed = time.monotonic()
    report = line_for(up, rf"^ringlimit: n1 \(pid {victim}\) killed by SIGKILL; .*$", 20.0)
    assert time.monotonic() - killed < 10.0
    assert "it is the ring's only node: the router keeps it" in report, report
    assert report.endswith("not restarted (--restart never)"), report


@pytest.mark.parametrize(
    ("backend", "crashed", "left"),
    [
        ("memory", "crash policy replica, its users go on from their replicas", "(handoff)"),
        ("redis", "its users' counters are in Redis, kept", "(in Redis)"),
    ],
)
def test_what_up_says_a_node_exit_did_follows_the_backend(
    backend: str, crashed: str, left: str
) -> None:
    """``up --backend redis`` said a crashed node's users "go on from their
    replicas": a Redis node holds no counts (an exploratory tester)."""
    from dataclasses import replace

    from node.config import ClusterConfig
    from router.restart import RestartPolicy
    from router.supervisor import Cluster

    config = replace(ClusterConfig(), backend=backend)
    cluster = Cluster("http://127.0.0.1:1", config, RestartPolicy())
    try:
        assert cluster._action({"kind": "crashed", "epoch": 4}).endswith(crashed)
        assert left in cluster._action({"kind": "left", "epoch": 5})
    finally:
        cluster._client.close()


def test_the_banner_lists_each_node_once(capsys: pytest.CaptureFixture[str]) -> None:
    """A node whose join was still in flight while it was already a member was in
    /admin/ring twice (a member, and joining): the banner listed it twice."""
    from node.config import ClusterConfig
    from router.restart import RestartPolicy
    from router.supervisor import _print_banner

    node = {"id": "n2", "url": "http://127.0.0.1:2", "weight": 1}
    ring = {
        "epoch": 1,
        "nodes": [
            {"id": "n1", "url": "http://127.0.0.1:1", "weight": 1, "state": "active"},
            {**node, "state": "active"},
            {**node, "state": "joining"},
            {"id": "n3", "url": "http://127.0.0.1:3", "weight": 1, "state": "joining"},
        ],
    }
    _print_banner("http://127.0.0.1:0", ring, ClusterConfig(), {"n2": 7}, RestartPolicy())
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  n")]
    assert lines == [
        "  n1  http://127.0.0.1:1  weight=1  pid=None",
        "  n2  http://127.0.0.1:2  weight=1  pid=7",
        "  n3  http://127.0.0.1:3  weight=1  pid=None  (joining)",
    ]


def test_the_banner_says_where_envoys_service_listens(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/envoy.md starts a local cluster with ``ringlimit up --grpc-port 8081
    --envoy-config edge.yaml``: the banner listed the HTTP port and the --rule
    rules only, nothing of the gRPC port or the Envoy config it serves."""
    from node.config import ClusterConfig
    from router.restart import RestartPolicy
    from router.supervisor import _print_banner

    ring = {"epoch": 1, "nodes": []}
    envoy = "127.0.0.1:8081  config edge.yaml"
    _print_banner("http://127.0.0.1:0", ring, ClusterConfig(), {}, RestartPolicy(), envoy)
    assert f"envoy rate limit service (gRPC): {envoy}" in capsys.readouterr().out.splitlines()


def test_up_removes_a_folder_left_under_its_hidden_name_once_its_up_is_gone(
    tmp_path: Path,
) -> None:
    """An ``up`` makes its folder under a hidden name and names it once its lock
    is held; one killed in between left ``.ringlimit-PID-*`` for good. Removed
    once its pid is gone and it is over a minute old; kept while its pid runs,
    or while it is new (an up in another pid namespace may be naming it)."""
    from router.supervisor import HIDDEN_GRACE, make_workdir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)
    old = time.time() - HIDDEN_GRACE - 5

    def hidden(name: str, age: float | None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "lock").write_bytes(b"")
        if age is not None:
            os.utime(path, (age, age))
        return path

    left = hidden(f".ringlimit-{gone.pid}-a", old)
    new = hidden(f".ringlimit-{gone.pid}-b", None)
    running = hidden(f".ringlimit-{os.getppid()}-c", old)
    foreign = hidden(f".ringlimit-{gone.pid}-d", None)
    (foreign / "notes.txt").write_text("mine")
    os.utime(foreign, (old, old))
    made, own = make_workdir(tmp_path)
    try:
        assert not left.exists()
        assert new.exists() and running.exists() and foreign.exists()
        assert not made.name.startswith(".")
    finally:
        own.close()


def test_up_removes_only_working_folders_of_ups_that_are_gone(tmp_path: Path) -> None:
    """``make_workdir`` removes a folder left by an ``up`` killed with SIGKILL:
    one named with a pid no process has, holding only its cluster.json. A
    folder of a running process, one holding anything else, one whose name is
    not ``up``'s, and a symlink are left as they are."""
    from router.supervisor import make_workdir

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(10)

    def folder(name: str, *files: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        for f in files:
            (path / f).write_text("{}")
        return path

    stale = folder(f"ringlimit-{gone.pid}-a1", "cluster.json")
    empty = folder(f"ringlimit-{gone.pid}-a2")
    running = folder(f"ringlimit-{os.getppid()}-b", "cluster.json")
    foreign = folder(f"ringlimit-{gone.pid}-c", "cluster.json", "notes.txt")
    unnamed = folder("ringlimit-xyz", "cluster.json")
    (tmp_path / f"ringlimit-{gone.pid}-d").symlink_to(running)
    # The lock decides where there is one: held (an up in another pid namespace,
    # whose pid this one cannot see), kept; let go (a pid reused since), removed.
    held = folder(f"ringlimit-{gone.pid}-e", "cluster.json", "lock")
    let_go = folder(f"ringlimit-{os.getppid()}-f", "cluster.json", "lock")
    # A node's socket (left by nodes killed with their up) is up's; a file of
    # that name that is no socket, or a socket of another name, is not.
    with_socket = folder(f"ringlimit-{gone.pid}-g", "cluster.json")
    not_a_socket = folder(f"ringlimit-{gone.pid}-h", "cluster.json", "n1.sock")
    other_socket = folder(f"ringlimit-{gone.pid}-i", "cluster.json")
    for path in (with_socket / "n1.sock", other_socket / "app.sock"):
        with socket.socket(socket.AF_UNIX) as bound:
            bound.bind(str(path))
    with open(held / "lock", "rb") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        made, own = make_workdir(tmp_path)
    try:
        assert made.parent == tmp_path and made.name.startswith(f"ringlimit-{os.getpid()}-")
        assert not stale.exists() and not empty.exists() and not let_go.exists()
        assert not with_socket.exists()
        assert not_a_socket.exists() and other_socket.exists()
        assert running.exists() and foreign.exists() and unnamed.exists() and held.exists()
        assert (running / "cluster.json").exists()
        assert (tmp_path / f"ringlimit-{gone.pid}-d").is_symlink()
        # This up's own folder is held while it runs.
        with open(made / "lock", "rb") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        own.close()
