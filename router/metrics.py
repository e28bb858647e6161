"""Prometheus metrics of the router, in a registry of its own (listed in docs/metrics.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from node.metrics import BatchedCounts, BatchedHistogram, DictCollector, Flusher, render

#: The ``node`` label of events no node had a part in (a request without a user id).
NO_NODE = "-"
#: Nodes that left the ring whose series a router keeps for its next scrape, at
#: most: past it the oldest go unseen (a router nobody scrapes stays bounded).
MAX_DEPARTED = 64
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 2.0)


class RouterMetrics:
    """The router's metrics. Forwards are counted in plain Python and published
    into the prometheus-client metrics when the registry is collected (see
    :class:`node.metrics.NodeMetrics`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        flusher = Flusher()
        self.registry.register(flusher)  # first: publishes the batched counts
        self._forwarded = Counter(
            "ringlimit_router_forwarded_total",
            "Requests forwarded, by node and outcome (2xx, 429, 4xx, 5xx).",
            ["node", "outcome"],
            registry=self.registry,
        )
        self._events = Counter(
            "ringlimit_router_events_total",
            "Requests that needed more than a forward: not_owner, unreachable_open, "
            "unreachable_closed, ring_changing, missing_user_id, ...",
            ["node", "event"],
            registry=self.registry,
        )
        self._checks = Counter(
            "ringlimit_router_checks_total",
            "Decision-API checks routed, by node.",
            ["node"],
            registry=self.registry,
        )
        self._envoy = Counter(
            "ringlimit_router_envoy_calls_total",
            "Envoy ShouldRateLimit calls, by answer: ok, over_limit, invalid_argument, "
            "unavailable, unauthenticated.",
            ["code"],
            registry=self.registry,
        )
        self._envoy_partial = Counter(
            "ringlimit_router_envoy_partial_consumptions_total",
            "Envoy calls with several enforced keys denied after some keys had consumed "
            "(a concurrent call took a key's last units between the read and the consume).",
            registry=self.registry,
        )
        self._latency = Histogram(
            "ringlimit_router_forward_seconds",
            "Time from request to forwarded answer.",
            buckets=BUCKETS,
            registry=self.registry,
        )
        self._epoch = Gauge("ringlimit_router_epoch", "Ring epoch.", registry=self.registry)
        self._nodes = Gauge("ringlimit_router_nodes", "Nodes in the ring.", registry=self.registry)
        self._forwards = BatchedCounts(self._forwarded)
        self._pending = self._forwards.pending
        self._batched_latency = BatchedHistogram(self._latency)
        self._observe = self._batched_latency.observe
        flusher.add(self._forwards.flush)
        flusher.add(self._batched_latency.flush)
        #: The per-node counters for :meth:`forget_departed`: each with its label
        #: names and how a child of it is removed.
        self._per_node: tuple[tuple[Counter, tuple[str, ...], Callable[..., None]], ...] = (
            (self._forwarded, ("node", "outcome"), self._forwards.remove),
            (self._events, ("node", "event"), self._events.remove),
            (self._checks, ("node",), self._checks.remove),
        )
        #: The members at the last scrape; None before the first, which drops
        #: nothing (a node that left before it is shown once, like any other).
        self._last_members: set[str] | None = None
        #: Nodes with series that left the view since the last scrape, oldest
        #: first (:meth:`view_changed` keeps them for that scrape).
        self._departed: dict[str, None] = {}
        #: Departed nodes the last scrape showed (its last look at them).
        self._shown: set[str] = set()
        self.max_departed = MAX_DEPARTED

    def watch(self, epoch: Callable[[], float], nodes: Callable[[], float]) -> None:
        self._epoch.set_function(epoch)
        self._nodes.set_function(nodes)

    def watch_membership(
        self,
        stats: Callable[[], Mapping[str, float]],
        suspect_self: Callable[[], float],
        leading: Callable[[], float] = lambda: 1.0,
    ) -> None:
        """Membership's own counters: removals, removals the budget deferred (by
        reason), self-suspicions and lease renewals; whether it suspects itself
        now (it cannot reach most members); and whether it leads membership
        (with etcd: elected; the routers' leadership was in their logs alone)."""
        self.registry.register(
            DictCollector(
                "ringlimit_router_membership",
                "Membership events: removed_crashed, deferred_quorum, deferred_rate, "
                "deferred_lease, self_suspected, lease_renewals.",
                stats,
            )
        )
        Gauge(
            "ringlimit_router_suspect_self",
            "1 while this router cannot reach most members and removes nobody.",
            registry=self.registry,
        ).set_function(suspect_self)
        Gauge(
            "ringlimit_router_leading",
            "1 while this router leads membership (etcd elected it, or it follows no router).",
            registry=self.registry,
        ).set_function(leading)

    def watch_pipelining(self, counts: Callable[[], Mapping[str, float]]) -> None:
        """Pipelined writes to nodes and the requests they carried (``--pipeline``)."""
        self.registry.register(
            DictCollector(
                "ringlimit_router_pipelined",
                "Pipelined forwarding (router --pipeline): writes to nodes, and the requests "
                "they carried.",
                counts,
            )
        )

    def watch_coalescing(self, counts: Callable[[], Mapping[str, float]]) -> None:
        """Single decision-API checks coalesced, and the batches they left in
        (``--coalesce-window``): their ratio is the mean batch, what tuning the
        window is judged by (docs/decision-api.md)."""
        self.registry.register(
            DictCollector(
                "ringlimit_router_coalesced",
                "Single decision-API and Envoy checks held by the coalescer "
                "(router --coalesce-window): batches sent to nodes, and the checks they carried.",
                counts,
            )
        )

    def watch_leases(self, counts: Callable[[], Mapping[str, float]]) -> None:
        """This router's quota leases for hot keys (docs/hotkeys.md): what it asked
        the owners for and was granted, and what it decided from them."""
        self.registry.register(
            DictCollector(
                "ringlimit_router_leases",
                "Quota leases for hot keys (lease = auto): requests admitted and denied "
                "from leases, asks sent to owners, grants taken.",
                lambda: {k: v for k, v in counts().items() if k != "units"},
            )
        )
        self.registry.register(
            DictCollector(
                "ringlimit_router_lease_units",
                "Units of quota the owners granted this router in leases (kind: granted).",
                lambda: {"granted": counts().get("units", 0)},
            )
        )

    def watch_failures(self, counts: Callable[[], Mapping[str, float]]) -> None:
        """Errors background loops survived, by kind (node/failures.py)."""
        self.registry.register(
            DictCollector(
                "ringlimit_router_background_errors",
                "Errors the router's background loops survived: health_loop, background_task.",
                counts,
            )
        )

    def forwarded(self, node: str, status: int, seconds: float) -> None:
        outcome = (
            "2xx" if status < 300 else "429" if status == 429 else "4xx" if status < 500 else "5xx"
        )
        key = (node, outcome)
        pending = self._pending
        pending[key] = pending.get(key, 0) + 1
        self._observe(seconds)

    def outcome(self, node: str, event: str) -> None:
        self._events.labels(node, event).inc()

    def envoy_call(self, code: str) -> None:
        self._envoy.labels(code).inc()

    def envoy_partial(self) -> None:
        self._envoy_partial.inc()

    def checks(self, node: str, count: int) -> None:
        self._checks.labels(node).inc(count)

    def forget_departed(self, members: Iterable[str]) -> None:
        """Drop the per-node series of nodes no longer in the ring, one scrape after
        they left (that scrape still shows their last counts). Events of no node
        (:data:`NO_NODE`) stay.

        Without it a router whose nodes come and go under new ids (pods, an
        autoscaled group) kept three or four series per id it ever served, for
        as long as it ran. Called before each render (``GET /metrics``).
        """
        current = set(members)
        last, self._last_members = self._last_members, current
        # Nodes gone since the last scrape (view_changed kept them): this scrape
        # shows them, the next one drops them. Dropped here, a node that came and
        # went between two scrapes never showed its counts.
        departed = set(self._departed)
        self._departed.clear()
        # Shown now for the last time: view_changed must not keep them again
        # (it did, and under churn a departed node was on every scrape).
        self._shown = (departed | (last or set())) - current
        if last is None:
            return  # the first scrape shows every series there is
        self._drop_series_but(current | last | departed)

    def view_changed(self, members: Iterable[str]) -> None:
        """The router adopted a view: keep the series of its members and of at
        most :attr:`max_departed` nodes that left since the last scrape (for it
        to show their last counts); drop the rest.

        :meth:`forget_departed` alone dropped series only when ``/metrics`` was
        scraped: a router nobody scraped kept three or four series per node id
        it ever served, for as long as it ran.
        """
        current = set(members)
        self._shown -= current  # back in the ring: shown again once it leaves
        series = self._series()
        gone = {values[0] for values, _ in series} - current - {NO_NODE} - self._shown
        for node in sorted(gone):
            self._departed.setdefault(node, None)  # newly gone: newest last
        for back in current & self._departed.keys():
            del self._departed[back]
        while len(self._departed) > self.max_departed:
            del self._departed[next(iter(self._departed))]
        self._drop(series, current | self._departed.keys())

    def _drop_series_but(self, nodes: set[str]) -> None:
        """Remove every per-node series of a node not in ``nodes`` (or NO_NODE)."""
        self._drop(self._series(), nodes)

    def _series(self) -> list[tuple[tuple[str, ...], Callable[..., None]]]:
        """Every per-node series: its label values (the node's first) and its remover."""
        self._forwards.flush()  # pending counts would bring a dropped series back
        found: set[tuple[tuple[str, ...], Callable[..., None]]] = set()
        for counter, names, remove in self._per_node:
            for family in counter.collect():
                for sample in family.samples:
                    if "node" in sample.labels:
                        found.add((tuple(sample.labels[name] for name in names), remove))
        return list(found)

    @staticmethod
    def _drop(series: list[tuple[tuple[str, ...], Callable[..., None]]], nodes: set[str]) -> None:
        keep = nodes | {NO_NODE}
        for values, remove in series:
            if values[0] not in keep:
                remove(*values)

    def render(self, worker: str | None = None) -> bytes:
        """The text exposition, without ``_created`` series (see
        :func:`node.metrics.render`); a ``worker`` label on every sample when named."""
        return render(self.registry, {"worker": worker} if worker else None)


def merge_workers(expositions: Mapping[str, bytes | None]) -> bytes:
    """One exposition of every worker's (worker name -> its text, None if it did
    not answer), each sample keeping its ``worker`` label, with
    ``ringlimit_router_worker_up`` saying whose are missing.

    A scrape of the public port lands on any one worker: its own counters alone
    would jump between scrapes, and the workers' admin ports are the kernel's
    choice, not a target one can configure. So the worker that takes the
    scrape asks the others for theirs (``/metrics?scope=worker``).
    """
    families: dict[str, Metric] = {}
    up = GaugeMetricFamily(
        "ringlimit_router_worker_up",
        "1 if the worker's metrics are in this scrape, 0 if it did not answer (router --workers).",
        labels=["worker"],
    )
    for worker, text in sorted(expositions.items()):
        parsed: list[Metric] = []
        if text is not None:
            try:
                parsed = list(text_string_to_metric_families(text.decode()))
            except (ValueError, UnicodeDecodeError):
                text = None
        up.add_metric([worker], 0.0 if text is None else 1.0)
        for family in parsed:
            kept = families.setdefault(family.name, family)
            if kept is not family:
                kept.samples.extend(family.samples)
    return generate_latest(_Families([*families.values(), up]))


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)
