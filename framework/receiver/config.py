"""Receiver tuning (``TXBOX_RECEIVER_*``) and the broker-level retry schedule."""

from __future__ import annotations

import re
from dataclasses import dataclass

from framework import dead_letters, names
from framework.errors import ConfigurationError
from framework.settings import FromEnv, Seconds, parse_duration, setting

DEFAULT_SCHEDULE = "10s*4,30s*4"  # 4 x 10 s, 4 x 30 s, then one final try
_STEP = re.compile(r"^\s*([0-9.]+\s*(?:ms|s|m|h)?)\s*(?:\*\s*(\d+))?\s*$")


def parse_schedule(text: str) -> tuple[int, ...]:
    """`10s*4,30s*4` → (10, 10, 10, 10, 30, 30, 30, 30): the delay before each retry.

    Delays are whole seconds because each one is a queue `delay:<n>s` whose TTL is fixed
    when the queue is declared; the final, flagged try reuses the last delay.
    """
    delays: list[int] = []
    for part in text.split(","):
        match = _STEP.match(part)
        if not match:
            raise ValueError(f"{part.strip()!r} is not `<delay>` or `<delay>*<count>`")
        seconds = parse_duration(match.group(1))
        if seconds < 1 or seconds != int(seconds):
            raise ValueError(f"{match.group(1).strip()!r}: delays are whole seconds ≥ 1s")
        delays += [int(seconds)] * int(match.group(2) or 1)
    if not delays:
        raise ValueError("the schedule is empty")
    return tuple(delays)


@dataclass(frozen=True, kw_only=True)
class ReceiverConfig(FromEnv):
    """How the receiver batches, what it accepts, and how it retries when PostgreSQL is down."""

    prefetch: int = setting("TXBOX_RECEIVER_PREFETCH", "1000", default=1000, help="unacked deliveries in flight")
    batch_size: int = setting(
        "TXBOX_RECEIVER_BATCH_SIZE", "500", default=500, help="deliveries stored per transaction at most"
    )
    batch_wait: Seconds = setting(
        "TXBOX_RECEIVER_BATCH_WAIT",
        "5ms",
        default=Seconds(0.005),
        help="how long a partial batch may wait for more deliveries while the previous batch is being written",
    )
    max_body_bytes: int = setting(
        "TXBOX_RECEIVER_MAX_BODY_BYTES", "1048576", default=1048576, help="larger bodies are rejected"
    )
    redelivery_limit: int = setting(
        "TXBOX_RECEIVER_REDELIVERY_LIMIT",
        "5",
        default=5,
        help="redeliveries of one message before it is dead-lettered",
    )
    retry_schedule: str = setting(
        "TXBOX_RECEIVER_RETRY_SCHEDULE",
        DEFAULT_SCHEDULE,
        default=DEFAULT_SCHEDULE,
        help="delays of the broker-level retries when a delivery cannot be stored",
    )
    db_connect_timeout: int = setting(
        "TXBOX_RECEIVER_DB_CONNECT_TIMEOUT", "3", default=3, help="seconds to wait for PostgreSQL"
    )
    max_unacked_bytes: int = setting(
        "TXBOX_RECEIVER_MAX_UNACKED_BYTES",
        "67108864",
        default=64 * 1024 * 1024,
        help="bodies held unacked at most, in bytes: beyond it the receiver stops reading from RabbitMQ",
    )
    trusted_users: str = setting(
        "TXBOX_RECEIVER_TRUSTED_USERS",
        "txbox-relay,txbox-receiver",
        default="",
        help="RabbitMQ users whose x-txbox-* headers count, besides the receiver's own (comma-separated)",
    )

    standby: bool = setting(
        "TXBOX_RECEIVER_STANDBY",
        "true",
        default=True,
        help="one receiver per inbox queue consumes, replicas stand by (false: all consume, order not kept)",
    )

    def __post_init__(self) -> None:
        try:
            parse_schedule(self.retry_schedule)
        except ValueError as exc:
            raise ConfigurationError(
                f"TXBOX_RECEIVER_RETRY_SCHEDULE={self.retry_schedule!r} is not valid ({exc}). "
                f"Example: TXBOX_RECEIVER_RETRY_SCHEDULE={DEFAULT_SCHEDULE}"
            ) from None
        for name, value, minimum in (
            ("TXBOX_RECEIVER_PREFETCH", self.prefetch, 1),
            ("TXBOX_RECEIVER_BATCH_SIZE", self.batch_size, 1),
            ("TXBOX_RECEIVER_MAX_BODY_BYTES", self.max_body_bytes, 1),
            ("TXBOX_RECEIVER_REDELIVERY_LIMIT", self.redelivery_limit, 0),
            ("TXBOX_RECEIVER_MAX_UNACKED_BYTES", self.max_unacked_bytes, 1),
        ):
            if value < minimum:
                raise ConfigurationError(f"{name}={value} must be ≥ {minimum}")
        if self.max_body_bytes > dead_letters.MAX_ACCEPTED_BODY:
            # A letter keeps an envelope whole up to its limit: a larger message could not be replayed.
            raise ConfigurationError(
                f"TXBOX_RECEIVER_MAX_BODY_BYTES={self.max_body_bytes} exceeds {dead_letters.MAX_ACCEPTED_BODY}, the "
                "largest message a dead letter keeps whole (replayable). Example: TXBOX_RECEIVER_MAX_BODY_BYTES=1048576"
            )
        if self.batch_size > self.prefetch:
            raise ConfigurationError(
                f"TXBOX_RECEIVER_BATCH_SIZE={self.batch_size} exceeds TXBOX_RECEIVER_PREFETCH={self.prefetch}: "
                "a batch could never fill. Example: TXBOX_RECEIVER_BATCH_SIZE=500 TXBOX_RECEIVER_PREFETCH=1000"
            )

    def trusted(self, own_user: str) -> frozenset[str]:
        """Broker users whose control headers count: the configured ones and always our own.

        Our own, because the attempt headers of our retry chain must count: without them
        a delivery would go round the delay queues for as long as the database is down.
        """
        users = {u.strip() for u in self.trusted_users.split(",") if u.strip()}
        return frozenset(users | {own_user}) - {""}

    @property
    def schedule(self) -> tuple[int, ...]:
        return parse_schedule(self.retry_schedule)

    @property
    def extra_delays(self) -> tuple[int, ...]:
        """Delays of the schedule without a queue in the standard topology (tests, tuning)."""
        return tuple(sorted(set(self.schedule) - set(names.DELAY_SECONDS)))
