"""Outbox writes in an asyncio transaction: AsyncSession and AsyncConnection (psycopg_async)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Column, MetaData, Table, Text, event, func, select
from sqlalchemy.engine import Engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession, create_async_engine
from sqlalchemy.util import greenlet_spawn

from framework import Service, tables
from framework.errors import ConfigurationError, PayloadValidationError

business = MetaData()
orders = Table("orders", business, Column("id", Text, primary_key=True))
PAYLOAD = {"customer": "ada", "sku": "SKU-1", "quantity": 2}


@pytest.fixture
def urls(service: Service) -> Iterator[str]:
    business.create_all(service.engine)
    yield service.settings.database_url
    service.engine.dispose()


def run(url: str, body: Callable[[AsyncEngine], Awaitable[Any]]) -> Any:
    async def main() -> Any:
        engine = create_async_engine(url)
        try:
            return await body(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def table(service: Service, t: Table = tables.outbox) -> list[Any]:
    with service.engine.connect() as conn:
        return list(conn.execute(select(t)).mappings().all())


def statements(engine: AsyncEngine) -> list[str]:
    """Every statement the engine's connections execute through SQLAlchemy."""
    seen: list[str] = []
    event.listen(engine.sync_engine, "before_cursor_execute", lambda *a: seen.append(a[2].split()[0].upper()))
    return seen


def place(service: Service, bind: AsyncSession | AsyncConnection, order_id: str) -> None:
    service.outbox(bind).send_command("PlaceOrder", aggregate_id=order_id, payload=PAYLOAD)


def test_async_session_rows_commit_with_the_transaction_and_ride_the_commit(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> list[str]:
        seen = statements(engine)
        async with AsyncSession(engine) as session, session.begin():
            await session.execute(orders.insert().values(id="o-1"))
            place(service, session, "o-1")
            place(service, session, "o-2")
        return seen

    seen = run(urls, body)
    assert [r["aggregate_id"] for r in table(service)] == ["o-1", "o-2"]
    # The rows went with the COMMIT's pipeline, not as statements of their own.
    assert seen == ["INSERT"]


def test_async_session_without_a_statement_before_the_row(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session:  # autobegin: nothing sent before the commit
            place(service, session, "o-1")
            await session.commit()

    run(urls, body)
    assert [r["aggregate_id"] for r in table(service)] == ["o-1"]


def test_async_session_rollback_leaves_no_row(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session:
            async with session.begin():
                await session.execute(orders.insert().values(id="o-1"))
                place(service, session, "o-1")
                await session.rollback()
            async with session.begin():  # the same session and pooled connection, a new transaction
                await session.execute(orders.insert().values(id="o-2"))

    run(urls, body)
    assert table(service) == []
    assert [r["id"] for r in table(service, orders)] == ["o-2"]


def test_async_session_failing_flush_commits_nothing(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session:
            await session.execute(orders.insert().values(id="o-1"))
            await session.commit()
            with pytest.raises(IntegrityError):
                async with session.begin():
                    place(service, session, "o-1")
                    await session.execute(orders.insert().values(id="o-1"))  # duplicate key

    run(urls, body)
    assert table(service) == []


def test_validation_raises_before_anything_commits(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session:
            with pytest.raises(PayloadValidationError):
                async with session.begin():
                    await session.execute(orders.insert().values(id="o-1"))
                    service.outbox(session).send_command("PlaceOrder", aggregate_id="o-1", payload={"sku": 1})

    run(urls, body)
    assert table(service) == [] and table(service, orders) == []


def test_async_session_savepoints(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session, session.begin():
            place(service, session, "before")
            async with session.begin_nested():
                place(service, session, "kept")
                async with session.begin_nested():
                    place(service, session, "inner-kept")
            savepoint = await session.begin_nested()
            place(service, session, "dropped")
            await savepoint.rollback()
            place(service, session, "after")

    run(urls, body)
    assert [r["aggregate_id"] for r in table(service)] == ["before", "kept", "inner-kept", "after"]


def test_async_connection_commit_rollback_and_savepoints(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> list[str]:
        seen = statements(engine)
        async with engine.connect() as conn:
            place(service, conn, "committed")
            await conn.commit()
            place(service, conn, "rolled-back")
            await conn.rollback()
            async with conn.begin():
                place(service, conn, "before")
                savepoint = await conn.begin_nested()
                place(service, conn, "dropped")
                await savepoint.rollback()
                async with conn.begin_nested():
                    place(service, conn, "kept")
                place(service, conn, "after")
        return seen

    seen = run(urls, body)
    assert [r["aggregate_id"] for r in table(service)] == ["committed", "before", "kept", "after"]
    assert "INSERT" not in seen


def test_async_connection_validation_raises_before_the_commit(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        async with engine.connect() as conn:
            with pytest.raises(PayloadValidationError):
                async with conn.begin():
                    place(service, conn, "o-1")
                    service.outbox(conn).send_command("PlaceOrder", aggregate_id="o-2", payload={"sku": 1})

    run(urls, body)
    assert table(service) == []


def test_pipeline_off_falls_back_to_the_insert_at_commit(service: Service, urls: str) -> None:
    import dataclasses

    plain = Service(settings=dataclasses.replace(service.settings, outbox_commit_pipeline=False))

    async def body(engine: AsyncEngine) -> list[str]:
        seen = statements(engine)
        async with AsyncSession(engine) as session:
            async with session.begin():
                place(plain, session, "o-1")
                assert seen == []  # still no I/O when written
            async with engine.connect() as conn:
                with pytest.raises(ConfigurationError, match="AsyncSession"):
                    place(plain, conn, "o-2")
        return seen

    assert run(urls, body) == ["INSERT"]
    assert [r["aggregate_id"] for r in table(service)] == ["o-1"]


def test_other_asyncio_drivers_are_refused(service: Service, urls: str) -> None:
    async def body(engine: AsyncEngine) -> None:
        # asyncpg need not be installed: the outbox only reads the dialect's driver name.
        engine.sync_engine.dialect.driver = "asyncpg"
        with pytest.raises(ConfigurationError, match=r"psycopg 3 driver, not 'asyncpg'.*postgresql\+psycopg://"):
            service.outbox(AsyncSession(engine))

    run(urls, body)


def test_a_failing_row_at_the_commit_commits_nothing(service: Service, urls: str) -> None:
    import uuid

    same = uuid.uuid4()

    async def body(engine: AsyncEngine) -> None:
        async with AsyncSession(engine) as session:
            with pytest.raises(IntegrityError):
                async with session.begin():
                    await session.execute(orders.insert().values(id="o-1"))
                    for order_id in ("o-1", "o-2"):  # the second row repeats the message id
                        service.outbox(session).send_command(
                            "PlaceOrder", aggregate_id=order_id, payload=PAYLOAD, message_id=same
                        )
            async with session.begin():  # the connection is usable again
                await session.execute(orders.insert().values(id="o-3"))

    run(urls, body)
    assert table(service) == []
    assert [r["id"] for r in table(service, orders)] == ["o-3"]


def reset_in_the_pool(engine: Engine) -> None:
    raw = engine.raw_connection()  # no SQLAlchemy Connection, so no rollback event
    raw.cursor().execute("INSERT INTO orders VALUES ('x')")
    raw.close()  # the pool rolls it back, and psycopg deallocates what it prepared


def deallocate(engine: Engine) -> None:
    with engine.connect() as conn:
        conn.exec_driver_sql("DEALLOCATE ALL")
        conn.commit()


@pytest.mark.parametrize("drop", [reset_in_the_pool, deallocate])
def test_a_dropped_statement_is_prepared_again(service: Service, urls: str, drop: Callable[[Engine], None]) -> None:
    async def body(_: AsyncEngine) -> None:
        # Every checkout is the same session, and psycopg prepares at once.
        one = create_async_engine(urls, pool_size=1, max_overflow=0, connect_args={"prepare_threshold": 0})
        try:
            for order_id in ("first", "second"):
                async with one.connect() as conn:
                    place(service, conn, order_id)
                    await conn.commit()
                    await conn.execute(select(func.count()).select_from(orders))  # one of psycopg's own
                    await conn.commit()
                await greenlet_spawn(drop, one.sync_engine)
        finally:
            await one.dispose()

    run(urls, body)
    assert [r["aggregate_id"] for r in table(service)] == ["first", "second"]
