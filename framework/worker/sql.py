"""Named SQL of the worker: claim, presume-and-fence, settle. Kept out of the daemon's logic.

The claim takes due rows that are at the head of their sequential segment (no pending
sequential row of the segment comes before them; parallel rows need no such check),
skips rows another worker has locked, and in the same statement counts the start and
sets the lease. Rows whose previous run never finished (``started > finished`` with an
expired lease: the process died) are claimed alone — see the daemon.

The claim's UPDATE finds the locked rows by ``ctid`` (stable while ``due`` holds their
row locks): a TID scan whatever the statistics say. Matched by ``id``, a planner that had
last analyzed a small inbox scanned the whole table for every claim (3-8 ms per claim
at 500 msg/s, growing with the table until the next ANALYZE).
"""

from __future__ import annotations

from psycopg import sql

from framework import names
from framework.tables import pending_by_id, pending_in_segment

_RETURNING = (
    "t.id, t.message_type, t.aggregate_type, t.aggregate_id, t.message_version, t.routing_key, t.payload,"
    " t.message_context, t.metadata, t.message_timestamp, t.started_attempts, t.finished_attempts, t.priority,"
    " t.created_at, t.segment"
)

_CLAIM = f"""
WITH due AS (
    SELECT i.ctid
    FROM {{inbox}} i
    WHERE i.processed_at IS NULL AND i.abandoned_at IS NULL
      AND i.locked_until <= now()
      AND {{which}}
      AND (i.concurrency = 'parallel' OR NOT EXISTS (
            SELECT 1 FROM {{inbox}} p
            WHERE p.segment = i.segment
              AND {pending_in_segment("p")}
              AND p.concurrency = 'sequential'
              AND (p.priority > i.priority
                   OR (p.priority = i.priority AND (p.created_at, p.id) < (i.created_at, i.id)))))
      {{park}}
    ORDER BY {{order}}
    LIMIT %(limit)s
    FOR UPDATE OF i SKIP LOCKED
)
UPDATE {{inbox}} t
SET started_attempts = t.started_attempts + 1,
    locked_until = now() + make_interval(secs => %(lease)s)
WHERE t.ctid = ANY(ARRAY(SELECT ctid FROM due))
RETURNING {{returning}}
"""

# Parked: an abandoned sequential message of the segment whose dead letter is still open.
_PARK = """
      AND NOT EXISTS (
            SELECT 1 FROM {inbox} a
            JOIN {dead_letters} d ON d.message_id = a.id AND d.source = 'inbox'
            WHERE a.abandoned_at IS NOT NULL AND a.segment = i.segment AND a.concurrency = 'sequential'
              AND d.replayed_at IS NULL AND d.discarded_at IS NULL)
"""


def claim(schema: str, *, suspects: bool, park: bool) -> sql.Composed:
    # Suspects are found through inbox_suspect_idx (oldest expired lease first); the
    # others in priority, then arrival order through inbox_due_idx.
    which = "i.started_attempts > i.finished_attempts" if suspects else "i.started_attempts <= i.finished_attempts"
    order = "i.locked_until" if suspects else "i.priority DESC, i.created_at"
    inbox = sql.Identifier(schema, names.INBOX)
    park_sql = (
        sql.SQL(_PARK).format(inbox=inbox, dead_letters=sql.Identifier(schema, names.DEAD_LETTERS))
        if park
        else sql.SQL("")
    )
    return sql.SQL(_CLAIM).format(
        inbox=inbox, which=sql.SQL(which), park=park_sql, order=sql.SQL(order), returning=sql.SQL(_RETURNING)
    )


# Our claims that still carry the started_attempts they had when we claimed them (the
# fencing token); params ``ids`` and ``started``. Each is looked up through the primary
# key by a scalar subquery, then updated by ``ctid`` (a TID scan). Both spell "pending"
# so that it matches no partial index's predicate (framework/tables.py): with statistics
# taken while the inbox was small, the planner picked one of them and scanned every
# pending row per id (0.8 s per batch); a plain join to the unnest hashed the whole inbox
# per batch instead.
_FENCE = f"""t.ctid = ANY(ARRAY(
    SELECT (SELECT i.ctid FROM {{inbox}} i WHERE i.id = c.id AND i.started_attempts = c.started
              AND {pending_by_id("i")})
    FROM unnest(%(ids)s::uuid[], %(started)s::int2[]) AS c(id, started)))
    AND {pending_by_id("t")}"""


# The presumption drops the message's auth_token (no longer needed once processed: no
# token at rest, docs/architecture.md "Secrets"); a run that did not succeed gets it back
# from the claimed row (param: the token or NULL) for its next run.
_TOKEN_BACK = "jsonb_strip_nulls(jsonb_build_object('auth_token', %s::text))"


def presume_processed(schema: str) -> sql.Composed:
    """First statement of the processing transaction: mark our claims processed, lock them.

    It is the fence (a row whose ``started_attempts`` moved on was claimed again by
    someone else after our lease ran out, and is left alone; a row locked by us cannot
    be claimed while we work) and the success mark in one pass over the rows. The few
    that do not succeed are corrected by the statements below before the commit, so
    nobody ever sees the presumption. ``processed_at`` is thus when the batch started.

    Each row comes back with whether a later sequential row of its segment waits behind
    it: the batch's commit makes that row due, and only then is a claim worth making
    before the next NOTIFY. The probe reads the statement's snapshot, in which the batch
    is still pending, so it skips the batch's own rows.
    """
    return sql.SQL(
        "UPDATE {inbox} t SET processed_at = clock_timestamp(), finished_attempts = t.finished_attempts + 1, "
        "locked_until = clock_timestamp(), metadata = t.metadata - 'auth_token' "
        f"WHERE {_FENCE} "
        "RETURNING t.id, t.concurrency = 'sequential' AND EXISTS ("
        "SELECT 1 FROM {inbox} p WHERE p.segment = t.segment AND p.concurrency = 'sequential' "
        f"AND {pending_in_segment('p')} AND p.id <> ALL(%(ids)s::uuid[]))"
    ).format(inbox=sql.Identifier(schema, names.INBOX))


def mark_failed(schema: str) -> sql.Composed:
    """Undo the presumption for a failed run: due again after the backoff (the run counted)."""
    return sql.SQL(
        "UPDATE {inbox} SET processed_at = NULL, "
        "locked_until = clock_timestamp() + make_interval(secs => %(delay)s), last_error = %(error)s, "
        f"metadata = metadata || {_TOKEN_BACK % '%(auth_token)s'} "
        "WHERE id = %(id)s"
    ).format(inbox=sql.Identifier(schema, names.INBOX))


def mark_abandoned(schema: str) -> sql.Composed:
    """Undo the presumption for an abandon; ``finished`` is how many runs it settles in all."""
    return sql.SQL(
        "UPDATE {inbox} SET processed_at = NULL, finished_attempts = finished_attempts - 1 + %(finished)s, "
        "abandoned_at = clock_timestamp(), locked_until = clock_timestamp(), last_error = %(error)s "
        "WHERE id = %(id)s"
    ).format(inbox=sql.Identifier(schema, names.INBOX))


def unclaim(schema: str) -> sql.Composed:
    """Undo the presumption *and* the claim of messages that were never run (lease too short)."""
    return sql.SQL(
        "UPDATE {inbox} t SET processed_at = NULL, finished_attempts = t.finished_attempts - 1, "
        "started_attempts = t.started_attempts - 1, locked_until = clock_timestamp(), "
        f"metadata = t.metadata || {_TOKEN_BACK % 'c.token'} "
        "FROM unnest(%s::uuid[], %s::text[]) AS c(id, token) WHERE t.id = c.id"
    ).format(inbox=sql.Identifier(schema, names.INBOX))


def release(schema: str) -> sql.Composed:
    """Give back claims that were never run (stop, lost database): not an attempt, not poison."""
    return sql.SQL(
        "UPDATE {inbox} t SET started_attempts = t.started_attempts - 1, locked_until = clock_timestamp() "
        f"WHERE {_FENCE}"
    ).format(inbox=sql.Identifier(schema, names.INBOX))


def backlog(schema: str) -> sql.Composed:
    return sql.SQL(
        "SELECT count(*), COALESCE(extract(epoch FROM now() - min(locked_until) "
        "FILTER (WHERE locked_until <= now())), 0) FROM {inbox} WHERE processed_at IS NULL AND abandoned_at IS NULL"
    ).format(inbox=sql.Identifier(schema, names.INBOX))
