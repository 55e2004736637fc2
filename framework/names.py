"""Every name txbox uses on the broker and in the database, derived in one place.

Exchange and queue names are fixed by DESIGN §5 and interoperate with Mosaic services,
so they must not be spelled anywhere else.
"""

from __future__ import annotations

import re

# Exchanges (DESIGN §5, fixed).
COMMAND_EXCHANGE = "command"
EVENT_EXCHANGE = "event"
DELAY_EXCHANGE = "delay"
RETRY_EXCHANGE = "retry"
DEAD_LETTER_EXCHANGE = "dead_letter"
EXCHANGES = (COMMAND_EXCHANGE, EVENT_EXCHANGE, DELAY_EXCHANGE, RETRY_EXCHANGE, DEAD_LETTER_EXCHANGE)

# Broker-level retry delays: queue `delay:<n>s`, bound to `delay` with `delay.<n>s`.
DELAY_SECONDS = (10, 30)

# Headers txbox adds to AMQP messages.
HEADER_ATTEMPT = "x-txbox-attempt"
HEADER_FINAL_ATTEMPT = "x-txbox-final-attempt"
HEADER_CORRELATION_ID = "x-correlation-id"
HEADER_DEAD_REASON = "x-txbox-reason"
HEADER_DEAD_ERROR = "x-txbox-error"
# Ordering lane chosen by the sender (default: aggregate_type:aggregate_id, sequential).
HEADER_SEGMENT = "x-txbox-segment"
HEADER_CONCURRENCY = "x-txbox-concurrency"
# The outbox row's priority (a smallint; the AMQP priority property holds only 0-255).
HEADER_PRIORITY = "x-txbox-priority"

# Tables of the framework (DESIGN §4, fixed); they live in the configured schema.
OUTBOX = "outbox"
INBOX = "inbox"
REDELIVERIES = "redeliveries"
DEAD_LETTERS = "dead_letters"
ALEMBIC_VERSION_TABLE = "txbox_alembic_version"

_SERVICE_ID = re.compile(r"^[a-z0-9][a-z0-9_-]*$")
_IDENTIFIER = re.compile(r"^[a-z_][a-z0-9_]*$")


def exchange_for(kind: str) -> str:
    """The exchange a message of ``kind`` ('command' or 'event') is published to."""
    return COMMAND_EXCHANGE if kind == "command" else EVENT_EXCHANGE


def inbox_queue(service: str) -> str:
    return f"{service}:inbox"


def dead_letter_queue(service: str) -> str:
    return f"{service}:dead_letter"


def dead_letter_routing_key(service: str) -> str:
    return f"{service}.dead_letter"


def retry_binding(service: str) -> str:
    """Routing-key pattern that brings a delayed retry back to the service's inbox queue."""
    return f"{inbox_queue(service)}.#"


def retry_routing_key(service: str, original_routing_key: str) -> str:
    """CC of a delayed retry: `<service>:inbox.<original routing key>`."""
    return f"{inbox_queue(service)}.{original_routing_key}"


def delay_queue(seconds: int) -> str:
    return f"delay:{seconds}s"


def delay_routing_key(seconds: int) -> str:
    return f"delay.{seconds}s"


def notify_channel(schema: str, table: str) -> str:
    """LISTEN/NOTIFY channel an insert into ``schema.table`` signals (a wake-up hint)."""
    return f"{schema}_{table}_insert"


def qualified(schema: str, table: str) -> str:
    """``schema.table`` for named SQL; both parts are validated identifiers."""
    return f"{schema}.{table}"


def valid_service_id(value: str) -> bool:
    return bool(_SERVICE_ID.match(value))


def valid_schema(value: str) -> bool:
    return bool(_IDENTIFIER.match(value))


def kebab_case(title: str) -> str:
    """`Example Service` → `example-service` (AsyncAPI `info.title` fallback, DESIGN §3)."""
    words = re.findall(r"[A-Za-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", title))
    return "-".join(w.lower() for w in words)


def pascal_case(key: str) -> str:
    """`example-create-command` → `ExampleCreateCommand` (message type fallback, DESIGN §3)."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_.\s]+", key) if part)
