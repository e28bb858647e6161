"""The handoff row of ``ringlimit bench``: how long one node takes to hand N states to another.

Node A is filled with ``n`` token-bucket states through its own decision API
(batches of 1000, keys A owns), then removed gracefully through the router
(``DELETE /admin/nodes/A``): every state moves to B, streamed in msgpack
chunks (node/shard.py). Timed: the DELETE, which returns once A has
delivered everything. A's RSS before and
after the fill gives a real node's bytes per key.

Alone, without the rest of the bench (to compare two commits side by side):
``python -m benchmarks.handoff [--keys N] [--runs R]`` prints one line per run.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.deployments import Processes, Settings, cluster_toml, free_port, wait_http
from benchmarks.measure import rss
from ring import Member, RingView

NODES = ("A", "B")
BATCH = 1000


def run_handoff(procs: Processes, workdir: Path, n: int) -> dict[str, Any]:
    """Fill node A with ``n`` token-bucket states, then remove A: all of them move to B."""
    pids, urls, router = _start(procs, workdir / "cluster.toml")
    keys = _keys_of_a(urls, n)
    rss_before = rss(pids["A"])
    with httpx.Client(timeout=60.0) as client:
        fill_seconds = _fill(client, urls["A"], keys)
        held = client.get(f"{urls['A']}/healthz").json()["keys"]
        settle_seconds = _settle(client, urls["B"], held)
        # Once A is quiet: its periodic sweep (every second) has given freed heap
        # pages back (node.memory), so RSS is what the states really hold.
        time.sleep(1.5)
        rss_after = rss(pids["A"])
        started = time.perf_counter()
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
    }


def _start(procs: Processes, cfg: Path) -> tuple[dict[str, int], dict[str, str], str]:
    """Fenced nodes A and B, then a router seeded with both: (pids, node URLs, router URL)."""
    ports = {node: free_port() for node in NODES}
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
    rport = free_port()
    procs.ringlimit(
        "handoff-router",
        "router",
        *("--port", str(rport), "--config", str(cfg), "--no-health-checks"),
        *("--node", f"A={urls['A']}", "--node", f"B={urls['B']}"),
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
    args = parser.parse_args(argv)
    for _ in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="ringlimit-handoff-") as tmp:
            workdir = Path(tmp)
            (workdir / "cluster.toml").write_text(cluster_toml(Settings()))
            procs = Processes(workdir)
            try:
                result = run_handoff(procs, workdir, args.keys)
            finally:
                procs.stop_all()
        print(f"handoff of {args.keys:,} keys: {result['seconds']:.2f} s ({result['detail']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
