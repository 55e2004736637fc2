"""Daemon heartbeats: which daemons run, where, and when each last made progress.

Every daemon process upserts its row (service, kind, host, pid) every few seconds on a
connection of its own, outside any business transaction; rows of processes gone for a
day are pruned by the daemons themselves. The dashboard's overview reads them
(docs/explanation/operations.md, "Probes, logs and liveness"). A new table: no lock on the others.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"""
        CREATE TABLE {s}.daemon_heartbeats (
            service text NOT NULL,
            kind text NOT NULL,
            host text NOT NULL,
            pid integer NOT NULL,
            started_at timestamptz NOT NULL,
            last_progress timestamptz NOT NULL,
            beat_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            beat_interval double precision NOT NULL,
            stuck_after double precision NOT NULL,
            ready boolean NOT NULL,
            PRIMARY KEY (service, kind, host, pid)
        )
        """
    )
    op.execute(
        f"COMMENT ON TABLE {s}.daemon_heartbeats IS "
        "'Liveness of the daemons: upserted every few seconds by each running daemon.'"
    )


def downgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(f"DROP TABLE {s}.daemon_heartbeats")
