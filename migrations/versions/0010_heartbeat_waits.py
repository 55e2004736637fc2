"""Heartbeats carry a daemon's wait: a receiver standing by for its turn, and since when.

A receiver that is ready yet does not consume — another replica holds the turn, or it
holds the turn while RabbitMQ still counts another consumer, such as that of a node
lost for good — said so only in its own ``/readyz``. Its heartbeat now carries the wait,
so the dashboard's daemon list shows it too (docs/explanation/operations.md, "Probes, logs and
liveness"): ``waiting_since`` (the database's clock), ``waiting_queue`` (the queue whose
turn it waits for) and ``waiting_detail`` (the state and the line it logged), all null
while it works. The texts are bounded: the daemon cuts them to these lengths.

Locks: nullable columns without a default change the catalog only; their checks read
the small table once under its ACCESS EXCLUSIVE lock (a beat waits that long). Daemons
of the code before ignore the columns; daemons of this code beat without them until
the migration has run.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"""
        ALTER TABLE {s}.daemon_heartbeats
            ADD COLUMN waiting_since timestamptz,
            ADD COLUMN waiting_queue text
                CONSTRAINT daemon_heartbeats_waiting_queue_check CHECK (char_length(waiting_queue) <= 255),
            ADD COLUMN waiting_detail text
                CONSTRAINT daemon_heartbeats_waiting_detail_check CHECK (char_length(waiting_detail) <= 500)
        """
    )


def downgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"ALTER TABLE {s}.daemon_heartbeats DROP COLUMN waiting_since, DROP COLUMN waiting_queue, "
        "DROP COLUMN waiting_detail"
    )
