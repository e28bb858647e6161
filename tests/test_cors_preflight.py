"""A CORS preflight (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) needs no user id: it is decided under the
same rules by its client's address, apart from every user's own quota
(node/identity.py ``preflight_origin`` says why).

Before, one without a user id (a browser sends none on a preflight) got the
router's ``400 missing_user_id``, so a browser could make no cross-origin call
that needs a preflight (found by an exploratory tester); one with a user id
spent that user's quota. (A first version passed preflights unlimited: any
client adding the two fields had every endpoint without a limit, found by a
review.)

A real router and two nodes, ``tests.sample_app`` answering 201 to anything.
"""

from __future__ import annotations

import httpx
import pytest

from tests.processes import Procs, procs  # noqa: F401 (fixture)

pytestmark = pytest.mark.integration

PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}


def test_a_preflight_is_limited_by_its_address_not_by_a_user(procs: Procs) -> None:  # noqa: F811
    rule = ("--rule", "api=2/minute")
    nodes = procs.nodes(["n1", "n2"], "--app", "tests.sample_app:app", *rule)
    seeds = [arg for node_id, (_, url) in nodes.items() for arg in ("--node", f"{node_id}={url}")]
    _, router = procs.router(None, *seeds, *rule)
    with httpx.Client(base_url=router, timeout=10.0) as client:
        first = client.options("/orders", headers=PREFLIGHT)
        assert first.status_code == 201, first.text
        assert first.json()["method"] == "OPTIONS"
        assert first.headers["ratelimit"].endswith(";r=1;t=30")
        # A user id on a preflight changes nothing: the address's quota is spent.
        assert client.options("/orders", headers={**PREFLIGHT, "X-User-Id": "u"}).status_code == 201
        assert client.options("/orders", headers=PREFLIGHT).status_code == 429
        # The user's own quota is whole.
        assert [
            client.post("/orders", headers={"X-User-Id": "u"}).status_code for _ in range(3)
        ] == [
            201,
            201,
            429,
        ]
        # An OPTIONS that is not a preflight is a request like any other.
        plain = client.options("/orders", headers={"Origin": "https://app.example"})
        assert plain.status_code == 400 and plain.json()["error"] == "missing_user_id"
        assert client.options("/orders", headers={"X-User-Id": "v"}).status_code == 201
