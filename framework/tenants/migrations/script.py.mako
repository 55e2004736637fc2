"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = ${repr(up_revision)}
down_revision = ${repr(down_revision)}
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    ${upgrades if upgrades else "pass"}


def downgrade() -> None:
    s = schema_of(op.get_context())
    ${downgrades if downgrades else "pass"}
