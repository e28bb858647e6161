"""``ringlimit router --workers N`` (router/workers.py) with real processes on 127.0.0.1.

Two router workers share one public port; users' requests land on either
(``X-Ringlimit-Router`` says which), and the counts stay exact through a join
and a graceful leave made through that port, whichever worker takes them. A
worker killed with SIGKILL is reported and restarted while the other serves.
With ``--coordinator`` the workers are routers of one etcd cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.cli import main
from router.processes import child_env, ringlimit_argv
from router.workers import Supervisor, WorkerRole, bind_public
from tests.processes import Proc, Procs, free_port, wait_for, wait_healthy
from tests.real_cluster import (
    LIMIT,
    USERS,
    Load,
    add_node,
    admin_ring,
    finish,
    gone,
    kill_all,
    report,
    start_cluster,
)
from tests.test_cli import alive

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

RULE = ["--rule", f"api={LIMIT}/minute", "--algorithm", "sliding_log"]
LINE = re.compile(r"worker (\d+) pid (\d+) on \S+, admin (\S+)")


def workers(proc: Proc) -> dict[int, tuple[int, str]]:
    """Worker index -> (pid, admin URL), from the supervisor's lines (latest start wins)."""
    found: dict[int, tuple[int, str]] = {}
    for index, pid, admin in LINE.findall(proc.output()):
        found[int(index)] = (int(pid), admin)
    return found


def both_listening(url: str) -> bool:
    """Both workers answer on the public port. A worker's socket joins the port's
    SO_REUSEPORT group only when it listens (as it starts serving; an etcd
    follower after it has the leader's view): until then the kernel gives every
    connection to the other one, so a load started earlier may never meet it."""
    return {"w0", "w1"} <= set(answered_by(url, 8))


def answered_by(url: str, n: int) -> Counter[str]:
    """Which workers answer ``n`` requests, each on a new connection."""
    seen: Counter[str] = Counter()
    with httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for i in range(n):
            response = client.get(f"{url}/spread", headers={"X-User-Id": f"spread-{i}"})
            assert response.status_code in (200, 429), response.text
            seen[response.headers.get("x-ringlimit-router", "?")] += 1
    return seen


def forwarded_by_worker(exposition: str) -> Counter[str]:
    """``ringlimit_router_forwarded_total`` summed per ``worker`` label."""
    totals: Counter[str] = Counter()
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name == "ringlimit_router_forwarded_total":
                totals[sample.labels["worker"]] += int(sample.value)
    return totals


def test_role_round_trip_and_shared_port() -> None:
    role = WorkerRole(1, 2, 7, 8, "http://127.0.0.1:5", "http://127.0.0.1:4")
    assert WorkerRole.decode(role.encode()) == role
    urls = ("http://127.0.0.1:4", "http://127.0.0.1:5", "http://127.0.0.1:6")
    again = WorkerRole(1, 3, 7, 8, urls[1], urls[0], restarted=True, admin_urls=urls)
    assert WorkerRole.decode(again.encode()) == again
    assert again.fellows == {"w0": urls[0], "w2": urls[2]}
    lead = WorkerRole(0, 2, 7, 8, "http://127.0.0.1:4", None)
    assert WorkerRole.decode(lead.encode()) == lead and lead.name == "w0"
    first = bind_public("127.0.0.1", 0)
    try:
        port = first.getsockname()[1]
        second = bind_public("127.0.0.1", port)  # SO_REUSEPORT: one port, two sockets
        second.close()
    finally:
        first.close()


def _plain_listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


@pytest.mark.parametrize(
    "bind",
    [_plain_listener, lambda: bind_public("127.0.0.1", 0)],
    ids=["plain", "another-group"],
)
def test_a_port_in_use_is_one_line(
    bind: Callable[[], socket.socket], capsys: pytest.CaptureFixture[str]
) -> None:
    """Taken by any listener, or by another ``router --workers`` whose sockets
    share the port (``SO_REUSEPORT``, as this user's first group): that one
    was joined without a word, and two routers, each leading a membership,
    took turns at the clients (an exploratory tester: 503 no_nodes for 6 of
    10 requests)."""
    with bind() as taken:
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["router", "--workers", "2", "--port", str(port)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().count("\n") == 0, err
    assert f"cannot bind 127.0.0.1:{port}" in err and "in use" in err, err


@pytest.mark.parametrize("timeout", ["0.5", "1.5"])
def test_a_worker_timeout_a_loaded_loop_could_outlast_is_refused(timeout: str) -> None:
    """At 1 s a busy worker was killed as hung, once in six runs of wrk -c500 on
    two cores (the day's-end tester). (A subprocess: a regression fails, not hangs.)"""
    port = str(free_port())
    argv = ringlimit_argv("router", "--workers", "2", "--port", port, "--worker-timeout", timeout)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=child_env())
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    expected = f"--worker-timeout {timeout}: must be 0 (never) or at least 2 seconds"
    assert expected in done.stderr, done.stderr


def test_a_worker_timeout_without_workers_is_refused() -> None:
    """A single router has no supervisor: the flag was taken and ignored (and
    the router served: a subprocess, so that a regression fails, not hangs)."""
    argv = ringlimit_argv("router", "--port", str(free_port()), "--worker-timeout", "3")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=child_env())
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "--worker-timeout applies to --workers N" in done.stderr, done.stderr


def test_workers_without_their_etcd_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "router",
            "--workers",
            "2",
            "--port",
            str(free_port()),
            "--coordinator",
            "etcd://127.0.0.1:1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().count("\n") == 0 and "etcd not reachable at 127.0.0.1:1" in err, err


def test_workers_share_one_port_and_one_membership(procs: Procs) -> None:
    cluster = start_cluster(procs, [*RULE, "--workers", "2"], spare=("n4",))
    url = cluster.router
    assert wait_for(lambda: len(workers(cluster.router_proc)) == 2, timeout=10.0)
    started = workers(cluster.router_proc)
    # Both workers route by the ring the nodes joined (through either worker).
    for _, admin in started.values():
        wait_healthy(admin, cluster.router_proc)
        assert wait_for(lambda a=admin: len(admin_ring(a)["nodes"]) == 3, timeout=10.0)
    assert "leader" not in admin_ring(started[0][1])
    assert admin_ring(started[1][1])["leader"] == started[0][1]

    assert wait_for(lambda: both_listening(url), timeout=15.0)
    load = Load([url], fresh_connections=True)
    thread = load.start()
    assert wait_for(lambda: load.progress >= 0.3, timeout=20.0)
    add_node(url, "n4", cluster.urls["n4"])  # through the public port: either worker
    assert wait_for(lambda: load.progress >= 0.55, timeout=20.0)
    cluster.nodes["n2"].popen.send_signal(signal.SIGTERM)  # leaves through the public port
    assert wait_for(lambda: gone(started[0][1], "n2"), timeout=15.0)
    finish(thread, load)
    routers = Counter(s.router for sent in load.log.values() for s in sent)
    statuses = load.statuses()
    report(
        "workers join+leave",
        routers=dict(routers),
        statuses=dict(statuses),
        excess=load.excess(),
        errors=load.errors,
    )
    assert set(routers) == {"w0", "w1"}, routers
    assert load.errors == 0
    assert set(statuses) <= {200, 429}, statuses
    # The public port's /metrics is every worker's, whichever worker takes the scrape.
    # (The first scrape still shows n2's series, once: a departed node's go after it.)
    scrapes = [forwarded_by_worker(httpx.get(f"{url}/metrics", timeout=5.0).text)]
    assert set(scrapes[0]) == {"w0", "w1"}, scrapes
    for _ in range(5):  # a new connection each: either worker takes it
        scrapes.append(forwarded_by_worker(httpx.get(f"{url}/metrics", timeout=5.0).text))
        assert scrapes[-1] == scrapes[1], scrapes
    assert all(scrapes[1][w] > 0 for w in routers), scrapes
    assert load.excess() == 0, load.over()
    assert all(load.allowed(u) == LIMIT for u in USERS)
    # Both workers converge on the final ring (the follower polls the leader).
    final = admin_ring(started[0][1])
    assert [n["id"] for n in final["nodes"]] == ["n1", "n3", "n4"]
    assert wait_for(lambda: admin_ring(started[1][1])["epoch"] == final["epoch"], timeout=5.0)

    # kill -9 of the follower: the port keeps answering, and the worker comes back.
    follower_pid = started[1][0]
    os.kill(follower_pid, signal.SIGKILL)
    seen = answered_by(url, 20)
    assert seen["w0"] > 0 and seen["?"] == 0, seen
    assert wait_for(lambda: workers(cluster.router_proc)[1][0] != follower_pid, timeout=10.0)
    assert "worker 1 killed by signal 9; restarting it" in cluster.router_proc.output()
    restarted = workers(cluster.router_proc)[1]
    assert restarted[1] == started[1][1]  # the same admin URL
    wait_healthy(restarted[1], cluster.router_proc)
    assert wait_for(lambda: "w1" in answered_by(url, 10), timeout=10.0, interval=0.2)
    kill_all(procs)


def test_a_whole_config_applied_at_runtime_reaches_every_worker(procs: Procs) -> None:
    """``PUT /admin/config`` through a --workers group: a follower compared the
    leader's rules alone and kept its own identity, so half the group's answers
    still read the old user-id field (the review of the day's changes: 12 of 20
    fresh connections served, 8 refused 400). Followers now take the leader's
    whole config when its digest differs."""
    cluster = start_cluster(procs, [*RULE, "--workers", "2"])
    url = cluster.router
    assert wait_for(lambda: len(workers(cluster.router_proc)) == 2, timeout=10.0)
    (_, leader), (_, follower) = workers(cluster.router_proc)[0], workers(cluster.router_proc)[1]
    for admin in (leader, follower):
        wait_healthy(admin, cluster.router_proc)
    rules = httpx.get(f"{url}/admin/rules", timeout=5.0).json()["rules"]
    config = {
        "rules": rules,
        "identity": {"name": "X-Account"},
        "privacy": {"show_keys": "hashed", "salt": "pepper"},
    }
    answer = httpx.put(f"{url}/admin/config", json=config, timeout=10.0)
    assert answer.status_code == 200, answer.text
    digest = admin_ring(leader)["config_digest"]
    # (The follower takes the salt too, which GET /admin/config hides.)
    assert wait_for(lambda: admin_ring(follower)["config_digest"] == digest, timeout=5.0)
    shown = httpx.get(f"{follower}/admin/config", timeout=5.0).json()["config"]
    assert shown["privacy"] == {"show_keys": "hashed", "salt": "<hidden>"}
    assert wait_for(lambda: both_listening_as(url, "X-Account"), timeout=10.0)
    seen: Counter[tuple[str, int]] = Counter()
    with httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for i in range(20):
            response = client.get(f"{url}/x", headers={"X-Account": f"acct-{i}"})
            seen[(response.headers.get("x-ringlimit-router", "?"), response.status_code)] += 1
            old = client.get(f"{url}/x", headers={"X-User-Id": f"old-{i}"})
            seen[(old.headers.get("x-ringlimit-router", "?"), old.status_code)] += 1
    assert {status for _, status in seen} == {200, 400}, seen
    assert sum(n for (_, status), n in seen.items() if status == 400) == 20, seen
    assert {router for router, status in seen if status == 200} == {"w0", "w1"}, seen
    kill_all(procs)


def both_listening_as(url: str, field: str) -> bool:
    """Both workers answer, and take the user id from ``field``."""
    seen: set[str] = set()
    with httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for i in range(8):
            response = client.get(f"{url}/spread", headers={field: f"spread-{i}"})
            if response.status_code not in (200, 429):
                return False
            seen.add(response.headers.get("x-ringlimit-router", "?"))
    return {"w0", "w1"} <= seen


def test_a_restarted_leader_keeps_the_ring_and_the_rules_applied_at_runtime(
    procs: Procs,
) -> None:
    """kill -9 of worker 0, the leader of a ring whose nodes joined it (no state
    file, no seeds): the supervisor starts it again, and it routes by the ring
    and the rules the cluster had. It came back with an empty ring (every
    request it took answered 503, and the nodes' leases ran out, so that the
    other worker admitted everything under the default open rule), and pushing
    its flags' rules it dropped a rule applied at runtime (a user refused under
    it was admitted again)."""
    cluster = start_cluster(procs, [*RULE, "--workers", "2"])
    url = cluster.router
    assert wait_for(lambda: len(workers(cluster.router_proc)) == 2, timeout=10.0)
    started = workers(cluster.router_proc)
    leader_pid, leader = started[0]
    _, follower = started[1]
    for admin in (leader, follower):
        wait_healthy(admin, cluster.router_proc)
    ring = admin_ring(leader)
    assert len(ring["nodes"]) == 3
    rules = httpx.get(f"{url}/admin/rules", timeout=5.0).json()["rules"]
    login = {"name": "login", "limit": 2, "period": 60, "paths": ["/login"]}
    answer = httpx.put(f"{url}/admin/rules", json={"rules": [*rules, login]}, timeout=10.0)
    assert answer.status_code == 200, answer.text
    digest = admin_ring(leader)["rules_digest"]
    assert wait_for(lambda: admin_ring(follower)["rules_digest"] == digest, timeout=5.0)
    user = {"X-User-Id": "spent-login"}
    with httpx.Client(timeout=5.0) as client:
        spent = [client.get(f"{url}/login", headers=user).status_code for _ in range(3)]
    assert spent == [200, 200, 429], spent

    os.kill(leader_pid, signal.SIGKILL)
    assert wait_for(lambda: workers(cluster.router_proc)[0][0] != leader_pid, timeout=10.0)
    wait_healthy(leader, cluster.router_proc)
    again = admin_ring(leader)
    assert (again["epoch"], again["nodes"]) == (ring["epoch"], ring["nodes"]), again
    assert again["rules_digest"] == digest
    assert "took the cluster's rules from" in cluster.router_proc.output()
    # Both workers refuse the user spent under the runtime rule, on the nodes' count.
    assert wait_for(lambda: both_listening(url), timeout=10.0)
    seen: Counter[tuple[str, int]] = Counter()
    with httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        for _ in range(20):
            response = client.get(f"{url}/login", headers=user)
            seen[(response.headers.get("x-ringlimit-router", "?"), response.status_code)] += 1
    assert {status for _, status in seen} == {429}, seen
    assert {router for router, _ in seen} == {"w0", "w1"}, seen
    kill_all(procs)


@pytest.mark.parametrize("spoil", ["truncated", "directory"])
def test_a_restarted_leader_carries_on_without_a_usable_state_file(
    procs: Procs, tmp_path: Path, spoil: str
) -> None:
    """kill -9 of worker 0 while its state file cannot be used (cut short by a
    full disk, or its path taken by a directory): the supervisor starts it
    again, and it takes the ring from the other workers and the nodes, with one
    warning naming the file. It died at each start on the file (`not valid
    JSON`, `cannot write ring state`), and after 3 the supervisor stopped every
    worker, the two that were serving too: all traffic refused."""
    state = tmp_path / "state.json"
    # Leases that outlast a slow restart of the leader on a loaded test machine
    # (none renews them meanwhile: the default open rule then admits uncounted).
    flags = [*RULE, "--workers", "3", "--state-file", str(state), "--lease", "15"]
    cluster = start_cluster(procs, flags)
    url = cluster.router
    assert wait_for(lambda: len(workers(cluster.router_proc)) == 3, timeout=10.0)
    started = workers(cluster.router_proc)
    leader_pid, leader = started[0]
    for _, admin in started.values():
        wait_healthy(admin, cluster.router_proc)
    ring = admin_ring(leader)
    assert len(ring["nodes"]) == 3
    users = USERS[:60]
    load = Load([url], users=users, fresh_connections=True)
    thread = load.start()
    assert wait_for(lambda: load.progress >= 0.2, timeout=20.0)
    if spoil == "truncated":
        state.write_text('{"epoch": 3')
    else:
        state.unlink()
        state.mkdir()
    os.kill(leader_pid, signal.SIGKILL)
    killed = time.monotonic()
    assert wait_for(lambda: workers(cluster.router_proc)[0][0] != leader_pid, timeout=10.0)
    wait_healthy(leader, cluster.router_proc)
    finish(thread, load)
    output = cluster.router_proc.output()
    assert cluster.router_proc.alive(), output
    assert "stopping every worker" not in output and "could not start" not in output, output
    again = admin_ring(leader)
    assert (again["epoch"], again["nodes"]) == (ring["epoch"], ring["nodes"]), again
    warned = [line for line in output.splitlines() if f"{state}: cannot read ring state" in line]
    assert len(warned) == 1, output
    if spoil == "truncated":  # written again with the ring it recovered
        assert json.loads(state.read_text())["epoch"] == ring["epoch"]
        assert "warning" not in again
    else:  # said in every admin answer, as for a running router
        assert "the state file was not written" in again["warning"], again
    statuses = load.statuses()
    report("leader restart, unusable state file", statuses=dict(statuses), errors=load.errors)
    assert set(statuses) <= {200, 429}, statuses
    assert load.excess() == 0, load.over()
    # Every user was admitted its limit, on the nodes' counts; or one less: a
    # request the killed worker had passed on was counted, and its answer lost
    # (aiohttp sends an idempotent request again on a connection reset: the
    # client sees 14 answers, one of them for a request counted twice).
    short = {
        u: [(s.status, s.node, s.router, round(s.at - killed, 2)) for s in load.log[u]]
        for u in users
        if load.allowed(u) != LIMIT
    }
    assert all(load.allowed(u) == LIMIT - 1 for u in short), short
    assert len(short) <= 3, short
    kill_all(procs)


@pytest.mark.etcd
def test_workers_on_etcd(procs: Procs, etcd_endpoint: str) -> None:
    """Two workers of one etcd cluster: one leads, admin calls work through the port."""
    started = procs.nodes(["n1", "n2", "n3"], "--fenced")
    seeds = [x for node_id in ("n1", "n2") for x in ("--node", f"{node_id}={started[node_id][1]}")]
    spare = started["n3"][1]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--coordinator", etcd_endpoint, "--cluster", "workers", "--coordinator-ttl", "2"]
    proc = procs.start(
        "router", ["router", "--port", str(port), "--workers", "2", *RULE, *flags, *seeds]
    )
    wait_healthy(url, proc)
    assert wait_for(lambda: len(workers(proc)) == 2, timeout=10.0)
    admins = [admin for _, admin in workers(proc).values()]
    for admin in admins:
        wait_healthy(admin, proc)

    def leaders() -> list[bool]:
        return [admin_ring(a)["coordinator"]["leading"] for a in admins]

    assert wait_for(lambda: sorted(leaders()) == [False, True], timeout=15.0), leaders()
    assert wait_for(lambda: both_listening(url), timeout=15.0)
    users = USERS[:60]
    load = Load([url], users=users, fresh_connections=True)
    thread = load.start()
    assert wait_for(lambda: load.progress >= 0.3, timeout=20.0)
    add_node(url, "n3", spare)
    finish(thread, load)
    epochs = {admin_ring(a)["epoch"] for a in admins}
    routers = Counter(s.router for sent in load.log.values() for s in sent)
    report("workers on etcd", routers=dict(routers), epochs=sorted(epochs), excess=load.excess())
    assert wait_for(lambda: len({admin_ring(a)["epoch"] for a in admins}) == 1, timeout=5.0)
    assert [n["id"] for n in admin_ring(admins[0])["nodes"]] == ["n1", "n2", "n3"]
    assert set(routers) == {"w0", "w1"}, routers
    assert load.errors == 0
    assert load.excess() == 0, load.over()
    assert all(load.allowed(u) == LIMIT for u in users)
    kill_all(procs)


@pytest.mark.parametrize("spoil", ["not json", "under a file"])
def test_a_state_file_the_router_cannot_use_is_one_line_before_any_worker(
    spoil: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As for a single router: worker 0 used to find out, and the supervisor
    restarted it three times (nine lines) before it gave up."""
    state = tmp_path / "ring.json"
    if spoil == "not json":
        state.write_text("not json")
    else:
        (tmp_path / "file").write_text("")
        state = tmp_path / "file" / "ring.json"
    code = main(
        ["router", "--workers", "2", "--port", str(free_port()), "--state-file", str(state)]
    )
    err = capsys.readouterr().err
    assert code == 1
    assert err.strip().count("\n") == 0, err
    assert f"the router could not start: {state}: cannot" in err and "check --state-file" in err


def _supervisor(argv: list[str]) -> Supervisor:
    return Supervisor(
        argv,
        2,
        host="127.0.0.1",
        port=free_port(),
        admin_host="127.0.0.1",
        advertise_host="127.0.0.1",
        coordinated=False,
    )


def test_a_worker_that_never_served_stops_the_workers(capfd: pytest.CaptureFixture[str]) -> None:
    """A worker that exits before it ever served could not start (a seed that
    does not answer, a bad flag): it was restarted every time, forever when
    each start took longer than the crash window (10 s for a seed)."""
    supervisor = _supervisor(["--no-such-flag"])
    started = time.monotonic()
    assert supervisor.run() == 1
    assert time.monotonic() - started < 30.0
    err = capfd.readouterr().err
    assert re.search(r"worker \d exited with code 2 before it served; stopping every worker", err)
    assert "restarting it" not in err, err
    assert all(w.process is not None and w.process.poll() is not None for w in supervisor.workers)


def test_a_worker_the_system_refuses_to_start_is_named_and_nothing_is_left(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A spawn the kernel refuses (here E2BIG: an argument past its length limit;
    EAGAIN or ENOMEM alike) was reported by the CLI as a port it could not bind."""
    from router.workers import WorkerStartError

    supervisor = _supervisor(["--node", "n1=http://127.0.0.1:1/" + "x" * 200_000])
    with pytest.raises(WorkerStartError, match=r"^cannot start router worker 0: Argument list"):
        supervisor.run()
    assert all(w.process is None for w in supervisor.workers)
    assert all(w.admin.fileno() == -1 for w in supervisor.workers)  # closed


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (["router", "--workers", "257"], "--workers 257: must be from 1 to 256"),
        (["router", "--workers", "0"], "--workers 0: must be from 1 to 256"),
        (["up", "--workers", "300"], "--workers 300: must be from 1 to 256"),
        (["up", "--nodes", "1000"], "--nodes 1000: must be from 1 to 256"),
    ],
)
def test_counts_of_processes_are_bounded(command: list[str], expected: str) -> None:
    """``up --nodes 1000`` started 1,000 node processes (a ring holds 256) and
    took nine minutes to stop; ``--workers 10000`` said it could not bind its
    port (an exploratory tester). A subprocess: a regression fails, not hangs."""
    argv = ringlimit_argv(*command, "--port", str(free_port()))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=child_env())
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert expected in done.stderr, done.stderr


def test_a_crash_loop_stops_the_workers(capfd: pytest.CaptureFixture[str]) -> None:
    """Workers that served once and then keep dying at start are not restarted forever."""
    supervisor = _supervisor(["--no-such-flag"])
    for worker in supervisor.workers:
        worker.admin.listen()  # as a worker that served once leaves it
    assert supervisor.run() == 1
    err = capfd.readouterr().err
    # (Once it was "killed by signal 6": a gRPC poller of the pytest process,
    # forked with the preexec_fn workers were started with then, found its epoll
    # fd closed before exec. Workers are spawned without one now.)
    assert re.search(r"worker \d exited with code 2, 3 times within", err), err
    assert "restarting it" in err and "before it served" not in err, err


def test_workers_die_with_a_supervisor_killed_with_sigkill(procs: Procs) -> None:
    """kill -9 of ``ringlimit router --workers 2``: no worker outlives it
    (PR_SET_PDEATHSIG, router.processes.die_with_parent), so none keeps the port."""
    _, node_url = procs.node("n1")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["router", "--port", str(port), "--workers", "2", *RULE, "--node", f"n1={node_url}"]
    proc = procs.start("router", argv)
    wait_healthy(url, proc)
    assert wait_for(lambda: len(workers(proc)) == 2, timeout=10.0), proc.output()
    pids = [pid for pid, _ in workers(proc).values()]
    assert all(alive(pid) for pid in pids)
    proc.popen.send_signal(signal.SIGKILL)
    try:
        assert wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10.0), pids
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{url}/healthz", timeout=2.0)
    finally:  # a worker that outlived its supervisor is this test's to stop
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def _workers_of_one_node(procs: Procs, *extra: str) -> tuple[Proc, str, dict[int, tuple[int, str]]]:
    """``router --workers 2`` over one node, both workers serving."""
    _, node_url = procs.node("n1")
    proc, url = procs.router(None, "--workers", "2", *RULE, "--node", f"n1={node_url}", *extra)
    assert wait_for(lambda: len(workers(proc)) == 2, timeout=10.0), proc.output()
    started = workers(proc)
    for _, admin in started.values():
        wait_healthy(admin, proc)
    # The supervisor judges a worker only once it has echoed a ping (one
    # every 0.5 s): before, it may be starting.
    time.sleep(1.2)
    return proc, url, started


def test_a_paused_leading_worker_is_killed_and_started_again(procs: Procs) -> None:
    """SIGSTOP of worker 0, which leads (health checks, leases, admin changes):
    it kept its sockets, so a share of the port's new connections waited on it
    and the nodes' leases lapsed, and the supervisor, which watched only for
    exits, never noticed (an exploratory tester). It pings each worker and
    kills one that stops answering (router/heartbeat.py)."""
    proc, url, started = _workers_of_one_node(procs, "--worker-timeout", "2")
    leader = started[0][0]
    os.kill(leader, signal.SIGSTOP)
    paused = time.monotonic()
    try:
        assert wait_for(lambda: workers(proc)[0][0] != leader, timeout=15.0), proc.output()
    finally:
        if alive(leader):
            os.kill(leader, signal.SIGCONT)
    noticed = time.monotonic() - paused
    out = proc.output()
    line = re.search(
        rf"worker 0 \(pid {leader}\) answered no ping for (\d+\.\d) s \(paused or hung\); "
        "killing it",
        out,
    )
    assert line, out
    assert 2.0 <= float(line.group(1)) < 3.5, line.group(0)
    assert "worker 0 killed by signal 9; restarting it" in out, out
    assert noticed < 8.0, noticed
    assert not alive(leader)
    # The new leader serves the ring it recovered, on the same admin URL.
    admin = workers(proc)[0][1]
    assert admin == started[0][1]
    wait_healthy(admin, proc)
    assert [n["id"] for n in admin_ring(admin)["nodes"]] == ["n1"]
    assert wait_for(lambda: "w0" in answered_by(url, 10), timeout=10.0, interval=0.2)
    assert "killing it" not in out.split("worker 0 killed by signal 9")[1], out


def test_a_paused_supervisor_kills_no_worker(procs: Procs) -> None:
    """A host paused whole (its supervisor and workers: a VM suspended) finds
    every ping old on resuming; none of that time counts, or the supervisor
    would kill a worker that merely had not been resumed yet."""
    proc, _, started = _workers_of_one_node(procs, "--worker-timeout", "2")
    pids = [pid for pid, _ in started.values()]
    supervisor = proc.popen.pid
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    time.sleep(0.7)  # a ping is sent meanwhile, and waits
    os.kill(supervisor, signal.SIGSTOP)
    time.sleep(3.0)
    os.kill(supervisor, signal.SIGCONT)  # it resumes first: its ping is 3.7 s old
    time.sleep(0.5)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)
    time.sleep(4.0)  # twice the timeout
    out = proc.output()
    assert "killing it" not in out, out
    assert workers(proc) == started
    assert all(alive(pid) for pid in pids)


def test_a_supervisor_stops_a_paused_worker_at_once_and_names_each_workers_lines(
    procs: Procs,
) -> None:
    """SIGTERM to the supervisor while a worker was paused: the worker held the
    signal, and the supervisor waited out its 15 s grace and killed it (an
    exploratory tester). Resumed with its SIGTERM, it stops as the others do.
    And with ``-v`` each line names its worker, without httpx's line per request."""
    proc, _, started = _workers_of_one_node(procs, "--worker-timeout", "0", "-v")
    paused = started[1][0]
    os.kill(paused, signal.SIGSTOP)
    time.sleep(1.0)  # a follower polls its leader every 0.2 s: lines from both
    began = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    try:
        proc.popen.wait(timeout=20.0)
    finally:
        if alive(paused):
            os.kill(paused, signal.SIGCONT)
    assert time.monotonic() - began < 8.0
    out = proc.output()
    assert proc.popen.returncode == 0, out
    assert "did not stop within" not in out, out
    assert not alive(paused)
    assert re.search(r"^\S+ \S+ w1 ringlimit\.router INFO adopted epoch", out, re.MULTILINE), out
    assert "HTTP Request:" not in out, out


def test_a_worker_finishing_its_requests_after_sigterm_is_not_killed_as_hung(
    procs: Procs,
) -> None:
    """SIGTERM to one worker (to recycle it): it closes its listening sockets and
    finishes the requests it holds, its event loop running. A first version of
    the supervisor's probe asked /healthz on the admin socket, whose copy in the
    supervisor kept taking connections no one read, and killed the worker
    midway ("answered no probe ... killing it"; the review). The ping is echoed
    by the event loop itself, draining or not."""
    proc, _, started = _workers_of_one_node(procs, "--worker-timeout", "2")
    pid, admin = started[1]
    port = int(admin.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as held:
        # A request whose body never comes whole: the worker waits for it.
        held.sendall(
            b"POST /v1/check HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{"
        )
        time.sleep(0.3)
        os.kill(pid, signal.SIGTERM)
        line = "worker 1 exited with code 0; restarting it"
        assert wait_for(lambda: line in proc.output(), timeout=20.0), proc.output()
    assert "answered no ping" not in proc.output(), proc.output()
