"""When a GPU peer's next records are due, learned from when its records arrived.

A GPU publishes its tokens once a decode step: at light load the records come in
bursts a step apart (5-20 ms), and the poll loop's 1 ms polls between the bursts find
nothing. Each empty poll is a timer wake-up, an exchange with the peer and a pass of
the event loop: at 64 streams of a 20 ms step, most of the daemon's CPU. ``Cadence``
watches the polls' outcomes (sans I/O: the caller passes the clock), and once the
bursts have come at a steady period, it says how long the loop may wait after a burst:
until three poll intervals, the peer's jitter and a learned margin before the next is
due. From there the loop polls every interval again, so a burst that comes on time
waits no longer than it did.

A burst is not always read in one poll: a peer may still be writing it (the
reference peer's Python, on a busy core, writes a 256-record step over several
milliseconds). Records within a quarter period of the last (three intervals before a
period is known) are the same burst's, and no wait starts before a burst has been
quiet for as long as the longest burst lasted, an interval more: a wait that began in
a burst's middle would hold its tail.

A burst that comes early is found by the first poll after the wait: it may have
waited up to the wait. If it still came at the pace learned (a peer's jitter past what
the gaps showed, the loop's timer firing late while its handlers ran), later waits
end an interval earlier, and the margin is given back slowly as bursts come on time
(a 64th of an interval each: at a steady state, about one burst in 65 finds a wait
ending). If the pace changed (the steps got shorter, a prefill step ended),
everything learned is forgotten and the cadence is learned again from ``bursts``
bursts polled every interval: one such burst per change of pace. Records that come at
no steady period (a peer pacing each stream on its own) never give a cadence, and the
loop polls as before. Nor does the loop wait where handing out a burst keeps it busy
half the period or more (1,000 streams on one worker): a wait would save little there.

A burst's start is its poll's exchange, taken before its records are handed out, so
that the work a burst makes does not blur the starts.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque


class Cadence:
    """``interval``: the poll interval; ``bursts``: the burst starts whose gaps must
    agree; ``min_period``: no skipping below this period (a wait shorter than a few
    intervals saves nothing); ``jitter``: the share of the period by which the gaps
    may stray from it, an interval more (the polls' own granularity); ``longest``: no
    wait longer (the loop watches the peer's heartbeat between polls)."""

    def __init__(self, interval: float, *, longest: float = 0.25, bursts: int = 8,
                 min_period: float = 0.006, jitter: float = 0.1) -> None:
        if (interval <= 0 or longest < interval or bursts < 2 or min_period <= 0
                or not 0 <= jitter < 0.5):
            raise ValueError("a cadence needs a positive interval, a longest wait and a "
                             "period no shorter, two or more bursts and a jitter share in "
                             "[0, 0.5)")
        self.interval = interval
        self.longest = longest
        self.min_period = min_period
        self.jitter = jitter
        self._starts: deque[float] = deque(maxlen=bursts + 1)
        #: How long each of the last bursts went on: from its start to its last records.
        self._spans: deque[float] = deque(maxlen=bursts)
        #: How long the loop was busy with each of the last bursts: from its start to the
        #: first poll after it that found nothing (the records handed out meanwhile).
        self._busy: deque[float] = deque(maxlen=bursts)
        self._opened = False  # a burst started, no poll since found nothing
        self._quiet = True  # the last poll found nothing
        self._last = float("-inf")  # the last poll that found records
        self._waited = False  # the wait before the coming poll was a skip
        self._learned: tuple[float, float] | None = None  # period(), as of the last start
        self._due = 0.0  # the next burst's earliest start, as of the last start
        #: Margin added by bursts that came early on the same pace (a peer's jitter past
        #: the spread seen, a loop that woke late): an interval each, given back a
        #: 64th of an interval for each burst on time (one burst in 65 may come early).
        self._margin = 0.0

    def polled(self, now: float, records: int) -> bool:
        """A poll at ``now`` brought ``records``. True: they were there when a skip
        ended (cut short or not), so they may have waited up to it. If they came at the
        pace learned, the waits keep an interval more of margin from now on; if not (the
        pace changed), the cadence is learned again."""
        waited, self._waited = self._waited, False
        if not records:
            if self._opened:
                self._busy.append(now - self._starts[-1])
                self._opened = False
            self._quiet = True
            return False
        learned = self._learned
        if waited:
            if (learned is not None and abs(now - self._starts[-1] - learned[0])
                    <= learned[1] + self.interval):
                self._margin = min(self._margin + self.interval, learned[0] / 2)
            else:
                self._starts.clear()
                self._spans.clear()
                self._learned = None
                self._margin = 0.0
        elif learned is not None and self._quiet:
            self._margin = max(0.0, self._margin - self.interval / 64)
        # Records within a quarter period (three intervals while none is known) of the
        # last are the same burst's.
        join = 3 * self.interval if self._learned is None else self._learned[0] / 4
        if self._quiet and now - self._last > join:
            if self._starts:
                self._spans.append(self._last - self._starts[-1])
            self._starts.append(now)
            self._opened = True
            self._learn()
        self._quiet = False
        self._last = now
        return waited

    def period(self) -> tuple[float, float] | None:
        """The bursts' period and the most a gap between their starts strayed from it,
        once the last ones agree on one; else None. A start is the poll that found a
        burst: up to an interval after the peer published it, so the gaps stray by up
        to an interval more than the peer's own jitter."""
        return self._learned

    def _learn(self) -> None:
        """What the starts say now: the period and spread, and when the next is due."""
        self._learned = None
        if len(self._starts) < (self._starts.maxlen or 0):
            return
        gaps = [b - a for a, b in itertools.pairwise(self._starts)]
        period = statistics.median(gaps)
        spread = max(abs(g - period) for g in gaps)
        if period < self.min_period or spread > self.jitter * period + self.interval:
            return
        self._learned = period, spread
        # The earliest of what each start foretells: a peer that keeps to a clock makes
        # up a late step with an early one, and the late start alone would foretell late.
        n = len(self._starts)
        self._due = min(start + (n - i) * period for i, start in enumerate(self._starts))

    def wait(self, now: float) -> float:
        """Seconds to wait before the next poll, after one that found nothing while
        requests are open: the poll interval, or longer where a cadence says the next
        burst is not due before then."""
        learned = self._learned
        if (learned is None or not self._quiet
                or now - self._starts[-1] < max(self._spans, default=0.0) + self.interval
                or max(self._busy, default=0.0) > learned[0] / 2):
            # No cadence; or the burst may not be over: the longest lasted this long; or
            # the bursts keep the loop busy half the period or more, where a wait saves
            # little and a late wake-up of the loop would make it end past the next.
            return self.interval
        _, spread = learned
        # The next burst is published no earlier than it is due, less the peer's own
        # jitter (the spread, less the interval by which the polls blur the starts, which
        # the earliest foretelling has taken already), less the interval a start may have
        # waited for its poll. Two intervals more: the loop's timer fires up to about an
        # interval late when the handlers keep the loop busy, and the first poll after a
        # wait should find nothing; one that finds the burst means it came early.
        until = (self._due - max(0.0, spread - self.interval) - 3 * self.interval
                 - self._margin)
        if until - now <= self.interval:
            return self.interval
        self._waited = True
        return min(until - now, self.longest)
