"""Alembic environment of the framework's own history.

It keeps its version in ``<schema>.txbox_alembic_version`` so a service's own Alembic
history (default ``public.alembic_version``) lives beside it in the same database.
Run through ``txbox migrate`` (framework.migrate), which passes the schema and URL.
"""

from __future__ import annotations

from alembic import context

from framework import migration_env, names

config = context.config
schema: str = config.attributes.get("schema") or context.get_x_argument(as_dictionary=True).get("schema", "txbox")
# Every serious migration lock: two `txbox migrate` at once must not interleave.
migration_env.run(schema, version_table=names.ALEMBIC_VERSION_TABLE, lock=f"txbox.migrate.{schema}")
