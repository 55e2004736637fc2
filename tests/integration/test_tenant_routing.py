"""Multi-tenant routing keys (docs/explanation/receive.md, "Multi-tenant routing keys").

A contract written as Mosaic's multi-tenant ones are (`*.*.entity.action` channels)
loads; a command sent with plain pika on one tenant's key is stored under that key; the
handler's event inherits the tenant and environment; the relay publishes it on that
tenant's key; the service's own subscription (bound with the placeholders) receives it.
A key with its placeholders left in is refused as ``wrong_route``; a send without a tenant is
refused at send.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import Any

import pika
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, EventHandler, Message, Outbox, names, topology
from framework.errors import ContractError
from framework.receiver import Receiver, ReceiverConfig
from framework.relay import Relay, RelayConfig
from framework.service import Service
from framework.settings import Settings
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import publish, query, running

pytestmark = pytest.mark.integration

SERVICE = "ax-tenant-service"
CONTRACT = f"""
asyncapi: 2.0.0
x-service-id: {SERVICE}
info:
  title: Tenant Service
  version: '1.0.0'
x-subscribes:
  - {SERVICE}.*.*.thing.created
channels:
  '*.*.thing.create':
    bindings: {{amqp: {{queue: {{name: inbox}}}}}}
    publish:
      message: {{$ref: '#/components/messages/create-thing-command'}}
  '*.*.thing.created':
    bindings: {{amqp: {{queue: {{name: inbox}}}}}}
    subscribe:
      message: {{$ref: '#/components/messages/thing-created-event'}}
  'thing.audit':
    bindings: {{amqp: {{queue: {{name: inbox}}}}}}
    publish:
      message: {{$ref: '#/components/messages/audit-thing-command'}}
components:
  messages:
    create-thing-command:
      tags: [{{name: 'aggregate-type:thing'}}]
      payload: {{$ref: 'create-thing-command.json'}}
    thing-created-event:
      tags: [{{name: 'aggregate-type:thing'}}]
      payload: {{$ref: 'thing-created-event.json'}}
    audit-thing-command:
      tags: [{{name: 'aggregate-type:thing'}}]
      payload: {{$ref: 'audit-thing-command.json'}}
"""


def schema(title: str) -> str:
    return json.dumps(
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "title": title,
            "required": ["name"],
            "properties": {"name": {"type": "string"}},
        }
    )


class CreateThing(CommandHandler):
    message_type = "CreateThing"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        # No tenant named: the event takes the command's.
        outbox.publish_event("ThingCreated", aggregate_id=message.aggregate_id, payload=message.payload)


class ThingCreated(EventHandler):
    message_type = "ThingCreated"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        session.execute(
            text("INSERT INTO tenant_things (name, routing_key) VALUES (:n, :k)"),
            {"n": message.payload["name"], "k": message.routing_key},
        )


def contracts_folder(folder: Path) -> Path:
    """The contract above and its schemas, written into ``folder/contracts``."""
    contracts = folder / "contracts"
    contracts.mkdir()
    (contracts / "tenant-service.yml").write_text(CONTRACT)
    for name in ("create_thing_command", "thing_created_event", "audit_thing_command"):
        (contracts / f"{name.replace('_', '-')}.json").write_text(schema(name))
    return contracts


@pytest.fixture
def tenant_service(settings: Settings, tmp_path: Path) -> Service:
    contracts = contracts_folder(tmp_path)
    service = Service(settings=dataclasses.replace(settings, service=SERVICE, contracts_dir=contracts))
    service.register(CreateThing())
    service.register(ThingCreated())
    with service.engine.begin() as conn:
        conn.execute(text("CREATE TABLE tenant_things (name text, routing_key text)"))
    return service


def envelope(message_type: str, name: str) -> bytes:
    return json.dumps(
        {
            "payload": {"name": name},
            "message_context": {},
            "message_id": str(uuid.uuid4()),
            "timestamp": "2026-12-01T00:00:00.000Z",
            "message_type": message_type,
            "aggregate_id": name,
            "aggregate_type": "thing",
            "message_version": "1.0",
        }
    ).encode()


def test_a_tenants_command_and_its_event_keep_the_tenant_on_every_hop(
    tenant_service: Service, amqp_url: str, database_url: str
) -> None:
    spec = tenant_service.registry.get("CreateThing")
    assert spec.routing_key == f"{SERVICE}.*.*.thing.create" and spec.tenant_scoped
    topology.declare(tenant_service.settings, tenant_service.registry)
    tenant, environment = str(uuid.uuid4()), "env-1"
    command_key = f"{SERVICE}.{tenant}.{environment}.thing.create"
    props: Any = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    publish(amqp_url, [envelope("CreateThing", "t1")], routing_key=command_key, properties=[props])
    # The placeholders left in: the binding routes it (`*` matches the word `*`), the receiver refuses it.
    publish(
        amqp_url, [envelope("CreateThing", "literal")], routing_key=f"{SERVICE}.*.*.thing.create", properties=[props]
    )
    fast = {"poll_interval": 0.1}
    with (
        running(Receiver(tenant_service, ReceiverConfig(batch_wait=0.01))),  # type: ignore[arg-type]
        running(Worker(tenant_service, WorkerConfig(**fast))),  # type: ignore[arg-type]
        running(Relay(tenant_service, RelayConfig(**fast), declare_topology=False)),  # type: ignore[arg-type]
    ):
        support.wait_until(
            lambda: (
                query(database_url, "SELECT count(*) FROM tenant_things")[0][0] == 1
                and query(database_url, "SELECT count(*) FROM txbox.dead_letters")[0][0] == 1
            ),
            timeout=60,
            message="the tenant's event handled and the unfilled key dead-lettered",
        )
    event_key = f"{SERVICE}.{tenant}.{environment}.thing.created"
    assert query(database_url, "SELECT name, routing_key FROM tenant_things") == [("t1", event_key)]
    assert query(database_url, "SELECT routing_key FROM txbox.outbox") == [(event_key,)]
    stored = dict(query(database_url, "SELECT message_type, routing_key FROM txbox.inbox"))
    assert stored == {"CreateThing": command_key, "ThingCreated": event_key}
    assert {r for (r,) in query(database_url, "SELECT reason FROM txbox.dead_letters")} == {"wrong_route"}


def test_a_multi_tenant_send_names_its_tenant_and_others_do_not(tenant_service: Service) -> None:
    with Session(tenant_service.engine) as session, session.begin():
        outbox = tenant_service.outbox(session)
        with pytest.raises(ContractError, match="give tenant_id= and environment_id="):
            outbox.send_command("CreateThing", aggregate_id="x", payload={"name": "x"})
        with pytest.raises(ContractError, match="one routing-key word"):
            outbox.send_command(
                "CreateThing", aggregate_id="x", payload={"name": "x"}, tenant_id="a.b", environment_id="e"
            )
        with pytest.raises(ContractError, match="not a multi-tenant message"):
            outbox.send_command(
                "AuditThing", aggregate_id="x", payload={"name": "x"}, tenant_id="t", environment_id="e"
            )
        outbox.send_command(
            "CreateThing", aggregate_id="x", payload={"name": "x"}, tenant_id="t-1", environment_id="e-1"
        )
    rows = query(tenant_service.settings.database_url.replace("+psycopg", ""), "SELECT routing_key FROM txbox.outbox")
    assert rows == [(f"{SERVICE}.t-1.e-1.thing.create",)]
    assert names.tenancy(f"{SERVICE}.*.*.thing.create", rows[0][0]) == ("t-1", "e-1")
