"""A router's CPU per decision on the decision API's batch path, in process.

A router with a ring of two nodes answers batches of 100 checks (``POST
/v1/check``, random users of 10,000, as in the bench's batch row) straight
through its raw ASGI handler (``DecisionAPI.check_asgi``): reading the body,
decoding and checking it, splitting it by owner, the merger, the batch sent to
each node, splitting each node's answer into its results and merging them back
in order. The nodes are a stand-in forwarder that answers at once, with one
result line per check as a real node writes it (no sockets, no HTTP, no node
processes). What it leaves out is the same before and after a change to that
path, so two commits compare side by side here without the cluster's noise.
The node side of the same path is ``benchmarks/batchpath.py``.

Like a router process, it freezes its heap out of garbage collection and
collects young objects less often (``node.memory.tune_gc``) before measuring.
Run and count its instructions as ``benchmarks/batchpath.py`` says (with
``python -m benchmarks.batchroute``).
"""

from __future__ import annotations

import json
import random
import time
from typing import Any

from benchmarks.batchpath import run
from node.config import ClusterConfig
from node.memory import tune_gc
from node.wire import lines_body
from ring import Member, RingView
from router.app import Router, RouterSettings
from router.forward import Answer

CONFIG = {"rules": [{"name": "bench", "limit": 1000, "period": "1s"}]}
USERS = 10_000
BATCH = 100
NODES = 2
#: Distinct bodies, sent round-robin (so the owners' batches vary as in the bench).
BODIES = 50
#: One node's result for one check, as a node writes it (node/wire.py node_batch_body).
RESULT = (
    b'{"allowed":true,"limit":1000,"remaining":998,"reset_after":0.002,"retry_after":null,'
    b'"rule":"bench","available_after":0.001,"node":"n1"}'
)


class _Nodes:
    """The forwarder: every node answers each batch at once, a result per check."""

    def __init__(self) -> None:
        self.answers = {n: lines_body([RESULT] * n) for n in range(1, BATCH + 1)}

    async def post_json(self, url: str, payload: bytes, headers: list[tuple[str, str]]) -> Answer:
        return Answer(200, [], self.answers[payload.count(b'"key"')])

    async def close(self) -> None:
        return None


def _router() -> Router:
    """A router with a ring of :data:`NODES` nodes (never started: no health checks,
    no seeds to ask) and the stand-in nodes."""
    router = Router(RouterSettings(config=ClusterConfig.from_dict(CONFIG), health_checks=False))
    members = [Member(f"n{i}", f"http://127.0.0.1:{9000 + i}") for i in range(1, NODES + 1)]
    router.membership.log.view = RingView.of(members, epoch=1)
    router.forwarder = _Nodes()  # type: ignore[assignment]
    return router


def _bodies() -> list[bytes]:
    """The batches, as the bench's load generator writes them."""
    rng = random.Random(15)
    return [
        json.dumps(
            {
                "checks": [
                    {"key": f"user:{rng.randint(1, USERS)}", "rule": "bench"} for _ in range(BATCH)
                ]
            },
            separators=(",", ":"),
        ).encode()
        for _ in range(BODIES)
    ]


async def _post(router: Router, body: bytes) -> bytes:
    """One ``POST /v1/check`` through the router's handler; the answer's body."""
    scope: dict[str, Any] = {
        "type": "http",
        "method": "POST",
        "path": "/v1/check",
        "headers": [(b"content-length", str(len(body)).encode())],
    }
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await router.decisions.check_asgi(scope, receive, send)
    if sent[0]["status"] != 200:
        raise RuntimeError(f"the router answered {sent[0]['status']}: {sent[1]['body'][:300]!r}")
    payload: bytes = sent[1]["body"]
    return payload


async def measure(batches: int, rounds: int) -> list[float]:
    """Seconds per decision of each round of ``batches`` batches."""
    router = _router()
    bodies = _bodies()
    for body in bodies:  # every owner known, as in a long bench run
        answer = json.loads(await _post(router, body))
        if len(answer["results"]) != BATCH or answer["results"][0] != json.loads(RESULT):
            raise RuntimeError(f"the router merged {answer!r:.300}")
    tune_gc()  # as a router process does once started (node/server.py)
    seconds: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter()
        for i in range(batches):
            await _post(router, bodies[i % BODIES])
        seconds.append((time.perf_counter() - started) / (batches * BATCH))
    return seconds


def main(argv: list[str] | None = None) -> None:
    run("python -m benchmarks.batchroute", __doc__, measure, argv)


if __name__ == "__main__":
    main()
