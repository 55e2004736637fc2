"""Bounds of direct sends (``TXBOX_PUBLISHER_MAX_UNCONFIRMED``, ``_OVERFLOW``, ``_OVERFLOW_TIMEOUT``).

docs/explanation/write.md, "Direct sends": a caller faster than the broker's confirms would
otherwise queue without limit in memory; the bound makes it wait or fail instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from framework.errors import ConfigurationError
from framework.settings import FromEnv, Seconds, setting

Overflow = Literal["block", "fail"]


@dataclass(frozen=True, kw_only=True)
class DirectSendConfig(FromEnv):
    """How many direct sends may wait for their confirm, and what ``publish`` does beyond that."""

    max_unconfirmed: int = setting(
        "TXBOX_PUBLISHER_MAX_UNCONFIRMED", "1000", default=1000, help="direct sends awaiting a confirm at most"
    )
    overflow: Overflow = setting(
        "TXBOX_PUBLISHER_OVERFLOW", "block", default="block", help="block: wait for room; fail: raise at once"
    )
    overflow_timeout: Seconds = setting(
        "TXBOX_PUBLISHER_OVERFLOW_TIMEOUT", "30s", default=Seconds(30), help="longest wait for room (block)"
    )

    def __post_init__(self) -> None:
        if self.max_unconfirmed < 1:
            raise ConfigurationError(
                f"max_unconfirmed must be at least 1, not {self.max_unconfirmed}. "
                "Example: TXBOX_PUBLISHER_MAX_UNCONFIRMED=1000"
            )
        if self.overflow not in ("block", "fail"):
            raise ConfigurationError(
                f"overflow must be 'block' or 'fail', not {self.overflow!r}. Example: TXBOX_PUBLISHER_OVERFLOW=block"
            )
        if self.overflow_timeout < 0:
            raise ConfigurationError(
                f"overflow_timeout must not be negative, not {self.overflow_timeout:g}. "
                "Example: TXBOX_PUBLISHER_OVERFLOW_TIMEOUT=30s"
            )
