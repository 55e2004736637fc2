"""The publisher: the outbox relay daemon and the confirm-tracking publisher it is built on.

``Relay(settings, registry, config).run()`` runs the daemon in-process (``txbox run``
embeds it); ``Publisher`` is the same streamed-confirm machinery for direct sends.
"""

from framework.publisher.confirms import Outgoing, Publisher
from framework.publisher.relay import Relay, RelayConfig

__all__ = ["Outgoing", "Publisher", "Relay", "RelayConfig"]
