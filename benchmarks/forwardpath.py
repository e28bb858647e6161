"""The router's CPU per forwarded request on the sticky path, in process.

A router (:func:`router.server.router_server`'s protocol: the front door's
limits, the coalesced writes and the direct proxy path) serves raw HTTP/1.1
requests of the bench's ``sticky`` row (``GET /load/x`` with ``X-User-Id``)
arriving on in-memory connections, and forwards each with its
:class:`router.fastclient.FastForwarder` to one of two nodes that answer at
once with the bytes a real node sends (no sockets, no node processes). So
what is measured is the router's work per forward: parsing the request, the
user id, the checks, the owner, the request to the node, parsing its answer,
metrics, and the answer to the client; what it leaves out (system calls and
the nodes) is the same before and after a change to that path, so two
commits compare side by side here without the cluster's noise. The users
(:data:`USERS`) are fewer than the bench's and each has been forwarded once
before the rounds start, so every round sees what a long bench run does (the
owner of every user known) and no round depends on how many went before.
Like a router process, it freezes its heap out of garbage collection and
collects young objects less often (``node.memory.tune_gc``) before measuring.

Run: ``python -m benchmarks.forwardpath [--requests N] [--rounds R]
[--connections C] [--pipeline P]``, which prints nanoseconds per forward (the
fastest round and the median). For a figure that the machine's load cannot
move, count instructions: run it under ``valgrind --tool=callgrind`` with two
values of ``--requests`` and ``--rounds 1``, and divide the difference of the
two totals by the difference of the requests.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from email.utils import formatdate
from typing import Any

import uvicorn

from node.config import ClusterConfig
from node.memory import tune_gc
from ring import Member, RingView
from router.app import Router, RouterSettings
from router.fastclient import FastForwarder, _Connection
from router.server import router_server

CONFIG = {"rules": [{"name": "bench", "rate": "1000/second", "paths": ["/load/*"]}]}
USERS = 1_024
NODES = 2
#: What a node answers to the bench's ``GET /load/x`` (its own date and server fields too).
NODE_ANSWER = (
    b"HTTP/1.1 200 OK\r\ndate: Fri, 27 Nov 2026 18:41:48 GMT\r\nserver: uvicorn\r\n"
    b"content-type: application/json\r\ncontent-length: 61\r\n"
    b'ratelimit-policy: "bench";q=1000;w=1\r\nratelimit: "bench";r=999;t=1\r\n'
    b"x-ratelimit-limit: 1000\r\nx-ratelimit-remaining: 999\r\nx-ratelimit-reset: 1795804910\r\n"
    b'\r\n{"node":"s1","user":"user:1","method":"GET","path":"/load/x"}'
)


class _NodeEnd:
    """A node's end of a forwarding connection: every request written is answered
    in the next event-loop step (as a read would be), with :data:`NODE_ANSWER`."""

    def __init__(self, connection: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self._connection = connection
        self._loop = loop

    def write(self, data: bytes) -> None:
        requests = data.count(b"\r\n\r\n")  # the router's requests here have no body
        self._loop.call_soon(self._connection.data_received, NODE_ANSWER * requests)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        raise RuntimeError("the router closed a connection to a node")


class _ClientEnd:
    """A client's connection to the router: it sends its next request (in the next
    event-loop step) once the answer to the previous one arrived, ``left`` in all."""

    def __init__(
        self, number: int, step: int, requests: list[bytes], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.number = number
        #: The clients' numbers: together they send every user in turn.
        self.step = step
        self.requests = requests
        self.loop = loop
        self.protocol: Any = None
        self.left = 0
        self.sent = 0
        self.closed = False
        self.done: asyncio.Future[None] = loop.create_future()

    def run(self, count: int) -> asyncio.Future[None]:
        self.left = count
        self.done = self.loop.create_future()
        self._next()
        return self.done

    def _next(self) -> None:
        if self.left == 0:
            self.done.set_result(None)
            return
        self.left -= 1
        request = self.requests[(self.number + self.sent * self.step) % len(self.requests)]
        self.sent += 1
        self.loop.call_soon(self.protocol.data_received, request)

    # what uvicorn's protocol asks of its transport
    def write(self, data: bytes) -> None:
        if self.closed or not data.startswith(b"HTTP/1.1 200 "):
            raise RuntimeError(f"the router answered {data[:300]!r}")
        self._next()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {
            "sockname": ("127.0.0.1", 8000),
            "peername": ("127.0.0.1", 40000 + self.number),
        }.get(name, default)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


def _router(pipeline: int) -> tuple[Router, uvicorn.Server, FastForwarder]:
    """A router with a ring of :data:`NODES` nodes (never started: no health checks,
    no seeds to ask) and a fast forwarder."""
    router = Router(RouterSettings(config=ClusterConfig.from_dict(CONFIG), health_checks=False))
    members = [Member(f"n{i}", f"http://127.0.0.1:{9000 + i}") for i in range(1, NODES + 1)]
    router.membership.log.view = RingView.of(members, epoch=1)
    forwarder = FastForwarder(pipeline=pipeline)
    router.forwarder = forwarder
    server = router_server(router, host="127.0.0.1", port=8000)
    return router, server, forwarder


def _connect_nodes(
    forwarder: FastForwarder, members: tuple[Member, ...], count: int, loop: Any
) -> None:
    """``count`` idle connections per node, so that no forward connects."""
    for member in members:
        pool, _ = forwarder.base(member.url)
        for _ in range(count):
            connection = _Connection(loop)
            connection.pool = pool
            connection.connection_made(_NodeEnd(connection, loop))  # type: ignore[arg-type]
            pool.idle.append(connection)


async def measure(requests: int, rounds: int, connections: int, pipeline: int) -> list[float]:
    """Seconds per forward of each round of ``requests`` forwards."""
    loop = asyncio.get_running_loop()
    router, server, forwarder = _router(pipeline)
    _connect_nodes(forwarder, router.membership.view.members, connections, loop)
    config = server.config
    config.load()
    # What uvicorn's main loop sets (and renews each second) while it serves.
    server.server_state.default_headers = [
        (b"date", formatdate(usegmt=True).encode()),
        *config.encoded_headers,
    ]
    wanted = [
        f"GET /load/x HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nX-User-Id: user:{i}\r\n\r\n".encode()
        for i in range(1, USERS + 1)
    ]
    clients = [_ClientEnd(i, connections, wanted, loop) for i in range(connections)]
    for client in clients:
        client.protocol = config.http_protocol_class(  # type: ignore[call-arg]
            config=config, server_state=server.server_state, app_state={}, _loop=loop
        )
        client.protocol.connection_made(client)
    # Every user once (their owners, their quoted keys), whatever is measured after.
    await asyncio.gather(*(c.run(-(-USERS // connections)) for c in clients))
    tune_gc()  # as a router process does once started (node/server.py)
    share = max(1, requests // connections)
    seconds: list[float] = []
    for _ in range(rounds):
        started = time.perf_counter()
        await asyncio.gather(*(c.run(share) for c in clients))
        seconds.append((time.perf_counter() - started) / (share * connections))
    if any(c.closed for c in clients):
        raise RuntimeError("the router closed a client's connection")
    for client in clients:
        client.protocol.connection_lost(None)
    return seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.forwardpath", description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000, help="forwards per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--connections", type=int, default=16, help="clients at once")
    parser.add_argument("--pipeline", type=int, default=1, help="the router's --pipeline")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    coroutine = measure(args.requests, args.rounds, args.connections, args.pipeline)
    if args.loop == "uvloop":
        import uvloop

        per = uvloop.run(coroutine)
    else:
        per = asyncio.run(coroutine)
    print(
        f"{min(per) * 1e9:,.0f} ns per forward (fastest of {len(per)} rounds; "
        f"median {statistics.median(per) * 1e9:,.0f})"
    )


if __name__ == "__main__":
    main()
