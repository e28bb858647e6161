"""Two routers on one ring through a real etcd, as separate processes.

Each test starts etcd (the ``etcd_endpoint`` fixture), two routers with
``--coordinator`` and three nodes that join through either router, sends paced
traffic alternating between the routers (tests/real_cluster.py ``Load``), and
kills the leading router (kill -9) while traffic runs, or in the middle of a
join. The follower must take the lead within the coordinator's ttl, finish or
roll forward the change, and every user must be admitted exactly ``LIMIT``
times: one history of epochs and one count per user, whichever router routes.

Run: ``pytest -m etcd tests/test_coordinator_processes.py -v -s``
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.etcd_server import EtcdServer
from tests.processes import Proc, Procs, free_port, wait_for, wait_healthy
from tests.real_cluster import LIMIT, Load, admin_ring, finish, metric, report, scrape

pytestmark = [pytest.mark.integration, pytest.mark.etcd, pytest.mark.timeout(90)]

TTL = 2.0
FLAGS = [
    *("--rule", f"api={LIMIT}/hour", "--algorithm", "sliding_log", "--on-error", "closed"),
    *("--health-interval", "0.2", "--failure-threshold", "3", "--health-timeout", "0.3"),
    *("--forward-timeout", "2", "--replication-interval", "0.1"),
    *("--coordinator-ttl", str(TTL), "--cluster", "proc"),
]
USERS = [f"user-{i}" for i in range(60)]


def start(
    procs: Procs, endpoint: str, *extra: str
) -> tuple[list[tuple[Proc, str]], dict[str, str]]:
    """Two routers (the first one seeds the ring) and three nodes; ``extra`` flags
    for the routers override FLAGS."""
    nodes: dict[str, str] = {}
    for node_id in ("n1", "n2", "n3"):
        _, url = procs.node(node_id, None, "--fenced")
        nodes[node_id] = url
    seeds = [x for node_id, url in nodes.items() for x in ("--node", f"{node_id}={url}")]
    routers = []
    for i in range(2):
        port = free_port()
        proc = procs.start(
            f"router{i}",
            ["router", "--port", str(port), "--coordinator", endpoint, *FLAGS, *extra, *seeds],
        )
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        routers.append((proc, url))
    assert wait_for(lambda: leader_of(routers) is not None, timeout=15.0)
    return routers, nodes


def leader_of(routers: list[tuple[Proc, str]]) -> tuple[Proc, str] | None:
    for proc, url in routers:
        if not proc.alive():
            continue
        try:
            if admin_ring(url)["coordinator"]["leading"]:
                return proc, url
        except (httpx.HTTPError, KeyError, ValueError):
            continue
    return None


def epochs(routers: list[tuple[Proc, str]]) -> list[int]:
    out = []
    for proc, url in routers:
        if proc.alive():
            try:
                out.append(int(admin_ring(url)["epoch"]))
            except (httpx.HTTPError, ValueError):
                out.append(-1)
    return out


def exact(load: Load, nodes: dict[str, str]) -> None:
    """Nobody over the limit; and the nodes admitted exactly LIMIT per user (a
    client may have lost the answer of a request the killed router forwarded:
    one per user at most, as each user sends one request at a time)."""
    assert load.excess() == 0, load.over()
    assert all(load.allowed(u) >= LIMIT - 1 for u in load.users)
    admitted = sum(
        metric(scrape(url), "ringlimit_decisions_total", rule="api", outcome="allowed")
        for url in nodes.values()
    )
    assert admitted == LIMIT * len(load.users), admitted


def test_killing_the_leading_router_under_traffic_keeps_every_count(
    procs: Procs, etcd_endpoint: str
) -> None:
    routers, nodes = start(procs, etcd_endpoint)
    leader = leader_of(routers)
    assert leader is not None
    follower = next(r for r in routers if r[1] != leader[1])
    load = Load([url for _, url in routers], users=USERS, pace=0.1)
    thread = load.start()
    assert wait_for(lambda: load.progress > 0.3, timeout=30.0)
    killed_at = time.monotonic()
    leader[0].kill9()
    assert wait_for(lambda: leader_of([follower]) is not None, timeout=TTL * 4 + 5), _describe(
        follower[1]
    )
    took_over = time.monotonic() - killed_at
    # The new leader changes the ring: a node joins through it.
    _, n4 = procs.node("n4", None, "--fenced")
    nodes["n4"] = n4
    response = httpx.post(f"{follower[1]}/admin/nodes", json={"id": "n4", "url": n4}, timeout=30.0)
    assert response.status_code == 200, response.text
    # The killed router's clients lose their answers (connection refused):
    # only the survivor is used from now on.
    load.routers = [follower[1]]
    finish(thread, load, timeout=60.0)
    report(
        "leader kill -9 under traffic",
        took_over_s=round(took_over, 2),
        ttl_s=TTL,
        epoch=admin_ring(follower[1])["epoch"],
        statuses=dict(load.statuses()),
        errors=load.errors,
    )
    # Requests sent to the dead router failed; the users' counts are still
    # exact among the answered ones: send each user's remaining share now.
    top_up(load, follower[1])
    exact(load, nodes)
    assert took_over < TTL * 4 + 5


def top_up(load: Load, router: str) -> None:
    """Requests that failed (the dead router) are sent again, one by one, until
    every user has LIMIT + 2 answers: then each must have exactly LIMIT 200s."""
    with httpx.Client(timeout=10.0) as client:
        for user in load.users:
            answered = [s for s in load.log.get(user, []) if s.status in (200, 429)]
            for _ in range(max(0, LIMIT + 2 - len(answered))):
                response = client.get(f"{router}/api", headers={"X-User-Id": user})
                assert response.status_code in (200, 429), response.text
                load.log[user].append(
                    type(load.log[user][0])(time.monotonic(), response.status_code, None, False)
                    if load.log.get(user)
                    else _sent(response.status_code)
                )


def _sent(status: int) -> Any:
    from tests.real_cluster import Sent

    return Sent(time.monotonic(), status, None, False)


def test_killing_the_leader_in_the_middle_of_a_join(
    procs: Procs, etcd_endpoint: str, etcd_server: EtcdServer
) -> None:
    """The leader commits a join to etcd and dies before carrying it out (an old
    member, paused, holds up its push): the next leader rolls the change forward,
    every node ends on etcd's view, and nobody's count is lost in the handoff."""
    # Slow failure detection: the paused member must not be removed as crashed
    # before the leader dies (this test is about the join, not the pause).
    routers, nodes = start(procs, etcd_endpoint, "--failure-threshold", "200")
    leader = leader_of(routers)
    assert leader is not None
    follower = next(r for r in routers if r[1] != leader[1])
    load = Load([url for _, url in routers], users=USERS, pace=0.1, per_user=LIMIT // 2)
    finish(load.start(), load, timeout=60.0)
    _, n4 = procs.node("n4", None, "--fenced")
    paused = next(p for p in procs.started if p.name == "n1")
    answer: dict[str, Any] = {}

    def join() -> None:
        try:
            answer["response"] = httpx.post(
                f"{leader[1]}/admin/nodes", json={"id": "n4", "url": n4}, timeout=30.0
            )
        except httpx.HTTPError as exc:
            answer["error"] = type(exc).__name__

    paused.pause()  # n1 takes no view now: the leader's push to it hangs after the commit
    joining = threading.Thread(target=join, daemon=True)
    joining.start()
    try:
        committed = wait_for(lambda: _record(etcd_server).get("epoch") == 2, timeout=20.0)
        assert committed, (_record(etcd_server), answer.get("response") and answer["response"].text)
        record = _record(etcd_server)
        assert record["settled"] is False and "n4" in record["members"], record
        leader[0].kill9()
    finally:
        paused.resume()
    joining.join(35.0)
    killed_at = time.monotonic()
    assert wait_for(lambda: leader_of([follower]) is not None, timeout=TTL * 4 + 5)
    assert wait_for(lambda: _record(etcd_server).get("settled") is True, timeout=20.0)
    rolled = time.monotonic() - killed_at
    assert wait_for(lambda: _nodes_agree(follower[1]), timeout=20.0)
    ring = admin_ring(follower[1])
    assert ring["epoch"] == 2 and sorted(n["id"] for n in ring["nodes"]) == sorted([*nodes, "n4"])
    follower_proc = follower[0]
    assert "finishing the change to epoch 2 left by the last leader" in follower_proc.output()
    report(
        "leader kill -9 during a join",
        join=answer.get("error") or answer["response"].status_code,
        rolled_forward_s=round(rolled, 2),
        ttl_s=TTL,
        epoch=ring["epoch"],
    )
    rest = Load([follower[1]], users=USERS, pace=0.05, per_user=LIMIT // 2 + 3)
    finish(rest.start(), rest, timeout=60.0)
    for user in USERS:
        total = load.allowed(user) + rest.allowed(user)
        assert total == LIMIT, (user, load.allowed(user), rest.allowed(user))


def _record(etcd: EtcdServer) -> dict[str, Any]:
    """The ring record the routers keep in etcd (router/coordinator.py), in short."""
    import json

    raw = etcd.get("/ringlimit/proc/view")
    if raw is None:
        return {}
    data = json.loads(raw)
    return {
        "epoch": data["ring"]["epoch"],
        "members": [n["id"] for n in data["ring"]["nodes"]],
        "settled": data["settled"],
    }


def _nodes_agree(router: str) -> bool:
    ring = admin_ring(router)
    epoch = ring["epoch"]
    with httpx.Client(timeout=2.0) as client:
        for node in ring["nodes"]:
            try:
                data = client.get(f"{node['url']}/healthz").json()
            except (httpx.HTTPError, ValueError):
                return False
            if data.get("epoch") != epoch:
                return False
    return True


def _describe(router: str) -> object:
    try:
        return admin_ring(router)
    except httpx.HTTPError as exc:
        return repr(exc)


def test_a_node_killed_under_traffic_through_both_routers(procs: Procs, etcd_endpoint: str) -> None:
    """The leader removes the dead node (its replicas promoted); the follower adopts
    the view through etcd; users who had spent their quota stay denied on both."""
    routers, _ = start(procs, etcd_endpoint)
    urls = [url for _, url in routers]
    spend = Load(urls, users=USERS, pace=0.05, per_user=LIMIT)
    finish(spend.start(), spend, timeout=60.0)
    time.sleep(0.5)  # a few replication rounds: every state is on its successor
    epoch = admin_ring(urls[0])["epoch"]
    victim = next(p for p in procs.started if p.name == "n2")
    victim.kill9()
    killed_at = time.monotonic()
    assert wait_for(lambda: all(admin_ring(u)["epoch"] > epoch for u in urls), timeout=20.0)
    removed = time.monotonic() - killed_at
    assert all("n2" not in [n["id"] for n in admin_ring(u)["nodes"]] for u in urls)
    more = Load(urls, users=USERS, pace=0.05, per_user=3)
    finish(more.start(), more, timeout=60.0)
    report(
        "node kill -9, two routers on etcd",
        removed_s=round(removed, 2),
        statuses=dict(more.statuses()),
    )
    assert spend.excess() == 0 and all(spend.allowed(u) == LIMIT for u in USERS)
    assert more.statuses()[200] == 0, more.over()


def test_conflicting_changes_through_both_routers_make_one_history(
    procs: Procs, etcd_endpoint: str, etcd_server: EtcdServer
) -> None:
    """Under traffic through both routers, a join and a graceful leave are asked of
    the two routers at the same moment (and a second join of the same id through
    the other one): every answer is a success or a retryable conflict, the epochs
    form one history (no epoch made twice, both routers and etcd end on the same
    view), and every user's count is exact through the join and the leave."""
    routers, _ = start(procs, etcd_endpoint)
    urls = [url for _, url in routers]
    load = Load(urls, users=USERS, pace=0.1)
    thread = load.start()
    assert wait_for(lambda: load.progress > 0.2, timeout=30.0)
    _, n4 = procs.node("n4", None, "--fenced")
    epoch = admin_ring(urls[0])["epoch"]
    answers: dict[str, httpx.Response | str] = {}

    def call(name: str, method: str, url: str, body: dict[str, Any] | None = None) -> None:
        try:
            answers[name] = httpx.request(method, url, json=body, timeout=40.0)
        except httpx.HTTPError as exc:
            answers[name] = type(exc).__name__

    calls = [
        threading.Thread(
            target=call, args=("join", "POST", f"{urls[0]}/admin/nodes", {"id": "n4", "url": n4})
        ),
        threading.Thread(target=call, args=("leave", "DELETE", f"{urls[1]}/admin/nodes/n3")),
        threading.Thread(
            target=call, args=("join2", "POST", f"{urls[1]}/admin/nodes", {"id": "n4", "url": n4})
        ),
    ]
    for thread_ in calls:
        thread_.start()
    for thread_ in calls:
        thread_.join(60.0)
    statuses = {
        name: a.status_code if isinstance(a, httpx.Response) else a for name, a in answers.items()
    }
    # A change either happened or was refused as retryable (409 ring_changed /
    # join_in_progress, 503 no_leader while the forward raced an election).
    assert all(s in (200, 409, 503) for s in statuses.values()), statuses
    for name, method, url, body in [
        ("join", "POST", f"{urls[0]}/admin/nodes", {"id": "n4", "url": n4}),
        ("leave", "DELETE", f"{urls[1]}/admin/nodes/n3", None),
    ]:
        if statuses[name] != 200:  # retried once, as a client would
            call(name, method, url, body)
    ring = admin_ring(urls[0])
    assert sorted(n["id"] for n in ring["nodes"]) == ["n1", "n2", "n4"], (statuses, ring)
    assert wait_for(lambda: len({admin_ring(u)["epoch"] for u in urls}) == 1, timeout=10.0)
    record = _record(etcd_server)
    assert record["settled"] is True and record["epoch"] == admin_ring(urls[1])["epoch"]
    # One history: each change took its own epoch (a join and a leave: two).
    assert record["epoch"] == epoch + 2, (epoch, record, statuses)
    events = [e for e in admin_ring(urls[0]).get("events", []) if e.get("epoch", 0) > epoch]
    seen = [e["epoch"] for e in events if e.get("kind") in ("joined", "left")]
    assert len(seen) == len(set(seen)), events
    finish(thread, load, timeout=90.0)
    report(
        "conflicting join + leave through two routers on etcd",
        answers=statuses,
        epochs=f"{epoch} -> {record['epoch']}",
        statuses=dict(load.statuses()),
    )
    assert load.excess() == 0, load.over()
    assert all(load.allowed(u) == LIMIT for u in USERS), {
        u: load.allowed(u) for u in USERS if load.allowed(u) != LIMIT
    }
