"""Inbox tombstones: the dedup memory that outlives `txbox archive`.

The inbox's primary key is what makes a duplicate delivery a no-op (``ON CONFLICT (id)
DO NOTHING``). Archiving used to delete processed rows, and with them that memory: a
late duplicate, or the replay of a dead letter, was then stored and applied again. Now
the archive keeps a row that is still inside ``TXBOX_DEDUP_WINDOW`` as a *tombstone*:
``archived_at`` set, payload, context, metadata and error stripped (the payload's
SHA-256 stays in ``metadata``, so a later copy can still be told apart from a conflict).
The receiver's insert is unchanged: the tombstone holds the id in the same primary key.
``inbox_tombstone_idx`` (tombstones only) finds those whose window has passed.

Locks: adding a nullable column without a default changes the catalog only; the index
is built by one read of the inbox under a SHARE lock (writes wait, about as long as
revision 0006's index builds). Downgrade deletes the tombstones: the older code cannot
tell them from processed rows, and would archive their stripped copy again.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(f"ALTER TABLE {s}.inbox ADD COLUMN archived_at timestamptz")
    op.execute(
        f"CREATE INDEX inbox_tombstone_idx ON {s}.inbox ((coalesce(processed_at, abandoned_at))) "
        "WHERE archived_at IS NOT NULL"
    )


def downgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(f"DELETE FROM {s}.inbox WHERE archived_at IS NOT NULL")
    op.execute(f"DROP INDEX {s}.inbox_tombstone_idx")
    op.execute(f"ALTER TABLE {s}.inbox DROP COLUMN archived_at")
