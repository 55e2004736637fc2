"""The daemons' pace of wake-ups (framework/wakeup.py, ``Pace``): windows only under load,
holds only after a lost race, a NOTIFY deferred during a hold and never dropped."""

from __future__ import annotations

import time

import pytest

from framework import wakeup
from framework.wakeup import HOLD_FIRST, WINDOW_MAX, Pace


def test_a_trickle_gets_no_window_and_a_burst_at_most_the_longest() -> None:
    pace = Pace()
    assert pace.window() == 0.0  # nothing heard yet: as at a trickle
    for _ in range(50):  # NOTIFYs microseconds apart
        pace.notify(time.monotonic())
    assert pace.window() == WINDOW_MAX


def test_the_window_grows_with_the_rate_and_is_none_when_shorter_than_the_gap() -> None:
    pace = Pace()
    now = 1000.0
    # (mean gap between NOTIFYs, window): 250 msg/s would wait 2 ms for a NOTIFY due in 4,
    # 333 msg/s waits 4 ms, 500 msg/s the longest.
    for gap, window in ((0.004, 0.0), (0.003, 0.004), (0.002, WINDOW_MAX)):
        for _ in range(100):  # the running mean settles on this gap
            now += gap
            pace.notify(now)
        assert pace.window() == pytest.approx(window)


def test_only_a_loop_woken_from_sleep_waits_out_the_window() -> None:
    pace = Pace()
    for _ in range(50):
        pace.notify(time.monotonic())
    now = time.monotonic()
    assert pace.delay(now, from_sleep=True) == WINDOW_MAX
    assert pace.delay(now, from_sleep=False) == 0.0  # a busy loop claims soon anyway


def test_an_empty_claim_after_a_notify_holds_the_next_ones_back_and_rows_end_the_hold() -> None:
    pace = Pace(hold_max=0.05)
    pace.found(0, notified=False)  # an empty claim at the poll: nobody raced us
    assert pace.hold_until == 0.0
    pace.found(0, notified=True)
    first = pace.hold_until - time.monotonic()
    assert HOLD_FIRST * 0.5 < first <= max(HOLD_FIRST, 2.0)
    for _ in range(20):  # losing again and again: longer, never past hold_max
        pace.found(0, notified=True)
    assert 0.0 < pace.hold_until - time.monotonic() <= 0.05
    pace.found(3, notified=True)
    assert pace.hold_until == 0.0


def test_a_notify_during_a_hold_is_deferred_to_its_end_not_dropped() -> None:
    pace = Pace(hold_max=60.0)
    for _ in range(10):
        pace.found(0, notified=True)  # a hold of a minute
    now = time.monotonic()
    delay = pace.delay(now, from_sleep=True)
    assert delay == pytest.approx(pace.hold_until - now) and delay > 0  # the claim comes at its end
    assert pace.held


def test_rows_found_after_a_hold_halve_it_and_a_dead_peers_rows_end_it_soon(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(wakeup.time, "monotonic", lambda: clock[0])
    pace = Pace(hold_max=0.04)
    for _ in range(10):
        pace.found(0, notified=True)  # the longest hold: 40 ms
    holds = []
    for _ in range(4):  # the peer is gone: every claim after a hold finds rows
        clock[0] = pace.hold_until - 0.001  # a NOTIFY during the hold: deferred to its end
        assert pace.delay(clock[0], from_sleep=True) > 0
        clock[0] = pace.hold_until  # the claim at the hold's end finds rows
        pace.found(1, notified=True)
        holds.append(round(max(0.0, pace.hold_until - clock[0]), 3))
    assert holds[0] == 0.02  # halved, not ended
    assert holds[-1] == 0.0  # and soon no hold at all
    pace.found(0, notified=True)
    pace.found(2, notified=False)  # rows without a hold before: the hold ends at once
    assert pace.hold_until == 0.0
