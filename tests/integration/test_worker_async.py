"""Async handlers (``async def handle`` with an ``AsyncSession``) keep every worker guarantee:
exactly once with the processed mark, the timeout that cancels the coroutine and its
statement, poison, backoff, ordering, batching, and sync and async handlers in one service.

docs/explanation/handle.md, "Async handlers".
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from framework import CommandHandler, Message, Outbox, PermanentError, RetryableError, logs
from framework.service import Service
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.async_orders import AsyncRecorder, AsyncStockReserved
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox
from tests.integration.test_worker import business, done, letters, row, worker  # noqa: F401 (business: fixture)


def test_an_async_handler_commits_with_the_processed_mark(service: Service, business: str) -> None:  # noqa: F811
    async def publish(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        # The handler runs in the worker's context (its log fields, its span) ...
        assert str(logs._context.get().get("message_id")) == str(message.message_id)
        # ... and the AsyncSession is the worker's transaction: it sees the row the handler just wrote.
        assert await session.scalar(text("SELECT count(*) FROM seen WHERE id = :id"), {"id": message.message_id}) == 1
        outbox.publish_event(
            "OrderPlaced",
            aggregate_id=message.aggregate_id,
            payload={"order_id": message.aggregate_id, "sku": "SKU-1", "quantity": 1},
        )

    handler = service.register(AsyncRecorder(publish))
    messages = [place_order(aggregate_id=str(i)) for i in range(5)]
    store_in_inbox(service, messages)
    with running(worker(service, batch_size=10)):
        support.wait_until(lambda: done(business) == 5, 20, message="processed")
    assert len(handler.calls) == 5
    for message in messages:
        state = row(business, message)
        assert state["processed_at"] is not None and (state["started"], state["finished"]) == (1, 1)
    assert scalar(business, "SELECT count(*) FROM seen") == 5
    assert scalar(business, "SELECT count(*) FROM txbox.outbox") == 5


def test_an_async_handler_cannot_commit_the_workers_transaction(service: Service, business: str) -> None:  # noqa: F811
    async def commit(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        await session.commit()

    service.register(AsyncRecorder(commit))
    store_in_inbox(service, [place_order()])
    with running(worker(service, max_attempts=1)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    [(_, _, reason, error, _)] = letters(business)
    assert reason == "max_attempts" and "session.commit()" in error
    assert scalar(business, "SELECT count(*) FROM seen") == 0


def test_an_async_handler_over_its_timeout_has_its_task_cancelled(service: Service, business: str) -> None:  # noqa: F811
    cancelled: list[int] = []

    async def slow_first(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        if message.attempt == 1:
            try:
                await asyncio.sleep(60)  # blocks the loop's select: only a task cancel ends it early
            except asyncio.CancelledError:
                cancelled.append(message.attempt)
                raise

    service.register(AsyncRecorder(slow_first))
    message = place_order()
    store_in_inbox(service, [message])
    started = time.monotonic()
    with running(worker(service, timeout=0.5, lease=30)):
        support.wait_until(lambda: done(business) == 1, 25, message="processed on the second run")
    assert time.monotonic() - started < 15
    assert cancelled == [1]
    state = row(business, message)
    assert state["finished"] == 2 and "HandlerTimeout" in (state["last_error"] or "")
    assert scalar(business, "SELECT count(*) FROM seen") == 1, "the timed-out run's write must be rolled back"


def test_an_async_handler_stuck_in_the_database_is_cancelled(service: Service, business: str) -> None:  # noqa: F811
    async def sleep_in_sql(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        await session.execute(text("SELECT pg_sleep(30)"))

    service.register(AsyncRecorder(sleep_in_sql))
    store_in_inbox(service, [place_order()])
    started = time.monotonic()
    with running(worker(service, timeout=0.5, lease=20, max_attempts=1)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned after the timeout")
    assert time.monotonic() - started < 15
    [(_, _, reason, error, _)] = letters(business)
    assert reason == "max_attempts" and "timeout" in error


def test_async_failures_back_off_then_abandon(service: Service, business: str) -> None:  # noqa: F811
    runs: list[float] = []

    async def fail(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        runs.append(time.monotonic())
        await asyncio.sleep(0)
        raise RetryableError("stock service unavailable")

    handler = service.register(AsyncRecorder(fail))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service, max_attempts=3, backoff_base=0.5, backoff_cap=5.0, backoff_jitter=0.0)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    assert [c[1:] for c in handler.calls] == [(1, False), (2, False), (3, True)]
    assert runs[1] - runs[0] >= 0.45, "the second run must wait for its backoff"
    state = row(business, message)
    assert state["abandoned_at"] is not None and "stock service unavailable" in state["last_error"]
    assert scalar(business, "SELECT count(*) FROM seen") == 0, "failed runs must leave no business rows"
    assert [r[2] for r in letters(business)] == ["max_attempts"]


def test_an_async_permanent_error_abandons_at_once_and_spares_its_batch_mates(
    service: Service,
    business: str,  # noqa: F811
) -> None:
    async def fail_bad(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            raise PermanentError("bad one")
        outbox.publish_event(
            "OrderPlaced",
            aggregate_id=message.aggregate_id,
            payload={"order_id": message.aggregate_id, "sku": "SKU-1", "quantity": 1},
        )

    service.register(AsyncRecorder(fail_bad))
    good = [place_order(aggregate_id=str(i)) for i in range(20)]
    store_in_inbox(service, [*good[:10], place_order(aggregate_id="bad"), *good[10:]])
    with running(worker(service, batch_size=50, max_attempts=5)):
        support.wait_until(lambda: done(business) == 21, 20, message="all settled")
    assert scalar(business, "SELECT count(*) FROM seen") == 20
    assert scalar(business, "SELECT count(*) FROM txbox.outbox") == 20, "only the good runs' rows commit"
    assert [r[2] for r in letters(business)] == ["permanent_error"]


def test_an_async_poison_message_is_abandoned_without_running(service: Service, business: str) -> None:  # noqa: F811
    handler = service.register(AsyncRecorder())
    store_in_inbox(service, [place_order()])
    query(business, "UPDATE txbox.inbox SET started_attempts = 3, locked_until = now() - interval '1 s'")
    with running(worker(service, poison_threshold=3)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned as poison")
    assert handler.calls == []
    assert [r[2] for r in letters(business)] == ["poison"]


def test_async_handlers_keep_every_segment_in_order_across_workers(service: Service, business: str) -> None:  # noqa: F811
    async def fail_some(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        if message.payload["quantity"] == 2 and message.attempt == 1:
            raise RetryableError("the second of each segment fails once")

    service.register(AsyncRecorder(fail_some))
    messages = [place_order(aggregate_id=f"s{s}", quantity=q) for q in range(1, 6) for s in range(4)]
    store_in_inbox(service, messages)
    workers: list[Worker] = [
        Worker(service, WorkerConfig(backoff_base=0.05, backoff_cap=0.1, poll_interval=0.1, batch_size=5))
        for _ in range(3)
    ]
    with running(workers[0]), running(workers[1]), running(workers[2]):
        support.wait_until(lambda: done(business) == 20, 30, message="all settled")
    seen: dict[str, list[int]] = {}
    for segment, quantity in query(business, "SELECT segment, quantity FROM seen ORDER BY n"):
        seen.setdefault(segment, []).append(quantity)
    assert seen == {f"s{s}": [1, 2, 3, 4, 5] for s in range(4)}


class SyncPlaceOrder(CommandHandler):
    message_type = "PlaceOrder"

    def handle(self, message: Message, session: Any, outbox: Outbox) -> None:
        session.execute(
            text("INSERT INTO seen (id, segment, quantity) VALUES (:id, 'order', :q)"),
            {"id": message.message_id, "q": message.payload["quantity"]},
        )


def test_sync_and_async_handlers_mix_in_one_service_and_batch(service: Service, business: str) -> None:  # noqa: F811
    service.register(SyncPlaceOrder())
    service.register(AsyncStockReserved())
    events = []
    for i in range(5):
        event = place_order(message_type="StockReserved", aggregate_id=f"o-{i}")
        event["payload"] = {"order_id": f"o-{i}", "sku": "SKU-1", "quantity": 1}
        events.append(event)
    store_in_inbox(service, [m for pair in zip([place_order(aggregate_id=str(i)) for i in range(5)], events,
                                                strict=True) for m in pair])  # fmt: skip
    with running(worker(service, batch_size=20)):
        support.wait_until(lambda: done(business) == 10, 20, message="all processed")
    assert dict(query(business, "SELECT segment, count(*) FROM seen GROUP BY segment")) == {"order": 5, "stock": 5}
    assert scalar(business, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL") == 10
