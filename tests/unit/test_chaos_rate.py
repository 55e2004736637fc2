"""The chaos run's "rate between faults": what counts as recovery, what counts against the rate."""

from __future__ import annotations

import pytest

from txbox_tools.chaos.faults import Fault, Kind
from txbox_tools.chaos.run import SETTLE, Event, _rate_between_faults


def steady(start: float, stop: float, rate: float, handled: int, step: float = 0.5) -> list[tuple[float, int]]:
    samples = []
    t = start
    while t <= stop + 1e-9:
        samples.append((t, handled + round((t - start) * rate)))
        t += step
    return samples


def kill_at(t: float, seconds: float = 0.2) -> Event:
    return Event(Fault(Kind.KILL, "orders-worker", 0.5), started=t, ended=t + seconds)


def test_a_standstill_after_a_fault_is_its_recovery_not_load() -> None:
    """1,000/s, a kill at 10 s, nothing handled until 20 s (leases running out), then 1,000/s again."""
    before = steady(0, 10, 1000, 0)
    stalled = [(t, 10_000) for t in (10.5 + 0.5 * i for i in range(19))]  # 10.5 … 19.5
    after = steady(20, 30, 1000, 10_000)
    rate = _rate_between_faults(before + stalled + after, [kill_at(10)], end=30)
    assert rate == pytest.approx(1000, rel=0.01)


def test_a_standstill_with_no_fault_counts_against_the_rate() -> None:
    samples = steady(0, 10, 1000, 0) + [(t, 10_000) for t in (10.5, 11, 11.5, 12)] + steady(12.5, 22.5, 1000, 10_000)
    rate = _rate_between_faults(samples, [], end=22.5)
    assert rate == pytest.approx(20_000 / 22.5, rel=0.01)


def test_the_settle_time_is_recovery_even_when_progress_never_stopped() -> None:
    slow = steady(10, 10 + SETTLE, 100, 10_000)  # just after the fault: slow, not stopped
    samples = steady(0, 10, 1000, 0) + slow[1:] + steady(10 + SETTLE + 0.5, 20, 1000, slow[-1][1] + 500)
    rate = _rate_between_faults(samples, [kill_at(10, 0.0)], end=20)
    assert rate == pytest.approx(1000, rel=0.02)


def test_the_idle_tail_after_the_last_message_is_not_counted() -> None:
    samples = steady(0, 10, 1000, 0) + [(t, 10_000) for t in (10.5, 11, 20, 30)]
    assert _rate_between_faults(samples, [], end=30) == pytest.approx(1000, rel=0.01)


def test_a_crash_the_poison_causes_has_the_recovery_of_a_kill() -> None:
    """The poison is written at 5 s and kills its worker at 10 s: a kill, not load."""
    before = steady(0, 10, 1000, 0)
    stalled = [(t, 10_000) for t in (10.5 + 0.5 * i for i in range(19))]
    after = steady(20, 30, 1000, 10_000)
    poison = Event(Fault(Kind.POISON, "orders-worker", 0.3), started=5, ended=5)
    samples = before + stalled + after
    assert _rate_between_faults(samples, [poison], end=30) == pytest.approx(20_000 / 30, rel=0.01)
    assert _rate_between_faults(samples, [poison], end=30, crashes=[10.0]) == pytest.approx(1000, rel=0.01)
