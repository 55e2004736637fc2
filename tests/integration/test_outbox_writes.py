"""Transactional outbox writes in the caller's own SQLAlchemy transaction."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import Column, Connection, MetaData, Table, Text, event, func, select, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import Session

from framework import Message, Service, migrate, tables
from framework.db import create_engine
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


# --- rows written at the top of a transaction travel with its COMMIT (framework.outbox_commit)


def committed_ids(engine: Engine) -> list[uuid.UUID]:
    with engine.connect() as conn:
        query = select(tables.outbox.c.id).order_by(tables.outbox.c.created_at)
        return list(conn.execute(query).scalars())


def count_in(bind: Session) -> int:
    return bind.execute(select(func.count()).select_from(tables.outbox)).scalar_one()


def test_a_row_is_held_until_commit_and_sent_with_it(service: Service, engine: Engine) -> None:
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with Session(engine) as session, session.begin():
        session.execute(orders.insert().values(id="o-1"))
        message_id = service.outbox(session).send_command("PlaceOrder", aggregate_id="o-1", payload=PAYLOAD)
        assert count_in(session) == 0  # not yet in the table: it rides on the COMMIT
    assert committed_ids(engine) == [message_id]
    assert not any("outbox" in s and s.lstrip().upper().startswith("INSERT") for s in statements)


def test_with_the_pipeline_off_each_row_is_a_plain_insert_at_once(settings: Settings, engine: Engine) -> None:
    environ = {"TXBOX_SERVICE": settings.service, "TXBOX_DATABASE_URL": settings.database_url}
    plain = Service.from_env(
        {**environ, "TXBOX_OUTBOX_COMMIT_PIPELINE": "false", "TXBOX_CONTRACTS_DIR": str(CONTRACTS)}
    )
    assert not plain.settings.outbox_commit_pipeline
    statements: list[str] = []
    event.listen(engine, "before_cursor_execute", lambda *args: statements.append(args[2]))
    with Session(engine) as session, session.begin():
        later = datetime.now(UTC) + timedelta(hours=1)
        first = plain.outbox(session).send_command("PlaceOrder", aggregate_id="o-1", payload=PAYLOAD)
        assert count_in(session) == 1  # in the table before the COMMIT
        second = plain.outbox(session).send_command("PlaceOrder", aggregate_id="o-2", payload=PAYLOAD, not_before=later)
        assert our_statements(session.connection()) == []  # nothing prepared for a pipeline
    assert committed_ids(engine) == [first, second]
    inserts = [s for s in statements if s.lstrip().upper().startswith("INSERT") and "outbox" in s]
    assert len(inserts) == 2
    with engine.connect() as conn:
        due = dict(conn.execute(select(tables.outbox.c.id, tables.outbox.c.locked_until)).all())
    assert due[first] <= datetime.now(UTC) < due[second] == later


def test_the_pipeline_is_on_unless_turned_off(settings: Settings) -> None:
    environ = {"TXBOX_SERVICE": settings.service, "TXBOX_DATABASE_URL": settings.database_url}
    assert Settings.from_env(environ).outbox_commit_pipeline
    with pytest.raises(Exception, match="TXBOX_OUTBOX_COMMIT_PIPELINE"):
        Settings.from_env({**environ, "TXBOX_OUTBOX_COMMIT_PIPELINE": "maybe"})


def test_flush_writes_held_rows_into_the_open_transaction(service: Service, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        outbox = service.outbox(session)
        outbox.send_command("PlaceOrder", aggregate_id="o-1", payload=PAYLOAD)
        outbox.flush()
        assert count_in(session) == 1
    assert len(committed_ids(engine)) == 1


def test_rows_flushed_first_thing_in_a_transaction_still_roll_back_with_it(service: Service, engine: Engine) -> None:
    # No statement ran before them, so the driver has not begun the transaction yet.
    with Session(engine) as session, session.begin():
        service.outbox(session).send_command("PlaceOrder", aggregate_id="flushed", payload=PAYLOAD)
        service.outbox(session).flush()
        session.rollback()
    with Session(engine) as session, session.begin():
        service.outbox(session).send_command("PlaceOrder", aggregate_id="before", payload=PAYLOAD)
        nested = session.begin_nested()  # the held row goes in before the SAVEPOINT
        nested.rollback()
        session.rollback()
    assert committed_ids(engine) == []


def test_a_transaction_begun_by_the_outbox_has_the_connections_characteristics(
    service: Service, engine: Engine
) -> None:
    options = {"isolation_level": "SERIALIZABLE", "postgresql_deferrable": True}
    with engine.connect().execution_options(**options) as conn, conn.begin():
        service.outbox(conn).send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)
        service.outbox(conn).flush()  # the transaction's first statement
        settings = text("SELECT current_setting('transaction_isolation'), current_setting('transaction_deferrable')")
        assert tuple(conn.execute(settings).one()) == ("serializable", "on")
    with engine.connect().execution_options(postgresql_readonly=True) as conn, conn.begin():
        service.outbox(conn).send_command("PlaceOrder", aggregate_id="b", payload=PAYLOAD)
        with pytest.raises(DBAPIError, match="read-only transaction"):
            service.outbox(conn).flush()
    assert len(committed_ids(engine)) == 1


def test_rollback_to_a_savepoint_keeps_rows_written_before_it(service: Service, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        outbox = service.outbox(session)
        first = outbox.send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)
        nested = session.begin_nested()
        outbox.send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)
        nested.rollback()
        last = outbox.send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)
    assert committed_ids(engine) == [first, last]


def test_rows_around_a_released_savepoint_keep_the_order_they_were_written_in(service: Service, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        outbox = service.outbox(session)
        ids = [outbox.send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)]
        with session.begin_nested():
            ids += [outbox.send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD) for _ in range(2)]
        ids.append(outbox.send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD))
    assert committed_ids(engine) == ids


def test_a_failing_row_fails_the_commit_and_nothing_commits(service: Service, engine: Engine) -> None:
    duplicate = uuid.uuid4()
    with Session(engine) as session, session.begin():
        service.outbox(session).send_command("PlaceOrder", aggregate_id="x", payload=PAYLOAD, message_id=duplicate)
    session = Session(engine)
    with pytest.raises(IntegrityError) as caught, session.begin():
        session.execute(orders.insert().values(id="o-9"))
        service.outbox(session).send_command(
            "PlaceOrder", aggregate_id="y", payload=PAYLOAD, message_id=duplicate, auth_token="s3cret"
        )
    session.close()
    assert "s3cret" not in str(caught.value) and "SKU-1" not in str(caught.value)
    assert committed_ids(engine) == [duplicate]
    with engine.connect() as conn:
        assert conn.execute(select(func.count()).select_from(orders)).scalar_one() == 0
    # The pooled connection is clean again.
    with Session(engine) as again, again.begin():
        service.outbox(again).send_command("PlaceOrder", aggregate_id="z", payload=PAYLOAD)
    assert len(committed_ids(engine)) == 2


def test_rows_of_a_rolled_back_transaction_never_reach_the_next_one(
    service: Service, engine: Engine, database_url: str
) -> None:
    one = create_engine(database_url, pool_size=1, max_overflow=0)  # one DBAPI connection, reused
    try:
        with one.connect() as conn:
            service.outbox(conn).send_command("PlaceOrder", aggregate_id="gone", payload=PAYLOAD)
            conn.rollback()
            kept = service.outbox(conn).send_command("PlaceOrder", aggregate_id="kept", payload=PAYLOAD)
            conn.commit()
        with one.connect() as conn:
            service.outbox(conn).send_command("PlaceOrder", aggregate_id="closed", payload=PAYLOAD)
            # closed without a commit: rolled back on its way back to the pool
        with one.begin() as conn:  # a commit on the same DBAPI connection
            conn.execute(orders.insert().values(id="o-1"))
        assert committed_ids(one) == [kept]
    finally:
        one.dispose()


def test_autocommit_writes_at_once(service: Service, engine: Engine) -> None:
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        message_id = service.outbox(conn).send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)
        assert committed_ids(engine) == [message_id]  # visible to another connection already


def test_text_postgresql_cannot_store_is_refused_at_write(service: Service, engine: Engine) -> None:
    with Session(engine) as session, session.begin():
        with pytest.raises(DataError, match="NUL"):
            service.outbox(session).send_command("PlaceOrder", aggregate_id="a\x00b", payload=PAYLOAD)
        session.execute(orders.insert().values(id="still-usable"))
    assert committed_ids(engine) == []


# Any text, as the values of a row travel in libpq's text format (outbox_commit._text).
texts = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(aggregate_id=texts, customer=texts.filter(bool))
def test_any_text_arrives_exactly_as_written(
    service: Service, engine: Engine, aggregate_id: str, customer: str
) -> None:
    payload = {**PAYLOAD, "customer": customer}
    with Session(engine) as session, session.begin():
        message_id = service.outbox(session).send_command("PlaceOrder", aggregate_id=aggregate_id, payload=payload)
    with engine.connect() as conn:
        row = conn.execute(select(tables.outbox).where(tables.outbox.c.id == message_id)).mappings().one()
    assert (row["aggregate_id"], row["segment"], row["payload"]) == (aggregate_id, f"order:{aggregate_id}", payload)


# --- the held rows' INSERT is prepared once per connection and survives whatever drops it


def our_statements(conn: Connection) -> list[tuple[str, int]]:
    """The outbox statements prepared in ``conn``'s session, with how often each ran."""
    query = text(
        "SELECT name, generic_plans + custom_plans FROM pg_prepared_statements"
        " WHERE name LIKE 'txbox_outbox_%' ORDER BY name"
    )
    return [(name, runs) for name, runs in conn.execute(query)]


def write_and_commit(service: Service, conn: Connection, aggregate_id: str) -> uuid.UUID:
    conn.execute(orders.insert().values(id=aggregate_id))  # begins the transaction
    message_id = service.outbox(conn).send_command("PlaceOrder", aggregate_id=aggregate_id, payload=PAYLOAD)
    conn.commit()
    return message_id


@pytest.fixture
def one_connection(engine: Engine, database_url: str) -> Iterator[Engine]:
    """An engine whose every checkout is the same session; psycopg prepares at once."""
    one = create_engine(database_url, pool_size=1, max_overflow=0, connect_args={"prepare_threshold": 0})
    yield one
    one.dispose()


def test_the_insert_is_prepared_once_and_reused(service: Service, one_connection: Engine) -> None:
    with one_connection.connect() as conn:
        for n in range(3):
            write_and_commit(service, conn, f"a{n}")
        ((_, runs),) = our_statements(conn)
    assert runs == 3
    assert len(committed_ids(one_connection)) == 3


def deallocate(conn: Connection, engine: Engine) -> None:
    conn.execute(text("DEALLOCATE ALL"))
    conn.commit()


def discard(conn: Connection, engine: Engine) -> None:
    conn.commit()
    conn.execution_options(isolation_level="AUTOCOMMIT").execute(text("DISCARD ALL"))


def roll_back(conn: Connection, engine: Engine) -> None:
    # psycopg deallocates everything after a rollback once it has prepared statements
    conn.execute(orders.insert().values(id="x"))
    conn.rollback()


def reset_in_the_pool(conn: Connection, engine: Engine) -> None:
    conn.commit()
    conn.close()
    raw = engine.raw_connection()  # no SQLAlchemy Connection, so no rollback event
    raw.cursor().execute("INSERT INTO orders VALUES ('x')")
    raw.close()  # the pool rolls it back


@pytest.mark.parametrize("drop", [deallocate, discard, roll_back, reset_in_the_pool])
def test_a_dropped_statement_is_prepared_again_in_the_same_round_trip(
    service: Service, one_connection: Engine, drop: Any
) -> None:
    with one_connection.connect() as conn:
        first = write_and_commit(service, conn, "first")
        conn.execute(select(func.count()).select_from(orders))  # psycopg prepares one of its own
        drop(conn, one_connection)
    with one_connection.connect() as conn:
        assert our_statements(conn) == []  # the session really lost it
        second = write_and_commit(service, conn, "second")
        assert len(our_statements(conn)) == 1
    assert committed_ids(one_connection) == [first, second]


def test_a_statement_dropped_behind_sqlalchemys_back_fails_one_commit_and_loses_nothing(
    service: Service, one_connection: Engine
) -> None:
    with one_connection.connect() as conn:
        kept = write_and_commit(service, conn, "a")
        conn.execute(orders.insert().values(id="o-1"))
        conn.connection.driver_connection.pgconn.exec_(b"DEALLOCATE ALL")  # type: ignore[union-attr]
        service.outbox(conn).send_command("PlaceOrder", aggregate_id="b", payload=PAYLOAD)
        with pytest.raises(ProgrammingError, match="does not exist") as caught:
            conn.commit()
        assert "retry" in "".join(getattr(caught.value, "__notes__", []))
        conn.rollback()  # as after any failed commit
        again = write_and_commit(service, conn, "c")  # and the next try goes through
        assert conn.execute(select(orders.c.id).order_by(orders.c.id)).scalars().all() == ["a", "c"]
    assert committed_ids(one_connection) == [kept, again]


def test_without_prepared_statements_rows_still_ride_on_the_commit(
    service: Service, engine: Engine, database_url: str
) -> None:
    # prepare_threshold=None is psycopg's setting behind a pooler in transaction mode.
    unprepared = create_engine(database_url, pool_size=1, connect_args={"prepare_threshold": None})
    try:
        statements: list[str] = []
        event.listen(unprepared, "before_cursor_execute", lambda *args: statements.append(args[2]))
        with unprepared.connect() as conn:
            message_id = write_and_commit(service, conn, "a")
            assert our_statements(conn) == []
        assert not any("outbox" in s and s.startswith("INSERT") for s in statements)
        assert committed_ids(engine) == [message_id]
    finally:
        unprepared.dispose()


def test_a_connection_lost_before_the_commit_commits_nothing(service: Service, engine: Engine) -> None:
    with engine.connect() as conn:
        conn.execute(orders.insert().values(id="o-1"))
        pid = conn.connection.driver_connection.info.backend_pid  # type: ignore[union-attr]
        service.outbox(conn).send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)
        with engine.connect() as other:
            other.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
        with pytest.raises(OperationalError):
            conn.commit()
    assert committed_ids(engine) == []
    with Session(engine) as session, session.begin():  # the pool replaced the connection
        service.outbox(session).send_command("PlaceOrder", aggregate_id="b", payload=PAYLOAD)
    assert len(committed_ids(engine)) == 1


def test_notifications_arriving_with_the_commit_reach_psycopgs_handlers(service: Service, engine: Engine) -> None:
    heard: list[str] = []
    with engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        raw.add_notify_handler(lambda notify: heard.append(notify.channel))
        conn.execute(text("LISTEN txbox_outbox_insert"))  # the outbox trigger's own channel
        conn.commit()
        write_and_commit(service, conn, "a")
        assert heard == ["txbox_outbox_insert"]  # with no further statement
        conn.execute(text("UNLISTEN *"))
        conn.commit()


@pytest.mark.parametrize(("value", "arrives"), [("café", True), ("€ 5", False)])
def test_text_travels_in_the_connections_own_encoding(
    service: Service, database_url: str, value: str, arrives: bool
) -> None:
    engine = create_engine(database_url, connect_args={"options": "-c client_encoding=LATIN1"})
    try:
        with Session(engine) as session, session.begin():
            outbox = service.outbox(session)
            if not arrives:
                with pytest.raises(DataError, match="client_encoding LATIN1"):
                    outbox.send_command("PlaceOrder", aggregate_id=value, payload=PAYLOAD)
                return
            message_id = outbox.send_command("PlaceOrder", aggregate_id=value, payload=PAYLOAD)
        with engine.connect() as conn:
            row = conn.execute(select(tables.outbox.c.aggregate_id).where(tables.outbox.c.id == message_id))
            assert row.scalar_one() == value
    finally:
        engine.dispose()


def test_an_engine_with_execution_options_commits_its_rows(service: Service, engine: Engine) -> None:
    with engine.execution_options(logging_token="shop").connect() as conn:
        message_id = service.outbox(conn).send_command("PlaceOrder", aggregate_id="a", payload=PAYLOAD)
        conn.commit()
    assert committed_ids(engine) == [message_id]
