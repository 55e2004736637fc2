"""Faults against the real broker and database: kill -9, broker-side close, killed DB backends."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

import pika
import psycopg

from framework import names, topology
from framework.confirms.client import NACK_STREAK
from framework.db import conninfo
from framework.relay import RelayConfig
from framework.service import Service
from framework.settings import Seconds, Settings
from tests import support
from tests.integration.publisher.conftest import (
    Delivered,
    drain_queue,
    inbox_queue,
    insert_rows,
    orders,
    outbox_state,
    running_relay,
)
from tests.support import wait_until

Spawn = Callable[..., subprocess.Popen[bytes]]


def all_ids(settings: Settings) -> set[str]:
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        return {r[0] for r in conn.execute("SELECT id::text FROM txbox.outbox")}


def assert_complete_and_ordered(settings: Settings, got: list[Delivered], per_segment: int) -> None:
    """Every row reached the broker at least once; first sightings per segment are in order."""
    ids = all_ids(settings)
    seen: set[str] = set()
    firsts: dict[str, list[int]] = {}
    for d in got:
        if d.body["message_id"] in seen:
            continue  # a duplicate (at-least-once); the inbox dedups it
        seen.add(d.body["message_id"])
        firsts.setdefault(d.body["aggregate_id"], []).append(d.body["payload"]["quantity"])
    assert seen == ids, f"{len(ids - seen)} rows never reached the broker"
    for segment, sequence in firsts.items():
        assert sequence == list(range(1, per_segment + 1)), f"segment {segment} out of order"


def test_kill_9_mid_relay_then_restart_loses_nothing_and_keeps_order(
    settings: Settings, service: Service, spawn: Spawn
) -> None:
    insert_rows(settings, service.registry, orders(400, 50))  # 20,000 rows
    args = ("--batch-size", "500", "--lease", "3s", "--confirm-timeout", "2s")
    first = spawn(settings, *args)
    wait_until(lambda: outbox_state(settings)["processed"] >= 3000, 120, message="3000 rows published")
    first.send_signal(signal.SIGKILL)
    assert first.wait(10) == -signal.SIGKILL
    interrupted = outbox_state(settings)
    assert interrupted["processed"] < 20000
    spawn(settings, *args)
    wait_until(lambda: outbox_state(settings)["processed"] == 20000, 240, message="all 20000 rows published")
    got = drain_queue(settings.amqp_url, inbox_queue(settings))
    assert len(got) >= 20000
    assert_complete_and_ordered(settings, got, 50)


def test_broker_closes_the_connection_mid_relay_and_relay_resumes(
    settings: Settings, service: Service, vhost: str
) -> None:
    insert_rows(settings, service.registry, orders(100, 50))
    config = RelayConfig(batch_size=50, poll_interval=0.2)  # type: ignore[arg-type]
    with running_relay(service, config) as relay:
        wait_until(lambda: outbox_state(settings)["processed"] >= 300, 60, message="300 rows published")
        before = relay._channel
        wait_until(lambda: support.close_connections(vhost), 30, message="the broker closes the connection")
        wait_until(
            lambda: relay._channel is not None and relay._channel is not before and relay._channel.is_open,
            60,
            message="the relay reconnects",
        )
        wait_until(lambda: outbox_state(settings)["processed"] == 5000, 120, message="all 5000 rows published")
    assert_complete_and_ordered(settings, drain_queue(settings.amqp_url, inbox_queue(settings)), 50)


def test_database_connections_killed_and_the_relay_recovers(
    settings: Settings, service: Service, database: str
) -> None:
    insert_rows(settings, service.registry, orders(50, 20))
    config = RelayConfig(batch_size=20, poll_interval=0.2)  # type: ignore[arg-type]
    with running_relay(service, config):
        wait_until(lambda: outbox_state(settings)["processed"] >= 100, 60, message="100 rows published")
        with psycopg.connect(support.PG_ADMIN_URL, autocommit=True) as admin:
            killed = admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s",
                (database,),
            ).fetchone()[0]  # type: ignore[index]
        assert killed >= 1  # the relay's one connection: claims, records and LISTEN
        wait_until(lambda: outbox_state(settings)["processed"] == 1000, 120, message="all 1000 rows published")
        # Recovered by itself, LISTEN included: new rows keep flowing.
        insert_rows(settings, service.registry, orders(5, 1, aggregate_id="after"))
        wait_until(lambda: outbox_state(settings)["processed"] == 1005, 60, message="rows inserted after recovery")
    got = drain_queue(settings.amqp_url, inbox_queue(settings))
    ids = all_ids(settings)
    assert ids <= {d.body["message_id"] for d in got}


def test_a_streak_of_nacks_makes_the_relay_publish_again_on_a_new_channel(settings: Settings, service: Service) -> None:
    """RabbitMQ 3.10 kept nacking a channel that met a dead quorum leader while a new channel got
    acks (docs/explanation/operations.md, "A RabbitMQ cluster"): here a full queue nacks every publish."""
    ids = insert_rows(settings, service.registry, orders(10, 1))
    topology.declare(settings, service.registry)
    exchange, key = names.COMMAND_EXCHANGE, service.registry.get("PlaceOrder").routing_key
    conn = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    try:
        ch = conn.channel()
        ch.queue_declare("full", durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
        ch.queue_bind("full", exchange, routing_key=key)
        config = RelayConfig(  # type: ignore[arg-type]
            poll_interval=0.2, retry_base=Seconds(0.2), retry_cap=Seconds(0.5), max_attempts=1000
        )
        with running_relay(service, config) as relay:
            wait_until(lambda: relay._channel is not None, 30, message="the relay connects")
            first = relay._channel
            wait_until(
                lambda: relay.failed >= NACK_STREAK and relay._channel not in (None, first),
                60,
                message="the relay opens a new publisher after a streak of nacks",
            )
            assert outbox_state(settings)["processed"] == 0  # nothing marked without an ack
            ch.queue_unbind("full", exchange, routing_key=key)
            wait_until(lambda: outbox_state(settings)["processed"] == 10, 60, message="all 10 rows published")
    finally:
        conn.close()
    got = drain_queue(settings.amqp_url, inbox_queue(settings))
    assert {d.body["message_id"] for d in got} == set(ids)


def test_a_row_whose_message_cannot_be_built_is_dead_lettered_and_the_batch_goes_on(
    settings: Settings, service: Service
) -> None:
    """Rows written around the outbox API: an expiry no float holds (building the headers
    raises), a message type longer than AMQP's 255-byte ``type`` property (pika would
    refuse it only when publishing). Each ends as an ``internal_error`` letter at once."""
    overflow, too_long, plain = insert_rows(
        settings,
        service.registry,
        [*orders(1, 1), *orders(1, 1, aggregate_id="o-long"), *orders(1, 1, aggregate_id="o-plain")],
    )
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        conn.execute(
            "UPDATE txbox.outbox SET metadata = metadata || jsonb_build_object('expires_at', repeat('9', 400)::numeric)"
            " WHERE id = %s",
            (overflow,),
        )
        conn.execute("UPDATE txbox.outbox SET message_type = repeat('x', 300) WHERE id = %s", (too_long,))
    with running_relay(service) as relay:
        wait_until(
            lambda: outbox_state(settings)["processed"] == 1 and outbox_state(settings)["abandoned"] == 2,
            30,
            message="the plain row published, the other two abandoned",
        )
        assert relay.abandoned == 2
    assert [d.body["message_id"] for d in drain_queue(settings.amqp_url, inbox_queue(settings), idle=1)] == [plain]
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        letters = conn.execute(
            "SELECT message_id::text, source, reason, error, message->>'message_id' FROM txbox.dead_letters"
        ).fetchall()
    assert sorted((r[0], r[1], r[2], r[4]) for r in letters) == sorted(
        (i, "outbox", "internal_error", i) for i in (overflow, too_long)
    )
    errors = {r[0]: r[3] for r in letters}
    assert "OverflowError" in errors[overflow]
    assert "message_type of 300 bytes" in errors[too_long]
