"""The worker as a guest of a loop it is given (docs/explanation/daemons.md, "One loop per process"),
and the rows another daemon of the process claims for it (``Worker.take``)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from pika.adapters.select_connection import IOLoop
from sqlalchemy.orm import Session

from framework import Message, Outbox, db
from framework.daemon import Daemon
from framework.relay import Relay, RelayConfig
from framework.service import Service
from framework.sql import inbox as inbox_sql
from framework.sql import positional, rendered
from framework.worker import Worker, WorkerConfig
from framework.worker.wake import Listeners
from tests import support
from tests.apps.helpers import place_order, scalar, store_in_inbox
from tests.integration.test_worker import (  # noqa: F401 (business: fixture)
    FAST,
    Recorder,
    business,
    done,
    row,
    worker,
)
from tests.integration.test_worker_listener import _listen_sessions as listen_connections

HOUR = 3600.0  # a poll interval no test waits out


class OneLoop:
    """Daemons started on one pika loop, run by a thread of its own (the loop thread)."""

    def __init__(self, daemons: list[Daemon]) -> None:
        self.daemons = daemons
        self.loop = IOLoop()
        self.finished: dict[str, BaseException | None] = {}
        self.crash: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="one loop", daemon=True)

    def _run(self) -> None:
        try:
            for n, daemon in enumerate(self.daemons):
                self.daemons[n].start_on(self.loop, self._finished_by(f"{n}:{daemon.name}"))
            self.loop.start()
        except BaseException as exc:  # a callback that escaped to the loop: the test fails on it
            self.crash.append(exc)
        finally:
            self.loop.close()

    def _finished_by(self, key: str) -> Callable[[BaseException | None], None]:
        def finished(exc: BaseException | None) -> None:
            assert threading.current_thread() is self.thread, "finished is called on the loop"
            self.finished[key] = exc
            if len(self.finished) == len(self.daemons):
                self.loop.stop()

        return finished

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the loop thread and return what it returned."""
        done = threading.Event()
        result: list[Any] = []

        def on_loop() -> None:
            try:
                result.append(fn())
            finally:
                done.set()

        self.loop.add_callback_threadsafe(on_loop)
        assert done.wait(30), "the loop did not run the callback"
        return result[0]


@contextmanager
def on_one_loop(*daemons: Daemon) -> Iterator[OneLoop]:
    runner = OneLoop(list(daemons))
    runner.thread.start()
    try:
        yield runner
    finally:
        for daemon in daemons:
            daemon.stop()
        runner.thread.join(30)
        assert not runner.thread.is_alive(), "the loop did not end within 30 s"
    assert not runner.crash, runner.crash
    assert all(exc is None for exc in runner.finished.values()), runner.finished


def _listen_sessions(url: str) -> int:
    return int(
        scalar(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name LIKE 'txbox-worker%'",
        )
    )


def test_a_worker_and_a_relay_share_one_loop(service: Service, business: str) -> None:  # noqa: F811
    """The worker's handler writes an outbox row; the relay on the same loop (the same
    thread) publishes it. Both end on one stop, having said so on the loop."""

    def publish(message: Message, session: Session, outbox: Outbox) -> None:
        outbox.publish_event(
            "OrderPlaced",
            aggregate_id=message.aggregate_id,
            payload={"order_id": message.aggregate_id, "sku": "SKU-1", "quantity": 1},
        )

    handler = service.register(Recorder(publish))
    messages = [place_order(aggregate_id=f"loop{n}") for n in range(3)]
    store_in_inbox(service, messages)
    w = worker(service, poll_interval=HOUR)
    relay = Relay(service, RelayConfig(poll_interval=0.2))
    with on_one_loop(w, relay) as runner:
        support.wait_until(lambda: done(business) == 3, 30, message="the inbox rows processed")
        support.wait_until(
            lambda: scalar(business, "SELECT count(*) FROM txbox.outbox WHERE processed_at IS NOT NULL") == 3,
            30,
            message="the relay publishing what the handlers wrote",
        )
        # More rows come with a NOTIFY, which the shared loop hands to the worker.
        store_in_inbox(service, [place_order(aggregate_id="loop-late")])
        support.wait_until(lambda: done(business) == 4, 30, message="the row announced by its NOTIFY")
    assert set(runner.finished) == {"0:worker", "1:publisher"}
    assert len(handler.calls) == 4
    assert _listen_sessions(business) == 0, "the worker closed its connections"


@pytest.mark.parametrize("shared", [False, True], ids=["a session each", "one LISTEN session"])
def test_a_worker_stopped_from_another_thread_while_idle_leaves_the_loop_to_the_others(
    service: Service,
    business: str,  # noqa: F811
    shared: bool,
) -> None:
    """One worker's own stop, from the test's thread while it waits for work, ends that
    worker alone: the other worker on the loop, the service's listener, goes on processing.
    Sharing one LISTEN session (framework.worker.wake.Listeners), one of the two leads all
    the same: the lock the session holds is one worker's."""
    service.register(Recorder())
    listeners = Listeners() if shared else None
    pair = [Worker(service, WorkerConfig(**{**FAST, "poll_interval": HOUR}), listeners=listeners) for _ in range(2)]
    with on_one_loop(*pair) as runner:
        support.wait_until(lambda: all(w.idle and w.listening for w in pair), 30, message="both workers waiting")
        assert listen_connections(business) == (1 if shared else 2)
        [(n, first)] = [(n, w) for n, w in enumerate(pair) if not w.leading]
        [other] = [w for w in pair if w.leading]
        first.stop()  # not the loop's thread
        support.wait_until(lambda: f"{n}:worker" in runner.finished, 30, message="the stopped worker ended")
        assert runner.finished[f"{n}:worker"] is None
        assert not other.ended and other.listening
        store_in_inbox(service, [place_order(aggregate_id=f"after{n}") for n in range(5)])
        support.wait_until(lambda: done(business) == 5, 30, message="the other worker processing on the loop")
    assert other.ended


# --- rows handed over ---------------------------------------------------------------------------


def _claim_ids_sql(park: bool = False) -> bytes:
    return rendered(inbox_sql.claim_ids("txbox", park=park))


def insert_and_claim(
    service: Service, messages: list[dict[str, Any]], lease: float
) -> tuple[float, list[tuple[Any, ...]]]:
    """Insert ``messages`` and claim them with ``claim_ids``, in one transaction (as the
    receiver of the process will): (the moment the lease began, the rows claimed)."""
    from framework.receiver import Delivery, Intake
    from framework.sql.inbox import InboxRow, insert_rows

    intake = Intake(service.registry, service.name, max_body_bytes=1 << 20)
    rows = []
    for n, message in enumerate(messages):
        admitted = intake.admit(
            Delivery(
                delivery_tag=n + 1,
                body=json.dumps(message).encode(),
                properties={"content_type": "application/json"},
                headers={},
            )
        )
        assert isinstance(admitted, InboxRow), admitted
        rows.append(admitted)
    claimed_at = time.monotonic()
    with db.connect(service.settings.database_url) as conn, conn.transaction(), conn.cursor() as cur:
        insert_rows(cur, "txbox", rows)
        claimed = cur.execute(_claim_ids_sql(), {"ids": [r.id for r in rows], "lease": lease}).fetchall()
    return claimed_at, claimed


def test_rows_claimed_for_a_started_worker_are_processed_once_without_its_claim(
    service: Service,
    business: str,  # noqa: F811
) -> None:
    handler = service.register(Recorder())
    w = worker(service, poll_interval=HOUR, batch_size=4)
    messages = [place_order(aggregate_id=f"handed{n}") for n in range(10)]
    with on_one_loop(w) as runner:
        support.wait_until(lambda: w.idle, 30, message="the worker waiting for work")
        assert runner.call(lambda: w.wants_handoff)
        claims_before = w.counts.claims - w.counts.empty_claims
        claimed_at, rows = insert_and_claim(service, messages, float(w.config.lease))
        assert len(rows) == 10
        runner.call(lambda: w.take(claimed_at, rows))
        support.wait_until(lambda: done(business) == 10, 30, message="the rows handed over processed")
        assert w.counts.handed == 10
        # Run as handed, in chunks of the batch size: the one claim made for the worker (counted
        # as its own) found them, none of the worker's.
        assert w.counts.claims - w.counts.empty_claims == claims_before + 1
    assert sorted(call[0] for call in handler.calls) == sorted(m["message_id"] for m in messages)
    for message in messages:
        state = row(business, message)
        assert state["processed_at"] is not None and (state["started"], state["finished"]) == (1, 1)


def test_claim_ids_claims_no_later_row_of_a_sequential_segment_behind_a_pending_one(
    service: Service,
    business: str,  # noqa: F811
) -> None:
    """The same eligibility as the worker's claim: a sequential segment's head only, whether
    the row before it came earlier or in the same transaction."""
    earlier = place_order(aggregate_id="seq-a")
    store_in_inbox(service, [earlier])
    later, head, behind = (place_order(aggregate_id=a) for a in ("seq-a", "seq-b", "seq-b"))
    _, rows = insert_and_claim(service, [later, head, behind], 60.0)
    assert [str(r[0]) for r in rows] == [head["message_id"]]
    assert row(business, later)["started"] == 0 and row(business, behind)["started"] == 0
    assert row(business, earlier)["started"] == 0  # not among the ids: not claimed
    # In the form a daemon prepares for libpq: $1 the ids, $2 the lease.
    text = positional(_claim_ids_sql(), ("ids", "lease"), {"lease": "float8"})
    with psycopg.connect(db.conninfo(service.settings.database_url), autocommit=True) as conn:
        result = conn.pgconn.exec_params(text, [f"{{{later['message_id']}}}".encode(), b"60"])
        assert result.status == psycopg.pq.ExecStatus.TUPLES_OK, result.error_message
        assert result.ntuples == 0, "still behind the earlier row of its segment"
        conn.execute("UPDATE txbox.inbox SET processed_at = now() WHERE id = %s", (earlier["message_id"],))
        result = conn.pgconn.exec_params(text, [f"{{{later['message_id']}}}".encode(), b"60"])
        assert result.ntuples == 1, "the segment's head once the earlier row was processed"


def test_rows_handed_over_too_late_are_given_back_and_claimed_the_ordinary_way(
    service: Service,
    business: str,  # noqa: F811
) -> None:
    handler = service.register(Recorder())
    w = worker(service, poll_interval=HOUR)
    messages = [place_order(aggregate_id=f"stale{n}") for n in range(3)]
    with on_one_loop(w) as runner:
        support.wait_until(lambda: w.idle, 30, message="the worker waiting for work")
        claims_before = w.counts.claims - w.counts.empty_claims
        _, rows = insert_and_claim(service, messages, float(w.config.lease))
        # Claimed long enough ago that less than half the lease is left.
        claimed_at = time.monotonic() - 0.6 * float(w.config.lease)
        runner.call(lambda: w.take(claimed_at, rows))
        support.wait_until(lambda: done(business) == 3, 30, message="the rows given back, then claimed")
        assert w.counts.claims - w.counts.empty_claims > claims_before + 1, "claimed the ordinary way"
    assert sorted(call[0] for call in handler.calls) == sorted(m["message_id"] for m in messages)
    for message in messages:
        # Given back (not an attempt), then claimed once more: one start, one finish.
        assert (row(business, message)["started"], row(business, message)["finished"]) == (1, 1)
