"""Publishing with broker confirms: the channel every send of txbox goes out on, and the
direct-send clients built on it.

:class:`~framework.confirms.channel.ConfirmChannel` publishes and settles each send on
the broker's confirm, on a loop its owner runs: the publisher daemon's (:mod:`framework.relay`)
beside its database socket, or the loop thread of a :class:`Publisher`. :class:`Publisher`
is the direct-send client for application code (each send a future completed on the
confirm, docs/explanation/write.md, "Direct sends") and :class:`AsyncPublisher` its awaitable
face. The word "publisher" names the daemon; these two keep it as their public names
(docs/explanation/development.md, "One vocabulary").
"""

from framework.confirms.awaitable import AsyncPublisher
from framework.confirms.client import Outgoing, Publisher

__all__ = ["AsyncPublisher", "Outgoing", "Publisher"]
