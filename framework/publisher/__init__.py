"""The direct-send client: :class:`Publisher` publishes with streamed confirms, each send a
future completed on the broker's confirm (docs/explanation/write.md, "Direct sends"). The outbox
relay daemon (:mod:`framework.relay`) is built on it; :class:`AsyncPublisher` is its awaitable
face for async code.
"""

from framework.publisher.awaitable import AsyncPublisher
from framework.publisher.confirms import Outgoing, Publisher

__all__ = ["AsyncPublisher", "Outgoing", "Publisher"]
