"""The outbox relay: the daemon `txbox publisher` runs (claim due outbox rows, publish them
with streamed confirms, record the outcomes), on one thread that owns its connection and
its :class:`framework.confirms.channel.ConfirmChannel` (docs/explanation/daemons.md, "One thread
per daemon").
"""

from framework.relay.config import RelayConfig
from framework.relay.daemon import Relay

__all__ = ["Relay", "RelayConfig"]
