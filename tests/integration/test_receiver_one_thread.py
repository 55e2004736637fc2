"""The receiver's batch write sent without waiting (framework/receiver/write.py) against
the real PostgreSQL, and the shape of pika's I/O loop it is watched on (framework.amqp.ioloop).

docs/explanation/daemons.md, "The daemons and their threads": a batch of new rows is one
round trip (the PREPARE too, the first time), committed in it; a batch with a row that is not new, or one
PostgreSQL refuses, stores nothing and leaves the connection idle and usable.
"""

from __future__ import annotations

import socket
import uuid
from typing import Any

import psycopg
from psycopg import pq

from framework import amqp
from framework.db import conninfo
from framework.receiver.write import InboxWrite, Step
from framework.sql import inbox as inbox_sql
from tests.integration.test_inbox_insert import _row


def _insert(rows: list[Any]) -> Step:
    params: list[bytes | None] = [inbox_sql.batch_json(rows).encode(), str(len(rows)).encode()]
    return Step(b"inbox", inbox_sql.insert_all_new_sql("txbox"), params)


def _write(conn: psycopg.Connection[Any], rows: list[Any]) -> InboxWrite:
    done: list[bool] = []
    held = conn.execute("SELECT 1 FROM pg_prepared_statements WHERE name = 'inbox'").fetchone()
    conn.rollback()
    write = InboxWrite(conn, [_insert(rows)], lambda: done.append(True), prepared=frozenset({b"inbox"} if held else ()))
    write.send()
    write.wait()
    assert done == [True], "on_done runs once, when the write is over"
    assert write.error is not None or write.prepared == {b"inbox"}, "prepared in the write's own round trip"
    return write


def _ids(database_url: str) -> set[uuid.UUID]:
    with psycopg.connect(conninfo(database_url)) as conn:
        return {row[0] for row in conn.execute("SELECT id FROM txbox.inbox").fetchall()}


def test_a_batch_of_new_rows_is_committed_in_its_one_round_trip(database_url: str) -> None:
    rows = [_row(n) for n in range(3)]
    with psycopg.connect(conninfo(database_url)) as conn:
        write = _write(conn, rows)
        assert write.error is None and write.refused is None
        assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
        # Seen from another session: committed, with no COMMIT of ours.
        assert _ids(database_url) == {row.id for row in rows}


def test_a_row_that_is_not_new_rolls_the_batch_back(database_url: str) -> None:
    """A duplicate may need an id_conflict letter in the same transaction: the batch is
    left to the ordinary write, and nothing of it may be committed meanwhile."""
    first = _row(0)
    with psycopg.connect(conninfo(database_url)) as conn:
        _write(conn, [first])
        fresh = _row(1)
        for batch in ([first, fresh], [fresh, fresh]):  # stored before, or twice in the batch
            write = _write(conn, batch)
            assert write.error is None and isinstance(write.refused, psycopg.errors.DivisionByZero), write.refused
            assert write.refused.sqlstate == inbox_sql.NOT_ALL_NEW
            assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
            assert _ids(database_url) == {first.id}
        assert conn.execute("SELECT count(*) FROM txbox.inbox").fetchone() == (1,)  # usable


def test_a_refused_batch_stores_nothing_and_leaves_the_connection_usable(database_url: str) -> None:
    rows = [_row(0), _row(1, payload='{"a": "\\u0000"}')]  # jsonb refuses NUL
    with psycopg.connect(conninfo(database_url)) as conn:
        write = _write(conn, rows)
        assert isinstance(write.refused, psycopg.errors.UntranslatableCharacter), write.refused
        assert write.error is None
        assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
        assert _ids(database_url) == set()
        ok = _write(conn, rows[:1])
        assert ok.refused is None and _ids(database_url) == {rows[0].id}


def test_a_lost_connection_is_the_writes_error(database_url: str) -> None:
    conn = psycopg.connect(conninfo(database_url))
    try:
        with psycopg.connect(conninfo(database_url), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        done: list[bool] = []
        write = InboxWrite(conn, [_insert([_row(0)])], lambda: done.append(True))
        write.send()
        write.wait()
        assert isinstance(write.error, psycopg.OperationalError), write.error
        assert done == [True]
    finally:
        conn.close()  # what the receiver does with it (no rollback: mid-protocol)


def test_a_socket_registered_on_the_broker_connections_loop_is_served_while_it_waits(amqp_url: str) -> None:
    """The receiver's one wait covers the database socket: pin the shape of pika's loop it uses."""
    connection = amqp.connect(amqp_url)
    left, right = socket.socketpair()
    try:
        ioloop = amqp.ioloop(connection)
        seen: list[bytes] = []

        def ready(fileno: int, events: int) -> None:
            seen.append(left.recv(16))
            ioloop.remove_handler(fileno)
            connection.call_later(0, lambda: None)  # ends the wait, as a finished write does

        ioloop.add_handler(left.fileno(), ready, ioloop.READ)
        right.send(b"ping")
        connection.process_data_events(time_limit=30)  # returns early only if the handler ran
        assert seen == [b"ping"]
    finally:
        left.close()
        right.close()
        amqp.close_quietly(connection)
