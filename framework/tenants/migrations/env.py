"""Alembic environment of the control database's history (the tenant registry's tables).

A history of its own, not a branch of the framework's: the control database is not a
tenant's, so `txbox migrate` never creates these tables in a tenant's database, and
`upgrade head` stays one head in both (docs/explanation/operations.md, "Tenants: the registry").
Its version is kept in ``<TXBOX_TENANTS_SCHEMA>.txbox_tenants_alembic_version``. Run
through `txbox tenants init` (framework.tenants.control.init).
"""

from __future__ import annotations

from alembic import context

from framework import migration_env, names

schema: str = context.config.attributes.get("schema") or names.DEFAULT_TENANTS_SCHEMA
# Two `txbox tenants init` at once must not interleave.
migration_env.run(schema, version_table=names.TENANTS_ALEMBIC_VERSION_TABLE, lock=f"txbox.tenants.migrate.{schema}")
