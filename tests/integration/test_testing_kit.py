"""framework.testing: handlers run against a real database as the receiver and the worker
would run them, with no broker and no daemons; the pytest fixtures; wait_until_processed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, Service
from framework.errors import AssemblyError, HandlerMisuse, TxboxError
from framework.settings import Settings
from framework.testing import DeliveryRejected, Harness, NotProcessed, wait_until_processed
from framework.worker import Worker
from framework.worker.config import WorkerConfig
from tests.apps import counter
from tests.apps.helpers import query, scalar, store_in_inbox


class Count(CommandHandler):
    """Counts its message, then asks for the next number until ``until``; ``misuse`` breaks the rules."""

    message_type = "Count"

    def __init__(self, until: int = 0, misuse: str = "") -> None:
        self.until = until
        self.misuse = misuse
        self.seen: list[Message] = []

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        self.seen.append(message)
        n = message.payload["n"]
        session.execute(text("INSERT INTO counters (id, n) VALUES (:id, :n)"), {"id": message.message_id, "n": n})
        if self.misuse == "commit":
            session.commit()
        elif self.misuse == "sql commit":
            session.execute(text("COMMIT"))
        elif self.misuse == "raise":
            raise RuntimeError("the handler failed")
        if n < self.until:
            outbox.send_command("Count", aggregate_id="c", payload={"n": n + 1})


def counter_service(database_url: str, handler: Count) -> Service:
    service = Service(settings=Settings.from_env({}, service=counter.SERVICE, database_url=database_url,
                                                 contracts_dir=counter.CONTRACTS))  # fmt: skip
    service.register(handler)
    return service


@pytest.fixture
def counted(database_url: str) -> str:
    query(database_url, counter.TABLE)
    return database_url


def kit(database_url: str, handler: Count) -> Harness:
    return Harness(counter_service(database_url, handler), database_url=database_url)


def count_rows(database_url: str) -> list[tuple[Any, ...]]:
    return query(database_url, "SELECT n FROM counters ORDER BY n")


def test_a_delivery_commits_the_handlers_writes_and_returns_what_it_sent(counted: str) -> None:
    handler = Count(until=2)
    with kit(counted, handler) as harness:
        done = harness.deliver("Count", aggregate_id="c", payload={"n": 1}, message_context={"trace": "t-1"},
                               auth_token="secret")  # fmt: skip

    [seen] = handler.seen
    assert (seen.message_type, seen.aggregate_type, seen.routing_key) == ("Count", "counter", counter.ROUTING_KEY)
    assert (seen.attempt, seen.max_attempts, seen.auth_token) == (1, WorkerConfig().max_attempts, "secret")
    assert count_rows(counted) == [(1,)]
    [sent] = done.sent
    assert (sent.message_type, sent.payload, sent.message_context) == ("Count", {"n": 2}, {"trace": "t-1"})
    # The outbox row commits with the handler's writes, for the relay (none here) to send.
    assert scalar(counted, "SELECT payload->>'n' FROM txbox.outbox WHERE id = %s", (sent.message_id,)) == "2"


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"payload": {"n": "one"}}, "schema_invalid"),
        ({"payload": {"n": 1, "extra": True}}, "schema_invalid"),
        ({"payload": {"n": 1}, "aggregate_id": ""}, "invalid_field"),
    ],
)
def test_the_receivers_checks_hold(counted: str, fields: dict[str, Any], reason: str) -> None:
    handler = Count()
    with kit(counted, handler) as harness, pytest.raises(DeliveryRejected) as rejected:
        harness.deliver("Count", **{"aggregate_id": "c", **fields})
    assert rejected.value.reason == reason
    assert handler.seen == []


def test_a_message_the_service_does_not_receive_is_refused(counted: str) -> None:
    with kit(counted, Count()) as harness, pytest.raises(TxboxError, match="unknown message type 'PlaceOrder'"):
        harness.deliver("PlaceOrder", aggregate_id="1", payload={})


def test_a_service_that_does_not_assemble_is_refused(counted: str) -> None:
    service = counter_service(counted, Count())
    service.register(Count())  # two handlers for one type
    with pytest.raises(AssemblyError, match="2 handlers claim"):
        Harness(service, database_url=counted)


def test_the_test_database_is_never_implied(counted: str) -> None:
    with pytest.raises(TypeError, match="say which database"):
        Harness(counter_service(counted, Count()))


@pytest.mark.parametrize(
    ("misuse", "error"), [("raise", RuntimeError), ("commit", HandlerMisuse), ("sql commit", HandlerMisuse)]
)
def test_a_failing_or_misbehaving_handler_commits_nothing(counted: str, misuse: str, error: type) -> None:
    with kit(counted, Count(until=5, misuse=misuse)) as harness:
        with pytest.raises(error):
            harness.deliver("Count", aggregate_id="c", payload={"n": 1})
        assert list(harness.pending) == []
    assert count_rows(counted) == []
    assert scalar(counted, "SELECT count(*) FROM txbox.outbox") == 0


def test_run_until_idle_routes_what_handlers_send(counted: str) -> None:
    with kit(counted, Count(until=4)) as harness:
        harness.deliver("Count", aggregate_id="c", payload={"n": 1})
        steps = harness.run_until_idle()
        assert [d.message.payload["n"] for d in steps] == [2, 3, 4]
        assert not harness.pending
    assert count_rows(counted) == [(1,), (2,), (3,), (4,)]


def test_run_until_idle_gives_up_on_a_conversation_that_never_ends(counted: str) -> None:
    with kit(counted, Count(until=1_000_000)) as harness:
        harness.deliver("Count", aggregate_id="c", payload={"n": 1})
        with pytest.raises(TxboxError, match="still not idle after 5 deliveries"):
            harness.run_until_idle(max_deliveries=5)


def test_the_fixture_gives_each_call_a_migrated_database_of_its_own(txbox_database: Callable[..., str]) -> None:
    first, second = txbox_database(), txbox_database()
    assert first != second
    for url in (first, second):
        assert scalar(url, "SELECT to_regclass('txbox.inbox') IS NOT NULL") is True
    query(first, "CREATE TABLE only_here (x int)")
    assert scalar(second, "SELECT to_regclass('public.only_here')") is None


# --- wait_until_processed, for tests that run the daemons -------------------------


@pytest.fixture
def stored(counted: str) -> Iterator[tuple[Service, list[uuid.UUID]]]:
    service = counter_service(counted, Count())
    envelopes = [Message(message_id=uuid.uuid4(), message_type="Count", aggregate_type="counter",
                         aggregate_id=str(n), payload={"n": n}).to_dict() for n in (1, 2)]  # fmt: skip
    store_in_inbox(service, envelopes)
    yield service, [uuid.UUID(e["message_id"]) for e in envelopes]


def test_wait_until_processed_returns_once_the_worker_processed_them(stored: tuple[Service, list[uuid.UUID]]) -> None:
    service, ids = stored
    worker = Worker(service, WorkerConfig(poll_interval=0.05))  # type: ignore[arg-type]
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_until_processed(service, ids, timeout=30)
    finally:
        worker.stop()
        thread.join(timeout=30)
    assert count_rows(service.settings.database_url) == [(1,), (2,)]


def test_wait_until_processed_says_what_is_missing_at_the_deadline(stored: tuple[Service, list[uuid.UUID]]) -> None:
    service, ids = stored
    never_sent = uuid.uuid4()
    with pytest.raises(NotProcessed, match=rf"not in the inbox yet: {never_sent}.*received, not processed"):
        wait_until_processed(service.settings.database_url, [*ids, never_sent], timeout=0.2)


def test_wait_until_processed_fails_at_once_on_an_abandoned_message(stored: tuple[Service, list[uuid.UUID]]) -> None:
    service, ids = stored
    query(service.settings.database_url,
          "UPDATE txbox.inbox SET abandoned_at = now(), last_error = 'permanent_error: no' WHERE id = %s",
          (ids[0],))  # fmt: skip
    with pytest.raises(NotProcessed, match=r"abandoned instead of processed: .*permanent_error: no"):
        wait_until_processed(service, ids, timeout=60)


@pytest.mark.slow
def test_the_examples_handler_tests_pass_with_no_broker_reachable() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TXBOX_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/%2F"}  # nothing listens on port 1
    env.pop("TXBOX_DATABASE_URL", None)
    result = subprocess.run(
        [str(Path(sys.executable).parent / "pytest"), "-q", "-p", "no:cacheprovider", "examples"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "failed" not in result.stdout


def readme_block(text: str, after: str, fence: str) -> str:
    """The first ``fence`` code block after the text ``after`` (bounded: the page is ours)."""
    match = re.compile(rf"```{fence}\n(.*?)\n```", re.DOTALL).search(text, text.index(after))
    assert match, f"no ```{fence} block after {after!r}"
    return match.group(1)


@pytest.mark.slow
def test_the_tutorial_ends_with_a_handler_test_that_passes(tmp_path: Path, database_url: str) -> None:
    """Step 7 of docs/tutorial/index.md: `.venv/bin/pytest tutorial`, with the page's files."""
    tutorial = (Path(__file__).resolve().parents[2] / "docs" / "tutorial" / "index.md").read_text()
    command = readme_block(tutorial, "**7. Test your handler**", "python")
    assert "run with `.venv/bin/pytest tutorial`" in tutorial
    folder = tmp_path / "tutorial"
    (folder / "contracts" / "commands").mkdir(parents=True)
    (folder / "contracts" / "greeter-service.yml").write_text(readme_block(tutorial, "**1. The contract**", "yaml"))
    schema = readme_block(tutorial, "send-greeting.json`:", "json")
    (folder / "contracts" / "commands" / "send-greeting.json").write_text(schema)
    (folder / "__init__.py").write_text("")
    (folder / "app.py").write_text(readme_block(tutorial, "**2. The handler**", "python"))
    (folder / "test_greeter.py").write_text(command)
    env = {
        **os.environ,
        "TXBOX_SERVICE": "greeter-service",
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_CONTRACTS_DIR": "tutorial/contracts",
        "TXBOX_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/%2F",  # nothing listens on port 1
    }
    result = subprocess.run(
        [str(Path(sys.executable).parent / "pytest"), "-q", "-p", "no:cacheprovider", "tutorial"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 passed" in result.stdout


class AsyncCount(CommandHandler):
    """``Count`` as an async handler: framework.testing runs it as the worker does."""

    message_type = "Count"

    async def handle(self, message: Message, session: AsyncSession, outbox: Outbox) -> None:  # type: ignore[override]
        n = message.payload["n"]
        await session.execute(text("INSERT INTO counters (id, n) VALUES (:id, :n)"), {"id": message.message_id, "n": n})
        if n < 2:
            outbox.send_command("Count", aggregate_id="c", payload={"n": n + 1})


def test_the_harness_runs_async_handlers(counted: str) -> None:
    with Harness(counter_service(counted, AsyncCount()), database_url=counted) as harness:  # type: ignore[arg-type]
        harness.deliver("Count", aggregate_id="c", payload={"n": 1})
        harness.run_until_idle()
    assert count_rows(counted) == [(1,), (2,)]


class EvenCount(Count):
    selector = "payload.n IN (2, 4, 6)"


def test_a_message_the_handlers_selector_does_not_match_is_refused_as_filtered(counted: str) -> None:
    handler = EvenCount()
    with kit(counted, handler) as harness:
        harness.deliver("Count", aggregate_id="c", payload={"n": 2})
        with pytest.raises(DeliveryRejected) as rejected:
            harness.deliver("Count", aggregate_id="c", payload={"n": 3})
    assert rejected.value.reason == "filtered" and "selector" in str(rejected.value)
    assert [m.payload["n"] for m in handler.seen] == [2]
