"""stock and reservations tables

Revision ID: inventory_0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "inventory_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "stock",
        sa.Column("sku", sa.Text, primary_key=True),
        sa.Column("available", sa.Integer, nullable=False, server_default="0"),
        sa.Column("reserved", sa.Integer, nullable=False, server_default="0"),
        sa.CheckConstraint("available >= 0", name="stock_available_check"),
        sa.CheckConstraint("reserved >= 0", name="stock_reserved_check"),
    )
    op.create_table(
        "reservations",
        sa.Column("order_id", sa.Text, primary_key=True),
        sa.Column("sku", sa.Text, nullable=False),
        sa.Column("quantity", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("correlation_id", sa.Text),
        sa.Column(
            "created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")
        ),
        sa.CheckConstraint("status IN ('reserved', 'rejected')", name="reservations_status_check"),
    )


def downgrade() -> None:
    op.drop_table("reservations")
    op.drop_table("stock")
