"""Whatever reaches <service>:dead_letter is stored in a defined outcome and the collector goes on.

Raw pika publishes straight to the dead_letter exchange (or via queues RabbitMQ itself
dead-letters from); the verdict comes from txbox.dead_letters and the queue's depth.
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pika
import pytest

from framework import amqp, dead_letters, jsoncodec, names, topology
from framework.dead_letters.collector import Collector, CollectorConfig
from framework.reasons import Reason
from framework.service import Service
from tests import support

SERVICE = "order-service"
MIB = 1 << 20


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


@pytest.fixture
def channel(service: Service) -> Iterator[Any]:
    connection = amqp.connect(service.settings.amqp_url)
    try:
        ch = connection.channel()
        topology.declare(service.settings, service.registry, ch)
        ch.confirm_delivery()
        yield ch
    finally:
        if connection.is_open:
            connection.close()


def _dead_letter(channel: Any, body: bytes, props: pika.BasicProperties) -> None:
    channel.basic_publish(names.DEAD_LETTER_EXCHANGE, names.dead_letter_routing_key(SERVICE), body, props)


def _letters(conn: Any) -> list[dict[str, Any]]:
    return list(conn.execute("SELECT * FROM txbox.dead_letters ORDER BY id").fetchall())


def _by_case(conn: Any, count: int) -> dict[str, dict[str, Any]]:
    rows = support.wait_until(lambda: len(_letters(conn)) >= count and _letters(conn), message=f"{count} letters")
    assert len(rows) == count
    return {row["headers"].get("x-case", "?"): row for row in rows}


def _depth(service: Service) -> int:
    connection = amqp.connect(service.settings.amqp_url)
    try:
        declared = connection.channel().queue_declare(names.dead_letter_queue(SERVICE), passive=True)
        return int(declared.method.message_count)
    finally:
        connection.close()


def _nested_table(depth: int) -> dict[str, Any]:
    table: dict[str, Any] = {}
    inner = table
    for _ in range(depth):
        inner["t"] = {}
        inner = inner["t"]
    return table


def _nested_array(depth: int) -> list[Any]:
    array: list[Any] = []
    inner = array
    for _ in range(depth):
        inner.append([])
        inner = inner[0]
    return array


def test_header_tables_nested_as_deep_as_a_frame_allows_are_stored(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    """pika decodes tables recursively: without a depth bound the connection drops on such a
    delivery, it is redelivered, and the collector stores nothing, ever."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(100_000)  # pika *encodes* recursively too: only the publisher needs it
    try:
        _dead_letter(
            channel, b"deep table", pika.BasicProperties(headers={"x-case": "table", "d": _nested_table(15_000)})
        )
        _dead_letter(
            channel, b"deep array", pika.BasicProperties(headers={"x-case": "array", "d": _nested_array(20_000)})
        )
    finally:
        sys.setrecursionlimit(limit)
    _dead_letter(channel, b"after", pika.BasicProperties(headers={"x-case": "after"}))

    rows = _by_case(conn, 3)
    assert set(rows) == {"table", "array", "after"}
    for case in ("table", "array"):
        assert rows[case]["reason"] == "broker_unknown" and rows[case]["raw_body"] == f"deep {case}"
        assert "not decoded" in json.dumps(rows[case]["headers"]) or "not kept" in json.dumps(rows[case]["headers"])
    support.wait_until(lambda: _depth(service) == 0, message="every delivery acked")


def test_malformed_and_forged_headers_and_control_characters_are_stored(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    nul = "nul\x00ctl\x01\x1f\x7f"
    cases: dict[str, pika.BasicProperties] = {
        "x-death a string": pika.BasicProperties(headers={"x-death": "garbage"}),
        "x-death of numbers": pika.BasicProperties(headers={"x-death": [1, None, "x", [2]]}),
        "x-death wrong types": pika.BasicProperties(
            headers={
                "x-death": [{"count": "many", "queue": {"q": 1}, "reason": [1], "routing-keys": 7, "time": "x"}],
                "x-first-death-queue": ["not", "text"],
                "x-first-death-reason": {"a": 1},
            }
        ),
        "huge count": pika.BasicProperties(
            headers={"x-death": [{"count": 2**63 - 1, "reason": "rejected", "queue": "q"}]}
        ),
        "forged reason table": pika.BasicProperties(headers={names.HEADER_DEAD_REASON: {"x": 1}}),
        "forged reason text": pika.BasicProperties(headers={names.HEADER_DEAD_REASON: "Robert'); DROP TABLE x;--"}),
        "forged error": pika.BasicProperties(headers={names.HEADER_DEAD_ERROR: ["a", {"b": nul}]}),
        "nul everywhere": pika.BasicProperties(
            type=nul,
            message_id=nul,
            correlation_id=nul,
            app_id=nul,
            content_type=nul,
            reply_to=nul,
            headers={nul: nul, "k": [nul, {nul: b"\x00\xff"}], names.HEADER_DEAD_REASON: nul},
        ),
        "invalid utf-8 property": pika.BasicProperties(type=b"\xff\xfe\x00", app_id=b"\xc3"),  # type: ignore[arg-type]
        "big numbers": pika.BasicProperties(headers={"i": 2**63 - 1, "n": -(2**63)}),
    }
    for case, props in cases.items():
        props.headers = {**(props.headers or {}), "x-case": case}
        _dead_letter(channel, f"body of {case}".encode(), props)

    rows = _by_case(conn, len(cases))
    assert set(rows) == set(cases)
    for case, row in rows.items():
        assert row["source"] == "broker" and row["raw_body"] == f"body of {case}", case
        assert row["reason"] in ("broker_unknown", "broker_rejected"), (case, row["reason"])
    assert rows["forged reason text"]["headers"][names.HEADER_DEAD_REASON] == "Robert'); DROP TABLE x;--"
    assert rows["huge count"]["attempts"]["deaths"] == 2**63 - 1
    odd = rows["nul everywhere"]
    assert "\x00" not in (odd["message_type"] or "") and odd["message_type"].startswith("nul")
    support.wait_until(lambda: _depth(service) == 0, message="every delivery acked")


def _via_queue(channel: Any, arguments: dict[str, Any], body: bytes) -> str:
    """A queue of our own that RabbitMQ dead-letters into <service>.dead_letter."""
    queue = f"test-{uuid.uuid4().hex[:8]}"
    channel.queue_declare(
        queue,
        durable=True,
        arguments={
            "x-dead-letter-exchange": names.DEAD_LETTER_EXCHANGE,
            "x-dead-letter-routing-key": names.dead_letter_routing_key(SERVICE),
            **arguments,
        },
    )
    channel.basic_publish("", queue, body, pika.BasicProperties(headers={"x-case": queue}))
    return queue


def test_what_rabbitmq_dead_letters_itself_is_stored(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    """Delivery limit (the inbox queue's last net), expiry and rejection, without our headers."""
    limited = _via_queue(channel, {"x-queue-type": "quorum", "x-delivery-limit": 1}, b"over the limit")
    expired = _via_queue(channel, {"x-message-ttl": 1}, b"expired")
    rejected = _via_queue(channel, {}, b"rejected")
    for _ in range(3):  # a quorum queue counts returned deliveries; past the limit it dead-letters
        method = support.wait_until(lambda: channel.basic_get(limited)[0] or _letters(conn), message="a delivery")
        if not hasattr(method, "delivery_tag"):
            break
        channel.basic_nack(method.delivery_tag, requeue=True)
    method = support.wait_until(lambda: channel.basic_get(rejected)[0], message="the delivery to reject")
    channel.basic_reject(method.delivery_tag, requeue=False)

    rows = _by_case(conn, 3)
    assert rows[limited]["reason"] == "broker_delivery_limit" and rows[limited]["raw_body"] == "over the limit"
    assert rows[limited]["attempts"]["first_death"]["queue"] == limited
    assert rows[expired]["reason"] == "broker_expired" and rows[rejected]["reason"] == "broker_rejected"
    support.wait_until(lambda: _depth(service) == 0, message="every delivery acked")


def test_an_oversized_body_keeps_a_bounded_prefix_with_its_length_and_hash(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    body = ("é" + "x" * 1000) * 1100  # > 1 MiB of UTF-8, a two-byte character every 1001 bytes
    envelope = json.dumps({"message_id": str(uuid.uuid4()), "payload": {"blob": "y" * (2 * MIB)}}).encode()
    _dead_letter(channel, body.encode(), pika.BasicProperties(headers={"x-case": "text"}))
    _dead_letter(channel, envelope, pika.BasicProperties(headers={"x-case": "envelope"}))

    rows = _by_case(conn, 2)
    for case, sent in (("text", body.encode()), ("envelope", envelope)):
        row = rows[case]
        kept = dead_letters.decode_body(row["raw_body"], row["raw_encoding"])
        assert row["raw_encoding"] == "utf-8" and sent.startswith(kept)
        assert dead_letters.BODY_LIMIT - 4 < len(kept) <= dead_letters.BODY_LIMIT
        facts = row["headers"][names.BODY_FACTS]
        assert facts["length"] == len(sent) and facts["sha256"] == hashlib.sha256(sent).hexdigest()
        assert facts["truncated"] is True and facts["stored"] == len(kept)
    assert rows["text"]["message"] is None
    # An envelope up to the largest body a receiver accepts is kept whole: replayable.
    assert rows["envelope"]["message"] == json.loads(envelope)
    assert rows["envelope"]["message_id"] is not None


def test_json_nested_to_the_parsers_limit_is_stored(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    """An envelope nested ~900 levels (json parses it; jsonb and json.dumps would not)."""
    mid = uuid.uuid4()
    body = b'{"message_id": "%s", "payload": {"d": ' % str(mid).encode() + b"[" * 900 + b"]" * 900 + b"}}"
    _dead_letter(channel, body, pika.BasicProperties(headers={"x-case": "deep json"}))
    _dead_letter(channel, b"[" * 100_000, pika.BasicProperties(headers={"x-case": "deeper than parsable"}))

    rows = _by_case(conn, 2)
    deep = rows["deep json"]
    assert deep["message_id"] == mid and jsoncodec.TOO_DEEP in json.dumps(deep["message"])
    assert dead_letters.decode_body(deep["raw_body"], deep["raw_encoding"]) == body  # the body as it came
    assert rows["deeper than parsable"]["message"] is None and rows["deeper than parsable"]["raw_body"]
    support.wait_until(lambda: _depth(service) == 0, message="every delivery acked")


_REFUSE = """
CREATE FUNCTION txbox.refuse_letters() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.reason <> '{allowed}' THEN RAISE EXCEPTION 'refused by test trigger'; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER refuse BEFORE INSERT ON txbox.dead_letters FOR EACH ROW EXECUTE FUNCTION txbox.refuse_letters();
"""


def test_a_refused_row_ends_as_a_minimal_internal_error_row(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    conn.execute(_REFUSE.format(allowed=Reason.INTERNAL_ERROR))
    body = b"refused twice"
    _dead_letter(channel, body, pika.BasicProperties(headers={names.HEADER_DEAD_REASON: "poison"}))

    [row] = support.wait_until(lambda: _letters(conn), message="the minimal row")
    assert row["reason"] == Reason.INTERNAL_ERROR and "refused by test trigger" in row["error"]
    facts = row["headers"][names.BODY_FACTS]
    assert facts["length"] == len(body) and facts["sha256"] == hashlib.sha256(body).hexdigest()
    support.wait_until(lambda: _depth(service) == 0, message="the delivery acked")


def test_a_delivery_no_row_can_hold_is_not_acked_and_stored_once_the_database_takes_it(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    conn.execute(_REFUSE.format(allowed="no reason at all"))
    _dead_letter(channel, b"kept in the queue", pika.BasicProperties(headers={names.HEADER_DEAD_REASON: "poison"}))
    support.wait_until(lambda: "unavailable" in collector._state, message="the collector backing off")
    assert _letters(conn) == [] and _depth(service) == 1  # not acked: RabbitMQ still holds it

    conn.execute("DROP TRIGGER refuse ON txbox.dead_letters")
    [row] = support.wait_until(lambda: _letters(conn), message="the row once the database takes it")
    assert row["reason"] == "poison" and row["raw_body"] == "kept in the queue"
    support.wait_until(lambda: _depth(service) == 0, message="the delivery acked")


def test_a_message_that_expires_in_the_inbox_queue_is_collected(
    service: Service, collector: Collector, channel: Any, conn: Any
) -> None:
    """A sender's AMQP ``expiration`` runs out before any receiver takes the message: RabbitMQ
    dead-letters it through the inbox queue's arguments, and it ends as a letter, never vanishes."""
    inbox = names.inbox_queue(SERVICE)
    envelope = {"message_id": str(uuid.uuid4()), "message_type": "PlaceOrder", "payload": {"n": 1}}
    odd_death = [{"count": "many", "queue": 7}]  # a sender's x-death of tables: RabbitMQ adds its own entry
    for case, body in (("envelope", json.dumps(envelope).encode()), ("junk", b"\xff junk")):
        headers = {"x-case": case, "x-death": odd_death}
        channel.basic_publish("", inbox, body, pika.BasicProperties(expiration="1", headers=headers), mandatory=True)

    def expired_and_collected() -> list[dict[str, Any]]:
        # A quorum queue drops what expired when it is at the head and a delivery is asked for;
        # one asked for before it expired goes back (requeued, as a receiver that died would).
        method = channel.basic_get(inbox)[0]
        if method is not None:
            channel.basic_nack(method.delivery_tag, requeue=True)
        rows = _letters(conn)
        return rows if len(rows) == 2 else []

    rows = support.wait_until(expired_and_collected, message="both messages expired and collected")
    by_case = {row["headers"]["x-case"]: row for row in rows}
    assert {row["reason"] for row in rows} == {"broker_expired"}
    assert str(by_case["envelope"]["message_id"]) == envelope["message_id"]
    junk = by_case["junk"]
    assert by_case["envelope"]["message"] == envelope
    assert dead_letters.decode_body(junk["raw_body"], junk["raw_encoding"]) == b"\xff junk"
    assert all(inbox in row["error"] and "expired" in row["error"] for row in rows)
    support.wait_until(lambda: _depth(service) == 0, message="every delivery acked")
