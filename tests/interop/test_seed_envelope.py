"""The Mosaic guide's own example, end to end through the receiver and the worker.

Its contract (`x-service-id: ax-service-example`, channel `example.create`, no `name:`)
and its sample envelope (`message_type: ExampleCreateCommand`), published as raw bytes
with plain pika on `command` / `ax-service-example.example.create`, as a Mosaic service
sends it. The type Mosaic's generator gives the message is `CreateExample`; the
envelope's component-key name is an alias of it: stored and handled under the one type.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pika
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, topology
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from framework.settings import Settings
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import publish, query, running

SEED = Path(__file__).resolve().parents[1] / "fixtures" / "seed003"

# The guide's sample envelope, as printed (its auth token shortened to a placeholder).
ENVELOPE = b"""{
"payload":{
"title": "Example Title 1",
"count": 3
},
"message_context":{
"example_correlation_id": "9b9824d7-5af1-45c2-9f5d-32423f0d6d39"
},
"message_id":"3eb8257f-1341-49fb-bf77-027549cd4761",
"timestamp":"2024-03-02T08:56:22.555Z",
"message_type":"ExampleCreateCommand",
"aggregate_id": "3",
"aggregate_type": "example",
"message_version":"1.1",
"auth_token":"eyJhbGcixxx.eyJ0ZW5hbnRJZCxxx.VYqnlcLWxxx"
}"""


class CreateExample(CommandHandler):
    message_type = "CreateExample"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        session.execute(
            text("INSERT INTO examples (message_type, title) VALUES (:t, :title)"),
            {"t": message.message_type, "title": message.payload["title"]},
        )


def test_the_guides_example_envelope_is_received_and_handled(settings: Settings, database_url: str) -> None:
    service = Service(settings=dataclasses.replace(settings, service="ax-service-example", contracts_dir=SEED))
    service.register(CreateExample())
    assert not service.problems()
    query(database_url, "CREATE TABLE examples (n serial PRIMARY KEY, message_type text, title text)")
    topology.declare(service.settings, service.registry)
    props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    publish(settings.amqp_url, [ENVELOPE], routing_key="ax-service-example.example.create", properties=[props])
    config = ReceiverConfig(prefetch=10, batch_size=10)
    with running(Receiver(service, config)), running(Worker(service, WorkerConfig(poll_interval=0.1))):
        support.wait_until(
            lambda: query(database_url, "SELECT message_type, title FROM examples"), 20, message="the example handled"
        )
    assert query(database_url, "SELECT message_type, title FROM examples") == [("CreateExample", "Example Title 1")]
    assert query(database_url, "SELECT id::text, message_type, routing_key FROM txbox.inbox") == [
        (json.loads(ENVELOPE)["message_id"], "CreateExample", "ax-service-example.example.create")
    ]
