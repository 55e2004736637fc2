"""The framework's migrations: shape, drift against the metadata, reversibility, coexistence."""

from __future__ import annotations

import textwrap
from pathlib import Path

import psycopg
import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text

from framework import migrate, names, tables
from framework.cli import main as txbox
from framework.db import conninfo


def _tables(url: str, schema: str = "txbox") -> set[str]:
    engine = create_engine(url)
    try:
        return set(inspect(engine).get_table_names(schema=schema))
    finally:
        engine.dispose()


def test_creates_the_design_tables(database_url: str) -> None:
    assert {"outbox", "inbox", "redeliveries", "dead_letters", names.ALEMBIC_VERSION_TABLE} <= _tables(database_url)


def test_hot_queries_have_partial_indexes(database_url: str) -> None:
    with psycopg.connect(conninfo(database_url)) as conn:
        rows = conn.execute(
            "SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'txbox'"
        ).fetchall()
    predicates = {i: d[d.index(" WHERE ") :] for t, i, d in rows if " WHERE " in d}
    for t in ("outbox", "inbox"):
        assert predicates[f"{t}_due_idx"] == " WHERE ((processed_at IS NULL) AND (abandoned_at IS NULL))"
        # Spelled apart from the due index's, so that only the head-of-segment probes use it.
        assert predicates[f"{t}_segment_idx"] == " WHERE (COALESCE(processed_at, abandoned_at) IS NULL)"


def _indexes(url: str) -> dict[str, str]:
    with psycopg.connect(conninfo(url)) as conn:
        rows = conn.execute(
            "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'txbox' AND tablename <> %s",
            (names.ALEMBIC_VERSION_TABLE,),
        ).fetchall()
    return dict(rows)


def test_indexes_and_the_metadata_do_not_drift_down_to_the_predicates(
    database_url: str, empty_database_url: str
) -> None:
    # compare_metadata (below) does not compare a partial index's predicate; the planner does.
    engine = create_engine(empty_database_url)
    try:
        with engine.begin() as conn:
            conn.execute(text(f"CREATE SCHEMA {tables.SCHEMA}"))
            tables.metadata.create_all(conn)
    finally:
        engine.dispose()
    assert _indexes(database_url) == _indexes(empty_database_url)


def test_metadata_and_migrations_do_not_drift(database_url: str) -> None:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "compare_type": True,
                    "include_name": lambda name, type_, parent: (
                        (parent.get("schema_name") == tables.SCHEMA if type_ == "table" else True)
                        if type_ != "schema"
                        else name == tables.SCHEMA
                    ),
                    "include_object": lambda obj, name, type_, reflected, compare_to: (
                        not (type_ == "table" and name == names.ALEMBIC_VERSION_TABLE)
                    ),
                },
            )
            diff = compare_metadata(ctx, tables.metadata)
    finally:
        engine.dispose()
    assert diff == [], f"migrations and framework/tables.py differ: {diff}"


def test_downgrade_to_base_and_upgrade_again(database_url: str) -> None:
    migrate.downgrade(database_url)
    assert _tables(database_url) == {names.ALEMBIC_VERSION_TABLE}
    assert migrate.current(database_url) is None
    migrate.upgrade(database_url)
    assert {"outbox", "inbox", "redeliveries", "dead_letters"} <= _tables(database_url)
    assert migrate.current(database_url) is not None


def test_upgrade_twice_is_a_no_op(database_url: str) -> None:
    head = migrate.current(database_url)
    migrate.upgrade(database_url)
    assert migrate.current(database_url) == head


def test_other_schema(empty_database_url: str) -> None:
    migrate.upgrade(empty_database_url, schema="messaging")
    assert {"outbox", "inbox", "dead_letters", names.ALEMBIC_VERSION_TABLE} <= _tables(empty_database_url, "messaging")
    assert "outbox" not in _tables(empty_database_url, "txbox")


def test_insert_notifies_once_per_transaction_with_empty_payload(database_url: str) -> None:
    channel = names.notify_channel("txbox", "outbox")
    with psycopg.connect(conninfo(database_url), autocommit=True) as listener:
        listener.execute(f"LISTEN {channel}")
        with psycopg.connect(conninfo(database_url)) as writer:
            for i in range(3):
                writer.execute(
                    """INSERT INTO txbox.outbox (id, message_type, aggregate_type, aggregate_id, kind,
                       routing_key, payload, segment) VALUES (gen_random_uuid(), 'T', 'a', %s, 'event',
                       'a.b.c', '{}', 'a')""",
                    (str(i),),
                )
        notes = list(listener.notifies(timeout=2.0))
    assert [(n.channel, n.payload) for n in notes] == [(channel, "")]


def _service_alembic(tmp_path: Path, url: str) -> Config:
    """A service's own Alembic history in the default version table (public.alembic_version)."""
    scripts = tmp_path / "service_migrations"
    (scripts / "versions").mkdir(parents=True)
    (scripts / "env.py").write_text(
        textwrap.dedent(
            """
            from alembic import context
            from sqlalchemy import create_engine
            engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
            with engine.connect() as conn:
                context.configure(connection=conn)
                with context.begin_transaction():
                    context.run_migrations()
                conn.commit()
            """
        )
    )
    (scripts / "script.py.mako").write_text("")
    (scripts / "versions" / "a1_orders.py").write_text(
        textwrap.dedent(
            """
            from alembic import op
            revision = "a1"
            down_revision = None
            def upgrade():
                op.execute("CREATE TABLE public.orders (id text PRIMARY KEY)")
            def downgrade():
                op.execute("DROP TABLE public.orders")
            """
        )
    )
    cfg = Config()
    cfg.set_main_option("script_location", str(scripts))
    cfg.set_main_option("sqlalchemy.url", url)
    return cfg


def test_service_history_lives_beside_the_framework(empty_database_url: str, tmp_path: Path) -> None:
    service_cfg = _service_alembic(tmp_path, empty_database_url)
    command.upgrade(service_cfg, "head")
    migrate.upgrade(empty_database_url)
    with psycopg.connect(conninfo(empty_database_url)) as conn:
        assert conn.execute("SELECT version_num FROM public.alembic_version").fetchall() == [("a1",)]
        framework_head = conn.execute("SELECT version_num FROM txbox.txbox_alembic_version").fetchall()
    assert framework_head == [(migrate.current(empty_database_url),)]
    # Moving one history leaves the other alone.
    migrate.downgrade(empty_database_url)
    assert "orders" in _tables(empty_database_url, "public")
    command.downgrade(service_cfg, "base")
    migrate.upgrade(empty_database_url)
    assert "orders" not in _tables(empty_database_url, "public")
    assert "outbox" in _tables(empty_database_url)


def test_migrate_sql_prints_the_ddl(capsys: pytest.CaptureFixture[str]) -> None:
    assert txbox(["migrate", "--sql"]) == 0
    out = capsys.readouterr().out
    assert "CREATE TABLE txbox.outbox" in out and "CREATE TABLE txbox.txbox_alembic_version" in out
    assert "pg_notify('txbox_outbox_insert', '')" in out


def test_migrate_command(empty_database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = txbox(["migrate", "--service", "order-service", "--database-url", empty_database_url])
    assert rc == 0
    assert "base →" in capsys.readouterr().out
    assert "outbox" in _tables(empty_database_url)


def test_migrate_against_unreachable_database_is_one_clear_line(capsys: pytest.CaptureFixture[str]) -> None:
    rc = txbox(["migrate", "--service", "s", "--database-url", "postgresql://postgres@127.0.0.1:1/nope"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("txbox migrate: error: cannot migrate") and "Traceback" not in err
