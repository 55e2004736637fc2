"""Transactional outbox writes in the caller's own SQLAlchemy transaction."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import Column, MetaData, Table, Text, func, select
from sqlalchemy.orm import Session

from framework import Message, Service, migrate, tables
from framework.errors import ContractError, PayloadValidationError, UnknownMessageType
from framework.settings import Settings
from tests.conftest import CONTRACTS

business = MetaData()
orders = Table("orders", business, Column("id", Text, primary_key=True))
PAYLOAD = {"customer": "ada", "sku": "SKU-1", "quantity": 2}


@pytest.fixture
def engine(service: Service):  # type: ignore[no-untyped-def]
    business.create_all(service.engine)
    yield service.engine
    service.engine.dispose()


def outbox_rows(engine, table=tables.outbox):  # type: ignore[no-untyped-def]
    with engine.connect() as conn:
        return conn.execute(select(table)).mappings().all()


def test_send_command_writes_one_row_with_contract_facts(service: Service, engine) -> None:  # type: ignore[no-untyped-def]
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id="o-1"))
        message_id = service.outbox(session).send_command(
            "PlaceOrder", aggregate_id="o-1", payload=PAYLOAD, message_context={"correlation_id": "c-1"}
        )
    (row,) = outbox_rows(engine)
    assert row["id"] == message_id
    assert (row["message_type"], row["kind"], row["routing_key"], row["aggregate_type"], row["aggregate_id"]) == (
        "PlaceOrder",
        "command",
        "order-service.order.place",
        "order",
        "o-1",
    )
    assert row["payload"] == PAYLOAD and row["message_context"] == {"correlation_id": "c-1"}
    assert (row["segment"], row["concurrency"], row["priority"]) == ("order:o-1", "sequential", 0)
    assert row["processed_at"] is None and row["started_attempts"] == 0
    assert row["locked_until"] <= datetime.now(UTC)


def test_publish_event_and_options(service: Service, engine) -> None:  # type: ignore[no-untyped-def]
    later = datetime.now(UTC) + timedelta(hours=1)
    with engine.begin() as conn:  # a Connection works as well as a Session
        service.outbox(conn).publish_event(
            "OrderPlaced",
            aggregate_id=7,
            payload={"order_id": "7", "sku": "S", "quantity": 1},
            not_before=later,
            priority=5,
            segment="vip",
            concurrency="parallel",
            auth_token="secret-token",
        )
    (row,) = outbox_rows(engine)
    assert (row["kind"], row["aggregate_id"], row["priority"], row["segment"], row["concurrency"]) == (
        "event",
        "7",
        5,
        "vip",
        "parallel",
    )
    assert abs((row["locked_until"] - later).total_seconds()) < 0.001
    assert row["metadata"] == {"auth_token": "secret-token"}


def test_rollback_leaves_no_row(service: Service, engine) -> None:  # type: ignore[no-untyped-def]
    with Session(engine) as session, pytest.raises(RuntimeError), session.begin():
        service.outbox(session).send_command("PlaceOrder", aggregate_id="1", payload=PAYLOAD)
        raise RuntimeError("business failure")
    assert outbox_rows(engine) == []


def test_invalid_payload_raises_before_commit_and_writes_nothing(service: Service, engine) -> None:  # type: ignore[no-untyped-def]
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id="o-2"))
        with pytest.raises(PayloadValidationError, match="quantity"):
            service.outbox(session).send_command("PlaceOrder", aggregate_id="o-2", payload={**PAYLOAD, "quantity": 0})
    assert outbox_rows(engine) == []


@pytest.mark.parametrize(
    ("method", "message_type", "error"),
    [
        ("send_command", "OrderPlaced", ContractError),
        ("publish_event", "PlaceOrder", ContractError),
        ("send_command", "Nope", UnknownMessageType),
    ],
)
def test_wrong_kind_or_unknown_type(service: Service, engine, method: str, message_type: str, error: type) -> None:  # type: ignore[no-untyped-def]
    with Session(engine) as session, session.begin(), pytest.raises(error):
        getattr(service.outbox(session), method)(message_type, aggregate_id="1", payload={})


def test_message_context_propagates_from_the_incoming_message(service: Service, engine) -> None:  # type: ignore[no-untyped-def]
    incoming = Message(
        message_id=uuid.uuid4(),
        message_type="PlaceOrder",
        aggregate_type="order",
        aggregate_id="o-3",
        payload=PAYLOAD,
        message_context={"correlation_id": "saga-9"},
    )
    with Session(engine) as session, session.begin():
        outbox = service.outbox(session, incoming=incoming)
        outbox.publish_event("OrderPlaced", aggregate_id="o-3", payload={"order_id": "o-3", "sku": "S", "quantity": 1})
        outbox.publish_event(
            "OrderCompleted",
            aggregate_id="o-3",
            payload={"order_id": "o-3", "status": "completed"},
            message_context={"other": "x"},
        )
    contexts = {r["message_type"]: r["message_context"] for r in outbox_rows(engine)}
    assert contexts == {"OrderPlaced": {"correlation_id": "saga-9"}, "OrderCompleted": {"other": "x"}}


def test_rows_keep_insert_order_inside_one_transaction(service: Service, engine) -> None:  # type: ignore[no-untyped-def]
    with Session(engine) as session, session.begin():
        ids = [
            service.outbox(session).send_command("PlaceOrder", aggregate_id="same", payload=PAYLOAD) for _ in range(20)
        ]
    with engine.connect() as conn:
        ordered = conn.execute(select(tables.outbox.c.id).order_by(tables.outbox.c.created_at)).scalars().all()
    assert ordered == ids


def test_other_schema(empty_database_url: str) -> None:
    migrate.upgrade(empty_database_url, schema="messaging")
    service = Service(
        settings=Settings(
            service="order-service",
            database_url=empty_database_url,
            contracts_dir=CONTRACTS,
            schema="messaging",
        )
    )
    try:
        with Session(service.engine) as session, session.begin():
            service.outbox(session).send_command("PlaceOrder", aggregate_id="1", payload=PAYLOAD)
        with service.engine.connect() as conn:
            count = conn.execute(
                select(func.count()).select_from(tables.outbox),
                execution_options={"schema_translate_map": tables.translate_map("messaging")},
            ).scalar_one()
        assert count == 1
    finally:
        service.engine.dispose()
