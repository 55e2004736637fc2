"""The order service's HTTP API: the web front end of the saga (Starlette on uvicorn).

``POST /orders`` stores the order and sends PlaceOrder in one ``AsyncSession``
transaction: both commit together or neither does (docs/explanation/write.md, "Async
outbox"). ``GET /orders/{id}`` shows where the order stands. Run it with::

    TXBOX_DATABASE_URL=postgresql+psycopg://postgres@127.0.0.1:5432/txbox_demo_orders \\
        .venv/bin/uvicorn examples.orders.api:app --port 8000

It needs the ``dashboard`` (Starlette, uvicorn) and ``async`` extras. The engine comes
from the service's ``TXBOX_DATABASE_URL``; ``create_async_engine`` picks psycopg's
asyncio side for a ``postgresql+psycopg://`` URL. ``TXBOX_API_POOL_SIZE`` sizes its pool.
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sqlalchemy import bindparam, func
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from examples.orders.app import service
from examples.orders.models import PLACED, Order
from framework import Service, TxboxError

#: A PlaceOrder request is a few short fields; anything much larger is not one.
MAX_BODY = 16 * 1024
_orders = Order.metadata.tables[Order.__tablename__]
_FIELDS = ("customer", "sku", "quantity")
# Built once with bind parameters, as the handlers' statements are (examples/orders/app.py).
_STORE = (
    insert(_orders)
    .values(
        id=bindparam("order_id"),
        customer=bindparam("customer_"),
        sku=bindparam("sku_"),
        quantity=bindparam("quantity_"),
        status=PLACED,
        correlation_id=bindparam("correlation_id_"),
        requested_at=func.clock_timestamp(),
    )
    .on_conflict_do_nothing(index_elements=[_orders.c.id])
    .returning(_orders.c.id)
)


def create_app(orders: Service = service, *, pool_size: int | None = None) -> Starlette:
    """The API of ``orders`` (its database URL and contracts)."""
    if pool_size is None:
        raw = os.environ.get("TXBOX_API_POOL_SIZE", "10")
        try:
            pool_size = int(raw)
        except ValueError:
            raise ValueError(f"TXBOX_API_POOL_SIZE={raw!r} is not a number; e.g. TXBOX_API_POOL_SIZE=10") from None
    engine = create_async_engine(orders.settings.database_url, pool_size=pool_size)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        await engine.dispose()

    async def place(request: Request) -> JSONResponse:
        return await _place(orders, engine, request)

    async def show(request: Request) -> JSONResponse:
        return await _show(engine, request.path_params["order_id"])

    return Starlette(
        routes=[Route("/orders", place, methods=["POST"]), Route("/orders/{order_id}", show, methods=["GET"])],
        lifespan=lifespan,
    )


async def _place(orders: Service, engine: AsyncEngine, request: Request) -> JSONResponse:
    body = await _json(request)
    if isinstance(body, JSONResponse):
        return body
    order_id = body.get("id") or str(uuid.uuid4())
    if not isinstance(order_id, str) or len(order_id) > 200:
        return JSONResponse({"error": "id must be a string of at most 200 characters"}, status_code=422)
    payload = {name: body.get(name) for name in _FIELDS}
    correlation_id = str(uuid.uuid4())
    try:
        async with AsyncSession(engine) as session, session.begin():
            # First, as it does no I/O: a bad order is refused before anything is stored.
            message_id = orders.outbox(session).send_command(
                "PlaceOrder",
                aggregate_id=order_id,
                payload=payload,
                message_context={"correlation_id": correlation_id},
            )
            await _store(session, order_id, payload, correlation_id)
    except TxboxError as exc:  # the contract refuses the message (its payload, its id)
        return JSONResponse({"error": str(exc)}, status_code=422)
    except _Exists:  # rolled back, and with it the PlaceOrder just written
        return JSONResponse({"error": f"order {order_id} exists already"}, status_code=409)
    return JSONResponse(
        {"id": order_id, "status": PLACED, "message_id": str(message_id), "correlation_id": correlation_id},
        status_code=201,
        headers={"Location": f"/orders/{order_id}"},
    )


class _Exists(Exception):
    """The order's id is taken (rolls the request's transaction back)."""


async def _store(session: AsyncSession, order_id: str, payload: dict[str, Any], correlation_id: str) -> None:
    values = {f"{name}_": value for name, value in payload.items()}
    stored = await session.scalar(_STORE, {"order_id": order_id, "correlation_id_": correlation_id, **values})
    if stored is None:
        raise _Exists(order_id)


async def _show(engine: AsyncEngine, order_id: str) -> JSONResponse:
    async with AsyncSession(engine) as session:
        order = await session.get(Order, order_id)
    if order is None:
        return JSONResponse({"error": f"no order {order_id}"}, status_code=404)
    return JSONResponse(
        {
            "id": order.id,
            "customer": order.customer,
            "sku": order.sku,
            "quantity": order.quantity,
            "status": order.status,
            "reason": order.reason,
            "finished_at": order.finished_at.isoformat() if order.finished_at else None,
        }
    )


async def _json(request: Request) -> dict[str, Any] | JSONResponse:
    raw = b""
    async for chunk in request.stream():  # bounded: a client cannot make us buffer more
        raw += chunk
        if len(raw) > MAX_BODY:
            return JSONResponse({"error": f"the body is over {MAX_BODY} bytes"}, status_code=413)
    try:
        body = json.loads(raw)
    except ValueError as exc:
        return JSONResponse({"error": f"the body is not JSON: {exc}"}, status_code=400)
    if not isinstance(body, dict):
        return JSONResponse(
            {"error": "the body must be a JSON object: {customer, sku, quantity[, id]}"}, status_code=400
        )
    return body


app = create_app()
