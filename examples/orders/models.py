"""The order service's own tables (its business data), beside the framework's `txbox.*`.

They have their own Alembic history (``examples/orders/migrations``, version table
``public.alembic_version``); the framework keeps its version in
``txbox.txbox_alembic_version``, so the two histories never touch each other.
"""

from __future__ import annotations

from datetime import datetime
from typing import Final

from sqlalchemy import CheckConstraint, DateTime, Integer, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

PLACED: Final = "placed"
COMPLETED: Final = "completed"
CANCELLED: Final = "cancelled"
FINAL = (COMPLETED, CANCELLED)


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    __table_args__ = (
        CheckConstraint("status IN ('placed', 'completed', 'cancelled')", name="orders_status_check"),
        CheckConstraint("quantity > 0", name="orders_quantity_check"),
    )

    id: Mapped[str] = mapped_column(Text, primary_key=True)
    customer: Mapped[str] = mapped_column(Text)
    sku: Mapped[str] = mapped_column(Text)
    quantity: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(Text, default=PLACED)
    reason: Mapped[str | None] = mapped_column(Text)
    #: The saga's correlation id, from the PlaceOrder message's `message_context`.
    correlation_id: Mapped[str | None] = mapped_column(Text)
    #: When the PlaceOrder command was written (its envelope timestamp): latency starts here.
    requested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    placed_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=text("clock_timestamp()"))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    #: How often a stock result moved this order to a final state. Exactly-once means 1
    #: for every finished order; the demo's summary checks it.
    final_transitions: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
