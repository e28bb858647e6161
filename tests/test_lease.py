"""The lease protocol (node/lease.py): a node never decides past the router's bound."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.lease import DEFAULT_DRIFT, MAX_LEASE, Lease, LeaseError, lease_bound


def test_a_grant_extends_the_lease_from_the_offer_not_from_its_arrival() -> None:
    lease = Lease(required=True)
    token = lease.offer(100.0)
    assert not lease.valid(100.0)
    # The grant arrives 2 s after the offer: the lease still ends at offer + 3.
    assert lease.grant(token, 3.0, 102.0) == pytest.approx(1.0)
    assert lease.valid(102.9)
    assert not lease.valid(103.0)


def test_a_late_grant_does_nothing() -> None:
    lease = Lease(required=True)
    token = lease.offer(100.0)
    assert lease.grant(token, 3.0, 150.0) == 0.0  # held in a socket buffer during a pause
    assert not lease.valid(150.0)


def test_grants_never_shorten_the_lease() -> None:
    lease = Lease(required=True)
    late = lease.offer(100.0)
    early = lease.offer(101.0)
    lease.grant(early, 3.0, 101.5)
    lease.grant(late, 3.0, 101.6)
    assert lease.until == 104.0


def test_a_lease_is_not_required_outside_a_leased_ring() -> None:
    lease = Lease()
    assert lease.valid(0.0)
    lease.required = True
    assert not lease.valid(0.0)


def test_revoke_ends_the_lease_at_once() -> None:
    lease = Lease(required=True)
    lease.grant(lease.offer(10.0), 5.0, 10.0)
    lease.revoke()
    assert not lease.valid(10.1)


@pytest.mark.parametrize(
    ("token", "seconds", "problem"),
    [
        ("other:1.0", 3.0, "another incarnation"),
        (None, 3.0, "string"),
        ("{inc}:nan", 3.0, "not one this node offered"),
        ("{inc}:200.0", 3.0, "not one this node offered"),  # from the future
        ("{inc}:abc", 3.0, "malformed"),
        ("{inc}:1.0", 0.0, "seconds"),
        ("{inc}:1.0", MAX_LEASE + 1, "seconds"),
        ("{inc}:1.0", math.inf, "seconds"),
        ("{inc}:1.0", True, "seconds"),
        ("{inc}:1.0", "3", "seconds"),
    ],
)
def test_bad_grants_are_refused_and_change_nothing(
    token: object, seconds: object, problem: str
) -> None:
    lease = Lease(required=True)
    if isinstance(token, str):
        token = token.replace("{inc}", lease.incarnation)
    with pytest.raises(LeaseError, match=problem):
        lease.grant(token, seconds, 100.0)  # type: ignore[arg-type]
    assert lease.until == -math.inf


# A round of the protocol, in real time: the node handles a probe (offer at r),
# the router receives the answer (a >= r), and later sends a grant (delivered,
# perhaps much later, at d >= send time); the node's clock may run up to
# DRIFT faster or slower than the router's.
rounds = st.lists(
    st.tuples(
        st.floats(0.0, 2.0),  # gap before the node handles the next probe
        st.floats(0.0, 1.0),  # answer latency (offer -> router receipt)
        st.floats(0.0, 3.0),  # router's wait before granting that offer
        st.floats(0.0, 30.0),  # grant delivery delay (a pause, a buffer)
    ),
    min_size=1,
    max_size=20,
)


@given(
    rounds=rounds,
    seconds=st.floats(0.1, 10.0),
    # The node's clock may run fast, or slow down to 1 / (1 + drift) of the router's.
    rate=st.floats(1 / (1 + DEFAULT_DRIFT), 1.5),
)
def test_the_node_never_decides_past_the_routers_bound(
    rounds: list[tuple[float, float, float, float]], seconds: float, rate: float
) -> None:
    """Whatever the delays, a node's lease ends (in real time) no later than the
    bound the router computed for the grants it sent: the safety the router's
    removal relies on."""
    lease = Lease(required=True)
    now = 0.0  # real time; the node reads now * rate, the router reads now
    bound = -math.inf
    deliveries: list[tuple[float, str]] = []
    for gap, latency, wait, delay in rounds:
        now += gap
        token = lease.offer(now * rate)
        received = now + latency
        sent = received + wait
        bound = max(bound, lease_bound(received, seconds))
        deliveries.append((sent + delay, token))
    for at, token in sorted(deliveries):
        lease.grant(token, seconds, at * rate)
        # The node's lease ends at until / rate in real time: before the bound.
        assert lease.until / rate <= bound + 1e-9
