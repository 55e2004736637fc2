"""The tenant registry file: hostile files (written here as raw bytes) fail whole, naming
the file, the line or entry and the fix, and never print a password; a good one gives an
immutable snapshot whose diffs and Mosaic lookups are right."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from framework.errors import ConfigurationError, TenantRegistryError
from framework.settings import TenantSettings, load
from framework.tenants import files
from framework.tenants.model import MAX_TENANTS
from framework.tenants.watch import FileSource, RegistryWatcher

SERVICE_URL = "postgresql+psycopg://app:service-pw@db:5432/orders"
PASSWORD = "t0p-s3cret"


def _write(tmp_path: Path, data: bytes | str) -> Path:
    path = tmp_path / "tenants.toml"
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def _load(path: Path, default_url: str | None = SERVICE_URL) -> files.Registry:
    return files.load_file(path, default_database_url=default_url, default_schema="txbox")


def _fails(tmp_path: Path, data: bytes | str, *expected: str, default_url: str | None = SERVICE_URL) -> str:
    path = _write(tmp_path, data)
    with pytest.raises(TenantRegistryError) as caught:
        _load(path, default_url)
    text = str(caught.value)
    assert str(path) in text
    for part in expected:
        assert part in text, text
    assert PASSWORD not in text and "service-pw" not in text
    return text


GOOD = f"""
# the catalog of order-service's tenants
[tenants.acme]
database_url = "postgresql+psycopg://app:{PASSWORD}@db-acme:5432/orders"
mosaic_tenant_id = "9b2f0c7e-3d1a-4d8e-9a55-1c2b3d4e5f60"

[tenants.globex]
schema = "tenant_globex"
mosaic_tenant_id = "globex"
mosaic_environment_id = "prod"

[tenants.initech]
schema = "tenant_initech"
mosaic_tenant_id = "globex"
"""


def test_a_good_file_is_an_immutable_sorted_snapshot(tmp_path: Path) -> None:
    registry = _load(_write(tmp_path, GOOD))
    assert registry.keys() == ("acme", "globex", "initech")
    acme = registry.tenant("acme")
    assert acme.database_url.endswith("@db-acme:5432/orders") and acme.schema == "txbox"
    globex = registry.tenant("globex")
    assert globex.database_url == SERVICE_URL and globex.schema == "tenant_globex"  # schema per tenant
    with pytest.raises(dataclasses.FrozenInstanceError):
        acme.schema = "other"  # type: ignore[misc]
    assert PASSWORD not in repr(acme) and PASSWORD not in repr(registry) and "***" in repr(acme)
    assert len(registry.version) == 64


def test_mosaic_ids_find_their_tenant_an_exact_environment_first(tmp_path: Path) -> None:
    registry = _load(_write(tmp_path, GOOD))
    assert registry.for_mosaic("globex", "prod") == registry.tenant("globex")
    assert registry.for_mosaic("globex", "staging") == registry.tenant("initech")  # every other environment
    assert registry.for_mosaic("9b2f0c7e-3d1a-4d8e-9a55-1c2b3d4e5f60", "any") == registry.tenant("acme")
    assert registry.for_mosaic("nobody", "prod") is None


def test_an_unknown_key_names_the_close_ones(tmp_path: Path) -> None:
    registry = _load(_write(tmp_path, GOOD))
    with pytest.raises(ConfigurationError, match="did you mean acme"):
        registry.tenant("acm")


def test_a_tenant_given_twice_is_toml_s_error_with_its_line(tmp_path: Path) -> None:
    _fails(tmp_path, '[tenants.a]\nschema = "s1"\n\n[tenants.a]\nschema = "s2"\n', "line 4", "is not valid TOML")


def test_two_tenants_at_one_database_and_schema_are_refused(tmp_path: Path) -> None:
    text = _fails(
        tmp_path,
        '[tenants.a]\nschema = "shared"\n\n[tenants.b]\nschema = "shared"\n',
        "line 4, tenant 'b'",
        "has the database and schema of tenant 'a'",
        "own database or schema",
    )
    assert "app:***@db" in text


def test_two_tenants_for_one_mosaic_tenant_and_environment_are_refused(tmp_path: Path) -> None:
    _fails(
        tmp_path,
        '[tenants.a]\nschema = "a"\nmosaic_tenant_id = "t"\n\n[tenants.b]\nschema = "b"\nmosaic_tenant_id = "t"\n',
        "has the Mosaic ids of tenant 'a'",
    )


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (f"mysql://app:{PASSWORD}@db/orders", "is not a PostgreSQL URL"),
        (f"postgresql+psycopg://app:{PASSWORD}@db:5432", "names no database"),
        (f"postgresql+psycopg://app:{PASSWORD}@a:5432,b:5432/orders", "several hosts"),
        (f"postgresql+psycopg://app:{PASSWORD}@db/orders?host=a&host=b", "target_session_attrs"),
        (f"postgresql+psycopg://app:{PASSWORD}@db:notaport/orders", "not valid"),
    ],
)
def test_a_bad_url_is_named_masked_with_the_fix(tmp_path: Path, url: str, expected: str) -> None:
    text = _fails(tmp_path, f'[tenants.a]\ndatabase_url = "{url}"\n', "line 1, tenant 'a'", expected)
    assert "app:***@" in text


@pytest.mark.parametrize(
    "key",
    ['"Acme"', '"-acme"', '"a b"', '"' + "a" * 64 + '"', '"ümlaut"', '"a.b"', f'"postgresql://x:{PASSWORD}@h/d"'],
)
def test_a_bad_tenant_key_is_refused(tmp_path: Path, key: str) -> None:
    _fails(tmp_path, f'[tenants.{key}]\nschema = "s"\n', "tenant key", "lower-case letters")


def test_every_problem_is_listed_at_once_and_an_unknown_field_gets_a_suggestion(tmp_path: Path) -> None:
    text = _fails(
        tmp_path,
        '[tenants.a]\nshema = "s"\n\n[tenants.b]\nschema = "Bad Schema"\n\n[tenants.c]\nschema = 7\n'
        '\n[tenants.d]\nmosaic_environment_id = "prod"\nschema = "d"\n',
        "unknown field 'shema' (did you mean schema?)",
        "line 4, tenant 'b': schema 'Bad Schema' is not a valid schema name",
        "line 7, tenant 'c': schema must be a string, not int",
        "mosaic_environment_id needs mosaic_tenant_id",
    )
    assert text.count("\n  - ") == 4


def test_without_a_service_url_each_tenant_must_name_its_database(tmp_path: Path) -> None:
    _fails(tmp_path, '[tenants.a]\nschema = "a"\n', "no database_url", default_url=None)


def test_a_huge_file_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    big = b"# " + b"x" * (files.MAX_FILE_BYTES + 10) + b"\n"
    _fails(tmp_path, big, f"more than {files.MAX_FILE_BYTES}")


def test_too_many_tenants_are_refused(tmp_path: Path) -> None:
    body = "".join(f'[tenants.t{i}]\nschema = "s{i}"\n' for i in range(MAX_TENANTS + 1))
    assert len(body) < files.MAX_FILE_BYTES
    _fails(tmp_path, body, f"more than {MAX_TENANTS}")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'[tenants.a]\nschema = "\xff\xfe"\n', "line 2: not UTF-8"),
        (b"[tenants]\na = 1\n", "must be a table of the tenant's fields"),
        (b'[[tenants]]\nschema = "a"\n', "tables named by each tenant's key"),
        (b'version = 2\n[tenants.a]\nschema = "a"\n', "at the top"),
        (b"[tenants.a\n", "is not valid TOML"),
        (f'[tenants.a]\ndatabase_url = "postgresql://u:{PASSWORD}@h/d\n'.encode(), "is not valid TOML"),
    ],
)
def test_malformed_files_are_refused(tmp_path: Path, data: bytes, expected: str) -> None:
    _fails(tmp_path, data, expected)


def test_a_missing_file_or_a_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TenantRegistryError, match="cannot be read"):
        _load(tmp_path / "absent.toml")
    with pytest.raises(TenantRegistryError, match="not a regular file"):
        _load(tmp_path)


def test_the_file_watcher_reports_each_change_and_keeps_the_last_good_snapshot(tmp_path: Path) -> None:
    path = _write(tmp_path, '[tenants.a]\nschema = "a"\n')
    watcher = RegistryWatcher(FileSource(path, default_database_url=SERVICE_URL, default_schema="txbox"), interval=1)
    assert watcher.start().keys() == ("a",)
    assert watcher.poll() is None

    path.write_text('[tenants.a]\nschema = "a2"\n\n[tenants.b]\nschema = "b"\n')
    change = watcher.poll()
    assert change is not None
    assert [t.key for t in change.added] == ["b"] and not change.removed
    assert [(old.schema, new.schema) for old, new in change.changed] == [("a", "a2")]

    path.write_text('[tenants.b]\nschema = "b"\n\n[tenants.c\n')  # half saved
    with pytest.raises(TenantRegistryError, match="not valid TOML"):
        watcher.poll()
    assert watcher.poll() is None  # reported once
    assert watcher.registry.keys() == ("a", "b")  # the last good snapshot is still in force

    path.write_text('[tenants.b]\nschema = "b"\n')
    change = watcher.poll()
    assert change is not None and [t.key for t in change.removed] == ["a"] and not change.added


def test_the_settings_refuse_two_sources_and_bad_bounds() -> None:
    both = {"TXBOX_TENANTS_FILE": "t.toml", "TXBOX_TENANTS_DATABASE_URL": "postgresql+psycopg://h/control"}
    with pytest.raises(ConfigurationError, match="both set"):
        load(TenantSettings, both)
    with pytest.raises(ConfigurationError, match="TXBOX_TENANTS_JOBS=0 must be between 1 and"):
        load(TenantSettings, {"TXBOX_TENANTS_JOBS": "0"})
    with pytest.raises(ConfigurationError, match="TXBOX_TENANTS_SCHEMA"):
        load(TenantSettings, {"TXBOX_TENANTS_SCHEMA": "Bad"})
    with pytest.raises(ConfigurationError, match="TXBOX_TENANTS_DATABASE_URL") as caught:
        load(TenantSettings, {"TXBOX_TENANTS_DATABASE_URL": f"mysql://u:{PASSWORD}@h/control"})
    assert PASSWORD not in str(caught.value)
    assert not load(TenantSettings, {}).configured
