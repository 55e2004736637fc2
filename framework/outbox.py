"""Transactional outbox writes: one row in the caller's own transaction.

The row commits or rolls back with the business data it belongs to; the publisher
relays it afterwards. A row written at the top level of a transaction is sent with its
COMMIT (:mod:`framework.outbox_commit`), saving the round trip of an INSERT of its own.
Routing key, kind and aggregate type come from the contracts and the payload is
validated here, so a bad message raises before anything commits.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from psycopg import sql
from sqlalchemy import Connection, insert
from sqlalchemy.orm import Session

from framework import jsoncodec, names, outbox_commit, tables, tracing
from framework.contracts import MessageSpec, Registry
from framework.envelope import DEFAULT_MESSAGE_VERSION
from framework.errors import ContractError

if TYPE_CHECKING:
    from framework.envelope import Message

Concurrency = Literal["sequential", "parallel"]

_INSERT = insert(tables.outbox)


def default_segment(aggregate_type: str, aggregate_id: str) -> str:
    """Ordering lane of a message unless told otherwise: one per aggregate."""
    return f"{aggregate_type}:{aggregate_id}"


@dataclass(frozen=True, kw_only=True)
class OutboxRow:
    """A message on its way into txbox.outbox (column values)."""

    id: uuid.UUID
    message_type: str
    aggregate_type: str
    aggregate_id: str
    message_version: str
    kind: str
    routing_key: str
    payload: dict[str, Any]
    message_context: dict[str, Any]
    metadata: dict[str, Any]
    segment: str
    concurrency: str
    priority: int
    locked_until: datetime | None

    def params(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if out["locked_until"] is None:
            del out["locked_until"]  # server default: due now
        return out


class Outbox:
    """Writes messages into the outbox within ``session``'s current transaction.

    Get one from ``service.outbox(session)``; inside a handler the worker passes one in,
    which copies the incoming ``message_context`` into everything written.
    """

    def __init__(
        self,
        bind: Session | Connection,
        registry: Registry,
        *,
        schema: str = tables.SCHEMA,
        incoming: Message | None = None,
        defer_to: list[OutboxRow] | None = None,
    ) -> None:
        self._bind = bind
        self._registry = registry
        self._schema = schema
        self._options = {"schema_translate_map": tables.translate_map(schema)} if schema != tables.SCHEMA else {}
        self._incoming = incoming
        # The worker's batches collect rows here and insert them all before the commit
        # (:func:`insert_sql`), saving a round trip per message; validation still raises
        # in the handler that wrote the bad message.
        self._deferred = defer_to
        self.written: list[OutboxRow] = []

    def send_command(self, message_type: str, **kwargs: Any) -> uuid.UUID:
        """Send a command to the one service that accepts it. Returns the message id."""
        return self._write(self._spec(message_type, "command"), **kwargs)

    def publish_event(self, message_type: str, **kwargs: Any) -> uuid.UUID:
        """Publish an event to whoever subscribed. Returns the message id."""
        return self._write(self._spec(message_type, "event"), **kwargs)

    def _spec(self, message_type: str, kind: str) -> MessageSpec:
        spec = self._registry.get(message_type)
        if spec.kind != kind:
            verb = "send_command" if spec.kind == "command" else "publish_event"
            raise ContractError(
                f"{message_type} is {'a command' if spec.kind == 'command' else 'an event'}: use outbox.{verb}()"
            )
        return spec

    def build(
        self,
        spec: MessageSpec,
        *,
        aggregate_id: str | int,
        payload: Mapping[str, Any],
        message_context: Mapping[str, Any] | None = None,
        message_id: uuid.UUID | None = None,
        message_version: str = DEFAULT_MESSAGE_VERSION,
        auth_token: str | None = None,
        not_before: datetime | None = None,
        priority: int = 0,
        segment: str | None = None,
        concurrency: Concurrency = "sequential",
    ) -> OutboxRow:
        """Validate and shape one row without writing it (the worker batches these)."""
        payload = dict(payload)
        spec.validate(payload)
        if concurrency not in ("sequential", "parallel"):
            raise ValueError(f"concurrency must be 'sequential' or 'parallel', not {concurrency!r}")
        if not -32768 <= priority <= 32767:
            raise ValueError(f"priority must fit a smallint, not {priority}")
        if not_before is not None and not_before.tzinfo is None:
            raise ValueError("not_before must be timezone-aware (e.g. datetime.now(UTC) + timedelta(...))")
        if message_context is None:
            message_context = self._incoming.message_context if self._incoming is not None else {}
        aggregate = str(aggregate_id)
        metadata: dict[str, Any] = {}
        if auth_token is not None:
            metadata["auth_token"] = auth_token
        # The span current now is the message's parent (docs/architecture.md, "Tracing").
        trace = tracing.current()
        if trace is not None:
            metadata[names.METADATA_TRACE] = trace
        return OutboxRow(
            id=message_id or uuid.uuid4(),
            message_type=spec.message_type,
            aggregate_type=spec.aggregate_type,
            aggregate_id=aggregate,
            message_version=message_version,
            kind=spec.kind,
            routing_key=spec.routing_key,
            payload=payload,
            message_context=dict(message_context),
            metadata=metadata,
            segment=segment if segment is not None else default_segment(spec.aggregate_type, aggregate),
            concurrency=concurrency,
            priority=priority,
            locked_until=not_before.astimezone(UTC) if not_before is not None else None,
        )

    def flush(self) -> None:
        """Insert the rows this transaction holds for its COMMIT now.

        Rows written at the top level of a transaction reach the table with its COMMIT
        (:mod:`framework.outbox_commit`); call this first to read them back before that.
        """
        if self._deferred is None:
            outbox_commit.write_held(self._connection())

    def _connection(self) -> Connection:
        if isinstance(self._bind, Session):
            return self._bind.connection(bind_arguments={"clause": _INSERT})
        return self._bind

    def _write(self, spec: MessageSpec, **kwargs: Any) -> uuid.UUID:
        row = self.build(spec, **kwargs)
        if self._deferred is not None:
            self._deferred.append(row)
        else:
            conn = self._connection()
            if not outbox_commit.hold(conn, _table_text(self._schema), _json_values(row)):
                outbox_commit.write_held(conn)  # rows written earlier go first
                conn.execute(_INSERT, row.params(), execution_options=self._options)
        self.written.append(row)
        return row.id


_COLUMNS = tuple(f for f in OutboxRow.__dataclass_fields__ if f != "locked_until")


def insert_sql(schema: str) -> sql.Composed:
    """One outbox row for raw psycopg ``executemany`` (params: :func:`json_params`).

    One statement per row, not a multi-row INSERT: ``created_at`` (``clock_timestamp()``)
    orders a segment, and rows of one statement may share a microsecond.
    """
    return sql.SQL("INSERT INTO {t} ({cols}, locked_until) VALUES ({vals}, COALESCE({lu}, clock_timestamp()))").format(
        t=sql.Identifier(schema, tables.outbox.name),
        cols=sql.SQL(", ").join(map(sql.Identifier, _COLUMNS)),
        vals=sql.SQL(", ").join(map(sql.Placeholder, _COLUMNS)),
        lu=sql.SQL("{}::timestamptz").format(sql.Placeholder("locked_until")),
    )


@functools.cache
def _table_text(schema: str) -> str:
    return sql.Identifier(schema, tables.outbox.name).as_string()


def _json_values(row: OutboxRow) -> dict[str, Any]:
    # Column values, JSON columns serialized; without locked_until when due now (default).
    values = row.params()
    for key in ("payload", "message_context", "metadata"):
        values[key] = jsoncodec.dumps(values[key])
    return values


def json_params(row: OutboxRow) -> dict[str, Any]:
    """Row params with JSON columns serialized, for raw psycopg executemany on hot paths."""
    params = _json_values(row)
    params.setdefault("locked_until", None)  # insert_sql: NULL means due now
    return params
