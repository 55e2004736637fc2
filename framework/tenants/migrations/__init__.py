"""The control database's own Alembic history: the tenant registry's tables (`txbox tenants init`)."""
