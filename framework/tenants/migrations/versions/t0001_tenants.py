"""The tenant registry: ``tenants`` (one row a tenant) and ``tenants_version`` (its change counter).

Every statement that changes ``tenants`` (INSERT, UPDATE, DELETE, TRUNCATE) bumps the one
row of ``tenants_version`` and NOTIFYs ``<schema>_tenants_changed`` with the new version,
in the same transaction: a watcher polls that one row (or LISTENs) and reads the table
again only when it moved (docs/explanation/operations.md, "Tenants: the registry"). The checks
are those of the registry's validation (framework/tenants/model.py), so a row a plain
INSERT adds is one the watchers accept; uniqueness of a tenant's (database, schema) is
checked by the watchers, which resolve a URL's defaults.

Revision ID: t0001
Revises:
Create Date: 2026-12-10
"""

from __future__ import annotations

from alembic import op

from framework import names
from framework.migrate import schema_of

revision = "t0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    channel = names.tenants_channel(s)
    op.execute(
        f"""
        CREATE TABLE {s}.tenants (
            key text PRIMARY KEY CONSTRAINT tenants_key_check CHECK (key ~ '^[a-z0-9][a-z0-9_-]{{0,62}}$'),
            database_url text CONSTRAINT tenants_database_url_check
                CHECK (char_length(database_url) BETWEEN 1 AND 4096),
            schema text CONSTRAINT tenants_schema_check
                CHECK (schema ~ '^[a-z_][a-z0-9_]{{0,62}}$' AND schema NOT LIKE 'pg\\_%'),
            mosaic_tenant_id text CONSTRAINT tenants_mosaic_tenant_id_check
                CHECK (mosaic_tenant_id ~ '^[A-Za-z0-9_-]{{1,64}}$'),
            mosaic_environment_id text CONSTRAINT tenants_mosaic_environment_id_check
                CHECK (mosaic_environment_id ~ '^[A-Za-z0-9_-]{{1,64}}$'),
            created_at timestamptz NOT NULL DEFAULT now(),
            CONSTRAINT tenants_environment_needs_tenant_check
                CHECK (mosaic_environment_id IS NULL OR mosaic_tenant_id IS NOT NULL)
        )
        """
    )
    op.execute(
        f"CREATE UNIQUE INDEX tenants_mosaic_idx ON {s}.tenants (mosaic_tenant_id, coalesce(mosaic_environment_id, ''))"
        " WHERE mosaic_tenant_id IS NOT NULL"
    )
    op.execute(
        f"""
        CREATE TABLE {s}.tenants_version (
            one boolean PRIMARY KEY DEFAULT true CONSTRAINT tenants_version_one_check CHECK (one),
            version bigint NOT NULL,
            changed_at timestamptz NOT NULL DEFAULT now()
        )
        """
    )
    op.execute(f"INSERT INTO {s}.tenants_version (version) VALUES (1)")
    op.execute(
        f"""CREATE FUNCTION {s}.tenants_changed() RETURNS trigger LANGUAGE plpgsql AS $$
        DECLARE v bigint;
        BEGIN
            UPDATE {s}.tenants_version SET version = version + 1, changed_at = now() RETURNING version INTO v;
            PERFORM pg_notify('{channel}', v::text);
            RETURN NULL;
        END $$"""
    )
    op.execute(
        f"CREATE TRIGGER tenants_changed AFTER INSERT OR UPDATE OR DELETE ON {s}.tenants "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {s}.tenants_changed()"
    )
    op.execute(
        f"CREATE TRIGGER tenants_truncated AFTER TRUNCATE ON {s}.tenants "
        f"FOR EACH STATEMENT EXECUTE FUNCTION {s}.tenants_changed()"
    )


def downgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(f"DROP TABLE {s}.tenants")
    op.execute(f"DROP FUNCTION {s}.tenants_changed()")
    op.execute(f"DROP TABLE {s}.tenants_version")
