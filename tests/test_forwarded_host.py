"""The router passes its client's ``Host`` on to the node, on every path a
proxied request takes (the fast client, and the text forwarders of a
failover), so an application behind a node builds its absolute URLs and
redirects from the host its client asked for.

Before, the node and its application saw the node's own address: a
Starlette app redirecting ``/items/`` to ``/items`` sent its client to
``http://127.0.0.1:<node port>/items`` (found by an exploratory tester).

Real router and node processes, ``tests.sample_app`` echoing what it got.
"""

from __future__ import annotations

import socket

import httpx
import pytest

from tests.processes import Procs, procs  # noqa: F401 (fixture)
from tests.real_cluster import admin_ring, view_of
from tests.test_integration import upstream  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

APP = ("--app", "tests.sample_app:app")


def _seen_host(answer: httpx.Response) -> list[str]:
    assert answer.status_code == 201, answer.text
    return [v for k, v in answer.json()["headers"] if k == "host"]


def test_the_clients_host_reaches_the_application(procs: Procs) -> None:  # noqa: F811
    nodes = procs.nodes(["n1", "n2"], *APP)
    seeds = [arg for node_id, (_, url) in nodes.items() for arg in ("--node", f"{node_id}={url}")]
    _, router = procs.router(None, *seeds, "--no-health-checks")
    view = view_of(admin_ring(router))
    users = [f"u{i}" for i in range(200)]
    on_n1 = next(u for u in users if view.owner_id(u) == "n1")
    on_n2 = next(u for u in users if view.owner_id(u) == "n2")
    with httpx.Client(timeout=10.0) as client:
        host = {"Host": "api.example.com"}
        seen = _seen_host(client.get(f"{router}/items", headers={**host, "X-User-Id": on_n1}))
        assert seen == ["api.example.com"]
        # A body goes through the same path, sized by the router.
        posted = client.post(f"{router}/items", headers={**host, "X-User-Id": on_n1}, content=b"x")
        assert _seen_host(posted) == ["api.example.com"]
        # HTTP/1.0 without a Host: the node's own (some host, never none or two).
        port = int(router.rpartition(":")[2])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(f"GET /items HTTP/1.0\r\nX-User-Id: {on_n1}\r\n\r\n".encode())
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 201"), head
        assert body.count(b'["host", "127.0.0.1:') == 1, body
        # Its owner down, an open rule sends the request to the next node (the
        # failover's text forwarder): the host is still the client's.
        nodes["n2"][0].kill9()
        failover = client.get(f"{router}/items", headers={**host, "X-User-Id": on_n2})
        assert _seen_host(failover) == ["api.example.com"]
        assert failover.headers.get("x-ringlimit-node") == "n1"


def test_an_upstream_gets_the_clients_host_as_x_forwarded_host(
    procs: Procs,  # noqa: F811
    upstream: str,  # noqa: F811
) -> None:
    """A node's ``--upstream`` sends its own Host there (as nginx does) and the
    client's in ``X-Forwarded-Host`` (it sent none: the redirect bug stayed for
    upstream apps, found by a review), unless a proxy ahead set one."""
    _, node = procs.node("n1", None, "--upstream", upstream)
    _, router = procs.router(None, "--node", f"n1={node}", "--no-health-checks")
    with httpx.Client(timeout=10.0) as client:
        headers = {"Host": "api.example.com", "X-User-Id": "u"}
        seen = dict(client.get(f"{router}/items", headers=headers).json()["headers"])
        assert seen["x-forwarded-host"] == "api.example.com"
        assert seen["host"] == upstream.removeprefix("http://")
        ahead = {**headers, "X-Forwarded-Host": "public.example"}
        seen = dict(client.get(f"{router}/items", headers=ahead).json()["headers"])
        assert seen["x-forwarded-host"] == "public.example"
