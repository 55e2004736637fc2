"""Alembic environment of the order service's own tables (version table: alembic_version)."""

from examples.migrate import run_env
from examples.orders.models import Base

run_env(Base.metadata)
