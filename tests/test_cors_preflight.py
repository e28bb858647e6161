"""A CORS preflight (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) reaches the application and is never
limited (node/identity.py ``preflight_origin`` says why).

Before, one without a user id (a browser sends none on a preflight) got the
router's ``400 missing_user_id``, so a browser could make no cross-origin call
that needs a preflight (found by an exploratory tester); one with a user id
spent that user's quota.

A real router and two nodes, ``tests.sample_app`` answering 201 to anything.
"""

from __future__ import annotations

import httpx
import pytest

from tests.processes import Procs, procs  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


def test_a_preflight_reaches_the_app_unlimited(procs: Procs) -> None:  # noqa: F811
    rule = ("--rule", "api=1/minute")
    nodes = procs.nodes(["n1", "n2"], "--app", "tests.sample_app:app", *rule)
    seeds = [arg for node_id, (_, url) in nodes.items() for arg in ("--node", f"{node_id}={url}")]
    _, router = procs.router(None, *seeds, *rule)
    with httpx.Client(base_url=router, timeout=10.0) as client:
        for _ in range(3):
            answer = client.options("/orders", headers=PREFLIGHT)
            assert answer.status_code == 201, answer.text
            assert answer.json()["method"] == "OPTIONS"
            assert "ratelimit" not in answer.headers
        # With a user id (an identity a preflight can carry): not spent either.
        for _ in range(3):
            answer = client.options("/orders", headers={**PREFLIGHT, "X-User-Id": "u"})
            assert answer.status_code == 201, answer.text
        assert client.post("/orders", headers={"X-User-Id": "u"}).status_code == 201
        assert client.post("/orders", headers={"X-User-Id": "u"}).status_code == 429
        # An OPTIONS that is not a preflight is a request like any other.
        plain = client.options("/orders", headers={"Origin": "https://app.example"})
        assert plain.status_code == 400 and plain.json()["error"] == "missing_user_id"
        assert client.options("/orders", headers={"X-User-Id": "v"}).status_code == 201
        assert client.options("/orders", headers={"X-User-Id": "v"}).status_code == 429
