"""The documentation site builds and its home page renders in real headless Chromium.

`mkdocs build --strict` (what `make docs` runs) writes the site into a folder of this
test's own; a plain HTTP server on a free loopback port serves it; Chromium opens the
home page. It must have the site's title, navigation listing the four kinds of page
(tutorial, how-to guides, reference, explanation), no console error, no failed request,
and no request leaving the host (no web font, no CDN). A screenshot lands in
artifacts/screenshots/docs-home.png.
"""

from __future__ import annotations

import functools
import http.server
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

import pytest

from tests.acceptance.test_dashboard_browser import CHROMIUM_ARGS
from tests.conftest import ROOT

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SHOTS = ROOT / "artifacts" / "screenshots"
KINDS = ("Tutorial", "How-to guides", "Reference", "Explanation")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def test_the_docs_home_page_renders(tmp_path: Path) -> None:
    from playwright.sync_api import expect, sync_playwright

    site = tmp_path / "site"
    build = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--quiet", "-d", str(site)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    assert (site / "index.html").is_file()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    home = f"http://127.0.0.1:{server.server_address[1]}/index.html"
    errors: list[str] = []
    failed: list[str] = []
    off_host: list[str] = []
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(20_000)
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("requestfailed", lambda r: failed.append(r.url))
                page.on(
                    "request",
                    lambda r: (
                        off_host.append(r.url)
                        if urllib.parse.urlsplit(r.url).hostname not in ("127.0.0.1", None)
                        else None
                    ),
                )
                response = page.goto(home, wait_until="networkidle")
                assert response is not None and response.status == 200
                expect(page).to_have_title("txbox")
                expect(page.locator("article h1")).to_have_text("txbox¶")  # the permalink sign
                navigation = page.locator("nav.md-nav--primary")
                for kind in KINDS:
                    expect(navigation.get_by_text(kind, exact=True).first).to_be_attached()
                page.screenshot(path=str(SHOTS / "docs-home.png"), full_page=True)
            finally:
                browser.close()
    finally:
        server.shutdown()
        server.server_close()
    assert errors == [], errors
    assert failed == [], failed
    assert off_host == [], off_host
