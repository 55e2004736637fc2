"""framework.Publisher, the direct-send client, on a real broker.

docs/explanation/write.md, "Direct sends".
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from functools import partial

import pika
import pytest

from framework import Publisher
from framework.confirms import client
from framework.errors import BrokerUnavailable, PublisherClosed, PublishError
from tests import support
from tests.support import wait_until


@pytest.fixture
def broker(amqp_url: str) -> Iterator[str]:
    """Exchange `x` → queue `q` (key `k`), and `x` → queue `full` (key `full`) that nacks."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    ch = conn.channel()
    ch.exchange_declare("x", exchange_type="topic", durable=True)
    ch.queue_declare("q", durable=True)
    ch.queue_bind("q", "x", routing_key="k")
    ch.queue_declare("full", durable=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"})
    ch.queue_bind("full", "x", routing_key="full")
    conn.close()
    yield amqp_url


def depth(vhost: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(support.amqp_url(vhost)))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def test_future_completes_on_confirm_and_message_is_persistent(broker: str, vhost: str) -> None:
    with Publisher(broker) as publisher:
        future = publisher.publish("x", "k", b'{"a":1}', message_id="m-1", headers={"x-correlation-id": "c"})
        assert future.result(timeout=30) is None
    conn = pika.BlockingConnection(pika.URLParameters(broker))
    _, props, body = conn.channel().basic_get("q", auto_ack=True)
    conn.close()
    assert body == b'{"a":1}'
    assert (props.message_id, props.delivery_mode, props.content_type) == ("m-1", 2, "application/json")
    assert props.headers == {"x-correlation-id": "c"}


def test_unroutable_and_nacked_sends_fail_with_publish_error(broker: str) -> None:
    with Publisher(broker) as publisher:
        unroutable = publisher.publish("x", "nobody", b"{}")
        nacked = publisher.publish("x", "full", b"{}")
        ok = publisher.publish("x", "k", b"{}")
        with pytest.raises(PublishError) as returned:
            unroutable.result(timeout=30)
        with pytest.raises(PublishError) as rejected:
            nacked.result(timeout=30)
        ok.result(timeout=30)
    assert returned.value.reason == "unroutable" and "nobody" in str(returned.value)
    assert rejected.value.reason == "nacked"


def test_many_in_flight_complete_in_send_order(broker: str, vhost: str) -> None:
    n = 3000
    order: list[int] = []
    threads: set[str] = set()

    def record(i: int, _: Future[None]) -> None:
        order.append(i)
        threads.add(threading.current_thread().name)

    with Publisher(broker) as publisher:
        futures: list[Future[None]] = []
        peak = 0
        for i in range(n):
            futures.append(publisher.publish("x", "k" if i % 10 else "nobody", b"%d" % i, callback=partial(record, i)))
            # Streamed: many are in flight at once, not one round trip each. The most seen
            # while sending (read once at the end, a fast broker had confirmed most by then).
            peak = max(peak, publisher.in_flight)
        assert publisher.flush(timeout=60)
        assert all(f.done() for f in futures)
    assert order == list(range(n))
    assert threading.current_thread().name not in threads  # callbacks never run on the sender
    assert peak > 100
    assert sum(1 for f in futures if f.exception() is not None) == n // 10
    assert depth(vhost, "q") == n - n // 10


def test_close_waits_for_incomplete_sends(broker: str) -> None:
    publisher = Publisher(broker).start()
    futures = [publisher.publish("x", "k", b"x" * 1000) for _ in range(2000)]
    publisher.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(PublisherClosed):
        publisher.publish("x", "k", b"late")


def test_close_or_flush_inside_a_completion_callback_raises(broker: str) -> None:
    raised: list[BaseException] = []
    with Publisher(broker) as publisher:

        def callback(_: Future[None]) -> None:
            for call in (publisher.close, publisher.flush):
                try:
                    call()
                except PublishError as exc:
                    raised.append(exc)

        publisher.publish("x", "k", b"{}", callback=callback)
        assert publisher.flush(timeout=30)
        assert publisher.is_open  # the refused close() did not close it
    assert len(raised) == 2
    assert all("completion callback" in str(e) for e in raised)


def test_connection_lost_fails_incomplete_sends_and_marks_the_publisher_broken(broker: str, vhost: str) -> None:
    publisher = Publisher(broker).start()
    try:
        # The management API lists a new connection only after its next stats tick.
        wait_until(lambda: support.close_connections(vhost), 30, message="the connection is listed and closed")
        wait_until(lambda: publisher.broken, 30, message="the publisher notices the closed connection")
        with pytest.raises(PublisherClosed):
            publisher.publish("x", "k", b"{}")
        assert isinstance(publisher.error, BaseException)
    finally:
        publisher.close(timeout=1)


def test_unreachable_broker_raises_broker_unavailable() -> None:
    with pytest.raises(BrokerUnavailable):
        Publisher("amqp://guest:guest@127.0.0.1:1/%2F", connect_timeout=5).start()


def test_a_streak_of_nacks_breaks_the_publisher_so_that_a_new_channel_is_opened(broker: str) -> None:
    """RabbitMQ 3.10 kept nacking a channel that first met a dead quorum leader; a new one got acks."""
    with Publisher(broker) as publisher:
        single = publisher.publish("x", "full", b"{}")
        publisher.publish("x", "k", b"{}").result(timeout=30)  # an ack ends a streak
        with pytest.raises(PublishError):
            single.result(timeout=30)
        assert publisher.is_open
        streak = [publisher.publish("x", "full", b"{}") for _ in range(client.NACK_STREAK)]
        for future in streak:
            with pytest.raises(PublishError) as nacked:
                future.result(timeout=30)
            assert nacked.value.reason == "nacked"
        wait_until(lambda: publisher.broken, 30, message="the publisher gives up the nacking channel")
        assert "in a row" in str(publisher.error)
        with pytest.raises(PublisherClosed):
            publisher.publish("x", "k", b"{}")


def test_a_list_of_urls_connects_to_the_first_node_that_answers(broker: str) -> None:
    """TXBOX_AMQP_URL with a node that is down: the publisher connects to another one."""
    dead = "amqp://guest:guest@127.0.0.1:1/%2F"
    for _ in range(4):  # the order is this process's shuffle: whichever comes first
        urls = f"{dead},{broker}" if _ % 2 else f"{broker},{dead}"
        with Publisher(urls, connect_timeout=10) as publisher:
            publisher.publish("x", "k", b"{}").result(timeout=30)
    with pytest.raises(BrokerUnavailable):
        Publisher(f"{dead},{dead.replace(':1/', ':2/')}", connect_timeout=5).start()


def test_unencodable_properties_fail_that_send_alone_and_the_connection_stays(broker: str, vhost: str) -> None:
    with Publisher(broker) as publisher:
        before = publisher.publish("x", "k", b"{}")
        with pytest.raises(PublishError) as refused:
            publisher.publish("x", "k", b"{}", headers={"big": 2**70})
        with pytest.raises(PublishError):
            publisher.publish("x", "k", b"{}", headers={"odd": object()})
        after = publisher.publish("x", "k", b"{}")
        before.result(timeout=30)
        after.result(timeout=30)
        assert not publisher.broken
    assert refused.value.reason == client.UNENCODABLE
    assert depth(vhost, "q") == 2
