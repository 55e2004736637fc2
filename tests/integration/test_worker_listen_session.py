"""The LISTEN session the workers of one database share (framework/worker/wake.py): what a
worker took on it goes back when a statement fails, and a worker whose statement found
the session broken hears so at its next drain (docs/explanation/daemons.md, "Wake-ups").

Driven directly on a loop that is not running: each call is what the worker's cycle does.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from pika.adapters.select_connection import IOLoop

from framework import db
from framework.worker.wake import Listeners, Notifications
from tests import support
from tests.apps.helpers import query, scalar
from txbox_tools.chaos.instances import PrivatePostgres

pytestmark = pytest.mark.integration

KEY = 7_700_001  # an advisory lock key of this test's own


@pytest.fixture
def loop() -> Iterator[IOLoop]:
    loop = IOLoop()
    yield loop
    loop.close()


def _member(database_url: str, listeners: Listeners) -> Notifications:
    return Notifications(database_url, "t_inbox_insert", help_channel="t_inbox_help", lock_key=KEY, listeners=listeners)


def _lock_free(database_url: str) -> bool:
    """Another session can take the key (and gives it back at once: explicitly, since a
    closed session's locks go only when its backend has exited)."""
    with psycopg.connect(_dsn(database_url), autocommit=True) as conn:
        row = conn.execute("SELECT pg_try_advisory_lock(%s)", (KEY,)).fetchone()
        assert row is not None
        if row[0]:
            conn.execute("SELECT pg_advisory_unlock(%s)", (KEY,))
        return bool(row[0])


def _dsn(database_url: str) -> str:
    return psycopg.conninfo.make_conninfo(**db.connect_params(database_url))


def test_a_listen_that_fails_after_the_lock_gives_the_lock_back(loop: IOLoop) -> None:
    """A real standby (a failover target not promoted yet) takes the advisory lock but
    refuses LISTEN ("cannot execute LISTEN during recovery"), an error that is not a lost
    connection: the session stays, but the lock taken just before is given back, so
    another replica can lead. Once the standby is promoted the next open leads."""
    with PrivatePostgres() as primary, primary.standby() as standby:
        url = standby.url("postgres")
        member = _member(url, Listeners())
        with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
            member.open(loop)
        assert not member.listening
        assert _lock_free(url), "the lock went back with the failed open"
        standby.promote()
        assert member.open(loop) and member.leading
        assert not _lock_free(url)
        member.close()
        support.wait_until(lambda: _lock_free(url), 10, message="the lock gone with the session")


def test_a_worker_whose_statement_broke_the_session_hears_it_at_its_next_drain(database_url: str, loop: IOLoop) -> None:
    """Two tenants' workers on one session, one the listener of its schema, the other
    not (its schema's lock held by a replica elsewhere): the second's try for the lock
    finds the session gone. It is told (-1) at its next drain, and the other at once, so
    both listen again rather than sleep a poll interval deaf."""
    listeners = Listeners()
    told: list[int] = []
    leader = _member(database_url, listeners)
    follower = Notifications(
        database_url, "u_inbox_insert", help_channel="u_inbox_help", lock_key=KEY + 1, listeners=listeners
    )
    leader.on_notify = told.append
    with psycopg.connect(_dsn(database_url), autocommit=True) as elsewhere:
        elsewhere.execute("SELECT pg_advisory_lock(%s)", (KEY + 1,))
        assert leader.open(loop) and follower.open(loop)
        assert leader.leading and not follower.leading
        [(pid,)] = query(
            database_url,
            "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'txbox-worker-listen'",
        )
        assert scalar(database_url, "SELECT pg_terminate_backend(%s, 10000)", (pid,))
        assert not follower.take_turn(0)
        assert follower.drain() == -1
        assert told == [-1]
        elsewhere.execute("SELECT pg_advisory_unlock(%s)", (KEY + 1,))
    assert follower.open(loop) and leader.open(loop)
    assert leader.leading and follower.leading, "the replica elsewhere let go: the lock is free"
    for member in (leader, follower):
        member.close()
    support.wait_until(lambda: _lock_free(database_url), 10, message="the lock gone with the session")
