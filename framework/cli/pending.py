"""`txbox outbox list` / `txbox inbox list`: what is pending, from the terminal.

One module for both commands (registered twice, as `check` serves `contracts`): the two
tables share their columns and states (framework/pending.py). Output looks like
`txbox dlq list` and is masked as dead letters are (framework/dead_letters/present.py).
"""

from __future__ import annotations

import argparse
import json
from datetime import UTC, datetime
from typing import Any

from framework import pending
from framework.cli.common import add_service_options, load_service
from framework.cli.output import clip, emit, table
from framework.dead_letters import queries
from framework.dead_letters.present import masked
from framework.settings import parse_duration
from framework.sql import pending as pending_sql


def duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age: give a duration like 90s, 10m, 2h or 7d") from None


def limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= pending_sql.MAX_LIMIT:
        raise argparse.ArgumentTypeError(f"{text!r}: the limit is a number from 1 to {pending_sql.MAX_LIMIT}")
    return value


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="action")
    p = sub.add_parser(
        "list", help=f"pending {name} rows: state, age, attempts, last error (masked); by priority, oldest first"
    )
    add_service_options(p)  # after the action too: `txbox inbox list --app ...`
    g = p.add_argument_group("filters")
    g.add_argument("--type", dest="message_type", help="message type, e.g. PlaceOrder")
    g.add_argument("--segment", help="ordering segment, e.g. order:o-1")
    g.add_argument("--state", choices=pending_sql.STATES, help="one state (default: every pending row)")
    g.add_argument(
        "--older-than", type=duration, metavar="AGE", help="written/stored at least this long ago: 10m, 2h, 7d"
    )
    p.add_argument(
        "--limit",
        type=limit,
        default=pending_sql.DEFAULT_LIMIT,
        help=f"rows at most (default {pending_sql.DEFAULT_LIMIT})",
    )
    p.add_argument(
        "--segment-policy",
        choices=("proceed", "park"),
        help="the worker's policy, which decides what is parked (TXBOX_WORKER_SEGMENT_POLICY)",
    )
    p.add_argument("--json", action="store_true", help="JSON lines, with payload, context and metadata (masked)")


def run(args: argparse.Namespace) -> int:
    from framework.worker.config import WorkerConfig

    service = load_service(args)
    policy = WorkerConfig.from_env(segment_policy=args.segment_policy).segment_policy
    filters = pending_sql.Filters(
        table=args.command,
        state=args.state,
        message_type=args.message_type,
        segment=args.segment,
        older_than=args.older_than,
        limit=args.limit,
        park=policy == "park",
    )
    schema = service.settings.schema
    with queries.connection(service.engine) as conn:
        rows = masked(pending.list_pending(conn, schema, filters))
        if args.json:
            for r in rows:
                emit(json.dumps(r, default=str, ensure_ascii=False))
            return 0
        summary = pending.counts(conn, schema, filters.table, park=filters.park)
    emit(
        table(
            [
                [
                    str(r["id"]),
                    age(r["age_seconds"]),
                    r["state"],
                    r["message_type"],
                    clip(r["segment"], 30),
                    str(r["started_attempts"]),
                    until(r["locked_until"]),
                    clip(r["last_error"], 60) or "-",
                ]
                for r in rows
            ],
            ["ID", "AGE", "STATE", "TYPE", "SEGMENT", "ATTEMPTS", "UNTIL", "LAST ERROR"],
        )
    )
    states = ", ".join(f"{n} {state}" for state, s in summary["states"].items() if (n := s["n"]))
    emit(
        f"({len(rows)} shown; {summary['pending']} pending in the {filters.table}" + (f": {states})" if states else ")")
    )
    return 0


def age(seconds: Any) -> str:
    """``95`` → ``1m35s``: two units at most, enough to compare rows at a glance."""
    left = max(0, int(seconds or 0))
    parts: list[str] = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if left >= size or (unit == "s" and not parts):
            parts.append(f"{left // size}{unit}")
            left %= size
    return "".join(parts[:2])


def until(value: datetime | None) -> str:
    """How long the lease, backoff or schedule still holds the row; '-' once it is over."""
    if value is None or value <= datetime.now(UTC):
        return "-"
    return "in " + age((value - datetime.now(UTC)).total_seconds())
