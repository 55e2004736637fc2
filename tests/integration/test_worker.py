"""The worker against the real PostgreSQL: outcomes, attempts, poison, timeouts, conflicts."""

from __future__ import annotations

import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from sqlalchemy import func, select, text
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from framework import CommandHandler, Message, Outbox, PermanentError, RetryableError
from framework.service import Service
from framework.worker import Worker, WorkerConfig
from framework.worker.batch import driver
from framework.worker.timeout import Watchdog
from tests import support
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox

FAST = {"backoff_base": 0.01, "backoff_cap": 0.05, "poll_interval": 0.1}


class Recorder(CommandHandler):
    """PlaceOrder handler whose behaviour each test sets with ``act``."""

    message_type = "PlaceOrder"

    def __init__(self, act: Callable[[Message, Session, Outbox], None] | None = None) -> None:
        self.act = act
        self.calls: list[tuple[str, int, bool]] = []
        self.lock = threading.Lock()

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        with self.lock:
            self.calls.append((str(message.message_id), message.attempt, message.is_final_attempt))
        session.execute(
            text("INSERT INTO seen (id, segment, quantity) VALUES (:id, :segment, :q)"),
            {"id": message.message_id, "segment": message.aggregate_id, "q": message.payload["quantity"]},
        )
        if self.act is not None:
            self.act(message, session, outbox)


@pytest.fixture
def business(database_url: str) -> str:
    query(
        database_url,
        "CREATE TABLE seen (n bigserial PRIMARY KEY, id uuid NOT NULL, segment text NOT NULL, quantity int NOT NULL)",
    )
    return database_url


def worker(service: Service, **overrides: Any) -> Worker:
    return Worker(service, WorkerConfig(**{**FAST, **overrides}))


def row(url: str, message: dict[str, Any]) -> dict[str, Any]:
    rows = query(
        url,
        "SELECT processed_at, abandoned_at, started_attempts, finished_attempts, last_error,"
        " locked_until > now() FROM txbox.inbox WHERE id = %s",
        (message["message_id"],),
    )
    keys = ("processed_at", "abandoned_at", "started", "finished", "last_error", "leased")
    return dict(zip(keys, rows[0], strict=True))


def done(url: str) -> int:
    return int(
        scalar(url, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL OR abandoned_at IS NOT NULL")
    )


def letters(url: str) -> list[tuple[Any, ...]]:
    return query(url, "SELECT message_id, source, reason, error, message FROM txbox.dead_letters ORDER BY id")


def test_a_handler_commits_with_the_processed_mark_and_context_propagates(service: Service, business: str) -> None:
    def publish(message: Message, session: Session, outbox: Outbox) -> None:
        outbox.publish_event(
            "OrderPlaced",
            aggregate_id=message.aggregate_id,
            payload={"order_id": message.aggregate_id, "sku": "SKU-1", "quantity": 1},
        )

    service.register(Recorder(publish))
    message = place_order(aggregate_id="5")
    store_in_inbox(service, [message])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 1, 20, message="processed")
    state = row(business, message)
    assert state["processed_at"] is not None and (state["started"], state["finished"]) == (1, 1)
    assert scalar(business, "SELECT count(*) FROM seen") == 1
    context = scalar(business, "SELECT message_context FROM txbox.outbox")
    assert context == message["message_context"], "the incoming message_context must be copied"


def test_retryable_failures_back_off_then_abandon_after_max_attempts(service: Service, business: str) -> None:
    def fail(message: Message, session: Session, outbox: Outbox) -> None:
        raise RetryableError("stock service unavailable")

    handler = service.register(Recorder(fail))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service, max_attempts=3)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    assert handler.calls == [(message["message_id"], 1, False), (message["message_id"], 2, False),
                             (message["message_id"], 3, True)]  # fmt: skip
    state = row(business, message)
    assert state["abandoned_at"] is not None and state["processed_at"] is None
    assert (state["started"], state["finished"]) == (3, 3)
    assert "stock service unavailable" in state["last_error"]
    assert scalar(business, "SELECT count(*) FROM seen") == 0, "failed runs must leave no business rows"
    [(message_id, source, reason, _error, body)] = letters(business)
    assert (str(message_id), source, reason) == (message["message_id"], "inbox", "max_attempts")
    assert body["payload"] == message["payload"]


def test_a_failure_waits_for_its_backoff(service: Service, business: str) -> None:
    calls: list[float] = []

    def fail_once(message: Message, session: Session, outbox: Outbox) -> None:
        calls.append(time.monotonic())
        if len(calls) == 1:
            raise ValueError("first run fails")

    service.register(Recorder(fail_once))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service, backoff_base=1.0, backoff_cap=5.0, backoff_jitter=0.0)):
        support.wait_until(lambda: done(business) == 1, 20, message="processed on the second run")
    assert calls[1] - calls[0] >= 0.9
    assert row(business, message)["finished"] == 2


def test_permanent_error_abandons_at_once(service: Service, business: str) -> None:
    def reject(message: Message, session: Session, outbox: Outbox) -> None:
        raise PermanentError("customer is blocked")

    handler = service.register(Recorder(reject))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service, max_attempts=5)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    assert len(handler.calls) == 1
    assert [r[2] for r in letters(business)] == ["permanent_error"]
    assert scalar(business, "SELECT count(*) FROM seen") == 0


def test_one_failing_message_does_not_undo_its_batch_mates(service: Service, business: str) -> None:
    bad = place_order(aggregate_id="bad")

    def fail_bad(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            raise PermanentError("bad one")

    service.register(Recorder(fail_bad))
    good = [place_order(aggregate_id=str(i)) for i in range(20)]
    store_in_inbox(service, [*good[:10], bad, *good[10:]])
    with running(worker(service, batch_size=50)):
        support.wait_until(lambda: done(business) == 21, 20, message="all settled")
    assert scalar(business, "SELECT count(*) FROM seen") == 20
    assert scalar(business, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL") == 20


def test_poison_is_abandoned_without_running(service: Service, business: str) -> None:
    handler = service.register(Recorder())
    message = place_order()
    store_in_inbox(service, [message])
    # Three claims whose runs never finished: the process died in the handler each time.
    query(business, "UPDATE txbox.inbox SET started_attempts = 3, locked_until = now() - interval '1 s'")
    with running(worker(service, poison_threshold=3)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned as poison")
    assert handler.calls == []
    state = row(business, message)
    assert state["abandoned_at"] is not None and (state["started"], state["finished"]) == (4, 4)
    assert [r[2] for r in letters(business)] == ["poison"]


def test_a_suspect_below_the_threshold_runs_again_alone(service: Service, business: str) -> None:
    handler = service.register(Recorder())
    suspect, other = place_order(), place_order()
    store_in_inbox(service, [suspect, other])
    query(
        business,
        "UPDATE txbox.inbox SET started_attempts = 1, locked_until = now() - interval '1 s' WHERE id = %s",
        (suspect["message_id"],),
    )
    with running(worker(service, poison_threshold=3)):
        support.wait_until(lambda: done(business) == 2, 20, message="both processed")
    assert {c[0] for c in handler.calls} == {suspect["message_id"], other["message_id"]}
    assert row(business, suspect)["processed_at"] is not None


def test_the_batch_a_crash_left_behind_is_taken_up_without_a_pause_per_suspect(service: Service, business: str) -> None:
    """Suspects run one at a time; the next one is looked for at once (the chaos run
    stalled when a crash left 694 of them and each waited for the next suspect check)."""
    service.register(Recorder())
    messages = [place_order() for _ in range(40)]
    store_in_inbox(service, messages)
    query(business, "UPDATE txbox.inbox SET started_attempts = 1, locked_until = now() - interval '1 s'")
    with running(worker(service, poison_threshold=3)):
        support.wait_until(lambda: done(business) == 40, 20, message="all 40 suspects processed")


def test_a_handler_over_its_timeout_is_interrupted_and_retried(service: Service, business: str) -> None:
    def slow_first(message: Message, session: Session, outbox: Outbox) -> None:
        if message.attempt == 1:
            for _ in range(3000):  # Python code between short waits: interruptible at once
                support.pause(0.01)

    service.register(Recorder(slow_first))
    message = place_order()
    store_in_inbox(service, [message])
    started = time.monotonic()
    with running(worker(service, timeout=0.5, lease=20)):
        support.wait_until(lambda: done(business) == 1, 20, message="processed on the second run")
    assert time.monotonic() - started < 15
    assert row(business, message)["finished"] == 2
    assert scalar(business, "SELECT count(*) FROM seen") == 1


def test_a_handler_stuck_in_the_database_is_cancelled(service: Service, business: str) -> None:
    def sleep_in_sql(message: Message, session: Session, outbox: Outbox) -> None:
        if message.attempt == 1:
            session.execute(text("SELECT pg_sleep(30)"))

    service.register(Recorder(sleep_in_sql))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service, timeout=0.5, lease=20, max_attempts=1)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned after the timeout")
    [(_, _, reason, error, _)] = letters(business)
    assert reason == "max_attempts" and "timeout" in error


def test_serialization_failures_rerun_without_counting(service: Service, business: str) -> None:
    raised: list[int] = []

    def conflict_twice(message: Message, session: Session, outbox: Outbox) -> None:
        if len(raised) < 2:
            raised.append(1)
            raise psycopg.errors.SerializationFailure("could not serialize access")

    handler = service.register(Recorder(conflict_twice))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 1, 20, message="processed")
    assert [c[1] for c in handler.calls] == [1, 1, 1], "conflicts are not attempts"
    state = row(business, message)
    assert state["processed_at"] is not None and (state["started"], state["finished"]) == (1, 1)
    assert scalar(business, "SELECT count(*) FROM seen") == 1


def test_notify_wakes_an_idle_worker_long_before_the_poll(service: Service, business: str) -> None:
    service.register(Recorder())
    with running(worker(service, poll_interval=60)) as w:
        support.wait_until(lambda: w.listening, 10, message="the worker to listen")
        store_in_inbox(service, [place_order()])
        support.wait_until(lambda: done(business) == 1, 10, message="processed after NOTIFY")


def test_the_worker_listens_claims_ahead_and_handles_on_one_thread(service: Service, business: str) -> None:
    """docs/explanation/daemons.md, "The daemons and their threads": besides its loop the worker
    starts only the watchdog and the pruner (no listener, no claim thread), while it takes
    a NOTIFY from sleep and claims ahead under a backlog."""
    service.register(Recorder())
    before = set(threading.enumerate())
    w = worker(service, batch_size=5, poll_interval=60)
    with running(w):
        support.wait_until(lambda: w.listening, 10, message="the worker to listen")
        store_in_inbox(service, [place_order(aggregate_id=f"t{n}") for n in range(30)])  # full batches: ahead
        support.wait_until(lambda: done(business) == 30, 30, message="processed after NOTIFY")
        started = {t.name for t in set(threading.enumerate()) - before}
    # "worker": the test's thread running the loop.
    assert started == {"worker", "txbox-watchdog", "txbox worker prune"}, started
    assert w.counts.claims > 6 and w.counts.statements > w.counts.claims


def test_a_stop_from_another_thread_ends_an_idle_wait_at_once(service: Service, business: str) -> None:
    """stop() rings the loop's alarm: an idle worker with a poll interval of an hour ends
    within seconds (the wait does not run out first)."""
    service.register(Recorder())
    w = worker(service, poll_interval=3600)
    thread = threading.Thread(target=w.run, name="idle worker")
    thread.start()
    try:
        support.wait_until(lambda: w.listening and w._claims.is_open, 10, message="the worker idle")
        support.pause(0.2)  # into its wait
        stopped = time.monotonic()
        w.stop()
        thread.join(20)
        assert not thread.is_alive() and time.monotonic() - stopped < 10
    finally:
        w.stop()
        thread.join(30)


def test_stopping_finishes_the_batch_in_hand_and_leaves_no_lease(service: Service, business: str) -> None:
    entered = threading.Event()

    def slow(message: Message, session: Session, outbox: Outbox) -> None:
        entered.set()
        support.pause(0.05)  # the handler's own work

    service.register(Recorder(slow))
    store_in_inbox(service, [place_order(aggregate_id=str(i)) for i in range(30)])
    w = worker(service, batch_size=10)
    with running(w):
        assert entered.wait(10)
    processed = done(business)
    assert processed % 10 == 0 and processed >= 10, "the batch in hand is finished, the next not started"
    leased = scalar(
        business,
        "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL AND (locked_until > now()"
        " OR started_attempts > finished_attempts)",
    )
    assert leased == 0


def test_a_row_claimed_by_someone_else_after_our_lease_is_left_alone(service: Service, business: str) -> None:
    handler = service.register(Recorder())
    message = place_order()
    store_in_inbox(service, [message])
    w = worker(service)
    batch = w._claim(w._claim_batch, 10)
    # Another worker claimed it again after our lease (the fencing token moved on).
    query(business, "UPDATE txbox.inbox SET started_attempts = started_attempts + 1")
    w._watchdog = Watchdog()
    try:
        w._process(batch)
    finally:
        w._watchdog.close()
    assert handler.calls == []
    assert row(business, message)["processed_at"] is None


def test_unknown_handler_is_a_dead_letter_not_a_crash(service: Service, business: str) -> None:
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    assert [r[2] for r in letters(business)] == ["no_handler"]


def test_an_error_text_postgresql_cannot_store_does_not_stop_the_worker(service: Service, business: str) -> None:
    def nul(message: Message, session: Session, outbox: Outbox) -> None:
        raise PermanentError("bad\x00byte")

    service.register(Recorder(nul))
    store_in_inbox(service, [place_order()])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 1, 20, message="abandoned")
    assert "bad" in scalar(business, "SELECT last_error FROM txbox.inbox")


def test_a_commit_that_refuses_the_batch_blames_only_its_message(service: Service, business: str) -> None:
    """A deferred constraint fails at COMMIT, naming no handler: each message then runs alone."""
    query(business, "CREATE TABLE once (k text CONSTRAINT once_k UNIQUE DEFERRABLE INITIALLY DEFERRED)")
    query(business, "INSERT INTO once VALUES ('segment-3')")

    def claim_key(message: Message, session: Session, outbox: Outbox) -> None:
        session.execute(text("INSERT INTO once VALUES (:k)"), {"k": f"segment-{message.aggregate_id}"})

    service.register(Recorder(claim_key))
    messages = [place_order(aggregate_id=str(i)) for i in range(6)]
    store_in_inbox(service, messages)
    with running(worker(service, batch_size=10, max_attempts=2)):  # a crash would re-raise here
        support.wait_until(lambda: done(business) == 6, 30, message="every message settled")
    bad = messages[3]
    for message in messages:
        state = row(business, message)
        if message is bad:
            assert state["abandoned_at"] is not None and state["finished"] == 2
            assert "once_k" in state["last_error"]
        else:
            assert state["processed_at"] is not None and (state["started"], state["finished"]) == (1, 1)
    # Each good message's effect committed once; the bad one's never.
    counts = dict(query(business, "SELECT id::text, count(*) FROM seen GROUP BY id"))
    assert counts == {m["message_id"]: 1 for m in messages if m is not bad}
    assert [(str(r[0]), r[2]) for r in letters(business)] == [(bad["message_id"], "max_attempts")]


class _Base(DeclarativeBase):
    pass


class Keyed(_Base):
    __tablename__ = "keyed"
    k: Mapped[str] = mapped_column(primary_key=True)


def test_a_database_error_in_a_handler_is_not_blamed_on_a_batch_mate(service: Service, business: str) -> None:
    """The optimistic pass may see one handler's bad row fail in the next one's query."""
    query(business, "CREATE TABLE keyed (k text PRIMARY KEY)")
    query(business, "INSERT INTO keyed VALUES ('taken')")

    def act(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            session.add(Keyed(k="taken"))  # pending: fails when the next handler's query autoflushes
        elif message.aggregate_id == "http":
            raise ConnectionRefusedError("the handler's HTTP call failed")  # not the database's trouble
        else:
            session.scalar(select(func.count()).select_from(Keyed))

    service.register(Recorder(act))
    good = [place_order(aggregate_id=f"g{i}") for i in range(4)]
    bad, http_down = place_order(aggregate_id="bad"), place_order(aggregate_id="http")
    store_in_inbox(service, [*good[:2], bad, http_down, *good[2:]])
    with running(worker(service, batch_size=10, max_attempts=3, backoff_base=30, backoff_cap=30)):
        support.wait_until(lambda: done(business) == 4, 30, message="the four good messages")
        support.wait_until(
            lambda: all(row(business, m)["last_error"] for m in (bad, http_down)), 30, message="both failures"
        )
    for message in good:
        state = row(business, message)
        assert state["processed_at"] is not None and (state["started"], state["finished"]) == (1, 1)
    # The bad row surfaced in a batch mate's query; the mate is processed all the same.
    for message, error in ((bad, "UniqueViolation"), (http_down, "ConnectionRefusedError")):
        state = row(business, message)
        assert state["processed_at"] is None and state["abandoned_at"] is None, message["aggregate_id"]
        assert (state["started"], state["finished"]) == (1, 1) and error in state["last_error"]


def test_outbox_rows_of_a_batch_commit_with_their_handlers_only(service: Service, business: str) -> None:
    """Handlers' outbox rows go out together at the end of the batch; a row PostgreSQL
    refuses there (a reused message id) fails its own message, not its batch mates."""
    reused = uuid.uuid4()

    def publish(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "boom":
            raise RetryableError("not now")
        outbox.publish_event(
            "OrderPlaced",
            aggregate_id=message.aggregate_id,
            payload={"order_id": message.aggregate_id, "sku": "SKU-1", "quantity": 1},
            message_id=reused if message.aggregate_id.startswith("dup") else None,
        )

    service.register(Recorder(publish))
    messages = [place_order(aggregate_id=a) for a in ("a", "dup1", "b", "boom", "dup2", "c")]
    store_in_inbox(service, messages)
    with running(worker(service, batch_size=10, backoff_base=30, backoff_cap=30)):
        support.wait_until(lambda: done(business) == 4, 30, message="a, b, c and one dup processed")
        support.wait_until(
            lambda: sum(1 for m in messages if row(business, m)["last_error"]) == 2, 30, message="two failures"
        )
    states = {m["aggregate_id"]: row(business, m) for m in messages}
    assert all(states[a]["processed_at"] is not None for a in ("a", "b", "c", "dup1"))
    assert "UniqueViolation" in states["dup2"]["last_error"] and states["dup2"]["processed_at"] is None
    assert "not now" in states["boom"]["last_error"]
    rows = query(business, "SELECT aggregate_id, count(*) FROM txbox.outbox GROUP BY 1 ORDER BY 1")
    assert rows == [("a", 1), ("b", 1), ("c", 1), ("dup1", 1)]


def test_the_worker_refreshes_inbox_statistics_after_a_burst(service: Service, business: str) -> None:
    """Plans made with statistics of an empty inbox scan every pending row per claim."""
    analyzed = lambda: scalar(  # noqa: E731 - manual ANALYZEs only (autovacuum counts apart)
        business, "SELECT analyze_count FROM pg_stat_user_tables WHERE relid = 'txbox.inbox'::regclass"
    )
    before = analyzed()
    service.register(Recorder())
    store_in_inbox(service, [place_order(aggregate_id=str(i)) for i in range(1500)])
    support.wait_until(
        lambda: (
            scalar(
                business, "SELECT n_mod_since_analyze FROM pg_stat_user_tables WHERE relid = 'txbox.inbox'::regclass"
            )
            >= 1500
        ),
        20,
        message="the statistics collector to see the burst",
    )
    with running(worker(service, batch_size=500)):
        support.wait_until(lambda: analyzed() > before, 30, message="an ANALYZE of txbox.inbox by the worker")


def test_a_worker_whose_connections_are_terminated_while_idle_reconnects(service: Service, business: str) -> None:
    """pg_terminate_backend of everything the idle worker holds, its listener included
    (a chaos run crashed a worker this way: the loss surfaced outside its reconnect)."""
    recorder = Recorder()
    service.register(recorder)
    w = worker(service)
    with running(w):
        support.wait_until(
            lambda: w.listening and w._claims.is_open and w._conn is not None, 10, message="the worker idle"
        )
        killed = scalar(
            business,
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        assert killed >= 3  # the LISTEN, claim and processing connections
        store_in_inbox(service, [place_order(aggregate_id="after")])
        support.wait_until(lambda: done(business) == 1, 30, message="the message stored after the outage")


def test_dropping_connections_collects_the_claim_sent_ahead_and_gives_its_batch_back(
    service: Service, business: str
) -> None:
    """A claim sent ahead (its rows leased, not yet read) when the connections are dropped
    (a stop, database trouble) is collected and its rows given back, not left to wait out
    their lease or counted as an attempt."""
    service.register(Recorder())
    messages = [place_order(aggregate_id=f"a{n}") for n in range(3)]
    store_in_inbox(service, messages)
    w = worker(service)
    try:
        w._claims.send(w._claim_batch, 10)
        assert w._claims.in_flight
        support.wait_until(lambda: all(row(business, m)["leased"] for m in messages), 30, message="the claim ahead")
        w._drop_connections()
        assert not w._claims.in_flight
    finally:
        w._drop_connections()
    # Claimed ahead, never run, given back: no attempt counted, no lease left.
    assert [row(business, m)["started"] for m in messages] == [0, 0, 0]
    assert not any(row(business, m)["leased"] for m in messages)


def test_a_segment_drains_without_a_notify_per_row_as_each_commit_frees_its_successor(
    service: Service, business: str
) -> None:
    # One NOTIFY for the three rows, no poll for an hour: each later row of the segment
    # becomes due when its predecessor's batch commits, and that batch must say so.
    service.register(Recorder())
    messages = [place_order(aggregate_id="lane", quantity=n) for n in (1, 2, 3)]
    with running(worker(service, poll_interval=3600)) as w:
        support.wait_until(lambda: w.listening, 10, message="the worker to listen")
        store_in_inbox(service, messages)
        support.wait_until(lambda: done(business) == 3, 30, message="the whole segment processed")
    assert [r[0] for r in query(business, "SELECT quantity FROM seen ORDER BY n")] == [1, 2, 3]


def _round_trips(trace: str) -> tuple[int, int]:
    """(round trips, statements) in a libpq protocol trace: the client waits at each Sync
    (extended protocol) and each Query (simple protocol, psycopg's BEGIN)."""
    sent = [line.split("\t")[2].split()[0] for line in trace.splitlines() if line.startswith("F\t")]
    return sum(kind in ("Sync", "Query") for kind in sent), sum(kind in ("Execute", "Query") for kind in sent)


def test_a_batch_costs_three_round_trips_and_a_claim_one(service: Service, business: str, tmp_path: Any) -> None:
    """docs/explanation/handle.md, "Worker batches": BEGIN, the presumption that arms the commit
    guard, the guard's DELETE with the COMMIT (a handler that writes nothing has no flush);
    each claim commits in its own round trip. Five and three before."""

    class Quiet(CommandHandler):
        message_type = "PlaceOrder"

        def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
            pass

    service.register(Quiet())
    w = worker(service, batch_size=2)
    # No look for suspects, which comes once a second: on a loaded machine a batch took
    # that long and the traced run made one more claim than the test counts.
    w._last_suspect_check = math.inf
    # Nor a statistics look after a claim that a loaded machine made slow (db.Statistics):
    # its statements on the claim connection are not the batch's.
    w._statistics.slow = lambda seconds, rows: False  # type: ignore[method-assign]
    counted = 0
    store_in_inbox(service, [place_order(aggregate_id=f"r{n}") for n in range(4)])
    paths = {"batch": tmp_path / "batch", "claim": tmp_path / "claim"}
    try:
        assert w.run_once() == 2  # the first batch on a connection also creates the guard's table
        conns = {
            "batch": driver(w._connection()),
            "claim": w._claims._slot.get(),
        }  # the one a claim may be in flight on
        with paths["batch"].open("w") as batch_trace, paths["claim"].open("w") as claim_trace:
            for conn, handle in ((conns["batch"], batch_trace), (conns["claim"], claim_trace)):
                conn.pgconn.trace(handle.fileno())
                conn.pgconn.set_trace_flags(psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE)
            try:
                counted = w.counts.statements
                assert w.run_once() == 2
                counted = w.counts.statements - counted
            finally:
                for conn in conns.values():
                    conn.pgconn.untrace()
    finally:
        w._drop_connections()
    assert _round_trips(paths["batch"].read_text()) == (3, 4)  # the DELETE and the COMMIT share one
    trips, statements = _round_trips(paths["claim"].read_text())
    assert trips == statements >= 1
    # The worker's own count (txbox_worker_statements_total) is what libpq sent: the claim
    # collected (sent during the previous batch) is counted now, the one sent now later.
    assert counted == 4 + 1 and statements == 1
    assert done(business) == 4
