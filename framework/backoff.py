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


def reconnect_seconds(failures: int) -> float:
    """Delay before a daemon's next try after ``failures`` lost connections in a row: half
    a second, then a second, each give or take a fifth.

    The cap is short on purpose: a daemon holds one or two connections, so trying every
    second costs the server nothing, while a long cap keeps a daemon away for up to
    that long after the server is back (benchmarks/README.md, "2026-11-24: fewer claims
    per message at a trickle; a worker hang and slow reconnects fixed").
    """
    return backoff_seconds(failures, base=0.5, cap=1.0, jitter=0.2)
