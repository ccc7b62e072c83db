"""The poll loop's cadence (``engine/cadence.py``): when a GPU peer's next records are
due, learned from the polls' outcomes, on a clock the test holds."""

from __future__ import annotations

import random

import pytest

from dpu_frontend.engine.cadence import Cadence

INTERVAL = 0.001


def polled_steps(cadence: Cadence, period: float, steps: int, start: float = 0.0,
                 jitter: float = 0.0, seed: int = 1) -> tuple[float, int]:
    """Poll every interval (or as the cadence says) while a peer publishes a burst every
    ``period`` (give or take ``jitter``), from ``start``: the time after ``steps`` bursts,
    and how many were late. Checks that no other burst waits longer than an interval."""
    rng = random.Random(seed)
    due = [start + (i + 1) * period + rng.uniform(-jitter, jitter) for i in range(steps)]
    now, i, lates = start, 0, 0
    while i < len(due):
        found = due[i] <= now
        late = cadence.polled(now, 5 if found else 0)
        lates += late
        if found:
            assert now - due[i] <= INTERVAL + 1e-9 or late, (i, now - due[i])
            i += 1
            cadence.polled(now, 0)  # the next poll, at once, finds the burst drained
        now += cadence.wait(now)
    return now, lates


def test_a_steady_peer_gives_its_period_after_enough_bursts() -> None:
    cadence = Cadence(INTERVAL, bursts=8)
    now, _ = polled_steps(cadence, 0.020, 8)
    assert cadence.period() is None  # 8 starts, 7 gaps: not yet
    polled_steps(cadence, 0.020, 2, start=now)
    learned = cadence.period()
    assert learned is not None and learned[0] == pytest.approx(0.020, abs=INTERVAL)


def test_between_bursts_it_waits_until_one_interval_and_the_jitter_before_the_next() -> None:
    cadence = Cadence(INTERVAL, bursts=4)
    for start in (0.0, 0.020, 0.040, 0.060, 0.080):
        cadence.polled(start, 3)
        cadence.polled(start + 1e-5, 0)
    # One poll more first: a burst is over once it has been quiet an interval longer
    # than the longest lasted (these: one poll).
    assert cadence.wait(0.080 + 1e-5) == INTERVAL
    cadence.polled(0.081, 0)
    now = 0.081
    wait = cadence.wait(now)
    # Due at 0.100; the gaps did not stray, so three intervals of margin.
    assert now + wait == pytest.approx(0.100 - 3 * INTERVAL)
    # From there it polls every interval, as before.
    assert cadence.polled(now + wait, 0) is False
    assert cadence.wait(now + wait) == INTERVAL


class Counting(Cadence):
    waits = 0

    def wait(self, now: float) -> float:
        self.waits += 1
        return super().wait(now)


def test_steady_bursts_never_wait_longer_than_an_interval() -> None:
    """A 20 ms and a 6 ms step, with jitter inside the allowance: every burst is found
    within one poll interval of its publication, and the empty polls between bursts
    are skipped (all but the margin's: one in two at 20 ms, one in ten at 8)."""
    for period, jitter, share in ((0.020, 0.0008, 0.5), (0.008, 0.0002, 0.9)):
        cadence = Counting(INTERVAL)
        _, late = polled_steps(cadence, period, 200, jitter=jitter)
        assert late == 0
        every_interval = 200 * period / INTERVAL
        assert cadence.waits < share * every_interval, (period, cadence.waits, every_interval)


def test_a_late_step_does_not_push_the_next_one_later() -> None:
    """A peer on a clock: a step late by 2.5 ms, then one on time. The wait after the
    late one ends as early as the earlier starts foretell."""
    cadence = Cadence(INTERVAL, bursts=4)
    for start in (0.0, 0.020, 0.040, 0.060, 0.0825):
        cadence.polled(start, 3)
        cadence.polled(start + 1e-5, 0)
    cadence.polled(0.0835, 0)
    now = 0.0835
    until = now + cadence.wait(now)
    assert until > now + INTERVAL
    assert until <= 0.100 - 3 * INTERVAL


def test_an_early_burst_is_reported_and_the_cadence_learned_again() -> None:
    cadence = Cadence(INTERVAL, bursts=4)
    for start in (0.0, 0.020, 0.040, 0.060, 0.080):
        cadence.polled(start, 3)
        cadence.polled(start + 1e-5, 0)
    cadence.polled(0.081, 0)
    wait = cadence.wait(0.081)
    assert wait > INTERVAL
    # The steps got shorter: the burst was there when the wait ended.
    assert cadence.polled(0.081 + wait, 2) is True
    assert cadence.period() is None
    assert cadence.wait(0.098) == INTERVAL


def test_an_early_burst_at_the_same_pace_widens_the_margin() -> None:
    """The burst was there when the wait ended, but on the pace learned (the loop woke
    late): the period stays, and the next wait ends an interval earlier."""
    cadence = Cadence(INTERVAL, bursts=4)
    for start in (0.0, 0.020, 0.040, 0.060, 0.080):
        cadence.polled(start, 3)
        cadence.polled(start + 1e-5, 0)
    cadence.polled(0.081, 0)
    before = 0.081 + cadence.wait(0.081)
    assert cadence.polled(0.1005, 3) is True  # woke 3.5 ms after the wait's end
    assert cadence.period() is not None
    cadence.polled(0.1006, 0)
    cadence.polled(0.1016, 0)
    after = 0.1016 + cadence.wait(0.1016)
    assert after - 0.120 == pytest.approx(before - 0.100 - INTERVAL, abs=6e-4)


def test_no_cadence_from_irregular_records_or_short_periods() -> None:
    irregular = Cadence(INTERVAL, bursts=4)
    now = 0.0
    for gap in (0.005, 0.031, 0.012, 0.020, 0.008):
        now += gap
        irregular.polled(now, 1)
        irregular.polled(now + 1e-5, 0)
    assert irregular.period() is None and irregular.wait(now) == INTERVAL
    fast = Cadence(INTERVAL, bursts=4)
    for i in range(6):
        fast.polled(i * 0.002, 1)
        fast.polled(i * 0.002 + 1e-5, 0)
    assert fast.period() is None  # 2 ms: below the 4 ms worth skipping
    assert fast.wait(0.011) == INTERVAL


def test_a_burst_read_over_several_polls_is_one() -> None:
    """A peer still writing a step's records when the loop polls: records, nothing,
    records within two intervals are one burst, and the period is the steps'."""
    cadence = Cadence(INTERVAL, bursts=4)
    for step in range(6):
        start = step * 0.020
        for at, found in ((0.0, 40), (0.0001, 0), (0.0011, 30), (0.0012, 0), (0.0022, 9),
                          (0.0023, 0)):
            cadence.polled(start + at, found)
    learned = cadence.period()
    assert learned is not None and learned[0] == pytest.approx(0.020)


def test_no_wait_begins_before_the_burst_is_over() -> None:
    """Bursts that went on for 2.5 ms: after the first quiet poll of the next one, the
    loop keeps polling every interval until the burst has been going for 2.5 ms and an
    interval; only then does it wait for the next."""
    cadence = Cadence(INTERVAL, bursts=4)
    for step in range(6):
        start = step * 0.020
        for at, found in ((0.0, 40), (0.0001, 0), (0.0025, 9), (0.0026, 0)):
            cadence.polled(start + at, found)
    start = 6 * 0.020
    cadence.polled(start, 40)
    cadence.polled(start + 0.0001, 0)
    assert cadence.wait(start + 0.0001) == INTERVAL
    cadence.polled(start + 0.0011, 0)
    assert cadence.wait(start + 0.0011) == INTERVAL
    cadence.polled(start + 0.0036, 0)
    assert cadence.wait(start + 0.0036) > INTERVAL


def test_no_waits_where_the_bursts_keep_the_loop_busy_half_the_period() -> None:
    """Bursts whose records take the loop 12 ms of a 20 ms step to hand out (1,000
    streams on one worker): a wait would save little, and a loop that wakes late would
    end it past the next burst. It polls every interval."""
    cadence = Cadence(INTERVAL, bursts=4)
    for step in range(6):
        start = step * 0.020
        cadence.polled(start, 1000)
        cadence.polled(start + 0.012, 0)
    learned = cadence.period()
    assert learned is not None and learned[0] == pytest.approx(0.020)
    assert cadence.wait(6 * 0.020 - 0.020 + 0.013) == INTERVAL


def test_records_in_every_poll_are_one_burst() -> None:
    """Records poll after poll (a busy peer): one burst, no period, no skipping."""
    cadence = Cadence(INTERVAL, bursts=2)
    for i in range(50):
        cadence.polled(i * INTERVAL, 4)
    assert cadence.period() is None


def test_no_wait_is_longer_than_the_longest() -> None:
    """A slow, steady peer (a burst a second): the loop still polls every quarter of the
    peer timeout, to watch its heartbeat."""
    cadence = Cadence(INTERVAL, longest=0.25, bursts=4)
    for start in range(6):
        cadence.polled(float(start), 2)
        cadence.polled(start + 1e-5, 0)
    cadence.polled(5.002, 0)
    assert cadence.wait(5.002) == 0.25


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"bursts": 1}, {"min_period": 0}, {"jitter": 0.5}, {"longest": 0.0005}):
        with pytest.raises(ValueError):
            Cadence(INTERVAL, **kwargs)
    with pytest.raises(ValueError):
        Cadence(0)
