"""A person looks at what a service still has to do, in real headless Chromium.

The inbox holds a message failing with a backoff, one parked behind an open dead letter
(the worker's segment policy is `park`), one due; the outbox one scheduled send. In the
dashboard (a real `txbox dashboard` process, TXBOX_DASHBOARD_TOKEN set) the person logs
in, goes from the overview's pending count to the service's pending page, reads each
state's count and the failing message's error, opens its details (payload secrets and
the auth_token masked), filters to the parked message, then to the outbox. Screenshots
land in artifacts/screenshots/pending-*.png.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from framework import names
from framework.dashboard.server import free_port
from framework.db import conninfo
from tests import support
from tests.acceptance.test_dashboard_browser import CHROMIUM_ARGS, SHOTS, TOKEN, Processes, _env
from tests.integration.dead_letters import seed
from tests.integration.pending.conftest import SECRET_PAYLOAD, SECRETS, put

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(conninfo(database_url), autocommit=True, row_factory=dict_row) as c:
        yield c


@pytest.fixture
def dashboard(database_url: str, amqp_url: str, tmp_path: Path) -> Iterator[str]:
    procs = Processes(tmp_path)
    env = {**_env(database_url, amqp_url), "TXBOX_WORKER_SEGMENT_POLICY": "park"}
    port = free_port()
    try:
        procs.start("dashboard", ["dashboard", "--port", str(port)], env)
        base = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            try:
                with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        support.wait_until(healthy, timeout=60, message="the dashboard to answer:\n" + procs.output())
        yield base
    finally:
        procs.stop()


def test_what_is_pending_from_the_browser(dashboard: str, conn: Any) -> None:
    from playwright.sync_api import expect, sync_playwright

    failing = put(
        conn,
        age=5400,
        started=2,
        finished=2,
        lease=300,
        payload=SECRET_PAYLOAD,
        last_error="TimeoutError: stock service did not answer (token=s3cr3t-in-error)",
    )
    abandoned = seed.envelope()
    seed.abandoned(conn, names.INBOX, abandoned)
    parked = put(conn, age=600, segment=f"order:{abandoned.aggregate_id}")
    put(conn, age=5)
    put(conn, names.OUTBOX, lease=3600, message_type="ShipOrder")
    SHOTS.mkdir(parents=True, exist_ok=True)

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(20_000)
            page.goto(dashboard + "/pending/order-service")
            expect(page.locator("h1")).to_have_text("Log in")  # the page needs the token, as the others
            page.fill("input[name=token]", TOKEN)
            page.click("button:has-text('Log in')")

            page.goto(dashboard + "/")
            page.click(".stat >> text=pending >> nth=0")
            _the_inbox_list(page, failing)
            _parked_only(page, parked)
            page.click(".pending-counts[data-table=outbox] .stat >> nth=0")
            expect(page.locator("table.pending tbody tr")).to_have_count(1)
            expect(page.locator("table.pending .pill")).to_have_text("scheduled")
            expect(page.locator("table.pending")).to_contain_text("ShipOrder")
            page.screenshot(path=SHOTS / "pending-4-outbox.png", full_page=True)
        finally:
            browser.close()


def _the_inbox_list(page: Any, failing: Any) -> None:
    """The inbox's counts by state and its list, the failing row first, its details masked."""
    from playwright.sync_api import expect

    expect(page.locator("h1")).to_contain_text("Pending · order-service")
    inbox = page.locator(".pending-counts[data-table=inbox]")
    expect(inbox.locator(".stat >> nth=0 >> .n")).to_have_text("3")
    for state, n in (("failing", "1"), ("parked", "1"), ("due", "1"), ("leased", "0")):
        expect(inbox.locator(f"[data-state={state}] .n")).to_have_text(n)
    expect(page.locator("p.count")).to_contain_text("3 pending inbox rows")
    first = page.locator("table.pending tbody tr >> nth=0")
    expect(first.locator(".pill")).to_have_text("failing")
    expect(first).to_contain_text("TimeoutError: stock service did not answer (token=[redacted])")
    expect(first.locator("td >> nth=0")).to_have_text("1.5 h")
    page.screenshot(path=SHOTS / "pending-1-inbox.png", full_page=True)

    first.locator(f"summary:has-text('{failing}')").click()
    details = first.locator("pre.json")
    expect(details).to_be_visible()
    expect(details).to_contain_text('"customer": "ada"')
    expect(details).to_contain_text('"auth_token": "•••• (masked')
    expect(details).to_contain_text('"password": "•••• (masked')
    content = page.content()
    assert not [s for s in SECRETS if s in content]
    page.screenshot(path=SHOTS / "pending-2-details.png", full_page=True)


def _parked_only(page: Any, parked: Any) -> None:
    """The state filter: parked rows only, in the page's address too."""
    from playwright.sync_api import expect

    page.select_option("select[name=state]", "parked")
    page.click("button:has-text('Filter')")
    expect(page.locator("table.pending tbody tr")).to_have_count(1)
    expect(page.locator("table.pending")).to_contain_text(str(parked))
    assert "state=parked" in page.url
    page.screenshot(path=SHOTS / "pending-3-parked.png", full_page=True)
