"""txbox: exactly-once messaging over PostgreSQL and RabbitMQ (transactional outbox + inbox)."""

from framework.confirms import AsyncPublisher, Publisher
from framework.envelope import Message
from framework.errors import PermanentError, RetryableError, TxboxError, Unauthorized
from framework.handlers import CommandHandler, EventHandler, Handler
from framework.middleware import Middleware
from framework.outbox import Outbox
from framework.permissions import JwtSettings
from framework.service import Service
from framework.settings import Settings

__all__ = [
    "AsyncPublisher",
    "CommandHandler",
    "EventHandler",
    "Handler",
    "JwtSettings",
    "Message",
    "Middleware",
    "Outbox",
    "PermanentError",
    "Publisher",
    "RetryableError",
    "Service",
    "Settings",
    "TxboxError",
    "Unauthorized",
]
__version__ = "0.1.0"
