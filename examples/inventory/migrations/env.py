"""Alembic environment of the inventory service's own tables (version table: alembic_version)."""

from examples.inventory.models import Base
from examples.migrate import run_env

run_env(Base.metadata)
