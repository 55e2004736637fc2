"""orders table

Revision ID: orders_0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "orders_0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "orders",
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("customer", sa.Text, nullable=False),
        sa.Column("sku", sa.Text, nullable=False),
        sa.Column("quantity", sa.Integer, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("correlation_id", sa.Text),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("placed_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.text("clock_timestamp()")),
        sa.Column("finished_at", sa.DateTime(timezone=True)),
        sa.Column("final_transitions", sa.Integer, nullable=False, server_default="0"),
        sa.CheckConstraint("status IN ('placed', 'completed', 'cancelled')", name="orders_status_check"),
        sa.CheckConstraint("quantity > 0", name="orders_quantity_check"),
    )
    op.create_index("orders_status_idx", "orders", ["status"])


def downgrade() -> None:
    op.drop_table("orders")
