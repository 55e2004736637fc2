"""Publisher pieces that need no broker: the envelope a row becomes, configuration, completion order."""

from __future__ import annotations

import argparse
import json
from collections import deque
from types import SimpleNamespace

import pika.spec
import pytest
from pika.adapters.select_connection import IOLoop

from framework import names
from framework.cli import publisher as cli
from framework.confirms import Outgoing, Publisher
from framework.confirms.channel import _COALESCED_CHUNK, _PENDING, ConfirmChannel
from framework.confirms.channel import coalesce_writes as _coalesce_writes
from framework.envelope import parse_message
from framework.errors import ConfigurationError, PublishError
from framework.relay import RelayConfig
from framework.relay.messages import envelope_body, outgoing
from framework.settings import load
from framework.sql.outbox import Claimed


def claimed(**over: object) -> Claimed:
    base = {
        "id": "3eb8257f-1341-49fb-bf77-027549cd4761",
        "message_type": "PlaceOrder",
        "aggregate_type": "order",
        "aggregate_id": "o-1",
        "message_version": "1.1",
        "kind": "command",
        "routing_key": "order-service.order.place",
        "payload_json": '{"sku": "SKU-1", "note": "caf\u00e9 \\"quoted\\""}',
        "context_json": '{"example_correlation_id": "c-1"}',
        "auth_token": "eyJhbGci",
        "correlation_id": "c-1",
        "priority": 0,
        "stamp": "2024-03-02T08:56:22.555Z",
        "epoch": 1709369782,
        "started_attempts": 1,
        "finished_attempts": 0,
    }
    base.update(over)
    return Claimed(**base)  # type: ignore[arg-type]


def test_envelope_is_the_design_format_and_parses_strictly() -> None:
    body = envelope_body(claimed())
    data = json.loads(body)
    assert list(data) == [
        "payload",
        "message_context",
        "message_id",
        "timestamp",
        "message_type",
        "aggregate_id",
        "aggregate_type",
        "message_version",
        "auth_token",
    ]
    assert data["timestamp"] == "2024-03-02T08:56:22.555Z"
    message = parse_message(body)
    assert message.payload == {"sku": "SKU-1", "note": 'caf\u00e9 "quoted"'}
    assert message.auth_token == "eyJhbGci" and message.message_version == "1.1"


def test_envelope_without_auth_token_omits_the_field() -> None:
    data = json.loads(envelope_body(claimed(auth_token=None, aggregate_id='we"ird\n')))
    assert "auth_token" not in data and data["aggregate_id"] == 'we"ird\n'


def test_amqp_message_is_persistent_mandatory_with_mirrored_properties() -> None:
    item = outgoing(claimed())
    props = item.properties
    assert (item.exchange, item.routing_key, item.mandatory) == ("command", "order-service.order.place", True)
    assert (props.message_id, props.type, props.content_type) == (
        "3eb8257f-1341-49fb-bf77-027549cd4761",
        "PlaceOrder",
        "application/json",
    )
    assert props.delivery_mode == 2 and props.timestamp == 1709369782
    assert props.headers == {names.HEADER_CORRELATION_ID: "c-1"}
    assert outgoing(claimed(kind="event", correlation_id=None)).exchange == "event"
    assert outgoing(claimed(correlation_id=None)).properties.headers is None


def test_confirm_timeout_must_be_shorter_than_the_lease() -> None:
    with pytest.raises(ConfigurationError, match="TXBOX_PUBLISHER_CONFIRM_TIMEOUT"):
        RelayConfig(lease=10, confirm_timeout=10)  # type: ignore[arg-type]


def test_environment_and_flags_configure_the_daemon() -> None:
    config = load(RelayConfig, {"TXBOX_PUBLISHER_BATCH_SIZE": "50", "TXBOX_PUBLISHER_LEASE": "2m"})
    assert (config.batch_size, float(config.lease)) == (50, 120.0)
    with pytest.raises(ConfigurationError, match="TXBOX_PUBLISHER_BATCH_SIZE='many'"):
        load(RelayConfig, {"TXBOX_PUBLISHER_BATCH_SIZE": "many"})
    parser = argparse.ArgumentParser()
    cli.configure(parser, "publisher")
    args = parser.parse_args(["--batch-size", "7", "--drain-timeout", "3s", "--max-attempts", "2"])
    config = cli.config_from(args)
    assert (config.batch_size, float(config.drain_timeout), config.max_attempts) == (7, 3.0, 2)


def _channel() -> ConfirmChannel:
    """A channel never opened: its confirm bookkeeping runs without a loop."""
    return ConfirmChannel(
        "amqp://guest:guest@127.0.0.1:5672/%2F", IOLoop(), name="t", confirm_timeout=30, on_change=lambda _: None
    )


def _frame(method: object) -> SimpleNamespace:
    return SimpleNamespace(method=method)


def test_completions_run_in_send_order_even_when_confirms_arrive_out_of_order() -> None:
    """The channel's bookkeeping, driven directly: confirms for 3, 1, then 2 (multiple)."""
    publisher = _channel()
    done: list[tuple[str, str | None]] = []
    items = []
    for i in range(1, 5):
        item = Outgoing("x", "k", b"", pika.BasicProperties(message_id=f"m{i}"), True)
        item.on_done = lambda it, err: done.append((it.message_id, err.reason if err else None))
        item.tag, item.outcome = i, _PENDING
        items.append(item)
    publisher._pending.extend(items)
    publisher._by_id = {it.message_id: it for it in items}
    publisher._on_return(None, SimpleNamespace(reply_code=312, reply_text="NO_ROUTE"), items[0].properties, b"")
    publisher._on_confirm(_frame(pika.spec.Basic.Ack(delivery_tag=3)))
    assert done == []  # 1 and 2 still wait: 3 must not complete first
    publisher._on_confirm(_frame(pika.spec.Basic.Nack(delivery_tag=1)))
    assert done == [("m1", "nacked")]
    publisher._on_confirm(_frame(pika.spec.Basic.Ack(delivery_tag=4, multiple=True)))
    assert done == [("m1", "nacked"), ("m2", None), ("m3", None), ("m4", None)]
    assert publisher.in_flight == 0


def test_a_returned_message_fails_as_unroutable_when_its_ack_comes() -> None:
    publisher = _channel()
    errors: list[PublishError | None] = []
    item = Outgoing("command", "nobody.home", b"", pika.BasicProperties(message_id="m1"), True)
    item.on_done, item.tag = (lambda _, err: errors.append(err)), 1
    publisher._pending.append(item)
    publisher._by_id["m1"] = item
    publisher._on_return(None, SimpleNamespace(reply_code=312, reply_text="NO_ROUTE"), item.properties, b"")
    publisher._on_confirm(_frame(pika.spec.Basic.Ack(delivery_tag=1)))
    (error,) = errors
    assert error is not None and error.reason == "unroutable" and "nobody.home" in str(error)


def test_publish_before_start_is_refused() -> None:
    with pytest.raises(PublishError, match="closed"):
        Publisher("amqp://guest:guest@127.0.0.1:5672/%2F").publish("x", "k", b"{}")


def test_a_burst_of_frames_goes_out_in_few_large_writes_in_order() -> None:
    frames = [bytes([i % 251]) * (100 + i % 400) for i in range(6000)]  # ~1.5 MB of frames
    conn = SimpleNamespace(_transport=SimpleNamespace(_tx_buffers=deque(frames)))
    _coalesce_writes(conn)  # type: ignore[arg-type]
    chunks = list(conn._transport._tx_buffers)
    assert b"".join(chunks) == b"".join(frames)  # same bytes, same order
    assert len(chunks) <= len(b"".join(frames)) // _COALESCED_CHUNK + 1
    assert all(len(c) < _COALESCED_CHUNK + 500 for c in chunks)


def test_coalescing_leaves_a_transport_it_does_not_know_alone() -> None:
    _coalesce_writes(None)
    _coalesce_writes(SimpleNamespace(_transport=SimpleNamespace()))  # type: ignore[arg-type]
