"""Deliver messages to handlers against a real database, with no broker and no daemons
(docs/explanation/development.md, "Testing handlers").

A message is admitted exactly as the receiver admits a delivery (:class:`Intake`: the
envelope, the message type, the service's contract, the payload schema), then its handler
runs as the worker runs it (:func:`guard.run_handler`, in one transaction with the commit
guard armed) and that transaction commits. What the handler sent is read from its outbox
and can be routed on to the handlers of the other registered services.
"""

from __future__ import annotations

import contextlib
import uuid
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import psycopg
from sqlalchemy.engine import Engine

from framework import db, jsoncodec
from framework.contracts import MessageSpec
from framework.dead_letters import DeadLetter
from framework.envelope import CONTENT_TYPE, DEFAULT_MESSAGE_VERSION, Message
from framework.errors import (
    AssemblyError,
    ContractError,
    DeliveryRejected,
    HandlerMisuse,
    Problem,
    TxboxError,
    UnknownMessageType,
)
from framework.outbox import Outbox
from framework.receiver.config import ReceiverConfig
from framework.receiver.intake import FILTERED, Delivery, Filtered, Intake
from framework.service import Service
from framework.sql.inbox import InboxRow
from framework.sql.outbox import OutboxRow
from framework.worker import guard
from framework.worker.config import WorkerConfig

#: Deliveries one :meth:`Harness.run_until_idle` makes at most: a saga that never goes
#: idle (handlers sending each other messages forever) fails instead of hanging.
MAX_DELIVERIES = 1000


@dataclass(frozen=True)
class Delivered:
    """One message handled: by which service, the message as the handler saw it, what it sent."""

    service: str
    message: Message
    sent: list[Message] = field(default_factory=list)

    def sent_types(self) -> list[str]:
        return [m.message_type for m in self.sent]


class _Target:
    """A registered service: its handlers, its database, and the receiver's intake for it."""

    def __init__(self, service: Service, database_url: str) -> None:
        self.service = service
        self.name = service.name
        self.schema = service.settings.schema
        self.engine: Engine = db.create_engine(database_url)
        self.intake = Intake(
            service.registry,
            service.name,
            max_body_bytes=ReceiverConfig.from_env().max_body_bytes,
            selectors=service.selectors,
        )


class Harness:
    """Handlers of one or more services, each against its own (test) database.

    ``Harness(service, database_url=...)``, then ``add(other, database_url=...)`` for each
    other service of a saga. :meth:`deliver` runs one message; :meth:`run_until_idle`
    routes everything sent since to the registered services that receive it, until
    nothing is left. Use it as a context manager (or call :meth:`close`) to release the
    database connections.
    """

    def __init__(self, service: Service | None = None, *, database_url: str | None = None) -> None:
        self._targets: dict[str, _Target] = {}
        #: Sent and not routed yet (in send order).
        self.pending: deque[Message] = deque()
        #: Sent messages that no registered service receives (an event nobody here subscribes to).
        self.unrouted: list[Message] = []
        #: Every delivery so far, in order.
        self.delivered: list[Delivered] = []
        self._max_attempts = WorkerConfig.from_env().max_attempts
        if service is not None:
            if database_url is None:
                raise TypeError("Harness(service, database_url=...): say which database (txbox_database(), say)")
            self.add(service, database_url=database_url)

    def add(self, service: Service, *, database_url: str) -> Harness:
        """Register ``service``'s handlers; its messages run against ``database_url`` — the
        test's database, given explicitly so that a test never writes into the service's own."""
        if service.name in self._targets:
            raise ValueError(f"service {service.name!r} is registered already")
        errors = [p for p in service.problems() if p.severity == "error"]
        if errors:
            raise AssemblyError(errors)
        self._targets[service.name] = _Target(service, database_url)
        return self

    @property
    def _first(self) -> _Target:
        if not self._targets:
            raise ValueError("no service registered: Harness(service, database_url=...) or harness.add(...)")
        return next(iter(self._targets.values()))

    def message(
        self,
        message_type: str,
        *,
        aggregate_id: str | int,
        payload: Mapping[str, Any],
        message_context: Mapping[str, Any] | None = None,
        message_id: uuid.UUID | None = None,
        message_version: str | None = None,
        auth_token: str | None = None,
    ) -> Message:
        """A message of ``message_type`` with the routing facts its contract gives it (not yet validated).

        ``message_version`` defaults to the contract's current version of the type.
        """
        spec = self._spec(message_type)
        if message_version is None:
            message_version = spec.version or DEFAULT_MESSAGE_VERSION
        return Message(
            message_id=message_id or uuid.uuid4(),
            message_type=spec.message_type,
            aggregate_type=spec.aggregate_type,
            aggregate_id=str(aggregate_id),
            payload=dict(payload),
            message_context=dict(message_context or {}),
            message_version=message_version,
            auth_token=auth_token,
            routing_key=spec.routing_key,
        )

    def deliver(
        self,
        message: Message | str,
        *,
        to: str | None = None,
        attempt: int = 1,
        **fields: Any,
    ) -> Delivered:
        """Run one message through the handler of the service that receives it; commit.

        ``message`` is a :class:`Message` or a message type, then built by
        :meth:`message` from ``fields`` (``aggregate_id``, ``payload``, ...). ``to`` names
        the service when several registered ones receive it; ``attempt`` sets
        ``message.attempt`` (``is_final_attempt`` follows from the handler's max_attempts).

        Raises :class:`DeliveryRejected` when the receiver would reject the message, and
        whatever the handler raises (its transaction is then rolled back).
        """
        if isinstance(message, str):
            message = self.message(message, **fields)
        elif fields:
            raise TypeError(f"deliver(message) takes no message fields (got {', '.join(sorted(fields))})")
        target = self._target_for(message, to)
        delivered = self._run(target, self._admit(target, message), attempt)
        self.delivered.append(delivered)
        self.pending.extend(delivered.sent)
        return delivered

    def run_until_idle(self, *, max_deliveries: int = MAX_DELIVERIES) -> list[Delivered]:
        """Deliver every pending message to each registered service that receives it, and
        what those handlers send, until nothing is pending; the deliveries in order."""
        done: list[Delivered] = []
        while self.pending:
            message = self.pending.popleft()
            targets = [t for t in self._targets.values() if message.message_type in t.intake.accepted]
            if not targets:
                self.unrouted.append(message)
            for target in targets:
                if len(done) >= max_deliveries:
                    raise TxboxError(
                        f"still not idle after {max_deliveries} deliveries (next: {message.message_type} to "
                        f"{target.name}): do the handlers send each other messages forever?"
                    )
                delivered = self._run(target, self._admit(target, message), 1)
                done.append(delivered)
                self.delivered.append(delivered)
                self.pending.extend(delivered.sent)
        return done

    def engine(self, service: str | None = None) -> Engine:
        """The engine of a registered service's test database (to set up or check rows)."""
        return (self._targets[service] if service else self._first).engine

    def close(self) -> None:
        for target in self._targets.values():
            target.engine.dispose()

    def __enter__(self) -> Harness:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- as the receiver and the worker do it ----------------------------------------

    def _spec(self, message_type: str) -> MessageSpec:
        """From the first registered service's contracts that know the type (services may
        load different folders)."""
        for target in self._targets.values():
            with contextlib.suppress(UnknownMessageType):
                return target.service.registry.get(message_type)
        return self._first.service.registry.get(message_type)  # raises, naming the known types

    def _target_for(self, message: Message, to: str | None) -> _Target:
        if to is not None:
            if to not in self._targets:
                raise ValueError(f"service {to!r} is not registered (registered: {', '.join(self._targets)})")
            return self._targets[to]
        receivers = [t for t in self._targets.values() if message.message_type in t.intake.accepted]
        if len(receivers) == 1:
            return receivers[0]
        if not receivers:
            raise ContractError(
                f"no registered service receives {message.message_type} (registered: {', '.join(self._targets)})"
            )
        raise ValueError(
            f"{message.message_type} reaches {', '.join(t.name for t in receivers)}: say which with to=..."
        )

    def _admit(self, target: _Target, message: Message) -> Message:
        """The message as the worker would read it back, if the receiver stores it."""
        delivery = Delivery(
            delivery_tag=0,
            body=message.to_json(),
            properties={"content_type": CONTENT_TYPE, "message_id": str(message.message_id)},
        )
        row = target.intake.admit(delivery)
        if isinstance(row, Filtered):
            raise DeliveryRejected(
                f"{target.name}'s receiver would not store this {message.message_type}: its handler's selector "
                "does not match it",
                FILTERED,
            )
        if isinstance(row, DeadLetter):
            raise DeliveryRejected(
                f"{target.name}'s receiver would reject this {message.message_type} ({row.reason}): {row.error}",
                row.reason,
            )
        return _from_inbox(row, message.auth_token)

    def _run(self, target: _Target, message: Message, attempt: int) -> Delivered:
        handler = target.service.handler_for(message.message_type)
        if handler is None:
            raise AssemblyError(
                [Problem("error", target.name, f"receives {message.message_type} but has no handler for it")]
            )
        message = message.with_delivery(attempt=attempt, max_attempts=handler.max_attempts or self._max_attempts)
        with target.engine.connect() as conn:
            raw: psycopg.Connection[Any] = conn.connection.driver_connection  # type: ignore[assignment]
            transaction = conn.begin()
            session = guard.HandlerSession(bind=conn, join_transaction_mode="rollback_only", autoflush=True)
            outbox = Outbox(
                session,
                target.service.registry,
                schema=target.schema,
                incoming=message,
                sent_by=(target.service.name, handler.name),
            )
            try:
                cur = raw.cursor()
                cur.execute(guard.create_guard())
                cur.execute(guard.arm())
                try:
                    guard.run_handler(
                        handler, message, session, outbox, conn, raw, transaction, None, target.service.middleware
                    )
                except Exception as exc:
                    # As the worker words it: a handler that ended the transaction (the commit
                    # guard refused its COMMIT, say) misused it, whatever it raised then.
                    found = guard.misuse(session, conn, raw, transaction, None)
                    if found is not None and found[1]:
                        raise HandlerMisuse(found[0]) from exc
                    raise
                session.flush()
                session.close()
                cur.execute(guard.disarm())
                transaction.commit()
            except BaseException:
                session.close()
                if transaction.is_active:
                    transaction.rollback()
                raise
        return Delivered(target.name, message, [_sent(row) for row in outbox.written])


def _from_inbox(row: InboxRow, auth_token: str | None) -> Message:
    return Message(
        message_id=row.id,
        message_type=row.message_type,
        aggregate_type=row.aggregate_type,
        aggregate_id=row.aggregate_id,
        message_version=row.message_version,
        payload=jsoncodec.loads(row.payload),
        message_context=jsoncodec.loads(row.message_context),
        timestamp=row.message_timestamp,
        auth_token=auth_token,
        routing_key=row.routing_key,
    )


def _sent(row: OutboxRow) -> Message:
    return Message(
        message_id=row.id,
        message_type=row.message_type,
        aggregate_type=row.aggregate_type,
        aggregate_id=row.aggregate_id,
        message_version=row.message_version,
        payload=row.payload,
        message_context=row.message_context,
        timestamp=datetime.now(UTC),
        auth_token=row.metadata.get("auth_token"),
        routing_key=row.routing_key,
    )
