"""The outbox relay: the daemon `txbox publisher` runs (claim due outbox rows, publish them
with streamed confirms, record the outcomes). It publishes through the direct-send client,
:class:`framework.publisher.Publisher`.
"""

from framework.relay.config import RelayConfig
from framework.relay.daemon import Relay

__all__ = ["Relay", "RelayConfig"]
