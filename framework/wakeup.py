"""When a daemon claims after NOTIFYs: the two ways it spends fewer wake-ups.

A wake-up, not a message, is the unit of a daemon's cost: each pays a whole cycle
(claim, then publish or handle, then commit). So (docs/explanation/daemons.md, "Wake-ups"):

- **A window under load.** When NOTIFYs come closer together than
  :data:`WINDOW_FROM`, a daemon woken from sleep by one waits (up to :data:`WINDOW_MAX`,
  more the closer they come) before it claims, so one claim takes the burst. A window
  shorter than the mean gap gathers no NOTIFY more on average, so there is none then,
  nor for NOTIFYs further apart (a trickle): no added latency where nothing is gained.
- **A replica that lost the race steps back.** Every replica listening on a channel
  wakes for every NOTIFY, but only one claims each row. A replica whose claim after a
  NOTIFY found nothing holds back the next NOTIFYs for a while (two of their mean gaps,
  at least :data:`HOLD_FIRST`, doubling up to :data:`HOLD_MAX` while its claims keep finding nothing), so the
  replica that got the rows claims alone. A NOTIFY is deferred, never dropped: the
  replica claims at the end of its hold, so a dead peer's rows wait at most
  :data:`HOLD_MAX` (less than any poll interval); a claim that finds rows ends the hold,
  or halves it if it was one at the end of a hold.
"""

from __future__ import annotations

import time

WINDOW_FROM = 0.005  # seconds: NOTIFYs at least this far apart get no window
# Seconds: the longest window, for NOTIFYs 2.5 ms apart or closer. Under load this length
# saved CPU and lowered the p50 at once (the CPU it saved was time spent queueing for a
# core); shorter windows saved less, longer ones cost latency (docs/explanation/daemons.md,
# "Wake-ups"; benchmarks/cpu-per-message.md, "A longer window").
WINDOW_MAX = 0.005
HOLD_FIRST = 0.005  # seconds a replica holds NOTIFYs back after its first empty claim
HOLD_MAX = 0.1  # seconds: the longest hold, bounded by the poll interval too
_SMOOTHING = 0.25  # weight of the newest gap between two NOTIFYs in their running mean


class Pace:
    """When to claim after NOTIFYs: the window under load and a replica's hold (the module's
    text). Pure state, for the one thread that owns it: the relay's and the worker's loop
    thread (docs/explanation/daemons.md, "Wake-ups")."""

    def __init__(self, *, hold_max: float = HOLD_MAX) -> None:
        self._hold_max = hold_max
        self._gap = 1.0  # running mean of the seconds between two NOTIFYs
        self._last_notify = 0.0
        self._hold = 0.0
        self.held = False  # the last wait slept out a hold
        self.hold_until = 0.0  # monotonic: NOTIFYs before this wake the loop only then

    def notify(self, now: float) -> None:
        """A NOTIFY came at ``now`` (monotonic)."""
        self._gap += (min(now - self._last_notify, 1.0) - self._gap) * _SMOOTHING
        self._last_notify = now

    def window(self) -> float:
        """Seconds a NOTIFY-woken loop waits for more before it claims: twice the mean gap's
        distance below :data:`WINDOW_FROM`, at most :data:`WINDOW_MAX`; 0 at a trickle, and
        0 when that is shorter than the mean gap: such a window gathers no NOTIFY more, it
        only adds its length to the latency (benchmarks/cpu-per-message.md, "A longer window")."""
        gap = self._gap
        wait = min(WINDOW_MAX, 2 * (WINDOW_FROM - gap))
        return wait if wait >= gap else 0.0

    def delay(self, now: float, *, from_sleep: bool) -> float:
        """Seconds to wait after a NOTIFY before claiming: the rest of a hold, else the
        window if the loop was asleep (a busy loop claims soon anyway)."""
        delay = self.hold_until - now
        self.held = delay > 0
        if not self.held and from_sleep:
            return self.window()
        return max(0.0, delay)

    def found(self, rows: int, *, notified: bool) -> None:
        """What the claim after a wake-up found. Nothing, after a NOTIFY: another replica
        took the rows, so hold the next NOTIFYs back (longer each time); rows: no hold."""
        held, self.held = self.held, False
        if rows and held and self._hold > 2 * HOLD_FIRST:
            # Rows left after a hold: the replica that got the others was busy, or is gone.
            # Halve the hold rather than end it: a busy peer's next claim takes those rows
            # with its next ones, and a dead one's are claimed after ever shorter holds.
            self._hold /= 2
            self.hold_until = time.monotonic() + self._hold
        elif rows:
            self._hold = 0.0
            self.hold_until = 0.0
        elif notified:
            # At first past the next NOTIFY or two (their gap), so the replica that got the
            # rows takes the next ones alone; longer while this one keeps losing.
            first = max(HOLD_FIRST, 2 * self._gap)
            self._hold = min(self._hold_max, self._hold * 2 or first)
            self.hold_until = time.monotonic() + self._hold
