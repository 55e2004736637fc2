"""Test databases: one template per set of migrations, migrated once, cloned per test
(``CREATE DATABASE ... TEMPLATE``: a file copy, far faster than migrating again).

The server is the one of ``TXBOX_TEST_DATABASE_URL`` (any database there; the clones are
created beside it), else of ``TXBOX_DATABASE_URL``, else the local PostgreSQL.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import psycopg
from alembic import command
from alembic.config import Config
from psycopg import sql
from sqlalchemy.engine import make_url

from framework import db, migrate, tables
from framework.errors import ConfigurationError

DEFAULT_SERVER = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def server_url(environ: dict[str, str] | None = None) -> str:
    """A URL of the server test databases are created on (its database: the maintenance one)."""
    env = os.environ if environ is None else environ
    given = env.get("TXBOX_TEST_DATABASE_URL")
    if given:
        return given
    if env.get("TXBOX_DATABASE_URL"):
        return make_url(env["TXBOX_DATABASE_URL"]).set(database="postgres").render_as_string(hide_password=False)
    return DEFAULT_SERVER


class Templates:
    """Migrated template databases, made on first use and cloned for each test."""

    def __init__(self, server: str | None = None) -> None:
        self.server = server or server_url()
        self._templates: dict[tuple[str, str], str] = {}
        self._made: list[str] = []
        try:
            self._admin().close()
        except psycopg.OperationalError as exc:
            raise ConfigurationError(
                f"test databases: PostgreSQL is not reachable at {make_url(self.server)!r} ({exc}); start it, "
                "or set TXBOX_TEST_DATABASE_URL to a database URL on a server where tests may create databases"
            ) from None

    def url(self, database: str) -> str:
        return make_url(self.server).set(database=database).render_as_string(hide_password=False)

    def template(self, alembic_ini: str | Path | None = None, schema: str = tables.SCHEMA) -> str:
        """The name of a database migrated to head: the framework's history, then the
        service's own Alembic history of ``alembic_ini`` (if any)."""
        ini = str(Path(alembic_ini).resolve()) if alembic_ini is not None else ""
        key = (ini, schema)
        if key not in self._templates:
            name = _unique("txbox_tpl")
            self._create(name)
            self._made.append(name)
            url = self.url(name)
            migrate.upgrade(url, schema)
            if ini:
                if not Path(ini).is_file():
                    raise ConfigurationError(f"test databases: no Alembic configuration at {ini}")
                cfg = Config(ini)
                cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
                command.upgrade(cfg, "head")
            # A clone needs its template free of sessions: one a migration left open would
            # fail every CREATE DATABASE ... TEMPLATE of the run.
            self._execute(
                sql.SQL(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = {} "
                    "AND pid <> pg_backend_pid()"
                ).format(sql.Literal(name))
            )
            self._templates[key] = name
        return self._templates[key]

    def clone(self, alembic_ini: str | Path | None = None, schema: str = tables.SCHEMA) -> str:
        """A new database copied from the template; returns its URL (drop it with :meth:`drop`)."""
        template = self.template(alembic_ini, schema)
        name = _unique("txbox_test")
        self._create(name, template)
        return self.url(name)

    def drop(self, url: str) -> None:
        database = make_url(url).database
        if database:
            self._execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))

    def close(self) -> None:
        """Drop the templates."""
        while self._made:
            self.drop(self.url(self._made.pop()))
        self._templates.clear()

    def _create(self, name: str, template: str | None = None) -> None:
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        self._execute(statement)

    def _admin(self) -> psycopg.Connection[tuple[object, ...]]:
        return psycopg.connect(db.conninfo(self.server), autocommit=True, connect_timeout=10)

    def _execute(self, statement: sql.Composed) -> None:
        with self._admin() as conn:
            conn.execute(statement)


def _unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:12]}"
