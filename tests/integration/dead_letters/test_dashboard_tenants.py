"""The dashboard over a tenant registry, against the real database: two tenants as two
schemas of one test database (as tests/integration/dead_letters/test_dlq_tenants.py sets
them up), each with its own dead letters; ``?tenant=KEY`` shows and acts on one, its
links keep it, and the errors of an unknown key, a missing one and a missing registry."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from framework.dashboard.app import DashboardSettings, Source, create_app
from framework.dashboard.server import serving
from framework.settings import TenantSettings
from framework.tenants import load_registry
from tests.conftest import CONTRACTS
from tests.integration.dead_letters import seed
from tests.integration.dead_letters.test_dashboard import TOKEN, _csrf, _login, http

GLOBEX = seed.GLOBEX
SETTINGS = DashboardSettings(token=TOKEN, view_requires_token=False)


@pytest.fixture
def tenants(tmp_path: Path, database_url: str, conn: Any) -> dict[str, list[int]]:
    """acme (schema txbox) and globex (schema tenant_globex): their dead letters by key."""
    letters, _ = seed.two_tenants(conn, database_url, tmp_path)
    return letters


@pytest.fixture
def base(tmp_path: Path, database_url: str, tenants: dict[str, list[int]]) -> Iterator[str]:
    """The dashboard of order-service over the registry file listing acme and globex."""
    path = tmp_path / "tenants.toml"  # written by the tenants fixture (seed.two_tenants)
    registry = load_registry(
        TenantSettings(tenants_file=path), default_database_url=database_url, default_schema="txbox"
    )
    assert registry is not None
    # The service's own source names no database: every read goes to a tenant's.
    service = Source("order-service", "", schema="txbox", contracts_dir=CONTRACTS)
    with serving(create_app([service], SETTINGS, tenants=registry)) as url:
        yield url


def _links(page: str) -> list[str]:
    """The page's own links (not its stylesheet), unquoted (the login's ``next`` too), and
    the target of each form that is not a GET filter form carrying the tenant in a field."""
    found = re.findall(r'href="(/[^"]*)"', page)
    found += re.findall(r'<form method="post" action="(/[^"]*)"', page)
    kept = re.findall(
        r'<form[^>]*method="get" action="(/[^"]*)">\s*<input type="hidden" name="tenant" value="[^"]+">', page
    )
    unkept = [a for a in re.findall(r'<form[^>]*method="get" action="(/[^"]*)">', page) if a not in kept]
    links = [unquote(u.replace("&amp;", "&")) for u in found + unkept]
    return [u for u in links if not u.startswith("/static/") and u != "/logout"]


def test_each_tenant_sees_only_its_letters_and_links_keep_it(base: str, tenants: dict[str, list[int]]) -> None:
    status, _, page = http(base + "/letters?tenant=globex")
    assert status == 200 and "ValueError: globex" in page and "KeyError" not in page
    assert "tenant globex" in page and "1 open dead letter" in page
    links = _links(page)
    (letter,) = tenants["globex"]
    assert f"/letters/order-service/{letter}?tenant=globex" in links
    # Every link but the brand's and the tenant pill's (both: the list of tenants) keeps the tenant.
    assert [u for u in links if "tenant=globex" not in u] == ["/", "/"]

    status, _, page = http(base + "/letters?tenant=acme")
    assert status == 200 and page.count("KeyError: &#39;acme&#39;") == 2 and "globex" not in page

    # Ids are each tenant's own: the same id is another letter in the other tenant.
    status, _, page = http(base + f"/letters/order-service/{letter}?tenant=globex")
    assert status == 200 and "&#34;customer&#34;: &#34;globex-1&#34;" in page
    assert "tenant globex" in page
    assert all("tenant=globex" in u for u in _links(page) if u not in ("/",))
    status, _, page = http(base + f"/letters/order-service/{letter}?tenant=acme")
    assert status == 200 and "&#34;customer&#34;: &#34;acme-1&#34;" in page

    for path in ("/?tenant=globex", "/groups?tenant=globex", "/pending/order-service?tenant=globex"):
        status, _, page = http(base + path)
        assert status == 200 and "tenant globex" in page, path
        assert [u for u in _links(page) if "tenant=globex" not in u] == ["/", "/"], path

    status, _, body = http(base + "/api/letters?tenant=globex&status=all")
    data = json.loads(body)
    assert data["total"] == 1 and [r["error"] for r in data["rows"]] == ["ValueError: globex"]


def test_the_list_of_tenants_links_to_each_ones_letters(base: str) -> None:
    status, _, page = http(base + "/")
    assert status == 200 and "Tenants" in page
    links = _links(page)
    assert "/letters?tenant=acme" in links and "/letters?tenant=globex" in links
    assert all("tenant=" in u for u in links if u not in ("/", "/login?next=/")), links  # no link to a 400
    # Login, health and static files need no tenant.
    assert http(base + "/login")[0] == 200 and http(base + "/healthz")[0] == 200
    assert http(base + "/static/style.css")[0] == 200


def test_an_unknown_tenant_is_404_and_a_missing_one_400(base: str, tenants: dict[str, list[int]]) -> None:
    (letter,) = tenants["globex"]
    for path in ("/letters?tenant=initech", f"/api/letters/order-service/{letter}?tenant=initech"):
        status, _, body = http(base + path)
        assert status == 404 and "initech" in body and "acme, globex" in body, path
    status, _, body = http(base + f"/api/letters/order-service/{letter}/replay?tenant=initech", method="POST")
    assert status == 404 and "acme, globex" in body

    for path in (
        f"/letters/order-service/{letter}",
        f"/api/letters/order-service/{letter}",
        "/letters",
        "/api/letters",
    ):
        status, _, body = http(base + path)
        assert status == 400 and "?tenant=KEY" in body and "acme, globex" in body, path
    status, _, body = http(base + f"/letters/order-service/{letter}/replay", data={"csrf": "x"})
    assert status == 400 and "?tenant=KEY" in body


def test_a_replay_on_one_tenant_leaves_the_other_unchanged(base: str, conn: Any, tenants: dict[str, list[int]]) -> None:
    (letter,) = tenants["globex"]
    acme_before = seed.tenant_state(conn, "txbox")
    globex_before = seed.tenant_state(conn, GLOBEX)

    # The form: the session and CSRF checks are the dashboard's own, with the tenant in the query.
    cookie = _login(base)
    path = f"/letters/order-service/{letter}/replay?tenant=globex"
    assert http(base + path, data={"csrf": "forged"}, headers=cookie)[0] == 403
    assert seed.tenant_state(conn, GLOBEX) == globex_before
    status, _, page = http(base + path, headers=cookie)
    assert status == 200 and f'action="/letters/order-service/{letter}/replay?tenant=globex"' in page
    assert [u for u in _links(page) if "tenant=globex" not in u] == ["/", "/"]  # Cancel keeps it too
    csrf = _csrf(base, path, cookie)
    status, headers, _ = http(base + path, data={"csrf": csrf}, headers=cookie)
    assert status == 303 and headers["location"].startswith(f"/letters/order-service/{letter}?done=inbox-reset")
    assert headers["location"].endswith("&tenant=globex")
    assert seed.tenant_state(conn, "txbox") == acme_before  # tenant acme: nothing changed
    assert seed.tenant_state(conn, GLOBEX) != globex_before
    replayed = conn.execute(f"SELECT replay_count FROM {GLOBEX}.dead_letters WHERE id = %s", (letter,)).fetchone()
    assert replayed["replay_count"] == 1

    # The JSON API: Bearer only, as ever; a discard on acme leaves globex as the replay left it.
    globex_after = seed.tenant_state(conn, GLOBEX)
    acme_id = tenants["acme"][0]
    assert http(base + f"/api/letters/order-service/{acme_id}/discard?tenant=acme", method="POST")[0] == 401
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    status, _, body = http(
        base + f"/api/letters/order-service/{acme_id}/discard?tenant=acme", method="POST", headers=bearer
    )
    assert status == 200 and json.loads(body)["outcomes"][0]["action"] == "discarded"
    assert seed.tenant_state(conn, GLOBEX) == globex_after
    assert seed.tenant_state(conn, "txbox") != acme_before


def test_without_a_registry_the_dashboard_is_as_before_and_tenant_is_400(database_url: str, conn: Any) -> None:
    lid = seed.abandoned(conn, "inbox", seed.envelope(customer="bob"))
    source = Source("order-service", database_url, schema="txbox", contracts_dir=CONTRACTS)
    with serving(create_app([source], SETTINGS)) as base:
        status, _, page = http(base + "/letters")
        assert status == 200 and f'href="/letters/order-service/{lid}"' in page and "tenant" not in page
        assert http(base + "/")[0] == 200 and "<h1>Tenants</h1>" not in http(base + "/")[2]
        for path in ("/letters?tenant=acme", f"/letters/order-service/{lid}?tenant=", "/api/letters?tenant=acme"):
            status, _, body = http(base + path)
            assert status == 400 and "TXBOX_TENANTS_FILE" in body, path


def test_tenants_added_removed_and_changed_are_followed_without_a_restart(
    tmp_path: Path, database_url: str, tenants: dict[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """The registry file edited while the dashboard runs (each edit an atomic rename, as an
    editor saves): a tenant added is served, one removed is a 404, one moved to another
    schema is read from there; the follower's thread is the only one that reads the file."""
    from framework.tenants import FileSource, RegistryWatcher
    from framework.tenants.follow import RegistryFollower
    from tests.support import wait_until

    path = tmp_path / "followed.toml"

    def save(text: str) -> None:
        (tmp_path / "followed.tmp").write_text(text)
        (tmp_path / "followed.tmp").replace(path)

    save("[tenants.acme]\n")
    source = FileSource(path, default_database_url=database_url, default_schema="txbox")
    follower = RegistryFollower(RegistryWatcher(source, interval=0.05))
    follower.start()
    service = Source("order-service", "", schema="txbox", contracts_dir=CONTRACTS)
    try:
        with serving(create_app([service], SETTINGS, tenants=follower)) as url:
            assert http(url + "/letters?tenant=globex")[0] == 404
            assert http(url + "/letters?tenant=acme")[0] == 200  # acme's dashboard is made now

            save(f'[tenants.acme]\n\n[tenants.globex]\nschema = "{GLOBEX}"\n')
            wait_until(lambda: "globex" in http(url + "/")[2], message="globex listed")
            status, _, page = http(url + "/letters?tenant=globex")
            assert status == 200 and "ValueError: globex" in page

            # acme moves to globex's schema (globex leaves it): acme's page now reads there.
            save(f'[tenants.acme]\nschema = "{GLOBEX}"\n')
            wait_until(lambda: http(url + "/letters?tenant=globex")[0] == 404, message="globex removed")
            status, _, page = http(url + "/letters?tenant=acme")
            assert status == 200 and "ValueError: globex" in page and "KeyError" not in page

            save("this is not TOML [")  # a half-saved file: the last good snapshot stays in force
            wait_until(
                lambda: any(r.name == "txbox.tenants" and r.levelname == "WARNING" for r in caplog.records),
                message="the bad version reported",
            )
            status, _, page = http(url + "/letters?tenant=acme")
            assert status == 200 and "ValueError: globex" in page
    finally:
        follower.stop()
