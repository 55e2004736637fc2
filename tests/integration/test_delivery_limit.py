"""The inbox queues' delivery limit holds out of the box, against the real broker.

The receiver (and ``txbox topology``) apply the policy through the management API; a
message no receiver ever acks is then dead-lettered by RabbitMQ after the limit and
stored by the collector, never redelivered forever (docs/explanation/receive.md, "Receiver intake").
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid

import pika
import pytest

from framework import delivery_limit, names, topology
from framework.dead_letters.collector import Collector, CollectorConfig
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from tests import support
from tests.apps.helpers import place_order, publish, query, queue_depth, running


def _policy_in_force(vhost: str, queue: str) -> object:
    return (support.queue_info(vhost, queue) or {}).get("effective_policy_definition", {}).get("delivery-limit")


def _nack_until_gone(amqp_url: str, queue: str, most: int) -> int:
    """A receiver that dies holding the message, again and again: returns the deliveries it got."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        for delivered in range(most):
            method, _, _ = channel.basic_get(queue)
            if method is None:
                return delivered
            channel.basic_nack(method.delivery_tag, requeue=True)
        return most
    finally:
        connection.close()


QUORUM_ONLY = pytest.mark.skipif(
    os.environ.get("TXBOX_QUEUE_TYPE", "quorum") != "quorum", reason="classic queues have no delivery limit"
)


@QUORUM_ONLY
def test_a_message_nobody_acks_is_dead_lettered_after_the_limit_and_collected(
    service: Service, database_url: str, amqp_url: str, vhost: str
) -> None:
    inbox = names.inbox_queue(service.name)
    with running(Receiver(service, ReceiverConfig())):  # its start applies the policy
        support.wait_until(lambda: _policy_in_force(vhost, inbox), 30, message="the receiver's policy in force")
    assert _policy_in_force(vhost, inbox) == delivery_limit.INBOX_DELIVERY_LIMIT
    killer = place_order()
    publish(amqp_url, [json.dumps(killer).encode()])
    delivered = _nack_until_gone(amqp_url, inbox, most=3 * delivery_limit.INBOX_DELIVERY_LIMIT)
    assert delivery_limit.INBOX_DELIVERY_LIMIT <= delivered < 3 * delivery_limit.INBOX_DELIVERY_LIMIT
    assert queue_depth(amqp_url, inbox) == 0
    collector = Collector(service, CollectorConfig(flush_interval=0.05))  # type: ignore[arg-type]
    with running(collector):
        rows = support.wait_until(
            lambda: query(database_url, "SELECT message_id, reason, source FROM txbox.dead_letters"),
            30,
            message="the collector storing the letter",
        )
    assert rows == [(uuid.UUID(killer["message_id"]), "broker_delivery_limit", "broker")]
    assert queue_depth(amqp_url, names.dead_letter_queue(service.name)) == 0


@QUORUM_ONLY
def test_ensure_is_idempotent_and_never_displaces_an_operators_policy(service: Service, vhost: str) -> None:
    topology.declare(service.settings, service.registry)
    first = delivery_limit.ensure(service.settings)
    assert first.held, first.message
    policy = support.mgmt("GET", f"/policies/{support.vhost_path(vhost)}/{names.INBOX_LIMIT_POLICY}")
    assert policy["definition"] == {"delivery-limit": delivery_limit.INBOX_DELIVERY_LIMIT}
    assert delivery_limit.ensure(service.settings).held

    support.mgmt("DELETE", f"/policies/{support.vhost_path(vhost)}/{names.INBOX_LIMIT_POLICY}")
    operators = {"pattern": ".*", "definition": {"max-length": 1_000_000}, "apply-to": "queues", "priority": 5}
    support.mgmt("PUT", f"/policies/{support.vhost_path(vhost)}/operators", operators)
    inbox = names.inbox_queue(service.name)
    support.wait_until(lambda: (support.queue_info(vhost, inbox) or {}).get("policy") == "operators", 30)
    shadowed = delivery_limit.ensure(service.settings)
    assert not shadowed.held and "'operators'" in shadowed.message and '"delivery-limit": 20' in shadowed.message
    assert support.mgmt("GET", f"/policies/{support.vhost_path(vhost)}/{names.INBOX_LIMIT_POLICY}") is None


def test_without_the_management_api_the_message_gives_the_command(service: Service, vhost: str) -> None:
    settings = dataclasses.replace(service.settings, amqp_management_url="http://127.0.0.1:1/api")
    outcome = delivery_limit.ensure(settings)
    assert not outcome.held
    assert delivery_limit.policy_command(vhost) in outcome.message
