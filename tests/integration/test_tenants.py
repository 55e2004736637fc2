"""The tenant registry against the real PostgreSQL: `txbox migrate` and `txbox check` over
several tenant databases and schemas made here, one of them unreachable and one broken;
hostile registries that migrate nothing; the control table's watcher seeing tenants come
and go without a restart."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from framework import migrate, names
from framework.cli import main as txbox
from framework.db import conninfo
from framework.errors import TenantRegistryError
from framework.tenants import control
from framework.tenants.control import TableSource
from framework.tenants.watch import RegistryWatcher
from tests import support

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"
PASSWORD = "s3cr3t-pw"  # trust authentication ignores it; the output must never show it


def _url(database: str) -> str:
    """A URL of the test server carrying a password, as a real registry's would."""
    return support.db_url(database).replace("postgres@", f"postgres:{PASSWORD}@", 1)


@pytest.fixture
def empty_databases() -> Iterator[Callable[[int], list[str]]]:
    """``empty_databases(n)``: ``n`` empty databases of this test's own, dropped after it."""
    made: list[str] = []

    def make(count: int) -> list[str]:
        names_ = [support.unique("txbox_tn") for _ in range(count)]
        for name in names_:
            support.create_database(name)
            made.append(name)
        return names_

    yield make
    for name in made:
        support.drop_database(name)


def _revision(database: str, schema: str = "txbox") -> str | None:
    return migrate.current(support.db_url(database), schema)


def _schemas(database: str) -> set[str]:
    with psycopg.connect(conninfo(support.db_url(database))) as conn:
        return {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace")}


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for var in ("TXBOX_TENANTS_FILE", "TXBOX_TENANTS_DATABASE_URL", "TXBOX_TENANTS_SCHEMA", "TXBOX_APP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TXBOX_SERVICE", "order-service")
    return monkeypatch


def _registry(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_text(text)
    return path


def test_migrate_goes_on_past_an_unreachable_and_a_broken_tenant(
    tmp_path: Path,
    empty_databases: Callable[[int], list[str]],
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    own, shared, broken = empty_databases(3)
    # `broken` already has a txbox.outbox of another shape: the first migration fails there.
    with psycopg.connect(conninfo(support.db_url(broken)), autocommit=True) as conn:
        conn.execute("CREATE SCHEMA txbox; CREATE TABLE txbox.outbox (something int)")
    path = _registry(
        tmp_path,
        f"""
[tenants.acme]
database_url = "{_url(own)}"

[tenants.globex]
schema = "tenant_globex"

[tenants.initech]
schema = "tenant_initech"

[tenants.gone]
database_url = "{_url(support.unique("txbox_absent"))}"

[tenants.broken]
database_url = "{_url(broken)}"
""",
    )
    env.setenv("TXBOX_DATABASE_URL", _url(shared))  # globex and initech: a schema each in `shared`
    env.setenv("TXBOX_TENANTS_FILE", str(path))
    env.setenv("TXBOX_TENANTS_JOBS", "3")

    assert txbox(["migrate"]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert PASSWORD not in out.out + out.err
    assert _revision(own) == _revision(shared, "tenant_globex") == _revision(shared, "tenant_initech") is not None
    assert {"tenant_globex", "tenant_initech"} <= _schemas(shared)
    assert _revision(broken) is None  # its failed migration left nothing half-way
    for key in ("acme", "globex", "initech"):
        assert any(line.startswith(f"tenant {key}: ok: ") and "base → " in line for line in lines), lines
    failed = {line.split(":")[0] for line in lines if ": FAILED: " in line}
    assert failed == {"tenant gone", "tenant broken"}
    assert lines[-1] == "tenants: 3 migrated, 2 failed (broken, gone)"
    assert any("tenant gone: FAILED" in line and "does not exist" in line for line in lines)

    # Again: the three at head stay there, the two still fail; the exit code still says so.
    assert txbox(["migrate"]) == 1
    assert "tenants: 3 migrated, 2 failed" in capsys.readouterr().out

    # `txbox check` (no service named: the contracts lint) checks each tenant's database too.
    env.delenv("TXBOX_SERVICE")
    assert txbox(["check", "--contracts-dir", str(CONTRACTS)]) == 1
    out = capsys.readouterr()
    lines = out.out.splitlines()
    assert PASSWORD not in out.out + out.err
    assert sum(": ok: " in line and "migrated (" in line for line in lines) == 3
    assert any(line.startswith("tenant broken: FAILED") and "not migrated" in line for line in lines), lines
    assert "tenants: 3 ok, 2 failed (broken, gone)" in lines

    # One tenant picked: only it is checked, and it passes.
    assert txbox(["check", "--contracts-dir", str(CONTRACTS), "--tenant", "acme"]) == 0
    assert "tenants: 1 ok, 0 failed" in capsys.readouterr().out


def test_migrate_one_tenant_and_an_unknown_one(
    tmp_path: Path,
    empty_databases: Callable[[int], list[str]],
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a, b = empty_databases(2)
    path = _registry(tmp_path, f'[tenants.a]\ndatabase_url = "{_url(a)}"\n\n[tenants.b]\ndatabase_url = "{_url(b)}"\n')
    env.delenv("TXBOX_DATABASE_URL", raising=False)  # database per tenant: the service needs none
    assert txbox(["migrate", "--tenants-file", str(path), "--tenant", "b"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "tenants: 1 migrated, 0 failed"
    assert _revision(a) is None and _revision(b) is not None
    assert txbox(["migrate", "--tenants-file", str(path), "--tenant", "c"]) == 2
    assert "no tenant 'c'" in capsys.readouterr().err
    assert _revision(a) is None


def test_without_a_registry_migrate_is_as_it_was(
    empty_databases: Callable[[int], list[str]], env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (database,) = empty_databases(1)
    env.setenv("TXBOX_DATABASE_URL", _url(database))
    assert txbox(["migrate"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("migrated postgresql+psycopg://postgres:***@") and "tenant" not in out
    assert txbox(["migrate", "--tenant", "a"]) == 2
    assert "--tenant needs a tenant registry" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ('[tenants.b]\nschema = "txbox"\n', "has the database and schema of tenant 'a'"),
        ('[tenants.B]\nschema = "b"\n', "tenant key 'B' is not valid"),
        ('[tenants.b]\ndatabase_url = "postgresql+psycopg://postgres:{pw}@127.0.0.1"\n', "names no database"),
        ('[tenants.b]\nschema = "b"\nport = 5432\n', "unknown field 'port'"),
        ('[tenants.a]\nschema = "again"\n', "is not valid TOML"),
        ("[tenants.b]\n" + "# padding\n" * 200_000, "more than 1048576"),
    ],
)
def test_a_hostile_registry_migrates_no_tenant(
    tmp_path: Path,
    empty_databases: Callable[[int], list[str]],
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    entry: str,
    expected: str,
) -> None:
    (good,) = empty_databases(1)
    path = _registry(tmp_path, f'[tenants.a]\ndatabase_url = "{_url(good)}"\n\n' + entry.format(pw=PASSWORD))
    env.setenv("TXBOX_DATABASE_URL", _url(good))
    env.setenv("TXBOX_TENANTS_FILE", str(path))
    assert txbox(["migrate"]) == 2
    out = capsys.readouterr()
    assert expected in out.err and str(path) in out.err
    assert PASSWORD not in out.out + out.err
    assert _revision(good) is None and "txbox" not in _schemas(good)  # not even the good tenant


@pytest.fixture
def control_url() -> Iterator[str]:
    name = support.unique("txbox_ctl")
    support.create_database(name)
    yield support.db_url(name)
    support.drop_database(name)


def _execute(url: str, statement: str, *params: object) -> None:
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        conn.execute(statement, params)  # type: ignore[call-overload]


def test_the_control_table_watcher_sees_tenants_come_change_and_go(control_url: str) -> None:
    schema = names.DEFAULT_TENANTS_SCHEMA
    assert control.init(control_url, schema) == (None, control.head())
    assert control.init(control_url, schema) == (control.head(), control.head())  # again: nothing to do
    tenants = f"{schema}.{names.TENANTS}"
    service_url = "postgresql+psycopg://app@db:5432/orders"
    source = TableSource(control_url, schema, default_database_url=service_url, default_schema="txbox")
    watcher = RegistryWatcher(source, interval=0.05)
    try:
        assert len(watcher.start()) == 0
        assert watcher.poll() is None

        # A plain INSERT by whoever runs the catalog: no restart, no signal.
        _execute(control_url, f"INSERT INTO {tenants} (key, schema, mosaic_tenant_id) VALUES ('acme', 'ta', 'T1')")
        change = support.wait_until(watcher.poll, message="the added tenant")
        assert [(t.key, t.database_url, t.schema) for t in change.added] == [("acme", service_url, "ta")]
        assert watcher.registry.for_mosaic("T1", "prod") == change.added[0]

        _execute(
            control_url,
            f"INSERT INTO {tenants} (key, database_url) VALUES ('globex', %s)",
            f"postgresql+psycopg://app:{PASSWORD}@db-globex/orders",
        )
        change = support.wait_until(watcher.poll, message="the second tenant")
        assert [t.key for t in change.added] == ["globex"] and PASSWORD not in str(change) + repr(change)

        _execute(control_url, f"UPDATE {tenants} SET schema = 'tb' WHERE key = 'acme'")
        change = support.wait_until(watcher.poll, message="the changed tenant")
        assert [(old.schema, new.schema) for old, new in change.changed] == [("ta", "tb")]

        # A row the database accepts but the registry cannot (two tenants at one schema):
        # reported once, and the last good snapshot stays in force.
        _execute(control_url, f"INSERT INTO {tenants} (key, schema) VALUES ('twin', 'tb')")
        with pytest.raises(TenantRegistryError, match="has the database and schema of tenant 'acme'"):
            support.wait_until(watcher.poll, message="the bad row")
        assert watcher.poll() is None
        assert watcher.registry.keys() == ("acme", "globex")

        _execute(control_url, f"DELETE FROM {tenants} WHERE key IN ('twin', 'acme')")
        change = support.wait_until(watcher.poll, message="the removed tenant")
        assert [t.key for t in change.removed] == ["acme"] and not change.added
        assert watcher.registry.keys() == ("globex",)
    finally:
        watcher.close()


def test_a_change_notifies_its_channel_and_the_watch_loop_reports_it(control_url: str) -> None:
    schema = "ctl_custom"
    control.init(control_url, schema)
    with psycopg.connect(conninfo(control_url), autocommit=True) as listener:
        listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(names.tenants_channel(schema))))
        source = TableSource(control_url, schema, default_database_url=None, default_schema="txbox")
        watcher = RegistryWatcher(source, interval=0.05)
        watcher.start()
        stop = threading.Event()
        seen: list[str] = []
        thread = threading.Thread(target=watcher.watch, args=(lambda c: seen.extend(t.key for t in c.added), stop))
        thread.start()
        try:
            url = support.db_url("x")
            _execute(control_url, f"INSERT INTO {schema}.tenants (key, database_url) VALUES ('n1', %s)", url)
            note = next(listener.notifies(timeout=10, stop_after=1))
            assert note.channel == names.tenants_channel(schema) and int(note.payload) >= 2
            support.wait_until(lambda: seen == ["n1"], message="the watch loop's report")
        finally:
            stop.set()
            thread.join(10)
            watcher.close()
    assert not thread.is_alive()


def test_tenants_commands_over_the_control_table(
    control_url: str,
    empty_databases: Callable[[int], list[str]],
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    (database,) = empty_databases(1)
    env.setenv("TXBOX_TENANTS_DATABASE_URL", control_url)
    env.setenv("TXBOX_DATABASE_URL", _url(database))
    assert txbox(["tenants", "list"]) == 2
    assert "txbox tenants init" in capsys.readouterr().err
    assert txbox(["tenants", "init"]) == 0
    _execute(control_url, "INSERT INTO txbox_control.tenants (key, schema) VALUES ('a', 'ta'), ('b', 'tb')")
    assert txbox(["tenants", "list"]) == 0
    out = capsys.readouterr().out
    assert "2 tenants in table txbox_control.tenants" in out and PASSWORD not in out and "postgres:***@" in out
    assert txbox(["migrate"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "tenants: 2 migrated, 0 failed"
    assert _revision(database, "ta") == _revision(database, "tb") is not None
    assert "txbox" not in _schemas(database)  # the service's own schema was never a tenant's
