"""What the receiver believes about a delivery: its id, its route, its control headers.

- A message id already in the inbox with other content is ``id_conflict`` (dead letter
  with the body, metric), a true duplicate stays quiet — also within one batch.
- A message is accepted only on the route its contract gives it (``wrong_route``).
- x-txbox-* headers count only from trusted broker users (RabbitMQ validates ``user_id``).

Everything is published with plain pika and judged from the database.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pika
from prometheus_client import REGISTRY

from framework import metrics, names, topology
from framework.dead_letters import decode_body
from framework.receiver import Receiver, ReceiverConfig
from framework.redaction import redact_bytes
from framework.service import Service
from tests import support
from tests.apps.helpers import place_order, publish, query, running, scalar


def _props(**extra: Any) -> pika.BasicProperties:
    return pika.BasicProperties(content_type="application/json", delivery_mode=2, **extra)


def _settled(url: str, count: int) -> bool:
    total = scalar(url, "SELECT (SELECT count(*) FROM txbox.inbox) + (SELECT count(*) FROM txbox.dead_letters)")
    return int(total) >= count


def _conflicts_metric() -> float:
    value = REGISTRY.get_sample_value("txbox_receiver_id_conflicts_total", metrics.labels("order-service"))
    return value or 0.0


def test_another_message_under_a_stored_id_is_an_id_conflict_and_a_true_duplicate_is_quiet(
    service: Service, database_url: str, amqp_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    original = place_order(aggregate_id="7", quantity=1)
    other_payload = {**copy.deepcopy(original), "payload": {**original["payload"], "quantity": 99}}
    other_aggregate = {**copy.deepcopy(original), "aggregate_id": "8"}
    # Same message sent again: key order and number spelling differ, context and token too.
    resent = {**copy.deepcopy(original), "message_context": {"other": "context"}, "auth_token": "new-token"}
    resent["payload"] = {
        "quantity": 1.0,
        "sku": original["payload"]["sku"],
        "customer": original["payload"]["customer"],
    }
    first = json.dumps(original).encode()
    later = [json.dumps(d).encode() for d in (other_payload, original, resent, other_aggregate)]
    before = _conflicts_metric()
    with running(Receiver(service, ReceiverConfig(prefetch=50, batch_size=10))):
        publish(amqp_url, [first])
        support.wait_until(lambda: _settled(database_url, 1), 30, message="the original stored")
        publish(amqp_url, later)  # one batch, most likely: conflicts and duplicates side by side
        support.wait_until(lambda: _settled(database_url, 3), 30, message="the two conflicts dead-lettered")
        # Within one batch: a new id twice, the second with another payload.
        fresh = place_order(aggregate_id="9")
        twin = {**copy.deepcopy(fresh), "payload": {**fresh["payload"], "quantity": 5}}
        publish(amqp_url, [json.dumps(fresh).encode(), json.dumps(twin).encode()])
        support.wait_until(lambda: _settled(database_url, 5), 30, message="the in-batch twin dead-lettered")
    rows = query(database_url, "SELECT id, aggregate_id, payload FROM txbox.inbox ORDER BY aggregate_id")
    assert [(str(r[0]), r[1], r[2]["quantity"]) for r in rows] == [
        (original["message_id"], "7", 1),
        (fresh["message_id"], "9", 1),
    ]
    letters = query(
        database_url, "SELECT reason, message_id, raw_body, raw_encoding, error FROM txbox.dead_letters ORDER BY id"
    )
    assert [r[0] for r in letters] == ["id_conflict"] * 3
    bodies = [decode_body(r[2], r[3]) for r in letters]
    assert bodies == [redact_bytes(json.dumps(m).encode()) for m in (other_payload, other_aggregate, twin)]
    assert "payload" in letters[0][4] and "aggregate_id" in letters[1][4]
    assert _conflicts_metric() - before == 3


def test_a_message_off_its_contract_route_is_wrong_route(service: Service, database_url: str, amqp_url: str) -> None:
    topology.declare(service.settings, service.registry)
    inbox = names.inbox_queue(service.name)
    command = place_order()
    event = place_order(message_type="StockReserved")
    event["payload"] = {"order_id": "o-1", "sku": "SKU-1", "quantity": 1}
    cases = [
        # A command through the event exchange, on a key the inbox listens to there.
        (names.EVENT_EXCHANGE, "inventory-service.stock.reserved", command),
        # An event type through the command exchange, on another type's key.
        (names.COMMAND_EXCHANGE, "order-service.order.place", event),
        # Straight into the queue through the default exchange.
        ("", inbox, place_order()),
        # Through retry, with another type's original key.
        (
            names.RETRY_EXCHANGE,
            names.retry_routing_key(service.name, "inventory-service.stock.reserved"),
            place_order(),
        ),
    ]
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    channel.confirm_delivery()
    for exchange, key, data in cases:
        channel.basic_publish(exchange, key, json.dumps(data).encode(), _props(), mandatory=True)
    connection.close()
    good = place_order()
    with running(Receiver(service, ReceiverConfig(prefetch=50, batch_size=10))):
        publish(amqp_url, [json.dumps(good).encode()])
        support.wait_until(lambda: _settled(database_url, len(cases) + 1), 30, message="all settled")
    assert [str(r[0]) for r in query(database_url, "SELECT id FROM txbox.inbox")] == [good["message_id"]]
    reasons = [r[0] for r in query(database_url, "SELECT reason FROM txbox.dead_letters")]
    assert reasons == ["wrong_route"] * len(cases)


def test_control_headers_count_only_from_a_trusted_broker_user(
    service: Service, database_url: str, amqp_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    lane = {names.HEADER_SEGMENT: "lane-1", names.HEADER_CONCURRENCY: "parallel", names.HEADER_PRIORITY: 300}
    stranger = place_order(aggregate_id="s")
    ours = place_order(aggregate_id="o")
    publish(
        amqp_url,
        [json.dumps(stranger).encode(), json.dumps(ours).encode()],
        properties=[_props(headers=lane), _props(headers=lane, user_id="guest")],
    )
    with running(Receiver(service, ReceiverConfig(prefetch=50, batch_size=10))):
        support.wait_until(lambda: _settled(database_url, 2), 30, message="both stored")
    rows = {str(r[0]): r[1:] for r in query(database_url, "SELECT id, segment, concurrency, priority FROM txbox.inbox")}
    assert rows[stranger["message_id"]] == ("order:s", "sequential", 0)
    assert rows[ours["message_id"]] == ("lane-1", "parallel", 300)
