"""Receiver replicas: one consumes the inbox queue, the others stand by and take over in order."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from framework import names, topology
from framework.db import conninfo
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from tests import support
from tests.apps.helpers import encode, place_order, publish, query, running, scalar

QUEUE = names.inbox_queue("order-service")


def config(**overrides: Any) -> ReceiverConfig:
    return ReceiverConfig(**{"prefetch": 20, "batch_size": 10, **overrides})


def consumers(channel_url: str) -> int:
    import pika

    connection = pika.BlockingConnection(pika.URLParameters(channel_url))
    try:
        return int(connection.channel().queue_declare(QUEUE, passive=True).method.consumer_count)
    finally:
        connection.close()


def stored_quantities(database_url: str) -> list[int]:
    rows = query(database_url, "SELECT payload FROM txbox.inbox ORDER BY created_at, id")
    return [int(r[0]["quantity"]) for r in rows]


def orders(first: int, last: int) -> list[bytes]:
    return [encode(place_order(aggregate_id="7", quantity=n)) for n in range(first, last + 1)]


def test_a_second_receiver_stands_by_and_takes_over_keeping_the_segment_in_order(
    service: Service, database_url: str, amqp_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    first, second = Receiver(service, config()), Receiver(service, config())
    with running(first):
        support.wait_until(lambda: first.consuming and consumers(amqp_url) == 1, 20, message="first receiver consumes")
        with running(second):
            support.wait_until(lambda: second._state == "standby", 20, message="second receiver stands by")
            assert not second.consuming
            assert consumers(amqp_url) == 1, "a standby must not consume"
            assert second.readiness()["rabbitmq"], "a standby is ready: it has all it needs to take over"
            publish(amqp_url, orders(1, 60))
            support.wait_until(lambda: len(stored_quantities(database_url)) == 60, 20, message="first half stored")
            first.stop()
            support.wait_until(lambda: second.consuming, 20, message="the standby takes over")
            publish(amqp_url, orders(61, 120))
            support.wait_until(lambda: len(stored_quantities(database_url)) == 120, 20, message="all stored")
            assert consumers(amqp_url) == 1
    assert stored_quantities(database_url) == list(range(1, 121))


def test_a_holder_that_lost_its_session_to_another_stands_down_until_the_turn_is_free(
    service: Service, database_url: str, amqp_url: str
) -> None:
    """The fence: a receiver whose lock session died while another took the lock stops consuming."""
    topology.declare(service.settings, service.registry)
    receiver = Receiver(service, config())
    with running(receiver):
        support.wait_until(lambda: receiver.consuming and consumers(amqp_url) == 1, 20, message="receiver consumes")
        with psycopg.connect(conninfo(database_url), autocommit=True) as rival:
            pid = scalar(
                database_url,
                # This database's lock only: another test's receiver of the same service
                # holds the same key in its own database on this server.
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                " AND (classid::bigint << 32 | objid::bigint) = %s",
                (names.receiver_lock_key("order-service"),),
            )
            assert pid is not None, "the consuming receiver holds the advisory lock"
            rival.execute("SELECT pg_terminate_backend(%s)", (pid,))
            support.wait_until(
                lambda: (
                    rival.execute(
                        "SELECT pg_try_advisory_lock(%s)", (names.receiver_lock_key("order-service"),)
                    ).fetchone()
                    == (True,)
                ),
                20,
                message="the rival takes the lock",
            )
            support.wait_until(lambda: consumers(amqp_url) == 0, 20, message="the receiver stands down")
            assert not receiver.consuming
        # The rival's session ended: the turn is free again.
        support.wait_until(lambda: consumers(amqp_url) == 1, 20, message="the receiver consumes again")
        publish(amqp_url, orders(1, 3))
        support.wait_until(lambda: stored_quantities(database_url) == [1, 2, 3], 20, message="stored")


@pytest.mark.parametrize("service_id", ["order-service", "inventory-service"])
def test_the_lock_key_is_a_stable_bigint(service_id: str) -> None:
    key = names.receiver_lock_key(service_id)
    assert key == names.receiver_lock_key(service_id)
    assert -(2**63) <= key < 2**63


def test_readyz_says_which_receiver_waits_for_its_turn_and_for_how_long(
    service: Service, database_url: str, amqp_url: str
) -> None:
    from framework import probes

    topology.declare(service.settings, service.registry)
    first, second = Receiver(service, config()), Receiver(service, config())
    with running(first):
        support.wait_until(lambda: first.consuming, 20, message="first receiver consumes")
        with running(second):
            support.wait_until(lambda: second._state == "standby", 20, message="second receiver stands by")
            _, body = probes.readiness([second])
            assert body["waiting"]["receiver"]["state"] == "standby"
            assert "another receiver consumes order-service:inbox" in body["waiting"]["receiver"]["detail"]
            earlier = body["waiting"]["receiver"]["seconds"]
            support.wait_until(
                lambda: probes.readiness([second])[1]["waiting"]["receiver"]["seconds"] > earlier,
                20,
                message="the wait is measured from its start",
            )
            assert "waiting" not in probes.readiness([first])[1], "a consuming receiver waits for nothing"
