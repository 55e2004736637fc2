"""The daemons' own ANALYZE (framework.db.Statistics): why it exists, and what it does.

Statistics taken while every row was processed tell the planner there are no pending
rows; after a burst it then probes each head of segment through the index of all
pending rows. These tests rebuild that state in a real inbox and read the plans; the
last three show statements whose plans stale statistics cannot spoil.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest

from framework import db, names
from framework.publisher import sql as relay_sql
from framework.worker import sql as q
from tests import support
from tests.support import db_url

pytestmark = pytest.mark.integration

PENDING = 3000
ROW = """
INSERT INTO txbox.inbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
                         segment, queue, message_timestamp, processed_at)
SELECT gen_random_uuid(), 'PlaceOrder', 'order', g::text, 'command', 'order-service.order.place-order',
       '{{"n": 1}}', 'order:' || g, 'order-service:inbox', now(), {processed}
FROM generate_series(1, {count}) g
"""


def _probe_index(conn: psycopg.Connection[Any]) -> str:
    """The index the claim's head-of-segment probe (its NOT EXISTS) reads."""
    claim = q.claim("txbox", suspects=False, park=False).as_string(conn)
    plan = "\n".join(r[0] for r in conn.execute("EXPLAIN " + claim, {"limit": 200, "lease": 60.0}))
    probe = plan[plan.index("SubPlan") :]
    for index in ("inbox_segment_idx", "inbox_due_idx"):
        if index in probe:
            return index
    raise AssertionError(f"no index in the probe:\n{plan}")


def _burst(conn: psycopg.Connection[Any]) -> None:
    """PENDING new pending rows, and wait until the statistics counters show them."""
    before = _modified(conn)
    conn.execute(ROW.format(processed="NULL", count=PENDING))
    support.wait_until(lambda: _modified(conn) >= before + PENDING, 20, message="the counters to see the burst")


def _modified(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT n_mod_since_analyze FROM pg_stat_user_tables WHERE relid = 'txbox.inbox'::regclass"
    ).fetchone()
    return int(row[0]) if row else 0


@pytest.fixture
def stale_inbox(database: str) -> psycopg.Connection[Any]:
    """An inbox analyzed while all its rows were processed, then a burst of pending rows."""
    conn = psycopg.connect(db.conninfo(db_url(database)), autocommit=True)
    conn.execute(ROW.format(processed="now()", count=PENDING))
    conn.execute(db.analyze("txbox", names.INBOX))
    _burst(conn)
    return conn


def test_a_refresh_after_a_burst_gives_the_claim_its_segment_index_back(stale_inbox: psycopg.Connection[Any]) -> None:
    assert _probe_index(stale_inbox) == "inbox_due_idx"  # the misplan: every pending row per probe

    statistics = db.Statistics("txbox", names.INBOX, min_interval=30.0)
    assert statistics.refresh(stale_inbox.cursor(), now=100.0, urgent=True)

    assert _probe_index(stale_inbox) == "inbox_segment_idx"


def test_refreshes_are_spaced_and_skip_the_json_columns(stale_inbox: psycopg.Connection[Any]) -> None:
    statistics = db.Statistics("txbox", names.INBOX, min_interval=30.0)
    assert statistics.refresh(stale_inbox.cursor(), now=100.0)
    _burst(stale_inbox)  # stale again

    assert not statistics.refresh(stale_inbox.cursor(), now=101.0, urgent=True)  # urgent: 2 s apart
    assert not statistics.refresh(stale_inbox.cursor(), now=120.0)  # timer: min_interval apart
    assert statistics.refresh(stale_inbox.cursor(), now=102.5, urgent=True)

    analyzed = {
        r[0]
        for r in stale_inbox.execute(
            "SELECT attname FROM pg_stats WHERE schemaname = 'txbox' AND tablename = 'inbox'"
        ).fetchall()
    }
    assert {"segment", "processed_at", "locked_until"} <= analyzed <= set(db.PLANNING_COLUMNS)


def test_a_fresh_table_needs_no_refresh(database: str) -> None:
    with psycopg.connect(db.conninfo(db_url(database)), autocommit=True) as conn:
        assert not db.Statistics("txbox", names.INBOX, min_interval=30.0).refresh(conn.cursor(), now=100.0)


def test_only_a_slow_claim_refreshes_and_no_transaction_is_left_open(
    database: str, stale_inbox: psycopg.Connection[Any]
) -> None:
    statistics = db.Statistics("txbox", names.INBOX, min_interval=30.0)
    log = logging.getLogger("test")
    with psycopg.connect(db.conninfo(db_url(database))) as conn:  # not autocommit, as the worker's claims
        statistics.after_claim(conn, seconds=0.01, rows=200, log=log)  # a fresh plan's time
        assert _probe_index(stale_inbox) == "inbox_due_idx"

        statistics.after_claim(conn, seconds=0.62, rows=200, log=log)  # the misplan's time
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert _probe_index(stale_inbox) == "inbox_segment_idx"


OUTBOX_ROWS = """
INSERT INTO txbox.outbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload, segment,
                          processed_at)
SELECT gen_random_uuid(), 'PlaceOrder', 'order', g::text, 'command', 'order-service.order.place-order',
       '{{"n": 1}}', 'order:' || (g % 50), {processed}
FROM generate_series(1, {count}) g
"""


def _plan(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> str:
    return "\n".join(r[0] for r in conn.execute("EXPLAIN " + statement, params))


def _analyzed_small_then_grown(
    conn: psycopg.Connection[Any], rows: str, table: str, *, processed: int, pending: int
) -> None:
    """Statistics taken over 10 processed rows, then ``processed`` and ``pending`` more rows."""
    conn.execute(rows.format(processed="now()", count=10))
    conn.execute(db.analyze("txbox", table))
    if processed:
        conn.execute(rows.format(processed="now()", count=processed))
    conn.execute(rows.format(processed="NULL", count=pending))


def test_the_worker_claim_updates_its_rows_by_tid_whatever_the_statistics_say(database: str) -> None:
    # Analyzed while small, then grown: matched by id, the UPDATE scanned the inbox per claim.
    with psycopg.connect(db.conninfo(db_url(database)), autocommit=True) as conn:
        _analyzed_small_then_grown(conn, ROW, names.INBOX, processed=PENDING, pending=20)
        plan = _plan(conn, q.claim("txbox", suspects=False, park=False).as_string(conn), {"limit": 200, "lease": 60.0})

    scans = [line for line in plan.splitlines() if "->" in line and " on inbox t " in line]
    assert scans and all("Tid Scan" in scan for scan in scans), plan


def test_the_relay_window_claim_finds_its_heads_without_a_join_whatever_the_statistics_say(database: str) -> None:
    # Joined by id under statistics from a smaller outbox, the heads were a nested loop
    # that re-ran the whole window for every row (quadratic in the window); by ctid there
    # is no join to misplan.
    with psycopg.connect(db.conninfo(db_url(database)), autocommit=True) as conn:
        _analyzed_small_then_grown(conn, OUTBOX_ROWS, names.OUTBOX, processed=PENDING, pending=200)
        statement = relay_sql.claim_window("txbox").as_string(conn)
        plan = _plan(conn, statement, {"window": 800, "limit": 200, "lease": 60.0})

    assert "Join" not in plan and "Nested Loop" not in plan, plan


def test_the_relay_mark_probes_each_marked_row_without_a_join_whatever_the_statistics_say(database: str) -> None:
    # As a join against the marked rows, statistics from a smaller outbox made the probe
    # a nested loop over every pending row per marked row (9 s for a mark of 1,101 rows).
    with psycopg.connect(db.conninfo(db_url(database)), autocommit=True) as conn:
        _analyzed_small_then_grown(conn, OUTBOX_ROWS, names.OUTBOX, processed=0, pending=PENDING)
        ids = [str(r[0]) for r in conn.execute("SELECT id FROM txbox.outbox WHERE processed_at IS NULL LIMIT 30")]
        statement = relay_sql.mark_published("txbox").as_string(conn)
        plan = _plan(conn, statement, {"ids": ids, "probe": True})

    assert "Join" not in plan and "Nested Loop" not in plan and "SubPlan" in plan, plan
    # The UPDATE finds its ids by cost (primary key, or a scan of this small table), never
    # by walking a partial index of every pending row that the stale statistics call empty.
    assert "_idx on outbox t" not in plan, plan
