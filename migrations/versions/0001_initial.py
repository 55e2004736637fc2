"""Outbox, inbox, redelivery counter, dead letters, partial indexes and NOTIFY triggers.

Revision ID: 0001
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

MESSAGE_COLUMNS = """
    id uuid PRIMARY KEY,
    message_type text NOT NULL,
    aggregate_type text NOT NULL,
    aggregate_id text NOT NULL,
    message_version text NOT NULL DEFAULT '1.0',
    kind text NOT NULL CONSTRAINT {t}_kind_check CHECK (kind IN ('command', 'event')),
    routing_key text NOT NULL,
    payload jsonb NOT NULL,
    message_context jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    metadata jsonb NOT NULL DEFAULT '{{}}'::jsonb,
    segment text NOT NULL,
    concurrency text NOT NULL DEFAULT 'sequential'
        CONSTRAINT {t}_concurrency_check CHECK (concurrency IN ('sequential', 'parallel')),
    priority smallint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    locked_until timestamptz NOT NULL DEFAULT clock_timestamp(),
    started_attempts smallint NOT NULL DEFAULT 0,
    finished_attempts smallint NOT NULL DEFAULT 0,
    processed_at timestamptz,
    abandoned_at timestamptz,
    last_error text"""

PENDING = "WHERE processed_at IS NULL AND abandoned_at IS NULL"


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(f"CREATE TABLE {s}.outbox ({MESSAGE_COLUMNS.format(t='outbox')})")
    op.execute(
        f"""CREATE TABLE {s}.inbox ({MESSAGE_COLUMNS.format(t="inbox")},
            message_timestamp timestamptz NOT NULL,
            received_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            queue text NOT NULL,
            redelivered boolean NOT NULL DEFAULT false)"""
    )
    for t in ("outbox", "inbox"):
        op.execute(f"CREATE INDEX {t}_due_idx ON {s}.{t} (priority DESC, created_at) {PENDING}")
        op.execute(f"CREATE INDEX {t}_segment_idx ON {s}.{t} (segment, created_at) {PENDING}")
        op.execute(f"CREATE INDEX {t}_created_at_idx ON {s}.{t} (created_at)")
        # Statement-level, empty payload: PostgreSQL folds identical notifications of
        # one transaction into one, so a batch insert wakes listeners once.
        op.execute(
            f"""CREATE FUNCTION {s}.notify_{t}_insert() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_notify('{s}_{t}_insert', ''); RETURN NULL; END $$"""
        )
        op.execute(
            f"""CREATE TRIGGER {t}_notify AFTER INSERT ON {s}.{t}
            FOR EACH STATEMENT EXECUTE FUNCTION {s}.notify_{t}_insert()"""
        )
    op.execute(
        f"""CREATE TABLE {s}.redeliveries (
            queue text NOT NULL,
            message_id text NOT NULL,
            count integer NOT NULL DEFAULT 1,
            first_seen timestamptz NOT NULL DEFAULT clock_timestamp(),
            last_seen timestamptz NOT NULL DEFAULT clock_timestamp(),
            PRIMARY KEY (queue, message_id))"""
    )
    op.execute(
        f"""CREATE TABLE {s}.dead_letters (
            id bigserial PRIMARY KEY,
            message_id uuid,
            source text NOT NULL CONSTRAINT dead_letters_source_check
                CHECK (source IN ('broker', 'inbox', 'outbox')),
            reason text NOT NULL,
            error text,
            fingerprint text NOT NULL,
            message_type text,
            routing_key text,
            message jsonb,
            raw_body text,
            raw_encoding text CONSTRAINT dead_letters_raw_encoding_check
                CHECK (raw_encoding IN ('utf-8', 'base64')),
            headers jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            attempts jsonb NOT NULL DEFAULT '{{}}'::jsonb,
            died_at timestamptz NOT NULL DEFAULT clock_timestamp(),
            replayed_at timestamptz,
            replay_count integer NOT NULL DEFAULT 0,
            resolved_at timestamptz,
            discarded_at timestamptz)"""
    )
    op.execute(f"CREATE INDEX dead_letters_message_id_idx ON {s}.dead_letters (message_id)")
    op.execute(f"CREATE INDEX dead_letters_fingerprint_idx ON {s}.dead_letters (fingerprint, died_at DESC)")
    op.execute(f"CREATE INDEX dead_letters_died_at_idx ON {s}.dead_letters (died_at DESC)")
    op.execute(
        f"""CREATE INDEX dead_letters_open_idx ON {s}.dead_letters (died_at DESC)
            WHERE replayed_at IS NULL AND discarded_at IS NULL"""
    )
    for t, what in (
        ("outbox", "Transactional outbox: messages written with business data, relayed by the publisher."),
        ("inbox", "Transactional inbox: deliveries stored once by message id, processed by the worker."),
        ("redeliveries", "Redelivery counter of seed 003: survives a receiver that crashes on a delivery."),
        ("dead_letters", "Every message that gave up anywhere, one row each, written where it was abandoned."),
    ):
        op.execute(f"COMMENT ON TABLE {s}.{t} IS '{what}'")


def downgrade() -> None:
    s = schema_of(op.get_context())
    for t in ("dead_letters", "redeliveries", "inbox", "outbox"):
        op.execute(f"DROP TABLE {s}.{t}")
    for t in ("outbox", "inbox"):
        op.execute(f"DROP FUNCTION {s}.notify_{t}_insert()")
