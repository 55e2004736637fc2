"""Bounded direct sends and copies at the call, on a real broker (docs/explanation/write.md, "Direct sends").

Confirms are held back deterministically: completions run one after another on the
publisher's I/O thread, so a completion callback that waits on an event keeps every later
send unconfirmed (and the I/O thread from reading what was queued) until the test sets it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import pika
import pytest

from framework import Publisher
from framework.confirms.config import DirectSendConfig
from framework.errors import ConfigurationError, PublisherOverflow, PublishError


@pytest.fixture
def broker(amqp_url: str) -> Iterator[str]:
    """Exchange `x` → queue `q` (key `k`)."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    ch = conn.channel()
    ch.exchange_declare("x", exchange_type="topic", durable=True)
    ch.queue_declare("q", durable=True)
    ch.queue_bind("q", "x", routing_key="k")
    conn.close()
    yield amqp_url


class Gate:
    """A completion callback that holds the I/O thread until :meth:`open` (30 s at most)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.released = threading.Event()

    def __call__(self, _: Future[None]) -> None:
        self.entered.set()
        self.released.wait(30)

    def open(self) -> None:
        self.released.set()


def held(publisher: Publisher, gate: Gate) -> Future[None]:
    """A first send whose completion holds the I/O thread."""
    future = publisher.publish("x", "k", b"{}", callback=gate)
    assert gate.entered.wait(30), "the first send was confirmed"
    return future


def test_fail_policy_raises_at_once_beyond_the_bound(broker: str) -> None:
    gate = Gate()
    with Publisher(broker, max_unconfirmed=3, overflow="fail") as publisher:
        try:
            held(publisher, gate)
            others = [publisher.publish("x", "k", b"{}") for _ in range(2)]
            with pytest.raises(PublisherOverflow, match=r"3 sends await their confirm.*max_unconfirmed=3") as err:
                publisher.publish("x", "k", b"{}")
            assert err.value.reason == "overflow"
            assert publisher.in_flight == 3  # the refused send was not counted
        finally:
            gate.open()
        assert all(f.result(timeout=30) is None for f in others)
        publisher.publish("x", "k", b"{}").result(timeout=30)  # room again


def test_block_policy_waits_for_room_then_sends(broker: str) -> None:
    gate = Gate()
    with Publisher(broker, max_unconfirmed=2, overflow="block", overflow_timeout=60) as publisher:
        try:
            held(publisher, gate)
            publisher.publish("x", "k", b"{}")
            blocked: list[Future[None]] = []
            sender = threading.Thread(target=lambda: blocked.append(publisher.publish("x", "k", b"late")))
            sender.start()
            sender.join(0.5)
            assert sender.is_alive() and not blocked, "publish returned while the bound was reached"
        finally:
            gate.open()
        sender.join(30)
        assert blocked and blocked[0].result(timeout=30) is None


def test_block_policy_gives_up_after_its_timeout(broker: str) -> None:
    gate = Gate()
    with Publisher(broker, max_unconfirmed=1, overflow="block", overflow_timeout=0.2) as publisher:
        try:
            held(publisher, gate)
            with pytest.raises(PublisherOverflow, match=r"no room for a send within 0.2s"):
                publisher.publish("x", "k", b"{}")
        finally:
            gate.open()


def test_a_callback_that_would_block_on_the_bound_raises_instead(broker: str) -> None:
    raised: list[BaseException] = []

    def callback(_: Future[None]) -> None:
        try:
            publisher.publish("x", "k", b"{}")
        except PublishError as exc:
            raised.append(exc)

    with Publisher(broker, max_unconfirmed=1, overflow="block") as publisher:
        publisher.publish("x", "k", b"{}", callback=callback)
        assert publisher.flush(timeout=30)
    assert len(raised) == 1 and "completion callback" in str(raised[0])


def test_what_the_caller_passed_is_copied_at_the_call(broker: str) -> None:
    gate = Gate()
    properties = pika.BasicProperties(content_type="application/json", headers={"h": "v", "nested": {"n": 1}})
    body = bytearray(b'{"a":1}')
    with Publisher(broker) as publisher:
        try:
            held(publisher, gate)
            # The I/O thread is held: the send below is still queued when the caller changes its objects.
            future = publisher.publish("x", "k", body, properties=properties, headers={"extra": "e"})
            assert properties.message_id is None, "the caller's properties were changed"
            assert properties.headers == {"h": "v", "nested": {"n": 1}}
            properties.headers["h"] = "changed"
            properties.headers["nested"]["n"] = 2
            properties.content_type = "text/plain"
            body[:] = b'{"b":2}'
        finally:
            gate.open()
        future.result(timeout=30)
    conn = pika.BlockingConnection(pika.URLParameters(broker))
    ch = conn.channel()
    ch.basic_get("q", auto_ack=True)  # the held first send
    _, sent, sent_body = ch.basic_get("q", auto_ack=True)
    conn.close()
    assert sent_body == b'{"a":1}'
    assert sent.content_type == "application/json"
    assert sent.headers == {"h": "v", "nested": {"n": 1}, "extra": "e"}
    assert sent.message_id is not None


def test_limits_come_from_the_environment_and_bad_values_name_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TXBOX_PUBLISHER_MAX_UNCONFIRMED", "7")
    monkeypatch.setenv("TXBOX_PUBLISHER_OVERFLOW", "fail")
    assert Publisher("amqp://unused").limits == DirectSendConfig(max_unconfirmed=7, overflow="fail")
    assert Publisher("amqp://unused", max_unconfirmed=9).limits.max_unconfirmed == 9  # the argument wins
    monkeypatch.setenv("TXBOX_PUBLISHER_MAX_UNCONFIRMED", "0")
    with pytest.raises(ConfigurationError, match="TXBOX_PUBLISHER_MAX_UNCONFIRMED=1000"):
        Publisher("amqp://unused")
    monkeypatch.setenv("TXBOX_PUBLISHER_MAX_UNCONFIRMED", "10")
    monkeypatch.setenv("TXBOX_PUBLISHER_OVERFLOW", "drop")
    with pytest.raises(ConfigurationError, match="TXBOX_PUBLISHER_OVERFLOW"):
        Publisher("amqp://unused")
