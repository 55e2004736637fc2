"""Report tables written by the Spark job (`txbox analyze`).

Every table carries ``run_id`` and ``run_at``; ``analytics_runs`` gets its row last, so
a reader that joins on it never sees a half-written run. Columns are documented in
framework/analytics/__init__.py. The DDL is spelled out here (not generated from
framework/tables.py) so this revision stays what it was when later ones change the
metadata; the drift test keeps the two in step.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22
"""

from __future__ import annotations

from alembic import op

from framework.migrate import schema_of

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

RUN = "run_id text NOT NULL, run_at timestamptz NOT NULL"

TABLES = {
    "analytics_findings": """kind text, service text, publisher text, message_type text, message_id text,
        state text, reason text, fingerprint text, since timestamptz, age_seconds double precision,
        count integer, detail text""",
    "analytics_latency": """service text, publisher text, message_type text, stage text, samples bigint,
        p50_ms double precision, p90_ms double precision, p99_ms double precision,
        max_ms double precision, mean_ms double precision""",
    "analytics_throughput": "service text, message_type text, event text, minute timestamptz, messages bigint",
    "analytics_attempts": "service text, side text, message_type text, attempts integer, messages bigint",
    "analytics_message_types": """service text, side text, message_type text, total bigint, processed bigint,
        abandoned bigint, pending bigint, attempts bigint, failed_attempts bigint,
        failure_rate double precision, abandon_rate double precision""",
    "analytics_fingerprints": """service text, source text, reason text, fingerprint text, message_type text,
        dead_letters bigint, open bigint, first_died_at timestamptz, last_died_at timestamptz,
        sample_error text, message_ids text""",
    "analytics_dead_letter_trend": "service text, reason text, hour timestamptz, dead_letters bigint",
}


def upgrade() -> None:
    s = schema_of(op.get_context())
    op.execute(
        f"""CREATE TABLE {s}.analytics_runs (
            run_id text PRIMARY KEY,
            run_at timestamptz NOT NULL,
            finished_at timestamptz NOT NULL,
            sources text NOT NULL,
            window_start timestamptz,
            grace_seconds double precision NOT NULL,
            sla_seconds double precision NOT NULL,
            outbox_rows bigint NOT NULL,
            inbox_rows bigint NOT NULL,
            lost integer NOT NULL,
            in_flight integer NOT NULL,
            stuck integer NOT NULL,
            abandoned integer NOT NULL,
            unexpected integer NOT NULL,
            redelivered integer NOT NULL,
            notes text)"""
    )
    op.execute(f"COMMENT ON TABLE {s}.analytics_runs IS 'One row per completed `txbox analyze` run; written last.'")
    for table, columns in TABLES.items():
        op.execute(f"CREATE TABLE {s}.{table} ({RUN}, {columns})")
        op.execute(f"CREATE INDEX {table}_run_idx ON {s}.{table} (run_id)")
        op.execute(f"COMMENT ON TABLE {s}.{table} IS 'Written by `txbox analyze`; see framework/analytics.'")


def downgrade() -> None:
    s = schema_of(op.get_context())
    for table in reversed(TABLES):
        op.execute(f"DROP TABLE {s}.{table}")
    op.execute(f"DROP TABLE {s}.analytics_runs")
