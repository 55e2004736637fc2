"""The inventory service's own tables: stock per SKU and one reservation per order.

Own Alembic history in ``examples/inventory/migrations`` (version table
``public.alembic_version``), beside the framework's ``txbox.txbox_alembic_version``.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import CheckConstraint, DateTime, Integer, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

RESERVED = "reserved"
REJECTED = "rejected"


class Base(DeclarativeBase):
    pass


class Stock(Base):
    __tablename__ = "stock"
    __table_args__ = (
        # The database, not only the handler, refuses to oversell.
        CheckConstraint("available >= 0", name="stock_available_check"),
        CheckConstraint("reserved >= 0", name="stock_reserved_check"),
    )

    sku: Mapped[str] = mapped_column(Text, primary_key=True)
    available: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    reserved: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Reservation(Base):
    """The answer given to one order; the primary key makes a second answer impossible."""

    __tablename__ = "reservations"
    __table_args__ = (CheckConstraint("status IN ('reserved', 'rejected')", name="reservations_status_check"),)

    order_id: Mapped[str] = mapped_column(Text, primary_key=True)
    sku: Mapped[str] = mapped_column(Text)
    quantity: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(Text)
    reason: Mapped[str | None] = mapped_column(Text)
    correlation_id: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=text("clock_timestamp()"))
