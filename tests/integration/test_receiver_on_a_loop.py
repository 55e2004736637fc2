"""The receiver as a guest of a loop it is given (docs/explanation/daemons.md, "One loop per
process"), against the real RabbitMQ and PostgreSQL: beside another daemon on one
thread, stopped from another thread, and with a drain that ends although the database
does not answer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from framework import metrics, names, topology
from framework.cli.run import Supervisor
from framework.db import conninfo
from framework.receiver import Receiver, ReceiverConfig
from framework.receiver import daemon as receiver_daemon
from framework.relay import Relay, RelayConfig
from framework.service import Service
from tests import support
from tests.apps.helpers import encode, place_order, publish, query, queue_depth, running, scalar

QUEUE = names.inbox_queue("order-service")

# Rows of the ids in ``unavailable`` fail to insert with SQLSTATE 53100 (disk_full), an
# error of the database: the receiver sends them round the delay chain, through its copies.
_UNAVAILABLE = """
CREATE TABLE public.unavailable (id uuid PRIMARY KEY);
CREATE FUNCTION public.refuse_unavailable() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM public.unavailable WHERE id = NEW.id) THEN
        RAISE EXCEPTION 'the test makes this row unstorable for now' USING ERRCODE = '53100';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse_unavailable BEFORE INSERT ON txbox.inbox
    FOR EACH ROW EXECUTE FUNCTION public.refuse_unavailable();
"""


def inbox_count(url: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM txbox.inbox"))


def record_writes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread of each batch write the receiver sends without waiting from now on."""
    threads: list[int] = []
    send = receiver_daemon.InboxWrite.send

    def recorded(self: Any) -> None:
        threads.append(threading.get_ident())
        send(self)

    monkeypatch.setattr(receiver_daemon.InboxWrite, "send", recorded)
    return threads


@pytest.fixture
def supervised(service: Service) -> Iterator[tuple[Supervisor, Receiver, threading.Thread]]:
    """A relay and a receiver of one service on one loop, as `txbox run` runs them, on a thread
    of the test's; stopped (from the test's thread) at the end if the test did not."""
    topology.declare(service.settings, service.registry)
    stop = threading.Event()
    relay = Relay(service, RelayConfig(), stop_event=stop, declare_topology=False)
    receiver = Receiver(service, ReceiverConfig(prefetch=200, batch_size=100, retry_schedule="1s*2"), stop_event=stop)
    supervisor = Supervisor([relay, receiver])
    thread = threading.Thread(target=supervisor.run, args=(30.0,), name="the one loop", daemon=True)
    thread.start()
    try:
        yield supervisor, receiver, thread
    finally:
        supervisor.stop()
        thread.join(40)


def test_the_receiver_shares_one_loop_with_another_daemon_and_stops_from_another_thread(
    supervised: tuple[Supervisor, Receiver, threading.Thread],
    database_url: str,
    amqp_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    supervisor, receiver, thread = supervised
    writes = record_writes(monkeypatch)
    query(database_url, _UNAVAILABLE)
    support.wait_until(lambda: receiver.consuming, 30, message="the receiver consuming on the shared loop")
    before = {t.ident for t in threading.enumerate()}

    publish(amqp_url, [encode(place_order()) for _ in range(300)])
    support.wait_until(lambda: inbox_count(database_url) == 300, 30, message="the deliveries stored")
    assert set(writes) == {thread.ident}, "every batch is written on the loop's thread"

    # The database refuses one message: its copy goes to the delay exchange on the copies'
    # confirm channel, on the same loop, and the delivery is acked once it is confirmed.
    delayed = metrics.RECEIVER_DELAYED.labels(**metrics.labels("order-service"))._value.get()
    held = place_order(aggregate_id="held")
    query(database_url, "INSERT INTO public.unavailable VALUES (%s)", (held["message_id"],))
    publish(amqp_url, [encode(held)])
    support.wait_until(
        lambda: metrics.RECEIVER_DELAYED.labels(**metrics.labels("order-service"))._value.get() == delayed + 1,
        30,
        message="the copy confirmed",
    )
    query(database_url, "DELETE FROM public.unavailable")
    support.wait_until(lambda: inbox_count(database_url) == 301, 30, message="the held one stored after its delay")
    started = [t.name for t in threading.enumerate() if t.ident not in before]
    assert started == [], f"no thread of the receiver's own: {started}"

    supervisor.stop()  # from the test's thread, not the loop's
    thread.join(40)
    assert not thread.is_alive(), "both daemons ended and the loop returned"
    assert supervisor.failures == [] and supervisor.stuck == []
    assert receiver.ended and not receiver.consuming
    assert queue_depth(amqp_url, QUEUE) == 0


def test_a_stop_while_the_database_holds_the_write_ends_within_the_drain_and_loses_nothing(
    service: Service, database_url: str, amqp_url: str
) -> None:
    """The write in flight is waited for at most the drain's bound: the receiver ends while
    PostgreSQL still holds it, and the batch, left unacked, comes back and is stored once."""
    topology.declare(service.settings, service.registry)
    message = place_order()
    with psycopg.connect(conninfo(database_url)) as blocker:
        blocker.execute("LOCK TABLE txbox.inbox IN SHARE ROW EXCLUSIVE MODE")
        receiver = Receiver(service, ReceiverConfig(prefetch=10, batch_size=10))
        with running(receiver):
            publish(amqp_url, [encode(message)])
            support.wait_until(
                lambda: scalar(
                    database_url,
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'txbox-receiver'"
                    " AND wait_event_type = 'Lock' AND datname = current_database()",
                ),
                30,
                message="the receiver's write to wait on the lock",
            )
            # running() stops it from this thread and fails unless it ended within 30 s,
            # all of which the lock is held for.
        assert receiver.ended
        blocker.rollback()
    with running(Receiver(service, ReceiverConfig(prefetch=10, batch_size=10))):
        support.wait_until(lambda: queue_depth(amqp_url, QUEUE) == 0, 30, message="the delivery settled")
        support.wait_until(lambda: inbox_count(database_url) == 1, 30, message="the message stored")
    assert inbox_count(database_url) == 1
