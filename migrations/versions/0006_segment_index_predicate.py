"""The segment indexes get a predicate of their own, so only the head-of-segment probes use them.

``outbox_segment_idx`` and ``inbox_segment_idx`` shared the predicate of the ``*_due_idx``
indexes (``processed_at IS NULL AND abandoned_at IS NULL``). PostgreSQL picks a partial
index for a query whose WHERE implies the predicate's text, so every probe "is there an
earlier pending row of this segment?" could be served by either. With statistics taken
before a burst the planner believes both are empty, and often chose ``*_due_idx``,
walking every earlier pending row per probe: 1-2.7 s per claim in ``txbox bench e2e``,
until the daemons' own ANALYZE caught up. Spelled ``coalesce(processed_at, abandoned_at)
IS NULL`` (the same rows), the segment index is the only partial index a probe can use,
and no other query's WHERE implies its predicate (framework/tables.py, where the
spellings live).

Locks: ``DROP INDEX`` locks each table exclusively until the commit, and the new index
is built by one sequential read of the table (0.2 s for a million outbox rows in
memory), so the daemons and the services' outbox writes wait that long. Run it at a
quiet moment, or after ``txbox archive`` has made the tables small.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-24
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

TABLES = ("outbox", "inbox")


def _recreate(predicate: str) -> None:
    s = schema_of(op.get_context())
    for t in TABLES:
        op.execute(f"DROP INDEX {s}.{t}_segment_idx")
        op.execute(f"CREATE INDEX {t}_segment_idx ON {s}.{t} (segment, created_at) WHERE {predicate}")


def upgrade() -> None:
    _recreate("coalesce(processed_at, abandoned_at) IS NULL")


def downgrade() -> None:
    _recreate("processed_at IS NULL AND abandoned_at IS NULL")
