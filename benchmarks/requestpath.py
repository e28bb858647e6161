"""A node's CPU per proxied request, limiter on and off, in process.

One node answers ``GET /load/x`` requests through the HTTP server it runs in
production (uvicorn's httptools protocol with node/frontdoor.py's limits and
node/server.py's coalesced writes) on a transport that is not a socket: the
request's bytes go into ``data_received`` and the answer's bytes come out of
``write``. Everything between is the node's: the HTTP parsing, the event
loop's task per request, RateLimitMiddleware, the decision, the rate-limit
fields, metrics and top keys, and the echo app's answer. Three setups, as in
the bench (benchmarks/deployments.py):

* ``off``: the ``direct`` row's node, no rules (the floor);
* ``direct``: the ``direct_limited`` (1l) row's node, the bench's rules, the
  user in ``X-User-Id``;
* ``routed``: a node of a two-node cluster (the ``sticky`` row), as the
  router forwards to it: the user in ``X-Ringlimit-Key`` too, an
  ``X-Forwarded-For``, only keys this node owns.

10,000 users round-robin; the clock moves 100 us per request (10,000 requests
a second, a C-level callable like the real one); the garbage collector tuned
as a node process tunes it. What the three share (the
HTTP server, the loop) cancels out in the differences, which is where a
change to the limiter's path shows, without the machine's noise.

Run: ``python -m benchmarks.requestpath [--requests N] [--rounds R] [--modes
off,direct,routed]``, which prints nanoseconds per request (the fastest round
and the median). For a figure that the machine's load cannot move, count
instructions: run it under ``valgrind --tool=callgrind`` with two values of
``--requests``, ``--rounds 1`` and one mode, and divide the difference of the
two totals by the difference of the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
import tomllib
from collections.abc import Coroutine
from email.utils import formatdate
from functools import partial
from operator import getitem
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from benchmarks.deployments import Settings, cluster_toml
from node.app import Node, NodeSettings, create_app
from node.config import ClusterConfig
from node.memory import tune_gc
from node.server import uvicorn_options
from router.testing import InProcessCluster

USERS = 10_000
#: Seconds between two requests on the node's clock (10,000 requests a second).
STEP = 1e-4
MODES = ("off", "direct", "routed")


class _Transport:
    """What uvicorn's protocol writes to; ``waiter`` gets each write's bytes."""

    def __init__(self) -> None:
        self.waiter: asyncio.Future[bytes] | None = None
        self.closing = False

    def write(self, data: bytes) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(data)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 50000), "sockname": ("127.0.0.1", 8000)}.get(
            name, default
        )

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def bench_config() -> ClusterConfig:
    """The rules every ringlimit process of the bench runs with."""
    return ClusterConfig.from_dict(tomllib.loads(cluster_toml(Settings())))


def requests(keys: list[str], routed: bool) -> list[bytes]:
    """One request per user, as wrk sends it or (``routed``) as the router forwards it."""
    if routed:
        return [
            b"GET /load/x HTTP/1.1\r\nhost: 127.0.0.1:8000\r\nx-user-id: %s\r\n"
            b"x-ringlimit-key: %s\r\nx-forwarded-for: 127.0.0.1\r\n\r\n" % (k.encode(), k.encode())
            for k in keys
        ]
    return [
        b"GET /load/x HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nX-User-Id: %s\r\n\r\n" % k.encode()
        for k in keys
    ]


async def drive(node: Node, payloads: list[bytes], box: list[float], n: int) -> list[bytes]:
    """Send ``n`` requests (round-robin over ``payloads``) on one keep-alive
    connection; the clock in ``box`` moves ``STEP`` per request. Answers the
    last answer of each payload seen (to check them)."""
    loop = asyncio.get_running_loop()
    config = uvicorn.Config(node, **uvicorn_options())
    config.load()
    protocol_class = config.http_protocol_class
    state = ServerState()
    # What uvicorn's server sets (and refreshes each second): every answer carries them.
    state.default_headers = [(b"date", formatdate(usegmt=True).encode()), *config.encoded_headers]
    protocol = protocol_class(config=config, server_state=state, app_state={}, _loop=loop)
    transport = _Transport()
    protocol.connection_made(transport)
    answers: list[bytes] = []
    count = len(payloads)
    for i in range(n):
        box[0] += STEP
        waiter = transport.waiter = loop.create_future()
        protocol.data_received(payloads[i % count])
        answer = await waiter
        if i < count:
            answers.append(answer)
    protocol.connection_lost(None)
    return answers


async def measure(mode: str, n: int, rounds: int, users: int = USERS) -> list[float]:
    """Seconds per request of each round of ``n`` requests in ``mode`` (``users``
    users round-robin)."""
    box = [1_000_000.0]
    clock = partial(getitem, box, 0)
    config = bench_config()
    names = [f"user:{i}" for i in range(users)]
    if mode == "routed":
        async with InProcessCluster(2, config, clock=clock) as cluster:
            node = cluster.nodes["n1"]
            view = cluster.router.membership.view
            keys = [u for u in names if view.owner_id(u) == "n1"]
            return await _rounds(node, requests(keys, True), box, n, rounds)
    limited = mode == "direct"
    node = create_app(
        NodeSettings(
            node_id="l1" if limited else "d1", config=config if limited else ClusterConfig()
        ),
        clock=clock,
    )
    return await _rounds(node, requests(names, False), box, n, rounds)


async def _rounds(
    node: Node, payloads: list[bytes], box: list[float], n: int, rounds: int
) -> list[float]:
    tune_gc()  # as a node process does once built (node/server.py)
    # Every user once first: the states exist, as after the bench's warm-up.
    answers = await drive(node, payloads, box, len(payloads))
    _check(answers[0], limited=bool(node.authority.config.rules))
    seconds: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter()
        await drive(node, payloads, box, n)
        seconds.append((time.perf_counter() - started) / n)
    return seconds


def _check(answer: bytes, *, limited: bool) -> None:
    """The node answered 200, with the rate-limit fields exactly when limiting."""
    if not answer.startswith(b"HTTP/1.1 200 "):
        raise RuntimeError(f"the node did not answer 200: {answer[:300]!r}")
    if limited != (b"\r\nratelimit: " in answer):
        raise RuntimeError(f"rate-limit fields {'missing' if limited else 'present'}: {answer!r}")


def run(main: Coroutine[Any, Any, list[float]]) -> list[float]:
    """``main`` on the event loop a node runs on: uvloop when installed (node/server.py)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover (uvloop is a dependency on Linux)
        return asyncio.run(main)
    return uvloop.run(main)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.requestpath", description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--users", type=int, default=USERS)
    parser.add_argument("--modes", default=",".join(MODES), help="of " + ",".join(MODES))
    args = parser.parse_args(argv)
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}")
        per = run(measure(mode, args.requests, args.rounds, args.users))
        print(
            f"{mode}: {min(per) * 1e9:,.0f} ns per request (fastest of {len(per)} rounds; "
            f"median {statistics.median(per) * 1e9:,.0f})"
        )


if __name__ == "__main__":
    main()
