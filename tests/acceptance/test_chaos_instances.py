"""The private PostgreSQL and RabbitMQ the chaos run restarts: they must really restart and keep data."""

from __future__ import annotations

from collections.abc import Iterator

import pika
import pika.exceptions
import psycopg
import pytest

from framework import names, topology
from framework.contracts import load_registry
from framework.settings import Settings
from tests.conftest import CONTRACTS
from tests.support import wait_until
from txbox_tools.chaos.instances import PrivatePostgres, PrivateRabbit

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pg() -> Iterator[PrivatePostgres]:
    with PrivatePostgres() as instance:
        yield instance


@pytest.fixture(scope="module")
def rabbit() -> Iterator[PrivateRabbit]:
    with PrivateRabbit() as instance:
        yield instance


def test_postgres_crash_restart_keeps_committed_rows(pg: PrivatePostgres) -> None:
    url = pg.create_database("keep").replace("+psycopg", "")
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE t (n int)")
        conn.execute("INSERT INTO t SELECT generate_series(1, 1000)")
        assert conn.execute("SHOW fsync").fetchone() == ("on",)
    old_pid = _postmaster_pid(pg)
    pg.restart(mode="immediate")
    assert _postmaster_pid(pg) != old_pid
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT count(*) FROM t").fetchone() == (1000,)


def test_terminate_backends_drops_client_connections(pg: PrivatePostgres) -> None:
    url = pg.create_database("victim").replace("+psycopg", "")
    with psycopg.connect(url, autocommit=True) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        assert pg.terminate_backends("victim") >= 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")


def test_rabbit_restart_keeps_confirmed_messages(rabbit: PrivateRabbit) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.amqp_url()))
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("keep", durable=True, arguments={"x-queue-type": "quorum"})
    for i in range(100):
        ch.basic_publish("", "keep", str(i).encode(), pika.BasicProperties(delivery_mode=2))
    conn.close()
    rabbit.restart()
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.amqp_url()))
    try:
        ch = conn.channel()
        count = wait_until(
            lambda: ch.queue_declare("keep", durable=True, passive=True).method.message_count, 30, message="queue"
        )
        assert count == 100
    finally:
        conn.close()


def test_retries_that_expire_while_the_broker_restarts_still_reach_the_inbox(rabbit: PrivateRabbit) -> None:
    """A receiver parks deliveries in a delay queue while PostgreSQL is down; RabbitMQ
    restarting meanwhile must not drop them (the chaos run lost them with classic
    delay queues: dead-lettering from those is at most once)."""
    settings = Settings(
        service="order-service",
        database_url="postgresql+psycopg://unused@127.0.0.1/unused",
        amqp_url=rabbit.amqp_url(),
        contracts_dir=CONTRACTS,
    )
    topology.declare(settings, load_registry(CONTRACTS))
    inbox = names.inbox_queue("order-service")
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.amqp_url()))
    ch = conn.channel()
    ch.confirm_delivery()
    topology.declare_queue(ch, topology.delay_queue(1), settings)  # expires during the restart
    cc = [names.retry_routing_key("order-service", "order-service.order.place")]
    for i in range(20):
        ch.basic_publish(
            names.DELAY_EXCHANGE,
            names.delay_routing_key(1),
            str(i).encode(),
            pika.BasicProperties(delivery_mode=2, headers={"CC": cc}),
            mandatory=True,
        )
    conn.close()
    rabbit.restart()
    conn = pika.BlockingConnection(pika.URLParameters(rabbit.amqp_url()))
    try:
        ch = conn.channel()

        def arrived() -> int:
            count = ch.queue_declare(inbox, durable=True, passive=True).method.message_count
            return count if count >= 20 else 0

        assert wait_until(arrived, 60, message="the retries in the inbox queue") == 20
        assert ch.queue_declare(names.delay_queue(1), durable=True, passive=True).method.message_count == 0
    finally:
        conn.close()


def test_close_connections_from_the_broker_side(rabbit: PrivateRabbit) -> None:
    params = pika.URLParameters(rabbit.amqp_url())
    params.client_properties = {"connection_name": "chaos-victim"}
    conn = pika.BlockingConnection(params)
    try:
        wait_until(lambda: rabbit.close_connections("chaos-victim"), 30, message="the connection to be listed")
        with pytest.raises(pika.exceptions.AMQPConnectionError):
            for _ in range(50):
                conn.process_data_events(time_limit=0.1)
    finally:
        if conn.is_open:
            conn.close()


def _postmaster_pid(pg: PrivatePostgres) -> str:
    """The server's start time: it changes exactly when the postmaster was restarted."""
    with psycopg.connect(pg.admin_url) as conn:
        row = conn.execute("SELECT pg_postmaster_start_time()::text").fetchone()
    assert row is not None
    return str(row[0])
