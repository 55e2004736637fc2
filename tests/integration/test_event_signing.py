"""Signed events on the real broker and database (docs/explanation/receive.md, "Event signing").

The relay's signatures are checked with the cryptography library directly over the raw
bytes a plain pika consumer received; the receiver's judgments come from deliveries the
test signs itself and publishes with plain pika, read back from the inbox and the dead
letters.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pika
import pytest
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from framework import names, topology
from framework.errors import ConfigurationError
from framework.receiver import Receiver, ReceiverConfig
from framework.relay import Relay, RelayConfig
from framework.service import Service
from tests import support
from tests.apps.helpers import encode, place_order, publish, query, running
from tests.integration.publisher.conftest import insert_rows

pytestmark = pytest.mark.integration

SIGNATURE, VERSION = "x-mosaic-signature", "x-mosaic-signature-key-version"


@pytest.fixture(scope="module")
def key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem_private(key: rsa.RSAPrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def pem_public(key: rsa.RSAPrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def sign(key: rsa.RSAPrivateKey, body: bytes) -> str:
    return base64.b64encode(key.sign(body, padding.PKCS1v15(), hashes.SHA256())).decode()


def raw_messages(amqp_url: str, queue: str, count: int) -> list[tuple[pika.BasicProperties, bytes]]:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        got: list[tuple[pika.BasicProperties, bytes]] = []
        for method, props, body in channel.consume(queue, inactivity_timeout=30):
            assert method is not None, f"only {len(got)} of {count} messages reached {queue} within 30 s"
            channel.basic_ack(method.delivery_tag)
            got.append((props, body))
            if len(got) == count:
                break
        channel.cancel()
        return got
    finally:
        connection.close()


def test_the_relay_signs_every_event_and_no_command(
    service: Service, amqp_url: str, key: rsa.RSAPrivateKey, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "signing-key.pem"
    key_file.write_bytes(pem_private(key))
    monkeypatch.setenv("TXBOX_SIGNING_KEY_FILE", str(key_file))
    monkeypatch.setenv("TXBOX_SIGNING_KEY_VERSION", "4")
    topology.declare(service.settings, service.registry)
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    watch = connection.channel().queue_declare("", exclusive=False, auto_delete=False).method.queue
    connection.channel().queue_bind(watch, names.EVENT_EXCHANGE, "order-service.#")
    connection.channel().queue_bind(watch, names.COMMAND_EXCHANGE, "order-service.#")
    connection.close()
    insert_rows(
        service.settings,
        service.registry,
        [
            {
                "message_type": "OrderPlaced",
                "aggregate_id": "o-1",
                "payload": {"order_id": "o-1", "sku": "é ✓", "quantity": 2},
            },
            {
                "message_type": "PlaceOrder",
                "aggregate_id": "o-2",
                "payload": {"customer": "c", "sku": "SKU-1", "quantity": 1},
            },
        ],
    )
    with running(Relay(service, RelayConfig(poll_interval=0.2), declare_topology=False)):  # type: ignore[arg-type]
        messages = raw_messages(amqp_url, watch, 2)
    by_type = {props.type: (props, body) for props, body in messages}
    props, body = by_type["OrderPlaced"]
    assert props.headers[VERSION] == 4
    key.public_key().verify(base64.b64decode(props.headers[SIGNATURE]), body, padding.PKCS1v15(), hashes.SHA256())
    with pytest.raises(InvalidSignature):
        key.public_key().verify(
            base64.b64decode(props.headers[SIGNATURE]),
            body.replace(b'"o-1"', b'"o-9"'),
            padding.PKCS1v15(),
            hashes.SHA256(),
        )
    command_headers = by_type["PlaceOrder"][0].headers or {}
    assert SIGNATURE not in command_headers and VERSION not in command_headers


def test_the_receiver_dead_letters_what_its_producers_policy_refuses(
    service: Service,
    amqp_url: str,
    database_url: str,
    key: rsa.RSAPrivateKey,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "inventory-service.1.pem").write_bytes(pem_public(key))
    monkeypatch.setenv("TXBOX_SIGNING_PUBLIC_KEYS", str(keys))  # producers with a key: signatures required
    stranger = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    def event(case: str) -> bytes:
        data = place_order(message_type="StockReserved", aggregate_id=case)
        data["payload"] = {"order_id": case, "sku": "SKU-1", "quantity": 1}
        return encode(data)

    signed, unsigned, tampered, other_version, foreign = (
        event(c) for c in ("signed", "unsigned", "tampered", "v2", "foreign")
    )
    cases: list[tuple[bytes, dict[str, Any]]] = [
        (signed, {SIGNATURE: sign(key, signed), VERSION: 1}),
        (unsigned, {}),
        (tampered, {SIGNATURE: sign(key, tampered.replace(b'"tampered"', b'"other"')), VERSION: 1}),
        (other_version, {SIGNATURE: sign(key, other_version), VERSION: 2}),
        (foreign, {SIGNATURE: sign(stranger, foreign), VERSION: 1}),
    ]
    topology.declare(service.settings, service.registry)
    with running(Receiver(service, ReceiverConfig(batch_wait=0.01))):  # type: ignore[arg-type]
        for body, headers in cases:
            props = pika.BasicProperties(content_type="application/json", delivery_mode=2, headers=headers)
            publish(
                amqp_url,
                [body],
                exchange=names.EVENT_EXCHANGE,
                routing_key="inventory-service.stock.reserved",
                properties=[props],
            )
        # Commands are not signed (as Mosaic's are not): one goes through unsigned.
        publish(amqp_url, [encode(place_order(aggregate_id="command"))])
        support.wait_until(
            lambda: (
                query(
                    database_url,
                    "SELECT (SELECT count(*) FROM txbox.inbox) + (SELECT count(*) FROM txbox.dead_letters)",
                )[0][0]
                == 6
            ),
            timeout=60,
            message="every delivery stored or dead-lettered",
        )
    stored = {row[0] for row in query(database_url, "SELECT aggregate_id FROM txbox.inbox")}
    letters = dict(query(database_url, "SELECT message->>'aggregate_id', reason FROM txbox.dead_letters"))
    assert stored == {"signed", "command"}
    assert letters == {
        "unsigned": "signature_missing",
        "tampered": "signature_invalid",
        "v2": "signing_key_unknown",
        "foreign": "signature_invalid",
    }


def test_a_producer_to_verify_without_a_key_fails_at_start(service: Service, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TXBOX_SIGNING_VERIFY", "inventory-service=required")
    with pytest.raises(ConfigurationError, match=r"inventory-service.*no public key"):
        Receiver(service, ReceiverConfig())  # type: ignore[arg-type]
    monkeypatch.setenv("TXBOX_SIGNING_VERIFY", "inventory-service=sometimes")
    with pytest.raises(ConfigurationError, match="TXBOX_SIGNING_VERIFY"):
        Receiver(service, ReceiverConfig())  # type: ignore[arg-type]
    monkeypatch.delenv("TXBOX_SIGNING_VERIFY")
    monkeypatch.setenv("TXBOX_SIGNING_KEY_FILE", "/nonexistent/key.pem")
    with pytest.raises(ConfigurationError, match="TXBOX_SIGNING_KEY_VERSION"):
        Relay(service, RelayConfig())  # type: ignore[arg-type]
