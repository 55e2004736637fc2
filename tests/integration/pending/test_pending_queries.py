"""framework/pending.py and its statements against a real database: each state, the filters, the order, the plans."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from psycopg import sql

from framework import names, pending
from framework.sql import pending as pending_sql
from tests.integration.dead_letters import seed
from tests.integration.pending.conftest import put


def _states(conn: Any, **filters: Any) -> dict[uuid.UUID, str]:
    return {r["id"]: r["state"] for r in pending.list_pending(conn, "txbox", pending_sql.Filters(**filters))}


@pytest.mark.parametrize("table", [names.OUTBOX, names.INBOX])
def test_each_pending_row_has_one_state(conn: Any, table: str) -> None:
    due = put(conn, table)
    scheduled = put(conn, table, lease=600)
    leased = put(conn, table, started=1, lease=60)
    failing = put(conn, table, started=1, finished=1, lease=30, last_error="KeyError: 'price'")
    died = put(conn, table, started=1, lease=-5)  # the run never finished and its lease is over
    put(conn, table, started=1, finished=1, processed=True)  # finished: not pending

    assert _states(conn, table=table) == {
        due: "due",
        scheduled: "scheduled",
        leased: "leased",
        failing: "failing",
        died: "failing",
    }
    summary = pending.counts(conn, "txbox", table)
    assert summary["pending"] == 5
    assert {s: v["n"] for s, v in summary["states"].items()} == {
        "leased": 1,
        "failing": 2,
        "parked": 0,
        "scheduled": 1,
        "due": 1,
    }


def test_parked_follows_the_workers_segment_policy(conn: Any) -> None:
    m = seed.envelope()
    seed.abandoned(conn, names.INBOX, m)  # its dead letter is open
    segment = f"order:{m.aggregate_id}"
    behind = put(conn, segment=segment)
    elsewhere = put(conn)

    assert _states(conn, park=True) == {behind: "parked", elsewhere: "due"}
    assert _states(conn, park=False) == {behind: "due", elsewhere: "due"}
    assert pending.counts(conn, "txbox", names.INBOX, park=True)["states"]["parked"]["n"] == 1
    # Once the dead letter is discarded the segment goes on.
    conn.execute("UPDATE txbox.dead_letters SET discarded_at = now()")
    assert _states(conn, park=True)[behind] == "due"


def test_filters_and_order(conn: Any) -> None:
    old = put(conn, age=3600, segment="s-1")
    new = put(conn, age=60, segment="s-1")
    urgent = put(conn, age=10, priority=5)
    other_type = put(conn, age=7200, message_type="CancelOrder")

    listed = [r["id"] for r in pending.list_pending(conn, "txbox", pending_sql.Filters())]
    assert listed == [urgent, other_type, old, new]  # highest priority, then oldest first
    assert [r["id"] for r in pending.list_pending(conn, "txbox", pending_sql.Filters(message_type="CancelOrder"))] == [
        other_type
    ]
    assert [r["id"] for r in pending.list_pending(conn, "txbox", pending_sql.Filters(segment="s-1"))] == [old, new]
    assert [r["id"] for r in pending.list_pending(conn, "txbox", pending_sql.Filters(older_than=1800))] == [
        other_type,
        old,
    ]
    assert [r["id"] for r in pending.list_pending(conn, "txbox", pending_sql.Filters(limit=2))] == [urgent, other_type]
    assert pending.list_pending(conn, "txbox", pending_sql.Filters(table=names.OUTBOX)) == []


@pytest.mark.parametrize(
    ("given", "complaint"),
    [
        ({"table": "dead_letters"}, "table must be one of outbox, inbox"),
        ({"state": "stuck"}, "state must be one of leased, failing, parked, scheduled, due"),
        ({"older_than": -1.0}, "must not be negative"),
        ({"limit": 0}, "limit must be from 1 to 1000"),
        ({"limit": 5000}, "limit must be from 1 to 1000"),
    ],
)
def test_bad_filters_say_what_is_wrong(given: dict[str, Any], complaint: str) -> None:
    with pytest.raises(ValueError, match=complaint):
        pending_sql.Filters(**given)


def _plan(conn: Any, filters: pending_sql.Filters) -> str:
    query, params = pending_sql.list_query("txbox", filters)
    rows = conn.execute(sql.SQL("EXPLAIN ") + query, params).fetchall()
    return "\n".join(r["QUERY PLAN"] for r in rows)


@pytest.mark.parametrize("table", [names.OUTBOX, names.INBOX])
def test_listing_reads_the_pending_indexes_not_the_history(conn: Any, table: str) -> None:
    """100k rows, 1k of them pending: every listing walks a partial pending index."""
    inbox = table == names.INBOX
    conn.execute(
        sql.SQL(
            """INSERT INTO {t} (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload, segment,
                   created_at, processed_at{extra_cols})
               SELECT gen_random_uuid(), 'T' || (g % 5), 'order', g::text, 'command', 'r', '{{}}',
                      'order:' || (g % 1000),
                      now() - make_interval(secs => 100000 - g), CASE WHEN g <= 99000 THEN now() END{extra_vals}
               FROM generate_series(1, 100000) g"""
        ).format(
            t=sql.Identifier("txbox", table),
            extra_cols=sql.SQL(", message_timestamp, queue" if inbox else ""),
            extra_vals=sql.SQL(", now(), 'q'" if inbox else ""),
        )
    )
    conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier("txbox", table)))
    for filters, index in (
        (pending_sql.Filters(table=table, park=True), f"{table}_due_idx"),
        (
            pending_sql.Filters(table=table, state="failing", message_type="T1", older_than=60, park=True),
            f"{table}_due_idx",
        ),
        (pending_sql.Filters(table=table, segment="order:7"), f"{table}_segment_idx"),
    ):
        plan = _plan(conn, filters)
        assert f"Index Scan using {index}" in plan, plan
        assert "Seq Scan" not in plan and "created_at_idx" not in plan, plan
    counting = "\n".join(
        r["QUERY PLAN"] for r in conn.execute(sql.SQL("EXPLAIN ") + pending_sql.counts_query("txbox", table, park=True))
    )
    assert f"Seq Scan on {table}" not in counting and "created_at_idx" not in counting, counting
    assert len(pending.list_pending(conn, "txbox", pending_sql.Filters(table=table))) == 50
    assert pending.counts(conn, "txbox", table)["pending"] == 1000
