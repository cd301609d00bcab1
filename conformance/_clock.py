"""The sessions' clock in a case: wall time, less the time the suite's process waited for a CPU between polls.

A scenario's deadlines (a few tenths of a second, FAIL-1) bound how long a
request may take while the suite keeps polling it. On a busy machine the
suite's process is descheduled between two polls for tens or hundreds of
milliseconds; a correct backend that needs a number of polls (NIXL without a
progress thread moves a transfer a piece per call) then misses a deadline it
would meet on an idle machine. :class:`PollClock` counts each gap between two
polls up to ``step`` seconds only: while the suite polls steadily it runs as
wall time, so a lost message or a hung transfer still ends at its deadline,
as fast as before; when the process was starved, the starved time does not
count. It never runs backwards and never runs faster than wall time.
"""

from __future__ import annotations

import time

__all__ = ["DEFAULT_POLL_STEP", "PollClock"]

# The longest gap between two polls that counts in full: above a poll of a backend in another process or on
# another host (a few round trips), far below any deadline a case sets (50 ms and up). Only a starved process,
# or a call that took long, loses time; a deadline that must fire still fires after as many polls.
DEFAULT_POLL_STEP = 0.01


class PollClock:
    """A monotonic clock (seconds) that counts at most ``step`` seconds between two :meth:`tick` calls.

    Call :meth:`tick` once per poll; hand the clock itself (a callable) to the
    drivers. Between ticks it reads as wall time, up to ``step`` past the
    last tick.
    """

    def __init__(self, step: float = DEFAULT_POLL_STEP) -> None:
        self.step = step
        self._wall = time.monotonic()
        self._now = self._wall

    def __call__(self) -> float:
        """The clock's time now."""
        return self._now + min(time.monotonic() - self._wall, self.step)

    def tick(self) -> None:
        """One poll: the time since the last tick counts, up to ``step``."""
        wall = time.monotonic()
        self._now += min(wall - self._wall, self.step)
        self._wall = wall
