"""Migration 0011: the inbox's insert NOTIFY is left out only by a transaction that asks.

`txbox run`'s receiver claims what it stores for its own worker in the inserting
transaction (docs/explanation/daemons.md, "The hand-off in one process"); everyone else's
inserts must still wake the listener.
"""

from __future__ import annotations

import uuid

import psycopg
import pytest

from framework import names
from framework.db import conninfo
from framework.sql import inbox as inbox_sql
from tests.integration.test_inbox_insert import _row

pytestmark = pytest.mark.integration

CHANNEL = names.notify_channel("txbox", names.INBOX)


def _notified(listener: psycopg.Connection[tuple[object, ...]]) -> int:
    """NOTIFYs that reached ``listener`` since the last look (the insert has committed)."""
    listener.execute("SELECT 1")  # reads what the server sent meanwhile
    return sum(1 for _ in listener.notifies(timeout=0.2, stop_after=10))


def _insert(database_url: str, *, quiet: bool) -> None:
    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        if quiet:
            cur.execute("SELECT set_config(%s, 'off', true)", (names.QUIET_NOTIFY_SETTING,))
        inbox_sql.insert_rows(cur, "txbox", [_row(1, id=uuid.uuid4()), _row(2, id=uuid.uuid4())])


def test_an_insert_notifies_unless_its_transaction_set_the_setting_off(database_url: str) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as listener:
        listener.execute(f'LISTEN "{CHANNEL}"')
        _insert(database_url, quiet=False)
        assert _notified(listener) == 1
        _insert(database_url, quiet=True)
        assert _notified(listener) == 0
        _insert(database_url, quiet=False)  # the setting was the transaction's alone
        assert _notified(listener) == 1
