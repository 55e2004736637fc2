"""txbox: exactly-once messaging over PostgreSQL and RabbitMQ (transactional outbox + inbox)."""

from framework.envelope import Message
from framework.errors import PermanentError, RetryableError, TxboxError
from framework.handlers import CommandHandler, EventHandler, Handler
from framework.outbox import Outbox
from framework.publisher import AsyncPublisher, Publisher
from framework.service import Service
from framework.settings import Settings

__all__ = [
    "AsyncPublisher",
    "CommandHandler",
    "EventHandler",
    "Handler",
    "Message",
    "Outbox",
    "PermanentError",
    "Publisher",
    "RetryableError",
    "Service",
    "Settings",
    "TxboxError",
]
__version__ = "0.1.0"
