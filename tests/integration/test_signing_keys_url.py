"""Producers' keys fetched from a JWKS URL by a running receiver (docs/explanation/receive.md,
"Event signing"), on the real broker and database.

The test serves the producer's JWKS over loopback HTTP and publishes events it signs
itself with plain pika; judged from the inbox and the dead letters: a key published at
start verifies; a new version that appears at the URL later is picked up on its first
event; while the URL answers with something huge, slow or malformed, the keys fetched
before keep verifying and an unknown version is dead-lettered ``signing_key_unknown``
naming what the fetch met; once the URL is healthy again, its new key is taken.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pika
import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from framework import names, topology
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from tests import support
from tests.apps.helpers import encode, place_order, publish, query, running
from tests.key_server import KeyServer, jwk

pytestmark = pytest.mark.integration

SIGNATURE, VERSION = "x-mosaic-signature", "x-mosaic-signature-key-version"
PRODUCER = "inventory-service"


def sign(key: rsa.RSAPrivateKey, body: bytes) -> str:
    return base64.b64encode(key.sign(body, padding.PKCS1v15(), hashes.SHA256())).decode()


def test_a_receiver_takes_rotated_keys_from_the_url_and_survives_a_hostile_one(
    service: Service, amqp_url: str, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = {v: rsa.generate_private_key(public_exponent=65537, key_size=2048) for v in (1, 2, 6)}
    settled = 0

    def deliver(case: str, version: int, key: rsa.RSAPrivateKey) -> None:
        """Publish one signed event and wait until it is stored or dead-lettered."""
        nonlocal settled
        data = place_order(message_type="StockReserved", aggregate_id=case)
        data["payload"] = {"order_id": case, "sku": "SKU-1", "quantity": 1}
        body = encode(data)
        headers: dict[str, Any] = {SIGNATURE: sign(key, body), VERSION: version}
        props = pika.BasicProperties(content_type="application/json", delivery_mode=2, headers=headers)
        publish(
            amqp_url,
            [body],
            exchange=names.EVENT_EXCHANGE,
            routing_key=f"{PRODUCER}.stock.reserved",
            properties=[props],
        )
        settled += 1
        support.wait_until(
            lambda: (
                query(
                    database_url,
                    "SELECT (SELECT count(*) FROM txbox.inbox) + (SELECT count(*) FROM txbox.dead_letters)",
                )[0][0]
                >= settled
            ),
            timeout=60,
            message=f"the event {case!r} stored or dead-lettered",
        )

    with KeyServer() as server:
        server.serve({"keys": [jwk(keys[1], "1")]})
        monkeypatch.setenv("TXBOX_SIGNING_KEYS_URL", f"{server.base}/{{service}}/jwks.json")
        monkeypatch.setenv("TXBOX_SIGNING_VERIFY", f"{PRODUCER}=required")
        monkeypatch.setenv("TXBOX_SIGNING_KEYS_REFRESH", "0s")  # every unknown version asks again
        monkeypatch.setenv("TXBOX_SIGNING_KEYS_TIMEOUT", "2s")
        topology.declare(service.settings, service.registry)
        with running(Receiver(service, ReceiverConfig(batch_wait=0.01))):  # type: ignore[arg-type]
            assert [r["path"] for r in server.requests] == [f"/{PRODUCER}/jwks.json"]  # fetched at start
            deliver("v1", 1, keys[1])
            assert server.count() == 1  # a known version asks nobody
            server.serve({"keys": [jwk(keys[1], "1"), jwk(keys[2], "2")]})  # rotation
            deliver("v2", 2, keys[2])
            assert server.count() == 2
            server.hostile("huge", size=8 * 1024 * 1024)
            deliver("huge", 6, keys[6])
            deliver("v1-while-huge", 1, keys[1])
            server.hostile("slow")
            deliver("slow", 6, keys[6])
            server.serve(b'{"keys": [{"kid": "6", "kty": "RSA", "n": "AQAB"')
            deliver("malformed", 6, keys[6])
            deliver("v2-while-malformed", 2, keys[2])
            server.serve({"keys": [jwk(keys[2], "2"), jwk(keys[6], "6")]})
            deliver("v6", 6, keys[6])
            deliver("v1-withdrawn", 1, keys[1])  # the healthy answer dropped version 1
    stored = {row[0] for row in query(database_url, "SELECT aggregate_id FROM txbox.inbox")}
    assert stored == {"v1", "v2", "v1-while-huge", "v2-while-malformed", "v6"}
    letters = {
        row[0]: row[1:]
        for row in query(database_url, "SELECT message->>'aggregate_id', reason, error FROM txbox.dead_letters")
    }
    assert {case: reason for case, (reason, _) in letters.items()} == {
        "huge": "signing_key_unknown",
        "slow": "signing_key_unknown",
        "malformed": "signing_key_unknown",
        "v1-withdrawn": "signing_key_unknown",
    }
    assert "more than 1048576 bytes" in letters["huge"][1] and "known: 1, 2" in letters["huge"][1]
    assert "no whole answer within 2 s" in letters["slow"][1]
    assert "not JSON" in letters["malformed"][1]
    assert "known: 2, 6" in letters["v1-withdrawn"][1]
