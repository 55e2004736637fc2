"""Expiry at each place a message waits, and receiver-side selectors, against the real servers.

- A message whose time to live ran out in the outbox, at the broker or in the inbox is
  dead-lettered as ``expired`` (source ``outbox``, ``broker``, ``inbox``) and counted;
  the messages beside it go on as usual.
- A handler's selector: a delivery it does not match (published with plain pika) is acked
  and counted, neither stored nor dead-lettered; hostile header values change nothing.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import timedelta
from typing import Any

import pika
import psycopg
from prometheus_client import REGISTRY
from sqlalchemy.orm import Session

from framework import AsyncPublisher, CommandHandler, Message, Outbox, Publisher, expiry, metrics, names, topology
from framework.db import conninfo
from framework.dead_letters import replay
from framework.receiver import Receiver, ReceiverConfig
from framework.relay import RelayConfig
from framework.service import Service
from framework.settings import Settings
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import place_order, publish, query, queue_depth, running, scalar, store_in_inbox
from tests.integration.publisher.conftest import drain_queue, inbox_queue, insert_rows, orders, outbox_state


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {**metrics.labels("order-service"), **labels}) or 0.0


def _wait_for_the_clock(expires_at: float) -> None:
    """Expiry is a time on the clock: the test waits for that time, not for another thread."""
    support.wait_until(lambda: expiry.passed(expires_at), 10, message="the message's expiry")


def _letters(url: str) -> list[tuple[Any, ...]]:
    return query(url, "SELECT message_id::text, source, reason, error FROM txbox.dead_letters ORDER BY id")


def _props(headers: dict[str, Any] | None = None) -> pika.BasicProperties:
    return pika.BasicProperties(content_type="application/json", delivery_mode=2, headers=headers)


def test_an_outbox_row_that_expired_is_dead_lettered_instead_of_published(settings: Settings, service: Service) -> None:
    expired_id, lasting_id, plain_id = insert_rows(
        settings,
        service.registry,
        [
            *orders(1, 1, ttl=0.05),
            *orders(1, 1, ttl=timedelta(hours=1), aggregate_id="o-lasting"),
            *orders(1, 1, aggregate_id="o-plain"),
        ],
    )
    (soon,) = [
        r[0]
        for r in query(
            settings.database_url,
            "SELECT (metadata->>'expires_at')::float FROM txbox.outbox WHERE id = %s",
            (expired_id,),
        )
    ]
    _wait_for_the_clock(soon)
    before = _metric("txbox_publisher_failed_total", message_type="PlaceOrder", reason="expired")
    with running_relay_fast(service):
        support.wait_until(
            lambda: outbox_state(settings)["processed"] == 2 and outbox_state(settings)["abandoned"] == 1,
            30,
            message="two rows published, the expired one abandoned",
        )
    got = {d.body["message_id"]: d for d in drain_queue(settings.amqp_url, inbox_queue(settings), idle=1)}
    assert set(got) == {lasting_id, plain_id}
    header = got[lasting_id].properties.headers[names.HEADER_EXPIRES_AT]
    assert abs((expiry.from_header(header) or 0) - (time.time() + 3600)) < 120
    assert names.HEADER_EXPIRES_AT not in (got[plain_id].properties.headers or {})
    [(message_id, source, reason, error)] = _letters(settings.database_url)
    assert (message_id, source, reason) == (expired_id, "outbox", "expired")
    assert "before the relay published it" in error
    assert _metric("txbox_publisher_failed_total", message_type="PlaceOrder", reason="expired") == before + 1


def running_relay_fast(service: Service) -> Any:
    from tests.integration.publisher.conftest import running_relay

    return running_relay(service, RelayConfig(poll_interval=0.2))  # type: ignore[arg-type]


def test_a_message_that_expired_at_the_broker_is_dead_lettered_by_the_receiver(
    service: Service, database_url: str, amqp_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    expires_at = time.time() + 0.3
    waited, lasting, plain, malformed = (place_order(aggregate_id=str(n)) for n in range(4))
    publish(
        amqp_url,
        [json.dumps(m).encode() for m in (waited, lasting, plain, malformed)],
        properties=[
            _props({names.HEADER_EXPIRES_AT: expiry.header_value(expires_at)}),
            _props({names.HEADER_EXPIRES_AT: expiry.header_value(time.time() + 3600)}),
            _props(),
            _props({names.HEADER_EXPIRES_AT: "next tuesday" * 1000}),  # not a time: no expiry
        ],
    )
    _wait_for_the_clock(expires_at)  # the message expires while it waits in the inbox queue
    before = _metric("txbox_receiver_rejected_total", reason="expired")
    with running(Receiver(service, ReceiverConfig(prefetch=10, batch_size=10))):
        support.wait_until(
            lambda: int(scalar(database_url, "SELECT count(*) FROM txbox.inbox")) == 3 and _letters(database_url),
            30,
            message="three stored, one dead-lettered",
        )
    [(message_id, source, reason, error)] = _letters(database_url)
    assert (message_id, source, reason) == (waited["message_id"], "broker", "expired")
    assert "before the receiver stored it" in error
    stored = dict(query(database_url, "SELECT id::text, metadata->'expires_at' FROM txbox.inbox"))
    assert set(stored) == {lasting["message_id"], plain["message_id"], malformed["message_id"]}
    assert stored[plain["message_id"]] is None and stored[malformed["message_id"]] is None
    assert abs(stored[lasting["message_id"]] - (time.time() + 3600)) < 120
    assert _metric("txbox_receiver_rejected_total", reason="expired") == before + 1


class Recorder(CommandHandler):
    message_type = "PlaceOrder"

    def __init__(self) -> None:
        self.seen: list[str] = []

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        self.seen.append(str(message.message_id))


def test_an_inbox_row_that_expired_is_dead_lettered_without_running_its_handler(
    service: Service, database_url: str
) -> None:
    handler = service.register(Recorder())
    expires_at = time.time() + 0.3
    waited, plain = place_order(aggregate_id="1"), place_order(aggregate_id="2")
    store_in_inbox(service, [waited], headers={names.HEADER_EXPIRES_AT: expiry.header_value(expires_at)})
    store_in_inbox(service, [plain])
    _wait_for_the_clock(expires_at)  # stored in time, expired before a worker took it
    before = _metric("txbox_worker_abandoned_total", message_type="PlaceOrder", reason="expired")
    with running(Worker(service, WorkerConfig(poll_interval=0.1))):
        support.wait_until(
            lambda: (
                int(
                    scalar(
                        database_url,
                        "SELECT count(*) FROM txbox.inbox WHERE coalesce(processed_at, abandoned_at) IS NOT NULL",
                    )
                )
                == 2
            ),
            30,
            message="both rows finished",
        )
    assert handler.seen == [plain["message_id"]]
    [(message_id, source, reason, error)] = _letters(database_url)
    assert (message_id, source, reason) == (waited["message_id"], "inbox", "expired")
    assert "before a worker ran its handler" in error
    assert _metric("txbox_worker_abandoned_total", message_type="PlaceOrder", reason="expired") == before + 1
    # Replaying the letter is someone's decision to run the message after all: its expiry goes.
    [(letter_id,)] = query(database_url, "SELECT id FROM txbox.dead_letters")
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        [outcome] = replay.replay(conn, "txbox", service.registry, service.name, [letter_id])
    assert outcome.action == "inbox-reset"
    with running(Worker(service, WorkerConfig(poll_interval=0.1))):
        support.wait_until(lambda: len(handler.seen) == 2, 30, message="the replayed message handled")
    assert handler.seen == [plain["message_id"], waited["message_id"]]


class AcmeOrders(Recorder):
    selector = "headers['x-tenant'] = 'acme' AND payload.quantity > 1"


def _deep_table(levels: int) -> dict[str, Any]:
    table: dict[str, Any] = {"x-tenant": "acme"}
    for _ in range(levels):
        table = {"x-tenant": table}
    return table


def test_a_selector_stores_what_it_matches_and_acks_the_rest_without_a_trace(
    service: Service, database_url: str, amqp_url: str
) -> None:
    service.register(AcmeOrders())
    topology.declare(service.settings, service.registry)
    cases = [
        (place_order(aggregate_id="match", quantity=2), {"x-tenant": "acme"}),
        (place_order(aggregate_id="few", quantity=1), {"x-tenant": "acme"}),
        (place_order(aggregate_id="other", quantity=2), {"x-tenant": "globex"}),
        (place_order(aggregate_id="none", quantity=2), None),
        (place_order(aggregate_id="huge", quantity=2), {"x-tenant": "acme" * 25_000}),
        (place_order(aggregate_id="deep", quantity=2), {"x-tenant": _deep_table(25)["x-tenant"]}),
        (place_order(aggregate_id="number", quantity=2), {"x-tenant": 7}),
    ]
    before = _metric("txbox_receiver_filtered_total", message_type="PlaceOrder")
    publish(amqp_url, [json.dumps(m).encode() for m, _ in cases], properties=[_props(h) for _, h in cases])
    with running(Receiver(service, ReceiverConfig(prefetch=20, batch_size=20))):
        support.wait_until(
            lambda: _metric("txbox_receiver_filtered_total", message_type="PlaceOrder") == before + 6,
            30,
            message="six deliveries filtered",
        )
        support.wait_until(
            lambda: int(scalar(database_url, "SELECT count(*) FROM txbox.inbox")) == 1, 30, message="one stored"
        )
    assert [r[0] for r in query(database_url, "SELECT aggregate_id FROM txbox.inbox")] == ["match"]
    assert _letters(database_url) == []
    assert queue_depth(amqp_url, names.inbox_queue(service.name)) == 0, "filtered deliveries are acked"


def test_direct_sends_carry_their_ttl_and_expire_at_the_receiver(
    service: Service, database_url: str, amqp_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    short, lasting = place_order(aggregate_id="short"), place_order(aggregate_id="lasting")
    key = "order-service.order.place"
    with Publisher(amqp_url) as publisher:
        publisher.publish(names.COMMAND_EXCHANGE, key, json.dumps(short).encode(), properties=_props(), ttl=0.3).result(
            30
        )
        sent = time.time()

    async def send() -> None:
        async with AsyncPublisher(amqp_url) as sender:
            await sender.publish(
                names.COMMAND_EXCHANGE, key, json.dumps(lasting).encode(), properties=_props(), ttl=timedelta(hours=1)
            )

    asyncio.run(send())
    _wait_for_the_clock(sent + 0.3)  # the short one's expiry is at most this
    with running(Receiver(service, ReceiverConfig(prefetch=10, batch_size=10))):
        support.wait_until(
            lambda: _letters(database_url) and int(scalar(database_url, "SELECT count(*) FROM txbox.inbox")) == 1,
            30,
            message="one stored, one expired",
        )
    assert [(r[0], r[2]) for r in _letters(database_url)] == [(short["message_id"], "expired")]
    assert [r[0] for r in query(database_url, "SELECT id::text FROM txbox.inbox")] == [lasting["message_id"]]
