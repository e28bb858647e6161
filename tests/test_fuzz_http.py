"""A hypothesis-driven fuzz of every HTTP endpoint of real router and node processes.

One router and two nodes on 127.0.0.1 (started once for the module, stopped at
its end). Junk methods, paths, headers, bodies and JSON go to the proxy path,
the decision API, the admin API and the nodes' internal API, through httpx and
as raw bytes on a socket. Every answer must be:

* never a 5xx, except the documented cluster-state answers (503
  ``ring_changing`` / ``no_nodes`` / ``limiter_unavailable``, 504
  ``node_timeout``);
* a JSON ``{"error", "detail"}`` body for every 4xx our code gives;
* in under 2 s;

and after all of it the ring epoch (router and nodes) and a known user's
remaining quota are what they were: rejected input changed nothing.

Generated input never names the known user and never is a valid change (a
join at a reachable new URL, a removal of a member, a newer ring view): those
are not rejected input, and the other test suites cover them.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.processes import Procs

pytestmark = [pytest.mark.integration, pytest.mark.reliability]

KNOWN = "known-user-7f3a"
#: Bounded: the whole module runs in well under a minute.
EXAMPLES = 60
LIMIT_SECONDS = 2.0
#: 5xx answers that describe the cluster's state, not a failure (docs).
DOCUMENTED_5XX = {
    503: {"ring_changing", "no_nodes", "limiter_unavailable", "lease_expired"},
    504: {"node_timeout"},
}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


#: Keys the internal-API fuzz writes states for, then has decided (never the known user).
POOL = [f"fz-{i}" for i in range(8)]


@dataclass
class Cluster:
    router: str
    nodes: dict[str, str]
    client: httpx.Client
    rule: str = "api"

    def epochs(self) -> list[int]:
        epochs = [self.client.get(f"{self.router}/healthz").json()["epoch"]]
        for url in self.nodes.values():
            epochs.append(self.client.get(f"{url}/healthz").json()["epoch"])
        return epochs

    def remaining(self) -> int:
        answer = self.client.post(f"{self.router}/v1/check", json={"key": KNOWN, "cost": 0})
        assert answer.status_code == 200, answer.text
        return int(answer.json()["remaining"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    manager = Procs(tmp_path_factory.mktemp("fuzz"))
    rule = ["--rule", "50/hour", "--algorithm", "sliding_log"]
    try:
        nodes = {node_id: url for node_id, (_, url) in manager.nodes(["n1", "n2"], *rule).items()}
        seeds = [a for node_id, url in nodes.items() for a in ("--node", f"{node_id}={url}")]
        _, router = manager.router(None, *seeds, *rule)
        with httpx.Client(timeout=5.0) as client:
            cluster = Cluster(router, nodes, client)
            for _ in range(3):
                answer = client.get(f"{router}/hello", headers={"X-User-Id": KNOWN})
                assert answer.status_code == 200, answer.text
            config = client.get(f"{nodes['n1']}/internal/cluster").json()["config"]
            cluster.rule = config["rules"][0]["name"]
            before = (cluster.epochs(), cluster.remaining())
            assert before[1] == 47
            yield cluster
            # Rejected input changed nothing: the ring, and the known user's quota.
            assert (cluster.epochs(), cluster.remaining()) == before
    finally:
        manager.stop_all()
        for proc in manager.started:
            log = proc.log_path.read_text(errors="replace")
            assert "Traceback" not in log, log[-3000:]


# --------------------------------------------------------------------------- strategies


def _no_known(text: str) -> bool:
    return KNOWN not in text and quote(KNOWN) not in text


texts = st.text(max_size=30).filter(_no_known)
header_text = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=40
).filter(lambda v: _no_known(v) and v == v.strip(" \t"))  # (h11 refuses to send padding)
numbers = st.one_of(
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, -1, 1e999, -1e999, 10**30]),
)
scalars = st.one_of(st.none(), st.booleans(), numbers, texts)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)
member_ids = st.one_of(
    st.sampled_from(["n9", "a/b", "a?b", "a#b", "..", "\ud800", "", " n9", "x" * 65]), texts
)


def bad_urls(cluster: Cluster) -> st.SearchStrategy[Any]:
    """URLs a join must refuse at once: malformed, or already taken."""
    return st.one_of(
        st.sampled_from(
            [
                *cluster.nodes.values(),
                cluster.router,
                cluster.router + "/",
                "ftp://x",
                "http://",
                "http://a:0",
                "http://a:99999",
                "http://a/x",
                "http://a?x",
                "http://u@a",
                "a:1",
            ]
        ),
        numbers,
        st.none(),
    )


def records(cluster: Cluster) -> st.SearchStrategy[Any]:
    """Exported states, mostly of the cluster's rule and the pool's keys, with junk inside."""
    poison = st.sampled_from([0, 1.5, -20, 1e999, -1e999, 1e300, -1e300, 1e9, -5.0])
    state = st.one_of(
        st.lists(poison, min_size=1, max_size=3),
        st.lists(numbers, min_size=1, max_size=3),
        st.lists(st.floats(-1e9, 1e9), min_size=2, max_size=2),
        json_values,
    )
    return st.lists(
        st.one_of(
            st.tuples(
                st.sampled_from([cluster.rule, cluster.rule, "other"]) | texts,
                st.sampled_from(["sliding_log", "sliding_log", "token_bucket", "gcra"]) | texts,
                st.sampled_from(POOL) | texts.filter(bool) | numbers | st.none(),
                state,
            ).map(list),
            json_values,
        ),
        max_size=4,
    )


def bodies(cluster: Cluster, path: str) -> st.SearchStrategy[Any]:
    """JSON bodies shaped like each endpoint's, mutated (mostly); or anything at all."""
    shaped: dict[str, st.SearchStrategy[Any]] = {
        "/v1/check": st.one_of(
            st.fixed_dictionaries(
                {"key": texts | numbers, "cost": numbers, "rule": texts | st.none()}
            ),
            st.fixed_dictionaries(
                {"checks": st.lists(st.fixed_dictionaries({"key": texts, "cost": numbers}))}
            ),
        ),
        "/admin/nodes": st.fixed_dictionaries(
            {"id": member_ids, "url": bad_urls(cluster)},
            optional={"weight": st.one_of(numbers, st.sampled_from([0, 1001, 10**6, True]))},
        ),
        "/internal/import": st.fixed_dictionaries(
            {
                "from": st.sampled_from(["n1", "n2"]) | member_ids | numbers,
                "epoch": st.sampled_from([1, 2]) | numbers,
                "records": records(cluster),
                "final": scalars,
            },
            optional={"crashes": json_values},
        ),
        "/internal/replica": st.fixed_dictionaries(
            {"from": member_ids | numbers, "records": records(cluster)}
        ),
        "/internal/pull": st.fixed_dictionaries(
            {
                "keys": st.lists(st.sampled_from(POOL) | texts | numbers),
                "to": member_ids,
                "epoch": numbers,
            }
        ),
        "/internal/lease": st.fixed_dictionaries({"grant": scalars, "seconds": numbers}),
        "/internal/cluster": st.fixed_dictionaries(
            {
                # Epoch 0 at most: a view older than the nodes', never a real change.
                "ring": st.one_of(
                    json_values, st.fixed_dictionaries({"epoch": st.just(0), "nodes": st.just([])})
                ),
                "config": json_values,
            },
            optional={"previous": json_values, "crashed": json_values, "lease": numbers},
        ),
    }
    shape = shaped.get(path, json_values)
    return st.one_of(shape, shape, shape, json_values)


PATHS = [
    "/",
    "/hello",
    "/v1/check",
    "/healthz",
    "/metrics",
    "/admin/ring",
    "/admin/nodes",
    "/admin/nodes/nope",
    "/internal/cluster",
    "/internal/import",
    "/internal/pull",
    "/internal/replica",
    "/internal/status",
    "/internal/lease",
    "/internal/top",
    "/internal/top?n=-1&rule=%00",
    "/admin/top",
    "/admin/top?rule=api&n=abc",
    "/admin/top?n=99999999999999999999",
    "/admin/ui",
    "/admin/ui/data",
    "/v1/check?key=%ff%fe",
    "/hello?x=%zz&&=",
]
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "TRACE", "BREW"]


#: Each endpoint that takes a body, with its method: the focused fuzz aims here.
ROUTER_BODIES = [("POST", "/v1/check"), ("POST", "/admin/nodes")]
NODE_BODIES = [
    ("POST", "/v1/check"),
    ("POST", "/internal/import"),
    ("POST", "/internal/replica"),
    ("POST", "/internal/pull"),
    ("POST", "/internal/lease"),
    ("PUT", "/internal/cluster"),
]


@st.composite
def requests(
    draw: st.DrawFn,
    cluster: Cluster,
    target: str,
    focus: list[tuple[str, str]] | None = None,
) -> dict[str, Any]:
    """A request to ``target``: anything, or (``focus``) one of the given endpoints
    with its method and mostly a body shaped like the endpoint's, mutated."""
    if focus:
        method, path = draw(st.sampled_from(focus))
    else:
        method = draw(st.sampled_from(METHODS))
        path = draw(
            st.one_of(
                st.sampled_from(PATHS),
                st.sampled_from(PATHS).flatmap(
                    lambda p: texts.map(lambda t: p.rstrip("/") + "/" + quote(t, safe=""))
                ),
                # Junk query strings (parameters the endpoint reads, and others).
                st.sampled_from(PATHS).flatmap(
                    lambda p: texts.map(
                        lambda t: p + ("&" if "?" in p else "?") + quote(t, safe="=&")
                    )
                ),
            )
        )
    if path.startswith("/admin/nodes/") and path.removeprefix("/admin/nodes/") in cluster.nodes:
        path = "/admin/nodes/nope"  # removing a member is a valid change, not junk
    headers = draw(
        st.dictionaries(
            st.sampled_from(
                [
                    "X-User-Id",
                    "Content-Type",
                    "Authorization",
                    "X-Ringlimit-Key",
                    "X-Ringlimit-Token",
                    "X-Ringlimit-Failover",
                    "X-Forwarded-For",
                    "Content-Encoding",
                    "Accept",
                    "X-Tier",
                ]
            ),
            header_text,
            max_size=5,
        )
    )
    kind = draw(st.sampled_from(["json"] * (8 if focus else 1) + ["bytes", "none"]))
    if kind == "json":
        body = json.dumps(draw(bodies(cluster, path)), allow_nan=True).encode("utf-8", "replace")
    elif kind == "bytes":
        body = draw(st.binary(max_size=200))
    else:
        body = b""
    if KNOWN.encode() in body:
        body = b""
    return {
        "method": method,
        "url": target + path,
        "headers": {k: v.encode("latin-1") for k, v in headers.items()},
        "content": body,
    }


def check_answer(response: httpx.Response, elapsed: float, what: str) -> None:
    assert elapsed < LIMIT_SECONDS, f"{what}: {elapsed:.2f}s"
    code = response.status_code
    if code >= 500:
        error = None
        with contextlib.suppress(ValueError, AttributeError):
            error = response.json().get("error")
        assert error in DOCUMENTED_5XX.get(code, set()), f"{what}: {code} {response.text[:300]}"
    if 400 <= code < 500 and response.request.method != "HEAD":
        try:
            body = response.json()
        except ValueError:
            raise AssertionError(
                f"{what}: {code} without a JSON body: {response.text[:200]}"
            ) from None
        assert isinstance(body, dict) and "error" in body, f"{what}: {code} {body}"


def send(cluster: Cluster, request: dict[str, Any]) -> None:
    started = time.monotonic()
    try:
        response = cluster.client.request(timeout=LIMIT_SECONDS + 1, **request)
    except httpx.HTTPError as exc:
        raise AssertionError(f"{request['method']} {request['url']}: {exc!r}") from None
    what = f"{request['method']} {request['url']} {request['content'][:120]!r}"
    check_answer(response, time.monotonic() - started, what)
    if "/internal/" in request["url"] and response.status_code == 200:
        still_decided(cluster, what)


def still_decided(cluster: Cluster, what: str) -> None:
    """Whatever an internal call took, every key is still decided sanely, by every
    node: a request is spent on each (pool keys are the fuzz's own)."""
    checks = {"checks": [{"key": key, "cost": 1} for key in POOL]}
    routed = cluster.client.post(f"{cluster.router}/v1/check", json=checks)
    assert routed.status_code == 200, f"after {what}: {routed.text[:300]}"
    for result in routed.json()["results"]:
        assert "error" not in result, f"after {what}: {result}"
        sane(result, what)
    for url in cluster.nodes.values():
        for key in POOL:
            answer = cluster.client.post(f"{url}/v1/check", json={"key": key, "cost": 1})
            assert answer.status_code in (200, 421), f"after {what}: {key} {answer.text[:300]}"
            if answer.status_code == 200:
                sane(answer.json(), what)


def sane(result: dict[str, Any], what: str) -> None:
    """A decision a client can use: a count, and a reset within a few periods (1 h).

    (``remaining`` may exceed the limit for a while after a peer sent a bucket
    fuller than this rule's capacity: peers are trusted not to.)"""
    assert result["remaining"] >= 0, f"after {what}: {result}"
    assert math.isfinite(result["reset_after"]) and 0 <= result["reset_after"] <= 3 * 3600, (
        f"after {what}: {result}"
    )


# --------------------------------------------------------------------------- the fuzz


@FUZZ
@given(data=st.data())
def test_router_endpoints_survive_junk(cluster: Cluster, data: st.DataObject) -> None:
    send(cluster, data.draw(requests(cluster, cluster.router)))


@FUZZ
@given(data=st.data())
def test_node_endpoints_survive_junk(cluster: Cluster, data: st.DataObject) -> None:
    node = data.draw(st.sampled_from(sorted(cluster.nodes.values())))
    send(cluster, data.draw(requests(cluster, node)))


@FUZZ
@given(data=st.data())
def test_router_bodies_survive_junk(cluster: Cluster, data: st.DataObject) -> None:
    """The decision API and the admin API, with bodies shaped like theirs."""
    send(cluster, data.draw(requests(cluster, cluster.router, ROUTER_BODIES)))


@FUZZ
@given(data=st.data())
def test_node_internal_api_survives_junk(cluster: Cluster, data: st.DataObject) -> None:
    """Transfers, pulls, leases, ring pushes and decisions, with bodies shaped like theirs;
    whatever a node takes, every key stays decidable."""
    node = data.draw(st.sampled_from(sorted(cluster.nodes.values())))
    send(cluster, data.draw(requests(cluster, node, NODE_BODIES)))


TARGETS = st.one_of(
    st.just(b"*"),
    st.sampled_from(
        [b"*", b"/", b"/hello", b"//", b"http://x/hello", b"x:1", b"/%", b"/%ff", b"?", b"/a#b"]
    ),
    st.binary(min_size=1, max_size=40).filter(lambda b: b" " not in b and b"\r" not in b),
)
RAW_METHODS = st.sampled_from([b"GET", b"POST", b"OPTIONS", b"CONNECT", b"PRI", b"G\x00T", b"get"])


@FUZZ
@given(
    data=st.data(),
    method=RAW_METHODS,
    target=TARGETS,
    version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/9", b""]),
    header_lines=st.lists(st.binary(max_size=40).filter(lambda b: b"\n" not in b), max_size=4),
    user=st.booleans(),
)
def test_raw_requests_always_get_a_status_line(
    cluster: Cluster,
    data: st.DataObject,
    method: bytes,
    target: bytes,
    version: bytes,
    header_lines: list[bytes],
    user: bool,
) -> None:
    base = data.draw(st.sampled_from([cluster.router, *sorted(cluster.nodes.values())]))
    port = int(base.rsplit(":", 1)[1])
    lines = [b" ".join(p for p in (method, target, version) if p), b"Host: x"]
    if user:
        lines.append(b"X-User-Id: fuzz")
    lines += [h for h in header_lines if KNOWN.encode() not in h]
    raw = b"\r\n".join(lines) + b"\r\n\r\n"
    started = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=LIMIT_SECONDS) as sock:
        sock.sendall(raw)
        try:
            while b"\r\n" not in answer:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                answer += chunk
        except ConnectionResetError:
            raise AssertionError(f"{raw[:120]!r}: connection reset") from None
        except TimeoutError:
            raise AssertionError(f"{raw[:120]!r}: no answer in {LIMIT_SECONDS}s") from None
    assert time.monotonic() - started < LIMIT_SECONDS
    assert answer.startswith(b"HTTP/1.1 "), f"{raw[:120]!r}: {answer[:200]!r}"
    code = int(answer[9:12])
    assert code < 500 or code in DOCUMENTED_5XX, f"{raw[:120]!r}: {answer[:300]!r}"
