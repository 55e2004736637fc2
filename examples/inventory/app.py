"""The inventory service: keeps stock, reserves it for placed orders or rejects them.

Run its daemons with ``txbox run --app examples.inventory.app:service``. It accepts
RestockItem commands (their token must grant ``inventory:restock``) and consumes the order
service's OrderPlaced events; it never calls the order service, it only publishes
StockReserved / StockRejected.
"""

from __future__ import annotations

from sqlalchemy import bindparam, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from examples import _defaults, messages
from examples.inventory.models import REJECTED, RESERVED, Reservation, Stock
from framework import CommandHandler, EventHandler, Message, Outbox, Service

service = Service.from_env(
    service="inventory-service",
    database_url=_defaults.database_url("txbox_demo_inventory"),
    contracts_dir=_defaults.contracts_dir(),
)
# Verifies the tokens of RestockItem commands: TXBOX_JWT_* if set, else the demo's secret.
service.jwt = _defaults.jwt_settings()


# Statements built once, with bind parameters, on the tables rather than the mapped
# classes: a third of the CPU of building an ORM statement per message, and no autoflush,
# so the Reservation rows of a whole batch are flushed together (see examples/orders/app.py).
_stock = Stock.metadata.tables[Stock.__tablename__]
_upsert = insert(_stock).values(sku=bindparam("sku_"), available=bindparam("quantity_"))
_RESTOCK = _upsert.on_conflict_do_update(
    index_elements=[_stock.c.sku], set_={"available": _stock.c.available + _upsert.excluded.available}
)
_RESERVE = (
    update(_stock)
    .where(_stock.c.sku == bindparam("sku_"), _stock.c.available >= bindparam("quantity_"))
    .values(available=_stock.c.available - bindparam("quantity_"), reserved=_stock.c.reserved + bindparam("quantity_"))
    .returning(_stock.c.available)
)
_AVAILABLE = select(_stock.c.available).where(_stock.c.sku == bindparam("sku_"))


class RestockItem(CommandHandler):
    message_type = "RestockItem"
    # Only a sender whose token grants it may add stock; others' commands are dead-lettered
    # as `unauthorized` before this handler runs.
    permissions = frozenset({"inventory:restock"})

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        restock = message.payload_as(messages.RestockItem)  # typed by `txbox codegen`
        sku, quantity = restock["sku"], restock["quantity"]
        session.execute(_RESTOCK, {"sku_": sku, "quantity_": quantity})


class ReserveStock(EventHandler):
    """Reserve the ordered quantity in one conditional UPDATE: no read-modify-write race."""

    message_type = "OrderPlaced"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        placed = message.payload_as(messages.OrderPlaced)
        order_id, sku, quantity = placed["order_id"], placed["sku"], placed["quantity"]
        left = session.scalar(_RESERVE, {"sku_": sku, "quantity_": quantity})
        reason = None
        if left is None:
            available = session.scalar(_AVAILABLE, {"sku_": sku})
            reason = "unknown sku" if available is None else f"only {available} left"
        status = RESERVED if reason is None else REJECTED
        # Primary key order_id: a second answer for one order cannot commit.
        session.add(
            Reservation(
                order_id=order_id,
                sku=sku,
                quantity=quantity,
                status=status,
                reason=reason,
                correlation_id=message.correlation_id,
            )
        )
        payload = messages.StockReserved(order_id=order_id, sku=sku, quantity=quantity)  # StockRejected: same shape
        if reason is not None:
            payload["reason"] = reason
        # The aggregate is this order's reservation: its messages form their own ordering
        # lane (segment), instead of one lane per SKU that would serialize the relay.
        outbox.publish_event(
            "StockReserved" if status == RESERVED else "StockRejected", aggregate_id=order_id, payload=payload
        )


service.register(RestockItem())
service.register(ReserveStock())
