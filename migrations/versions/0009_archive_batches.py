"""The manifest of `txbox archive` batches, in PostgreSQL instead of files beside the archive.

`txbox archive` is a Spark job that writes to any Hadoop storage (file://, hdfs://,
s3a://), where renames are not atomic and fsync is not offered; its crash safety rests
on this table instead: a batch's ids are recorded here before its Parquet is written, and
the batch is marked done in the transaction that deletes its rows (docs/explanation/analytics.md,
"The Spark job on a cluster"). A new table: no lock on the others.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"""
        CREATE TABLE {s}.archive_batches (
            batch_id text PRIMARY KEY,
            service text NOT NULL,
            table_name text NOT NULL,
            ids uuid[] NOT NULL,
            location text NOT NULL,
            state text NOT NULL DEFAULT 'pending',
            rows integer,
            deleted integer,
            created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            finished_at timestamptz,
            CONSTRAINT archive_batches_state_check CHECK (state IN ('pending', 'done')),
            CONSTRAINT archive_batches_table_name_check CHECK (table_name IN ('outbox', 'inbox'))
        )
        """
    )
    op.execute(f"CREATE INDEX archive_batches_pending_idx ON {s}.archive_batches (created_at) WHERE state = 'pending'")
    op.execute(
        f"COMMENT ON TABLE {s}.archive_batches IS "
        "'One row per txbox archive batch: the ids it covers, written before its Parquet; done once deleted.'"
    )


def downgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(f"DROP TABLE {s}.archive_batches")
