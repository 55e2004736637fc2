"""The inbox row keeps the auth_token exactly as long as a handler may still need it."""

from __future__ import annotations

import threading
from typing import Any

from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, PermanentError, RetryableError
from framework.service import Service
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox

FAST = {"backoff_base": 0.01, "backoff_cap": 0.05, "poll_interval": 0.1}


class FailsFirst(CommandHandler):
    """Retryable failure on the first run, success on the second; a permanent one for quantity 9."""

    message_type = "PlaceOrder"

    def __init__(self) -> None:
        self.tokens: list[str | None] = []
        self.lock = threading.Lock()

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        with self.lock:
            self.tokens.append(message.auth_token)
        if message.payload["quantity"] == 9:
            raise PermanentError("never")
        if message.attempt == 1:
            raise RetryableError("try again")


def _metadata(url: str, message: dict[str, Any]) -> dict[str, Any]:
    [(metadata,)] = query(url, "SELECT metadata FROM txbox.inbox WHERE id = %s", (message["message_id"],))
    return dict(metadata)


def test_a_retry_runs_with_the_token_and_a_settled_row_keeps_none(service: Service, database_url: str) -> None:
    handler = service.register(FailsFirst())
    retried, rejected = place_order(aggregate_id="1"), place_order(aggregate_id="2", quantity=9)
    store_in_inbox(service, [retried, rejected])
    assert _metadata(database_url, retried)["auth_token"] == "secret-token"  # pending: needed
    with running(Worker(service, WorkerConfig(**FAST))):  # type: ignore[arg-type]
        support.wait_until(
            lambda: (
                scalar(
                    database_url,
                    "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL OR abandoned_at IS NOT NULL",
                )
                == 2
            ),
            20,
            message="both settled",
        )
    # Every run, the retry included, saw the token (the failed run's mark gave it back).
    assert handler.tokens == ["secret-token"] * 3
    for message in (retried, rejected):
        metadata = _metadata(database_url, message)
        assert "auth_token" not in metadata and metadata["fields"]["delivery_tag"] >= 1  # the rest is kept
    [(letter,)] = query(database_url, "SELECT message FROM txbox.dead_letters")
    assert "auth_token" not in letter and letter["payload"]["quantity"] == 9


class Leaks(CommandHandler):
    """A handler whose error texts carry the token: once bare, once as ``auth_token=...``."""

    message_type = "PlaceOrder"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        if message.payload["quantity"] == 9:
            raise PermanentError(f"refused for auth_token={message.auth_token}")
        raise RetryableError(f"upstream said no to {message.auth_token}")


def test_a_handlers_error_text_never_carries_the_token(service: Service, database_url: str, caplog: Any) -> None:
    service.register(Leaks())
    retried, rejected = place_order(aggregate_id="1"), place_order(aggregate_id="2", quantity=9)
    store_in_inbox(service, [retried, rejected])
    with running(Worker(service, WorkerConfig(**FAST))):  # type: ignore[arg-type]
        support.wait_until(
            lambda: scalar(database_url, "SELECT count(*) FROM txbox.inbox WHERE last_error IS NOT NULL") == 2,
            20,
            message="both failed once",
        )
    errors = [r[0] for r in query(database_url, "SELECT last_error FROM txbox.inbox")]
    errors += [r[0] for r in query(database_url, "SELECT error FROM txbox.dead_letters")]
    assert errors and all("upstream said no" in e or "refused for" in e for e in errors[:2])
    for text in [*errors, caplog.text]:
        assert "secret-token" not in text


URL_PASSWORD = "hunter2-CaNaRy-41c"


class QuotesUrls(CommandHandler):
    """A handler whose exceptions quote URLs and DSNs with their passwords, as drivers' do."""

    message_type = "PlaceOrder"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        if message.payload["quantity"] == 9:
            raise PermanentError(f"cannot reach amqp://app:{URL_PASSWORD}@mq1/%2F,amqp://app:{URL_PASSWORD}@mq2")
        raise RuntimeError(f"cannot reach postgresql://app:{URL_PASSWORD}@db/x (dsn: password='{URL_PASSWORD}')")


def test_a_handlers_error_quoting_a_url_is_stored_masked(service: Service, database_url: str) -> None:
    service.register(QuotesUrls())
    retried, rejected = place_order(aggregate_id="1"), place_order(aggregate_id="2", quantity=9)
    store_in_inbox(service, [retried, rejected])
    with running(Worker(service, WorkerConfig(**FAST))):  # type: ignore[arg-type]
        support.wait_until(
            lambda: (
                scalar(database_url, "SELECT count(*) FROM txbox.inbox WHERE last_error IS NOT NULL") == 2
                and scalar(database_url, "SELECT count(*) FROM txbox.dead_letters") == 1
            ),
            20,
            message="one failed once, one dead-lettered",
        )
    errors = [r[0] for r in query(database_url, "SELECT last_error FROM txbox.inbox")]
    errors += [r[0] for r in query(database_url, "SELECT error FROM txbox.dead_letters")]
    assert len(errors) == 3 and all("cannot reach" in e and "app:***@" in e for e in errors)
    for text in errors:
        assert URL_PASSWORD not in text
