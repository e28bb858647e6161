"""Shared helpers for the real-process cluster tests: paced load, cluster start, admin reads.

Used by tests/test_rebalancing_processes.py and tests/test_faults_processes.py.
The load generator uses aiohttp rather than httpx: on this 2-CPU machine an
``httpx.AsyncClient`` drove 70-100 requests/s against the cluster and aiohttp
about 780 (the router uses aiohttp to forward for the same reason, see
router/forward.py). httpx is used for the admin calls.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import httpx

from ring import RingView
from tests.processes import Proc, Procs, free_port, wait_for, wait_healthy

#: The default rule of the rebalancing tests: ``api=10/minute`` (sliding log).
LIMIT = 10
USERS = [f"user-{i}" for i in range(200)]
#: Requests per user: LIMIT admitted and a few denied ("clearly over quota").
PER_USER = LIMIT + 4


# --------------------------------------------------------------------------- load


@dataclass
class Sent:
    at: float  # monotonic time the answer arrived
    status: int
    node: str | None
    degraded: bool
    #: Seconds from sending to the answer (the client's wait).
    took: float = 0.0
    #: ``X-Ringlimit-Router``: the router worker that answered (router --workers).
    router: str | None = None


@dataclass
class Load:
    """Paced concurrent traffic: every user sends PER_USER requests, one at a time."""

    routers: list[str]
    users: list[str] = field(default_factory=lambda: list(USERS))
    #: The path each user requests (default /api).
    paths: dict[str, str] = field(default_factory=dict)
    per_user: int = PER_USER
    pace: float = 0.2
    #: The quota ``excess`` and ``over`` measure against.
    limit: int = LIMIT
    #: A new connection for every request, so a port the kernel shares between
    #: processes (SO_REUSEPORT, ``router --workers``) spreads them: the few
    #: keep-alive connections a paced load reuses may all hash to one worker.
    fresh_connections: bool = False
    log: dict[str, list[Sent]] = field(default_factory=dict)
    #: How long each request that got no answer waited (refused, reset, the
    #: client's 10 s timeout), so a latency bound covers every request.
    failed_waits: list[float] = field(default_factory=list)
    done = 0
    errors = 0

    @property
    def total(self) -> int:
        return len(self.users) * self.per_user

    @property
    def progress(self) -> float:
        return self.done / self.total

    async def run(self) -> None:
        connector = aiohttp.TCPConnector(limit=64, force_close=self.fresh_connections)
        timeout = aiohttp.ClientTimeout(total=10)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

            async def user(index: int, name: str) -> None:
                sent = self.log.setdefault(name, [])
                # Spread the users' start over one pace so the load is even.
                await asyncio.sleep(self.pace * index / len(self.users))
                for i in range(self.per_user):
                    router = self.routers[(index + i) % len(self.routers)]
                    sent_at = time.monotonic()
                    try:
                        path = self.paths.get(name, "/api")
                        async with session.get(
                            f"{router}{path}", headers={"X-User-Id": name}
                        ) as response:
                            await response.read()
                            sent.append(
                                Sent(
                                    time.monotonic(),
                                    response.status,
                                    response.headers.get("x-ringlimit-node"),
                                    "x-ringlimit-degraded" in response.headers,
                                    time.monotonic() - sent_at,
                                    response.headers.get("x-ringlimit-router"),
                                )
                            )
                    except (aiohttp.ClientError, TimeoutError):
                        self.errors += 1
                        self.failed_waits.append(time.monotonic() - sent_at)
                    self.done += 1
                    await asyncio.sleep(self.pace)

            await asyncio.gather(*(user(i, u) for i, u in enumerate(self.users)))

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=lambda: asyncio.run(self.run()), daemon=True)
        thread.start()
        return thread

    # -- measurements

    def allowed(self, user: str) -> int:
        return sum(1 for s in self.log.get(user, []) if s.status == 200)

    def excess(self) -> int:
        return sum(max(0, self.allowed(u) - self.limit) for u in self.users)

    def over(self) -> dict[str, int]:
        return {u: n for u in self.users if (n := self.allowed(u)) > self.limit}

    def statuses(self) -> Counter[int]:
        return Counter(s.status for sent in self.log.values() for s in sent)

    def nodes(self, user: str) -> list[str]:
        """The nodes that answered ``user``, in order, repeats collapsed."""
        seen: list[str] = []
        for s in self.log.get(user, []):
            if s.node and (not seen or seen[-1] != s.node):
                seen.append(s.node)
        return seen


def finish(thread: threading.Thread, load: Load, timeout: float = 40.0) -> None:
    thread.join(timeout)
    assert not thread.is_alive(), f"load did not finish in {timeout}s ({load.progress:.0%})"


# --------------------------------------------------------------------------- cluster


def admin_ring(router: str) -> dict[str, Any]:
    response = httpx.get(f"{router}/admin/ring", timeout=5.0)
    response.raise_for_status()
    data: dict[str, Any] = response.json()
    return data


def view_of(ring: dict[str, Any]) -> RingView:
    nodes = [{k: n[k] for k in ("id", "url", "weight")} for n in ring["nodes"]]
    return RingView.from_dict({"epoch": ring["epoch"], "nodes": nodes})


def ring_ids(router: str, *, active: bool = True) -> list[str]:
    """Ids in the router's ring: active members only, or any state (joining, leaving)."""
    try:
        ring = admin_ring(router)
    except httpx.HTTPError:
        return []
    return [n["id"] for n in ring["nodes"] if not active or n["state"] == "active"]


def gone(router: str, node_id: str) -> bool:
    """The node is out of the ring altogether (not merely leaving)."""
    try:
        return node_id not in [n["id"] for n in admin_ring(router)["nodes"]]
    except httpx.HTTPError:
        return False


@dataclass
class Cluster:
    router: str
    router_proc: Proc
    nodes: dict[str, Proc]
    urls: dict[str, str]


def start_cluster(
    procs: Procs,
    router_flags: list[str],
    *,
    join: tuple[str, ...] = ("n1", "n2", "n3"),
    spare: tuple[str, ...] = (),
    port: int | None = None,
) -> Cluster:
    """A router, nodes that join it (``--join``, no rule flags) and spare nodes
    (``--fenced``, not joined), all started at once; returns when the joining
    nodes are in the ring and the spares answer."""
    t0 = time.monotonic()
    port = port or free_port()
    router = f"http://127.0.0.1:{port}"
    router_proc = procs.start("router", ["router", "--port", str(port), *router_flags])
    started: dict[str, tuple[Proc, str]] = {}
    for node_id in (*join, *spare):
        node_port = free_port()
        flags = ["--join", router] if node_id in join else ["--fenced"]
        argv = ["node", "--id", node_id, "--port", str(node_port), *flags]
        started[node_id] = (procs.start(node_id, argv), f"http://127.0.0.1:{node_port}")
    wait_healthy(router, router_proc, require_ok=False)
    t1 = time.monotonic()
    for proc, url in started.values():
        wait_healthy(url, proc)
    t2 = time.monotonic()
    assert wait_for(lambda: set(join) <= set(ring_ids(router)), timeout=20.0), ring_ids(router)
    report(
        "startup",
        router_s=round(t1 - t0, 2),
        nodes_s=round(t2 - t0, 2),
        ring_s=round(time.monotonic() - t0, 2),
    )
    return Cluster(
        router,
        router_proc,
        {node_id: proc for node_id, (proc, _) in started.items()},
        {node_id: url for node_id, (_, url) in started.items()},
    )


def kill_all(procs: Procs) -> None:
    """Fast teardown (the fixture still stops anything left on failure)."""
    for proc in procs.started:
        proc.kill9()


def add_node(router: str, node_id: str, url: str) -> float:
    """``ringlimit nodes add``: join through the admin API; returns how long it took."""
    started = time.monotonic()
    response = httpx.post(f"{router}/admin/nodes", json={"id": node_id, "url": url}, timeout=30.0)
    assert response.status_code == 200, response.text
    return time.monotonic() - started


def report(title: str, **figures: object) -> None:
    print(f"\n[{title}] " + " ".join(f"{k}={v}" for k, v in figures.items()))


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def scrape(url: str) -> str:
    response = httpx.get(f"{url}/metrics", timeout=5.0)
    response.raise_for_status()
    return response.text
