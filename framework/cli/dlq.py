"""`txbox dlq list / show / replay / discard`: the dead letters from the terminal.

With a tenant registry, a command names where it works: ``--tenant KEY`` (one tenant's
database and schema), ``--all-tenants`` (`list` only: every tenant, its key in each row),
or ``--database-url`` (that database, as without a registry). Replay and discard act on
one tenant at a time (docs/how-to/tenants.md, "Dead letters per tenant").
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

from framework import jsoncodec
from framework.cli.common import (
    add_service_options,
    add_tenant_options,
    load_service,
    load_tenants,
    tenant_settings,
)
from framework.cli.output import clip as _clip
from framework.cli.output import emit as _print
from framework.cli.output import table as _table
from framework.cli.output import utc as _fmt_time
from framework.dead_letters import queries, replay
from framework.dead_letters.present import masked
from framework.errors import ConfigurationError, DatabaseUnavailable
from framework.permissions import MAX_TOKEN_CHARS
from framework.sql import dead_letters as dead_letters_sql

if TYPE_CHECKING:
    from framework.service import Service
    from framework.tenants import Tenant

LISTING = ("list",)
"""The subcommands that may read every tenant at once (``--all-tenants``)."""


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


def _where(parser: argparse.ArgumentParser, action: str) -> None:
    """``--tenant`` on every subcommand, ``--all-tenants`` shown on the listing ones (the
    others take it only to refuse it with the reason, rather than argparse's usage)."""
    g = parser.add_argument_group("tenant (with a registry: TXBOX_TENANTS_FILE or TXBOX_TENANTS_DATABASE_URL)")
    g.add_argument("--tenant", metavar="KEY", help="the tenant whose dead letters these are")
    g.add_argument(
        "--all-tenants",
        action="store_true",
        help="every tenant of the registry, its key in each row" if action in LISTING else argparse.SUPPRESS,
    )


def configure(parser: argparse.ArgumentParser, name: str) -> None:
    add_service_options(parser)
    add_tenant_options(parser, pick=False)
    sub = parser.add_subparsers(dest="action", required=True, metavar="action")
    p = sub.add_parser("list", help="dead letters, newest first (--groups: by failure fingerprint)")
    _where(p, "list")
    _filters(p)
    p.add_argument("--groups", action="store_true", help="one line per fingerprint with counts")
    p.add_argument("--limit", type=int, default=50)
    p.add_argument("--offset", type=int, default=0)
    p.add_argument("--json", action="store_true", help="JSON lines")
    p = sub.add_parser("show", help="one dead letter in full (auth_token masked)")
    _where(p, "show")
    p.add_argument("id", type=int)
    p.add_argument("--json", action="store_true")
    for action, what in (("replay", "send back for processing"), ("discard", "close without replaying")):
        p = sub.add_parser(action, help=f"{what}: ids, or every open letter a filter selects")
        _where(p, action)
        p.add_argument("ids", type=int, nargs="*", help="dead-letter ids")
        _filters(p, status=False)
        p.add_argument("--dry-run", action="store_true", help="show what would happen, change nothing")
        p.add_argument("--json", action="store_true")
        if action == "replay":
            p.add_argument(
                "--into-tenant",
                metavar="KEY",
                help="letters of the service's own database (deliveries that named no tenant: unknown_tenant): "
                "copy each into tenant KEY's dead letters and replay it there",
            )
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
    token = _auth_token(getattr(args, "auth_token_file", None))  # read (and checked) before any change
    if getattr(args, "into_tenant", None) is not None:
        return _replay_into_tenant(args, token)
    chosen = _tenants_of(args)
    if chosen is None:
        service = load_service(args)
        with queries.connection(service.engine) as conn:
            return _on(conn, service, service.settings.schema, args, token, None)
    service = load_service(args, database=False)  # each tenant names its own database
    if args.all_tenants:
        return _list_all(service, chosen, args)
    from framework.tenants.runs import engine_for

    (tenant,) = chosen
    engine = engine_for(tenant.database_url)
    try:
        with queries.connection(engine) as conn:
            return _on(conn, service, tenant.schema, args, token, tenant.key)
    except DatabaseUnavailable as exc:
        raise DatabaseUnavailable(f"tenant {tenant.key} ({tenant.display_url} schema {tenant.schema}): {exc}") from None
    finally:
        engine.dispose()


def _tenants_of(args: argparse.Namespace) -> list[Tenant] | None:
    """Where the command works: None for one database as without a registry (none is
    configured, or ``--database-url`` names it), else the tenants it names. A registry
    without a choice is an error listing the tenants: reading the service's default
    database instead would show no tenant's letters, or the wrong one's."""
    settings = tenant_settings(args)  # --tenant / --all-tenants without a registry: the fix
    if not settings.configured:
        return None
    if args.tenant is not None and args.all_tenants:
        raise ConfigurationError(f"txbox dlq {args.action}: give --tenant KEY or --all-tenants, not both")
    if args.all_tenants and args.action not in LISTING:
        raise ConfigurationError(
            f"txbox dlq {args.action} acts on one tenant at a time, never on all of them: name it with --tenant KEY"
        )
    if args.tenant is None and not args.all_tenants and args.database_url is not None:
        return None  # the operator named the database: that one, as it is
    registry = load_tenants(args, settings)
    if args.tenant is not None:
        return [registry.tenant(args.tenant)]
    if args.all_tenants:
        return list(registry)
    choices = "--tenant KEY or --all-tenants" if args.action in LISTING else "--tenant KEY (one tenant at a time)"
    raise ConfigurationError(
        f"txbox dlq {args.action}: {registry.source} lists the tenants: name where with {choices}, or give "
        f"--database-url for one database as it is. Its tenants: {registry.listed()}"
    )


def _replay_into_tenant(args: argparse.Namespace, token: str | None) -> int:
    """``replay --into-tenant KEY``: letters of the service's own database (``TXBOX_DATABASE_URL``
    or ``--database-url``) replayed into tenant KEY (docs/how-to/tenants.md, "Dead letters per tenant")."""
    if args.tenant is not None or args.all_tenants:
        raise ConfigurationError(
            "txbox dlq replay --into-tenant replays letters of the service's own database into a tenant: "
            "leave out --tenant / --all-tenants (the letters of a tenant are replayed with --tenant KEY alone)"
        )
    settings = tenant_settings(args)
    if not settings.configured:
        raise ConfigurationError(
            "--into-tenant needs a tenant registry: set TXBOX_TENANTS_FILE (or --tenants-file) or "
            "TXBOX_TENANTS_DATABASE_URL. Example: TXBOX_TENANTS_FILE=tenants.toml"
        )
    tenants = load_tenants(args, settings)
    tenant = tenants.tenant(args.into_tenant)
    service = load_service(args)
    if (tenant.database_url, tenant.schema) == (service.settings.database_url, service.settings.schema):
        raise ConfigurationError(
            f"tenant {tenant.key}'s tables are the service's own ({tenant.display_url} schema {tenant.schema}): "
            f"its letters are replayed where they are: txbox dlq replay ID --tenant {tenant.key}"
        )
    from framework.tenants.runs import engine_for

    engine = engine_for(tenant.database_url)
    try:
        with queries.connection(service.engine) as source:
            replay.resolve_replayed(source, service.settings.schema)
            ids = _ids(source, service.settings.schema, args)
            try:
                with queries.connection(engine) as target:
                    outcomes = replay.replay_into_tenant(
                        source,
                        service.settings.schema,
                        target,
                        service.registry,
                        service.name,
                        ids,
                        tenant=tenant,
                        tenants=tenants,
                        dry_run=args.dry_run,
                        auth_token=token,
                    )
            except DatabaseUnavailable as exc:
                raise DatabaseUnavailable(
                    f"tenant {tenant.key} ({tenant.display_url} schema {tenant.schema}): {exc}"
                ) from None
    finally:
        engine.dispose()
    return _report(outcomes, args, None)


def _ids(conn: Any, schema: str, args: argparse.Namespace) -> list[int]:
    """The letters ``replay`` or ``discard`` acts on: the ids given and those the filters select."""
    ids = list(args.ids)
    filtered = any(
        getattr(args, k) is not None
        for k in ("source", "message_type", "reason", "fingerprint", "message_id", "since", "until")
    )
    if filtered:
        ids += dead_letters_sql.ids_matching(conn, schema, _selected(args))
    if not ids:
        raise ConfigurationError(f"txbox dlq {args.action}: give dead-letter ids or a filter (e.g. --fingerprint)")
    return sorted(set(ids))


def _on(
    conn: Any, service: Service, schema: str, args: argparse.Namespace, token: str | None, tenant: str | None
) -> int:
    """The subcommand on one database (``tenant``: its key, shown with each row, or None)."""
    replay.resolve_replayed(conn, schema)
    if args.action == "list":
        return _list(conn, schema, args, tenant)
    if args.action == "show":
        return _show(conn, schema, args, tenant)
    ids = _ids(conn, schema, args)
    if args.action == "replay":
        outcomes = replay.replay(
            conn, schema, service.registry, service.name, ids, dry_run=args.dry_run, auth_token=token
        )
    else:
        outcomes = replay.discard(conn, schema, ids, dry_run=args.dry_run)
    return _report(outcomes, args, tenant)


def _report(outcomes: list[replay.Outcome], args: argparse.Namespace, tenant: str | None) -> int:
    """Print what ``replay`` or ``discard`` did, a line each and a total; 0 when every one went."""
    of_tenant = {} if tenant is None else {"tenant": tenant}
    if args.json:
        for o in outcomes:
            _print(json.dumps({**of_tenant, **o.as_dict(), "dry_run": args.dry_run}))
    else:
        for o in outcomes:
            _print(f"{o.id}: {o.action}: {o.detail}")
        ok = sum(o.ok for o in outcomes)
        verb = "would " + args.action if args.dry_run else args.action + "ed"
        where = "" if tenant is None else f" of tenant {tenant}"
        _print(f"{verb}: {ok} of {len(outcomes)}{where}" + (" (dry run: nothing changed)" if args.dry_run else ""))
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


def _fetch(conn: Any, schema: str, args: argparse.Namespace, *, all_tenants: bool) -> tuple[list[dict[str, Any]], int]:
    """The rows `list` shows and how many match (0 when not needed). Over all tenants,
    each tenant's first ``offset + limit``: the page is cut once they are merged."""
    filters = _selected(args, args.status)
    if args.groups:
        return masked(dead_letters_sql.groups(conn, schema, filters, limit=args.limit)), 0
    limit, offset = (args.offset + args.limit, 0) if all_tenants else (args.limit, args.offset)
    rows = masked(dead_letters_sql.list_letters(conn, schema, filters, limit=limit, offset=offset))
    total = 0 if args.json else dead_letters_sql.count_letters(conn, schema, filters)
    return rows, total


def _list(conn: Any, schema: str, args: argparse.Namespace, tenant: str | None) -> int:
    rows, total = _fetch(conn, schema, args, all_tenants=False)
    if tenant is not None:
        rows = [{"tenant": tenant, **r} for r in rows]
    _show_rows(rows, total, args, tenants=tenant is not None, where="" if tenant is None else f" of tenant {tenant}")
    return 0


def _list_all(service: Service, tenants: list[Tenant], args: argparse.Namespace) -> int:
    """`list --all-tenants`: every tenant read, ``TXBOX_TENANTS_JOBS`` at a time; the rows
    merged (newest first; groups by count) with the tenant's key in each; a tenant whose
    database fails is a line on stderr, and the exit code 1."""
    from framework.tenants.reads import read_each

    def read(tenant: Tenant, engine: Any) -> tuple[list[dict[str, Any]], int]:
        with queries.connection(engine) as conn:
            replay.resolve_replayed(conn, tenant.schema)
            return _fetch(conn, tenant.schema, args, all_tenants=True)

    reads = read_each(tenants, read, jobs=tenant_settings(args).tenants_jobs)
    rows: list[dict[str, Any]] = []
    total = 0
    for r in reads:
        if r.value is not None:
            rows += [{"tenant": r.tenant.key, **row} for row in r.value[0]]
            total += r.value[1]
    if args.groups:
        rows.sort(key=lambda g: (-g["count"], g["tenant"]))
        rows = rows[: args.limit]
    else:
        rows.sort(key=lambda x: (x["died_at"], x["tenant"], x["id"]), reverse=True)
        rows = rows[args.offset : args.offset + args.limit]
    failed = [r.failure for r in reads if r.failure is not None]
    _show_rows(rows, total, args, tenants=True, where=f" in {len(reads) - len(failed)} of {len(reads)} tenants")
    for failure in failed:
        print(failure, file=sys.stderr, flush=True)
    return 1 if failed else 0


def _show_rows(rows: list[dict[str, Any]], total: int, args: argparse.Namespace, *, tenants: bool, where: str) -> None:
    """`list`'s output: JSON lines, or a table (a TENANT column when ``tenants``) and a count."""
    if args.json:
        for r in rows:
            _print(json.dumps(r, default=str))
        return
    head = ["TENANT"] if tenants else []

    def first(r: dict[str, Any]) -> list[str]:
        return [r["tenant"]] if tenants else []

    if args.groups:
        cells = [
            [
                *first(r),
                str(r["count"]),
                r["fingerprint"],
                r["message_type"] or "-",
                r["reason"],
                _fmt_time(r["last_died_at"]),
                _clip(r["error"], 70),
            ]
            for r in rows
        ]
        _print(_table(cells, [*head, "COUNT", "FINGERPRINT", "TYPE", "REASON", "LAST DIED (UTC)", "ERROR (latest)"]))
        return
    cells = [
        [
            *first(r),
            str(r["id"]),
            _fmt_time(r["died_at"]),
            r["source"],
            r["reason"],
            r["message_type"] or "-",
            r["status"],
            _clip(r["error"], 60),
        ]
        for r in rows
    ]
    _print(_table(cells, [*head, "ID", "DIED (UTC)", "SOURCE", "REASON", "TYPE", "STATUS", "ERROR"]))
    _print(f"({len(rows)} of {total} {args.status} dead letters{where})")


def _show(conn: Any, schema: str, args: argparse.Namespace, tenant: str | None) -> int:
    row = dead_letters_sql.get_letter(conn, schema, args.id)
    if row is None:
        raise ConfigurationError(
            f"no dead letter with id {args.id}" + ("" if tenant is None else f" in tenant {tenant}")
        )
    row = masked(row)
    if args.json:
        _print(jsoncodec.pretty(row if tenant is None else {"tenant": tenant, **row}, ensure_ascii=True))
        return 0
    if tenant is not None:
        _print(f"{'tenant':13} {tenant}")
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
