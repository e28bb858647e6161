"""An application that sends rate-limit fields of its own, behind a node.

Its ``X-RateLimit-*`` and ours were both written: two ``X-RateLimit-Remaining``
in one answer, which a client reads as one unparseable value. The legacy
fields describe the most restrictive quota, so one set is written: the
application's when its remaining is below ours, ours otherwise. Checked on the
three ways a node's fields reach an answer: its front door's written lines,
uvicorn's own ``send`` under the front door (an access log), and the wrapper
of ``send`` under any other ASGI server.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from node.authority import Authority
from node.config import ClusterConfig, ScopedRule
from node.frontdoor import FrontDoor, limited_protocol
from node.middleware import RateLimitMiddleware
from node.rules import Rule
from tests.uvicorn_serving import serving

LEGACY = (b"x-ratelimit-limit", b"x-ratelimit-remaining", b"x-ratelimit-reset")


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Sends its own quota's fields: ``?left=N`` is its remaining (``?left=`` none,
    ``?left=junk`` an unreadable one); names in the case ``?case=upper`` asks."""
    query = dict(
        part.split("=", 1) for part in scope["query_string"].decode().split("&") if "=" in part
    )
    headers = [(b"content-length", b"2")]
    if query.get("left"):
        own = [
            (b"x-ratelimit-limit", b"10"),
            (b"x-ratelimit-remaining", query["left"].encode()),
            (b"x-ratelimit-reset", b"7"),
            (b"ratelimit-policy", b'"app";q=10;w=60'),
        ]
        if query.get("case") == "upper":
            own = [(name.title(), value) for name, value in own]
        headers += own
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


def limited() -> RateLimitMiddleware:
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 100, 60.0)),), legacy_reset="delta")
    return RateLimitMiddleware(app, authority=Authority.in_memory(config), trust_router=False)


async def over_a_socket(paths: list[str], access_log: bool) -> list[list[tuple[str, str]]]:
    """The node's front door (node/frontdoor.py) serving the middleware."""
    protocol = limited_protocol(HttpToolsProtocol, FrontDoor())
    answers = []
    async with (
        serving(protocol, limited(), ws="none", access_log=access_log) as (port, _),
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
    ):
        for path in paths:
            answer = await client.get(path, headers={"X-User-Id": "ann"})
            answers.append(answer.headers.multi_items())
    return answers


async def in_process(paths: list[str]) -> list[list[tuple[str, str]]]:
    """Any other server: the middleware wraps ``send``."""
    transport = httpx.ASGITransport(app=limited())  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://node") as client:
        return [
            (await client.get(path, headers={"X-User-Id": "ann"})).headers.multi_items()
            for path in paths
        ]


@pytest.mark.parametrize("server", ["front door", "front door, access log", "other server"])
def test_one_set_of_legacy_fields_the_most_restrictive(server: str) -> None:
    paths = [
        "/?left=3",  # the app's quota is tighter than ours (99, 98, ... left)
        "/?left=3&case=upper",
        "/?left=500",  # ours is tighter
        "/?left=junk",  # the app's unreadable: ours
        "/",  # the app sends none: ours
        "/?left=3",  # the same again: nothing remembered from the first answer
    ]
    if server == "other server":
        answers = asyncio.run(in_process(paths))
    else:
        answers = asyncio.run(over_a_socket(paths, access_log=server.endswith("log")))
    for path, fields in zip(paths, answers, strict=True):
        legacy = {name: value for name, value in fields if name.encode() in LEGACY}
        names = [name for name, _ in fields if name.encode() in LEGACY]
        assert sorted(names) == sorted(n.decode() for n in LEGACY), (path, fields)
        if "left=3" in path:
            assert legacy == {
                "x-ratelimit-limit": "10",
                "x-ratelimit-remaining": "3",
                "x-ratelimit-reset": "7",
            }, (path, fields)
        else:
            assert legacy["x-ratelimit-limit"] == "100", (path, fields)
            assert 90 <= int(legacy["x-ratelimit-remaining"]) < 100, (path, fields)
        # RateLimit-Policy is a list of named policies: ours is there whoever's
        # legacy fields were kept, beside the app's.
        policies = [value for name, value in fields if name == "ratelimit-policy"]
        assert any('"api"' in value for value in policies), (path, fields)
        assert any(name == "ratelimit" for name, _ in fields), (path, fields)
