"""The restart policy of ``ringlimit up`` (router/restart.py): bounded, backing off, by mode."""

from __future__ import annotations

import io
import signal

import pytest
from hypothesis import given
from hypothesis import strategies as st

from node.config import ClusterConfig
from router.restart import RestartPolicy, decide, describe_exit
from router.supervisor import Child, Cluster

policies = st.builds(
    RestartPolicy,
    mode=st.sampled_from(["always", "on-crash", "never"]),
    max_restarts=st.integers(0, 8),
    window=st.floats(1.0, 120.0),
    backoff=st.floats(0.0, 2.0),
    max_backoff=st.floats(2.0, 30.0),
)
#: Gaps between one incarnation's start and its exit, and whether the exit was graceful.
lives = st.lists(st.tuples(st.floats(0.0, 50.0), st.booleans()), max_size=40)


def replay(policy: RestartPolicy, history: list[tuple[float, bool]]) -> list[tuple[float, float]]:
    """Run a process that exits after each gap; returns (decided at, restarted at) pairs."""
    now, done = 0.0, []
    for gap, graceful in history:
        now += gap
        decision = decide(policy, [d for d, _ in done], graceful=graceful, now=now)
        if not decision.restart:
            break
        assert policy.backoff <= decision.delay <= policy.max_backoff
        done.append((now, now + decision.delay))
        now += decision.delay
    return done


@given(policies, lives)
def test_never_more_restarts_than_the_budget_in_any_window(
    policy: RestartPolicy, history: list[tuple[float, bool]]
) -> None:
    decided = [d for d, _ in replay(policy, history)]
    for start in decided:
        within = [t for t in decided if start <= t < start + policy.window]
        assert len(within) <= policy.max_restarts


@given(policies, lives)
def test_modes(policy: RestartPolicy, history: list[tuple[float, bool]]) -> None:
    done = replay(policy, history)
    if policy.mode == "never":
        assert done == []
    if policy.mode == "on-crash":
        # Every restart answered a crash: the first graceful exit ends the replay.
        graceful_at = [i for i, (_, graceful) in enumerate(history) if graceful]
        assert len(done) <= (graceful_at[0] if graceful_at else len(history))


@given(policies)
def test_the_first_exit_is_restarted_unless_the_mode_or_an_empty_budget_says_not(
    policy: RestartPolicy,
) -> None:
    crash = decide(policy, [], graceful=False, now=100.0)
    assert crash.restart == (policy.mode != "never" and policy.max_restarts > 0)
    if crash.restart:
        assert crash.delay == pytest.approx(policy.backoff)
    left = decide(policy, [], graceful=True, now=100.0)
    assert left.restart == (policy.mode == "always" and policy.max_restarts > 0)


def test_backoff_doubles_within_the_window_and_resets_after_it() -> None:
    policy = RestartPolicy(max_restarts=5, window=60.0, backoff=0.5, max_backoff=4.0)
    delays = []
    restarts: list[float] = []
    for now in (0.0, 1.0, 2.0, 3.0, 4.0):
        decision = decide(policy, restarts, graceful=False, now=now)
        delays.append(decision.delay)
        restarts.append(now)
    assert delays == [0.5, 1.0, 2.0, 4.0, 4.0]
    refused = decide(policy, restarts, graceful=False, now=5.0)
    assert not refused.restart and "5 times within 60 s" in refused.reason
    later = decide(policy, restarts, graceful=False, now=64.5)
    assert later.restart and later.delay == 0.5


def test_bad_policies_are_refused() -> None:
    for bad in (
        {"mode": "sometimes"},
        {"max_restarts": -1},
        {"window": 0.0},
        {"backoff": 5.0, "max_backoff": 1.0},
    ):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)  # type: ignore[arg-type]


def test_exits_in_words() -> None:
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(-signal.SIGTERM) == "killed by SIGTERM"
    assert describe_exit(0) == "exited with code 0"
    assert describe_exit(3) == "exited with code 3"


class _Exited:
    """A child process that has exited (what ``Cluster._exited`` reads of one)."""

    returncode = -9

    def describe(self) -> str:
        return "killed by SIGKILL"


def test_a_node_restarted_for_weeks_keeps_only_its_recent_restart_times() -> None:
    """``ringlimit up`` appended the time of every restart it decided to the
    node's list and never took one out, and read the whole list at each exit:
    a node killed every 30 s (within the budget, so restarted each time) held
    20,160 times after a week. Only the times within the policy's window count
    (``decide``), so only they are kept."""
    policy = RestartPolicy(max_restarts=5, window=60.0)
    cluster = Cluster("http://127.0.0.1:1", ClusterConfig(), policy, out=io.StringIO())
    try:
        child = Child("n1", [])
        for i in range(1000):
            child.process = _Exited()  # type: ignore[assignment]
            cluster._exited(child, None, now=i * 30.0)
            assert child.restart_at is not None  # restarted every time
        assert len(child.restarts) <= policy.max_restarts
    finally:
        cluster._client.close()
