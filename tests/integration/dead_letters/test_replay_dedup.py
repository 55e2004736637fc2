"""Replay and discard after `txbox archive`, id conflicts, and discarding a replayed letter.

Judged from the database: a message "runs" when its inbox row is pending (the worker
claims exactly those), so each test checks which rows are pending and which letters
are open, resolved or discarded.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import psycopg.rows
from psycopg.types.json import Jsonb

from framework.analytics.archive import Archiver
from framework.contracts import Registry
from framework.db import conninfo
from framework.dead_letters import replay
from framework.sql import inbox as inbox_sql
from tests.integration.dead_letters import seed

S = seed.SCHEMA
SERVICE = "order-service"


def _row(conn: psycopg.Connection[Any], mid: uuid.UUID) -> dict[str, Any] | None:
    return conn.execute("SELECT * FROM txbox.inbox WHERE id = %s", (mid,)).fetchone()


def _letter(conn: psycopg.Connection[Any], lid: int) -> dict[str, Any]:
    row = conn.execute("SELECT * FROM txbox.dead_letters WHERE id = %s", (lid,)).fetchone()
    assert row is not None
    return row


def _pending(conn: psycopg.Connection[Any]) -> int:
    n = conn.execute("SELECT count(*) AS n FROM txbox.inbox WHERE processed_at IS NULL AND abandoned_at IS NULL")
    return int(n.fetchone()["n"])


def _archive(spark: Any, database_url: str, root: Path, window: timedelta = timedelta(days=7)) -> Any:
    return Archiver(database_url=database_url, service=SERVICE, root=root, dedup_window=window, spark=spark).run(
        timedelta(0)
    )


def _processed(conn: psycopg.Connection[Any], m: Any) -> None:
    """``m`` received and processed (as the receiver and worker leave it)."""
    row = seed._message_row(m, "inbox")
    cols = ", ".join(row)
    marks = ", ".join(f"%({c})s" for c in row)
    conn.execute(
        f"INSERT INTO txbox.inbox ({cols}, started_attempts, finished_attempts, processed_at) "
        f"VALUES ({marks}, 1, 1, clock_timestamp())",
        row,
    )


def test_replaying_after_the_archive_does_not_run_a_processed_message_again(
    conn: Any, registry: Registry, database_url: str, tmp_path: Path, spark: Any
) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m)
    replay.replay(conn, S, registry, SERVICE, [lid])
    # The worker processes the replay; the archive runs before any sweep resolved the letter.
    conn.execute(
        "UPDATE txbox.inbox SET processed_at = clock_timestamp(), finished_attempts = 1 WHERE id = %s", (m.message_id,)
    )
    result = _archive(spark, database_url, tmp_path)

    [again] = replay.replay(conn, S, registry, SERVICE, [lid])
    assert (again.action, again.ok) == ("skipped", False)
    assert _pending(conn) == 0
    assert _letter(conn, lid)["resolved_at"] is not None
    assert result.tombstoned == 1 and result.deleted["inbox"] == 0

    # A broker letter of the same message collected after the archive: the tombstone answers.
    late = seed.rejected(conn, m)
    [outcome] = replay.replay(conn, S, registry, SERVICE, [late])
    assert outcome.action == "already-processed"
    assert _pending(conn) == 0
    assert conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0

    # Past the window the id is forgotten, but the letters were resolved: still no rerun.
    purged = _archive(spark, database_url, tmp_path, window=timedelta(microseconds=1))
    assert purged.purged == 1 and _row(conn, m.message_id) is None
    outcomes = replay.replay(conn, S, registry, SERVICE, [lid, late])
    assert [(o.action, o.ok) for o in outcomes] == [("skipped", False), ("skipped", False)]
    assert _pending(conn) == 0 and conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0


def test_an_archived_abandoned_message_is_filled_in_from_its_letter_on_replay(
    conn: Any, registry: Registry, database_url: str, tmp_path: Path, spark: Any
) -> None:
    m = seed.envelope(quantity=3)
    lid = seed.abandoned(conn, "inbox", m)
    _archive(spark, database_url, tmp_path)
    tomb = _row(conn, m.message_id)
    assert tomb is not None and tomb["archived_at"] is not None and tomb["payload"] == {}

    [outcome] = replay.replay(conn, S, registry, SERVICE, [lid])

    assert (outcome.action, outcome.ok) == ("inbox-reset", True)
    row = _row(conn, m.message_id)
    assert row is not None
    assert row["archived_at"] is None and row["payload"] == m.payload and row["message_context"] == m.message_context
    assert "auth_token" not in row["metadata"]  # a dead letter never stores the token (framework.redaction)
    assert row["abandoned_at"] is None and row["processed_at"] is None


def test_replaying_a_letter_whose_id_the_inbox_holds_with_other_content_is_an_id_conflict(
    conn: Any, registry: Registry, database_url: str, tmp_path: Path, spark: Any
) -> None:
    stored = seed.envelope(quantity=1)
    _processed(conn, stored)
    other = seed.envelope(message_id=stored.message_id, quantity=2)  # same id, other payload
    live = seed.rejected(conn, other)

    [outcome] = replay.replay(conn, S, registry, SERVICE, [live])

    assert (outcome.action, outcome.ok) == ("id-conflict", False)
    assert "new message_id" in outcome.detail
    letter = _letter(conn, live)
    assert letter["replayed_at"] is None and letter["resolved_at"] is None  # stays open
    row = _row(conn, stored.message_id)
    assert row is not None and row["payload"] == stored.payload  # not overwritten
    assert conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0

    # The archive does not resolve the conflicting letter, and the tombstone still tells them apart.
    _archive(spark, database_url, tmp_path)
    assert _letter(conn, live)["resolved_at"] is None
    [after] = replay.replay(conn, S, registry, SERVICE, [live])
    assert (after.action, after.ok) == ("id-conflict", False)
    same = seed.rejected(conn, stored)
    [duplicate] = replay.replay(conn, S, registry, SERVICE, [same])
    assert duplicate.action == "already-processed"


def test_the_receivers_conflict_check_tells_a_duplicate_from_a_reused_id_live_and_archived(
    conn: Any, database_url: str, tmp_path: Path, spark: Any
) -> None:
    live, archived = seed.envelope(), seed.envelope()
    _processed(conn, live)
    _processed(conn, archived)
    _archive(spark, database_url, tmp_path)
    conn.execute(
        "UPDATE txbox.inbox SET archived_at = NULL, payload = %s WHERE id = %s", (Jsonb(live.payload), live.message_id)
    )

    class Row:
        def __init__(self, m: Any, **change: Any) -> None:
            self.id, self.message_type, self.aggregate_type = m.message_id, m.message_type, m.aggregate_type
            self.aggregate_id = change.get("aggregate_id", m.aggregate_id)
            # Key order and spacing differ from what was stored: still the same JSON value.
            payload = dict(reversed(list(change.get("payload", m.payload).items())))
            self.payload = json.dumps(payload, indent=1)

    def conflicts(rows: list[Any]) -> dict[Any, str]:
        """What the receiver finds: id → the fields that differ (inbox_sql.conflicting, as in a batch)."""
        with conn.cursor(row_factory=psycopg.rows.tuple_row) as cur:
            return {rows[i].id: fields for i, fields in inbox_sql.conflicting(cur, S, rows, set())}

    found = conflicts(
        [
            Row(live),
            Row(archived),
            Row(live, payload={**live.payload, "quantity": 9}),
            Row(archived, aggregate_id="elsewhere"),
            Row(seed.envelope()),  # not stored at all
        ]
    )
    assert found == {live.message_id: "payload", archived.message_id: "aggregate_id"}
    assert conflicts([Row(live), Row(archived)]) == {}
    assert conflicts([Row(archived, payload={**archived.payload, "sku": "X"})]) == {archived.message_id: "payload"}


def test_discarding_a_replayed_letter_takes_the_replay_back(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m)
    replay.replay(conn, S, registry, SERVICE, [lid])
    assert _pending(conn) == 1

    [outcome] = replay.discard(conn, S, [lid])

    assert _pending(conn) == 0, "the discarded replay would still run"
    assert (outcome.action, outcome.ok) == ("discarded", True) and "taken back" in outcome.detail
    row = _row(conn, m.message_id)
    assert row is not None and row["abandoned_at"] is not None and "taken back" in row["last_error"]
    letter = _letter(conn, lid)
    assert letter["discarded_at"] is not None and letter["attempts"]["history"][-1]["action"] == "replay-taken-back"


def test_discarding_a_replay_that_is_running_or_ran_is_refused(
    conn: Any, registry: Registry, database_url: str
) -> None:
    running, ran, sent = seed.envelope(), seed.envelope(), seed.envelope()
    lids = [seed.abandoned(conn, "inbox", running), seed.abandoned(conn, "inbox", ran)]
    lids.append(seed.abandoned(conn, "outbox", sent))
    replay.replay(conn, S, registry, SERVICE, lids)
    conn.execute("UPDATE txbox.inbox SET processed_at = clock_timestamp() WHERE id = %s", (ran.message_id,))
    # A publisher claimed the outbox row (the publish may be on the wire already).
    conn.execute("UPDATE txbox.outbox SET started_attempts = 1 WHERE id = %s", (sent.message_id,))
    with psycopg.connect(conninfo(database_url)) as worker:  # a worker's transaction holds the row
        worker.execute("SELECT 1 FROM txbox.inbox WHERE id = %s FOR UPDATE", (running.message_id,))

        outcomes = replay.discard(conn, S, lids)

        worker.rollback()
    assert [(o.action, o.ok) for o in outcomes] == [("refused", False)] * 3
    assert "being processed" in outcomes[0].detail and "processed already" in outcomes[1].detail
    letters = [_letter(conn, lid) for lid in lids]
    assert all(letter["discarded_at"] is None for letter in letters)
    assert letters[1]["resolved_at"] is not None
    assert _row(conn, running.message_id)["abandoned_at"] is None  # type: ignore[index]
    assert conn.execute("SELECT abandoned_at FROM txbox.outbox").fetchone()["abandoned_at"] is None
