"""What the event loop's per-request calls cost, on the loop a node and a router run on.

A hot path that calls one of these once per request pays it on every request:
``asyncio.get_running_loop()`` (on CPython 3.11 a ``getpid`` system call each
time; router/fastclient.py keeps a connection's loop instead), a timer armed
and cancelled (uvicorn's keep-alive timer per response; node/keepalive.py
keeps one per connection), and a callback scheduled and run (node/server.py's
flush of a step's writes). An attribute read is the yardstick.

Run: ``python -m benchmarks.loopcalls [--calls N]``, which prints nanoseconds
per call (the fastest of three rounds) on uvloop when installed, else asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable


def _nothing() -> None:
    return None


def _rounds(body: Callable[[int], None], calls: int) -> float:
    """Nanoseconds per call of the fastest of three rounds of ``body(calls)``."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        body(calls)
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e9


async def measure(calls: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()

    def running_loop(n: int) -> None:
        get = asyncio.get_running_loop
        for _ in range(n):
            get()

    def attribute(n: int) -> None:
        for _ in range(n):
            loop.time  # noqa: B018 (the read is what is measured)

    def timer(n: int) -> None:
        call_later = loop.call_later
        for _ in range(n):
            call_later(60.0, _nothing).cancel()

    def callback(n: int) -> None:
        call_soon = loop.call_soon
        for _ in range(n):
            call_soon(_nothing)

    figures = {
        "asyncio.get_running_loop()": _rounds(running_loop, calls),
        "an attribute read": _rounds(attribute, calls),
        "call_later + cancel": _rounds(timer, calls),
    }
    # Scheduled here, run by the loop before the next round: both are counted.
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        callback(calls)
        await asyncio.sleep(0)
        best = min(best, (time.perf_counter() - started) / calls)
    figures["call_soon, and the callback run"] = best * 1e9
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loopcalls", description=__doc__)
    parser.add_argument("--calls", type=int, default=200_000, help="calls per round")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:  # pragma: no cover (uvloop is a dependency on Linux)
        name, figures = "asyncio", asyncio.run(measure(args.calls))
    else:
        name, figures = "uvloop", uvloop.run(measure(args.calls))
    for what, ns in figures.items():
        print(f"{what}: {ns:,.0f} ns per call ({name})")


if __name__ == "__main__":
    main()
