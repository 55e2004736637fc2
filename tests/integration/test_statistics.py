"""Plans that statistics from another moment cannot spoil, and the daemons' own ANALYZE.

Statistics taken while every row was processed tell the planner there are no pending
rows; statistics taken over a small table misjudge it once it has grown. Under both, the
daemons' statements once chose plans that cost seconds per claim. These tests rebuild
that state in a real database and read the plans; the refresh
(framework.db.Statistics) stays as a second line for plans not seen yet.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
import pytest
from psycopg import sql

from framework import db, names
from framework.sql import inbox as q
from framework.sql import outbox as relay_sql
from framework.worker import guard
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


def _counted(conn: psycopg.Connection[Any]) -> int:
    """The inbox's row count as the planner knows it (set by ANALYZE, transactionally)."""
    row = conn.execute("SELECT reltuples FROM pg_class WHERE oid = 'txbox.inbox'::regclass").fetchone()
    return int(row[0]) if row else 0


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


def test_a_refresh_after_a_burst_counts_it(stale_inbox: psycopg.Connection[Any]) -> None:
    assert _counted(stale_inbox) == PENDING

    statistics = db.Statistics("txbox", names.INBOX, min_interval=30.0)
    assert statistics.refresh(stale_inbox.cursor(), now=100.0, urgent=True)

    assert _counted(stale_inbox) == 2 * PENDING


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
        assert _counted(stale_inbox) == PENDING

        statistics.after_claim(conn, seconds=0.62, rows=200, log=log)  # a misplan's time
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert _counted(stale_inbox) == 2 * PENDING


OUTBOX_ROWS = """
INSERT INTO txbox.outbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload, segment,
                          processed_at)
SELECT gen_random_uuid(), 'PlaceOrder', 'order', g::text, 'command', 'order-service.order.place-order',
       '{{"n": 1}}', 'order:' || (g % 50), {processed}
FROM generate_series(1, {count}) g
"""


def _plan(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any], *, generic: bool = False) -> str:
    """The plan of ``statement`` for ``params``; ``generic``: the one plan a connection made
    with ``generic_plans=True`` (the relay's) keeps for every run, whatever the values."""
    if not generic:
        return "\n".join(r[0] for r in conn.execute("EXPLAIN " + statement, params))
    order = list(dict.fromkeys(re.findall(r"%\((\w+)\)s", statement)))
    text = re.sub(r"%\((\w+)\)s", lambda m: f"${order.index(m[1]) + 1}", statement).replace("%%", "%")
    # The id lists as uuid[] literals (the statement's casts apply to parameters, not to EXECUTE's arguments).
    values = [[uuid.UUID(v) for v in params[n]] if n in ("marked", "ids") else params[n] for n in order]
    conn.execute("SET plan_cache_mode = force_generic_plan")
    conn.execute(f"PREPARE txbox_generic AS {text}")
    try:
        cur = psycopg.ClientCursor(conn)  # EXECUTE's arguments are literals, not bound parameters
        args = ", ".join(["%s"] * len(values))
        return "\n".join(r[0] for r in cur.execute(f"EXPLAIN EXECUTE txbox_generic({args})", values))
    finally:
        conn.execute("DEALLOCATE txbox_generic")
        conn.execute("RESET plan_cache_mode")


def _ids(conn: psycopg.Connection[Any], table: str) -> list[str]:
    return [str(r[0]) for r in conn.execute(f"SELECT id FROM txbox.{table} WHERE processed_at IS NULL LIMIT 30")]


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


# The relay runs its statements with generic plans (framework/db.py, generic_plans), and the
# worker's fenced statements get one by PostgreSQL's choice (docs/explanation/daemons.md, "Generic
# plans"): each of their plans is checked both ways, the plan for these values and the one for any.
PLANNED = pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])


def _planned(statements: Iterable[str]) -> Any:
    """PLANNED for a set of statements: each with its custom plan, those that run generic plans also generic."""
    generic = ("relay", "worker presume", "worker release")
    cases = [(s, False) for s in statements] + [(s, True) for s in statements if s.startswith(generic)]
    return pytest.mark.parametrize(
        ("statement", "generic"), cases, ids=[f"{s}-{'generic' if g else 'custom'}" for s, g in cases]
    )


@PLANNED
def test_the_relay_window_claim_finds_its_heads_without_a_join_whatever_the_statistics_say(
    database: str, generic: bool
) -> None:
    # Joined by id under statistics from a smaller outbox, the heads were a nested loop
    # that re-ran the whole window for every row (quadratic in the window); by ctid there
    # is no join to misplan.
    with psycopg.connect(db.conninfo(db_url(database)), autocommit=True) as conn:
        _analyzed_small_then_grown(conn, OUTBOX_ROWS, names.OUTBOX, processed=PENDING, pending=200)
        statement = relay_sql.claim_window("txbox").as_string(conn)
        plan = _plan(
            conn,
            statement,
            {"window": 800, "limit": 200, "lease": 60.0, "marked": _ids(conn, names.OUTBOX), "ages": [0.0] * 30},
            generic=generic,
        )

    assert "Join" not in plan and "Nested Loop" not in plan, plan


@PLANNED
def test_the_relay_mark_probes_each_marked_row_without_a_join_whatever_the_statistics_say(
    database: str, generic: bool
) -> None:
    # As a join against the marked rows, statistics from a smaller outbox made the probe
    # a nested loop over every pending row per marked row (9 s for a mark of 1,101 rows).
    with psycopg.connect(db.conninfo(db_url(database)), autocommit=True) as conn:
        _analyzed_small_then_grown(conn, OUTBOX_ROWS, names.OUTBOX, processed=0, pending=PENDING)
        statement = relay_sql.mark_published("txbox").as_string(conn)
        plan = _plan(conn, statement, {"ids": _ids(conn, names.OUTBOX), "probe": True}, generic=generic)

    assert "Join" not in plan and "Nested Loop" not in plan and "SubPlan" in plan, plan


def _probe_indexes(plan: str, table: str) -> set[str]:
    """What the plan's probes (the scans of alias ``p``) read: index names, or the scan."""
    lines = plan.splitlines()
    used: set[str] = set()
    for n, line in enumerate(lines):
        if f" on {table} p " not in line + " ":
            continue
        if using := re.search(r"using (\w+)", line):
            used.add(using[1])
        elif "Bitmap Heap Scan" in line:
            used |= set(re.findall(r"Bitmap Index Scan on (\w+)", "\n".join(lines[n + 1 : n + 6])))
        else:
            used.add(line.split("->")[-1].split("(")[0].strip())
    return used


def _fenced(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    """Params of the worker's fenced statements: claims as first started."""
    ids = _ids(conn, names.INBOX)
    return {"ids": ids, "started": [0] * len(ids)}


Statement = Callable[[psycopg.Connection[Any]], tuple[sql.Composed, dict[str, Any]]]

PROBES: dict[str, tuple[str, Statement]] = {
    "worker claim": (
        names.INBOX,
        lambda conn: (q.claim("txbox", suspects=False, park=False), {"limit": 200, "lease": 60.0}),
    ),
    "worker presume": (
        names.INBOX,
        lambda conn: (q.presume_processed("txbox"), _fenced(conn)),
    ),
    "relay claim": (
        names.OUTBOX,
        lambda conn: (
            relay_sql.claim("txbox"),
            {"limit": 200, "lease": 60.0, "marked": _ids(conn, names.OUTBOX), "ages": [0.0] * 30},
        ),
    ),
    "relay window claim": (
        names.OUTBOX,
        lambda conn: (
            relay_sql.claim_window("txbox"),
            {"window": 800, "limit": 200, "lease": 60.0, "marked": _ids(conn, names.OUTBOX), "ages": [0.0] * 30},
        ),
    ),
    "relay mark": (
        names.OUTBOX,
        lambda conn: (relay_sql.mark_published("txbox"), {"ids": _ids(conn, names.OUTBOX), "probe": True}),
    ),
}


def _plan_after_a_burst(database: str, table: str, make: Statement, *, generic: bool = False) -> str:
    """The plan of a statement over ``table`` analyzed while all its rows were processed, then a burst
    (``generic``: see :func:`_plan`)."""
    rows = ROW if table == names.INBOX else OUTBOX_ROWS
    with psycopg.connect(db.conninfo(db_url(database)), autocommit=True) as conn:
        conn.execute(rows.format(processed="now()", count=PENDING))
        conn.execute(db.analyze("txbox", table))
        conn.execute(rows.format(processed="NULL", count=PENDING))
        composed, params = make(conn)
        return _plan(conn, composed.as_string(conn), params, generic=generic)


@_planned(PROBES)
def test_each_head_of_segment_probe_reads_the_segment_index_whatever_the_statistics_say(
    database: str, statement: str, generic: bool
) -> None:
    # The planner believed both partial indexes empty and probed through *_due_idx, every
    # earlier pending row per probe (seconds per claim). Only the segment index's
    # predicate matches a probe now.
    table, make = PROBES[statement]
    plan = _plan_after_a_burst(database, table, make, generic=generic)
    assert _probe_indexes(plan, table) == {f"{table}_segment_idx"}, plan


BY_ID: dict[str, tuple[str, Statement]] = {
    "relay mark": PROBES["relay mark"],
    "relay release": (names.OUTBOX, lambda conn: (relay_sql.release("txbox"), {"ids": _ids(conn, names.OUTBOX)})),
    "worker presume": PROBES["worker presume"],
    "worker release": (
        names.INBOX,
        lambda conn: (q.release("txbox"), _fenced(conn)),
    ),
}


@_planned(BY_ID)
def test_lookups_by_id_read_no_partial_index_whatever_the_statistics_say(
    database: str, statement: str, generic: bool
) -> None:
    # They find their rows by cost (primary key, or a scan of a small table), never by
    # walking a partial index of every pending row that the statistics call empty.
    table, make = BY_ID[statement]
    plan = _plan_after_a_burst(database, table, make, generic=generic)
    walks = [m[0] for m in re.finditer(r"using \w+_(?:due|segment)_idx on \w+(?: (\w+))?", plan) if m[1] != "p"]
    assert not walks, plan


@_planned(["relay claim", "relay window claim"])
def test_the_marks_a_claim_carries_read_no_partial_index_whatever_the_statistics_say(
    database: str, statement: str, generic: bool
) -> None:
    # The claim marks the published rows of earlier claims by id (alias m): like the
    # mark of its own, by primary key, never by walking a partial index of pending rows.
    table, make = PROBES[statement]
    plan = _plan_after_a_burst(database, table, make, generic=generic)
    assert "outbox m" in plan, plan
    assert not re.findall(r"using \w+_(?:due|segment)_idx on \w+ m\b", plan), plan


def test_the_worker_presumption_keeps_one_generic_plan_when_postgresql_chooses(database: str) -> None:
    # The batch connection runs the handlers' queries too, so the worker leaves the choice
    # between generic and custom plans to PostgreSQL. Its presumption, with the arrays
    # passed straight to unnest, got a custom plan at every batch of one: planned again
    # each time (docs/explanation/daemons.md, "Generic plans").
    statement = guard.armed(q.presume_processed("txbox"))
    batches = 12
    with psycopg.connect(db.conninfo(db_url(database))) as conn:  # plan_cache_mode as the server's
        conn.execute(ROW.format(processed="NULL", count=batches))
        conn.execute(guard.create_guard())
        conn.commit()
        for id_ in _ids(conn, names.INBOX)[:batches]:
            # Prepared from the first run (the worker's is from its sixth: psycopg's threshold).
            presumed = conn.execute(statement, {"ids": [id_], "started": [0]}, prepare=True).fetchall()
            assert [str(row[0]) for row in presumed] == [id_]
            conn.execute(guard.disarm())
            conn.commit()
        [(generic, custom)] = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s",
            ("%txbox_guard%",),
        ).fetchall()
    # PostgreSQL always plans the first five runs for their values, then compares.
    assert (generic, custom) == (batches - 5, 5)
