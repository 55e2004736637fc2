"""The daemons' wake-up (framework/wakeup.py): windows only under load, holds only after a lost race."""

from __future__ import annotations

import threading
import time

import pytest

from framework import wakeup
from framework.wakeup import HOLD_FIRST, WINDOW_MAX, Wakeup


def test_a_trickle_gets_no_window_and_a_burst_at_most_the_longest() -> None:
    wake = Wakeup(threading.Event())
    assert wake.window() == 0.0  # nothing heard yet: as at a trickle
    for _ in range(50):  # NOTIFYs microseconds apart
        wake.notify()
    assert wake.window() == WINDOW_MAX


def test_the_window_grows_with_the_rate_and_is_none_when_shorter_than_the_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(wakeup.time, "monotonic", lambda: clock[0])
    wake = Wakeup(threading.Event())
    # (mean gap between NOTIFYs, window): 250 msg/s would wait 2 ms for a NOTIFY due in 4,
    # 333 msg/s waits 4 ms, 500 msg/s the longest.
    for gap, window in ((0.004, 0.0), (0.003, 0.004), (0.002, WINDOW_MAX)):
        for _ in range(100):  # the running mean settles on this gap
            clock[0] += gap
            wake.notify()
        assert wake.window() == pytest.approx(window)


def test_an_empty_claim_after_a_notify_holds_the_next_ones_back_and_rows_end_the_hold() -> None:
    wake = Wakeup(threading.Event(), hold_max=0.05)
    wake.found(0, notified=False)  # an empty claim at the poll: nobody raced us
    assert wake.hold_until == 0.0
    wake.found(0, notified=True)
    first = wake.hold_until - time.monotonic()
    assert HOLD_FIRST * 0.5 < first <= max(HOLD_FIRST, 2.0)
    for _ in range(20):  # losing again and again: longer, never past hold_max
        wake.found(0, notified=True)
    assert 0.0 < wake.hold_until - time.monotonic() <= 0.05
    wake.found(3, notified=True)
    assert wake.hold_until == 0.0


def test_a_notify_during_a_hold_still_wakes_the_waiter_once_and_a_set_at_once() -> None:
    stop = threading.Event()
    wake = Wakeup(stop, hold_max=0.05)
    wake.found(0, notified=True)
    wake.clear()
    wake.notify()  # the first NOTIFY of the hold wakes the loop, to sleep out the hold
    assert wake.wait(10.0)
    assert time.monotonic() >= wake.hold_until  # it claims only after the hold: deferred, not lost
    wake.clear()
    wake.set()
    assert wake.wait(10.0)
    wake.clear()
    assert not wake.wait(0.0)  # nothing pending: the poll interval ran out


def test_a_stop_ends_a_hold() -> None:
    stop = threading.Event()
    wake = Wakeup(stop, hold_max=60.0)
    wake.found(0, notified=True)
    for _ in range(10):
        wake.found(0, notified=True)  # a hold of a minute
    wake.clear()
    wake.notify()
    stop.set()
    assert wake.wait(120.0)
    assert time.monotonic() < wake.hold_until


def test_rows_found_after_a_hold_halve_it_and_a_dead_peers_rows_end_it_soon() -> None:
    stop = threading.Event()
    wake = Wakeup(stop, hold_max=0.04)
    for _ in range(10):
        wake.found(0, notified=True)  # the longest hold: 40 ms
    holds = []
    for _ in range(4):  # the peer is gone: every claim after a hold finds rows
        wake.clear()
        wake.notify()
        assert wake.wait(10.0)
        wake.found(1, notified=True)
        holds.append(round(max(0.0, wake.hold_until - time.monotonic()), 3))
    assert 0.015 < holds[0] <= 0.02  # halved, not ended
    assert holds[-1] == 0.0  # and soon no hold at all
    wake.found(0, notified=True)
    wake.found(2, notified=False)  # rows without a hold before: the hold ends at once
    assert wake.hold_until == 0.0


def test_only_a_notify_that_woke_the_loop_from_sleep_counts_as_one_another_replica_may_have_answered() -> None:
    wake = Wakeup(threading.Event(), hold_max=0.05)
    wake.notify()  # came while the loop was busy (mostly for a row its claim already took)
    assert wake.wait(10.0) and not wake.woken_from_sleep
    wake.clear()
    sleeping = threading.Event()

    class Bed(threading.Event):  # tells the notifier once the loop sleeps in it
        def wait(self, timeout: float | None = None) -> bool:
            sleeping.set()
            return super().wait(timeout)

    wake._event = Bed()
    notifier = threading.Thread(target=lambda: sleeping.wait(10.0) and wake.notify())
    notifier.start()
    assert wake.wait(10.0) and wake.woken_from_sleep
    notifier.join()
    wake.clear()
    assert not wake.wait(0.0) and not wake.woken_from_sleep  # the poll interval ran out
