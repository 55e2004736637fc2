"""Relay tuning (``TXBOX_PUBLISHER_*``: the relay is the daemon `txbox publisher` runs)."""

from __future__ import annotations

from dataclasses import dataclass

from framework.errors import ConfigurationError
from framework.settings import FromEnv, Seconds, setting


@dataclass(frozen=True, kw_only=True)
class RelayConfig(FromEnv):
    """Tuning of the publisher daemon (``TXBOX_PUBLISHER_*``; CLI flags override)."""

    batch_size: int = setting("TXBOX_PUBLISHER_BATCH_SIZE", "1000", default=1000, help="rows per claim")
    max_in_flight: int = setting(
        "TXBOX_PUBLISHER_MAX_IN_FLIGHT", "5000", default=5000, help="unconfirmed messages at most"
    )
    lease: Seconds = setting(
        "TXBOX_PUBLISHER_LEASE", "60s", default=Seconds(60), help="how long a claim holds rows before others may"
    )
    confirm_timeout: Seconds = setting(
        "TXBOX_PUBLISHER_CONFIRM_TIMEOUT", "30s", default=Seconds(30), help="a publish not confirmed by then failed"
    )
    poll_interval: Seconds = setting(
        "TXBOX_PUBLISHER_POLL_INTERVAL", "1s", default=Seconds(1), help="fallback poll when no NOTIFY arrives"
    )
    drain_timeout: Seconds = setting(
        "TXBOX_PUBLISHER_DRAIN_TIMEOUT", "10s", default=Seconds(10), help="wait for confirms on shutdown"
    )
    max_attempts: int = setting("TXBOX_PUBLISHER_MAX_ATTEMPTS", "10", default=10, help="then dead-letter")
    retry_base: Seconds = setting("TXBOX_PUBLISHER_RETRY_BASE", "1s", default=Seconds(1), help="first backoff")
    retry_cap: Seconds = setting("TXBOX_PUBLISHER_RETRY_CAP", "5m", default=Seconds(300), help="longest backoff")
    metrics_interval: Seconds = setting(
        "TXBOX_PUBLISHER_METRICS_INTERVAL", "5s", default=Seconds(5), help="backlog gauge refresh"
    )

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.max_in_flight < 1 or self.max_attempts < 1:
            raise ConfigurationError(
                "TXBOX_PUBLISHER_BATCH_SIZE, TXBOX_PUBLISHER_MAX_IN_FLIGHT and TXBOX_PUBLISHER_MAX_ATTEMPTS "
                "must be at least 1. Example: TXBOX_PUBLISHER_BATCH_SIZE=1000"
            )
        if self.confirm_timeout >= self.lease:
            # A row whose confirm may still come must not be claimable by another publisher.
            raise ConfigurationError(
                f"TXBOX_PUBLISHER_CONFIRM_TIMEOUT ({self.confirm_timeout:g}s) must be shorter than "
                f"TXBOX_PUBLISHER_LEASE ({self.lease:g}s). Example: TXBOX_PUBLISHER_CONFIRM_TIMEOUT=30s "
                "TXBOX_PUBLISHER_LEASE=60s"
            )
