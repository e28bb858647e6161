"""Separately started processes on 127.0.0.1: a router, fenced nodes, and an upstream.

One cluster, three nodes fronting three kinds of application:

* n1 forwards to an upstream HTTP service (``--upstream``; here uvicorn serving
  ``tests.sample_app``, a third process),
* n2 serves an ASGI application in-process (``--app tests.sample_app:app``),
* n3 serves the built-in echo application.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from ring import Member, RingView
from tests.processes import ROOT, Procs, free_port, wait_for, wait_healthy
from tests.test_router import metric

pytestmark = pytest.mark.integration

CONFIG = """
[[rules]]
name = "api"
rate = "3/minute"
algorithm = "sliding_log"

[[rules]]
name = "hard"
rate = "2/minute"
paths = ["/hard*"]
on_error = "closed"
"""


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = open(tmp_path / "upstream.log", "wb")  # noqa: SIM115 (closed below)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "tests.sample_app:app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return httpx.get(url + "/ready", timeout=0.5).status_code == 201
            except httpx.HTTPError:
                return process.poll() is not None

        assert wait_for(up, 20) and process.poll() is None, (tmp_path / "upstream.log").read_text()
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        log.close()


def user_of(ring: RingView, node_id: str, prefix: str) -> str:
    return next(u for u in (f"{prefix}{n}" for n in range(2000)) if ring.owner_id(u) == node_id)


def test_router_and_fenced_nodes_fronting_an_upstream_an_app_and_echo(
    procs: Procs, upstream: str, tmp_path: Path
) -> None:
    ports = {n: free_port() for n in ("n1", "n2", "n3")}
    extra = {
        "n1": ["--upstream", upstream],
        "n2": ["--app", "tests.sample_app:app"],
        "n3": [],
    }
    nodes = {
        n: procs.start(n, ["node", "--id", n, "--port", str(p), "--fenced", *extra[n]])
        for n, p in ports.items()
    }
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    for n, proc in nodes.items():
        wait_healthy(urls[n], proc)
    # Fenced: a node decides nothing until a router sends it a view.
    with httpx.Client(timeout=5.0) as client:
        refused = client.post(urls["n1"] + "/v1/check", json={"key": "x"})
        assert refused.status_code == 421 and refused.json()["error"] == "not_owner"
        assert client.get(urls["n3"] + "/", headers={"X-User-Id": "x"}).status_code == 421

    config = tmp_path / "cluster.toml"
    config.write_text(CONFIG)
    seeds = [arg for n, url in urls.items() for arg in ("--node", f"{n}={url}")]
    _, router = procs.router(None, *seeds, "--config", str(config), "--health-interval", "60")
    ring = RingView.of([Member(n, u) for n, u in urls.items()], epoch=1)
    upstream_user = user_of(ring, "n1", "up-")
    app_user = user_of(ring, "n2", "app-")
    echo_user = user_of(ring, "n3", "echo-")

    with httpx.Client(base_url=router, timeout=10.0) as client:
        # n1 -> the upstream process: the whole request arrives there.
        response = client.post(
            "/orders/7?expand=items&n=1",
            headers={
                "X-User-Id": upstream_user,
                "X-Custom": "abc",
                "X-Name": "josé".encode(),
                "Content-Type": "application/octet-stream",
            },
            content=b"\x00binary body\xff",
        )
        assert response.status_code == 201, response.text
        assert response.headers["x-sample-app"] == "yes"
        assert response.headers["x-ringlimit-node"] == "n1"
        assert response.headers["ratelimit"] == '"api";r=2;t=60'
        seen = response.json()
        assert (seen["method"], seen["path"], seen["query"]) == (
            "POST",
            "/orders/7",
            "expand=items&n=1",
        )
        assert seen["body"] == b"\x00binary body\xff".decode("latin-1")
        headers = dict(seen["headers"])
        assert headers["x-custom"] == "abc"
        assert headers["x-name"] == "josé".encode().decode("latin-1"), "header bytes changed"
        assert headers["content-type"] == "application/octet-stream"
        assert not [h for h in headers if h.startswith("x-ringlimit-")]
        assert seen["user"] is None  # a separate process: it cannot see the node's state

        # n2 -> the ASGI app inside the node process.
        response = client.get("/inside?a=b", headers={"X-User-Id": app_user})
        assert response.status_code == 201 and response.headers["x-ringlimit-node"] == "n2"
        assert response.json()["user"] == app_user and response.json()["query"] == "a=b"

        # n3 -> the echo app.
        response = client.get("/echo", headers={"X-User-Id": echo_user})
        assert response.status_code == 200
        assert response.json() == {
            "node": "n3",
            "user": echo_user,
            "method": "GET",
            "path": "/echo",
        }

        # Every user: exactly the quota (the router's rules, pushed to the nodes), then 429.
        for user, owner, first in (
            (upstream_user, "n1", 201),
            (app_user, "n2", 201),
            (echo_user, "n3", 200),
        ):
            statuses = [client.get("/", headers={"X-User-Id": user}) for _ in range(3)]
            assert [r.status_code for r in statuses] == [first, first, 429], user
            assert {r.headers["x-ringlimit-node"] for r in statuses} == {owner}
            denied = statuses[-1]
            assert denied.json()["rule"] == "api" and int(denied.headers["retry-after"]) >= 59
            decided = client.post("/v1/check", json={"key": user, "cost": 0}).json()
            assert decided["allowed"] is False and decided["node"] == owner

        # The closed rule is under the decision API as well.
        fresh = user_of(ring, "n3", "fresh-")
        batch = client.post(
            "/v1/check", json={"checks": [{"key": fresh, "rule": "hard"}] * 3}
        ).json()["results"]
        assert [r["allowed"] for r in batch] == [True, True, False]

        # n3 dies and the router is not told (health checks every 60 s).
        nodes["n3"].kill9()
        victim = user_of(ring, "n3", "victim-")
        degraded = client.get("/soft", headers={"X-User-Id": victim})
        assert degraded.status_code in (200, 201), degraded.text
        assert degraded.headers["x-ringlimit-degraded"] == "owner-unreachable"
        assert degraded.headers["x-ringlimit-node"] in {"n1", "n2"}
        closed = client.get("/hard/x", headers={"X-User-Id": victim})
        assert closed.status_code == 503
        assert closed.json()["error"] == "limiter_unavailable" and closed.json()["node"] == "n3"
        check = client.post("/v1/check", json={"key": victim, "rule": "hard"})
        assert check.status_code == 503 and check.json()["reason"] == "owner_unreachable"
        text = client.get("/metrics").text
        events = "ringlimit_router_events_total"
        assert metric(text, events, node="n3", event="unreachable_open") == 1
        assert metric(text, events, node="n3", event="unreachable_closed") == 1
        # Users of the live nodes are unaffected.
        fine = client.get("/hard/x", headers={"X-User-Id": user_of(ring, "n2", "live-")})
        assert fine.status_code == 201 and "x-ringlimit-degraded" not in fine.headers


def test_forwarders_send_the_path_the_router_checked(upstream: str) -> None:
    """aiohttp (the forwarder for https nodes) resolved dot segments of the URL it
    was given: "/x/%2e%2e/internal/..." left the router, which had refused only
    paths starting with /internal, as "/internal/..." with the internal token
    added (the security audit reached a node's PUT /internal/cluster this way)."""
    import asyncio

    from router.fastclient import FastForwarder
    from router.forward import AiohttpForwarder

    async def main() -> None:
        for forwarder in (AiohttpForwarder(), FastForwarder()):
            try:
                answer = await forwarder.request(
                    "GET", upstream + "/x/%2e%2e/internal/cluster", [], None
                )
            finally:
                await forwarder.close()
            seen = json.loads(answer.body)
            assert seen["path"] == "/x/../internal/cluster", (type(forwarder).__name__, seen)

    asyncio.run(main())


def test_forwarders_send_the_client_header_bytes_unchanged(upstream: str) -> None:
    """The router holds header values as latin-1 text of the client's bytes; every
    forwarder must put those same bytes back on the wire (aiohttp writes UTF-8)."""
    import asyncio

    from router.fastclient import FastForwarder
    from router.forward import AiohttpForwarder

    sent = "josé €".encode()
    value = sent.decode("latin-1")
    invalid = b"caf\xe9".decode("latin-1")  # not UTF-8: cannot be sent byte for byte by aiohttp

    async def through(forwarder: object) -> dict[str, str]:
        try:
            answer = await forwarder.request(  # type: ignore[attr-defined]
                "POST", upstream + "/h?q=1", [("x-name", value), ("x-ascii", "plain")], b"body"
            )
        finally:
            await forwarder.close()  # type: ignore[attr-defined]
        assert answer.status == 201
        seen = json.loads(answer.body)
        assert (seen["method"], seen["path"], seen["query"], seen["body"]) == (
            "POST",
            "/h",
            "q=1",
            "body",
        )
        return dict(seen["headers"])

    async def main() -> None:
        for forwarder in (AiohttpForwarder(), FastForwarder()):
            headers = await through(forwarder)
            assert headers["x-name"] == value, type(forwarder).__name__
            assert headers["x-ascii"] == "plain"
        fast = FastForwarder()
        try:
            answer = await fast.request("GET", upstream + "/", [("x-bad", invalid)], None)
        finally:
            await fast.close()
        assert dict(json.loads(answer.body)["headers"])["x-bad"] == invalid

    asyncio.run(main())
