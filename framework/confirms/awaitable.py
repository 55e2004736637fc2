"""Direct sends from async code: :class:`AsyncPublisher`, the awaitable face of
:class:`~framework.confirms.client.Publisher` (docs/explanation/write.md, "Direct sends
from async code").

It wraps a Publisher rather than repeating it: confirms, send-order completions,
timeouts, nack streaks, the copy of the caller's input and the bound on unconfirmed
sends all stay the Publisher's. What this adds is the bridge to the caller's event loop:

- each send's completion (run by the Publisher on its I/O thread, in send order) is
  handed to the loop with ``loop.call_soon_threadsafe``, which keeps that order, and
  settles an asyncio future the ``publish`` coroutine awaits;
- waiting for room under ``max_unconfirmed`` (overflow ``block``) must not block the loop
  as the Publisher's own wait would: the Publisher runs with overflow ``fail``, and a send
  that finds no room waits here, asynchronously, for a completion to free some. One
  asyncio lock (first come, first served) keeps the sends in call order meanwhile;
- ``start`` and ``aclose`` (which drains: every send completes first) run the Publisher's
  blocking calls in a worker thread, so the loop goes on settling completions.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pika

from framework.confirms.client import OVERFLOW, Publisher
from framework.confirms.config import DirectSendConfig, Overflow
from framework.errors import PublisherOverflow


class AsyncPublisher:
    """``async with AsyncPublisher(url) as p: await p.publish(exchange, routing_key, body)``.

    ``publish`` returns once the broker confirmed the send, or raises PublishError (nacked,
    unroutable, not confirmed in time, connection lost). To have many sends in flight,
    run them as tasks (``asyncio.gather(*(p.publish(...) for ...))``): they are sent in
    the order the tasks start and complete in that order. Options as :class:`Publisher`'s.
    """

    def __init__(
        self,
        amqp_url: str,
        *,
        name: str = "txbox async direct sends",
        confirm_timeout: float = 30.0,
        connect_timeout: float = 10.0,
        max_unconfirmed: int | None = None,
        overflow: Overflow | None = None,
        overflow_timeout: float | None = None,
    ) -> None:
        self.limits = DirectSendConfig.from_env(
            max_unconfirmed=max_unconfirmed, overflow=overflow, overflow_timeout=overflow_timeout
        )
        # Overflow "fail" underneath: waiting for room happens here, on the loop (module docstring).
        self.publisher = Publisher(
            amqp_url,
            name=name,
            confirm_timeout=confirm_timeout,
            connect_timeout=connect_timeout,
            max_unconfirmed=self.limits.max_unconfirmed,
            overflow="fail",
            overflow_timeout=self.limits.overflow_timeout,
        )
        self._sending = asyncio.Lock()
        self._room = asyncio.Event()

    async def start(self) -> AsyncPublisher:
        """Connect and enable confirms (BrokerUnavailable if that fails within ``connect_timeout``)."""
        await asyncio.to_thread(self.publisher.start)
        return self

    async def __aenter__(self) -> AsyncPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def in_flight(self) -> int:
        """Sends not completed yet."""
        return self.publisher.in_flight

    async def publish(
        self,
        exchange: str,
        routing_key: str,
        body: bytes | bytearray | memoryview,
        *,
        properties: pika.BasicProperties | None = None,
        message_id: str | None = None,
        headers: dict[str, Any] | None = None,
        mandatory: bool = True,
        ttl: timedelta | float | None = None,
    ) -> None:
        """Send one persistent message and wait for its confirm (see :meth:`Publisher.publish`).

        Cancelling the caller stops the wait, not the send: once handed to the Publisher
        a message goes out (and ``aclose`` waits for its confirm).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()

        def complete(sent: Future[None]) -> None:  # the Publisher's I/O thread, in send order
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody awaits
                loop.call_soon_threadsafe(self._settle, sent, done)

        deadline = time.monotonic() + self.limits.overflow_timeout
        async with self._sending:
            while True:
                self._room.clear()
                try:
                    self.publisher.publish(
                        exchange,
                        routing_key,
                        body,
                        properties=properties,
                        message_id=message_id,
                        headers=headers,
                        mandatory=mandatory,
                        callback=complete,
                        ttl=ttl,
                    )
                    break
                except PublisherOverflow:
                    if self.limits.overflow == "fail":
                        raise
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise PublisherOverflow(
                            f"no room for a send within {self.limits.overflow_timeout:g}s: {self.in_flight} sends "
                            f"still await their confirm (max_unconfirmed={self.limits.max_unconfirmed}); the broker "
                            "is slow or blocked. Nothing was sent: retry later, or raise "
                            "TXBOX_PUBLISHER_OVERFLOW_TIMEOUT or TXBOX_PUBLISHER_MAX_UNCONFIRMED",
                            OVERFLOW,
                        ) from None
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._room.wait(), remaining)
        await done

    def _settle(self, sent: Future[None], done: asyncio.Future[None]) -> None:
        self._room.set()  # a completion freed room under max_unconfirmed
        if done.cancelled():
            return
        error = sent.exception()
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every send so far has completed; False if ``timeout`` passed first."""
        return await asyncio.to_thread(self.publisher.flush, timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        """Stop accepting sends and drain: wait (up to ``timeout``) for every incomplete send
        to complete, then close the connection (see :meth:`Publisher.close`)."""
        # The completions reach the loop before the close's own result does: every
        # ``publish`` still waiting is settled when this returns.
        await asyncio.to_thread(self.publisher.close, timeout)
