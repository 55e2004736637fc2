"""Exponential backoff with jitter, for message retries and reconnects alike."""

from __future__ import annotations

import random


def backoff_seconds(
    attempt: int, *, base: float = 1.0, cap: float = 300.0, jitter: float = 0.5, rng: random.Random | None = None
) -> float:
    """Delay before retry number ``attempt`` (1-based): base·2^(attempt-1), capped, ±jitter.

    Jitter spreads retries of many messages that failed together (e.g. the database
    blinked) so they do not come back as one thundering herd.
    """
    delay = min(cap, base * (2 ** max(0, attempt - 1)))
    spread = delay * jitter
    jittered: float = delay + (rng or random).uniform(-spread, spread)
    return max(0.0, jittered)
