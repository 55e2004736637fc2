"""AsyncPublisher, direct sends from async code, on a real broker: the confirm awaited,
completions in send order, room under the bound awaited without blocking the loop, and
a drain on close (docs/explanation/write.md, "Direct sends from async code")."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pika
import pytest

from framework import AsyncPublisher
from framework.errors import PublisherClosed, PublisherOverflow, PublishError
from tests.integration.confirms.test_direct_send_bounds import Gate
from tests.integration.confirms.test_direct_sends import depth


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


def test_publish_returns_on_confirm_and_failures_raise(broker: str, vhost: str) -> None:
    async def main() -> None:
        async with AsyncPublisher(broker) as publisher:
            await publisher.publish("x", "k", b'{"a":1}', message_id="m-1")
            with pytest.raises(PublishError) as unroutable:
                await publisher.publish("x", "nobody", b"{}")
            with pytest.raises(PublishError) as nacked:
                await publisher.publish("x", "full", b"{}")
            assert (unroutable.value.reason, nacked.value.reason) == ("unroutable", "nacked")

    asyncio.run(main())
    assert depth(vhost, "q") == 1


def test_completions_resume_the_senders_in_send_order(broker: str, vhost: str) -> None:
    order: list[int] = []

    async def send(publisher: AsyncPublisher, n: int) -> None:
        # Every fifth goes nowhere: failures complete in their place too.
        with contextlib.suppress(PublishError):
            await publisher.publish("x", "k" if n % 5 else "nobody", str(n).encode())
        order.append(n)

    async def main() -> None:
        async with AsyncPublisher(broker) as publisher:
            await asyncio.gather(*(send(publisher, n) for n in range(300)))

    asyncio.run(main())
    assert order == list(range(300))
    assert depth(vhost, "q") == 240


def test_waiting_for_room_leaves_the_loop_free_and_keeps_call_order(broker: str, vhost: str) -> None:
    gate = Gate()

    async def main() -> None:
        async with AsyncPublisher(broker, max_unconfirmed=2, overflow="block", overflow_timeout=10) as publisher:
            try:
                # The first send's completion holds the I/O thread: nothing completes after it.
                publisher.publisher.publish("x", "k", b"held", callback=gate)
                assert await asyncio.to_thread(gate.entered.wait, 30)
                sent: list[bytes] = []

                async def send(body: bytes) -> None:
                    await publisher.publish("x", "k", body)
                    sent.append(body)

                tasks = [asyncio.create_task(send(b)) for b in (b"a", b"b", b"c")]
                await asyncio.sleep(0.3)  # the loop runs on while the sends wait for room
                assert not any(t.done() for t in tasks) and publisher.in_flight == 2
            finally:
                gate.open()
            await asyncio.gather(*tasks)
            assert sent == [b"a", b"b", b"c"]

    asyncio.run(main())
    assert depth(vhost, "q") == 4


def test_the_fail_policy_raises_at_once_and_the_block_policy_gives_up_in_time(broker: str) -> None:
    gate = Gate()

    async def main() -> None:
        async with AsyncPublisher(broker, max_unconfirmed=1, overflow="fail") as failing:
            try:
                failing.publisher.publish("x", "k", b"held", callback=gate)
                assert await asyncio.to_thread(gate.entered.wait, 30)
                with pytest.raises(PublisherOverflow):
                    await failing.publish("x", "k", b"{}")
            finally:
                gate.open()
        gate2 = Gate()
        async with AsyncPublisher(broker, max_unconfirmed=1, overflow="block", overflow_timeout=0.2) as blocking:
            try:
                blocking.publisher.publish("x", "k", b"held", callback=gate2)
                assert await asyncio.to_thread(gate2.entered.wait, 30)
                with pytest.raises(PublisherOverflow, match="no room"):
                    await blocking.publish("x", "k", b"{}")
            finally:
                gate2.open()

    asyncio.run(main())


def test_aclose_drains_every_send_then_refuses_more(broker: str, vhost: str) -> None:
    async def main() -> None:
        publisher = await AsyncPublisher(broker).start()
        tasks = [asyncio.create_task(publisher.publish("x", "k", b"{}")) for _ in range(200)]
        await asyncio.sleep(0)  # every task has handed its message over
        await publisher.aclose()
        assert all(t.done() and t.exception() is None for t in tasks), "aclose returned before every confirm"
        with pytest.raises(PublisherClosed):
            await publisher.publish("x", "k", b"{}")

    asyncio.run(main())
    assert depth(vhost, "q") == 200
