"""The probe schedule of members removed as crashed (router/revival.py), on
injected times: probed every round at first, then less often, then forgotten."""

from __future__ import annotations

import itertools

from router.revival import FORGET_AFTER, FULL_RATE_FOR, MAX_GAP, RevivalProbes

INTERVAL = 1.0


def probe_times(probes: RevivalProbes, until: float, answers_at: float = -1.0) -> list[float]:
    """Rounds every INTERVAL from 0 to ``until``: when the member was probed.
    It answers the first probe at or after ``answers_at`` (never if negative);
    it stays removed (a rejoin that did not happen) until forgotten."""
    probed: list[float] = []
    answered = False
    now = 0.0
    removed = ["n3"]
    while now <= until and removed:
        due, forget = probes.plan(removed, now)
        if forget:
            removed = []
        for member_id in due:
            probed.append(now)
            if 0 <= answers_at <= now and not answered:
                answered = True
                probes.answered(member_id, now)
            else:
                probes.missed(member_id, now)
        now += INTERVAL
    return probed


def test_a_member_that_died_for_good_is_probed_less_often_then_forgotten() -> None:
    """Before, a router probed each removed member every health round for as
    long as it ran: 3,600 probes an hour at h = 1 s, each a connect timeout on
    an unreachable host, forever. Now every round for the first minute, then
    gaps that double up to MAX_GAP, and none past the forget age."""
    probes = RevivalProbes(INTERVAL)
    probed = probe_times(probes, 3 * FORGET_AFTER)
    first_minute = [t for t in probed if t < FULL_RATE_FOR]
    assert first_minute == [float(t) for t in range(int(FULL_RATE_FOR))]
    later = [t for t in probed if t >= FULL_RATE_FOR]
    gaps = [b - a for a, b in itertools.pairwise(later)]
    assert gaps[:5] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert max(gaps) == MAX_GAP and all(g <= MAX_GAP for g in gaps)
    assert probed[-1] < FORGET_AFTER
    # ~180 probes in its hour, then none (before: 10,801 in these three hours).
    assert len(probed) < 200


def test_an_answer_brings_a_removed_member_back_to_full_rate() -> None:
    """A member that answers (its rejoin then failed or waited for the lock)
    is alive: probed every round again, its age counted from the answer."""
    probes = RevivalProbes(INTERVAL)
    probed = probe_times(probes, 2 * FORGET_AFTER, answers_at=1000.0)
    answer = next(t for t in probed if t >= 1000.0)  # its first probe from then on
    after = [t for t in probed if t >= answer]
    assert after[: int(FULL_RATE_FOR)] == [answer + t for t in range(int(FULL_RATE_FOR))]
    assert FORGET_AFTER <= probed[-1] < answer + FORGET_AFTER


def test_the_forget_age_is_a_setting_and_ids_no_longer_removed_leave() -> None:
    probes = RevivalProbes(INTERVAL, forget_after=10.0)
    assert probes.plan(["a", "b"], 0.0) == (["a", "b"], [])
    assert probes.plan(["a", "b"], 9.0) == (["a", "b"], [])
    assert probes.plan(["a", "b"], 10.0) == ([], ["a", "b"])
    assert probes.plan(["c"], 11.0) == (["c"], [])
    assert set(probes._tracks) == {"c"}
    # A member removed again later is new to the schedule: its age starts again.
    assert probes.plan(["a"], 12.0) == (["a"], [])
