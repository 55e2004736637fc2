"""Handlers that end, close or break the worker's transaction: a failure of their own message
(retried, then abandoned with a dead letter), never lost or doubled work of their batch mates,
never a crash of the worker. Judged from the database."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox
from framework.service import Service
from framework.worker import guard
from tests import support
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox
from tests.integration.test_worker import Recorder, done, letters, row, worker


def _seen(session: Session, message: Message, note: int) -> None:
    session.execute(
        text("INSERT INTO seen (id, segment, quantity) VALUES (:id, :segment, :q)"),
        {"id": message.message_id, "segment": message.aggregate_id, "q": note},
    )


def _driver(session: Session) -> Any:
    return session.connection().connection.driver_connection


def _swallow(action: Callable[[], object]) -> None:
    with contextlib.suppress(Exception):  # the handler hides what went wrong and goes on
        action()


# What the bad handler does after writing its `seen` row; each then writes one more row,
# which must not survive either (in a transaction of its own after a COMMIT or ROLLBACK).
MISUSES: dict[str, Callable[[Session], object]] = {
    "session.rollback()": lambda s: s.rollback(),
    "session.rollback() swallowed": lambda s: _swallow(s.rollback),
    "session.close()": lambda s: s.close(),
    "session.commit()": lambda s: s.commit(),
    "session.commit() swallowed": lambda s: _swallow(s.commit),
    "ROLLBACK as SQL": lambda s: s.execute(text("ROLLBACK")),
    "COMMIT as SQL": lambda s: _swallow(lambda: s.execute(text("COMMIT"))),
    "driver commit()": lambda s: _swallow(lambda: _driver(s).commit()),
    "driver rollback()": lambda s: _driver(s).rollback(),
    "connection.commit()": lambda s: _swallow(lambda: s.connection().commit()),
    "failing statement swallowed": lambda s: _swallow(lambda: s.execute(text("SELECT 1/0"))),
    "begin_nested() left open": lambda s: s.begin_nested(),
}
# These return right after the misuse: nothing later in the handler trips over it.
MISUSES_THEN_RETURN = {"failing statement swallowed", "COMMIT as SQL", "ROLLBACK as SQL", "session.close()"}


@pytest.fixture
def business(database_url: str) -> str:
    query(
        database_url,
        "CREATE TABLE seen (n bigserial PRIMARY KEY, id uuid NOT NULL, segment text NOT NULL, quantity int NOT NULL)",
    )
    return database_url


@pytest.mark.parametrize(
    ("misuse", "then_write"),
    [(m, True) for m in MISUSES] + [(m, False) for m in sorted(MISUSES_THEN_RETURN)],
)
def test_a_handler_breaking_the_transaction_fails_only_its_message(
    service: Service, business: str, misuse: str, then_write: bool
) -> None:
    act = MISUSES[misuse]

    def misbehave(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            act(session)
            if then_write:
                _seen(session, message, 99)  # after the misuse: must not commit either

    handler = service.register(Recorder(misbehave))
    good = [place_order(aggregate_id=f"g{i}") for i in range(6)]
    bad = place_order(aggregate_id="bad")
    store_in_inbox(service, [*good[:3], bad, *good[3:]])
    with running(worker(service, batch_size=10, max_attempts=2)):  # a crash re-raises here
        support.wait_until(lambda: done(business) == 7, 30, message="every message settled")
    for message in good:
        state = row(business, message)
        assert state["processed_at"] is not None and (state["started"], state["finished"]) == (1, 1)
    state = row(business, bad)
    assert state["abandoned_at"] is not None and state["processed_at"] is None
    assert (state["started"], state["finished"]) == (2, 2), "each misuse is one failed attempt"
    counts = dict(query(business, "SELECT id::text, count(*) FROM seen GROUP BY id"))
    assert counts == {m["message_id"]: 1 for m in good}, "batch mates once each, the bad one never"
    [(message_id, _source, reason, error, _body)] = letters(business)
    assert (str(message_id), reason) == (bad["message_id"], "max_attempts")
    # Says what the handler did and how to do it right (or the error the handler ran into).
    assert ("the handler" in error and "begin_nested" in error) or "transaction is aborted" in error, error
    runs = {m["message_id"]: sum(1 for c in handler.calls if c[0] == m["message_id"]) for m in good}
    assert max(runs.values()) <= 5 * 2, runs  # at most five runs per claim, and a retry of the bad one


def test_many_misbehaving_batch_mates_run_healthy_handlers_a_bounded_number_of_times(
    service: Service, business: str
) -> None:
    """Four handlers that end the transaction in one batch: the healthy ones run at most five times."""
    kinds = ["ROLLBACK as SQL", "COMMIT as SQL", "session.close()", "driver rollback()"]

    def misbehave(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id.startswith("bad"):
            MISUSES[kinds[int(message.aggregate_id[3:])]](session)

    handler = service.register(Recorder(misbehave))
    good = [place_order(aggregate_id=f"g{i}") for i in range(8)]
    bad = [place_order(aggregate_id=f"bad{i}") for i in range(4)]
    store_in_inbox(service, [good[0], bad[0], good[1], bad[1], *good[2:5], bad[2], bad[3], *good[5:]])
    with running(worker(service, batch_size=20, max_attempts=1)):
        support.wait_until(lambda: done(business) == 12, 30, message="every message settled")
    counts = dict(query(business, "SELECT id::text, count(*) FROM seen GROUP BY id"))
    assert counts == {m["message_id"]: 1 for m in good}
    assert sorted(str(r[0]) for r in letters(business)) == sorted(m["message_id"] for m in bad)
    for message in good:
        runs = sum(1 for c in handler.calls if c[0] == message["message_id"])
        assert runs <= 5, (message["aggregate_id"], runs)


def test_a_handler_that_only_commits_in_sql_cannot_make_its_batch_durable_halfway(
    service: Service, business: str
) -> None:
    """The guard refuses the handler's COMMIT, so no processed mark becomes durable before its
    batch mates ran: watched from outside while the handler that commits is still running."""
    seen_from_outside: list[int] = []

    def commit_then_look(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            _swallow(lambda: session.execute(text("COMMIT")))
            seen_from_outside.append(
                int(scalar(business, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL"))
            )

    service.register(Recorder(commit_then_look))
    messages = [place_order(aggregate_id="g0"), place_order(aggregate_id="bad"), place_order(aggregate_id="g1")]
    store_in_inbox(service, messages)
    with running(worker(service, batch_size=10, max_attempts=1)):
        support.wait_until(lambda: done(business) == 3, 30, message="every message settled")
    assert seen_from_outside and set(seen_from_outside) == {0}


def test_a_handler_returning_an_awaitable_is_a_failure_not_processed(service: Service, business: str) -> None:
    ran: list[str] = []

    async def later(message: Message) -> None:
        ran.append(str(message.message_id))

    class Sneaky(CommandHandler):
        message_type = "PlaceOrder"

        def handle(self, message: Message, session: Session, outbox: Outbox) -> Any:
            return later(message)  # a coroutine nobody awaits

    service.register(Sneaky())
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service, max_attempts=2)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    state = row(business, message)
    assert state["processed_at"] is None and state["abandoned_at"] is not None
    assert "async def" in state["last_error"]
    assert ran == []


# Stored by an older version, or by hand: values the worker cannot turn into a Message.
UNREADABLE = {
    "payload nested 5000 deep": "UPDATE txbox.inbox SET payload = (repeat('[', 5000) || repeat(']', 5000))::jsonb",
    "timestamp after year 9999": "UPDATE txbox.inbox SET message_timestamp = '12000-01-01T00:00:00Z'",
    "timestamp infinity": "UPDATE txbox.inbox SET message_timestamp = 'infinity'",
    "metadata an array": "UPDATE txbox.inbox SET metadata = '[1, 2]'",
    "context a string": "UPDATE txbox.inbox SET message_context = '\"x\"'",
}


@pytest.mark.parametrize("stored", list(UNREADABLE))
def test_a_row_that_cannot_be_decoded_is_dead_lettered_and_the_rest_go_on(
    service: Service, business: str, stored: str
) -> None:
    handler = service.register(Recorder())
    good = [place_order(aggregate_id=f"g{i}") for i in range(4)]
    bad = place_order(aggregate_id="bad")
    store_in_inbox(service, [*good[:2], bad, *good[2:]])
    query(business, UNREADABLE[stored] + " WHERE id = %s", (bad["message_id"],))
    with running(worker(service, batch_size=10)):  # a crash re-raises here
        support.wait_until(lambda: done(business) == 5, 30, message="every row settled")
    assert all(row(business, m)["processed_at"] is not None for m in good)
    state = row(business, bad)
    assert state["abandoned_at"] is not None and (state["started"], state["finished"]) == (1, 1)
    assert bad["message_id"] not in {c[0] for c in handler.calls}
    [(message_id, source, reason, error, body)] = letters(business)
    assert (str(message_id), source, reason) == (bad["message_id"], "inbox", "internal_error")
    assert "cannot be read" in error and body is None
    raw = scalar(business, "SELECT raw_body FROM txbox.dead_letters")
    assert bad["message_id"] in raw, "the stored columns are kept, as text, in the dead letter"


def test_the_worker_failing_on_a_message_dead_letters_it_as_internal_error(service: Service, business: str) -> None:
    def fail_bad(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            raise ValueError("the handler fails")

    service.register(Recorder(fail_bad))
    good = [place_order(aggregate_id=f"g{i}") for i in range(4)]
    bad = place_order(aggregate_id="bad")
    store_in_inbox(service, [*good[:2], bad, *good[2:]])
    w = worker(service)
    classify = w._batches.settlement.classify

    def broken(claimed: Any, exc: BaseException) -> None:
        """A bug of the worker's that strikes one message whenever it settles a failure."""
        if claimed.message.aggregate_id == "bad":
            raise KeyError("a bug in the worker")
        classify(claimed, exc)

    w._batches.settlement.classify = broken  # type: ignore[method-assign]
    with running(w):  # a crash re-raises here
        support.wait_until(lambda: done(business) == 5, 30, message="every row settled")
    assert all(row(business, m)["processed_at"] is not None for m in good)
    assert dict(query(business, "SELECT id::text, count(*) FROM seen GROUP BY id")) == {
        m["message_id"]: 1 for m in good
    }
    [(message_id, _source, reason, error, body)] = letters(business)
    assert (str(message_id), reason) == (bad["message_id"], "internal_error")
    assert "KeyError" in error and body["payload"] == bad["payload"]


def test_a_handler_exception_whose_text_fails_is_still_its_message_failure(service: Service, business: str) -> None:
    class Unprintable(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no text for you")

    def fail(message: Message, session: Session, outbox: Outbox) -> None:
        raise Unprintable()

    service.register(Recorder(fail))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service, max_attempts=1)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    [(_id, _source, reason, error, _body)] = letters(business)
    assert reason == "max_attempts" and "Unprintable" in error


@pytest.mark.parametrize("fail_every", [0, 15], ids=["healthy", "a failed pass every 15 batches"])
def test_the_commit_guards_table_stays_small_however_many_batches_one_connection_runs(
    service: Service, business: str, monkeypatch: pytest.MonkeyPatch, fail_every: int
) -> None:
    """The guard's keys are deleted before each COMMIT and the table emptied every
    ``guard.TRUNCATE_EVERY`` batches and after a failed pass: its dead rows do not pile up
    on a long-lived connection (autovacuum never visits a temporary table), also where
    failures come more often than the TRUNCATEs."""
    monkeypatch.setattr(guard, "TRUNCATE_EVERY", 20)
    count = 600
    failing = {f"o{i}" for i in range(fail_every, count, fail_every)} if fail_every else set()

    def fail_some(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id in failing:
            raise RuntimeError("this one fails")

    service.register(Recorder(fail_some))
    store_in_inbox(service, [place_order(aggregate_id=f"o{i}") for i in range(count)])
    with running(worker(service, batch_size=1, max_attempts=1)):  # one batch per message, one connection
        support.wait_until(lambda: done(business) == count, 60, message="every message settled")
        # Another session sees the worker's temporary table in the catalog, and its size on disk.
        [(tables, largest)] = query(
            business,
            "SELECT count(*), max(pg_relation_size(c.oid)) FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE c.relname = %s AND n.nspname LIKE 'pg\\_temp\\_%%'",
            (guard.GUARD_TABLE,),
        )
    assert tables == 1, "the worker's processing connection holds the guard's table"
    # 600 batches leave 1,200 dead rows without the TRUNCATEs: at most 291 line pointers
    # fit on a page, so at least five pages.
    assert largest <= 8192, f"the guard's table grew to {largest} bytes"
    assert scalar(business, "SELECT count(*) FROM seen") == count - len(failing), "each healthy message once"
    assert len(letters(business)) == len(failing)
