"""Worker tuning (``TXBOX_WORKER_*``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from framework.errors import ConfigurationError
from framework.settings import FromEnv, Seconds, setting

SegmentPolicy = Literal["proceed", "park"]

LEASE_MARGIN = 2.0  # seconds kept between the hard stop of a handler and the end of its lease
GRACE = 1.0  # seconds a timed-out handler has to unwind (cancelled statement, cleanup) before the hard stop
MIN_RUN = 0.1  # seconds of lease a handler run needs at least, besides those two


@dataclass(frozen=True, kw_only=True)
class WorkerConfig(FromEnv):
    """Batching, leases, retries, poison detection and ordering of the inbox worker."""

    batch_size: int = setting("TXBOX_WORKER_BATCH_SIZE", "200", default=200, help="messages per transaction at most")
    lease: Seconds = setting(
        "TXBOX_WORKER_LEASE",
        "60s",
        default=Seconds(60),
        help="how long a claim holds a message; a crashed worker's messages come back after it",
    )
    timeout: Seconds = setting(
        "TXBOX_WORKER_TIMEOUT", "30s", default=Seconds(30), help="one handler run at most (handler.timeout overrides)"
    )
    max_attempts: int = setting(
        "TXBOX_WORKER_MAX_ATTEMPTS", "5", default=5, help="failed runs before a message is abandoned"
    )
    poison_threshold: int = setting(
        "TXBOX_WORKER_POISON_THRESHOLD",
        "3",
        default=3,
        help="unfinished runs (the process died in the handler) before a message is abandoned as poison",
    )
    backoff_base: Seconds = setting(
        "TXBOX_WORKER_BACKOFF_BASE", "1s", default=Seconds(1), help="delay before the first retry"
    )
    backoff_cap: Seconds = setting("TXBOX_WORKER_BACKOFF_CAP", "5m", default=Seconds(300), help="longest retry delay")
    backoff_jitter: float = setting(
        "TXBOX_WORKER_BACKOFF_JITTER", "0.5", default=0.5, help="± share of the delay, spreads retries"
    )
    poll_interval: Seconds = setting(
        "TXBOX_WORKER_POLL_INTERVAL", "1s", default=Seconds(1), help="look for due rows at least this often"
    )
    segment_policy: SegmentPolicy = setting(
        "TXBOX_WORKER_SEGMENT_POLICY",
        "proceed",
        default="proceed",
        help="after a message is abandoned, later messages of its segment `proceed` or stay `park`ed "
        "until its dead letter is replayed or discarded",
    )
    conflict_retries: int = setting(
        "TXBOX_WORKER_CONFLICT_RETRIES", "5", default=5, help="re-runs of a batch after serialization failures"
    )

    def __post_init__(self) -> None:
        for name, value, minimum in (
            ("TXBOX_WORKER_BATCH_SIZE", self.batch_size, 1),
            ("TXBOX_WORKER_MAX_ATTEMPTS", self.max_attempts, 1),
            ("TXBOX_WORKER_POISON_THRESHOLD", self.poison_threshold, 1),
        ):
            if value < minimum:
                raise ConfigurationError(f"{name}={value} must be ≥ {minimum}")
        if self.segment_policy not in ("proceed", "park"):
            raise ConfigurationError(
                f"TXBOX_WORKER_SEGMENT_POLICY={self.segment_policy!r} must be proceed or park. "
                "Example: TXBOX_WORKER_SEGMENT_POLICY=proceed"
            )
        shortest = LEASE_MARGIN + GRACE + MIN_RUN
        if self.lease <= shortest:
            raise ConfigurationError(
                f"TXBOX_WORKER_LEASE={self.lease:g}s is too short: a handler run needs {MIN_RUN:g}s of lease, "
                f"{GRACE:g}s to unwind after its timeout and {LEASE_MARGIN:g}s of margin, so more than "
                f"{shortest:g}s. Example: TXBOX_WORKER_LEASE=60s"
            )
        if not 0 < self.timeout < self.lease:
            raise ConfigurationError(
                f"TXBOX_WORKER_TIMEOUT={self.timeout:g}s must be positive and shorter than "
                f"TXBOX_WORKER_LEASE={self.lease:g}s: a handler may not outlive its lease. "
                "Example: TXBOX_WORKER_TIMEOUT=30s TXBOX_WORKER_LEASE=60s"
            )
