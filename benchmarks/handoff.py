"""The handoff row of ``ringlimit bench``: how long one node takes to hand N states to another.

Node A is filled with ``n`` token-bucket states through its own decision API
(batches of 1000, keys A owns), then removed gracefully through the router
(``DELETE /admin/nodes/A``): every state moves to B, streamed in msgpack
chunks (node/shard.py). Timed: the DELETE, which returns once A has
delivered everything. A's RSS before and
after the fill gives a real node's bytes per key.

Alone, without the rest of the bench (to compare two commits side by side):
``python -m benchmarks.handoff [--keys N] [--runs R]`` prints one line per run.
``--join`` measures the other direction instead (not a bench row): A alone
holds N states, B joins (``POST /admin/nodes``), and the time is until B has
every state the join moved to it; A's RSS after the join shows what it keeps
of them (the sender keeps what it hands over as the new owner's replicas
until that owner replicates them itself).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.deployments import Processes, Settings, cluster_toml, wait_http
from benchmarks.measure import rss
from node.peers import INTERNAL_TOKEN_HEADER
from ring import Member, RingView

NODES = ("A", "B")
BATCH = 1000


def run_handoff(procs: Processes, workdir: Path, n: int) -> dict[str, Any]:
    """Fill node A with ``n`` token-bucket states, then remove A: all of them move to B."""
    pids, urls, router = _start(procs, workdir / "cluster.toml")
    keys = _keys_of_a(urls, n)
    rss_before = rss(pids["A"])
    with httpx.Client(timeout=60.0, headers=_internal_headers()) as client:
        fill_seconds = _fill(client, urls["A"], keys)
        held = client.get(f"{urls['A']}/healthz").json()["keys"]
        settle_seconds = _settle(client, urls["B"], held)
        # Once A is quiet: its periodic sweep (every second) has given freed heap
        # pages back (node.memory), so RSS is what the states really hold.
        time.sleep(1.5)
        rss_after = rss(pids["A"])
        started = time.perf_counter()
        with _LongestWait(urls["B"]) as receiver:
            answer = client.delete(f"{router}/admin/nodes/A", timeout=120.0)
        seconds = time.perf_counter() - started
        status_b = client.get(f"{urls['B']}/internal/status").json()
        status_a = client.get(f"{urls['A']}/internal/status").json()
    received = int(status_b.get("stats", {}).get("keys_received", 0))
    transfer = float(status_a.get("stats", {}).get("last_transfer_seconds", 0.0))
    complete = answer.status_code == 200 and received >= held == n
    detail = (
        f"{received:,} of {held:,} keys arrived"
        + ("" if answer.status_code == 200 else f"; router answered {answer.status_code}")
        + f"; A's own transfer took {transfer:.1f} s"
        + f"; B's longest /healthz wait {receiver.longest * 1000:.0f} ms"
    )
    procs.stop(["handoff-router", "handoff-A", "handoff-B"])
    log_a = workdir / "handoff-A.log"
    failures = log_a.read_text(errors="replace").count("failed") if log_a.exists() else 0
    if failures:
        detail += f"; A logged {failures} failed transfer(s) (peer timeout)"
    return {
        "keys": n,
        "held_by_a": held,
        "received_by_b": received,
        "seconds": seconds,
        "complete": complete,
        "fill_seconds": fill_seconds,
        "settle_seconds": settle_seconds,
        "node_rss_bytes_per_key": (rss_after - rss_before) / n if n else None,
        "detail": detail,
        "sender_failures": failures,
        "receiver_longest_wait_seconds": receiver.longest,
    }


class _LongestWait:
    """Polls ``url``'s ``/healthz`` (every 20 ms, from a thread) while the block
    runs: the longest wait is how long the node's event loop stalled applying
    what it received, which a router's lease probe waits too (a probe that
    waits past its timeout several times in a row removes the node)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.longest = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> _LongestWait:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(timeout=30.0)

    def _poll(self) -> None:
        with httpx.Client(timeout=30.0) as client:
            for _ in range(100_000):  # bounded: 20 ms apart, the block lasts < 120 s
                if self._done.is_set():
                    return
                sent = time.perf_counter()
                with contextlib.suppress(httpx.HTTPError):
                    client.get(f"{self.url}/healthz")
                self.longest = max(self.longest, time.perf_counter() - sent)
                self._done.wait(0.02)


def run_join(procs: Processes, workdir: Path, n: int) -> dict[str, Any]:
    """Fill node A, alone in the ring, with ``n`` states; then B joins: how long until
    B holds every state the join moved to it, and what A keeps of them."""
    pids, urls, router = _start(procs, workdir / "cluster.toml", seeds=("A",))
    keys = [f"h{i}" for i in range(n)]
    two = RingView.of([Member("A", urls["A"]), Member("B", urls["B"])], epoch=2)
    moving = sum(1 for key in keys if two.owner_id(key) == "B")
    with httpx.Client(timeout=60.0, headers=_internal_headers()) as client:
        _fill(client, urls["A"], keys)
        time.sleep(1.5)  # A's sweep gives freed pages back: RSS is what it holds
        rss_before = rss(pids["A"])
        started = time.perf_counter()
        answer = client.post(
            f"{router}/admin/nodes", json={"id": "B", "url": urls["B"]}, timeout=120.0
        )
        joined = time.perf_counter() - started
        received = 0
        while time.perf_counter() - started < 120:
            stats = client.get(f"{urls['B']}/internal/status").json().get("stats", {})
            received = int(stats.get("keys_received", 0))
            if received >= moving:
                break
            time.sleep(0.05)
        seconds = time.perf_counter() - started
        time.sleep(1.5)
        rss_after = rss(pids["A"])
        kept = client.get(f"{urls['A']}/internal/status").json().get("replicas", {}).get("B", 0)
    procs.stop(["handoff-router", "handoff-A", "handoff-B"])
    return {
        "keys": n,
        "moved": moving,
        "received_by_b": received,
        "join_answered_seconds": joined,
        "seconds": seconds,
        "complete": answer.status_code == 200 and received >= moving,
        "a_rss_change_bytes": rss_after - rss_before,
        "a_kept_for_b": int(kept),
        "detail": f"{received:,} of {moving:,} moved keys arrived; the join answered "
        f"{answer.status_code} after {joined:.2f} s; A keeps {int(kept):,} of them for B, "
        f"its RSS {(rss_after - rss_before) / 2**20:+.1f} MiB",
    }


def _internal_headers() -> dict[str, str]:
    """The internal token, when the environment gives one to the nodes too: their
    decision API and /internal/status take it then."""
    token = os.environ.get("RINGLIMIT_INTERNAL_TOKEN")
    return {INTERNAL_TOKEN_HEADER: token} if token else {}


def _start(
    procs: Processes, cfg: Path, seeds: tuple[str, ...] = NODES
) -> tuple[dict[str, int], dict[str, str], str]:
    """Fenced nodes A and B, then a router seeded with ``seeds`` (both by default):
    (pids, node URLs, router URL)."""
    ports = {node: procs.port() for node in NODES}
    pids = {
        node: procs.ringlimit(
            f"handoff-{node}",
            "node",
            *("--id", node, "--port", str(port), "--fenced", "--config", str(cfg)),
        )
        for node, port in ports.items()
    }
    urls = {node: f"http://127.0.0.1:{port}" for node, port in ports.items()}
    for url in urls.values():
        wait_http(f"{url}/healthz", procs)
    rport = procs.port()
    procs.ringlimit(
        "handoff-router",
        "router",
        *("--port", str(rport), "--config", str(cfg), "--no-health-checks"),
        *(flag for node in seeds for flag in ("--node", f"{node}={urls[node]}")),
    )
    router = f"http://127.0.0.1:{rport}"
    wait_http(f"{router}/healthz", procs)
    return pids, urls, router


def _keys_of_a(urls: dict[str, str], n: int) -> list[str]:
    """``n`` keys that node A owns in the router's first view (A and B, epoch 1)."""
    view = RingView.of([Member("A", urls["A"]), Member("B", urls["B"])], epoch=1)
    keys: list[str] = []
    i = 0
    while len(keys) < n:
        key = f"h{i}"
        if view.owner_id(key) == "A":
            keys.append(key)
        i += 1
    return keys


def _fill(client: httpx.Client, node: str, keys: list[str]) -> float:
    """One state per key on ``node``, through its decision API; returns the seconds taken."""
    batches = [
        json.dumps({"checks": [{"key": k, "rule": "handoff"} for k in keys[j : j + BATCH]]})
        for j in range(0, len(keys), BATCH)
    ]
    started = time.perf_counter()

    def post(body: str) -> None:
        answer = client.post(
            f"{node}/v1/check", content=body, headers={"content-type": "application/json"}
        )
        answer.raise_for_status()

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(post, batches))
    return time.perf_counter() - started


def _settle(client: httpx.Client, successor: str, held: int) -> float:
    """Start from a quiet cluster: A streams replicas of what it decides to its
    successor (the default crash policy, "replica"); wait until B has caught up
    (or stopped catching up). Returns the seconds waited."""
    started = time.perf_counter()
    previous = -1
    while time.perf_counter() - started < 120:
        replicas = client.get(f"{successor}/internal/status").json().get("replicas", {})
        count = int(replicas.get("A", 0))
        if count >= held or count == previous:
            break
        previous = count
        time.sleep(0.5)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.handoff")
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--join", action="store_true", help="B joins A (instead of A leaving to B)")
    args = parser.parse_args(argv)
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="ringlimit-handoff-") as tmp:
            workdir = Path(tmp)
            (workdir / "cluster.toml").write_text(cluster_toml(Settings()))
            procs = Processes(workdir)
            try:
                result = (run_join if args.join else run_handoff)(procs, workdir, args.keys)
            finally:
                procs.stop_all()
        what = "join" if args.join else "handoff"
        print(f"{what} of {args.keys:,} keys: {result['seconds']:.2f} s ({result['detail']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
