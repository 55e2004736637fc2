"""No page or JSON answer of the dashboard carries a password a URL or DSN quoted in stored text.

The texts arrive the two ways they really do: a handler's exceptions quoting a
PostgreSQL URL, an AMQP ``?password=`` URL and libpq DSNs, run by a real worker (stored
masked since this version); and rows written with plain SQL as an older version stored
them, unmasked, in every text column a view shows: the error (also long, with the URL
across the cut a list or a group sample makes), the message type a sender claimed,
headers, the raw body, an inbox and an outbox row's ``last_error``. A second source
whose database URL carries the password cannot be reached. Every page and JSON endpoint
that shows any of it (overview with liveness, groups, the list and its filters, each
letter, the confirmation pages, pending, error pages) is searched for the password.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, PermanentError, dead_letters, names
from framework.dashboard.app import DashboardSettings, Source, create_app
from framework.dashboard.server import free_port, serving
from framework.reasons import Reason
from framework.service import Service
from framework.sql import dead_letters as dead_letters_sql
from framework.worker import Worker, WorkerConfig
from tests import support
from tests.apps.helpers import place_order, running, store_in_inbox
from tests.conftest import CONTRACTS
from tests.integration.dead_letters.test_dashboard import TOKEN, _source, http
from tests.integration.dead_letters.test_dashboard_security import BEARER
from tests.integration.pending.conftest import put

PASSWORD = "pw" + uuid.uuid4().hex  # unique per run
#: What a leak would show at least: the password's first 12 characters (a cut keeps a prefix).
PREFIX = PASSWORD[:12]
FORMS = (
    f"postgresql://app:{PASSWORD}@db1:5432,db2:5432/orders?sslmode=require",
    f"amqps://mq.internal/%2F?password={PASSWORD}&heartbeat=5",
    f"host=db user=app password={PASSWORD} dbname=orders",
    f"password='{PASSWORD} with blanks'",
)
QUOTED = "cannot reach " + " ; ".join(FORMS)


def _across(cut: int) -> str:
    """An error whose PostgreSQL URL spans position ``cut``, with 16 characters of its password before it."""
    head = f"connection lost to postgresql://app:{PASSWORD[:16]}"
    filler = "x " * cut
    return filler[: cut - len(head)] + head + PASSWORD[16:] + "@db/orders and more"


class QuotesDsns(CommandHandler):
    """Fails as a driver's error would: quantity 9 permanently, any other once per run."""

    message_type = "PlaceOrder"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        if message.payload["quantity"] == 9:
            raise PermanentError(QUOTED)
        raise RuntimeError(QUOTED)


def _older_letter(conn: psycopg.Connection[Any], *, error: str, message_type: str, fingerprint: str) -> int:
    """A dead letter as a version before the masking stored it: every text as it came."""
    row = dead_letters.DeadLetter(
        source="broker", reason=Reason.UNKNOWN_MESSAGE_TYPE, error="x", message_type="x", raw_body=b"x"
    ).row()
    row.update(
        error=error,
        message_type=message_type,
        fingerprint=fingerprint,
        routing_key=f"order-service.order.place?password={PASSWORD}",
        raw_body=json.dumps({"dsn": FORMS[2], "url": FORMS[0]}),
        raw_encoding="utf-8",
        headers=json.dumps({"x-origin": FORMS[0], "x-dsn": FORMS[2], "x-list": f"{FORMS[1]},{FORMS[0]}"}),
    )
    found = conn.execute(sql.SQL("{} RETURNING id").format(dead_letters_sql.insert_sql("txbox")), row).fetchone()
    assert found is not None
    return int(found["id"])


@pytest.fixture
def dashboard(database_url: str) -> Iterator[str]:
    unreachable = Source(
        "billing", f"postgresql://app:{PASSWORD}@127.0.0.1:{free_port()}/billing", schema="txbox",
        contracts_dir=CONTRACTS,
    )  # fmt: skip
    settings = DashboardSettings(token=TOKEN)
    with serving(create_app([_source(database_url), unreachable], settings)) as url:
        yield url


def test_no_view_shows_a_password_quoted_in_stored_text(
    service: Service, database_url: str, conn: psycopg.Connection[Any], dashboard: str
) -> None:
    service.register(QuotesDsns())
    store_in_inbox(service, [place_order(aggregate_id="1"), place_order(aggregate_id="2", quantity=9)])
    config = WorkerConfig(backoff_base=60, backoff_cap=60, poll_interval=0.1)  # type: ignore[arg-type]
    with running(Worker(service, config)):
        support.wait_until(
            lambda: (
                conn.execute(
                    "SELECT (SELECT count(*) FROM txbox.inbox WHERE last_error IS NOT NULL AND abandoned_at IS NULL)"
                    " + (SELECT count(*) FROM txbox.dead_letters) AS n"
                ).fetchone()
                == {"n": 2}
            ),
            30,
            message="one row failed once, one dead-lettered",
        )
    older = [
        _older_letter(conn, error=QUOTED, message_type=f"Legacy {FORMS[0]}", fingerprint="older-quoted"),
        _older_letter(conn, error=_across(240), message_type="PlaceOrder", fingerprint="older-cut-list"),
        _older_letter(conn, error=_across(300), message_type="PlaceOrder", fingerprint="older-cut-group"),
    ]
    put(conn, last_error=QUOTED)
    put(conn, names.OUTBOX, last_error=_across(2000))
    letters = [r["id"] for r in conn.execute("SELECT id FROM txbox.dead_letters ORDER BY id")]
    fingerprints = [r["fingerprint"] for r in conn.execute("SELECT DISTINCT fingerprint FROM txbox.dead_letters")]
    assert len(letters) == 4 and set(older) < set(letters)

    paths = ["/", "/?window=24h", "/groups?status=all", "/letters?status=all", "/api/overview?window=24h"]
    paths += ["/api/groups?status=all", "/api/letters?status=all", "/groups?status=all&service=order-service"]
    paths += ["/api/groups?status=all&service=order-service"]
    for lid in letters:
        paths += [f"/letters/order-service/{lid}", f"/api/letters/order-service/{lid}"]
        paths += [f"/letters/order-service/{lid}/replay", f"/letters/order-service/{lid}/discard"]
    paths += [f"/groups/order-service/{fp}/replay" for fp in fingerprints]
    for table in (names.INBOX, names.OUTBOX):
        paths += [f"/pending/order-service?table={table}", f"/api/pending/order-service?table={table}"]
    # A mistyped filter is quoted by its error page: masked there too.
    echoed = urllib.parse.quote(FORMS[0], safe="")
    bad = [
        f"/letters?since={echoed}",
        f"/api/letters?since={echoed}",
        f"/api/pending/order-service?older_than={echoed}",
    ]
    paths += bad

    shown: dict[str, str] = {}
    statuses: dict[str, int] = {}
    for path in paths:
        statuses[path], _, shown[path] = http(dashboard + path, headers=BEARER)
    # Reading every source's groups meets the unreachable one: that page is an error page.
    failed = {p: s for p, s in statuses.items() if s != 200}
    assert failed == {
        "/groups?status=all": 503, "/api/groups?status=all": 503,
        **{path: 400 for path in bad},
    }  # fmt: skip
    leaks = [path for path, body in shown.items() if PREFIX in body]
    assert not leaks, "the password is shown by:\n" + "\n".join(leaks)

    # The texts are shown, masked: the search above looked at them.
    assert all("bad filter" in shown[path] and "app:***@db1" in shown[path] for path in bad)
    assert "app:***@db1" in shown[f"/letters/order-service/{older[0]}"]
    assert re.search(r"user=app password=(\*\*\*|\[redacted\]) dbname", shown[f"/api/letters/order-service/{older[0]}"])
    assert "Legacy postgresql://app:***@db1" in shown["/letters?status=all"]  # the filter's choices
    assert "connection lost to" in shown["/letters?status=all"]
    assert "cannot reach" in shown["/pending/order-service?table=inbox"]
    assert "connection lost to" in shown["/pending/order-service?table=outbox"]
    assert "cannot read this service" in shown["/"]
