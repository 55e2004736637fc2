"""Migration 0004 upgrades, downgrades and upgrades again; its views answer."""

from __future__ import annotations

import psycopg

from framework import migrate
from framework.db import conninfo


def test_0004_round_trip(empty_database_url: str) -> None:
    migrate.upgrade(empty_database_url)
    migrate.downgrade(empty_database_url, revision="0003")
    with psycopg.connect(conninfo(empty_database_url)) as conn:
        views = conn.execute("SELECT count(*) FROM pg_views WHERE schemaname = 'txbox'").fetchone()
        assert views == (0,)
    migrate.upgrade(empty_database_url)
    with psycopg.connect(conninfo(empty_database_url)) as conn:
        conn.execute(
            "INSERT INTO txbox.dead_letters (source, reason, fingerprint, delivery_key) "
            "VALUES ('broker', 'r', 'f', 'k')"
        )
        summary = conn.execute("SELECT fingerprint, total, open FROM txbox.dead_letter_summary").fetchall()
        assert summary == [("f", 1, 1)]
        assert conn.execute("SELECT status FROM txbox.dead_letter_status").fetchall() == [("open",)]
        assert len(conn.execute("SELECT * FROM txbox.message_status").fetchall()) == 2
        assert conn.execute("SELECT died FROM txbox.dead_letter_timeline").fetchall() == [(1,)]
