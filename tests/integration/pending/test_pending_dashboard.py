"""The dashboard's pending page over HTTP against a real database: content, masking, protections."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from framework import names
from framework.dashboard.app import DashboardSettings, create_app
from framework.dashboard.security import SECURITY_HEADERS
from framework.dashboard.server import serving
from framework.errors import ConfigurationError
from tests.integration.dead_letters import seed
from tests.integration.dead_letters.test_dashboard import TOKEN, XSS, _login, _source, http
from tests.integration.dead_letters.test_dashboard_security import BEARER, raw_request
from tests.integration.pending.conftest import SECRET_PAYLOAD, SECRETS, put

PAGE = "/pending/order-service"
API = "/api/pending/order-service"


@pytest.fixture
def secured(database_url: str) -> Iterator[str]:
    """As `txbox dashboard` starts with TXBOX_DASHBOARD_TOKEN set: viewing needs the token."""
    with serving(create_app([_source(database_url)], DashboardSettings(token=TOKEN))) as url:
        yield url


def test_the_page_shows_states_ages_attempts_and_errors(secured: str, conn: Any) -> None:
    failing = put(conn, age=7200, started=3, finished=3, lease=40, last_error="KeyError: 'price'")
    put(conn, started=1, lease=60)
    put(conn, names.OUTBOX, lease=600)
    cookie = _login(secured)

    status, _, page = http(secured + "/", headers=cookie)
    assert status == 200 and f'href="{PAGE}?table=inbox"' in page and f'href="{PAGE}?table=outbox"' in page

    status, headers, page = http(secured + PAGE, headers=cookie)
    assert status == 200 and headers["x-frame-options"] == "DENY"
    assert "2 pending inbox rows" in page and "KeyError: &#39;price&#39;" in page and str(failing) in page
    assert '<span class="pill state-failing">failing</span>' in page and "2.0 h" in page
    assert '<span class="pill state-leased">leased</span>' in page

    status, _, body = http(secured + API + "?table=outbox", headers=BEARER)
    data = json.loads(body)
    assert status == 200 and [r["state"] for r in data["rows"]] == ["scheduled"]
    assert data["counts"]["inbox"]["states"]["failing"]["n"] == 1 and data["counts"]["outbox"]["pending"] == 1
    assert data["filters"] == {"table": "outbox", "limit": 50}

    status, _, body = http(secured + API + "?state=failing&older_than=1h&message_type=PlaceOrder", headers=BEARER)
    assert [r["id"] for r in json.loads(body)["rows"]] == [str(failing)]
    status, _, body = http(secured + API + "?older_than=3h", headers=BEARER)
    assert json.loads(body)["rows"] == []


@pytest.mark.parametrize("table", [names.OUTBOX, names.INBOX])
def test_secrets_are_masked_as_in_dead_letters(secured: str, conn: Any, table: str) -> None:
    put(conn, table, payload=SECRET_PAYLOAD, started=1, finished=1, last_error="401: token=s3cr3t-in-error refused")
    status, _, page = http(secured + f"{PAGE}?table={table}", headers=_login(secured))
    assert status == 200 and "&#34;customer&#34;: &#34;ada&#34;" in page and "•••• (masked" in page
    status, _, body = http(secured + f"{API}?table={table}", headers=BEARER)
    [row] = json.loads(body)["rows"]
    assert row["metadata"]["auth_token"].startswith("•••• (masked") and row["payload"]["customer"] == "ada"
    assert row["last_error"] == "401: token=[redacted] refused"
    assert not [s for s in SECRETS if s in page or s in body]


def test_content_is_escaped(secured: str, conn: Any) -> None:
    put(conn, message_type=XSS, segment=XSS, started=1, finished=1, last_error=XSS)
    status, _, page = http(secured + PAGE, headers=_login(secured))
    assert status == 200 and XSS not in page and "&lt;script&gt;" in page


def test_the_page_and_its_api_are_protected_like_the_dead_letters(secured: str, conn: Any) -> None:
    put(conn)
    for path in (PAGE, PAGE + "?table=outbox"):
        status, headers, _ = http(secured + path)
        assert status == 303 and headers["location"].startswith("/login?next="), path
    status, headers, body = http(secured + API)
    assert status == 401 and "order-service" not in body
    assert http(secured + API, headers={"Authorization": "Bearer " + "x" * len(TOKEN)})[0] == 401
    status, headers, _ = http(secured + API, headers=BEARER)
    assert status == 200 and all(headers[k] == v for k, v in SECURITY_HEADERS.items())
    # DNS rebinding: a foreign Host header is refused before the page.
    assert raw_request(secured, "GET", API, {"Host": "evil.example", **BEARER})[0] == 400
    assert raw_request(secured, "GET", PAGE, {"Host": "evil.example"})[0] == 400
    # Reads only: no other method is routed.
    assert http(secured + PAGE, data={"x": "1"}, headers=BEARER)[0] == 405


def test_bad_filters_and_unknown_services(secured: str) -> None:
    for query, complaint in (
        ("older_than=10x", "not a duration"),
        ("state=stuck", "state must be one of"),
        ("table=dead_letters", "table must be one of outbox, inbox"),
        ("limit=100000", "limit must be from 1 to 1000"),
        ("limit=lots", "bad filter"),
    ):
        status, _, body = http(secured + f"{API}?{query}", headers=BEARER)
        assert status == 400 and complaint in json.loads(body)["error"], query
    status, _, body = http(secured + "/api/pending/nobody", headers=BEARER)
    assert status == 404 and "no source named 'nobody'" in body


def test_the_workers_policy_decides_what_is_parked(
    database_url: str, conn: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = seed.envelope()
    seed.abandoned(conn, names.INBOX, m)
    put(conn, segment=f"order:{m.aggregate_id}")
    monkeypatch.setenv("TXBOX_WORKER_SEGMENT_POLICY", "park")
    with serving(create_app([_source(database_url)], DashboardSettings(token=TOKEN))) as url:
        status, _, body = http(url + API, headers=BEARER)
    assert status == 200 and [r["state"] for r in json.loads(body)["rows"]] == ["parked"]
    monkeypatch.setenv("TXBOX_WORKER_SEGMENT_POLICY", "later")
    with pytest.raises(ConfigurationError, match="TXBOX_WORKER_SEGMENT_POLICY"):
        create_app([_source(database_url)], DashboardSettings(token=TOKEN))
