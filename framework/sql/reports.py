"""Reads of the report tables ``txbox analyze`` writes (``analytics_*``, migration 0005).

A run's ``analytics_runs`` row is written last (framework/analytics/report.py), so a
reader that picks its run from there never sees half a run.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

LATENCY_ROWS = 10_000  # a run writes one row per publisher, message type and stage: never near this


def analytics(
    conn: psycopg.Connection[Any], schema: str, service: str, *, covering: bool = False
) -> dict[str, Any] | None:
    """The latest ``txbox analyze`` run's reconciliation and latency rows (per publisher,
    message type and stage), when its report tables are in this database (migration 0005
    and a finished run); None otherwise. ``covering``: only a run whose sources include
    ``service`` (a report database shared by services)."""
    found = conn.execute("SELECT to_regclass(%(t)s) IS NOT NULL AS ok", {"t": f"{schema}.analytics_runs"}).fetchone()
    if not found or not found["ok"]:
        return None
    run = conn.execute(
        sql.SQL(
            "SELECT run_id, run_at, finished_at, lost, stuck, in_flight, abandoned, unexpected, redelivered "
            "FROM {t} WHERE NOT %(covering)s OR %(service)s = ANY(string_to_array(sources, ',')) "
            "ORDER BY run_at DESC LIMIT 1"
        ).format(t=sql.Identifier(schema, "analytics_runs")),
        {"covering": covering, "service": service},
    ).fetchone()
    if run is None:
        return None
    latency = conn.execute(
        sql.SQL(
            """SELECT stage, message_type, samples, p50_ms, p90_ms, p99_ms, max_ms, mean_ms FROM {t}
               WHERE run_id = %(run)s AND (service = %(service)s OR service IS NULL)
               ORDER BY stage, message_type LIMIT %(most)s"""
        ).format(t=sql.Identifier(schema, "analytics_latency")),
        {"run": run["run_id"], "service": service, "most": LATENCY_ROWS},
    ).fetchall()
    return {"run": dict(run), "latency": [dict(r) for r in latency]}
