"""Handlers that bring the worker down count toward poison every time; their batch mates are
processed exactly once. With a real worker process for os._exit, in a thread otherwise."""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import Message, Outbox
from framework.service import Service
from tests import support
from tests.apps import counter
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox
from tests.integration.test_worker import Recorder, done, letters, row, worker
from txbox_tools.processes import ProcessGroup

LEASE = 4.0  # the shortest lease a worker accepts: suspects come back quickly


@pytest.fixture
def business(database_url: str) -> str:
    query(
        database_url,
        "CREATE TABLE seen (n bigserial PRIMARY KEY, id uuid NOT NULL, segment text NOT NULL, quantity int NOT NULL)",
    )
    return database_url


@pytest.mark.parametrize("app_name", ["service", "async_service"])
def test_a_handler_that_kills_its_process_is_poison_and_its_batch_mates_run_once(
    database_url: str, amqp_url: str, processes: ProcessGroup, app_name: str
) -> None:
    query(database_url, counter.TABLE)
    env = {
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_WORKER_LEASE": f"{LEASE:g}s",
        "TXBOX_WORKER_TIMEOUT": "1s",
        "TXBOX_WORKER_POLL_INTERVAL": "0.2s",
        "TXBOX_WORKER_POISON_THRESHOLD": "3",
    }
    app = counter.build(env)
    bodies = [json.loads(counter.envelope(n, crash=(n == 3))) for n in range(7)]
    store_in_inbox(app, bodies)  # one batch: the killer in the middle of six healthy ones
    killer = bodies[3]["message_id"]
    exits: list[int | None] = []

    def settled() -> bool:
        daemon = processes.daemons[-1]
        if not daemon.alive:
            exits.append(daemon.process.returncode)
            processes.start(f"worker-{len(exits)}", ["worker", "--app", f"tests.apps.counter:{app_name}"], env=env)
        return bool(
            scalar(
                database_url, "SELECT bool_and(processed_at IS NOT NULL OR abandoned_at IS NOT NULL) FROM txbox.inbox"
            )
        )

    processes.start("worker-0", ["worker", "--app", f"tests.apps.counter:{app_name}"], env=env)
    support.wait_until(
        settled, 90, interval=0.2, message="every message settled, the worker restarted after each crash"
    )
    assert exits == [counter.CRASH_EXIT_CODE] * 3, "the killer ran until the threshold, once per process"
    state = query(
        database_url,
        "SELECT abandoned_at IS NOT NULL, started_attempts, finished_attempts FROM txbox.inbox WHERE id = %s",
        (killer,),
    )
    assert state == [(True, 4, 4)]
    assert [(str(r[0]), r[2]) for r in letters(database_url)] == [(killer, "poison")]
    counts = dict(query(database_url, "SELECT id::text, n FROM counters"))
    assert counts == {b["message_id"]: 1 for b in bodies if b["message_id"] != killer}
    # Each healthy mate: the claim that died with the process, then one run of its own.
    started = dict(query(database_url, "SELECT id::text, started_attempts FROM txbox.inbox WHERE id <> %s", (killer,)))
    assert set(started.values()) == {2}


def _expire_leases(url: str, aggregate_id: str | None = None, started: int | None = None) -> None:
    """What waiting out the lease would do, without the wait (only ``aggregate_id``'s rows,
    when given: a lease taken from a row the worker is about to run would make it skip the
    run as too late, and count the claim; only the claim numbered ``started``, when given:
    a live claim that lost its lease is claimed again ahead and counts a run that never was)."""
    query(
        url,
        "UPDATE txbox.inbox SET locked_until = now() WHERE processed_at IS NULL AND abandoned_at IS NULL "
        "AND (%s::text IS NULL OR aggregate_id = %s) AND (%s::int IS NULL OR started_attempts = %s)",
        (aggregate_id, aggregate_id, started, started),
    )


def test_a_handler_raising_system_exit_keeps_its_claim_counted_and_gives_back_the_rest(
    service: Service, business: str
) -> None:
    def leave(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            sys.exit(3)

    service.register(Recorder(leave))
    good = [place_order(aggregate_id=f"g{i}") for i in range(4)]
    bad = place_order(aggregate_id="bad")
    store_in_inbox(service, [*good[:2], bad, *good[2:]])
    w = worker(service, batch_size=10, lease=LEASE, timeout=1)
    with pytest.raises(SystemExit):
        w.run()
    # Released: the batch mates (their runs were rolled back, not their fault); counted: the one that left.
    assert [row(business, m)["started"] for m in good] == [0, 0, 0, 0]
    assert (row(business, bad)["started"], row(business, bad)["finished"]) == (1, 0)
    # Restarted: the suspect runs alone first, and leaves again; the run still counts.
    _expire_leases(business)
    with pytest.raises(SystemExit):
        worker(service, batch_size=10, lease=LEASE, timeout=1, poison_threshold=2).run()
    assert (row(business, bad)["started"], row(business, bad)["finished"]) == (2, 0)
    # Restarted again: two runs never finished, the threshold: abandoned unrun; the rest once each.
    _expire_leases(business)
    with running(worker(service, batch_size=10, lease=LEASE, timeout=1, poison_threshold=2)):
        support.wait_until(lambda: done(business) == 5, 20, message="all settled")
    assert [r[2] for r in letters(business)] == ["poison"]
    assert dict(query(business, "SELECT id::text, count(*) FROM seen GROUP BY id")) == {
        m["message_id"]: 1 for m in good
    }


def test_a_handler_that_kills_its_own_connection_ends_as_poison_not_a_loop(service: Service, business: str) -> None:
    """pg_terminate_backend of its own session looks like a database outage; giving the whole
    batch back after each one used to run the killer again and again, never counting it."""
    runs: list[float] = []

    def terminate(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            runs.append(time.monotonic())
            session.execute(text("SELECT pg_terminate_backend(pg_backend_pid())"))

    service.register(Recorder(terminate))
    good = [place_order(aggregate_id=f"g{i}") for i in range(4)]
    bad = place_order(aggregate_id="bad")
    store_in_inbox(service, [*good[:2], bad, *good[2:]])
    w = worker(service, batch_size=10, lease=LEASE, timeout=1, poison_threshold=2)

    def settled() -> Any:
        # Instead of waiting out the killer's lease each time; only the lease of the claim whose
        # run was seen: the next claim's may be live, its run still to come.
        _expire_leases(business, "bad", started=len(runs))
        return done(business) == 5

    with running(w):
        support.wait_until(settled, 60, interval=0.2, message="all settled")
    assert len(runs) == 2, "the killer ran until the threshold, not forever"
    assert [r[2] for r in letters(business)] == ["poison"]
    assert dict(query(business, "SELECT id::text, count(*) FROM seen GROUP BY id")) == {
        m["message_id"]: 1 for m in good
    }
    assert all(row(business, m)["processed_at"] is not None for m in good)
