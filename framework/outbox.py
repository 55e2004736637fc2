"""Transactional outbox writes: one row in the caller's own transaction.

The row commits or rolls back with the business data it belongs to; the publisher
relays it afterwards. A row written at the top level of a transaction is sent with its
COMMIT (:mod:`framework.outbox_commit`), saving the round trip of an INSERT of its own;
with ``TXBOX_OUTBOX_COMMIT_PIPELINE=false``, or where the pipeline cannot be used, it is
a plain INSERT at once. Both are the one INSERT of :mod:`framework.sql.outbox`.
An ``AsyncSession`` or ``AsyncConnection`` is written to without I/O: its rows wait for
the commit (:mod:`framework.outbox_async`).
Routing key, kind and aggregate type come from the contracts and the payload is
validated here, so a bad message raises before anything commits.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Literal

from sqlalchemy import Connection, event
from sqlalchemy.orm import Session, SessionTransaction

from framework import expiry, ids, names, outbox_async, outbox_commit, tables, tracing
from framework.contracts import MessageSpec, Registry
from framework.envelope import DEFAULT_MESSAGE_VERSION
from framework.errors import ContractError
from framework.sql.outbox import OutboxRow

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    from framework.envelope import Message

Concurrency = Literal["sequential", "parallel"]


def default_segment(aggregate_type: str, aggregate_id: str) -> str:
    """Ordering lane of a message unless told otherwise: one per aggregate."""
    return f"{aggregate_type}:{aggregate_id}"


class Outbox:
    """Writes messages into the outbox within ``session``'s current transaction.

    Get one from ``service.outbox(session)``; inside a handler the worker passes one in,
    which copies the incoming ``message_context`` and ``auth_token`` into everything written
    and, given ``sent_by`` (service name, handler name), derives each message's id from the
    incoming message's id, the handler and the send's ordinal among this run's messages of
    its type (:func:`framework.ids.sent_id`); an explicit ``message_id=`` wins and takes no
    ordinal. Sends inside a savepoint (``begin_nested()``) that is rolled back are undone
    here too: their rows leave ``written`` (and the worker's batch) and their ordinals are
    given back, so the ids of what a run keeps do not depend on the savepoints that failed
    on the way (docs/explanation/write.md, "Ids of the messages a handler sends").
    """

    def __init__(
        self,
        bind: Session | Connection | AsyncSession | AsyncConnection,
        registry: Registry,
        *,
        schema: str = tables.SCHEMA,
        incoming: Message | None = None,
        defer_to: list[OutboxRow] | None = None,
        commit_pipeline: bool = True,
        sent_by: tuple[str, str] | None = None,
    ) -> None:
        # An asyncio bind is written to through the blocking object inside it, without I/O.
        inner = None if isinstance(bind, Session | Connection) else outbox_async.sync_bind(bind)
        self._asyncio = inner is not None
        self._bind: Session | Connection = inner or bind  # type: ignore[assignment]
        self._registry = registry
        self._schema = schema
        self._incoming = incoming
        # TXBOX_OUTBOX_COMMIT_PIPELINE: off, every row is a plain INSERT of its own at once.
        self._pipeline = commit_pipeline
        # The worker's batches collect rows here and insert them all before the commit
        # (:func:`framework.sql.outbox.insert`), saving a round trip per message; validation still raises
        # in the handler that wrote the bad message.
        self._deferred = defer_to
        self.written: list[OutboxRow] = []
        # The worker names the handler run (service, handler name): its sends get ids derived
        # from the incoming message (framework/ids.py, sent_id); anyone else, random ones.
        self._sent_by = sent_by if incoming is not None else None
        self._ordinals: dict[str, int] = {}
        # Savepoints begun since this outbox was made, in order: what to go back to when
        # one is rolled back (lengths of the batch's rows and of `written`, the ordinals).
        self._marks: dict[SessionTransaction, tuple[int, int, dict[str, int]]] = {}
        if self._sent_by is not None or defer_to is not None:
            _follow_savepoints(self._bind, self)

    def _savepoint_begun(self, savepoint: SessionTransaction) -> None:
        self._marks[savepoint] = (len(self._deferred or ()), len(self.written), dict(self._ordinals))

    def _savepoint_ended(self, savepoint: SessionTransaction, *, rolled_back: bool) -> None:
        if savepoint not in self._marks:
            return  # begun before this outbox was made, or ended already
        begun = list(self._marks)
        deferred, written, ordinals = self._marks[savepoint]
        for ended in begun[begun.index(savepoint) :]:  # it, and any savepoint begun inside it
            del self._marks[ended]
        if rolled_back:
            if self._deferred is not None:
                del self._deferred[deferred:]
            del self.written[written:]
            self._ordinals = ordinals

    @property
    def registry(self) -> Registry:
        """The contracts this outbox writes by (the worker reads message versions from it)."""
        return self._registry

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
        message_version: str | None = None,
        auth_token: str | None = None,
        not_before: datetime | None = None,
        priority: int = 0,
        segment: str | None = None,
        concurrency: Concurrency = "sequential",
        ttl: timedelta | float | None = None,
        tenant_id: str | None = None,
        environment_id: str | None = None,
    ) -> OutboxRow:
        """Validate and shape one row without writing it (the worker batches these).

        ``message_version`` defaults to the contract's current version of the message
        (``x-message-version``), else 1.0; the payload is validated against the schema of
        the version it is written as (docs/explanation/receive.md, "Message versions").

        ``ttl`` (a timedelta or seconds): the message expires that long after this call, on
        this process's clock; once expired it is dead-lettered as ``expired`` wherever it
        waits instead of being handled (docs/explanation/receive.md, "Expiry and filters").

        ``tenant_id`` and ``environment_id`` fill a multi-tenant message's routing key;
        inside a handler they default to the ones its message came with
        (docs/explanation/receive.md, "Multi-tenant routing keys"). A multi-tenant message without
        them, or another message with them, raises ContractError.
        """
        payload = dict(payload)
        routing_key = self._routing_key(spec, tenant_id, environment_id)
        if message_version is None:
            message_version = spec.version or DEFAULT_MESSAGE_VERSION
        spec.validate(payload, message_version)
        if concurrency not in ("sequential", "parallel"):
            raise ValueError(f"concurrency must be 'sequential' or 'parallel', not {concurrency!r}")
        if not -32768 <= priority <= 32767:
            raise ValueError(f"priority must fit a smallint, not {priority}")
        if not_before is not None and not_before.tzinfo is None:
            raise ValueError("not_before must be timezone-aware (e.g. datetime.now(UTC) + timedelta(...))")
        if message_context is None:
            message_context = self._incoming.message_context if self._incoming is not None else {}
        if auth_token is None and self._incoming is not None:
            # A handler's messages act for whoever sent its message; auth_token="" sends none
            # (docs/explanation/handle.md, "Handler middleware and the permission guard").
            auth_token = self._incoming.auth_token
        aggregate = str(aggregate_id)
        metadata: dict[str, Any] = {}
        if ttl is not None:
            expires_at = expiry.deadline(ttl)
            if not_before is not None and not_before.timestamp() >= expires_at:
                raise ValueError("not_before is at or after the message's expiry (ttl): it could never be sent")
            metadata[names.METADATA_EXPIRES_AT] = expires_at
        if auth_token:
            metadata["auth_token"] = auth_token
        # The span current now is the message's parent (docs/explanation/operations.md, "Tracing").
        trace = tracing.current()
        if trace is not None:
            metadata[names.METADATA_TRACE] = trace
        return OutboxRow(
            id=message_id or ids.message_id(),
            message_type=spec.message_type,
            aggregate_type=spec.aggregate_type,
            aggregate_id=aggregate,
            message_version=message_version,
            kind=spec.kind,
            routing_key=routing_key,
            payload=payload,
            message_context=dict(message_context),
            metadata=metadata,
            segment=segment if segment is not None else default_segment(spec.aggregate_type, aggregate),
            concurrency=concurrency,
            priority=priority,
            locked_until=not_before.astimezone(UTC) if not_before is not None else None,
        )

    def _routing_key(self, spec: MessageSpec, tenant_id: str | None, environment_id: str | None) -> str:
        """The routing key to send ``spec`` with: its own, or a multi-tenant one's filled in."""
        if not spec.tenant_scoped:
            if tenant_id is not None or environment_id is not None:
                raise ContractError(
                    f"{spec.message_type} is not a multi-tenant message ({spec.routing_key}): "
                    "send it without tenant_id and environment_id"
                )
            return spec.routing_key
        if tenant_id is None and environment_id is None:
            tenant_id, environment_id = self._incoming_tenancy()
        if tenant_id is None or environment_id is None:
            raise ContractError(
                f"{spec.message_type} is a multi-tenant message ({spec.routing_key}): give tenant_id= and "
                "environment_id=, or send it from a handler of a message that names them"
            )
        try:
            return names.tenant_routing_key(spec.routing_key, tenant_id, environment_id)
        except ValueError as exc:
            raise ContractError(f"{spec.message_type}: {exc}") from None

    def _incoming_tenancy(self) -> tuple[str | None, str | None]:
        """The tenant and environment of the message being handled: from its routing key
        when it is a multi-tenant message, else from ``tenant_id`` and ``environment_id``
        in its ``message_context``; (None, None) outside a handler."""
        incoming = self._incoming
        if incoming is None:
            return None, None
        if incoming.routing_key is not None and incoming.message_type in self._registry.messages:
            found = names.tenancy(self._registry.messages[incoming.message_type].routing_key, incoming.routing_key)
            if found is not None:
                return found
        context = incoming.message_context
        tenant, environment = context.get("tenant_id"), context.get("environment_id")
        if isinstance(tenant, str) and isinstance(environment, str):
            return tenant, environment
        return None, None

    def flush(self) -> None:
        """Insert the rows this transaction holds for its COMMIT now.

        Rows written at the top level of a transaction reach the table with its COMMIT
        (:mod:`framework.outbox_commit`); call this first to read them back before that.
        """
        if self._asyncio:
            raise TypeError(
                "an AsyncSession's or AsyncConnection's outbox rows reach the table with its commit; "
                'read them back after it (docs/explanation/write.md, "Async outbox")'
            )
        if self._deferred is None:
            outbox_commit.write_held(self._connection())

    def _connection(self) -> Connection:
        if isinstance(self._bind, Session):
            return self._bind.connection(bind_arguments={"clause": outbox_async.BIND_CLAUSE})
        return self._bind

    def _write(self, spec: MessageSpec, **kwargs: Any) -> uuid.UUID:
        if self._sent_by is not None and kwargs.get("message_id") is None:
            assert self._incoming is not None
            ordinal = self._ordinals.get(spec.message_type, 0)
            derived = ids.sent_id(self._incoming.message_id, *self._sent_by, spec.message_type, ordinal)
            row = self.build(spec, **{**kwargs, "message_id": derived})
            self._ordinals[spec.message_type] = ordinal + 1
        else:
            row = self.build(spec, **kwargs)
        if self._deferred is not None:
            self._deferred.append(row)
        elif not self._asyncio:
            outbox_commit.write(self._connection(), self._schema, row.params(), pipeline=self._pipeline)
        elif isinstance(self._bind, Session):
            outbox_async.hold_in_session(self._bind, self._schema, row.params(), pipeline=self._pipeline)
        else:
            outbox_async.hold_in_connection(self._bind, self._schema, row.params(), pipeline=self._pipeline)
        self.written.append(row)
        return row.id


# The outbox of the handler run in each session, for the savepoint listeners below.
_following: weakref.WeakKeyDictionary[Session, weakref.ref[Outbox]] = weakref.WeakKeyDictionary()
_listening = False
_listen_lock = threading.Lock()


def _follow_savepoints(bind: Session | Connection, outbox: Outbox) -> None:
    """Tell ``outbox`` about the savepoints its session begins and ends from now on (a
    handler run's outbox: the worker and the testing kit give it the handler's session).
    Any outbox that followed the session before is done with it.

    Session events, not the connection's: a session emits a savepoint's SAVEPOINT only
    once a statement runs in it, and a send deferred for the batch's INSERT runs none.
    """
    if not isinstance(bind, Session):
        return
    global _listening
    if not _listening:
        with _listen_lock:
            if not _listening:
                # On the class, as the async outbox's are: a dictionary look-up per event
                # of a session no handler's outbox follows.
                event.listen(Session, "after_transaction_create", _on_transaction_create)
                event.listen(Session, "after_commit", _on_commit)
                event.listen(Session, "after_transaction_end", _on_transaction_end)
                _listening = True
    _following[bind] = weakref.ref(outbox)


def _outbox_of(session: Session) -> Outbox | None:
    ref = _following.get(session)
    return ref() if ref is not None else None


def _on_transaction_create(session: Session, transaction: SessionTransaction) -> None:
    if transaction.nested:
        outbox = _outbox_of(session)
        if outbox is not None:
            outbox._savepoint_begun(transaction)


def _on_commit(session: Session) -> None:
    nested = session.get_nested_transaction()  # a savepoint's release; None: the top level
    outbox = _outbox_of(session) if nested is not None else None
    if outbox is not None and nested is not None:
        outbox._savepoint_ended(nested, rolled_back=False)


def _on_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    if transaction.nested:
        outbox = _outbox_of(session)
        if outbox is not None:  # still marked after its end: it was rolled back
            outbox._savepoint_ended(transaction, rolled_back=True)
