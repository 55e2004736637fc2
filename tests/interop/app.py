"""`widget-service`: the txbox side of the interoperability test with a Mosaic service.

Accepts ``CreateWidget`` (sent by the Mosaic peer) and publishes ``WidgetCreated``;
consumes the peer's ``GadgetCreated`` event. Tenant-scoped (``*.*.`` channels): accepts
``TagWidget`` and publishes ``WidgetTagged`` under the command's tenant and environment;
consumes the peer's ``GadgetTagged``. Every handled message adds one row to
``interop_effects`` (with the routing key it came by), so a message applied twice would
show as two rows.

Run with ``txbox run --app tests.interop.app:service`` (the test does).
"""

from __future__ import annotations

import os
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, EventHandler, Message, Outbox, Service

CONTRACTS = Path(__file__).resolve().parent / "contracts"
SERVICE = "widget-service"

service = Service.from_env(
    service=SERVICE,
    database_url=os.environ.get("TXBOX_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/txbox_interop"),
    contracts_dir=CONTRACTS,
)

EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS interop_effects (
    n bigserial PRIMARY KEY,
    message_id uuid NOT NULL,
    message_type text NOT NULL,
    aggregate_id text NOT NULL,
    name text NOT NULL,
    routing_key text
)"""
_RECORD = text(
    "INSERT INTO interop_effects (message_id, message_type, aggregate_id, name, routing_key) "
    "VALUES (:message_id, :message_type, :aggregate_id, :name, :routing_key)"
)


def _record(session: Session, message: Message, name: str) -> None:
    session.execute(
        _RECORD,
        {
            "message_id": message.message_id,
            "message_type": message.message_type,
            "aggregate_id": message.aggregate_id,
            "name": name,
            "routing_key": message.routing_key,
        },
    )


class CreateWidget(CommandHandler):
    message_type = "CreateWidget"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        name = str(message.payload["name"])
        _record(session, message, name)
        outbox.publish_event(
            "WidgetCreated",
            aggregate_id=message.aggregate_id,
            payload={"widget_id": message.aggregate_id, "name": name},
        )


class GadgetCreated(EventHandler):
    message_type = "GadgetCreated"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        _record(session, message, str(message.payload["name"]))


class TagWidget(CommandHandler):
    message_type = "TagWidget"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        name = str(message.payload["name"])
        _record(session, message, name)
        # No tenant named: the event takes the command's (docs/explanation/receive.md, "Multi-tenant routing keys").
        outbox.publish_event(
            "WidgetTagged", aggregate_id=message.aggregate_id, payload={"widget_id": message.aggregate_id, "name": name}
        )


class GadgetTagged(EventHandler):
    message_type = "GadgetTagged"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        _record(session, message, str(message.payload["name"]))


service.register(CreateWidget())
service.register(GadgetCreated())
service.register(TagWidget())
service.register(GadgetTagged())
