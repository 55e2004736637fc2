"""The SQL of retention, for the outbox and the inbox alike (framework/retention.py).

A pass walks the table's ``*_created_at_idx`` in creation order, one page of at most
``limit`` prunable rows at a time, each page its own short transaction. A finished row
was created before it finished, so ``created_at < bound`` (the later of the two
cutoffs) bounds the index range, and the page's filter picks the rows that may go.
The pass keeps its place in ``after`` (the newest ``created_at`` of the last page), so
the rows that must stay (pending, or abandoned with an open letter) are read once per
pass, not once per page. Why not an index on ``processed_at``: the publisher's and the
worker's marks would each pay one more index entry per row, on their hot path, for a
statement that runs once a minute (docs/explanation/operations.md, "Retention").
"""

from __future__ import annotations

from psycopg import sql

from framework import names

# Which dead letters speak for a row of each table (their ``source``).
LETTER_SOURCES = {names.OUTBOX: ("outbox",), names.INBOX: ("inbox", "broker")}

# Params: after, limit, retention (seconds), abandoned (seconds or NULL: only once resolved), sources.
# "No letter still open" is a scalar subquery, not NOT EXISTS: inside the OR, the planner
# made NOT EXISTS a hashed subplan that read every open dead letter for every page; this
# form probes dead_letters_message_id_idx for the abandoned rows only.
_PAGE = """
SELECT t.ctid FROM {table} t
WHERE t.created_at >= %(after)s
  AND t.created_at < greatest(now() - make_interval(secs => %(retention)s),
                              now() - make_interval(secs => %(abandoned)s))
  AND (t.processed_at < now() - make_interval(secs => %(retention)s)
       OR (t.abandoned_at IS NOT NULL AND t.processed_at IS NULL
           AND (t.abandoned_at < now() - make_interval(secs => %(abandoned)s)
                OR (t.abandoned_at < now() - make_interval(secs => %(retention)s)
                    AND (SELECT d.id FROM {letters} d
                         WHERE d.message_id = t.id AND d.source = ANY(%(sources)s)
                           AND d.resolved_at IS NULL AND d.discarded_at IS NULL LIMIT 1) IS NULL))))
ORDER BY t.created_at
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
"""


def _format(schema: str, table: str, text: str) -> sql.Composed:
    return sql.SQL(text).format(
        table=sql.Identifier(schema, table),
        letters=sql.Identifier(schema, names.DEAD_LETTERS),
        page=sql.SQL(_PAGE).format(
            table=sql.Identifier(schema, table), letters=sql.Identifier(schema, names.DEAD_LETTERS)
        ),
    )


def delete_page(schema: str, table: str) -> sql.Composed:
    """One page of prunable rows deleted; returns each one's ``created_at`` and whether it was processed.

    The outbox's rows go directly. The rows are found again by ``ctid`` (a TID scan, as
    the claims do), locked by the page so a replay or discard that holds one is skipped.
    """
    return _format(
        schema,
        table,
        """DELETE FROM {table} WHERE ctid = ANY(ARRAY({page}))
           RETURNING created_at, processed_at IS NOT NULL""",
    )


def select_page(schema: str, table: str) -> sql.Composed:
    """One page of prunable rows, locked: ``(id, created_at, processed)``, for the inbox,
    whose rows go through :func:`framework.dedup.forget` (docs/explanation/guarantees.md, "Dedup memory")."""
    return _format(
        schema,
        table,
        """SELECT id, created_at, processed_at IS NOT NULL FROM {table}
           WHERE ctid = ANY(ARRAY({page})) ORDER BY created_at""",
    )


def table_costs(schema: str, table: str) -> sql.Composed:
    """(heap bytes, index bytes, dead tuples, live tuples) of the table, from the catalog and the
    statistics collector."""
    return sql.SQL(
        """SELECT pg_table_size(c.oid), pg_indexes_size(c.oid), coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0)
           FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid
           WHERE c.oid = to_regclass({name})"""
    ).format(name=sql.Literal(f'"{schema}"."{table}"'))


def vacuum(schema: str, table: str) -> sql.Composed:
    """A plain VACUUM (no exclusive lock; DML goes on), skipped if another one (autovacuum) holds the table."""
    return sql.SQL("VACUUM (SKIP_LOCKED) {}").format(sql.Identifier(schema, table))


def try_lock() -> sql.SQL:
    """Params: key. A session-level advisory lock, taken if free (one pruner per table and service)."""
    return sql.SQL("SELECT pg_try_advisory_lock(%(key)s)")


def unlock() -> sql.SQL:
    return sql.SQL("SELECT pg_advisory_unlock(%(key)s)")
