"""One listener per service (docs/explanation/operations.md, "Replicas of every daemon"): of two
workers only the holder of the advisory lock wakes for the inbox's NOTIFYs, the other
claims when the listener's claim came back full, and takes the turn when the listener's
session ends (a kill -9 of its process)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, names
from framework.service import Service
from framework.worker import Worker
from tests import support
from tests.apps import counter
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox
from tests.integration.test_worker import Recorder, done, worker
from txbox_tools.processes import ProcessGroup

HOUR = 3600  # a poll interval no test waits out: a claim then answers a NOTIFY


@pytest.fixture
def business(database_url: str) -> str:
    query(
        database_url,
        "CREATE TABLE seen (n bigserial PRIMARY KEY, id uuid NOT NULL, segment text NOT NULL, quantity int NOT NULL)",
    )
    return database_url


def rows_claimed(w: Worker) -> int:
    """Claims that found rows."""
    return w.counts.claims - w.counts.empty_claims


@contextmanager
def two_workers(service: Service, **overrides: Any) -> Iterator[tuple[Worker, Worker]]:
    """Two workers in threads, both listening: (the listener, the other)."""
    with ExitStack() as stack:
        pair = [stack.enter_context(running(worker(service, **overrides))) for _ in range(2)]
        support.wait_until(lambda: all(w.listening for w in pair), 20, message="both workers listening")
        leaders = [w for w in pair if w.leading]
        assert len(leaders) == 1, "exactly one listener per service"
        [other] = [w for w in pair if not w.leading]
        yield leaders[0], other


def test_rows_one_at_a_time_are_claimed_by_the_listener_alone(service: Service, business: str) -> None:
    service.register(Recorder())
    with two_workers(service, poll_interval=HOUR) as (listener, other):
        # Their first claims (at start: the look for suspects, then the batch's) are behind
        # them: each waits now. Counting from the first alone raced the second.
        support.wait_until(lambda: other.counts.claims >= 2, 20, message="the other's first claims")
        other_claims = other.counts.claims
        for n in range(20):
            store_in_inbox(service, [place_order(aggregate_id=f"one{n}")])
            support.wait_until(lambda n=n: done(business) == n + 1, 20, message=f"row {n} processed")
        assert rows_claimed(listener) >= 20 - 1  # one claim may take a row the last one's NOTIFY announced
        # Woken by none of the 20 NOTIFYs: no claim at all, so no empty one.
        assert other.counts.claims == other_claims, other.counts.as_dict()


def test_a_burst_bigger_than_a_batch_wakes_the_other_replica(service: Service, business: str) -> None:
    """The listener's full claim NOTIFYs the help channel: the other claims too, within
    the burst, with no poll to wake it. Every handler waits until both have claimed rows,
    so the listener alone cannot drain the burst first."""
    both = threading.Event()

    class Gate(CommandHandler):
        message_type = "PlaceOrder"

        def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
            both.wait(60)

    service.register(Gate())
    with two_workers(service, poll_interval=HOUR, batch_size=5) as (listener, other):
        support.wait_until(lambda: other.counts.claims >= 1, 20, message="the other's first claim")
        store_in_inbox(service, [place_order(aggregate_id=f"burst{n}") for n in range(40)])
        try:
            support.wait_until(
                lambda: rows_claimed(listener) >= 1 and rows_claimed(other) >= 1,
                30,
                message="both replicas claiming rows of the burst",
            )
        finally:
            both.set()
        support.wait_until(lambda: done(business) == 40, 60, message="the burst processed")
        assert listener.leading and not other.leading  # help does not move the turn


def _listener_backend(url: str) -> int | None:
    """The backend pid holding the worker listener lock of the schema ``txbox``, if any."""
    key = names.worker_listener_lock_key("txbox") & 0xFFFFFFFFFFFFFFFF
    rows = query(
        url,
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND classid = %s AND objid = %s"
        " AND objsubid = 1 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (key >> 32, key & 0xFFFFFFFF),
    )
    return int(rows[0][0]) if rows else None


def _listen_sessions(url: str) -> int:
    return int(
        scalar(
            url,
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND application_name = 'txbox-worker-listen'",
        )
    )


def test_a_listener_killed_by_sigkill_passes_its_turn_within_a_poll_interval(
    database_url: str, amqp_url: str, processes: ProcessGroup
) -> None:
    query(database_url, counter.TABLE)
    env = {
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_WORKER_POLL_INTERVAL": "1s",
    }
    app = counter.build(env)
    command = ["worker", "--app", "tests.apps.counter:service"]
    first = processes.start("worker-0", command, env=env)
    support.wait_until(lambda: _listener_backend(database_url) is not None, 60, message="worker-0 the listener")
    held_by = _listener_backend(database_url)
    processes.start("worker-1", command, env=env)
    support.wait_until(lambda: _listen_sessions(database_url) == 2, 60, message="worker-1 listening too")
    assert _listener_backend(database_url) == held_by  # worker-1 waits on the help channel

    processes.kill(first)  # SIGKILL: the session ends when PostgreSQL sees the socket close
    support.wait_until(
        lambda: _listener_backend(database_url) not in (None, held_by),
        30,
        message="worker-1 taking the turn (bounded by its poll interval)",
    )
    bodies = [json.loads(counter.envelope(n)) for n in range(5)]
    for n, body in enumerate(bodies):
        store_in_inbox(app, [body])
        support.wait_until(
            lambda n=n: scalar(database_url, "SELECT count(*) FROM counters") == n + 1,
            30,
            message=f"row {n} handled by the new listener",
        )
    assert query(database_url, "SELECT DISTINCT n FROM counters") == [(1,)]
