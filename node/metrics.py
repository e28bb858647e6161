"""Prometheus metrics of one node, in a registry of its own (no global state).

Every metric is listed in ``docs/metrics.md``. Names follow Prometheus'
conventions: a ``ringlimit_`` prefix, the base unit in the name
(``_seconds``), ``_total`` on counters, and one unit per metric (a label never
mixes keys with seconds).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05, 0.25, 1.0)


class NodeMetrics:
    """The node's metrics. Decisions and their latency are counted per request
    in plain Python (:class:`BatchedHistogram`, :class:`BatchedCounts`) and
    published into the prometheus-client metrics when the registry is collected:
    a prometheus-client update takes a lock and several calls, which cost more
    than the decision they count."""

    def __init__(self, node_id: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        flusher = Flusher()
        # Registered first: every collection publishes the pending counts before
        # the metrics below are read.
        self.registry.register(flusher)
        self.node_id = node_id
        self.decisions = Counter(
            "ringlimit_decisions_total",
            "Decisions by rule and outcome (allowed, denied).",
            ["rule", "outcome"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "ringlimit_decision_seconds",
            "Time to decide one request or check (all its rules).",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter(
            "ringlimit_node_errors_total",
            "Requests answered without a decision, by kind.",
            ["kind"],
            registry=self.registry,
        )
        self.keys = Gauge("ringlimit_keys", "States held in memory.", registry=self.registry)
        self.epoch = Gauge(
            "ringlimit_ring_epoch", "Newest ring epoch known.", registry=self.registry
        )
        self.shadow_denials = Counter(
            "ringlimit_shadow_denials_total",
            "Requests a shadow rule would have denied (it let them through), by rule.",
            ["rule"],
            registry=self.registry,
        )
        self._latency = BatchedHistogram(self.latency)
        self._counts = BatchedCounts(self.decisions)
        flusher.add(self._latency.flush)
        flusher.add(self._counts.flush)
        self.observe = self._latency.observe
        self._pending = self._counts.pending
        #: The rules in force at the last scrape (see :meth:`forget_rules`); None
        #: before the first, which drops nothing.
        self._last_rules: set[str] | None = None
        #: Decisions by outcome of the series :meth:`forget_rules` dropped: still
        #: counted by :meth:`decision_totals`, whose rates must not dip when a
        #: rule is renamed.
        self._forgotten: dict[str, int] = {}

    def decided(self, rule: str, allowed: bool, seconds: float) -> None:
        """``observe(seconds)`` and ``count(rule, allowed)``: one call on every decision's path."""
        latency = self._latency  # BatchedHistogram.observe, inline: no second call
        latency._counts[bisect_left(latency._bounds, seconds)] += 1
        latency._sum += seconds
        key = (rule, "allowed" if allowed else "denied")
        pending = self._pending
        pending[key] = pending.get(key, 0) + 1

    def count(self, rule: str, allowed: bool, n: int = 1) -> None:
        key = (rule, "allowed" if allowed else "denied")
        pending = self._pending
        pending[key] = pending.get(key, 0) + n

    def shadow_denied(self, rule: str, n: int = 1) -> None:
        self.shadow_denials.labels(rule).inc(n)

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def watch(self, keys: Callable[[], float], epoch: Callable[[], float]) -> None:
        self.keys.set_function(keys)
        self.epoch.set_function(epoch)

    def add_counters(
        self, prefix: str, docs: dict[str, str], read: Callable[[], dict[str, float]]
    ) -> None:
        """Expose a dict of statistics read at scrape time, one metric per entry.

        ``<prefix>_<entry>_total`` for counts, ``<prefix>_<entry>`` (a gauge)
        for entries ending in ``_seconds``; ``docs`` gives each entry's help.
        """
        self.registry.register(StatsCollector(prefix, docs, read))

    def decision_totals(self) -> dict[str, int]:
        """Decisions so far by outcome, all rules together (for the ring page's rates)."""
        totals = {"allowed": 0, "denied": 0}
        for outcome, n in self._forgotten.items():
            totals[outcome] = totals.get(outcome, 0) + n
        self._counts.flush()
        for (_, outcome), value in _series(self.decisions).items():
            totals[outcome] = totals.get(outcome, 0) + int(value)
        return totals

    def watch_top(self, read: Callable[[], list[tuple[str, str, int, float]]]) -> None:
        """Top limited keys as gauges, read at scrape time: ``(rule, kind, rank, count)``."""
        self.registry.register(TopCollector(read))

    def forget_rules(self, rules: Iterable[str]) -> None:
        """Drop the per-rule series of rules no longer in force, one scrape after
        they left (that scrape still shows their last counts).

        Without it a node whose rules are renamed at runtime (PUT /admin/rules)
        kept two series per name it ever decided, for as long as it ran. Called
        before each render (``GET /metrics``), as the router forgets departed nodes.
        """
        current = set(rules)
        last, self._last_rules = self._last_rules, current
        if last is None:
            return  # the first scrape shows every series there is
        keep = current | last
        self._counts.flush()  # pending counts would bring a dropped series back
        forgotten = self._forgotten
        for labels, value in _series(self.decisions).items():
            if labels[0] not in keep:
                outcome = labels[1]
                forgotten[outcome] = forgotten.get(outcome, 0) + int(value)
                self._counts.remove(*labels)
        for labels in _series(self.shadow_denials):
            if labels[0] not in keep:
                self.shadow_denials.remove(*labels)

    def render(self) -> bytes:
        return render(self.registry)


def _series(counter: Counter) -> dict[tuple[str, ...], float]:
    """Each series ``counter`` has: its label values -> its value."""
    found: dict[tuple[str, ...], float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                found[tuple(sample.labels.values())] = sample.value
    return found


class BatchedHistogram:
    """A prometheus-client histogram's observations, counted locally until :meth:`flush`.

    Same buckets (an observation goes to the first bucket whose bound it does
    not exceed), same sum; only published later.
    """

    __slots__ = ("_bounds", "_counts", "_histogram", "_sum")

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._bounds: list[float] = list(histogram._upper_bounds)
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def flush(self) -> None:
        counts = self._counts
        if not any(counts):
            return
        histogram = self._histogram
        for i, n in enumerate(counts):
            if n:
                histogram._buckets[i].inc(n)
                counts[i] = 0
        histogram._sum.inc(self._sum)
        self._sum = 0.0


class BatchedCounts:
    """Increments of a labelled prometheus-client counter, kept in a dict
    (``pending``: label values -> count) until :meth:`flush`."""

    __slots__ = ("_children", "_counter", "pending")

    def __init__(self, counter: Counter) -> None:
        self._counter = counter
        self._children: dict[tuple[str, ...], Any] = {}
        self.pending: dict[tuple[str, ...], float] = {}

    def inc(self, labels: tuple[str, ...], n: float = 1) -> None:
        pending = self.pending
        pending[labels] = pending.get(labels, 0) + n

    def flush(self) -> None:
        pending = self.pending
        if not pending:
            return
        children = self._children
        for labels, n in list(pending.items()):
            child = children.get(labels)
            if child is None:
                child = children[labels] = self._counter.labels(*labels)
            child.inc(n)
        pending.clear()

    def remove(self, *labels: str) -> None:
        """``Counter.remove``, and the child held for it: the next increment makes
        a new one (a held reference would count into a child nobody exports)."""
        self._counter.remove(*labels)
        self._children.pop(labels, None)


class Flusher(Collector):
    """Collects nothing: publishes what batched metrics hold whenever the
    registry is collected (it is registered before them)."""

    def __init__(self) -> None:
        self._flushes: list[Callable[[], None]] = []

    def add(self, flush: Callable[[], None]) -> None:
        self._flushes.append(flush)

    def collect(self) -> Iterator[Metric]:
        for flush in self._flushes:
            flush()
        return iter(())

    def describe(self) -> list[Any]:
        return []


def render(registry: CollectorRegistry, labels: Mapping[str, str] | None = None) -> bytes:
    """The text exposition of ``registry`` without the ``_created`` series,
    ``labels`` added to every sample (a router worker's name).

    prometheus-client adds a ``<name>_created`` timestamp to every counter and
    histogram; Prometheus' text format has no use for it and it doubles the
    series count. ``disable_created_metrics()`` would drop it for the whole
    process (global state); filtering here keeps it per registry.
    """
    return generate_latest(_WithoutCreated(registry, dict(labels or {})))


class _WithoutCreated(Collector):
    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self) -> Iterator[Metric]:
        extra = self.labels
        for family in self.registry.collect():
            created = family.name + "_created"
            family.samples = [
                s._replace(labels={**extra, **s.labels}) if extra else s
                for s in family.samples
                if s.name != created
            ]
            yield family


class TopCollector(Collector):
    """``ringlimit_top_limited{rule, kind, rank}``: the count of the rank-th key.

    The key itself is never a label: series stay bounded (rules x 2 kinds x
    N ranks) however many users there are, and no user id reaches the
    monitoring system. ``GET /admin/top`` on the router says who they are.
    """

    def __init__(self, read: Callable[[], list[tuple[str, str, int, float]]]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "ringlimit_top_limited",
            "Events of the rank-th most limited key of this node, by rule and kind "
            "(denied, near_limit), over the last one to two windows.",
            labels=["rule", "kind", "rank"],
        )
        for rule, kind, position, count in self.read():
            family.add_metric([rule, kind, str(position)], count)
        yield family

    def describe(self) -> list[Any]:
        return []


class DictCollector(Collector):
    """A dict of event counts read at scrape time, one sample per key (label ``kind``).

    For counts of one unit only (events); statistics that mix units go
    through :class:`StatsCollector`.
    """

    def __init__(self, name: str, doc: str, read: Callable[[], Mapping[str, float]]) -> None:
        self.name, self.doc, self.read = name, doc, read

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.doc, labels=["kind"])
        for kind, value in self.read().items():
            family.add_metric([kind], float(value))
        yield family

    def describe(self) -> list[Any]:
        return []


class StatsCollector(Collector):
    """A dict of statistics read at scrape time, one metric per entry (own name, own unit)."""

    def __init__(
        self, prefix: str, docs: dict[str, str], read: Callable[[], dict[str, float]]
    ) -> None:
        self.prefix, self.docs, self.read = prefix, docs, read

    def collect(self) -> Iterator[Metric]:
        for entry, value in self.read().items():
            doc = self.docs.get(entry, entry.replace("_", " "))
            if entry.endswith("_seconds"):
                yield GaugeMetricFamily(f"{self.prefix}_{entry}", doc, value=float(value))
            else:
                yield CounterMetricFamily(f"{self.prefix}_{entry}", doc, value=float(value))

    def describe(self) -> list[Any]:
        return []
