"""Receiver and worker database objects: the index of suspect inbox rows.

A suspect is a pending row whose last run never finished (``started_attempts >
finished_attempts``): in flight, or its worker died. The worker looks for suspects with
an expired lease on every cycle; this small partial index (only rows in flight) keeps
that lookup from scanning the whole backlog.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"""CREATE INDEX inbox_suspect_idx ON {s}.inbox (locked_until)
            WHERE processed_at IS NULL AND abandoned_at IS NULL AND started_attempts > finished_attempts"""
    )


def downgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(f"DROP INDEX {s}.inbox_suspect_idx")
