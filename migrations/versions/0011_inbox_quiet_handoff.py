"""The inbox's insert NOTIFY can be left out by the transaction that inserts.

`txbox run` hands the rows its receiver stores straight to its own worker: the batch's
INSERT and a claim of the same rows travel in one round trip and one transaction
(docs/explanation/daemons.md, "The hand-off in one process"). A NOTIFY for those rows would
only wake the service's listener for a claim that finds them taken. So the trigger
function now notifies unless the transaction set ``txbox.notify`` to ``off``
(``set_config('txbox.notify', 'off', true)``, local to that transaction); every other
insert notifies as before.

Locks: ``CREATE OR REPLACE FUNCTION`` takes no lock on the table; inserts running meanwhile
use the old body or the new one, both of which notify. Daemons of the code before never
set the setting; daemons of this code on a schema without this migration hand off as
well, and the listener's claim after the NOTIFY then finds nothing new (one statement).

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op

from framework import names
from framework.migrate import schema_of

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"""CREATE OR REPLACE FUNCTION {s}.notify_inbox_insert() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF current_setting('{names.QUIET_NOTIFY_SETTING}', true) IS DISTINCT FROM 'off' THEN
                PERFORM pg_notify('{names.notify_channel(s, names.INBOX)}', '');
            END IF;
            RETURN NULL;
        END $$"""
    )


def downgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"""CREATE OR REPLACE FUNCTION {s}.notify_inbox_insert() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_notify('{names.notify_channel(s, names.INBOX)}', ''); RETURN NULL; END $$"""
    )
