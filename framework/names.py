"""Every name txbox uses on the broker and in the database, derived in one place.

Exchange and queue names are a fixed public surface and interoperate with Mosaic services,
so they must not be spelled anywhere else.
"""

from __future__ import annotations

import hashlib
import re
import uuid

# Namespace of the ids of messages handlers send (framework/ids.py, sent_id): fixed for
# good, or a re-run after an upgrade would send its copies under new ids.
MESSAGE_ID_NAMESPACE = uuid.UUID("5b0f8a52-6a0e-5c3b-9f1e-7d1c2a4e8b63")

# Exchanges (fixed: shared with Mosaic services).
COMMAND_EXCHANGE = "command"
EVENT_EXCHANGE = "event"
DELAY_EXCHANGE = "delay"
RETRY_EXCHANGE = "retry"
DEAD_LETTER_EXCHANGE = "dead_letter"
EXCHANGES = (COMMAND_EXCHANGE, EVENT_EXCHANGE, DELAY_EXCHANGE, RETRY_EXCHANGE, DEAD_LETTER_EXCHANGE)

# Broker-level retry delays. Mosaic's libraries declare the shared queues `delay:10s` and
# `delay:30s` (bound to `delay` with `delay.10s`/`delay.30s`) with at-most-once
# dead-lettering; txbox parks its own retries in queues of its own beside them, which
# dead-letter at least once (docs/explanation/receive.md, "Mosaic compatibility").
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
# W3C trace context (docs/explanation/operations.md, "Tracing"); a foreign publisher's are joined too.
HEADER_TRACEPARENT = "traceparent"
HEADER_TRACESTATE = "tracestate"
# Key of the trace context in the outbox and inbox rows' ``metadata``.
METADATA_TRACE = "trace"
# A message's expiry (docs/explanation/receive.md, "Expiry and filters"): on the wire an ISO 8601
# UTC time in this header, which Mosaic's libraries ignore; in the outbox and inbox rows'
# ``metadata`` seconds since the Unix epoch under this key.
HEADER_EXPIRES_AT = "x-txbox-expires-at"
# The registry key of the tenant whose outbox a message left, put on by a relay serving
# tenants; a receiver serving tenants stores the message in that tenant's inbox
# (docs/how-to/tenants.md, "One set of daemons for every tenant").
HEADER_TENANT = "x-txbox-tenant"
MAX_ROUTING_KEY_CHARS = 255  # AMQP's shortstr
METADATA_EXPIRES_AT = "expires_at"
# Control headers only our own daemons may set: a receiver honours them from trusted broker
# users only (docs/explanation/receive.md, "Receiver intake").
CONTROL_HEADERS = (
    HEADER_SEGMENT,
    HEADER_CONCURRENCY,
    HEADER_PRIORITY,
    HEADER_ATTEMPT,
    HEADER_FINAL_ATTEMPT,
    HEADER_DEAD_REASON,
    HEADER_DEAD_ERROR,
    HEADER_TENANT,
)
# Key in a dead letter's ``headers`` column with the facts of its body (length, sha256,
# what was kept): not sent on the wire, but an x-txbox-* name a sender could forge.
BODY_FACTS = "x-txbox-body"

# Headers RabbitMQ adds when it dead-letters a message.
HEADER_DEATH = "x-death"
HEADER_FIRST_DEATH_QUEUE = "x-first-death-queue"
HEADER_FIRST_DEATH_REASON = "x-first-death-reason"
HEADER_FIRST_DEATH_EXCHANGE = "x-first-death-exchange"
HEADER_LAST_DEATH_QUEUE = "x-last-death-queue"
HEADER_LAST_DEATH_REASON = "x-last-death-reason"
HEADER_LAST_DEATH_EXCHANGE = "x-last-death-exchange"
# Headers RabbitMQ writes when it dead-letters a message. A sender's own (forged, or
# malformed: an ``x-death`` list holding a string) make RabbitMQ 3.10's dead-lettering
# crash when that message next dies, e.g. when a copy expires from a delay queue
# (docs/explanation/receive.md, "Receiver intake"): copies of a stranger's delivery drop them.
BROKER_DEATH_HEADERS = (
    HEADER_DEATH,
    HEADER_FIRST_DEATH_QUEUE,
    HEADER_FIRST_DEATH_REASON,
    HEADER_FIRST_DEATH_EXCHANGE,
    HEADER_LAST_DEATH_QUEUE,
    HEADER_LAST_DEATH_REASON,
    HEADER_LAST_DEATH_EXCHANGE,
)

# The AMQP basic properties but ``headers``, in the order of the AMQP specification: what
# the receiver and the collector keep of a delivery.
BASIC_PROPERTIES = (
    "content_type",
    "content_encoding",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "type",
    "user_id",
    "app_id",
)
# What a copy the receiver publishes (retry, dead letter) takes from its delivery: not
# delivery_mode (a copy is always persistent), expiration (the copy would expire on its
# way) or user_id (RabbitMQ checks it against the publishing connection: ours is set).
REPUBLISHED_PROPERTIES = tuple(p for p in BASIC_PROPERTIES if p not in ("delivery_mode", "expiration", "user_id"))

# Tables of the framework (fixed names); they live in the configured schema.
OUTBOX = "outbox"
INBOX = "inbox"
REDELIVERIES = "redeliveries"
DEAD_LETTERS = "dead_letters"
DAEMON_HEARTBEATS = "daemon_heartbeats"
ARCHIVE_BATCHES = "archive_batches"
ALEMBIC_VERSION_TABLE = "txbox_alembic_version"

# The tenant registry's control tables (docs/explanation/operations.md, "Tenants: the registry"):
# in the control database, in TXBOX_TENANTS_SCHEMA, with a history of their own.
TENANTS = "tenants"
TENANTS_VERSION = "tenants_version"
TENANTS_ALEMBIC_VERSION_TABLE = "txbox_tenants_alembic_version"
DEFAULT_TENANTS_SCHEMA = "txbox_control"
MAX_TENANT_KEY_CHARS = 63
MAX_SCHEMA_CHARS = 63  # PostgreSQL's NAMEDATALEN - 1
# A tenant key: one lower-case word, usable as a metric label, a log field and a flag.
_TENANT_KEY = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")

# Whole names only: checked with fullmatch (``$`` would also match before a final newline).
_SERVICE_ID = re.compile(r"[a-z0-9][a-z0-9_-]*")
_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")


def exchange_for(kind: str) -> str:
    """The exchange a message of ``kind`` ('command' or 'event') is published to."""
    return COMMAND_EXCHANGE if kind == "command" else EVENT_EXCHANGE


MOSAIC_INBOX = "inbox"  # a channel's `bindings.amqp.queue.name` when it names none, and Mosaic's usual one


def inbox_queue(service: str) -> str:
    """The one queue a txbox service receives every command and event in: `<service>:inbox`."""
    return mosaic_queue(service, MOSAIC_INBOX)


def mosaic_queue(service: str, queue: str) -> str:
    """The queue Mosaic's message bus consumes a channel from: `<service>:<bindings.amqp.queue.name>`.

    ``service`` is the receiving service (the consumer of a command, the subscriber of an
    event); ``queue`` the channel's binding name (docs/explanation/receive.md, "Mosaic compatibility").
    """
    return f"{service}:{queue}"


DEFAULT_SCHEMA = "txbox"  # the framework's tables' schema when TXBOX_SCHEMA is not set


def receiver_lock_key(service: str) -> int:
    """The PostgreSQL advisory lock key held by the one consuming receiver of ``service``.

    A signed 64-bit number (``pg_try_advisory_lock(bigint)``) derived from the inbox
    queue's name, so every replica of the receiver computes the same key
    (docs/explanation/operations.md, "Replicas of every daemon").
    """
    return _lock_key(f"txbox receiver {inbox_queue(service)}")


def pruner_lock_key(service: str, table: str, schema: str = DEFAULT_SCHEMA) -> int:
    """The advisory lock key held by the one pruner of ``service``'s ``table`` in ``schema`` during a pass.

    Derived like :func:`receiver_lock_key`, so every replica of the publisher (outbox) or
    the worker (inbox) computes the same key and only one of them prunes at a time
    (docs/explanation/operations.md, "Retention"). The schema is part of the key but for
    the default one (whose key is the one txbox always had): the tenants kept as schemas
    of one database each prune their own tables, none waiting for another's pass.
    """
    where = "" if schema == DEFAULT_SCHEMA else f" {schema}"
    return _lock_key(f"txbox pruner {service}{where} {table}")


def archive_lock_key(service: str) -> int:
    """The advisory lock key one `txbox archive` run of ``service`` holds (signed 64-bit)."""
    return _lock_key(f"txbox archive {service}")


def _lock_key(text: str) -> int:
    """A signed 64-bit advisory lock key (``pg_try_advisory_lock(bigint)``) from ``text``:
    the same in every process, whatever its hash seed."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big", signed=True)


INBOX_QUEUE_PATTERN = "^[^:]+:inbox$"  # every service's inbox queue (a policy's pattern)
INBOX_LIMIT_POLICY = "txbox-inbox-limit"  # the policy giving them the delivery limit (framework.delivery_limit)


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
    """The queue txbox parks a delayed retry in: `delay:<n>s:at-least-once`.

    Not Mosaic's `delay:<n>s`: a queue's arguments are fixed at declaration and Mosaic
    declares that one without at-least-once dead-lettering, which txbox needs.
    """
    return f"{mosaic_delay_queue(seconds)}:at-least-once"


def delay_routing_key(seconds: int) -> str:
    """Routing key (on `delay`) of :func:`delay_queue`: `delay.<n>s.at-least-once`."""
    return f"{mosaic_delay_routing_key(seconds)}.at-least-once"


def mosaic_delay_queue(seconds: int) -> str:
    """Mosaic's shared delay queue `delay:<n>s` (declared exactly as Mosaic does)."""
    return f"delay:{seconds}s"


def mosaic_delay_routing_key(seconds: int) -> str:
    return f"delay.{seconds}s"


def wire_routing_key(owner: str, channel: str) -> str:
    """The routing key of a message on the wire, as Mosaic's message bus builds it.

    ``owner`` is the id of the service whose contract declares the channel: the consumer
    of a command, the producer of an event (`ax-service-example` + `example.create` →
    `ax-service-example.example.create`).
    """
    return f"{owner}.{channel}"


TENANT_PLACEHOLDER = "*"  # Mosaic's, in a multi-tenant message's channel: `*.*.entity.action`
MAX_TENANT_ID_CHARS = 64
_TENANT_WORD = re.compile(r"[A-Za-z0-9_-]{1,64}")


def tenant_routing_key(pattern: str, tenant_id: str, environment_id: str) -> str:
    """The routing key of a multi-tenant message for one tenant and environment.

    As Mosaic's ``getEnvironmentRoutingKey``: the first placeholder becomes the tenant id,
    the second the environment id. Each must be one routing-key word (letters, digits,
    ``_``, ``-``; a UUID is one), else ValueError names it.
    """
    for what, value in (("tenant_id", tenant_id), ("environment_id", environment_id)):
        if not isinstance(value, str) or not _TENANT_WORD.fullmatch(value):
            raise ValueError(
                f"{what} must be one routing-key word of at most {MAX_TENANT_ID_CHARS} letters, digits, '_' "
                f"or '-' (a UUID is one), not {str(value)[:80]!r}"
            )
    return pattern.replace(TENANT_PLACEHOLDER, tenant_id, 1).replace(TENANT_PLACEHOLDER, environment_id, 1)


def placeholders_match(pattern: str, key: str) -> bool:
    """Whether ``key`` is ``pattern`` with each placeholder replaced by one word (linear in the key)."""
    words, parts = key.split("."), pattern.split(".")
    return len(words) == len(parts) and all(
        _TENANT_WORD.fullmatch(word) is not None if part == TENANT_PLACEHOLDER else part == word
        for part, word in zip(parts, words, strict=True)
    )


def tenancy(pattern: str, key: str) -> tuple[str, str] | None:
    """(tenant id, environment id) that ``key`` puts in ``pattern``'s placeholders, or None."""
    if not placeholders_match(pattern, key):
        return None
    found = [w for p, w in zip(pattern.split("."), key.split("."), strict=True) if p == TENANT_PLACEHOLDER]
    return (found[0], found[1]) if len(found) == 2 else None


def valid_tenant_key(value: str) -> bool:
    """A registry's tenant key: 1-63 lower-case letters, digits, ``_`` or ``-``, starting with a letter or digit."""
    return _TENANT_KEY.fullmatch(value) is not None


def valid_mosaic_id(value: str) -> bool:
    """A Mosaic tenant or environment id: one routing-key word (what :func:`tenant_routing_key` accepts)."""
    return _TENANT_WORD.fullmatch(value) is not None


def tenants_channel(schema: str) -> str:
    """The channel a change of ``schema``'s tenant registry table NOTIFYs (its new version)."""
    return f"{schema}_{TENANTS}_changed"


def notify_channel(schema: str, table: str) -> str:
    """LISTEN/NOTIFY channel an insert into ``schema.table`` signals (a wake-up hint)."""
    return f"{schema}_{table}_insert"


#: The transaction-local setting that, set to ``off``, leaves the inbox's insert NOTIFY out:
#: the receiver of `txbox run` sets it when it hands the rows to its own worker
#: (docs/explanation/daemons.md, "The hand-off in one process"; migration 0011).
QUIET_NOTIFY_SETTING = "txbox.notify"


def inbox_help_channel(schema: str) -> str:
    """The channel the worker replica that listens on the inbox's inserts NOTIFYs when its
    claim came back full, waking the other replicas of ``schema``'s workers
    (docs/explanation/daemons.md, "Wake-ups")."""
    return f"{schema}_{INBOX}_help"


def worker_listener_lock_key(schema: str) -> int:
    """The advisory lock key held, on its LISTEN connection, by the one worker replica that
    listens on ``schema``'s inbox inserts (signed 64-bit). Keyed by the schema: the replicas
    that claim from one inbox are those of one service (docs/explanation/operations.md, "Replicas of
    every daemon")."""
    return _lock_key(f"txbox worker listener {schema}")


def qualified(schema: str, table: str) -> str:
    """``schema.table`` for named SQL; both parts are validated identifiers."""
    return f"{schema}.{table}"


def valid_service_id(value: str) -> bool:
    return _SERVICE_ID.fullmatch(value) is not None


def valid_schema(value: str) -> bool:
    return _IDENTIFIER.fullmatch(value) is not None


def kebab_case(title: str) -> str:
    """`Example Service` → `example-service` (AsyncAPI `info.title` fallback)."""
    words = re.findall(r"[A-Za-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", title))
    return "-".join(w.lower() for w in words)


def pascal_case(key: str) -> str:
    """`example-create-command` → `ExampleCreateCommand` (the alias of a message type)."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[-_.\s]+", key) if part)


_KIND_SUFFIX = re.compile(r"(?<=.)(Command|Event)$")


def mosaic_message_type(schema_title: str) -> str:
    """The message type Mosaic's code generator derives from a payload schema's ``title``.

    PascalCase of the title without its trailing command/event word:
    `create_widget_command` → `CreateWidget`, `entity_publish_failed_event` →
    `EntityPublishFailed`. Empty when the title has no word.
    """
    return _KIND_SUFFIX.sub("", pascal_case(schema_title))


# --- names a contract gives (docs/explanation/receive.md, "Contracts are outside input") ---------
# They reach routing keys, queue names, metric labels, SQL rows and generated Python, so
# each is checked against one of these at load (fullmatch, after a length check: the
# patterns never see more than MAX_NAME characters).
MAX_NAME = 100
MAX_PROPERTY_NAME = 128
_MESSAGE_TYPE = re.compile(r"[A-Z][A-Za-z0-9_]*")
_AGGREGATE_TYPE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
# A channel's `bindings.amqp.queue.name` (Mosaic's per-channel queues are `entity:action`).
_QUEUE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]*")
_VERSION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
# Names the generated module imports, or Python's constants: a class of that name breaks it.
RESERVED_MESSAGE_TYPES = frozenset({"Any", "Literal", "NotRequired", "TypedDict", "None", "True", "False"})


def message_type_problem(value: object) -> str | None:
    """Why ``value`` cannot be a message type (it becomes a Python class name), or None."""
    if not isinstance(value, str) or not value:
        return f"{str(value)[:60]!r} is not a message type: give a PascalCase name"
    if len(value) > MAX_NAME or not _MESSAGE_TYPE.fullmatch(value):
        return (
            f"{value[:60]!r} is not a message type: PascalCase, an upper-case ASCII letter then letters, "
            f"digits or '_', at most {MAX_NAME} characters (it becomes a Python class and a metric label)"
        )
    if value in RESERVED_MESSAGE_TYPES:
        return f"{value!r} is reserved (the generated module uses that name); pick another message type"
    return None


def service_id_problem(value: str) -> str | None:
    """Why ``value`` cannot be a service id, or None."""
    if len(value) > MAX_NAME or not valid_service_id(value):
        return (
            f"{value[:60]!r} is not a service id: lower-case letters, digits, '-' or '_', at most {MAX_NAME} "
            "characters (it is the first word of every routing key of the service)"
        )
    return None


def aggregate_type_problem(value: str) -> str | None:
    """Why ``value`` cannot be an aggregate type, or None."""
    if len(value) > MAX_NAME or not _AGGREGATE_TYPE.fullmatch(value):
        return (
            f"{value[:60]!r} is not an aggregate type: ASCII letters, digits, '_', '.' or '-', "
            f"at most {MAX_NAME} characters"
        )
    return None


def queue_name_problem(value: object) -> str | None:
    """Why ``value`` cannot be a channel's `bindings.amqp.queue.name`, or None."""
    if not isinstance(value, str) or len(value) > MAX_NAME or not _QUEUE_NAME.fullmatch(value):
        return (
            f"{str(value)[:60]!r} is not a queue name: ASCII letters, digits, '_', '.', ':' or '-', "
            f"at most {MAX_NAME} characters (e.g. inbox)"
        )
    return None


def version_problem(value: str) -> str | None:
    """Why ``value`` cannot be a message version (`x-message-version`), or None."""
    if len(value) > MAX_NAME or not _VERSION.fullmatch(value):
        return (
            f"{value[:60]!r} is not a version: ASCII letters, digits, '.', '_', '+' or '-' "
            f'(e.g. "2" or "1.1"), at most {MAX_NAME} characters'
        )
    return None


def property_name_problem(value: object) -> str | None:
    """Why ``value`` cannot name a payload property, or None.

    Any printable text (JSON payloads use `order-id`, `@type`...), without control
    characters, line separators or invisible format characters: it is shown in errors
    and written into generated code, escaped.
    """
    if not isinstance(value, str) or not value:
        return f"{str(value)[:60]!r} is not a property name: give a non-empty string"
    if len(value) > MAX_PROPERTY_NAME:
        return f"{value[:60]!r}... is longer than {MAX_PROPERTY_NAME} characters"
    if not value.isprintable():
        return f"{value!r} holds a control, separator or invisible character; property names are printable text"
    return None


def identifier_part(text: str) -> str:
    """``text`` in PascalCase with every character a Python identifier cannot hold dropped.

    For the names of nested classes the generator derives from property keys.
    """
    return "".join(c for c in pascal_case(text[:MAX_PROPERTY_NAME]) if c.isascii() and (c.isalnum() or c == "_"))
