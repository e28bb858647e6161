"""``/metrics`` of the router and the nodes: Prometheus' naming conventions, no
``_created`` series, and every metric documented in ``docs/metrics.md``.

The pages are read with prometheus-client's own text parser (not by the code
that wrote them), after traffic that makes every labelled series appear.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from node.app import Node, NodeSettings
from node.backend import MemoryBackend
from node.clock import FrozenClock
from node.config import ClusterConfig, ScopedRule
from node.metrics import NodeMetrics, render
from node.redis_backend import FallbackBackend
from node.rules import Rule
from node.store import MemoryStore
from router.metrics import RouterMetrics, merge_workers
from router.testing import InProcessCluster, node_url

pytestmark = pytest.mark.anyio

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
NAME = re.compile(r"^ringlimit_[a-z][a-z0-9_]*[a-z0-9]$")
LABEL = re.compile(r"^[a-z][a-z0-9_]*$")


def documented() -> set[str]:
    """Every metric name in the first column of the doc's tables."""
    names = set()
    for line in DOC.read_text().splitlines():
        match = re.match(r"^\|\s*`(ringlimit_[a-z0-9_]+)`", line)
        if match:
            names.add(match.group(1))
    return names


def check_page(text: str) -> set[str]:
    """Assert the conventions on one exposition page; return its series names."""
    assert "_created" not in text
    exposed = set()
    for family in text_string_to_metric_families(text):
        assert NAME.match(family.name), family.name
        assert family.documentation, family.name
        for sample in family.samples:
            assert not sample.name.endswith("_created"), sample.name
            assert all(LABEL.match(label) for label in sample.labels), sample
        if family.type == "counter":
            assert {s.name for s in family.samples} <= {family.name + "_total"}, family.name
            exposed.add(family.name + "_total")
        else:
            assert not family.name.endswith("_total"), family.name
            exposed.add(family.name)
        if family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
    return exposed


async def test_router_and_node_pages_follow_the_conventions_and_are_documented() -> None:
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 1, 60.0)),))
    async with InProcessCluster(3, config, clock=FrozenClock()) as cluster:
        for user in ("a", "a", "b"):
            await cluster.client.get("/hello", headers={"X-User-Id": user})
        await cluster.client.get("/hello")
        await cluster.client.post("/v1/check", json={"key": "a"})
        router_page = (await cluster.client.get("/metrics")).text
        node_pages = [
            (await cluster.client.get(node_url(n) + "/metrics")).text for n in ("n1", "n2", "n3")
        ]
    exposed = check_page(router_page)
    assert "ringlimit_router_forwarded_total" in exposed
    for page in node_pages:
        exposed |= check_page(page)
    assert {"ringlimit_decisions_total", "ringlimit_decision_seconds"} <= exposed
    assert "ringlimit_handoff_keys_sent_total" in exposed
    assert "ringlimit_handoff_last_transfer_seconds" in exposed
    missing = exposed - documented()
    assert not missing, f"not in docs/metrics.md: {sorted(missing)}"


def registered(registry: CollectorRegistry) -> set[str]:
    """Every metric a registry can expose, whether or not it has a sample yet:
    read from the registered collectors (not from a page after some traffic)."""
    names = set()
    for family in registry.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


class _Redis:
    """Stands for the Redis primary of a node with ``--backend redis`` (never called)."""

    name = "redis"
    available = True


async def test_every_registered_metric_is_documented() -> None:
    """The router (with Envoy's service, membership and failures watched) and every
    kind of node (a sticky one with its handoff statistics and top-keys gauges, one
    deciding in Redis with its local fallback): a metric added to any of their
    registries and left out of docs/metrics.md fails here."""
    # Envoy's series are the router's own (router/metrics.py), registered whether or
    # not it serves gRPC: no gRPC server here (grpc.aio's poller outlives a test's
    # event loop and may call into a closed one in the next test).
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 1, 60.0)),))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        registries = [cluster.router.metrics.registry]
        registries += [node.metrics.registry for node in cluster.nodes.values()]
        clock = FrozenClock()
        redis_node = Node(
            NodeSettings(node_id="r1", config=config, sticky=False),
            clock=clock,
            backend=FallbackBackend(_Redis(), MemoryBackend(MemoryStore(), clock)),  # type: ignore[arg-type]
        )
        registries.append(redis_node.metrics.registry)
        names: set[str] = set()
        for registry in registries:
            check_page(render(registry).decode())
            names |= registered(registry)
    assert {
        "ringlimit_router_envoy_calls_total",
        "ringlimit_router_envoy_partial_consumptions_total",
        "ringlimit_router_membership_total",
        "ringlimit_shadow_denials_total",
        "ringlimit_top_limited",
        "ringlimit_handoff_views_applied_total",
        "ringlimit_backend_fallback_decisions_total",
    } <= names
    missing = names - documented()
    assert not missing, f"not in docs/metrics.md: {sorted(missing)}"


def test_dict_statistics_become_one_metric_each_with_units() -> None:
    metrics = NodeMetrics("n1")
    metrics.add_counters(
        "ringlimit_backend_fallback", {"decisions": "Fallback decisions."}, lambda: {"decisions": 3}
    )
    metrics.add_counters(
        "ringlimit_handoff", {}, lambda: {"keys_sent": 5, "last_transfer_seconds": 0.25}
    )
    metrics.count("api", True)
    text = metrics.render().decode()
    exposed = check_page(text)
    assert {
        "ringlimit_backend_fallback_decisions_total",
        "ringlimit_handoff_keys_sent_total",
        "ringlimit_handoff_last_transfer_seconds",
    } <= exposed
    assert "ringlimit_handoff_last_transfer_seconds 0.25" in text
    assert exposed <= documented()


def test_decision_totals_do_not_fall_when_a_departed_rules_series_go() -> None:
    """The ring page's rates are differences of these totals: a rule renamed
    away must not take its counts with it when its series leave /metrics."""
    metrics = NodeMetrics("n1")
    metrics.count("old", True, 70)
    metrics.count("old", False, 30)
    metrics.forget_rules({"old"})
    metrics.forget_rules({"new"})  # renamed: the old series stay one scrape
    metrics.forget_rules({"new"})  # and leave now
    assert 'rule="old"' not in metrics.render().decode()
    assert metrics.decision_totals() == {"allowed": 70, "denied": 30}
    metrics.count("new", True, 5)
    assert metrics.decision_totals() == {"allowed": 75, "denied": 30}


def test_documented_names_follow_the_conventions() -> None:
    names = documented()
    assert len(names) >= 15
    for name in names:
        assert NAME.match(name), name


def node_labels(page: str) -> set[str]:
    """The ``node`` label values of every series of a router's page."""
    return {
        sample.labels["node"]
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if "node" in sample.labels
    }


async def test_a_departed_nodes_series_leave_the_router_one_scrape_later() -> None:
    """A router whose nodes come and go under new ids (pods) kept a few series per
    id it had ever served; now the scrape after a node left still shows its last
    counts, and the next one drops them. The members' series stay."""
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 100, 60.0)),))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        await cluster.add_node("n3")
        users = [f"u{i}" for i in range(60)]
        for user in users:
            await cluster.client.get("/hello", headers={"X-User-Id": user})
            await cluster.client.post("/v1/check", json={"key": user})
        assert node_labels((await cluster.client.get("/metrics")).text) == {"n1", "n2", "n3"}
        await cluster.remove_node("n3")
        for user in users:  # counts made before the scrape that follows the leave
            await cluster.client.get("/hello", headers={"X-User-Id": user})
        await cluster.client.get("/hello")  # no user id: an event of no node ("-")
        last = (await cluster.client.get("/metrics")).text
        later = (await cluster.client.get("/metrics")).text
        # Back under the same id (a restart with a stable --id): counted again.
        await cluster.add_node("n3")
        for user in users:
            await cluster.client.get("/hello", headers={"X-User-Id": user})
        back = (await cluster.client.get("/metrics")).text
    assert node_labels(last) == {"n1", "n2", "n3", "-"}
    assert node_labels(later) == {"n1", "n2", "-"}
    forwarded = [
        s.labels["node"]
        for f in text_string_to_metric_families(back)
        for s in f.samples
        if s.name == "ringlimit_router_forwarded_total"
    ]
    assert "n3" in forwarded


async def scraped_twice(cluster: InProcessCluster) -> tuple[set[str], set[str]]:
    """The node labels of two scrapes of ``/metrics`` in a row."""
    first = (await cluster.client.get("/metrics")).text
    second = (await cluster.client.get("/metrics")).text
    return node_labels(first), node_labels(second)


async def test_a_node_that_left_before_the_first_scrape_is_shown_once() -> None:
    """The first scrape of a router has no last scrape to compare with: it shows
    every series (a node gone before it, with its counts and events), and the
    next one drops the departed node's. (It dropped them unseen.)"""
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 100, 60.0)),))
    async with InProcessCluster(3, config, clock=FrozenClock()) as cluster:
        for i in range(60):
            await cluster.client.get("/hello", headers={"X-User-Id": f"u{i}"})
        await cluster.remove_node("n3")
        first, second = await scraped_twice(cluster)
    assert first == {"n1", "n2", "n3"} and second == {"n1", "n2"}


async def test_a_router_never_scraped_keeps_the_series_of_few_departed_nodes() -> None:
    """Per-node series were dropped only by a scrape: a router nobody scraped
    kept three or four series per node id it ever served (pods under new ids),
    for as long as it ran (a soak tester's finding). Every view it adopts now
    drops them but for the last ``max_departed`` nodes gone (64 by default),
    kept for the next scrape to show once."""
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 100, 60.0)),))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        cluster.router.metrics.max_departed = 2
        for i in range(5):
            await cluster.add_node(f"pod-{i}")
            for user in range(30):
                await cluster.client.get("/hello", headers={"X-User-Id": f"u{user}"})
            await cluster.remove_node(f"pod-{i}")
        unscraped = cluster.router.metrics.render().decode()
        first, second = await scraped_twice(cluster)
    assert node_labels(unscraped) == {"n1", "n2", "pod-3", "pod-4"}
    assert first == {"n1", "n2", "pod-3", "pod-4"} and second == {"n1", "n2"}


async def came_and_went_after_a_scrape(cluster: InProcessCluster, node_id: str) -> None:
    """A scrape, then ``node_id`` joins, forwards traffic and leaves."""
    await cluster.client.get("/metrics")
    await cluster.add_node(node_id)
    for user in range(30):
        await cluster.client.get("/hello", headers={"X-User-Id": f"u{user}"})
    await cluster.remove_node(node_id)


async def test_a_node_that_came_and_went_between_two_scrapes_is_shown_once() -> None:
    """After a first scrape, a node that joined and left before the next one was
    dropped by that scrape itself (it kept only the members of this scrape and
    the last), so its counts never showed: shown once, then dropped."""
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 100, 60.0)),))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        await came_and_went_after_a_scrape(cluster, "pod-0")
        first, second = await scraped_twice(cluster)
    assert first == {"n1", "n2", "pod-0"} and second == {"n1", "n2"}


async def test_a_departed_node_is_shown_once_while_the_ring_keeps_changing() -> None:
    """Nodes joining between every two scrapes (pods, autoscaling): a node gone
    was kept by each view change for the next scrape, so it showed on every one."""
    config = ClusterConfig(rules=(ScopedRule(Rule("api", 100, 60.0)),))
    async with InProcessCluster(2, config, clock=FrozenClock()) as cluster:
        await came_and_went_after_a_scrape(cluster, "pod-0")
        shown = []
        for i in range(1, 4):
            shown.append(node_labels((await cluster.client.get("/metrics")).text))
            await cluster.add_node(f"pod-{i}")
    assert "pod-0" in shown[0]
    assert all("pod-0" not in labels for labels in shown[1:]), shown


def test_a_rule_gone_before_a_nodes_first_scrape_is_shown_once() -> None:
    metrics = NodeMetrics("n1")
    metrics.count("old", True, 3)
    metrics.forget_rules({"new"})  # the first scrape, after a rename
    assert 'rule="old"' in metrics.render().decode()
    metrics.forget_rules({"new"})
    assert 'rule="old"' not in metrics.render().decode()
    assert metrics.decision_totals()["allowed"] == 3


def test_a_scrape_of_workers_gathers_every_workers_metrics() -> None:
    """``router --workers N``: the public port's ``/metrics`` lands on any one
    worker, which adds the others' (router/metrics.py merge_workers); each
    sample keeps its ``worker`` label, and a worker that did not answer (or
    answered junk) is ``ringlimit_router_worker_up 0``, not an error."""
    first, second = RouterMetrics(), RouterMetrics()
    for _ in range(3):
        first.forwarded("n1", 200, 0.001)
    second.forwarded("n1", 429, 0.001)
    merged = merge_workers(
        {
            "w0": first.render("w0"),
            "w1": second.render("w1"),
            "w2": None,
            "w3": b"not { an exposition",
        }
    ).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(merged)
        for s in family.samples
    }
    forwarded = "ringlimit_router_forwarded_total"
    assert samples[(forwarded, (("node", "n1"), ("outcome", "2xx"), ("worker", "w0")))] == 3
    assert samples[(forwarded, (("node", "n1"), ("outcome", "429"), ("worker", "w1")))] == 1
    up = {
        dict(k[1])["worker"]: v for k, v in samples.items() if k[0] == "ringlimit_router_worker_up"
    }
    assert up == {"w0": 1, "w1": 1, "w2": 0, "w3": 0}
    # One HELP and TYPE per metric, however many workers have it.
    assert merged.count(f"# TYPE {forwarded} counter") == 1
    assert merged.count("# TYPE ringlimit_router_epoch gauge") == 1
    # Without a name (one router, no workers) there is no worker label.
    assert 'worker="' not in RouterMetrics().render().decode()
