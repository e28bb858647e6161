"""Scoring every mode against the exact global limiter, on the same arrivals.

All metrics are computed with numpy from the per-arrival verdicts; the
definitions (and why they are what they are) are in ``docs/simulations.md``.
In short, with ``a_m(u)`` the requests of user ``u`` a mode allowed and
``a_ref(u)`` what the reference allowed:

* over-admission = sum over users of ``max(0, a_m(u) - a_ref(u))``;
* false denials = sum over users of ``max(0, a_ref(u) - a_m(u))``;
* the ``per_window`` variants apply the same sums per (user, window of
  ``report.window`` seconds), so an excess early in the run is not hidden by a
  shortfall later (they are always >= the run totals);
* per event, the same per (user, event): every request is charged to the
  latest membership change that moved its user's key with a policy that can
  lose state, else to the latest handoff that moved it (see
  ``_Common.charges``); round robin, which reshuffles every user at every
  change, charges the latest change. Requests of keys no change has moved
  form the ``baseline``. A crash's leftover divergence is therefore not
  blamed on a later join or leave that never touched, or exactly handed on,
  those keys.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .arrivals import Arrivals, user_name
from .modes import ModeResult, policy_table
from .pool import map_in_workers
from .scenario import Scenario
from .timeline import Timeline

#: Bump when a field changes meaning or is removed; adding fields keeps the version.
#: 2: ``pause`` events and failure detection (scenario.events[] may be a pause, with
#: ``nodes`` instead of ``node``; events[] may be made by the router's probes:
#: ``cause``), ``policy.return``, ``modes.<mode>.unavailable``, ``detection``.
#: 3: the ``[network]`` table: ``scenario.network`` and ``modes.<mode>.network`` (only
#: when the scenario has one); ``detection.outages[].source_event`` is ``-1 - k`` for a
#: node that ``network.partitions[k]`` cut off from the router.
SCHEMA_VERSION = 3


def _f(x: float | None, digits: int = 6) -> float | None:
    """Round for the report (stable output); NaN and None become None."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x) or math.isinf(x):
        return None
    value = round(x, digits)
    return 0.0 if value == 0 else value


def _positive_parts(codes: np.ndarray, delta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Group ``delta`` (+1 over, -1 under) by ``codes``; return (unique codes, sums)."""
    if codes.size == 0:
        return codes, np.zeros(0, dtype=np.int64)
    uniq, inverse = np.unique(codes, return_inverse=True)
    sums = np.bincount(inverse, weights=delta, minlength=uniq.size).round().astype(np.int64)
    return uniq, sums


class _Common:
    """Arrays every mode's scoring needs, computed once."""

    def __init__(
        self, scenario: Scenario, timeline: Timeline, arrivals: Arrivals, ref: np.ndarray
    ) -> None:
        self.scenario = scenario
        self.timeline = timeline
        rp = scenario.report
        self.times = arrivals.times
        self.users = arrivals.users.astype(np.int64)
        self.ref = ref
        self.n_users = scenario.users.count
        self.rel = self.times - scenario.clock_start
        self.n_buckets = max(1, math.ceil(scenario.duration / rp.bucket - 1e-9))
        self.bucket = np.minimum((self.rel / rp.bucket).astype(np.int64), self.n_buckets - 1)
        self.n_windows = max(1, math.ceil(scenario.duration / rp.window - 1e-9))
        self.window = np.minimum((self.rel / rp.window).astype(np.int64), self.n_windows - 1)
        self.change_at = timeline.change_times
        self.n_changes = len(timeline.changes)
        self.edges = np.searchsorted(self.times, self.change_at, side="left")
        segment = np.searchsorted(self.change_at, self.times, side="right").astype(np.int32)
        self.charge_latest = segment - 1
        self._charges: dict[tuple[str, ...], np.ndarray] = {}
        self.requests_user = np.bincount(self.users, minlength=self.n_users)
        self.ref_user = np.bincount(self.users[ref], minlength=self.n_users)
        self.requests_bucket = np.bincount(self.bucket, minlength=self.n_buckets)
        self.ref_bucket = np.bincount(self.bucket[ref], minlength=self.n_buckets)

    def charges(self, policy: dict[str, str]) -> np.ndarray:
        """The change each request is charged to (-1: baseline) under a sticky ``policy``.

        A request is charged to the latest change that moved its user's key with
        a policy that can lose state (anything but ``handoff``); failing that, to
        the latest handoff that moved it; failing that, to the baseline. So the
        leftover divergence of a crash stays with the crash even after a later
        graceful leave hands the (already diverged) state on.
        """
        lossy_kinds = tuple(sorted(k for k, p in policy.items() if p != "handoff"))
        cached = self._charges.get(lossy_kinds)
        if cached is not None:
            return cached
        n = len(self.times)
        lossy = np.full(n, -1, dtype=np.int32)
        exact = np.full(n, -1, dtype=np.int32)
        epochs = self.timeline.epochs
        for k, info in enumerate(self.timeline.changes):
            before, after = epochs[k].owners, epochs[k + 1].owners
            moved = before != after
            kind = info.change.kind
            if kind == "crash":
                # the crashed node's keys follow the crash policy, keys moving between
                # survivors (unequal weights only) the graceful one
                from_crashed = before == info.node_index
                lost = moved & from_crashed if policy["crash"] != "handoff" else moved & False
                if policy["leave"] != "handoff":
                    lost = lost | (moved & ~from_crashed)
            else:
                lost = moved if policy[kind] != "handoff" else moved & False
            kept = moved & ~lost
            lo = int(self.edges[k])
            later_users = self.users[lo:]
            lossy[lo:][lost[later_users]] = k
            exact[lo:][kept[later_users]] = k
        charge = np.where(lossy >= 0, lossy, exact)
        self._charges[lossy_kinds] = charge
        return charge


def _worst(diff: np.ndarray, common: _Common, sign: int) -> dict[str, Any] | None:
    value = diff * sign
    if value.size == 0 or value.max() <= 0:
        return None
    user = int(np.argmax(value))  # ties: the lowest index, i.e. the most popular user
    return {
        "user": user_name(user),
        "count": int(value[user]),
        "allowed": int(common.ref_user[user] + diff[user]),
        "reference_allowed": int(common.ref_user[user]),
        "requests": int(common.requests_user[user]),
    }


def _agreement(
    common: _Common, allowed: np.ndarray, ref: np.ndarray, times: np.ndarray, start: float
) -> tuple[float | None, bool]:
    """Time from ``start`` until the mode's admitted counts agree with the reference.

    ``times``/``allowed``/``ref`` are the requests charged to one event. They
    are cut in buckets of ``report.bucket`` seconds from ``start``; a bucket
    disagrees when the mode's and the reference's admitted counts differ by
    more than ``agreement_tolerance`` times the reference's. The answer is the
    end of the last disagreeing bucket, or ``None`` (never) when no later
    bucket holding requests of the event agrees.
    """
    if times.size == 0:
        return 0.0, True
    size = common.scenario.report.bucket
    tol = common.scenario.report.agreement_tolerance
    idx = ((times - start) / size).astype(np.int64)
    n = int(idx[-1]) + 1
    mode = np.bincount(idx, weights=allowed, minlength=n)
    reference = np.bincount(idx, weights=ref, minlength=n)
    bad = np.flatnonzero(np.abs(mode - reference) > tol * reference + 1e-9)
    if bad.size == 0:
        return 0.0, True
    last = int(bad[-1])
    if last == n - 1:  # the event's last bucket with requests still disagrees
        return None, False
    return (last + 1) * size, True


def score_mode(common: _Common, result: ModeResult) -> dict[str, Any]:
    scenario = common.scenario
    allowed = result.allowed
    users = common.users
    ref = common.ref
    mode_user = np.bincount(users[allowed], minlength=common.n_users)
    diff = mode_user - common.ref_user
    over_total = int(diff[diff > 0].sum())
    false_total = int(-diff[diff < 0].sum())

    mism = np.flatnonzero(allowed != ref)
    delta = allowed[mism].astype(np.int64) - ref[mism].astype(np.int64)
    mu = users[mism]

    _, wsums = _positive_parts(mu * common.n_windows + common.window[mism], delta)
    over_window = int(wsums[wsums > 0].sum())
    false_window = int(-wsums[wsums < 0].sum())

    if result.mode == "round_robin":
        charge = common.charge_latest
    else:
        charge = common.charges(policy_table(scenario)[result.mode])
    classes = common.n_changes + 1  # class 0: baseline, class k + 1: change k
    cls = charge.astype(np.int64) + 1
    codes, sums = _positive_parts(mu * classes + cls[mism], delta)
    of = codes % classes
    over_cls = np.bincount(of[sums > 0], weights=sums[sums > 0], minlength=classes)
    false_cls = np.bincount(of[sums < 0], weights=-sums[sums < 0], minlength=classes)
    mism_cls = np.bincount(cls[mism], minlength=classes)
    req_cls = np.bincount(cls, minlength=classes)
    starts = [scenario.clock_start, *common.change_at.tolist()]
    per_class = []
    for c in range(classes):
        sel = np.flatnonzero(cls == c)  # requests of the class, in time order
        agree_after, agreed = _agreement(
            common, allowed[sel], ref[sel], common.times[sel], starts[c]
        )
        per_class.append(
            {
                "requests": int(req_cls[c]),
                "over_admission": int(over_cls[c]),
                "false_denials": int(false_cls[c]),
                "mismatches": int(mism_cls[c]),
                "time_to_agree_s": _f(agree_after),
                "agreed": agreed,
            }
        )

    events = []
    for info, entry, action in zip(
        common.timeline.changes, per_class[1:], result.actions, strict=True
    ):
        events.append({"index": info.index, **entry, **action})

    n_allowed = int(allowed.sum())
    ref_allowed = int(ref.sum())
    return {
        "policy": policy_table(scenario)[result.mode],
        "allowed": n_allowed,
        "denied": len(allowed) - n_allowed,
        "allowed_fraction": _f(n_allowed / len(allowed) if len(allowed) else 0.0),
        "over_admission": {
            "total": over_total,
            "relative": _f(over_total / ref_allowed if ref_allowed else 0.0),
            "per_window": over_window,
            "users": int((diff > 0).sum()),
            "worst_user": _worst(diff, common, 1),
        },
        "false_denials": {
            "total": false_total,
            "relative": _f(false_total / ref_allowed if ref_allowed else 0.0),
            "per_window": false_window,
            "users": int((diff < 0).sum()),
            "worst_user": _worst(diff, common, -1),
        },
        "mismatches": int(mism.size),
        "unavailable": dict(result.unavailable),
        **({} if result.network is None else {"network": dict(result.network)}),
        "baseline": per_class[0],
        "events": events,
        "load": _load(common, result),
    }


def _ratio(values: np.ndarray) -> float | None:
    if values.size == 0:
        return None
    mean = values.mean()
    return _f(values.max() / mean) if mean > 0 else None


def _load(common: _Common, result: ModeResult) -> dict[str, Any]:
    timeline = common.timeline
    durations = np.array([e.end - e.start for e in timeline.epochs])
    if result.mode == "global":
        ids = ["global"]
        member = np.ones((len(timeline.epochs), 1), dtype=bool)
    else:
        ids = timeline.node_ids
        member = np.zeros((len(timeline.epochs), len(ids)), dtype=bool)
        for e, epoch in enumerate(timeline.epochs):
            member[e, epoch.alive] = True
    member_s = (member * durations[:, None]).sum(axis=0)
    requests = result.requests.sum(axis=0)
    present = member_s > 0
    rates = requests[present] / member_s[present]
    keys_end = result.keys[-1]
    per_epoch = []
    for e in range(len(timeline.epochs)):
        held = result.keys[e][member[e]]
        per_epoch.append(_ratio(held.astype(np.float64)))
    finite = [r for r in per_epoch if r is not None]
    per_node = []
    for n, node_id in enumerate(ids):
        if member_s[n] <= 0 and requests[n] == 0:
            continue
        per_node.append(
            {
                "node": node_id,
                "requests": int(requests[n]),
                "member_s": _f(member_s[n]),
                "keys_end": int(keys_end[n]) if keys_end[n] >= 0 else None,
            }
        )
    out: dict[str, Any] = {
        "requests_max_over_mean": _ratio(rates),
        "keys_max_over_mean": per_epoch[-1],
        "keys_max_over_mean_worst": max(finite) if finite else None,
        "keys_total_end": int(keys_end[keys_end >= 0].sum()),
        "per_node": per_node,
    }
    return out


# Set around map_in_workers: forked workers inherit it.
_SHARED: tuple[_Common, dict[str, ModeResult]] | None = None


def _score_one(mode: str) -> dict[str, Any]:
    assert _SHARED is not None
    common, results = _SHARED
    return score_mode(common, results[mode])


def _score_all(common: _Common, results: dict[str, ModeResult], jobs: int) -> dict[str, Any]:
    global _SHARED
    policies = policy_table(common.scenario)
    for mode in results:
        if mode != "round_robin":
            common.charges(policies[mode])  # computed once, before forking
    _SHARED = (common, results)
    try:
        scored = map_in_workers(_score_one, list(results), jobs)
    finally:
        _SHARED = None
    return dict(zip(results, scored, strict=True))


def _event_windows(common: _Common, results: dict[str, ModeResult]) -> list[dict[str, Any]]:
    rp = common.scenario.report
    out = []
    for info in common.timeline.changes:
        lo_t = max(common.scenario.clock_start, info.at - rp.event_window)
        hi_t = min(common.scenario.end, info.at + rp.event_window)
        n = max(1, math.ceil((hi_t - lo_t) / rp.event_bucket - 1e-9))
        lo, hi = np.searchsorted(common.times, [lo_t, hi_t], side="left").tolist()
        idx = np.minimum(((common.times[lo:hi] - lo_t) / rp.event_bucket).astype(np.int64), n - 1)
        allowed = {
            mode: np.bincount(idx[res.allowed[lo:hi]], minlength=n).tolist()
            for mode, res in results.items()
        }
        out.append(
            {
                "index": info.index,
                "start_s": _f(lo_t - common.scenario.clock_start),
                "event_s": _f(info.at - common.scenario.clock_start),
                "bucket_s": rp.event_bucket,
                "requests": np.bincount(idx, minlength=n).tolist(),
                "allowed": allowed,
            }
        )
    return out


def build_report(
    scenario: Scenario,
    timeline: Timeline,
    arrivals: Arrivals,
    results: dict[str, ModeResult],
    run: dict[str, Any] | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """The JSON report (see ``docs/simulations.md`` for the schema).

    ``jobs`` > 1 scores the modes in that many forked processes.
    """
    ref = results["global"].allowed
    common = _Common(scenario, timeline, arrivals, ref)
    n = len(arrivals)
    ref_allowed = int(ref.sum())
    events = []
    for info in timeline.changes:
        change = info.change
        events.append(
            {
                "index": info.index,
                "at_s": _f(info.at - scenario.clock_start),
                "type": change.kind,
                "node": change.node,
                "weight": change.weight,
                "source_event": change.source,
                "restart": change.restart,
                "cause": change.cause,
                "members_before": info.members_before,
                "members_after": info.members_after,
                "keys_moved": info.keys_moved,
                "moved_fraction": _f(info.moved_fraction),
                "ideal_fraction": _f(info.ideal_fraction),
                "ideal_fraction_equal_weights": _f(info.ideal_equal),
                "moved_over_ideal": _f(info.moved_fraction / info.ideal_fraction),
                "moved_elsewhere": info.moved_elsewhere,
            }
        )
    modes = _score_all(common, {m: results[m] for m in scenario.modes if m in results}, jobs)
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "scenario": scenario.to_dict(),
        "totals": {
            "requests": n,
            "users": scenario.users.count,
            "users_active": int((common.requests_user > 0).sum()),
            "users_throttled": int((common.requests_user > common.ref_user).sum()),
            "reference_allowed": ref_allowed,
            "reference_denied": n - ref_allowed,
        },
        "events": events,
        "detection": (
            None if timeline.detection is None else timeline.detection.to_dict(scenario.detection)
        ),
        "modes": modes,
        "timeline": {
            "bucket_s": scenario.report.bucket,
            "requests": common.requests_bucket.tolist(),
            "allowed": {
                mode: np.bincount(
                    common.bucket[results[mode].allowed], minlength=common.n_buckets
                ).tolist()
                for mode in modes
            },
        },
        "event_windows": _event_windows(common, {m: results[m] for m in modes}),
    }
    if run is not None:
        report["run"] = run
    return report
