"""A proxied request's body, through a real router and node: the router buffers
it, up to ``--max-request-body`` (default 1 MiB) and the config's
``limits.max_body``, the smaller; past either, ``413 body_too_large`` naming
which one, at once.

Before: a body past the bound sent whole was never answered (the router read
it to its end, then waited for more that could not come, and the client
waited until it gave up: ``node.asgi.read_all``); the router's own 1 MiB had
no flag, so raising ``limits.max_body`` for uploads changed nothing, and the
413 did not say why.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from node.asgi import read_all
from tests.processes import Procs, procs  # noqa: F401 (fixture)

MIB = 1 << 20


@pytest.mark.parametrize(
    "parts",
    [[b"x" * 10], [b"x" * 6, b"x" * 4], [b"x" * 10, b"x"]],
    ids=["in-one-part", "the-last-part-crosses", "an-earlier-part-crosses"],
)
def test_a_body_past_the_limit_is_refused_without_waiting_for_more(parts: list[bytes]) -> None:
    """As a server's ``receive`` does: after the last part it waits (for a
    disconnect), so reading on after the last part never returns."""

    async def run() -> bytes | None:
        messages = [
            {"type": "http.request", "body": part, "more_body": i < len(parts) - 1}
            for i, part in enumerate(parts)
        ]
        forever = asyncio.get_running_loop().create_future()

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            return await forever  # type: ignore[no-any-return]

        return await asyncio.wait_for(read_all(receive, 9), timeout=2.0)

    assert asyncio.run(run()) is None


def _parts(size: int) -> Iterator[bytes]:
    """A body without a length (chunked), its last part the one past the bound."""
    yield b"s" * (size - 1)
    yield b"s"


@pytest.mark.integration
def test_uploads_past_a_mebibyte_pass_once_both_bounds_allow_them(
    procs: Procs,  # noqa: F811
    tmp_path: Path,
) -> None:
    config = tmp_path / "cluster.toml"
    config.write_text(
        '[[rules]]\nname = "api"\nrate = "100/minute"\n\n[limits]\nmax_body = 4194304\n'
    )
    _, node = procs.node("n1", None, "--config", str(config), "--app", "tests.sample_app:app")
    seed = ("--node", f"n1={node}", "--config", str(config))
    _, default = procs.router(None, *seed)
    _, raised = procs.router(None, *seed, "--max-request-body", str(3 * MIB))
    user = {"X-User-Id": "alice"}
    with httpx.Client(timeout=10.0) as client:
        for content in (b"x" * (MIB + 1), _parts(MIB + 1)):
            refused = client.post(f"{default}/upload", headers=user, content=content)
            assert refused.status_code == 413
            assert refused.json()["error"] == "body_too_large"
            assert "(--max-request-body)" in refused.json()["detail"]
        upload = b"y" * (2 * MIB)
        passed = client.post(f"{raised}/upload", headers=user, content=upload)
        assert passed.status_code == 201, passed.text
        assert passed.json()["body"] == upload.decode()
        # Past the config's limits.max_body (4 MiB), whatever the flag says.
        over = client.post(f"{raised}/upload", headers=user, content=b"z" * (4 * MIB + 1))
        assert over.status_code == 413
        assert "(--max-request-body)" in over.json()["detail"]
        _, wide = procs.router(None, *seed, "--max-request-body", str(8 * MIB))
        over = client.post(f"{wide}/upload", headers=user, content=b"z" * (4 * MIB + 1))
        assert over.status_code == 413
        assert "(max_body)" in over.json()["detail"], over.json()
        _, even = procs.router(None, *seed, "--max-request-body", str(4 * MIB))
        over = client.post(f"{even}/upload", headers=user, content=b"z" * (4 * MIB + 1))
        assert "(--max-request-body and max_body)" in over.json()["detail"], over.json()


def test_up_passes_its_routers_proxy_flags_on(tmp_path: Path) -> None:
    """``ringlimit up`` takes them for its router (before: refused as unknown)."""
    from node.config import ClusterConfig
    from router.cli import build_parser
    from router.supervisor import _router_argv

    flags = ["--forward-timeout", "7.5", "--max-request-body", "2000000", "--max-answer", "3000000"]
    args = build_parser().parse_args(["up", *flags])
    argv = _router_argv(args, ClusterConfig(), "127.0.0.1", tmp_path / "c.toml", [])
    assert [argv[argv.index(f) + 1] for f in flags[::2]] == flags[1::2]
    plain = _router_argv(
        build_parser().parse_args(["up"]), ClusterConfig(), "127.0.0.1", tmp_path / "c.toml", []
    )
    assert not set(flags[::2]) & set(plain)


def _head_only(url: str, path: str, *fields: str) -> bytes:
    """A POST's head announcing 10 MB and awaiting ``100 Continue``: what comes
    back first, within 3 s (the body is never sent)."""
    host, _, port = url.removeprefix("http://").partition(":")
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000\r\n"
        "Expect: 100-continue\r\n" + "".join(f"{f}\r\n" for f in fields) + "\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=3) as sock:
        sock.sendall(head.encode())
        return sock.recv(65536)


@pytest.mark.integration
def test_a_refusal_does_not_invite_the_body_it_refuses(procs: Procs) -> None:  # noqa: F811
    """Before, the router and the node read a refused request's whole body
    first (sending ``100 Continue`` for it): a denied upload was
    uploaded, then refused."""
    _, node = procs.node("n1", None, "--rule", "api=1/minute")
    _, router = procs.router(None, "--node", f"n1={node}", "--rule", "api=1/minute")
    # The router's own refusals: no user id, an id too long.
    assert _head_only(router, "/upload").startswith(b"HTTP/1.1 400 "), "missing user"
    assert _head_only(router, "/upload", "X-User-Id: " + "k" * 300).startswith(b"HTTP/1.1 400 ")
    # A target that is not a path, on either process.
    for url in (router, node):
        assert _head_only(url, "*").startswith(b"HTTP/1.1 400 "), url
    # The node's 429 (straight to it: through the router the body is whole first).
    assert httpx.post(f"{node}/upload", headers={"X-User-Id": "u"}, content=b"x").status_code == 200
    assert _head_only(node, "/upload", "X-User-Id: u").startswith(b"HTTP/1.1 429 ")


def _refused_early(url: str, size: int) -> tuple[bytes, bool]:
    """A denied POST of ``size`` bytes, sent whole: its answer's head, and
    whether the same connection then serves another request."""
    host, _, port = url.removeprefix("http://").partition(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        head = f"POST /upload HTTP/1.1\r\nHost: x\r\nX-User-Id: u\r\nContent-Length: {size}\r\n\r\n"
        sock.sendall(head.encode())
        answer = sock.recv(65536)
        try:
            sock.sendall(b"x" * size)
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            rest = b""
            while b"HTTP/1.1 200" not in rest:
                chunk = sock.recv(65536)
                if not chunk:
                    return answer, False
                rest += chunk
        except OSError:
            return answer, False
        return answer, True


@pytest.mark.integration
def test_an_early_answer_whose_rest_will_not_be_read_says_connection_close(
    procs: Procs,  # noqa: F811
) -> None:
    """A node answering a body past what its front door drains (4 MiB) closes the
    connection after the answer: the answer says so. It did not, and the
    router's client pooled the connection and lost the next request written on
    it (another client's: ``504 node_timeout``; found by a review)."""
    _, node = procs.node("n1", None, "--rule", "api=1/minute")
    assert httpx.post(f"{node}/upload", headers={"X-User-Id": "u"}, content=b"x").status_code == 200
    head, kept = _refused_early(node, 6 * MIB)
    assert head.startswith(b"HTTP/1.1 429 ") and b"\r\nconnection: close\r\n" in head.lower()
    assert not kept
    head, kept = _refused_early(node, 3 * MIB)  # drained: the connection stays
    assert head.startswith(b"HTTP/1.1 429 ") and b"connection: close" not in head.lower()
    assert kept
