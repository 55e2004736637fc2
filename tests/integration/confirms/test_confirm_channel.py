"""framework.confirms.channel.ConfirmChannel on a loop this test runs, against a real broker."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pika.adapters.select_connection import IOLoop

from framework.confirms.channel import ConfirmChannel

DEADLINE = 30.0  # seconds the loop runs at most


def _run(first: Callable[[ConfirmChannel], None], amqp_url: str) -> tuple[ConfirmChannel, list[str]]:
    """Open a channel on a loop of our own, call ``first`` with it at once, close it once it
    opens, and run the loop until it has closed (or DEADLINE); the states it went through."""
    loop = IOLoop()
    changes: list[str] = []

    def changed(channel: ConfirmChannel) -> None:
        changes.append(channel.state)
        if channel.is_open:
            channel.close()
        else:
            loop.stop()

    channel = ConfirmChannel(amqp_url, loop, name="test", confirm_timeout=30, on_change=changed)
    loop.call_later(DEADLINE, loop.stop)
    channel.open()
    first(channel)
    try:
        loop.start()
    finally:
        loop.close()
    return channel, changes


@pytest.mark.parametrize("after", [None, 0.0, 0.001, 0.003, 0.01])
def test_a_channel_closed_while_it_opens_ends_closed_without_an_error(amqp_url: str, after: float | None) -> None:
    # A relay stopped right after it started closes a channel still in pika's connection
    # workflow (at once, or a moment into it: the socket connecting, the AMQP handshake);
    # aborting the workflow raised an AssertionError out of the loop.
    def close(channel: ConfirmChannel) -> None:
        if after is None:
            channel.close()
        else:
            channel.ioloop.call_later(after, channel.close)

    channel, changes = _run(close, amqp_url)
    assert channel.state == "closed", (changes, channel.error)
    assert changes[-1] == "closed" and "broken" not in changes


def test_a_channel_opens_and_closes(amqp_url: str) -> None:
    channel, changes = _run(lambda _: None, amqp_url)
    assert changes == ["open", "closed"], channel.error
