"""Message versions through the real receiver and worker (docs/explanation/receive.md, "Message versions").

``StockShelf`` (tests/fixtures/versions) is version 2, with version 1 still declared. A v1
and a v2 delivery are both admitted, each checked against its own version's schema; the
handler sees both as version 2 (v1 upcast). A version the contract does not declare is
refused at intake as ``schema_invalid``; a declared version the handler cannot take is
dead-lettered by the worker as ``permanent_error`` (VersionNotHandled) without running it.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from framework import names, topology
from framework.envelope import Message
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from framework.settings import Settings
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps import shelf
from tests.apps.helpers import encode, publish, query, running, scalar

V1 = {"sku": "SKU-1", "count": 3}
V2 = {"sku": "SKU-2", "quantity": 5, "location": "A-1"}


@pytest.fixture
def shelf_settings(database_url: str, amqp_url: str) -> Settings:
    return Settings(
        service="shelf-service", database_url=database_url, amqp_url=amqp_url, contracts_dir=shelf.CONTRACTS
    )  # type: ignore[arg-type]


def envelope(version: str, payload: dict[str, Any]) -> dict[str, Any]:
    return Message(
        message_id=uuid.uuid4(),
        message_type="StockShelf",
        aggregate_type="shelf",
        aggregate_id=str(uuid.uuid4()),  # a lane each: no message waits behind another
        payload=payload,
        message_version=version,
    ).to_dict()


def receive(service: Service, url: str, envelopes: list[dict[str, Any]]) -> None:
    """Publish the envelopes to the service's inbox and run its receiver until each is stored or dead-lettered."""
    topology.declare(service.settings, service.registry)
    publish(
        url, [encode(e) for e in envelopes], routing_key="shelf-service.shelf.stock", exchange=names.COMMAND_EXCHANGE
    )
    settled = "SELECT (SELECT count(*) FROM txbox.inbox) + (SELECT count(*) FROM txbox.dead_letters)"
    with running(Receiver(service, ReceiverConfig(prefetch=50, batch_size=10))):
        support.wait_until(
            lambda: scalar(service.settings.database_url, settled) == len(envelopes), 20, message="all settled"
        )


def work(service: Service, count: int) -> None:
    done = "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL OR abandoned_at IS NOT NULL"
    with running(Worker(service, WorkerConfig(poll_interval=0.1))):
        support.wait_until(lambda: scalar(service.settings.database_url, done) == count, 20, message="all worked")


def letters(url: str) -> dict[str, tuple[str, str]]:
    rows = query(url, "SELECT message_id, reason, error FROM txbox.dead_letters")
    return {str(r[0]): (r[1], r[2]) for r in rows}


def test_v1_and_v2_are_admitted_by_their_own_schema_and_v1_is_upcast(
    shelf_settings: Settings, database_url: str, amqp_url: str
) -> None:
    handler = shelf.UpcastingShelf()
    service = shelf.service(handler, shelf_settings)
    v1, v2 = envelope("1", V1), envelope("2", V2)
    v3 = envelope("3", V2)  # no such version in the contract
    v1_as_v2 = envelope("1", V2)  # declared as 1, shaped as 2
    receive(service, amqp_url, [v1, v2, v3, v1_as_v2])

    stored = dict(query(database_url, "SELECT id::text, message_version FROM txbox.inbox"))
    assert stored == {v1["message_id"]: "1", v2["message_id"]: "2"}
    refused = letters(database_url)
    assert refused[v3["message_id"]][0] == "schema_invalid"
    assert "'3' is not declared by the contract (2, 1)" in refused[v3["message_id"]][1]
    assert refused[v1_as_v2["message_id"]][0] == "schema_invalid"
    assert '"count" is a required property' in refused[v1_as_v2["message_id"]][1]

    work(service, 2)
    assert sorted(handler.seen, key=lambda s: s[1]["sku"]) == [
        ("2", {"sku": "SKU-1", "quantity": 3, "location": "unknown"}),
        ("2", V2),
    ]


def test_a_declared_version_the_handler_cannot_take_is_dead_lettered_with_the_fix(
    shelf_settings: Settings, database_url: str, amqp_url: str
) -> None:
    handler = shelf.CurrentOnlyShelf()
    service = shelf.service(handler, shelf_settings)
    v1, v2 = envelope("1", V1), envelope("2", V2)
    receive(service, amqp_url, [v1, v2])
    work(service, 2)

    assert handler.seen == [("2", V2)]
    reason, error = letters(database_url)[v1["message_id"]]
    assert reason == "permanent_error"
    assert "does not take StockShelf version '1' (it takes 2)" in error
    (abandoned,) = query(
        database_url,
        "SELECT abandoned_at IS NOT NULL, finished_attempts FROM txbox.inbox WHERE id = %s",
        (v1["message_id"],),
    )
    assert abandoned == (True, 1)  # at once: a retry would not change it


def test_the_outbox_writes_the_current_version_by_default_and_checks_an_older_one(shelf_settings: Settings) -> None:
    from sqlalchemy.orm import Session

    from framework.errors import PayloadValidationError

    service = shelf.service(shelf.UpcastingShelf(), shelf_settings)
    with Session(service.engine) as session, session.begin():
        outbox = service.outbox(session)
        outbox.send_command("StockShelf", aggregate_id="1", payload=V2)
        outbox.send_command("StockShelf", aggregate_id="2", payload=V1, message_version="1")
        with pytest.raises(PayloadValidationError, match='"quantity" is a required property'):
            outbox.send_command("StockShelf", aggregate_id="3", payload=V1)
    written = dict(query(service.settings.database_url, "SELECT aggregate_id, message_version FROM txbox.outbox"))
    assert written == {"1": "2", "2": "1"}
