"""The load of ``ringlimit bench``: wrk with ``wrk_users.lua``, or a built-in generator.

Both send the same thing: keep-alive connections (``connections`` of them),
each sending its next request as soon as the previous answer arrived, for
``duration`` seconds, with a user id drawn uniformly from a fixed population
(``users``, named ``<prefix><n>``):

* ``proxy``: ``GET URL`` with ``X-User-Id``;
* ``single``: ``POST URL`` (the decision API) with ``{"key": ..., "rule": ...}``;
* ``batch``: ``POST URL`` with ``{"checks": [...]}`` of ``batch`` such checks.

With ``count`` every answer is read and allowed/denied decisions are counted
(proxy: 200/429; decision API: ``"allowed": true/false`` in the body).

wrk is used when it is on the PATH (it is C and costs little CPU next to the
Python servers, which matters on a small machine); otherwise a built-in
asyncio generator runs in its own process (``python -m benchmarks.loadgen``),
which costs more CPU and so measures lower absolute throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.placement import pinned_argv

LUA_SCRIPT = Path(__file__).with_name("wrk_users.lua")
MARK = "RINGLIMIT_BENCH "
_ALLOWED = re.compile(rb'"allowed":\s*true')
_DENIED = re.compile(rb'"allowed":\s*false')


@dataclass
class Load:
    """What to send."""

    url: str
    mode: str = "proxy"  # proxy | single | batch
    users: int = 10_000
    prefix: str = "u"
    rule: str = "-"
    count: bool = False
    batch: int = 100
    duration: float = 5.0
    connections: int = 50
    #: proxy mode: the share of requests sent as one hot user, ``<prefix>hot``
    hot_share: float = 0.0
    #: The CPUs the generator runs on (``bench --pin``); None: anywhere.
    cpus: frozenset[int] | None = None


def hot_copies(users: int, share: float) -> int:
    """Copies of the hot user's request beside one per user, so that a uniform pick
    chooses it with probability ``share``."""
    if share <= 0:
        return 0
    return round(share * users / (1.0 - share))


@dataclass
class LoadResult:
    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    status_errors: int
    socket_errors: int
    allowed: int
    denied: int
    other: int
    tool: str

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    def to_dict(self) -> dict[str, float | int | str]:
        data: dict[str, float | int | str] = asdict(self)
        data["rps"] = self.rps
        return data


def wrk_available() -> bool:
    return shutil.which("wrk") is not None


def run(load: Load, tool: str = "auto") -> LoadResult:
    """Drive ``load`` with wrk (``auto`` when installed) or the built-in generator."""
    if tool == "wrk" or (tool == "auto" and wrk_available()):
        return run_wrk(load)
    return run_builtin(load)


def parse_marked(output: str, tool: str) -> LoadResult:
    """The result line (``RINGLIMIT_BENCH {json}``) printed by wrk_users.lua or this module."""
    for line in output.splitlines():
        if line.startswith(MARK):
            data = json.loads(line[len(MARK) :])
            return LoadResult(
                requests=int(data["requests"]),
                seconds=data["duration_us"] / 1e6,
                p50_ms=data["p50_us"] / 1e3,
                p99_ms=data["p99_us"] / 1e3,
                mean_ms=data["mean_us"] / 1e3,
                status_errors=int(data["status_errors"]),
                socket_errors=int(data["socket_errors"]),
                allowed=int(data["allowed"]),
                denied=int(data["denied"]),
                other=int(data["other"]),
                tool=tool,
            )
    raise RuntimeError(f"no result line in the load generator's output:\n{output[-2000:]}")


def _script_args(load: Load) -> list[str]:
    return [
        load.mode,
        str(load.users),
        load.prefix,
        load.rule,
        "count" if load.count else "-",
        str(load.batch),
        str(load.hot_share),
    ]


def run_wrk(load: Load) -> LoadResult:
    duration = max(1, round(load.duration))
    argv = [
        "wrk",
        "-t1",
        f"-c{load.connections}",
        f"-d{duration}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA_SCRIPT),
        load.url,
        "--",
        *_script_args(load),
    ]
    out = subprocess.run(
        pinned_argv(load.cpus, argv), capture_output=True, text=True, timeout=duration + 60
    )
    if out.returncode != 0:
        raise RuntimeError(f"wrk failed ({out.returncode}): {out.stderr[-2000:]}")
    return parse_marked(out.stdout, "wrk")


def run_builtin(load: Load) -> LoadResult:
    argv = [sys.executable, "-m", "benchmarks.loadgen", load.url, "--", *_script_args(load)]
    argv[4:4] = ["--duration", str(load.duration), "--connections", str(load.connections)]
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        pinned_argv(load.cpus, argv),
        capture_output=True,
        text=True,
        timeout=load.duration + 60,
        cwd=root,
    )
    if out.returncode != 0:
        raise RuntimeError(f"load generator failed ({out.returncode}): {out.stderr[-2000:]}")
    return parse_marked(out.stdout, "python")


# --------------------------------------------------------------------------- built-in generator


def build_requests(load: Load, rng: random.Random) -> list[bytes]:
    """The requests to pick from at random (one per user, or 1024 random batches)."""
    parts = urlsplit(load.url)
    host = parts.netloc
    path = parts.path or "/"
    if load.mode == "proxy":
        hot = f"GET {path} HTTP/1.1\r\nHost: {host}\r\nX-User-Id: {load.prefix}hot\r\n\r\n"
        return [
            f"GET {path} HTTP/1.1\r\nHost: {host}\r\nX-User-Id: {load.prefix}{i}\r\n\r\n".encode()
            for i in range(1, load.users + 1)
        ] + [hot.encode()] * hot_copies(load.users, load.hot_share)

    def check(key: str) -> dict[str, str]:
        return {"key": key} if load.rule in ("", "-") else {"key": key, "rule": load.rule}

    if load.mode == "single":
        bodies = [check(f"{load.prefix}{i}") for i in range(1, load.users + 1)]
    else:
        bodies = [
            {
                "checks": [
                    check(f"{load.prefix}{rng.randint(1, load.users)}") for _ in range(load.batch)
                ]
            }
            for _ in range(1024)
        ]
    out = []
    for body in bodies:
        payload = json.dumps(body, separators=(",", ":")).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        out.append(head + payload)
    return out


class _Client(asyncio.Protocol):
    def __init__(self) -> None:
        import httptools

        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None
        self.body: list[bytes] = []
        self.status = 0
        self.keep_body = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("connection lost"))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if self.keep_body:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)


async def _drive(load: Load) -> dict[str, float | int]:
    rng = random.Random(7919)
    requests = build_requests(load, rng)
    loop = asyncio.get_running_loop()
    parts = urlsplit(load.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    latencies: list[float] = []
    counts = {"allowed": 0, "denied": 0, "other": 0, "status_errors": 0, "socket_errors": 0}
    deadline = time.perf_counter() + load.duration
    perf = time.perf_counter
    choice = rng.choice

    async def worker() -> None:
        try:
            _, client = await loop.create_connection(_Client, host, port)
        except OSError:
            counts["socket_errors"] += 1
            return
        client.keep_body = load.count and load.mode != "proxy"
        while perf() < deadline:
            client.done = loop.create_future()
            client.body = []
            started = perf()
            assert client.transport is not None
            client.transport.write(choice(requests))
            try:
                await client.done
            except ConnectionError:
                counts["socket_errors"] += 1
                return
            latencies.append(perf() - started)
            status = client.status
            if status >= 400:
                counts["status_errors"] += 1
            if not load.count:
                continue
            if load.mode == "proxy":
                key = "allowed" if status == 200 else "denied" if status == 429 else "other"
                counts[key] += 1
            elif status != 200:
                counts["other"] += 1
            else:
                body = b"".join(client.body)
                yes, no = len(_ALLOWED.findall(body)), len(_DENIED.findall(body))
                counts["allowed"] += yes
                counts["denied"] += no
                if yes + no == 0:
                    counts["other"] += 1
        if client.transport is not None:
            client.transport.close()

    started = perf()
    await asyncio.gather(*(worker() for _ in range(load.connections)))
    elapsed = perf() - started
    latencies.sort()

    def pct(p: float) -> float:
        if not latencies:
            return 0.0
        return latencies[min(len(latencies) - 1, int(p / 100 * len(latencies)))] * 1e6

    return {
        "requests": len(latencies),
        "duration_us": elapsed * 1e6,
        "p50_us": pct(50),
        "p99_us": pct(99),
        "mean_us": (sum(latencies) / len(latencies) * 1e6) if latencies else 0.0,
        **counts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the built-in load generator of ringlimit bench")
    parser.add_argument("url")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=50)
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # as with wrk: MODE USERS PREFIX [RULE] [COUNT] [BATCH] after "--"
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    args = parser.parse_args(argv)
    defaults = ["proxy", "10000", "u", "-", "-", "100", "0"]
    values = [*script_args, *defaults[len(script_args) :]][:7]
    load = Load(
        url=args.url,
        mode=values[0],
        users=int(values[1]),
        prefix=values[2],
        rule=values[3],
        count=values[4] == "count",
        batch=int(values[5]),
        hot_share=float(values[6]),
        duration=args.duration,
        connections=args.connections,
    )
    try:
        import uvloop

        result = uvloop.run(_drive(load))
    except ImportError:
        result = asyncio.run(_drive(load))
    print(MARK + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
