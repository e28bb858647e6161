"""The ring page (``GET /admin/ui``) in a real headless Chromium against a real cluster.

Debian's ``chromium`` (``.ci/run`` installs it when missing). The page is
loaded with ``--dump-dom`` and a virtual-time budget: Chromium runs the
page's script, lets its fetches complete and its refresh timer fire a few
times, then prints the resulting DOM, which is checked here. A screenshot is
taken the same way; ``RINGLIMIT_UPDATE_SCREENSHOTS=1`` copies it to
docs/img/ring_page.png.
"""

from __future__ import annotations

import contextlib
import html
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import ROOT, Procs, free_port, wait_for, wait_healthy

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on this machine (`.ci/run` installs Debian's chromium package)",
)

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
]


def chromium(tmp: Path, url: str, *action: str, budget_ms: int = 5000) -> str:
    """Run Chromium once on ``url`` with a fresh profile; its stdout.

    Its own session, so a timeout kills every process it started."""
    assert CHROMIUM is not None
    profile = tmp / f"profile-{time.monotonic_ns()}"
    argv = [
        CHROMIUM,
        *FLAGS,
        f"--user-data-dir={profile}",
        f"--virtual-time-budget={budget_ms}",
        *action,
        url,
    ]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    finally:
        # Chromium's helpers (zygote, renderer, GPU) share its session: none outlives it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.wait(10)
    assert proc.returncode == 0, f"chromium exited with {proc.returncode}"
    return out.decode("utf-8", "replace")


class Traffic:
    """Requests through the router on a thread, until stopped (bounded in time and count)."""

    def __init__(self, router: str, users: int = 12) -> None:
        self.router, self.users = router, users
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + 120
        with httpx.Client(base_url=self.router, timeout=5.0) as client:
            while not self._stop.is_set() and time.monotonic() < deadline and self.sent < 50_000:
                client.get("/hello", headers={"X-User-Id": f"user-{self.sent % self.users}"})
                self.sent += 1
                self._stop.wait(0.005)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)


def start_cluster(procs: Procs) -> tuple[str, str]:
    """Three nodes and two routers on them: one open on loopback, one with an admin
    token. Every process starts at once (a loaded machine takes seconds per start)."""
    ports = {n: free_port() for n in ("n1", "n2", "n3")}
    nodes = {
        n: procs.start(n, ["node", "--id", n, "--port", str(p), "--fenced"])
        for n, p in ports.items()
    }
    urls = {n: f"http://127.0.0.1:{p}" for n, p in ports.items()}
    for n, proc in nodes.items():
        wait_healthy(urls[n], proc)
    seeds = [arg for n, url in urls.items() for arg in ("--node", f"{n}={url}")]
    routers = []
    for token in (None, "s3cret-admin"):
        port = free_port()
        proc = procs.start(
            "router",
            ["router", "--port", str(port), *seeds, "--rule", "5/minute"],
            env={"RINGLIMIT_ADMIN_TOKEN": token} if token else None,
        )
        routers.append((f"http://127.0.0.1:{port}", proc))
    for url, proc in routers:
        wait_healthy(url, proc)
    return routers[0][0], routers[1][0]


def cells(dom: str, cls: str) -> list[str]:
    return [html.unescape(v) for v in re.findall(rf'<td class="{cls}">([^<]*)</td>', dom)]


@needs_chromium
def test_the_ring_page_in_chromium(procs: Procs, tmp_path: Path) -> None:
    router, guarded = start_cluster(procs)
    with Traffic(router) as traffic:
        assert wait_for(lambda: traffic.sent >= 150, timeout=30), "no traffic got through"
        dom = chromium(tmp_path, router + "/admin/ui", "--dump-dom")
        shot = tmp_path / "ring_page.png"
        chromium(tmp_path, router + "/admin/ui", "--window-size=1100,900", f"--screenshot={shot}")

    # The node list, a non-zero request rate, the top limited users, the events.
    assert 'data-loaded="1"' in dom, dom[-2000:]
    nodes = re.findall(r'<tr class="node" data-node="([^"]+)">', dom)
    assert sorted(nodes) == ["n1", "n2", "n3"]
    assert re.search(r'id="status"[^>]*>updated ', dom)
    rates = [float(v) for v in cells(dom, "rate")]
    assert len(rates) == 3 and sum(rates) > 0, rates
    total = re.search(r'id="total-rate">([0-9.]+)<', dom)
    assert total is not None and float(total.group(1)) > 0
    # 12 users at 5 per minute: some are denied, and shown by name.
    assert '<td class="key">user-' in dom
    # n1..n3 joined (or, had the other router pushed the ring first, it was recovered).
    assert 'class="event"' in dom and re.search(r"epoch 1: n\d.* (joined|recovered)", dom)

    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    if os.environ.get("RINGLIMIT_UPDATE_SCREENSHOTS") == "1":
        shutil.copy(shot, ROOT / "docs" / "img" / "ring_page.png")

    # With an admin token the page asks for it, and shows nothing without it.
    dom = chromium(tmp_path, guarded + "/admin/ui", "--dump-dom", budget_ms=2000)
    assert '<form id="login" class="shown">' in dom
    assert "This router needs its admin token." in dom
    assert 'data-node="' not in dom and "user-0" not in dom
    assert "s3cret-admin" not in dom


@needs_chromium
def test_a_refused_token_is_said_until_the_next_sign_in(tmp_path: Path) -> None:
    """The page's own script, in Chromium, with a token in the tab that the router
    refuses (``fetch`` answers 401: a page served from a file cannot reach a
    router, whose guard refuses web pages of another origin). "That token was
    refused." gave way to "This router needs its admin token." at the next
    update, within two seconds (an exploratory tester); it stays now, through
    the updates of a 5 s virtual budget."""
    from router.ui import BODY, SCRIPT

    refused = (
        "<script>"
        'sessionStorage.setItem("ringlimit-admin-token", "wrong");'
        'window.fetch = async () => new Response(\'{"error": "unauthorized"}\', {status: 401});'
        "</script>"
    )
    harness = tmp_path / "refused.html"
    harness.write_text(
        f"<!doctype html><html><body>{BODY}{refused}<script>{SCRIPT}</script></body></html>"
    )
    dom = chromium(tmp_path, harness.as_uri(), "--dump-dom", budget_ms=5000)
    assert '<form id="login" class="shown">' in dom
    assert '<p id="login-message">That token was refused.</p>' in dom, dom[:3000]
