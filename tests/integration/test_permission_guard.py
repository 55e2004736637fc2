"""Handler middleware and the permission guard in the real worker, judged from the database:
an unauthorized message is a dead letter ``unauthorized`` at once, its token nowhere in what
is stored or logged; hooks run in order inside the message's transaction."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import jwt
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from framework import Message, Outbox, PermanentError
from framework.errors import ConfigurationError
from framework.middleware import Middleware
from framework.permissions import JwtSettings
from framework.service import Service
from framework.sql.outbox import OutboxRow
from tests import support
from tests.apps.helpers import place_order, query, running, scalar, store_in_inbox
from tests.integration.test_worker import Recorder, done, letters, row, worker

SECRET = "integration-test-only-hmac-secret-0123456789abcdef"
AUDIENCE = "order-service"


def token(permissions: Sequence[str], *, expires_in: int = 300) -> str:
    claims = {"aud": AUDIENCE, "exp": int(time.time()) + expires_in, "permissions": list(permissions)}
    return jwt.encode(claims, SECRET, algorithm="HS256")


class Guarded(Recorder):
    permissions = frozenset({"orders:place"})


@pytest.fixture
def business(database_url: str) -> str:
    query(
        database_url,
        "CREATE TABLE seen (n bigserial PRIMARY KEY, id uuid NOT NULL, segment text NOT NULL, quantity int NOT NULL)",
    )
    return database_url


@pytest.fixture
def guarded(service: Service, tmp_path: Path) -> Service:
    secret = tmp_path / "jwt-secret"
    secret.write_text(SECRET)
    service.jwt = JwtSettings(keys=str(secret), algorithms="HS256", audience=AUDIENCE)
    return service


def test_unauthorized_messages_are_dead_lettered_at_once_without_their_tokens(
    guarded: Service, business: str, caplog: pytest.LogCaptureFixture
) -> None:
    def publish(message: Message, session: Session, outbox: Outbox) -> None:
        payload = {"order_id": message.aggregate_id, "sku": "SKU-1", "quantity": 1}
        outbox.publish_event("OrderPlaced", aggregate_id=message.aggregate_id, payload=payload)
        outbox.publish_event("OrderPlaced", aggregate_id=message.aggregate_id, payload=payload, auth_token="")

    caplog.set_level(logging.DEBUG)
    handler = guarded.register(Guarded(publish))
    good_token = token(["orders:place", "orders:read"])
    good = place_order(aggregate_id="good", auth_token=good_token)
    refused = {
        "weak": place_order(aggregate_id="weak", auth_token=token(["orders:read"])),
        "expired": place_order(aggregate_id="expired", auth_token=token(["orders:place"], expires_in=-120)),
        "forged": place_order(aggregate_id="forged", auth_token=jwt.encode({"aud": AUDIENCE}, "x" * 40)),
        "none": place_order(aggregate_id="none", auth_token=None),
    }
    store_in_inbox(guarded, [good, *refused.values()])
    with running(worker(guarded, max_attempts=3)):
        support.wait_until(lambda: done(business) == 5, 30, message="every message settled")

    assert row(business, good)["processed_at"] is not None
    assert {c[0] for c in handler.calls} == {good["message_id"]}, "no refused message reaches the handler"
    for message in refused.values():
        state = row(business, message)
        assert state["abandoned_at"] is not None and (state["started"], state["finished"]) == (1, 1), "no retry"
    reasons = {str(m): (reason, error) for m, _source, reason, error, _body in letters(business)}
    assert {m: r for m, (r, _) in reasons.items()} == {m["message_id"]: "unauthorized" for m in refused.values()}
    assert "does not grant orders:place" in reasons[refused["weak"]["message_id"]][1]
    assert "expired" in reasons[refused["expired"]["message_id"]][1]
    assert "carries no auth_token" in reasons[refused["none"]["message_id"]][1]
    # The handler's messages act for the caller: the incoming token, unless told otherwise.
    sent = query(business, "SELECT metadata->>'auth_token' FROM txbox.outbox ORDER BY created_at, id")
    assert sorted(sent, key=str) == sorted([(good_token,), (None,)], key=str)
    stored = str(query(business, "SELECT * FROM txbox.dead_letters")) + str(
        query(business, "SELECT last_error, metadata FROM txbox.inbox")
    )
    for message in refused.values():
        if message["auth_token"]:
            assert message["auth_token"] not in stored
            assert message["auth_token"] not in caplog.text
    assert good_token not in caplog.text


def test_a_handler_declaring_permissions_needs_the_settings_at_start(service: Service) -> None:
    service.register(Guarded())
    problems = [str(p) for p in service.problems() if p.severity == "error"]
    assert any("TXBOX_JWT_AUDIENCE is not set" in p for p in problems), problems
    with pytest.raises(ConfigurationError, match="TXBOX_JWT_AUDIENCE is not set"):
        worker(service).run()  # also when started without the check


class Hook(Middleware):
    """Writes a row for each hook it sees into the handler's own transaction."""

    def __init__(self, name: str, failures: list[str]) -> None:
        self.name, self.failures = name, failures

    def _note(self, session: Session, message: Message, what: str) -> None:
        session.execute(
            text("INSERT INTO hooks (id, what) VALUES (:id, :what)"), {"id": message.message_id, "what": what}
        )

    def before(self, message: Message, session: Session) -> None:
        self._note(session, message, f"{self.name}.before")

    def after(self, message: Message, session: Session, sent: Sequence[OutboxRow]) -> None:
        self._note(session, message, f"{self.name}.after:{len(sent)}")

    def on_failure(self, message: Message, exc: BaseException) -> None:
        self.failures.append(f"{self.name}:{message.aggregate_id}:{type(exc).__name__}")


def test_middleware_runs_in_order_inside_the_message_transaction(service: Service, business: str) -> None:
    query(business, "CREATE TABLE hooks (n bigserial PRIMARY KEY, id uuid NOT NULL, what text NOT NULL)")

    def act(message: Message, session: Session, outbox: Outbox) -> None:
        if message.aggregate_id == "bad":
            raise PermanentError("refused by the handler")
        outbox.publish_event(
            "OrderPlaced", aggregate_id="ok", payload={"order_id": "ok", "sku": "SKU-1", "quantity": 1}
        )

    failures: list[str] = []
    service.add_middleware(Hook("outer", failures))
    service.add_middleware(Hook("inner", failures))
    service.register(Recorder(act))
    ok, bad = place_order(aggregate_id="ok"), place_order(aggregate_id="bad")
    store_in_inbox(service, [ok, bad])
    with running(worker(service)):
        support.wait_until(lambda: done(business) == 2, 30, message="both settled")
    hooks = [r[0] for r in query(business, "SELECT what FROM hooks WHERE id = %s ORDER BY n", (ok["message_id"],))]
    assert hooks == ["outer.before", "inner.before", "inner.after:1", "outer.after:1"]
    # The failed run's hook rows were rolled back with it; its failure was seen innermost first.
    assert scalar(business, "SELECT count(*) FROM hooks WHERE id = %s", (bad["message_id"],)) == 0
    assert failures[-2:] == ["inner:bad:PermanentError", "outer:bad:PermanentError"]
    assert row(business, bad)["abandoned_at"] is not None
