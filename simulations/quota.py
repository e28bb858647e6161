"""Quota leases on a virtual clock: the real lease logic on a scenario's arrivals.

``simulate_leases(scenario)`` runs the scenario's arrivals through routers
that hold lease books (``router/quotas.py``) in front of owners that grant
and settle leases (``node/quota.py``) and decide everything else with the
engine, on the real ring timeline (``simulations/timeline.py``). It reports
the owners' load (requests per second per node, max over mean, the figure
``ringlimit simulate`` shows for sticky routing), over-admission and false
denials against the exact reference (the ``global`` mode), and per user the
units leased and not used through a lease (written off, refunded or still
out at the end), which the false denials must not exceed.

What reaches an owner: a forwarded request (no lease, or a lease that
cannot decide it), an ask for the next block, and the return of a lease's
unused units at its end. Asks and returns are instantaneous (the best case
for freshness; latency only delays the next block: it adds local denials
bounded like the rest, never an admission).

Membership changes: a join or a graceful leave hands the moved keys' held
states (with their outstanding leases) to the new owners; a crash starts the
crashed node's keys exhausted at the new owners (the ``conservative``
policy, which never over-admits, so every over-admission would be the
leases'); every router drops the leases of the older epoch (written off).

It is also the ``leases`` mode of ``ringlimit simulate`` (:class:`LeasesMode`,
beside the six others; a node's requests are then forwarded requests + asks
+ returns); ``python -m simulations.quota SCENARIO`` prints the lease figures
themselves (bound, asks, units refunded and written off).
"""

from __future__ import annotations

import heapq
import json
import sys
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from node.algorithms import REGISTRY, exhausted
from node.quota import Held, HotKeys, LeasePolicy, decide, grant, refund
from router.quotas import ADMIT, DENY, LeaseBook, Released

from .arrivals import Arrivals, generate
from .modes import Mode, ModeResult, run_mode
from .scenario import Scenario, ScenarioError, load_scenario
from .timeline import Epoch, Timeline, build_timeline

#: A key is hot from this many decisions per second at its owner (simulation default).
DEFAULT_THRESHOLD = 50.0
EMPTY = Held()


@dataclass
class LeaseRun:
    """One run's per-arrival verdicts and counters."""

    allowed: np.ndarray
    #: messages[node]: forwarded requests + asks + returns the node received
    messages: np.ndarray
    forwarded: int = 0
    asks: int = 0
    returns: int = 0
    local_admits: int = 0
    local_denials: int = 0
    leases: int = 0
    units_leased: int = 0
    units_refunded: int = 0
    units_written_off: int = 0
    #: per user: units leased, units admitted through leases
    leased: np.ndarray | None = None
    used: np.ndarray | None = None
    #: per_epoch[e, node]: what ``messages`` counts, per epoch
    per_epoch: np.ndarray | None = None
    #: keys[e, node]: states a member holds at the end of epoch e (-1: not a member)
    keys: np.ndarray | None = None
    #: per membership change: leases revoked and units written off by it
    actions: list[dict[str, Any]] | None = None


def run_leases(
    timeline: Timeline,
    arrivals: Arrivals,
    policy: LeasePolicy,
    *,
    routers: int = 2,
    low_water: float = 0.25,
    half_life: float = 1.0,
) -> LeaseRun:
    """Decide every arrival through ``routers`` lease books (arrival i at router i mod n)."""
    scenario = timeline.scenario
    if len(scenario.rules) != 1:
        raise ValueError("the lease simulation takes one rule")
    if timeline.outages:
        raise ValueError("the lease simulation does not model paused nodes")
    rule = scenario.rules[0]
    cost = scenario.arrivals.cost
    block = policy.block(rule)
    leasing = policy.enabled(rule)
    n_slots = len(timeline.node_ids)
    n_users = scenario.users.count
    times = arrivals.times.tolist()
    users = arrivals.users.tolist()
    allowed = np.zeros(len(times), dtype=bool)
    run = LeaseRun(allowed, np.zeros(n_slots, dtype=np.int64))
    leased = np.zeros(n_users, dtype=np.int64)
    used = np.zeros(n_users, dtype=np.int64)
    messages = [0] * n_slots
    fresh_at = REGISTRY[rule.algorithm].fresh_at
    books: list[LeaseBook[int]] = [
        LeaseBook(drift=0.0, low_water=low_water) for _ in range(routers)
    ]
    holds: list[dict[int, Held]] = [{} for _ in range(n_slots)]
    hot = [HotKeys(policy.threshold, half_life=half_life) for _ in range(n_slots)]
    deadlines: list[tuple[float, int]] = []  # (deadline, router)
    lease_ids = iter(range(1, 1 << 62))
    epochs = timeline.epochs
    changes = timeline.changes
    e = 0
    owners = epochs[0].owner_list()
    next_change = changes[0].at if changes else float("inf")
    per_epoch = np.zeros((len(epochs), n_slots), dtype=np.int64)
    keys = np.full((len(epochs), n_slots), -1, dtype=np.int64)
    actions: list[dict[str, Any]] = []
    counted = [0] * n_slots

    def close_epoch(index: int) -> None:
        for node in range(n_slots):
            per_epoch[index, node] = messages[node] - counted[node]
            counted[node] = messages[node]
        end = epochs[index].end
        for node in epochs[index].alive:
            # states a node's sweeper would keep: not fresh, or with a lease still out
            keys[index, node] = sum(
                1
                for held in holds[node].values()
                if held.state is not None
                and (fresh_at(held.state, rule) > end or held.owed(end) > 0)
            )

    def settle(rel: Released[int], at: float, give_back: bool) -> None:
        key = rel.key
        node = owners[key]
        if node < 0:
            run.units_written_off += rel.unused
            return
        table = holds[node]
        held, back = refund(
            table.get(key, EMPTY), rule, rel.lease, rel.unused if give_back else 0, at
        )
        table[key] = held
        run.units_refunded += back
        run.units_written_off += rel.unused - back

    def ask(r: int, key: int, now: float, node: int, message: bool) -> None:
        if message:
            messages[node] += 1
            run.asks += 1
        book = books[r]
        table = holds[node]
        for spent in book.take_spent(key):  # settled in the same message
            table[key] = refund(table.get(key, EMPTY), rule, spent, 0, now)[0]
        held, lease = grant(
            table.get(key, EMPTY),
            rule,
            now,
            block,
            epoch=e,
            lease_id=next(lease_ids),
            ttl=policy.ttl,
            cost=cost,
            key=key,
        )
        table[key] = held
        if lease is None:
            return
        book.add(key, lease, now)
        if lease.units:
            run.leases += 1
            run.units_leased += lease.units
            leased[key] += lease.units
            heapq.heappush(deadlines, (now + (lease.expires_at - lease.granted_at), r))

    def expire_until(now: float) -> None:
        while deadlines and deadlines[0][0] <= now:
            due, r = heapq.heappop(deadlines)
            for rel in books[r].expire(due):
                if rel.unused:
                    assert isinstance(rel.key, int)
                    node = owners[rel.key]
                    if node >= 0:
                        messages[node] += 1
                        run.returns += 1
                settle(rel, due, True)

    def change(at: float) -> None:
        nonlocal e, owners, next_change
        close_epoch(e)
        info = changes[e]
        before, after = epochs[e], epochs[e + 1]
        new = after.owner_list()
        crashed = info.node_index if info.change.kind == "crash" else -1
        moved: list[tuple[int, Held]] = []
        for node in before.alive:
            table = holds[node]
            if node == crashed:
                table.clear()
                continue
            for key in [k for k in table if new[k] != node]:
                moved.append((key, table.pop(key)))
        for key, held in moved:
            if new[key] >= 0:
                holds[new[key]][key] = held
        if crashed >= 0:
            state, _ = exhausted(rule, at)
            for key in np.flatnonzero(before.owners == crashed).tolist():
                if new[key] >= 0 and key not in holds[new[key]]:
                    holds[new[key]][key] = Held(state)
            hot[crashed] = HotKeys(policy.threshold, half_life=half_life)
        e += 1
        owners = new
        revoked = written = 0
        for book in books:
            for rel in book.set_epoch(e):
                revoked += 1
                written += rel.unused
        run.units_written_off += written
        kind = info.change.kind
        actions.append(
            {
                "policy": "conservative" if kind == "crash" else "handoff",
                "leases_revoked": revoked,
                "units_written_off": written,
            }
        )
        next_change = changes[e].at if e < len(changes) else float("inf")

    for i, (now, key) in enumerate(zip(times, users, strict=True)):
        while now >= next_change:
            expire_until(next_change)
            change(next_change)
        expire_until(now)
        r = i % routers
        book = books[r]
        outcome = book.decide(key, now, cost)
        if outcome == ADMIT:
            allowed[i] = True
            used[key] += cost
            run.local_admits += 1
            if book.want(key, now, block):
                node = owners[key]
                if node >= 0:
                    ask(r, key, now, node, True)
            continue
        if outcome == DENY:
            run.local_denials += 1
            continue
        node = owners[key]
        if node < 0:
            continue
        messages[node] += 1
        run.forwarded += 1
        table = holds[node]
        held, decision = decide(table.get(key, EMPTY), rule, now, cost)
        table[key] = held
        allowed[i] = decision[0]
        if hot[node].observe(key, now) and leasing:
            ask(r, key, now, node, False)  # the lease rides on the answer
    while e < len(changes):  # changes after the last arrival
        expire_until(next_change)
        change(next_change)
    close_epoch(e)
    run.messages = np.asarray(messages, dtype=np.int64)
    run.leased, run.used = leased, used
    run.per_epoch, run.keys, run.actions = per_epoch, keys, actions
    return run


class LeasesMode(Mode):
    """``ringlimit simulate``'s ``leases`` mode: sticky routing with quota leases.

    The scenario's rule as if it said ``lease = "auto"`` (threshold
    :data:`DEFAULT_THRESHOLD` decisions/s, the default ttl and block), two
    routers, handoff on joins and graceful leaves, ``conservative`` on a
    crash, every lease of an older epoch revoked. A node's requests are what
    reaches it: forwarded requests, asks and returns (:func:`run_leases`).
    """

    name = "leases"

    def run(self) -> ModeResult:
        import time

        started = time.perf_counter()
        policy = LeasePolicy("auto", threshold=DEFAULT_THRESHOLD)
        run = run_leases(self.timeline, self.arrivals, policy)
        self.progress(len(self.times))
        assert run.per_epoch is not None and run.keys is not None and run.actions is not None
        return ModeResult(
            self.name,
            run.allowed,
            run.per_epoch,
            run.keys,
            run.actions,
            time.perf_counter() - started,
            len(self.times),
            None,
            None,
            self.unavailable,
        )

    def apply(self, info: Any, before: Epoch, after: Epoch) -> dict[str, Any]:
        raise NotImplementedError  # run() does the whole run


def _load_ratio(timeline: Timeline, requests: np.ndarray) -> float | None:
    """Requests per member-second per node, max over mean (as ``simulations.metrics``)."""
    member = np.zeros(len(timeline.node_ids))
    for epoch in timeline.epochs:
        for n in epoch.alive:
            member[n] += epoch.end - epoch.start
    present = member > 0
    rates = requests[present] / member[present]
    mean = rates.mean() if rates.size else 0.0
    return round(float(rates.max() / mean), 4) if mean > 0 else None


def _sticky_requests(timeline: Timeline, arrivals: Arrivals) -> np.ndarray:
    """Requests each node receives with plain sticky routing (every arrival to its owner)."""
    out = np.zeros(len(timeline.node_ids), dtype=np.int64)
    edges = [
        0,
        *np.searchsorted(arrivals.times, timeline.change_times, side="left").tolist(),
        len(arrivals),
    ]
    for e, epoch in enumerate(timeline.epochs):
        routed = epoch.owners[arrivals.users[edges[e] : edges[e + 1]]]
        out += np.bincount(routed[routed >= 0], minlength=len(out))
    return out


def score(
    scenario: Scenario,
    arrivals: Arrivals,
    run: LeaseRun,
    ref: np.ndarray,
    baseline: LeaseRun | None = None,
) -> dict[str, Any]:
    """Over-admission and false denials per user against the reference, and the bound.

    With a ``baseline`` (the same run with leases off), a user's false denials
    are checked against the bound plus the baseline's (a crash's conservative
    policy denies some by itself, leases or not).
    """
    n_users = scenario.users.count
    cost = scenario.arrivals.cost
    users = arrivals.users
    mine = np.bincount(users[run.allowed], minlength=n_users)
    theirs = np.bincount(users[ref], minlength=n_users)
    diff = mine - theirs
    assert run.leased is not None and run.used is not None
    # Units leased and not used through a lease (written off + refunded + still out):
    # never above the bound docs/hotkeys.md states (which adds the most out at once).
    bound = (run.leased - run.used) // cost
    false = np.maximum(0, -diff)
    allowance = bound
    if baseline is not None:
        base = np.bincount(users[baseline.allowed], minlength=n_users) - theirs
        allowance = bound + np.maximum(0, -base)
    return {
        "allowed": int(run.allowed.sum()),
        "reference_allowed": int(ref.sum()),
        "over_admission": int(np.maximum(0, diff).sum()),
        "false_denials": int(false.sum()),
        "false_denial_bound": int(bound.sum()),
        "users_above_bound": int((false > allowance).sum()),
        "forwarded": run.forwarded,
        "asks": run.asks,
        "returns": run.returns,
        "local_admits": run.local_admits,
        "local_denials": run.local_denials,
        "leases": run.leases,
        "units_leased": run.units_leased,
        "units_refunded": run.units_refunded,
        "units_written_off": run.units_written_off,
    }


def simulate_leases(
    scenario: Scenario,
    policy: LeasePolicy | None = None,
    *,
    routers: int = 2,
    low_water: float = 0.25,
) -> dict[str, Any]:
    """The figures for ``scenario`` with leases on and off (see the module docstring)."""
    if policy is None:
        policy = LeasePolicy("auto", threshold=DEFAULT_THRESHOLD)
    timeline = build_timeline(scenario)
    arrivals = generate(scenario)
    ref = run_mode("global", timeline, arrivals).allowed
    sticky = _sticky_requests(timeline, arrivals)
    on = run_leases(timeline, arrivals, policy, routers=routers, low_water=low_water)
    off = run_leases(
        timeline, arrivals, replace(policy, mode="off"), routers=routers, low_water=low_water
    )
    return {
        "scenario": scenario.name,
        "requests": len(arrivals),
        "routers": routers,
        "policy": {
            "threshold": policy.threshold,
            "ttl": policy.ttl,
            "block": policy.block(scenario.rules[0]),
            "low_water": low_water,
        },
        "owner_load_max_over_mean": {
            "sticky": _load_ratio(timeline, sticky),
            "leases_off": _load_ratio(timeline, off.messages),
            "leases_on": _load_ratio(timeline, on.messages),
        },
        "owner_messages": {
            "leases_off": int(off.messages.sum()),
            "leases_on": int(on.messages.sum()),
        },
        "leases_on": score(scenario, arrivals, on, ref, baseline=off),
        "leases_off": score(scenario, arrivals, off, ref),
    }


USAGE = "usage: python -m simulations.quota SCENARIO.toml [--steady]"


def main(argv: list[str] | None = None) -> int:
    """The lease figures of one scenario as JSON; what it cannot run is one line on
    stderr (exit 2), never a traceback."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    paths = [a for a in args if not a.startswith("-")]
    unknown = [a for a in args if a.startswith("-") and a != "--steady"]
    if len(paths) != 1 or unknown:
        print(f"{USAGE} (got {' '.join(args) or 'nothing'})", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(paths[0])
    except ScenarioError as exc:
        print(f"python -m simulations.quota: {exc}", file=sys.stderr)
        return 2
    if "--steady" in args:
        scenario = replace(scenario, events=())
    print(json.dumps(simulate_leases(scenario), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
