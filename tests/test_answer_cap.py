"""The router holds a node's answer up to ``--max-answer`` bytes, no more
(router/forward.py ``AnswerTooLarge``).

It relays whole answers. Without the cap, an answer that went on and on (an
application streaming) was held whole: one such request grew a real router
by gigabytes within its 3 s forward timeout, and the client still got a 504.
Now the router stops reading past the cap, closes that connection to the node
and answers ``502 answer_too_large`` at once; an answer of exactly the cap
passes whole.

In process, both forwarders against ``tests.streaming_app`` served by uvicorn
on 127.0.0.1; then a real router and node.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.fastclient import FastForwarder
from router.forward import AiohttpForwarder, AnswerLost, AnswerTooLarge, Timeouts
from tests.processes import Procs, procs  # noqa: F401 (fixture)
from tests.real_cluster import admin_ring, view_of
from tests.streaming_app import app
from tests.uvicorn_serving import serving

CAP = 256 * 1024


@contextlib.asynccontextmanager
async def streaming_server() -> AsyncIterator[str]:
    async with serving(HttpToolsProtocol, app) as (port, _):
        yield f"http://127.0.0.1:{port}"


FORWARDERS: dict[str, Callable[[], FastForwarder | AiohttpForwarder]] = {
    "fastclient": lambda: FastForwarder(timeouts=Timeouts(total=30.0), max_answer=CAP),
    "aiohttp": lambda: AiohttpForwarder(timeouts=Timeouts(total=30.0), max_answer=CAP),
}


@pytest.mark.anyio
@pytest.mark.parametrize("which", list(FORWARDERS))
async def test_an_answer_past_the_cap_is_refused_and_one_at_it_passes(which: str) -> None:
    forwarder = FORWARDERS[which]()
    try:
        async with streaming_server() as url:
            whole = await forwarder.request("GET", f"{url}/bytes/{CAP}", [], None)
            assert (whole.status, len(whole.body)) == (200, CAP)
            with pytest.raises(AnswerTooLarge) as raised:
                await forwarder.request("GET", f"{url}/bytes/{CAP + 1}", [], None)
            assert f"{CAP} bytes" in raised.value.what
            # An answer without a length that goes on: refused at the cap, not at the
            # (here 30 s) timeout, and the next request is served.
            started = time.monotonic()
            with pytest.raises(AnswerTooLarge):
                await forwarder.request("GET", f"{url}/stream", [], None)
            assert time.monotonic() - started < 10
            after = await forwarder.request("GET", f"{url}/bytes/10", [], None)
            assert (after.status, after.body) == (200, b"x" * 10)
            # The cap is per answer: answers on one connection add up past it.
            for _ in range(3):
                half = await forwarder.request("GET", f"{url}/bytes/{CAP // 2 + 1}", [], None)
                assert len(half.body) == CAP // 2 + 1
            # The decision API's answers (post_json) follow from its own limits.
            internal = await forwarder.post_json(f"{url}/bytes/{CAP * 2}", b"{}", [])
            assert len(internal.body) == CAP * 2
    finally:
        await forwarder.close()


@pytest.mark.anyio
async def test_requests_pipelined_behind_an_answer_too_large_are_lost_not_resent() -> None:
    """They were written on the connection that is closed: the node may have
    decided them, so they fail as lost answers (never sent again)."""
    forwarder = FastForwarder(timeouts=Timeouts(total=30.0), max_answer=CAP, pipeline=4)
    try:
        async with streaming_server() as url:
            first, second = await asyncio.gather(
                forwarder.request("GET", f"{url}/stream", [], None),
                forwarder.request("GET", f"{url}/bytes/10", [], None),
                return_exceptions=True,
            )
            assert isinstance(first, AnswerTooLarge)
            assert isinstance(second, AnswerLost) and not isinstance(second, AnswerTooLarge)
            # A decision-API call pipelined with a capped request keeps its exemption.
            internal, small = await asyncio.gather(
                forwarder.post_json(f"{url}/bytes/{CAP * 2}", b"{}", []),
                forwarder.request("GET", f"{url}/bytes/10", [], None),
            )
            assert (len(internal.body), small.body) == (CAP * 2, b"x" * 10)
    finally:
        await forwarder.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")  # pragma: no cover


def test_a_real_router_answers_502_for_an_answer_past_its_cap(procs: Procs) -> None:  # noqa: F811
    cap = 1 << 20
    _, node = procs.node("n1", None, "--app", "tests.streaming_app:app")
    router_proc, router = procs.router(None, "--node", f"n1={node}", "--max-answer", str(cap))
    user = {"X-User-Id": "alice"}
    with httpx.Client(timeout=20.0) as client:
        assert client.get(f"{router}/bytes/10", headers=user).status_code == 200
        before = _rss_kib(router_proc.pid)
        started = time.monotonic()
        answer = client.get(f"{router}/stream", headers=user)
        took = time.monotonic() - started
        grew_mib = (_rss_kib(router_proc.pid) - before) / 1024
        assert answer.status_code == 502, answer.text
        assert answer.json()["error"] == "answer_too_large"
        assert answer.headers["x-ringlimit-node"] == "n1"
        # At the cap, not at the 3 s forward timeout; held no more than the cap
        # and a read or two (it grew by gigabytes before).
        assert took < 2.5, took
        assert grew_mib < 48, grew_mib
        whole = client.get(f"{router}/bytes/{cap}", headers=user)
        assert (whole.status_code, len(whole.content)) == (200, cap)
        assert client.get(f"{router}/bytes/{cap + 1}", headers=user).status_code == 502
        assert client.get(f"{router}/bytes/10", headers=user).status_code == 200


def test_a_failover_answer_past_the_cap_is_a_502_too(procs: Procs) -> None:  # noqa: F811
    """The owner is down and the rule fails open: the request goes to the next
    node, whose answer is too large. Named as such (it was ``no_node_available``,
    uncounted)."""
    nodes = procs.nodes(["n1", "n2"], "--app", "tests.streaming_app:app")
    seeds = [f"{node_id}={url}" for node_id, (_, url) in nodes.items()]
    _, router = procs.router(
        None,
        *(a for s in seeds for a in ("--node", s)),
        "--no-health-checks",
        "--max-answer",
        str(1 << 20),
    )
    view = view_of(admin_ring(router))
    user = next(f"u{i}" for i in range(1000) if view.owner_id(f"u{i}") == "n2")
    nodes["n2"][0].kill9()
    answer = httpx.get(f"{router}/stream", headers={"X-User-Id": user}, timeout=20.0)
    assert answer.status_code == 502, answer.text
    assert answer.json()["error"] == "answer_too_large"
    assert answer.headers["x-ringlimit-node"] == "n1"
