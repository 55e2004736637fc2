"""The dashboard over HTTP against real databases: pages, API, security."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from framework.dashboard.app import DashboardSettings, Source, create_app
from framework.dashboard.server import serving
from framework.errors import ConfigurationError
from tests import support
from tests.conftest import CONTRACTS
from tests.integration.dead_letters import seed

TOKEN = "t0ken-for-tests-0123456789"
XSS = "<script>alert('xss')</script>"


class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


OPENER = urllib.request.build_opener(NoRedirect)


def http(
    url: str, *, data: dict[str, str] | None = None, headers: dict[str, str] | None = None, method: str | None = None
) -> tuple[int, dict[str, str], str]:
    body = urllib.parse.urlencode(data).encode() if data is not None else None
    req = urllib.request.Request(url, data=body, headers=headers or {}, method=method)
    try:
        with OPENER.open(req, timeout=30) as resp:
            return resp.status, _headers(resp.headers), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, _headers(exc.headers), exc.read().decode()


def _headers(message: Any) -> dict[str, str]:
    """Lower-case names; a repeated header (Set-Cookie) as its values joined by newlines."""
    out: dict[str, str] = {}
    for k, v in message.items():
        out[k.lower()] = f"{out[k.lower()]}\n{v}" if k.lower() in out else v
    return out


def cookie_named(headers: dict[str, str], name: str) -> str:
    """The Set-Cookie line of cookie ``name``."""
    return next(line for line in headers.get("set-cookie", "").split("\n") if line.startswith(name + "="))


def _source(database_url: str, name: str = "order-service") -> Source:
    return Source(name, database_url, schema="txbox", contracts_dir=CONTRACTS)


@pytest.fixture
def base(database_url: str) -> Iterator[str]:
    """A dashboard whose pages anyone on the host may view (as configured explicitly): the
    content tests; tests/integration/dead_letters/test_dashboard_security.py covers the default."""
    settings = DashboardSettings(token=TOKEN, view_requires_token=False)
    with serving(create_app([_source(database_url)], settings)) as url:
        yield url


def login_form(base: str) -> tuple[dict[str, str], str]:
    """The login page's CSRF cookie (as a Cookie header) and the form's matching field."""
    status, headers, page = http(base + "/login")
    assert status == 200, page
    cookie = cookie_named(headers, "txbox_login").split(";")[0]
    match = re.search(r'name="csrf" value="([^"]+)"', page)
    assert match and cookie.endswith("=" + match.group(1))
    return {"Cookie": cookie}, match.group(1)


def _login(base: str, token: str = TOKEN) -> dict[str, str]:
    cookie, csrf = login_form(base)
    status, headers, _ = http(base + "/login", data={"token": token, "next": "/letters", "csrf": csrf}, headers=cookie)
    assert status == 303 and headers["location"] == "/letters"
    session = cookie_named(headers, "txbox_session")
    assert "HttpOnly" in session and "SameSite=strict" in session
    cookie_value = session.split(";")[0].removeprefix("txbox_session=")
    assert TOKEN not in cookie_value and len(cookie_value) >= 40
    return {"Cookie": f"txbox_session={cookie_value}"}


def _csrf(base: str, path: str, cookie: dict[str, str]) -> str:
    status, _, page = http(base + path, headers=cookie)
    assert status == 200, page
    match = re.search(
        r'<form method="post" action="/(?:letters|groups)[^"]*">\s*<input type="hidden" name="csrf" value="([^"]+)"',
        page,
    )
    assert match, "no CSRF field on the confirmation page"
    return match.group(1)


def test_pages_render_with_numbers_and_charts(base: str, conn: Any) -> None:
    m = seed.envelope(customer="bob")
    lid = seed.abandoned(conn, "inbox", m, error="KeyError: 'price'")
    seed.rejected(conn, None, raw=b"junk")

    status, headers, page = http(base + "/")
    assert status == 200 and "order-service" in page and page.count('<svg class="chart"') == 2
    assert "open dead letters" in page and "KeyError" in page
    assert "default-src 'none'" in headers["content-security-policy"]

    status, _, page = http(base + "/groups")
    assert status == 200 and "max_attempts" in page and "not_json" in page

    status, _, page = http(base + "/letters?reason=max_attempts")
    assert status == 200 and f'/letters/order-service/{lid}"' in page and "1 open dead letter" in page

    status, _, page = http(base + f"/letters/order-service/{lid}")
    assert status == 200 and "&#34;customer&#34;: &#34;bob&#34;" in page
    assert m.auth_token not in page  # type: ignore[operator]

    status, _, body = http(base + f"/api/letters/order-service/{lid}")
    letter = json.loads(body)["letter"]
    # The token was dropped before the letter was stored; the payload is intact.
    assert "auth_token" not in letter["message"] and letter["message"]["payload"]["customer"] == "bob"
    status, _, body = http(base + "/api/letters?status=all")
    data = json.loads(body)
    assert data["total"] == 2 and len(data["rows"]) == 2
    status, _, body = http(base + "/api/overview?window=24h")
    [svc] = json.loads(body)["services"]
    assert svc["stats"]["dead_letters"]["open"] == 2 and len(svc["timeline"]["buckets"]) == 24
    assert http(base + "/api/groups")[0] == 200


def test_every_filter_is_a_bound_parameter(base: str, conn: Any) -> None:
    seed.abandoned(conn, "inbox", seed.envelope())
    evil = ["x' OR '1'='1", "'; DROP TABLE txbox.dead_letters; --", "1) OR (1=1", '" OR ""="']
    for value in evil:
        for param in ("message_type", "reason", "fingerprint", "message_id", "origin"):
            q = urllib.parse.urlencode({param: value, "status": "all"})
            status, _, body = http(f"{base}/api/letters?{q}")
            assert status == 200, body
            assert json.loads(body)["total"] == 0
        for param in ("since", "until", "status", "page"):
            status, _, _ = http(f"{base}/letters?" + urllib.parse.urlencode({param: value}))
            assert status == 400
        assert http(f"{base}/letters/{urllib.parse.quote(value, safe='')}/1")[0] == 404
    assert json.loads(http(base + "/api/letters")[2])["total"] == 1


def test_message_content_is_escaped(base: str, conn: Any) -> None:
    m = seed.envelope(customer=XSS)
    lid = seed.abandoned(conn, "inbox", m, error=f"ValueError: bad customer {XSS} <img src=x onerror=alert(1)>")
    for path in ("/", "/groups", "/letters", f"/letters/order-service/{lid}"):
        status, _, page = http(base + path)
        assert status == 200
        assert "<script>alert" not in page and "<img src=x" not in page, path
    assert "&lt;script&gt;alert(" in http(base + f"/letters/order-service/{lid}")[2]


def test_state_changes_need_the_token_and_a_csrf_token(base: str, conn: Any) -> None:
    lid = seed.abandoned(conn, "inbox", seed.envelope())
    replayed = lambda: conn.execute(  # noqa: E731
        "SELECT replay_count FROM txbox.dead_letters WHERE id = %s", (lid,)
    ).fetchone()["replay_count"]

    assert http(base + f"/api/letters/order-service/{lid}/replay", method="POST")[0] == 401
    bad = {"Authorization": "Bearer wrong"}
    assert http(base + f"/api/letters/order-service/{lid}/replay", method="POST", headers=bad)[0] == 401
    assert http(base + f"/letters/order-service/{lid}/replay", data={"csrf": "x"})[0] == 401
    cookie = _login(base)
    assert http(base + f"/letters/order-service/{lid}/replay", data={"csrf": "forged"}, headers=cookie)[0] == 403
    assert http(base + f"/letters/order-service/{lid}/replay", data={}, headers=cookie)[0] == 403
    # The JSON API takes only the Bearer header: the browser's cookie alone is no CSRF bypass.
    for path in (f"/api/letters/order-service/{lid}/replay", f"/api/groups/order-service/{'0' * 16}/replay"):
        status, _, body = http(base + path, method="POST", headers=cookie)
        assert status == 403 and "Bearer" in body, path
    assert replayed() == 0

    csrf = _csrf(base, f"/letters/order-service/{lid}/replay", cookie)
    status, headers, _ = http(base + f"/letters/order-service/{lid}/replay", data={"csrf": csrf}, headers=cookie)
    assert status == 303 and headers["location"].startswith(f"/letters/order-service/{lid}?done=inbox-reset")
    assert replayed() == 1

    bearer = {"Authorization": f"Bearer {TOKEN}"}
    status, _, body = http(base + f"/api/letters/order-service/{lid}/discard?dry_run=1", method="POST", headers=bearer)
    assert status == 200 and json.loads(body)["outcomes"][0]["action"] == "discarded"
    assert (
        conn.execute("SELECT discarded_at FROM txbox.dead_letters WHERE id = %s", (lid,)).fetchone()["discarded_at"]
        is None
    )


def test_group_replay_from_the_dashboard(base: str, conn: Any) -> None:
    ids = [seed.abandoned(conn, "inbox", seed.envelope(), error=f"KeyError: 'sku-{i}'") for i in range(3)]
    fp = conn.execute("SELECT fingerprint FROM txbox.dead_letters WHERE id = %s", (ids[0],)).fetchone()["fingerprint"]
    cookie = _login(base)
    path = f"/groups/order-service/{fp}/replay"
    status, _, page = http(base + path, headers=cookie)
    assert "all 3 open dead letters" in page and page.count("max_attempts · open") == 3  # the preview
    csrf = _csrf(base, path, cookie)
    status, headers, _ = http(base + path, data={"csrf": csrf}, headers=cookie)
    assert status == 303 and "replay%3A+3+of+3" in headers["location"]
    assert conn.execute("SELECT count(*) AS n FROM txbox.dead_letters WHERE replay_count = 1").fetchone()["n"] == 3


def test_without_a_token_the_dashboard_is_read_only(database_url: str, conn: Any) -> None:
    lid = seed.abandoned(conn, "inbox", seed.envelope())
    with serving(create_app([_source(database_url)], DashboardSettings())) as base:
        assert http(base + "/")[0] == 200
        assert http(base + f"/api/letters/order-service/{lid}")[0] == 200  # no token: read-only, loopback only
        assert http(base + f"/letters/order-service/{lid}/replay", data={"csrf": ""})[0] == 403
        status, _, body = http(
            base + f"/api/letters/order-service/{lid}/replay", method="POST", headers={"Authorization": "Bearer "}
        )
        assert status == 403 and "TXBOX_DASHBOARD_TOKEN" in body
    assert (
        conn.execute("SELECT replay_count FROM txbox.dead_letters WHERE id = %s", (lid,)).fetchone()["replay_count"]
        == 0
    )


def test_viewing_can_require_the_token(database_url: str) -> None:
    settings = DashboardSettings(token=TOKEN, view_requires_token=True)
    with serving(create_app([_source(database_url)], settings)) as base:
        status, headers, _ = http(base + "/letters")
        assert status == 303 and headers["location"] == "/login?next=%2Fletters"
        assert http(base + "/api/letters")[0] == 401
        assert http(base + "/api/letters", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200
        assert http(base + "/letters", headers=_login(base))[0] == 200
    with pytest.raises(ConfigurationError, match="TXBOX_DASHBOARD_TOKEN"):
        DashboardSettings(view_requires_token=True)
    assert DashboardSettings().host == "127.0.0.1"
    assert DashboardSettings(token=TOKEN).views_need_token  # the default once a token is set


def test_several_sources(database_url: str, conn: Any, template_db: str) -> None:
    other = support.unique("txbox_t")
    support.create_database(other, template=template_db)
    try:
        seed.abandoned(conn, "inbox", seed.envelope())
        sources = [_source(database_url), _source(support.db_url(other), "inventory-service")]
        with serving(create_app(sources, DashboardSettings())) as base:
            page = http(base + "/")[2]
            assert "order-service" in page and "inventory-service" in page
            assert json.loads(http(base + "/api/letters?service=inventory-service")[2])["total"] == 0
            assert json.loads(http(base + "/api/letters?service=order-service")[2])["total"] == 1
            assert http(base + "/api/letters?service=nope")[0] == 404
            for s in sources:
                s.engine.dispose()
    finally:
        support.drop_database(other)


def _report(conn: Any, run_id: str, sources: str, lost: int) -> None:
    """An analyze run as the Spark job writes it (txbox.analytics_runs / analytics_latency)."""
    conn.execute(
        """INSERT INTO txbox.analytics_runs (run_id, run_at, finished_at, sources, grace_seconds, sla_seconds,
               outbox_rows, inbox_rows, lost, in_flight, stuck, abandoned, unexpected, redelivered)
           VALUES (%s, now(), now(), %s, 60, 300, 10, 10, %s, 0, 0, 1, 0, 0)""",
        (run_id, sources, lost),
    )
    for service in sources.split(","):
        conn.execute(
            """INSERT INTO txbox.analytics_latency (run_id, run_at, service, stage, samples, p50_ms, p99_ms)
               VALUES (%s, now(), %s, 'end_to_end', 10, 12.4, 80.6), (%s, now(), %s, 'published_to_received',
               10, 2.2, 9.7)""",
            (run_id, service, run_id, service),
        )


def test_overview_shows_the_latest_analyze_run_when_there_is_one(base: str, conn: Any) -> None:
    assert "Last reconciliation" not in http(base + "/")[2]
    _report(conn, "r1", "order-service", lost=2)
    page = http(base + "/")[2]
    assert "Last reconciliation" in page and 'class="pill alarm">lost 2' in page
    # The latency chart is drawn from analytics_latency, one labelled row per stage.
    chart = re.search(r'<svg class="chart"[^>]*aria-label="Latency per stage[^"]*".*?</svg>', page, re.S)
    assert chart is not None
    assert "end_to_end p50 12 ms · p99 81 ms" in chart.group(0)
    assert "published_to_received p50 2 ms · p99 10 ms" in chart.group(0)
    assert chart.group(0).count("<rect") == 4
    analytics = json.loads(http(base + "/api/overview")[2])["services"][0]["analytics"]
    assert analytics["run"]["lost"] == 2


def test_latency_per_stage_summarises_every_message_type(base: str, conn: Any) -> None:
    """A rare slow type must not stand for the service: the figure per stage is weighted over all rows."""
    _report(conn, "r1", "order-service", lost=0)
    conn.execute("DELETE FROM txbox.analytics_latency")
    conn.cursor().executemany(
        """INSERT INTO txbox.analytics_latency (run_id, run_at, service, publisher, message_type, stage,
               samples, p50_ms, p90_ms, p99_ms, max_ms, mean_ms)
           VALUES ('r1', now(), 'order-service', 'order-service', %s, 'end_to_end', %s, %s, %s, %s, %s, %s)""",
        [("PlaceOrder", 10_000, 10, 15, 20, 30, 11), ("ExportAudit", 5, 5000, 8000, 9000, 9500, 5500)],
    )
    page = http(base + "/")[2]
    chart = re.search(r'<svg class="chart"[^>]*aria-label="Latency per stage[^"]*".*?</svg>', page, re.S)
    assert chart is not None
    label = re.search(r"end_to_end p50 (\d+) ms · p99 (\d+) ms", chart.group(0))
    assert label is not None and int(label.group(1)) == 10 and int(label.group(2)) < 30, label
    detail = re.search(r'<table class="latency-types">.*?</table>', page, re.S)
    assert detail is not None
    rows = re.findall(r"<tr><td>end_to_end</td><td>(\w+)</td><td class=\"num\">([\d,]+)</td>", detail.group(0))
    assert rows == [("PlaceOrder", "10,000"), ("ExportAudit", "5")]
    assert "5,000 ms" in detail.group(0)
    stage = json.loads(http(base + "/api/overview")[2])["services"][0]["analytics"]["latency"][0]
    assert stage["samples"] == 10_005 and stage["p50_ms"] < 11 and len(stage["types"]) == 2


def test_one_report_database_serves_every_service(database_url: str, conn: Any, template_db: str) -> None:
    """`txbox analyze` writes its report into the first source's database by default."""
    other = support.unique("txbox_t")
    support.create_database(other, template=template_db)
    try:
        _report(conn, "older", "order-service", lost=0)
        _report(conn, "shared", "order-service,inventory-service", lost=3)
        sources = [_source(database_url), _source(support.db_url(other), "inventory-service")]
        with serving(create_app(sources, DashboardSettings())) as base:
            cards = {c["name"]: c for c in json.loads(http(base + "/api/overview")[2])["services"]}
            for s in sources:
                s.engine.dispose()
        assert cards["inventory-service"]["analytics"]["run"]["run_id"] == "shared"
        assert cards["inventory-service"]["analytics"]["run"]["lost"] == 3
    finally:
        support.drop_database(other)
