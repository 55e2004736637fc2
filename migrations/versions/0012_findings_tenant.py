"""A finding names its tenant: ``analytics_findings.tenant``.

`txbox analyze` reads a service with many tenants one source per tenant, and each
finding says which tenant it concerns (docs/how-to/tenants.md, "Analyze every tenant");
null for a service without tenants, as every row written before this revision.

Locks: ``ADD COLUMN`` of a nullable column without a default changes only the catalog
(no rewrite); it waits for the ACCESS EXCLUSIVE lock, which only a running
`txbox analyze` writing the table holds against it, and for as long as the catalog
change takes.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(f"ALTER TABLE {schema_of(op.get_context())}.analytics_findings ADD COLUMN tenant text")


def downgrade() -> None:
    op.execute(f"ALTER TABLE {schema_of(op.get_context())}.analytics_findings DROP COLUMN tenant")
