"""The collector is a guest of the loop it is started on (docs/explanation/daemons.md, "One loop per process").

It shares one loop with another daemon, and a stop requested from another thread ends
it at once, with what it held stored and acked, however long its flush interval.
"""

from __future__ import annotations

import threading
from typing import Any

import pika

from framework import amqp, names, topology
from framework.cli.run import Supervisor
from framework.daemon import RABBITMQ
from framework.dead_letters.collector import Collector, CollectorConfig
from framework.relay import Relay, RelayConfig
from framework.service import Service
from tests import support
from tests.integration.publisher.conftest import insert_rows, orders, outbox_state

SERVICE = "order-service"


def _dead_letter(service: Service, *cases: str) -> None:
    """Publish raw deliveries straight to the dead_letter exchange, confirmed."""
    connection = amqp.connect(service.settings.amqp_url)
    try:
        channel = connection.channel()
        topology.declare(service.settings, service.registry, channel)
        channel.confirm_delivery()
        for case in cases:
            props = pika.BasicProperties(headers={"x-case": case})
            channel.basic_publish(
                names.DEAD_LETTER_EXCHANGE, names.dead_letter_routing_key(SERVICE), case.encode(), props
            )
    finally:
        connection.close()


def _ready(service: Service) -> int:
    """Deliveries waiting in the dead_letter queue (not those a consumer holds)."""
    connection = amqp.connect(service.settings.amqp_url)
    try:
        declared = connection.channel().queue_declare(names.dead_letter_queue(SERVICE), passive=True)
        return int(declared.method.message_count)
    finally:
        connection.close()


def _cases(conn: Any) -> list[str]:
    rows = conn.execute("SELECT headers FROM txbox.dead_letters ORDER BY id").fetchall()
    return sorted(row["headers"].get("x-case", "?") for row in rows)


def test_a_stop_from_another_thread_stores_and_acks_what_it_holds(service: Service, conn: Any) -> None:
    """A flush interval of an hour: the stop, not a timer, stores the batch, and the
    collector ends without waiting for a consume to time out."""
    collector = Collector(service, CollectorConfig(flush_interval=3600, batch_size=100))  # type: ignore[arg-type]
    thread = threading.Thread(target=collector.run, daemon=True)
    thread.start()
    try:
        support.wait_until(lambda: collector.readiness()[RABBITMQ], message="the collector consuming")
        _dead_letter(service, "a", "b", "c")
        support.wait_until(lambda: _ready(service) == 0, message="the collector holding the three deliveries")
        assert _cases(conn) == []  # held, not stored: the batch is neither full nor due
        collector.stop()  # from this thread: it wakes the collector's loop
        assert collector.finished.wait(15), "the collector did not end on the stop request"
    finally:
        collector.stop()
        thread.join(15)
    assert not thread.is_alive()
    assert _cases(conn) == ["a", "b", "c"]
    assert _ready(service) == 0  # acked before the connection closed: none went back to the queue


def test_the_collector_and_the_relay_share_one_loop(service: Service, conn: Any) -> None:
    stop = threading.Event()
    relay = Relay(service, RelayConfig(poll_interval=0.2), stop_event=stop)  # type: ignore[arg-type]
    collector = Collector(service, CollectorConfig(flush_interval=0.05), stop_event=stop)  # type: ignore[arg-type]
    supervisor = Supervisor([relay, collector])
    thread = threading.Thread(target=supervisor.run, kwargs={"stop_timeout": 15.0}, daemon=True)
    thread.start()
    try:
        support.wait_until(
            lambda: relay.readiness()[RABBITMQ] and collector.readiness()[RABBITMQ], message="both daemons connected"
        )
        insert_rows(service.settings, service.registry, orders(1, 3))
        _dead_letter(service, "x", "y")
        support.wait_until(lambda: _cases(conn) == ["x", "y"], message="the collector storing both letters")
        support.wait_until(lambda: outbox_state(service.settings)["processed"] == 3, message="the relay publishing")
    finally:
        supervisor.stop()
        thread.join(20)
    assert not thread.is_alive() and supervisor.failures == [] and supervisor.stuck == []
    assert relay.loop is collector.loop is not None
    assert collector.finished.is_set() and _ready(service) == 0


def test_a_lost_connection_ends_the_session_and_a_new_one_collects(service: Service, vhost: str, conn: Any) -> None:
    """Either connection lost (RabbitMQ's closed by the broker, PostgreSQL's backend
    terminated): the collector starts a new session after a backoff, on its loop."""
    collector = Collector(service, CollectorConfig(flush_interval=0.05))  # type: ignore[arg-type]
    thread = threading.Thread(target=collector.run, daemon=True)
    thread.start()
    try:
        support.wait_until(lambda: collector.readiness()[RABBITMQ], message="the collector consuming")
        # The management API lists a connection some seconds after it opened.
        support.wait_until(lambda: support.close_connections(vhost), message="the collector's connection closed")
        _dead_letter(service, "after-broker")
        support.wait_until(lambda: _cases(conn) == ["after-broker"], 60, message="a new broker session storing")
        terminated = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) AS n FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()["n"]
        assert terminated >= 1
        _dead_letter(service, "after-database")
        support.wait_until(
            lambda: _cases(conn) == ["after-broker", "after-database"], 60, message="a new database session storing"
        )
        support.wait_until(lambda: _ready(service) == 0, message="every delivery acked")
    finally:
        collector.stop()
        thread.join(15)
    assert not thread.is_alive() and collector.finished.is_set()
