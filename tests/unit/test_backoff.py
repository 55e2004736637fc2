"""Exponential backoff with jitter (worker retries, publisher retries, reconnects)."""

from __future__ import annotations

import random

from framework.backoff import backoff_seconds


def test_doubles_per_attempt_then_caps() -> None:
    plain = [backoff_seconds(n, base=1, cap=20, jitter=0) for n in range(1, 8)]
    assert plain == [1, 2, 4, 8, 16, 20, 20]


def test_jitter_spreads_within_its_band() -> None:
    rng = random.Random(3)
    delays = [backoff_seconds(4, base=1, cap=300, jitter=0.5, rng=rng) for _ in range(2000)]
    assert min(delays) >= 4 and max(delays) <= 12  # 8 s ± 50 %
    assert len({round(d, 3) for d in delays}) > 1000, "retries that failed together must not return together"
    assert 7.5 < sum(delays) / len(delays) < 8.5


def test_never_negative() -> None:
    assert all(backoff_seconds(1, base=0.01, jitter=1.0) >= 0 for _ in range(1000))
