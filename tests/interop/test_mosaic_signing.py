"""Signed events between txbox and a Mosaic service, both ways (docs/explanation/receive.md, "Event signing").

The Mosaic peer (tests/interop/peer) signs its events with Mosaic's message bus
(``rmqEventSigningPrivateKey``) and checks the events it receives with Mosaic's
``validateSignedEventMiddleware``, which looks producers' keys up in a key service: here a
list the test serves over HTTP, the only stand-in. ``txbox run`` of ``widget-service``
signs its events and requires the peer's to be signed, fetching the peer's key from the
same key service (``TXBOX_SIGNING_KEYS_FORMAT=mosaic``). Judged from both databases, the
dead letters, the key service's requests and the peer's log:

- the peer's signed ``GadgetCreated`` is handled by txbox, txbox's signed ``WidgetCreated``
  by the peer; each asked the key service for the other's key, as Mosaic asks it;
- events published with plain pika that are unsigned, tampered with, or signed under a key
  version nobody has, are dead-lettered by txbox with their reasons; a tampered
  ``WidgetCreated`` is refused by Mosaic's middleware and never handled.
"""

from __future__ import annotations

import base64
import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pika
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from sqlalchemy.orm import Session

from framework import names
from framework.service import Service
from tests import support
from tests.interop import app as widget_app
from tests.interop.test_mosaic_peer import (
    DEADLINE,
    PEER_ID,
    node_peer_ready,
    peer_database,  # noqa: F401 - fixture
    rows,
    widget_peer,
    widget_run,
    widget_service,  # noqa: F401 - fixture
)
from txbox_tools.processes import ProcessGroup

pytestmark = pytest.mark.acceptance

SIGNATURE, VERSION = "x-mosaic-signature", "x-mosaic-signature-key-version"
TXBOX_VERSION, PEER_VERSION = 1, 3


def private_b64(key: rsa.RSAPrivateKey) -> str:
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return base64.b64encode(der).decode()


def public_b64(key: rsa.RSAPrivateKey) -> str:
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(der).decode()


def sign(key: rsa.RSAPrivateKey, body: bytes) -> str:
    return base64.b64encode(key.sign(body, padding.PKCS1v15(), hashes.SHA256())).decode()


class KeyService:
    """Mosaic's key service as its message bus asks it (GraphQL ``GetPublicSigningKeys``): a fixed list."""

    def __init__(self, keys: list[dict[str, Any]]) -> None:
        self.asked: list[dict[str, Any]] = []
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = min(int(self.headers.get("Content-Length", "0")), 1 << 20)
                service.asked.append(
                    {"path": self.path, "auth": self.headers.get("Authorization"), "body": self.rfile.read(length)}
                )
                answer = json.dumps({"data": {"publicKeys": {"nodes": keys}}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, name="key service", daemon=True)

    def __enter__(self) -> KeyService:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def publish_event(amqp_url: str, routing_key: str, body: bytes, headers: dict[str, Any]) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        props = pika.BasicProperties(content_type="application/json", delivery_mode=2, headers=headers)
        channel.basic_publish(names.EVENT_EXCHANGE, routing_key, body, props)
    finally:
        connection.close()


def event(message_type: str, aggregate_type: str, aggregate_id: str, payload: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "payload": payload,
            "message_context": {},
            "message_id": str(uuid.uuid4()),
            "timestamp": "2026-12-01T00:00:00.000Z",
            "message_type": message_type,
            "aggregate_id": aggregate_id,
            "aggregate_type": aggregate_type,
            "message_version": "1.1",
        }
    ).encode()


@pytest.fixture
def keys() -> Iterator[tuple[rsa.RSAPrivateKey, rsa.RSAPrivateKey]]:
    yield (
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
        rsa.generate_private_key(public_exponent=65537, key_size=2048),
    )


def test_signed_events_cross_both_ways_and_forgeries_are_refused_on_both_sides(
    widget_service: Service,  # noqa: F811
    peer_database: str,  # noqa: F811
    amqp_url: str,
    tmp_path: Path,
    keys: tuple[rsa.RSAPrivateKey, rsa.RSAPrivateKey],
) -> None:
    txbox_key, peer_key = keys
    node = node_peer_ready()
    txbox_db = widget_service.settings.database_url
    (tmp_path / "txbox-key.pem").write_text(private_b64(txbox_key))  # Mosaic's form: base64, no armour
    (tmp_path / "key-service-token").write_text("txbox-token\n")
    registered = [
        {"serviceId": widget_app.SERVICE, "version": TXBOX_VERSION, "key": public_b64(txbox_key), "isActive": True},
        {"serviceId": PEER_ID, "version": PEER_VERSION, "key": public_b64(peer_key), "isActive": True},
    ]
    with KeyService(registered) as key_service:
        group = ProcessGroup(tmp_path / "logs")
        peer = widget_peer(
            node,
            peer_database,
            amqp_url,
            tmp_path,
            PEER_SIGNING_PRIVATE_KEY=private_b64(peer_key),
            PEER_SIGNING_KEY_VERSION=str(PEER_VERSION),
            PEER_KEY_SERVICE_URL=key_service.url,
            # A custom service's key trusted by configuration turns the middleware's checks
            # on for every custom service; keys it does not list come from the key service.
            PEER_TRUSTED_KEYS=json.dumps(
                [{"serviceId": PEER_ID, "version": PEER_VERSION, "key": public_b64(peer_key)}]
            ),
            LOG_LEVEL="DEBUG",
        )
        try:
            txbox, _ = widget_run(
                group,
                txbox_db,
                amqp_url,
                TXBOX_SIGNING_KEY_FILE=str(tmp_path / "txbox-key.pem"),
                TXBOX_SIGNING_KEY_VERSION=str(TXBOX_VERSION),
                TXBOX_SIGNING_KEYS_URL=key_service.url,
                TXBOX_SIGNING_KEYS_FORMAT="mosaic",
                TXBOX_SIGNING_KEYS_TOKEN_FILE=str(tmp_path / "key-service-token"),
                TXBOX_SIGNING_VERIFY=f"{PEER_ID}=required",
            )
            peer.start(PEER_SEND_WIDGET="w1")
            with Session(widget_service.engine) as session, session.begin():
                widget_service.outbox(session).send_command(
                    "CreateGadget", aggregate_id="gadget-1", payload={"name": "g1"}
                )
            support.wait_until(
                lambda: (
                    (
                        rows(txbox_db, "SELECT count(*) FROM interop_effects WHERE message_type = 'GadgetCreated'")[0][
                            0
                        ]
                        and rows(peer_database, "SELECT count(*) FROM widget_events")[0][0]
                    )
                    or not (peer.alive and txbox.alive)
                ),
                DEADLINE,
                message="a signed event each way",
            )
            assert peer.alive, peer.log()[-3000:]
            assert txbox.alive, txbox.log_tail(40)
            # Each side asked the key service for the other's key, the same way, with its token.
            asked = {
                tuple(json.loads(a["body"])["variables"]["filter"]["serviceId"]["in"]): a for a in key_service.asked
            }
            assert set(asked) == {(widget_app.SERVICE,), (PEER_ID,)}, key_service.asked
            by_peer, by_txbox = asked[(widget_app.SERVICE,)], asked[(PEER_ID,)]
            assert (by_peer["path"], by_peer["auth"]) == ("/graphql", "Bearer interop-token")
            assert (by_txbox["path"], by_txbox["auth"]) == ("/graphql", "Bearer txbox-token")
            query = json.loads(by_txbox["body"])
            assert query["query"] == json.loads(by_peer["body"])["query"]
            # The peer's event reached txbox signed, and was stored after its check.
            stored = rows(txbox_db, "SELECT metadata FROM txbox.inbox WHERE message_type = 'GadgetCreated'")
            assert stored[0][0]["properties"]["headers"][VERSION] == PEER_VERSION

            # Forgeries towards txbox: unsigned, tampered with, signed under a version nobody has.
            gadget = "mosaic-peer.gadget.created"
            forged = {
                case: event("GadgetCreated", "gadget", case, {"gadget_id": case, "name": case})
                for case in ("unsigned", "tampered", "version")
            }
            publish_event(amqp_url, gadget, forged["unsigned"], {})
            publish_event(
                amqp_url,
                gadget,
                forged["tampered"],
                {
                    SIGNATURE: sign(peer_key, forged["tampered"].replace(b"tampered", b"tempered")),
                    VERSION: PEER_VERSION,
                },
            )
            publish_event(
                amqp_url, gadget, forged["version"], {SIGNATURE: sign(peer_key, forged["version"]), VERSION: 9}
            )
            support.wait_until(
                lambda: rows(txbox_db, "SELECT count(*) FROM txbox.dead_letters")[0][0] >= 3,
                DEADLINE,
                message="txbox's dead letters of the three forgeries",
            )
            letters = dict(rows(txbox_db, "SELECT message->>'aggregate_id', reason FROM txbox.dead_letters"))
            assert letters == {
                "unsigned": "signature_missing",
                "tampered": "signature_invalid",
                "version": "signing_key_unknown",
            }

            # A forgery towards Mosaic: txbox's signature over another body.
            widget = event("WidgetCreated", "widget", "widget-forged", {"widget_id": "widget-forged", "name": "x"})
            signature = sign(txbox_key, widget.replace(b"forged", b"honest"))
            offset = len(peer.log())
            publish_event(
                amqp_url, f"{widget_app.SERVICE}.widget.created", widget, {SIGNATURE: signature, VERSION: TXBOX_VERSION}
            )
            support.wait_until(
                lambda: "SIGNATURE_VALIDATION_FAILED" in peer.log()[offset:] or not peer.alive,
                DEADLINE,
                message="Mosaic's middleware to refuse the forged WidgetCreated",
            )
            assert rows(peer_database, "SELECT widget_id FROM widget_events") == [("widget-w1",)]
            assert sorted(rows(txbox_db, "SELECT message_type FROM interop_effects")) == [
                ("CreateWidget",),
                ("GadgetCreated",),
            ]
        finally:
            peer.stop()
            group.stop_all(timeout=10)
