"""Async handlers for `order-service` (the worker tests' service): the same behaviour as the
sync test handlers, written as ``async def handle`` with an ``AsyncSession``
(docs/explanation/handle.md, "Async handlers").

``AsyncRecorder`` records each run and inserts a ``seen`` row, then awaits ``act`` (each
test sets it); ``AsyncStockReserved`` handles an event type beside a sync ``PlaceOrder``
handler in one service.
"""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from framework import CommandHandler, EventHandler, Message, Outbox

AsyncAct = Callable[[Message, AsyncSession, Outbox], Awaitable[None]]


class AsyncRecorder(CommandHandler):
    message_type = "PlaceOrder"

    def __init__(self, act: AsyncAct | None = None) -> None:
        self.act = act
        self.calls: list[tuple[str, int, bool]] = []
        self.lock = threading.Lock()

    async def handle(self, message: Message, session: AsyncSession, outbox: Outbox) -> None:  # type: ignore[override]
        assert isinstance(session, AsyncSession), type(session)
        with self.lock:
            self.calls.append((str(message.message_id), message.attempt, message.is_final_attempt))
        await session.execute(
            text("INSERT INTO seen (id, segment, quantity) VALUES (:id, :segment, :q)"),
            {"id": message.message_id, "segment": message.aggregate_id, "q": message.payload["quantity"]},
        )
        if self.act is not None:
            await self.act(message, session, outbox)


class AsyncStockReserved(EventHandler):
    message_type = "StockReserved"

    async def handle(self, message: Message, session: AsyncSession, outbox: Outbox) -> None:  # type: ignore[override]
        await session.execute(
            text("INSERT INTO seen (id, segment, quantity) VALUES (:id, 'stock', :q)"),
            {"id": message.message_id, "q": message.payload["quantity"]},
        )
