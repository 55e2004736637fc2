"""The SQL of txbox, one module per table: its statements and its one row codec.

``outbox``, ``inbox``, ``dead_letters`` and ``redeliveries``; ``messages`` and
``pending`` for statements that serve the outbox and the inbox alike, ``retention`` for
the pruners' pages of both; ``reports`` for
the report tables of ``txbox analyze``. Every writer of a table goes through that
table's one INSERT, and claimed rows are read by column name. The SQLAlchemy metadata
the migrations are checked against stays in framework/tables.py (docs/architecture.md,
"Tables and their SQL").
"""

from __future__ import annotations

from psycopg import sql


def rendered(statement: sql.Composable) -> bytes:
    """``statement`` as the bytes psycopg sends, for a statement a daemon runs per batch.

    psycopg renders a composed statement again at every execute, adapting each identifier
    and literal anew: 0.26 ms for the inbox INSERT and 0.2 ms for the outbox's, 10-45 µs
    for the claims, paid by every batch of one at a moderate load. Rendered once, the
    statement costs psycopg a cache lookup. Without a connection: txbox's identifiers are
    ASCII (``names.valid_schema``), the same bytes in every client encoding.
    """
    return statement.as_bytes()
