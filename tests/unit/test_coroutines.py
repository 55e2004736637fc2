"""framework/worker/coroutines.py without a database: the per-thread loop, the cancel at the
timeout, the refusals (docs/explanation/handle.md, "Async handlers")."""

from __future__ import annotations

import asyncio
import threading

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox
from framework.errors import HandlerMisuse, HandlerTimeout
from framework.handlers import is_coroutine_handler
from framework.worker import coroutines


def test_runs_reuse_one_loop_per_thread() -> None:
    loops: list[asyncio.AbstractEventLoop] = []

    async def record() -> None:
        loops.append(asyncio.get_running_loop())

    coroutines.run(record())
    coroutines.run(record())
    assert loops[0] is loops[1]


def test_a_handler_that_never_suspends_costs_one_pass_of_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    # Runner.run would make two (the task's step, then the callback stopping the loop):
    # the per-message cost that kept async handlers behind sync ones.
    passes = 0
    probe = asyncio.new_event_loop()
    loop_class = type(probe)  # the class this thread's loop has too
    probe.close()
    run_once = loop_class._run_once  # type: ignore[attr-defined]

    def counted(self: asyncio.AbstractEventLoop) -> None:
        nonlocal passes
        passes += 1
        run_once(self)

    async def plain() -> None:
        pass

    coroutines.run(plain())  # this thread's loop exists before counting
    monkeypatch.setattr(loop_class, "_run_once", counted)
    coroutines.run(plain())
    assert passes == 1


def test_a_handler_that_suspends_runs_to_its_end_and_raises_what_it_raised() -> None:
    steps: list[int] = []

    async def suspends() -> None:
        for n in range(3):
            await asyncio.sleep(0)
            steps.append(n)
        await asyncio.sleep(0.001)
        raise ValueError("from the handler")

    with pytest.raises(ValueError, match="from the handler"):
        coroutines.run(suspends())
    assert steps == [0, 1, 2]


def test_a_cancel_from_another_thread_wakes_a_sleeping_handler_as_a_timeout() -> None:
    started = threading.Event()
    me = threading.get_ident()

    async def sleep() -> None:
        started.set()
        await asyncio.sleep(60)

    def cancel() -> None:
        started.wait(10)
        assert coroutines.cancel_running(me)

    canceller = threading.Thread(target=cancel)
    canceller.start()
    with pytest.raises(HandlerTimeout):
        coroutines.run(sleep())
    canceller.join()
    assert not coroutines.cancel_running(me), "nothing runs any more"


def test_running_inside_a_running_loop_is_refused_with_the_fix() -> None:
    async def nothing() -> None:
        pass

    async def outer() -> None:
        with pytest.raises(HandlerMisuse, match="plain"):
            coroutines.run(nothing())

    asyncio.run(outer())


def test_streaming_and_connection_are_refused_with_the_fix() -> None:
    session = coroutines.HandlerAsyncSession(Session())

    async def use() -> None:
        with pytest.raises(HandlerMisuse, match="execute"):
            await session.stream(text("SELECT 1"))
        with pytest.raises(HandlerMisuse, match="run_sync"):
            await session.connection()

    coroutines.run(use())


def test_async_handlers_are_told_apart_once_per_class_and_by_a_handle_of_their_own() -> None:
    class Plain(CommandHandler):
        message_type = "PlaceOrder"

        def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
            return None

    class Awaited(CommandHandler):
        message_type = "PlaceOrder"

        async def handle(self, message: Message, session: Session, outbox: Outbox) -> None:  # type: ignore[override]
            return None

    async def handle(message: Message, session: Session, outbox: Outbox) -> None:
        return None

    assert not is_coroutine_handler(Plain()) and is_coroutine_handler(Awaited())
    replaced = Plain()
    replaced.handle = handle  # type: ignore[method-assign,assignment]
    assert is_coroutine_handler(replaced)  # the class's answer is not the instance's
    assert not is_coroutine_handler(Plain()) and is_coroutine_handler(Awaited())
