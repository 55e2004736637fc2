"""The inventory service: keeps stock, reserves it for placed orders or rejects them.

Run its daemons with ``txbox run --app examples.inventory.app:service``. It accepts
RestockItem commands and consumes the order service's OrderPlaced events; it never
calls the order service, it only publishes StockReserved / StockRejected.
"""

from __future__ import annotations

from sqlalchemy import update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from examples import _defaults
from examples.inventory.models import REJECTED, RESERVED, Reservation, Stock
from framework import CommandHandler, EventHandler, Message, Outbox, Service

service = Service.from_env(
    service="inventory-service",
    database_url=_defaults.database_url("txbox_demo_inventory"),
    contracts_dir=_defaults.contracts_dir(),
)


class RestockItem(CommandHandler):
    message_type = "RestockItem"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        sku, quantity = message.payload["sku"], message.payload["quantity"]
        upsert = insert(Stock).values(sku=sku, available=quantity)
        session.execute(
            upsert.on_conflict_do_update(
                index_elements=[Stock.sku], set_={"available": Stock.available + upsert.excluded.available}
            )
        )


class ReserveStock(EventHandler):
    """Reserve the ordered quantity in one conditional UPDATE: no read-modify-write race."""

    message_type = "OrderPlaced"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        order_id = message.payload["order_id"]
        sku, quantity = message.payload["sku"], message.payload["quantity"]
        left = session.scalar(
            update(Stock)
            .where(Stock.sku == sku, Stock.available >= quantity)
            .values(available=Stock.available - quantity, reserved=Stock.reserved + quantity)
            .returning(Stock.available)
        )
        reason = None
        if left is None:
            stock = session.get(Stock, sku)
            reason = "unknown sku" if stock is None else f"only {stock.available} left"
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
        payload = {"order_id": order_id, "sku": sku, "quantity": quantity}
        if reason is not None:
            payload["reason"] = reason
        # The aggregate is this order's reservation: its messages form their own ordering
        # lane (segment), instead of one lane per SKU that would serialize the relay.
        outbox.publish_event(
            "StockReserved" if status == RESERVED else "StockRejected", aggregate_id=order_id, payload=payload
        )


service.register(RestockItem())
service.register(ReserveStock())
