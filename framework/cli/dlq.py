"""`txbox dlq list / show / replay / discard`: the dead letters from the terminal."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import Any

from framework import jsoncodec
from framework.cli.common import add_service_options, load_service
from framework.cli.output import clip as _clip
from framework.cli.output import emit as _print
from framework.cli.output import table as _table
from framework.cli.output import utc as _fmt_time
from framework.dead_letters import queries, replay
from framework.dead_letters.present import masked
from framework.errors import ConfigurationError
from framework.permissions import MAX_TOKEN_CHARS
from framework.sql import dead_letters as dead_letters_sql


def when(text: str) -> datetime:
    try:
        return queries.parse_when(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _filters(parser: argparse.ArgumentParser, *, status: bool = True) -> None:
    g = parser.add_argument_group("filters")
    if status:
        g.add_argument("--status", choices=dead_letters_sql.STATUSES, default="open", help="default: open")
    g.add_argument("--source", choices=queries.SOURCES, help="where the message gave up")
    g.add_argument("--type", dest="message_type", help="message type, e.g. PlaceOrder")
    g.add_argument("--reason", help="reason code, e.g. max_attempts")
    g.add_argument("--fingerprint", help="failure group")
    g.add_argument("--message-id", help="one message id")
    g.add_argument("--since", type=when, help="died at or after: 2h, 1d or an ISO time")
    g.add_argument("--until", type=when, help="died before: 30m or an ISO time")


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    sub = parser.add_subparsers(dest="action", required=True, metavar="action")
    p = sub.add_parser("list", help="dead letters, newest first (--groups: by failure fingerprint)")
    _filters(p)
    p.add_argument("--groups", action="store_true", help="one line per fingerprint with counts")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--json", action="store_true", help="JSON lines")
    p = sub.add_parser("show", help="one dead letter in full (auth_token masked)")
    p.add_argument("id", type=int)
    p.add_argument("--json", action="store_true")
    for action, what in (("replay", "send back for processing"), ("discard", "close without replaying")):
        p = sub.add_parser(action, help=f"{what}: ids, or every open letter a filter selects")
        p.add_argument("ids", type=int, nargs="*", help="dead-letter ids")
        _filters(p, status=False)
        p.add_argument("--dry-run", action="store_true", help="show what would happen, change nothing")
        p.add_argument("--json", action="store_true")
        if action == "replay":
            p.add_argument(
                "--auth-token-file",
                metavar="PATH",
                help="file holding the auth_token to replay with ('-': read it from stdin); a letter keeps none",
            )


def _selected(args: argparse.Namespace, status: str = "open") -> dead_letters_sql.Filters:
    return dead_letters_sql.Filters(
        status=status,  # type: ignore[arg-type]
        source=args.source,
        message_type=args.message_type,
        reason=args.reason,
        fingerprint=args.fingerprint,
        message_id=args.message_id,
        since=args.since,
        until=args.until,
    )


def run(args: argparse.Namespace) -> int:
    service = load_service(args)
    schema = service.settings.schema
    token = _auth_token(getattr(args, "auth_token_file", None))  # read (and checked) before any change
    with queries.connection(service.engine) as conn:
        replay.resolve_replayed(conn, schema)
        if args.action == "list":
            return _list(conn, schema, args)
        if args.action == "show":
            return _show(conn, schema, args)
        ids = list(args.ids)
        filtered = any(
            getattr(args, k) is not None
            for k in ("source", "message_type", "reason", "fingerprint", "message_id", "since", "until")
        )
        if filtered:
            ids += dead_letters_sql.ids_matching(conn, schema, _selected(args))
        if not ids:
            raise ConfigurationError(f"txbox dlq {args.action}: give dead-letter ids or a filter (e.g. --fingerprint)")
        ids = sorted(set(ids))
        if args.action == "replay":
            outcomes = replay.replay(
                conn, schema, service.registry, service.name, ids, dry_run=args.dry_run, auth_token=token
            )
        else:
            outcomes = replay.discard(conn, schema, ids, dry_run=args.dry_run)
    if args.json:
        for o in outcomes:
            _print(json.dumps({**o.as_dict(), "dry_run": args.dry_run}))
    else:
        for o in outcomes:
            _print(f"{o.id}: {o.action}: {o.detail}")
        ok = sum(o.ok for o in outcomes)
        verb = "would " + args.action if args.dry_run else args.action + "ed"
        _print(f"{verb}: {ok} of {len(outcomes)}" + (" (dry run: nothing changed)" if args.dry_run else ""))
    return 0 if all(o.ok for o in outcomes) else 1


def _auth_token(path: str | None) -> str | None:
    """The operator's token from ``path`` (``-``: stdin), read bounded; never on the command line."""
    if path is None:
        return None
    limit = MAX_TOKEN_CHARS + 2  # the token and a line end: anything longer is refused unread
    if path == "-":
        return replay.operator_token(sys.stdin.read(limit + 1), "stdin (--auth-token-file -)")
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as exc:
        raise ConfigurationError(
            f"--auth-token-file {path}: cannot read it ({exc.strerror}): give a file holding the token"
        ) from None
    return replay.operator_token(data.decode("utf-8", errors="replace"), f"--auth-token-file {path}")


def _list(conn: Any, schema: str, args: argparse.Namespace) -> int:
    filters = _selected(args, args.status)
    if args.groups:
        rows = masked(dead_letters_sql.groups(conn, schema, filters, limit=args.limit))
        if args.json:
            for r in rows:
                _print(json.dumps(r, default=str))
            return 0
        _print(
            _table(
                [
                    [
                        str(r["count"]),
                        r["fingerprint"],
                        r["message_type"] or "-",
                        r["reason"],
                        _fmt_time(r["last_died_at"]),
                        _clip(r["error"], 70),
                    ]
                    for r in rows
                ],
                ["COUNT", "FINGERPRINT", "TYPE", "REASON", "LAST DIED (UTC)", "ERROR (latest)"],
            )
        )
        return 0
    rows = masked(dead_letters_sql.list_letters(conn, schema, filters, limit=args.limit, offset=args.offset))
    if args.json:
        for r in rows:
            _print(json.dumps(r, default=str))
        return 0
    total = dead_letters_sql.count_letters(conn, schema, filters)
    _print(
        _table(
            [
                [
                    str(r["id"]),
                    _fmt_time(r["died_at"]),
                    r["source"],
                    r["reason"],
                    r["message_type"] or "-",
                    r["status"],
                    _clip(r["error"], 60),
                ]
                for r in rows
            ],
            ["ID", "DIED (UTC)", "SOURCE", "REASON", "TYPE", "STATUS", "ERROR"],
        )
    )
    _print(f"({len(rows)} of {total} {filters.status} dead letters)")
    return 0


def _show(conn: Any, schema: str, args: argparse.Namespace) -> int:
    row = dead_letters_sql.get_letter(conn, schema, args.id)
    if row is None:
        raise ConfigurationError(f"no dead letter with id {args.id}")
    row = masked(row)
    if args.json:
        _print(jsoncodec.pretty(row, ensure_ascii=True))
        return 0
    for key in ("id", "status", "message_id", "message_type", "source", "reason", "fingerprint", "routing_key"):
        _print(f"{key:13} {row[key] if row[key] is not None else '-'}")
    for key in ("died_at", "replayed_at", "resolved_at", "discarded_at"):
        _print(f"{key:13} {_fmt_time(row[key])}")
    _print(f"{'replay_count':13} {row['replay_count']}")
    _print("\nerror:")
    for line in (row["error"] or "-").splitlines():
        _print(f"  {line}")
    if row["message"] is not None:
        _print("\nmessage:\n" + jsoncodec.pretty(row["message"]))
    else:
        _print(f"\nraw body ({row['raw_encoding']}):\n{row['raw_body']}")
    _print("\nheaders:\n" + jsoncodec.pretty(row["headers"], ensure_ascii=True))
    _print("\nattempts:\n" + jsoncodec.pretty(row["attempts"], ensure_ascii=True))
    if row["current"]:
        _print("\ncurrent row:\n" + jsoncodec.pretty(row["current"], ensure_ascii=True))
    return 0
