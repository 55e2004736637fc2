"""Replay sends only what this service could have sent itself (framework/dead_letters/route.py).

Letters are rows the tests insert raw into txbox.dead_letters (plain SQL, not our
encoder), or deliveries crafted with plain pika that the collector stores; they are
replayed through ``txbox dlq replay`` and judged from the outbox, the inbox and the
letters. The contracts' facts the verdicts rest on are spelled out here, not read from
the code under test.
"""

from __future__ import annotations

import io
import json
import random
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pika
import pytest
from psycopg.types.json import Jsonb

from framework import amqp, names, topology
from framework.cli import main
from framework.dead_letters.collector import Collector, CollectorConfig
from framework.service import Service
from tests import support
from tests.conftest import CONTRACTS
from tests.integration.dead_letters import seed

SERVICE = "order-service"
# The contracts (contracts/*): type → (kind, routing key, aggregate type, a valid payload).
CONTRACT = {
    "PlaceOrder": ("command", "order-service.order.place", "order", {"customer": "c", "sku": "SKU-1", "quantity": 1}),
    "OrderPlaced": ("event", "order-service.order.placed", "order", {"order_id": "o", "sku": "SKU-1", "quantity": 1}),
    "StockReserved": (
        "event",
        "inventory-service.stock.reserved",
        "stock",
        {"order_id": "o", "sku": "SKU-1", "quantity": 1},
    ),
    "RestockItem": ("command", "inventory-service.stock.restock", "stock", {"sku": "SKU-1", "quantity": 1}),
}
RECEIVES = {"PlaceOrder", "StockReserved"}  # order-service's commands and x-subscribes (of these four)
MAY_SEND = {"PlaceOrder", "OrderPlaced", "RestockItem"}  # commands, and the events it publishes itself
EXCHANGE = {"command": "command", "event": "event"}
OPERATOR_TOKEN = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJvcGVyYXRvciJ9.b3BlcmF0b3Itc2lnbmF0dXJl"
KEPT_TOKEN = "eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJsZXR0ZXIifQ.a2VwdC1pbi10aGUtbGV0dGVy"


def dlq(database_url: str, *args: str) -> list[str]:
    return ["dlq", "--service", SERVICE, "--database-url", database_url, "--contracts-dir", str(CONTRACTS), *args]


@dataclass
class Letter:
    """A dead-letter row as a test writes it: every part may claim something else."""

    source: str
    envelope_type: str
    column_type: str | None = None
    routing_key: str | None = None
    headers: dict[str, Any] = field(default_factory=dict)
    attempts: dict[str, Any] = field(default_factory=dict)
    envelope_id: uuid.UUID | None = None  # None: the letter's own message_id
    auth_token: str | None = None
    message_id: uuid.UUID = field(default_factory=uuid.uuid4)

    def envelope(self) -> dict[str, Any]:
        aggregate, payload = CONTRACT[self.envelope_type][2:]
        out = {
            "payload": payload,
            "message_context": {"example_correlation_id": str(uuid.uuid4())},
            "message_id": str(self.envelope_id or self.message_id),
            "timestamp": "2026-12-01T08:56:22.555Z",
            "message_type": self.envelope_type,
            "aggregate_id": "a-1",
            "aggregate_type": aggregate,
            "message_version": "1.0",
        }
        if self.auth_token is not None:
            out["auth_token"] = self.auth_token
        return out

    def insert(self, conn: Any) -> int:
        row = conn.execute(
            """INSERT INTO txbox.dead_letters (message_id, source, reason, error, fingerprint, message_type,
                   routing_key, message, headers, attempts)
               VALUES (%s, %s, 'max_attempts', 'boom', 'f', %s, %s, %s, %s, %s) RETURNING id""",
            (
                self.message_id,
                self.source,
                self.column_type,
                self.routing_key,
                Jsonb(self.envelope()),
                Jsonb(self.headers),
                Jsonb(self.attempts),
            ),
        ).fetchone()
        return int(row["id"])


def replay(database_url: str, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[int, Any]]:
    code = main(dlq(database_url, "replay", "--json", *args))
    out = capsys.readouterr()
    return code, {o["id"]: o for o in map(json.loads, out.out.splitlines())}


def rows(conn: Any, table: str, message_id: uuid.UUID) -> list[dict[str, Any]]:
    return list(conn.execute(f"SELECT * FROM txbox.{table} WHERE id = %s", (message_id,)).fetchall())


def assert_refused(conn: Any, outcome: dict[str, Any], letter: Letter, *words: str) -> None:
    assert outcome["action"] == "refused" and not outcome["ok"], outcome
    for word in words:
        assert word in outcome["detail"], outcome
    state = conn.execute("SELECT replayed_at, replay_count FROM txbox.dead_letters WHERE id = %s", (outcome["id"],))
    assert state.fetchone() == {"replayed_at": None, "replay_count": 0}, "a refused letter stays open"
    assert rows(conn, "outbox", letter.message_id) == [] and rows(conn, "inbox", letter.message_id) == []


def test_letters_whose_parts_disagree_are_refused_with_the_reason(
    database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    place = CONTRACT["PlaceOrder"][1]
    cases = {
        "type property says another type": (
            Letter("broker", "PlaceOrder", headers={"amqp_properties": {"type": "OrderPlaced"}}),
            ["OrderPlaced", "disagree"],
        ),
        "column says another type": (Letter("inbox", "PlaceOrder", column_type="StockReserved"), ["StockReserved"]),
        "key of another service's command": (
            Letter("broker", "PlaceOrder", routing_key="inventory-service.stock.restock"),
            ["RestockItem", "inventory-service"],
        ),
        "x-death key of another service's command": (
            Letter(
                "broker",
                "PlaceOrder",
                routing_key=place,
                attempts={"x_death": [{"exchange": "command", "routing-keys": ["inventory-service.stock.restock"]}]},
            ),
            ["RestockItem"],
        ),
        "an event this service does not publish": (
            Letter("outbox", "StockReserved", routing_key=CONTRACT["StockReserved"][1]),
            ["does not publish", "inventory-service"],
        ),
        "a command to a service it does not receive from the broker": (
            Letter("broker", "RestockItem", routing_key=CONTRACT["RestockItem"][1]),
            ["does not receive RestockItem"],
        ),
        "a command on the event exchange": (
            Letter("outbox", "PlaceOrder", routing_key=place, headers={"exchange": "event"}),
            ["exchange", "'command'"],
        ),
        "message_id property of another message": (
            Letter("broker", "PlaceOrder", headers={"amqp_properties": {"message_id": str(uuid.uuid4())}}),
            ["message_id", "disagree"],
        ),
        "envelope of another message id": (Letter("inbox", "PlaceOrder", envelope_id=uuid.uuid4()), ["message_id"]),
        "type property is not text": (
            Letter("broker", "PlaceOrder", headers={"amqp_properties": {"type": ["PlaceOrder"]}}),
            ["not text"],
        ),
        "an unbounded x-death list": (
            Letter("broker", "PlaceOrder", attempts={"x_death": [{"exchange": "command"}] * 10_000}),
            ["entries"],
        ),
    }
    ids = {name: letter.insert(conn) for name, (letter, _) in cases.items()}

    code, outcomes = replay(database_url, capsys, *map(str, ids.values()))

    assert code == 1
    for name, (letter, words) in cases.items():
        assert_refused(conn, outcomes[ids[name]], letter, *words)
    assert conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0


def test_letters_that_agree_are_replayed_by_the_contracts_route(
    database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    own_command = Letter(
        "broker",
        "PlaceOrder",
        column_type="PlaceOrder",
        routing_key="delay.10s",  # our retry chain's keys say nothing about the route
        headers={"amqp_properties": {"type": "PlaceOrder"}, "CC": ["order-service:inbox.order-service.order.place"]},
        attempts={"x_death": [{"exchange": "delay", "routing-keys": ["delay.10s"]}]},
    )
    others_event = Letter("broker", "StockReserved", routing_key=CONTRACT["StockReserved"][1])
    sent_event = Letter("outbox", "OrderPlaced", routing_key=CONTRACT["OrderPlaced"][1], headers={"exchange": "event"})
    ids = [x.insert(conn) for x in (own_command, others_event, sent_event)]

    code, outcomes = replay(database_url, capsys, *map(str, ids))

    assert code == 0, outcomes
    [row] = rows(conn, "outbox", own_command.message_id)
    assert (row["message_type"], row["kind"], row["routing_key"]) == (
        "PlaceOrder",
        "command",
        CONTRACT["PlaceOrder"][1],
    )
    [row] = rows(conn, "outbox", sent_event.message_id)
    assert (row["message_type"], row["kind"], row["routing_key"]) == (
        "OrderPlaced",
        "event",
        CONTRACT["OrderPlaced"][1],
    )
    # Another producer's event is never published again under this service's user: it goes
    # straight into the inbox it was delivered to.
    assert rows(conn, "outbox", others_event.message_id) == []
    [row] = rows(conn, "inbox", others_event.message_id)
    assert (row["message_type"], row["routing_key"], row["queue"]) == (
        "StockReserved",
        CONTRACT["StockReserved"][1],
        "order-service:inbox",
    )


def _generated(rng: random.Random, n: int) -> list[tuple[Letter, bool]]:
    """``n`` letters with each part chosen at random (agreeing, disagreeing or absent), and
    whether the contracts allow replaying it (the oracle: every claim names the envelope's
    type, id and route, and the source may hold that type)."""
    out: list[tuple[Letter, bool]] = []
    types = sorted(CONTRACT)
    for _ in range(n):
        source = rng.choice(["inbox", "broker", "outbox"])
        true = rng.choice(types)
        kind, key = CONTRACT[true][:2]
        agree = True
        letter = Letter(source, true)

        def pick(right: Any, *wrong: Any) -> Any:
            nonlocal agree
            choice = rng.choice(["absent", "right", "wrong"])
            if choice == "wrong":
                agree = False
                return rng.choice(wrong)
            return right if choice == "right" else None

        letter.column_type = pick(true, *(t for t in types if t != true))
        letter.routing_key = pick(
            rng.choice([key, f"order-service:inbox.{key}"]), *(CONTRACT[t][1] for t in types if t != true), "x.y"
        )
        if source == "broker":
            props = {"type": pick(true, *(t for t in types if t != true))}
            props["message_id"] = pick(str(letter.message_id), str(uuid.uuid4()), "not-a-uuid")
            letter.headers = {"amqp_properties": {k: v for k, v in props.items() if v is not None}}
            exchange = pick(EXCHANGE[kind], "event" if kind == "command" else "command", "")
            if exchange is not None:
                letter.attempts = {"x_death": [{"exchange": exchange, "queue": "order-service:inbox"}]}
        elif source == "outbox":
            exchange = pick(EXCHANGE[kind], "event" if kind == "command" else "command", "amq.topic")
            letter.headers = {} if exchange is None else {"exchange": exchange}
        allowed = true in (MAY_SEND if source == "outbox" else RECEIVES)
        out.append((letter, agree and allowed))
    return out


def test_generated_letters_end_refused_with_a_reason_or_sent_as_the_contracts_say(
    database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    cases = _generated(random.Random(20261201), 150)
    ids = [letter.insert(conn) for letter, _ in cases]

    _, outcomes = replay(database_url, capsys, *map(str, ids))

    kinds = {"refused": 0, "sent": 0, "into-inbox": 0}
    for lid, (letter, allowed) in zip(ids, cases, strict=True):
        outcome = outcomes[lid]
        if not allowed:
            assert_refused(conn, outcome, letter)
            assert outcome["detail"], outcome
            kinds["refused"] += 1
            continue
        assert outcome["ok"], (letter, outcome)
        true = letter.envelope_type
        kind, key = CONTRACT[true][:2]
        sent = rows(conn, "outbox", letter.message_id)
        if sent:
            [row] = sent
            assert true in MAY_SEND and (row["message_type"], row["kind"], row["routing_key"]) == (true, kind, key)
            kinds["sent"] += 1
        else:
            [row] = rows(conn, "inbox", letter.message_id)
            assert letter.source != "outbox" and true in RECEIVES
            assert (row["message_type"], row["routing_key"]) == (true, key)
            kinds["into-inbox"] += 1
    # Nothing else was sent: every outbox row is one the contracts allow this service.
    for row in conn.execute("SELECT message_type, kind, routing_key FROM txbox.outbox").fetchall():
        assert row["message_type"] in MAY_SEND and CONTRACT[row["message_type"]][:2] == (
            row["kind"],
            row["routing_key"],
        )
    assert min(kinds.values()) >= 5, kinds  # the table covers each outcome
    print(f"generated replays: {kinds}")


# --- the operator's auth_token -------------------------------------------------------


def test_replay_uses_the_operators_token_never_the_letters(
    database_url: str, conn: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = Letter("broker", "PlaceOrder", auth_token=KEPT_TOKEN)
    given = Letter("broker", "PlaceOrder", auth_token=KEPT_TOKEN)
    a, b = bare.insert(conn), given.insert(conn)
    inbox = seed.envelope(auth_token=KEPT_TOKEN)  # an abandoned inbox row that (wrongly) kept a token
    c = seed.abandoned(conn, "inbox", inbox)
    token_file = tmp_path / "token"
    token_file.write_text(OPERATOR_TOKEN + "\n")

    assert replay(database_url, capsys, str(a))[0] == 0
    code = main(dlq(database_url, "replay", str(b), "--auth-token-file", str(token_file)))
    printed = capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO(OPERATOR_TOKEN))
    assert main(dlq(database_url, "replay", str(c), "--auth-token-file", "-")) == 0
    printed_too = capsys.readouterr()

    assert code == 0
    [row] = rows(conn, "outbox", bare.message_id)
    assert "auth_token" not in row["metadata"], "the letter's token must not be sent"
    [row] = rows(conn, "outbox", given.message_id)
    assert row["metadata"]["auth_token"] == OPERATOR_TOKEN
    [row] = rows(conn, "inbox", inbox.message_id)
    assert row["metadata"]["auth_token"] == OPERATOR_TOKEN and row["abandoned_at"] is None
    for out in (printed, printed_too):
        assert OPERATOR_TOKEN not in out.out + out.err
    letters = conn.execute("SELECT string_agg(t::text, ' ') AS s FROM txbox.dead_letters t").fetchone()["s"]
    assert OPERATOR_TOKEN not in letters, "the operator's token is stored nowhere but the row that sends it"


@pytest.mark.parametrize(
    "content", ["", "   \n", "two words", "tok\x00en", "t" * 20_000, "tökën"], ids=lambda c: repr(c[:12])
)
def test_a_bad_token_file_fails_before_anything_changes(
    database_url: str, conn: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path, content: str
) -> None:
    letter = Letter("broker", "PlaceOrder")
    lid = letter.insert(conn)
    token_file = tmp_path / "token"
    token_file.write_text(content)

    assert main(dlq(database_url, "replay", str(lid), "--auth-token-file", str(token_file))) == 2
    err = capsys.readouterr().err
    assert "--auth-token-file" in err and (len(content.strip()) < 3 or content.strip()[:8] not in err)
    assert main(dlq(database_url, "replay", str(lid), "--auth-token-file", str(tmp_path / "missing"))) == 2
    assert "cannot read it" in capsys.readouterr().err
    assert rows(conn, "outbox", letter.message_id) == []


# --- deliveries crafted with plain pika, stored by the collector ---------------------


@pytest.fixture
def collector(service: Service) -> Iterator[Collector]:
    daemon = Collector(service, CollectorConfig(flush_interval=0.05))  # type: ignore[arg-type]
    thread = threading.Thread(target=daemon.run, daemon=True)
    thread.start()
    try:
        yield daemon
    finally:
        daemon.stop()
        thread.join(timeout=15)
        assert not thread.is_alive(), "collector did not stop"


def test_crafted_dead_letters_replay_only_as_the_contracts_say_whatever_their_size(
    service: Service, collector: Collector, database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    forged = Letter("broker", "PlaceOrder")
    large = Letter("broker", "PlaceOrder")
    envelope = large.envelope()
    envelope["message_context"] = {"trail": "x" * (200 * 1024)}  # far over the 64 KiB a raw body keeps
    connection = amqp.connect(service.settings.amqp_url)
    try:
        channel = connection.channel()
        topology.declare(service.settings, service.registry, channel)
        channel.confirm_delivery()
        for body, props in (
            (json.dumps(forged.envelope()).encode(), {"type": "OrderPlaced", "message_id": str(forged.message_id)}),
            (json.dumps(envelope).encode(), {"type": "PlaceOrder", "message_id": str(large.message_id)}),
        ):
            channel.basic_publish(
                names.DEAD_LETTER_EXCHANGE,
                names.dead_letter_routing_key(SERVICE),
                body,
                pika.BasicProperties(delivery_mode=2, content_type="application/json", **props),
            )
    finally:
        connection.close()
    query = "SELECT id, message_id FROM txbox.dead_letters ORDER BY id"
    stored = support.wait_until(lambda: len(found := conn.execute(query).fetchall()) == 2 and found, message="letters")
    by_message = {r["message_id"]: r["id"] for r in stored}

    code, outcomes = replay(database_url, capsys, *(str(r["id"]) for r in stored))

    assert code == 1
    assert_refused(conn, outcomes[by_message[forged.message_id]], forged, "OrderPlaced", "disagree")
    assert outcomes[by_message[large.message_id]]["ok"], outcomes
    [row] = rows(conn, "outbox", large.message_id)
    assert row["message_context"] == envelope["message_context"], "the whole message is replayed"
    assert (row["message_type"], row["routing_key"]) == ("PlaceOrder", CONTRACT["PlaceOrder"][1])


def test_a_body_refused_for_its_size_is_refused_for_replay_with_the_reason(
    database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    lid = conn.execute(
        """INSERT INTO txbox.dead_letters (message_id, source, reason, error, fingerprint, message_type,
               routing_key, raw_body, raw_encoding, headers)
           VALUES (%s, 'broker', 'too_large', 'body too large', 'f', 'PlaceOrder', 'order-service.order.place',
               '{"payload": {"customer": "c', 'utf-8', %s) RETURNING id""",
        (uuid.uuid4(), Jsonb({"x-txbox-body": {"length": 2 << 20, "stored": 65536, "truncated": True}})),
    ).fetchone()["id"]

    code, outcomes = replay(database_url, capsys, str(lid))

    assert code == 1 and outcomes[lid]["action"] == "refused"
    assert "larger than this service accepts" in outcomes[lid]["detail"], outcomes
    assert conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0


def test_a_receiver_limit_above_what_a_letter_keeps_whole_fails_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TXBOX_RECEIVER_MAX_BODY_BYTES", str(9 << 20))
    urls = ["--database-url", "postgresql://postgres@127.0.0.1:1/none", "--amqp-url", "amqp://guest:guest@127.0.0.1:1/"]
    assert main(["receiver", "--service", SERVICE, "--contracts-dir", str(CONTRACTS), *urls]) == 2
    err = capsys.readouterr().err
    assert "TXBOX_RECEIVER_MAX_BODY_BYTES=9437184 exceeds 8388608" in err and "Example:" in err
