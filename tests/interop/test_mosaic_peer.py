"""txbox and a Mosaic service built with Mosaic's own npm libraries, on one vhost.

The Node peer (tests/interop/peer: ``@axinom/mosaic-message-bus`` and
``@axinom/mosaic-transactional-inbox-outbox``, installed by ``make setup``) and the txbox
service ``widget-service`` (tests/interop/app.py, run with ``txbox run``) each have a
database of their own and share one test vhost. Judged from both databases:

- the peer starts first, txbox second, then the peer again (second): nobody's
  declarations are refused and both keep running;
- a command and an event in each direction, each handled exactly once: the peer's
  ``CreateWidget`` → txbox, txbox's ``WidgetCreated`` → peer; txbox's ``CreateGadget`` →
  peer, the peer's ``GadgetCreated`` → txbox;
- one delivery on each side goes round the delay/retry path: txbox's database refuses
  the first ``CreateWidget`` (a trigger raising an "insufficient resources" error), the
  peer's inbox writer refuses the first ``CreateGadget``;
- a duplicate of each command (same ``message_id``, published with plain pika) stays
  one effect.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest
from sqlalchemy.orm import Session

from framework import names
from framework.service import Service
from framework.settings import Settings
from tests import support
from tests.interop import app as widget_app
from txbox_tools.processes import ProcessGroup

pytestmark = pytest.mark.acceptance

PEER_DIR = Path(__file__).resolve().parent / "peer"
PEER_ID = "mosaic-peer"
DEADLINE = 60.0

# The database refuses the first CreateWidget row with SQLSTATE 53000 (insufficient
# resources): to the receiver that is the database failing, not the message. The
# sequence is not rolled back with the failed insert, so only the first try fails.
FAULT_SQL = """
CREATE SEQUENCE interop_fault;
CREATE FUNCTION interop_fault() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.message_type = 'CreateWidget' AND nextval('interop_fault') = 1 THEN
        RAISE EXCEPTION 'injected: the database refuses the first CreateWidget' USING ERRCODE = '53000';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER interop_fault BEFORE INSERT ON txbox.inbox FOR EACH ROW EXECUTE FUNCTION interop_fault();
"""


def node_peer_ready() -> str:
    """The node executable; fails (never skips) with the fix when the peer is not installed."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: run `make setup` (it installs nodejs and npm from Debian)")
    if not (PEER_DIR / "node_modules" / "@axinom" / "mosaic-message-bus").is_dir():
        pytest.fail(f"the Mosaic test peer's npm packages are missing in {PEER_DIR}/node_modules: run `make setup`")
    return node


@dataclasses.dataclass
class NodePeer:
    """The Mosaic peer as a process with its own log."""

    node: str
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self, **extra: str) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [self.node, "peer.js"],
                cwd=PEER_DIR,
                env={**os.environ, **self.env, **extra},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        support.wait_until(
            lambda: f"{PEER_ID} ready" in self.log(offset) or not self.alive,
            DEADLINE,
            message="the Mosaic peer to start",
        )
        assert self.alive, f"the Mosaic peer died at start:\n{self.log(offset)[-3000:]}"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log(self, offset: int = 0) -> str:
        try:
            return self.log_path.read_bytes()[offset:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGINT: Mosaic's shutdown actions close the broker and the listeners."""
        if self.process is None or not self.alive:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(port: int, name: str) -> float:
    """Sum of a Prometheus counter's samples (0 while not served yet)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE))


def widget_peer(node: str, peer_database: str, amqp_url: str, folder: Path, **env: str) -> NodePeer:
    """The Mosaic peer on the widget contracts, its database and the test vhost, logging to
    ``folder``/mosaic-peer.log; ``env``: more of its settings (or another ``LOG_LEVEL``)."""
    settings = {
        "PEER_CONTRACTS": str(widget_app.CONTRACTS),
        "PEER_DATABASE_URL": peer_database,
        "PEER_AMQP_URL": amqp_url,
        "LOG_LEVEL": "WARN",
        **env,
    }
    return NodePeer(node, settings, folder / "mosaic-peer.log")


def widget_run(group: ProcessGroup, txbox_db: str, amqp_url: str, **env: str) -> tuple[Any, int]:
    """`txbox run` of widget-service on the test vhost, ready: the process and its metrics port."""
    port = free_port()
    txbox = group.start(
        "widget-run",
        ["run", "--app", "tests.interop.app:service", "--metrics-port", str(port)],
        {"TXBOX_DATABASE_URL": txbox_db, "TXBOX_AMQP_URL": amqp_url, **env},
    )
    support.wait_until(lambda: ready(port) or not txbox.alive, DEADLINE, message="txbox run to be ready")
    assert txbox.alive, txbox.log_tail(40)
    return txbox, port


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as response:
            return int(response.status) == 200
    except OSError:
        return False


def rows(url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        return conn.execute(query, params).fetchall()


def publish_duplicate(amqp_url: str, exchange: str, routing_key: str, envelope: dict[str, Any]) -> None:
    """Publish an envelope again, as plain bytes, with its original message_id."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        props = pika.BasicProperties(
            content_type="application/json", delivery_mode=2, message_id=envelope["message_id"]
        )
        channel.basic_publish(exchange, routing_key, json.dumps(envelope).encode(), props, mandatory=True)
    finally:
        connection.close()


def envelope_of(row: tuple[Any, ...]) -> dict[str, Any]:
    """A Mosaic envelope from (id, message_type, aggregate_type, aggregate_id, version, payload, context)."""
    message_id, message_type, aggregate_type, aggregate_id, version, payload, context = row
    return {
        "payload": payload,
        "message_context": context,
        "message_id": str(message_id),
        "timestamp": "2026-01-01T00:00:00.000Z",
        "message_type": message_type,
        "aggregate_id": aggregate_id,
        "aggregate_type": aggregate_type,
        "message_version": version or "1.1",
    }


@pytest.fixture
def peer_database() -> Iterator[str]:
    name = support.unique("txbox_interop_peer")
    support.create_database(name)
    try:
        yield support.db_url(name, driver="postgresql")
    finally:
        support.drop_database(name)


@pytest.fixture
def widget_service(settings: Settings) -> Iterator[Service]:
    service = Service(
        settings=dataclasses.replace(settings, service=widget_app.SERVICE, contracts_dir=widget_app.CONTRACTS)
    )
    with psycopg.connect(settings.database_url.replace("+psycopg", "")) as conn:
        conn.execute(widget_app.EFFECTS_DDL)
        conn.execute(FAULT_SQL)
    yield service
    service.engine.dispose()


def test_a_mosaic_service_and_txbox_exchange_commands_and_events_exactly_once(
    widget_service: Service, peer_database: str, amqp_url: str, vhost: str, tmp_path: Path
) -> None:
    node = node_peer_ready()
    txbox_db = widget_service.settings.database_url
    peer = widget_peer(node, peer_database, amqp_url, tmp_path)
    group = ProcessGroup(tmp_path / "logs")
    try:
        # 1. The Mosaic service first: it declares the shared queues its way.
        peer.start()
        # 2. txbox second, on top of Mosaic's declarations.
        txbox, port = widget_run(group, txbox_db, amqp_url)
        # 3. The Mosaic service again, now second, on txbox's declarations; it sends
        #    CreateWidget through its outbox. (Not before txbox has bound its queue once:
        #    Mosaic declares a command's target queue but not its binding, and its outbox
        #    does not retry a command the broker returns as unroutable.)
        peer.stop()
        peer.start(PEER_SEND_WIDGET="w1", PEER_FAIL_FIRST="CreateGadget")

        # 4. txbox sends CreateGadget from its outbox, in a business transaction.
        with Session(widget_service.engine) as session, session.begin():
            widget_service.outbox(session).send_command(
                "CreateGadget", aggregate_id="gadget-1", payload={"name": "g1"}, message_context={"ticket": "t-1"}
            )

        def all_done() -> bool:
            return (
                _count(txbox_db, "SELECT count(*) FROM interop_effects WHERE message_type = 'CreateWidget'") >= 1
                and _count(txbox_db, "SELECT count(*) FROM interop_effects WHERE message_type = 'GadgetCreated'") >= 1
                and _count(peer_database, "SELECT count(*) FROM gadgets") >= 1
                and _count(peer_database, "SELECT count(*) FROM widget_events") >= 1
            )

        support.wait_until(
            lambda: all_done() or not (peer.alive and txbox.alive),
            DEADLINE,
            message="a command and an event each way (one of each side's deliveries waits 10 s in a delay queue)",
        )
        assert peer.alive, peer.log()[-3000:]
        assert txbox.alive, txbox.log_tail(40)

        _what_crossed(txbox_db, peer_database, port)

        # 5. A duplicate of each command, same message_id, as plain bytes: one effect each.
        _duplicates_have_one_effect(txbox_db, peer_database, amqp_url, port, peer)

        assert peer.alive and txbox.alive, txbox.log_tail(40)
        queues = {q["name"]: q for q in support.mgmt("GET", f"/queues/{support.vhost_path(vhost)}")}
        assert queues[names.mosaic_delay_queue(10)]["arguments"] == {
            "x-message-ttl": 10_000,
            "x-dead-letter-exchange": "retry",
            "x-queue-type": "quorum",
        }
        assert queues[names.delay_queue(10)]["arguments"]["x-dead-letter-strategy"] == "at-least-once"
    finally:
        peer.stop()
        group.stop_all()
        print(peer.log()[-4000:])
        for daemon in group.daemons:
            print(daemon.log_tail(60))


def _count(url: str, query: str) -> int:
    return int(rows(url, query)[0][0])


def _what_crossed(txbox_db: str, peer_database: str, port: int) -> None:
    """What crossed, with Mosaic's routing keys and message types, once each, and the
    delay/retry path once on each side."""
    assert sorted(rows(txbox_db, "SELECT message_type, aggregate_id, name FROM interop_effects")) == [
        ("CreateWidget", "widget-w1", "w1"),
        ("GadgetCreated", "gadget-1", "g1"),
    ]
    assert rows(peer_database, "SELECT gadget_id, name FROM gadgets") == [("gadget-1", "g1")]
    assert rows(peer_database, "SELECT widget_id, name FROM widget_events") == [("widget-w1", "w1")]
    inbox = {r[0]: r[1:] for r in rows(txbox_db, "SELECT message_type, routing_key, kind, metadata FROM txbox.inbox")}
    assert inbox["CreateWidget"][:2] == (f"{widget_app.SERVICE}.widget.create", "command")
    assert inbox["GadgetCreated"][:2] == (f"{PEER_ID}.gadget.created", "event")
    peer_inbox = dict(rows(peer_database, "SELECT message_type, metadata FROM app_private.inbox"))
    assert set(peer_inbox) == {"CreateGadget", "WidgetCreated"}
    assert peer_inbox["WidgetCreated"]["fields"]["routingKey"] == f"{widget_app.SERVICE}.widget.created"
    assert peer_inbox["WidgetCreated"]["fields"]["exchange"] == names.EVENT_EXCHANGE

    # The delay/retry path, once on each side, each through its own delay queue.
    widget_headers = inbox["CreateWidget"][2]["properties"]["headers"]
    assert widget_headers[names.HEADER_ATTEMPT] == 2
    assert widget_headers["x-death"][0]["queue"] == names.delay_queue(10)  # at-least-once
    assert metric(port, "txbox_receiver_delayed_total") == 1
    gadget_headers = peer_inbox["CreateGadget"]["properties"]["headers"]
    assert gadget_headers["x-death"][0]["queue"] == names.mosaic_delay_queue(10)
    assert gadget_headers["rascal"]["recovery"][f"{PEER_ID}:inbox"]["forwarded"] == 1


def _duplicates_have_one_effect(txbox_db: str, peer_database: str, amqp_url: str, port: int, peer: NodePeer) -> None:
    """A duplicate of each command, same message_id, as plain bytes: one effect each."""
    gadget = rows(
        txbox_db,
        "SELECT id, message_type, aggregate_type, aggregate_id, message_version, payload, message_context "
        "FROM txbox.outbox WHERE message_type = 'CreateGadget'",
    )
    widget = rows(
        txbox_db,
        "SELECT id, message_type, aggregate_type, aggregate_id, message_version, payload, message_context "
        "FROM txbox.inbox WHERE message_type = 'CreateWidget'",
    )
    publish_duplicate(amqp_url, names.COMMAND_EXCHANGE, f"{PEER_ID}.gadget.create", envelope_of(gadget[0]))
    publish_duplicate(amqp_url, names.COMMAND_EXCHANGE, f"{widget_app.SERVICE}.widget.create", envelope_of(widget[0]))
    support.wait_until(
        lambda: metric(port, "txbox_receiver_duplicates_total") >= 1, DEADLINE, message="txbox to see the duplicate"
    )
    support.wait_until(
        lambda: f"The message with id {gadget[0][0]} already existed" in peer.log(),
        DEADLINE,
        message="the Mosaic inbox to see the duplicate",
    )
    unprocessed = "SELECT count(*) FROM {} WHERE processed_at IS NULL AND abandoned_at IS NULL"
    support.wait_until(
        lambda: (
            _count(txbox_db, unprocessed.format("txbox.inbox")) == 0
            and _count(peer_database, unprocessed.format("app_private.inbox")) == 0
        ),
        DEADLINE,
        message="both inboxes processed",
    )
    assert _count(txbox_db, "SELECT count(*) FROM interop_effects") == 2
    assert _count(peer_database, "SELECT count(*) FROM gadgets") == 1
    assert _count(peer_database, "SELECT count(*) FROM widget_events") == 1


def test_the_peer_fails_clearly_without_its_packages(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(f"{__name__}.PEER_DIR", tmp_path)
    with pytest.raises(pytest.fail.Exception, match="run `make setup`"):
        node_peer_ready()
