"""The ids of the messages a handler sends, through the worker and the real PostgreSQL.

docs/explanation/write.md, "Ids of the messages a handler sends": every run of a handler for one
incoming message sends under the same ids (framework/ids.py, ``sent_id``), whatever made
it run again; a send inside a savepoint rolled back is undone and gives its ordinal back;
an explicit ``message_id=`` and sends outside a handler keep their own ids.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from framework import EventHandler, Message, Outbox
from framework.envelope import parse_message
from framework.handlers import Handler
from framework.ids import sent_id
from framework.service import Service
from framework.testing import Harness
from tests import support
from tests.apps.async_orders import AsyncRecorder
from tests.apps.helpers import place_order, query, running, store_in_inbox
from tests.integration.test_worker import Recorder, business, done, row, worker  # noqa: F401 (business: fixture)


def placed(aggregate_id: str) -> dict[str, Any]:
    return {"aggregate_id": aggregate_id, "payload": {"order_id": aggregate_id, "sku": "SKU-1", "quantity": 1}}


def derived(service: Service, handler: Handler, message: dict[str, Any], count: int) -> list[uuid.UUID]:
    """The ids the derivation gives a run's first ``count`` OrderPlaced events."""
    incoming = uuid.UUID(message["message_id"])
    return [sent_id(incoming, service.name, handler.name, "OrderPlaced", n) for n in range(count)]


def _ignore(self: EventHandler, message: Message, session: Session, outbox: Outbox) -> None:
    pass


def outbox_rows(url: str) -> list[tuple[uuid.UUID, str]]:
    """(id, aggregate_id) of every outbox row, in the order they were written."""
    return [(r[0], r[1]) for r in query(url, "SELECT id, aggregate_id FROM txbox.outbox ORDER BY created_at")]


def test_a_retried_handler_sends_under_the_ids_of_its_first_attempt(service: Service, business: str) -> None:  # noqa: F811
    runs: list[list[uuid.UUID]] = []

    def send_then_fail_once(message: Message, session: Session, outbox: Outbox) -> None:
        runs.append([outbox.publish_event("OrderPlaced", **placed(str(n))) for n in range(2)])
        if message.attempt == 1:
            raise ValueError("the first attempt fails after sending")

    handler = service.register(Recorder(send_then_fail_once))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 1, 30, message="processed on the second attempt")
    assert row(business, message)["finished"] == 2
    [first, *_, last] = runs
    assert first == last == derived(service, handler, message, 2), "attempt 2 sends attempt 1's ids"
    assert outbox_rows(business) == list(zip(last, ["0", "1"], strict=True)), "only the committed attempt's rows"


@pytest.mark.parametrize("careful", [False, True], ids=["optimistic-pass", "careful-pass"])
def test_a_send_in_a_savepoint_rolled_back_is_undone_and_gives_its_ordinal_back(
    service: Service,
    business: str,  # noqa: F811
    careful: bool,
) -> None:
    returned: list[uuid.UUID] = []

    def with_savepoints(message: Message, session: Session, outbox: Outbox) -> None:
        try:
            with session.begin_nested():
                returned.append(outbox.publish_event("OrderPlaced", **placed("undone")))
                raise ValueError("roll the savepoint back")
        except ValueError:
            pass
        returned.append(outbox.publish_event("OrderPlaced", **placed("kept-1")))
        with session.begin_nested():  # released: its send stays
            returned.append(outbox.publish_event("OrderPlaced", **placed("kept-2")))
        try:
            with session.begin_nested():
                with session.begin_nested():  # released into a savepoint that is then rolled back
                    returned.append(outbox.publish_event("OrderPlaced", **placed("undone")))
                raise ValueError("roll the outer savepoint back")
        except ValueError:
            pass

    def division_by_zero(message: Message, session: Session, outbox: Outbox) -> None:
        # A database error in a batch mate: the worker runs the whole batch again carefully,
        # a savepoint of its own around each handler (docs/explanation/handle.md, "Worker batches").
        if message.aggregate_id == "mate":
            session.execute(text("SELECT 1 / 0"))
        else:
            with_savepoints(message, session, outbox)

    handler = service.register(Recorder(division_by_zero if careful else with_savepoints))
    message = place_order(aggregate_id="sender")
    batch = [place_order(aggregate_id="mate"), message] if careful else [message]
    store_in_inbox(service, batch)
    with running(worker(service, batch_size=10, max_attempts=1)):
        support.wait_until(lambda: done(business) == len(batch), 30, message="the batch settled")
    assert row(business, message)["processed_at"] is not None
    first, second, third = derived(service, handler, message, 3)
    # The contract: an ordinal counts the sends the run keeps, so each run's rolled-back
    # attempts, however many, leave the ids of what it commits as they are.
    assert returned[-4:] == [first, first, second, third], "a rolled-back send's ordinal is used again"
    assert outbox_rows(business) == [(first, "kept-1"), (second, "kept-2")], "nothing rolled back is sent"


def test_an_async_handler_retried_and_rolling_back_a_savepoint_sends_the_same_ids(
    service: Service,
    business: str,  # noqa: F811
) -> None:
    runs: list[list[uuid.UUID]] = []

    async def send(message: Message, session: AsyncSession, outbox: Outbox) -> None:
        sent = []
        try:
            async with session.begin_nested():
                sent.append(outbox.publish_event("OrderPlaced", **placed("undone")))
                await session.execute(text("SELECT 1"))  # the SAVEPOINT reaches the database
                raise ValueError("roll the savepoint back")
        except ValueError:
            pass
        sent += [outbox.publish_event("OrderPlaced", **placed(str(n))) for n in range(2)]
        runs.append(sent)
        if message.attempt == 1:
            raise ValueError("the first attempt fails after sending")

    handler = service.register(AsyncRecorder(send))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 1, 30, message="processed on the second attempt")
    assert row(business, message)["finished"] == 2
    first, second = derived(service, handler, message, 2)
    assert runs[0] == runs[-1] == [first, first, second]
    assert outbox_rows(business) == [(first, "0"), (second, "1")]


def test_an_explicit_message_id_in_a_handler_and_sends_outside_one_keep_their_own_ids(
    service: Service,
    business: str,  # noqa: F811
) -> None:
    chosen = uuid.uuid4()

    def choose(message: Message, session: Session, outbox: Outbox) -> None:
        outbox.publish_event("OrderPlaced", **placed("chosen"), message_id=chosen)
        outbox.publish_event("OrderPlaced", **placed("derived"))

    handler = service.register(Recorder(choose))
    message = place_order()
    store_in_inbox(service, [message])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 1, 30, message="processed")
    [first] = derived(service, handler, message, 1)
    assert outbox_rows(business) == [(chosen, "chosen"), (first, "derived")], "the explicit id takes no ordinal"

    # Outside a handler (a web endpoint, a script), even naming the incoming message: new ids each time.
    incoming = parse_message(json.dumps(message))
    sent = []
    for _ in range(2):
        with Session(service.engine) as session, session.begin():
            sent.append(service.outbox(session, incoming=incoming).publish_event("OrderPlaced", **placed("outside")))
    assert sent[0] != sent[1] and {i.version for i in sent} == {7}
    assert {r[0] for r in outbox_rows(business) if r[1] == "outside"} == set(sent)


def test_the_testing_kit_leaves_out_a_send_rolled_back_and_derives_the_same_ids(
    service: Service,
    business: str,  # noqa: F811
) -> None:
    def with_savepoint(message: Message, session: Session, outbox: Outbox) -> None:
        try:
            with session.begin_nested():
                outbox.publish_event("OrderPlaced", **placed("undone"))
                raise ValueError("roll the savepoint back")
        except ValueError:
            pass
        outbox.publish_event("OrderPlaced", **placed("kept"))

    handler = service.register(Recorder(with_savepoint))
    for event_type in ("StockReserved", "StockRejected"):  # the kit runs only a service that assembles
        service.register(type(event_type, (EventHandler,), {"message_type": event_type, "handle": _ignore})())
    message = place_order()
    with Harness(service, database_url=business) as kit:
        delivered = kit.deliver(parse_message(json.dumps(message)))
    assert [(m.message_id, m.aggregate_id) for m in delivered.sent] == [
        (derived(service, handler, message, 1)[0], "kept")
    ]
    assert outbox_rows(business) == [(derived(service, handler, message, 1)[0], "kept")]
