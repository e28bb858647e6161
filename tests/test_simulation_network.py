"""The sticky modes run the node's protocol core over a simulated network.

With the default network (instant, lossless) the reports are the golden
ones (tests/test_simulations.py). These tests slow the network down and cut
it: the core's pull-on-miss must keep a handoff exact when transfers are
late, and a transfer that is lost for good must show up as over-admission.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from simulations import parse_scenario
from simulations.arrivals import generate
from simulations.modes import run_mode
from simulations.network import SimNetwork
from simulations.sticky import StickyMode
from simulations.timeline import build_timeline

JOIN_LEAVE = [
    {"at": 8.3, "type": "join", "node": "n5"},
    {"at": 15.1, "type": "leave", "node": "n2"},
    {"at": 21.7, "type": "join", "node": "n6", "weight": 2},
]


def scenario(events: list[dict[str, Any]], algorithm: str = "token_bucket") -> Any:
    return parse_scenario(
        {
            "scenario": {"name": "t", "duration": 30, "seed": 3},
            "cluster": {"nodes": 4},
            "users": {"count": 60, "popularity": "zipf", "exponent": 0.8},
            "arrivals": {"rate": 400},
            "rules": [{"limit": "20/5s", "algorithm": algorithm}],
            "events": events,
        }
    )


def excess(mode: str, network: SimNetwork, events: list[dict[str, Any]]) -> tuple[int, StickyMode]:
    """Admissions beyond the exact reference's, summed over users."""
    sc = scenario(events)
    timeline, arrivals = build_timeline(sc), generate(sc)
    reference = run_mode("global", timeline, arrivals)
    sticky = StickyMode(mode, timeline, arrivals, full=True, network=network)
    result = sticky.run()
    users = arrivals.users
    n = int(users.max()) + 1
    got = np.bincount(users[result.allowed], minlength=n)
    want = np.bincount(users[reference.allowed], minlength=n)
    return int(np.clip(got - want, 0, None).sum()), sticky


def test_an_instant_network_changes_nothing() -> None:
    sc = scenario(JOIN_LEAVE)
    timeline, arrivals = build_timeline(sc), generate(sc)
    default = run_mode("handoff", timeline, arrivals, full=True)
    explicit = StickyMode("handoff", timeline, arrivals, full=True, network=SimNetwork()).run()
    assert (default.allowed == explicit.allowed).all()
    assert default.actions == explicit.actions


def test_late_transfers_are_pulled_on_miss_and_handoff_stays_exact() -> None:
    """A token bucket that arrives late has refilled less than it should (its
    age crosses the wire relative to the sender's ``now``): never more quota."""
    network = SimNetwork(delay=0.5)
    over, mode = excess("handoff", network, JOIN_LEAVE)
    assert over == 0
    pulls = sum(c.stats.pulls for c in mode.cores if c is not None)
    assert pulls > 0  # requests arrived before the transfers: the cores pulled
    assert network.sent > 0 and network.lost == 0


def test_a_leaving_member_cut_off_from_the_ring_loses_what_it_held() -> None:
    network = SimNetwork()
    for other in ("n1", "n3", "n4", "n5", "n6"):
        network.cut("n2", other)
    over, _ = excess("handoff", network, JOIN_LEAVE)
    assert network.lost > 0
    assert over > 0
    # The same network without the cut: nothing lost, nothing over-admitted.
    assert excess("handoff", SimNetwork(), JOIN_LEAVE)[0] == 0


def test_dropped_replicas_are_sent_again_at_the_next_round() -> None:
    crash = [{"at": 12.0, "type": "crash", "node": "n2"}]
    dropped: list[Any] = []

    def drop_every_other(sender: str, receiver: str, message: Any) -> bool:
        dropped.append(message)
        return len(dropped) % 2 == 0

    lossy = SimNetwork(drop=drop_every_other)
    over_lossy, _ = excess("replica", lossy, crash)
    over, _ = excess("replica", SimNetwork(), crash)
    assert lossy.lost > 0
    assert over_lossy >= over


# --------------------------------------------------------------------------- the network


def test_the_network_delays_drops_partitions_and_hurries() -> None:
    timers: list[tuple[float, Any]] = []
    network = SimNetwork(delay=0.2, schedule=lambda when, cb: timers.append((when, cb)))
    log: list[tuple[str, str, float]] = []

    def send(a: str, b: str, what: str) -> None:
        network.send(
            a,
            b,
            what,
            1.0,
            lambda now: log.append(("arrived", what, now)),
            lambda now: log.append(("lost", what, now)),
        )

    send("a", "b", "m1")
    send("a", "c", "m2")
    assert log == [] and [when for when, _ in timers] == [1.2, 1.2]
    network.hurry("a", "b", 1.05)  # someone waits for a -> b: it lands now
    assert log == [("arrived", "m1", 1.05)]
    network.cut("a", "c")
    for when, callback in timers:
        callback(when, None)
    assert log == [("arrived", "m1", 1.05), ("lost", "m2", 1.2)]  # m1 lands once
    network.heal("a", "c")
    assert network.reachable("c", "a")
    assert (network.sent, network.lost) == (2, 1)
