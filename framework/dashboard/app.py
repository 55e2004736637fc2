"""The dashboard's Starlette application: pages, the JSON API that mirrors them, security.

Endpoints are plain (sync) functions: Starlette runs them in its thread pool, each
borrowing a pooled psycopg connection of the source's engine. Every filter reaches SQL
as a bound parameter (framework/sql/); every value reaches HTML through Jinja2's
autoescaping; secrets are masked before they reach a template or the JSON API
(framework.redaction). GET requests only read: the resolve sweep is the collector's,
and the confirmation pages preview from reads, not from a rolled-back dry run.
Who may do what, and the protections around every request: framework.dashboard.security.
"""

from __future__ import annotations

import hmac
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
import markupsafe
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from framework import jsoncodec
from framework.contracts import Registry, load_registry
from framework.dashboard import charts, latency
from framework.dashboard.security import (
    COOKIE,
    LOGIN_COOKIE,
    LOOPBACK_HOSTS,
    MIN_TOKEN_LENGTH,
    SECURITY_HEADERS,
    Auth,
    Shield,
    client_of,
)
from framework.dead_letters import queries, replay
from framework.dead_letters.present import masked
from framework.errors import ConfigurationError, HttpError, TxboxError
from framework.redaction import credentials_masked, mask_credentials, redact_text
from framework.settings import Seconds, setting
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import heartbeats as heartbeats_sql
from framework.sql import reports as reports_sql
from framework.tenants.follow import RegistryFollower
from framework.tenants.model import Registry as TenantRegistry

HERE = Path(__file__).parent
PAGE_SIZE = 50
CHOICES_TTL = 60.0
ACTIONS = ("replay", "discard")
# Where an operator gives the auth_token to replay with (a letter keeps none): the confirm
# form's field, or the JSON API's header. Empty or absent: replayed without one.
REPLAY_TOKEN_FIELD = "auth_token"
REPLAY_TOKEN_HEADER = "X-Txbox-Replay-Auth-Token"


def operator_token(value: Any, where: str) -> str | None:
    """The operator's replay token from a form field or header (None when empty); 400 when malformed."""
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        return replay.operator_token(value, where)
    except TxboxError as exc:
        raise HttpError(400, str(exc)) from None


@dataclass(frozen=True, kw_only=True)
class DashboardSettings:
    """`txbox dashboard`: where it listens and who may replay or discard."""

    token: str | None = setting(
        "TXBOX_DASHBOARD_TOKEN",
        "0b5c9e1f4a7d2c8e6b3f9a1d",
        default=None,
        help=f"secret (at least {MIN_TOKEN_LENGTH} characters) for viewing, replay and discard; "
        "unset: read-only dashboard on loopback only",
    )
    view_requires_token: bool | None = setting(
        "TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN",
        "true",
        default=None,
        help="require the token to view pages and /api/* (default: true when a token is set)",
    )
    host: str = setting("TXBOX_DASHBOARD_HOST", "127.0.0.1", default="127.0.0.1", help="address to bind")
    port: int = setting("TXBOX_DASHBOARD_PORT", "8470", default=8470, help="port to bind")
    allowed_hosts: str = setting(
        "TXBOX_DASHBOARD_ALLOWED_HOSTS",
        "dlq.example.com,10.0.0.5",
        default="",
        help="Host header names accepted besides loopback and --host (comma-separated; '*' for any)",
    )
    secure_cookies: bool = setting(
        "TXBOX_DASHBOARD_SECURE_COOKIES",
        "true",
        default=False,
        help="mark cookies Secure (automatic when the request came over TLS)",
    )
    session_ttl: Seconds = setting(
        "TXBOX_DASHBOARD_SESSION_TTL", "8h", default=Seconds(8 * 3600), help="a login session expires after this"
    )
    max_body_bytes: int = setting(
        "TXBOX_DASHBOARD_MAX_BODY_BYTES", "65536", default=65536, help="larger request bodies are refused (413)"
    )
    max_connections: int = setting(
        "TXBOX_DASHBOARD_MAX_CONNECTIONS", "64", default=64, help="concurrent connections; more get 503"
    )
    header_timeout: Seconds = setting(
        "TXBOX_DASHBOARD_HEADER_TIMEOUT",
        "10s",
        default=Seconds(10),
        help="a connection must send a request's headers within this",
    )

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token) < MIN_TOKEN_LENGTH:
            raise ConfigurationError(
                f"TXBOX_DASHBOARD_TOKEN is {len(self.token)} characters: it must have at least {MIN_TOKEN_LENGTH}. "
                "Example: TXBOX_DASHBOARD_TOKEN=$(openssl rand -hex 24)"
            )
        if self.view_requires_token and not self.token:
            raise ConfigurationError(
                "TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN=true needs TXBOX_DASHBOARD_TOKEN. "
                "Example: TXBOX_DASHBOARD_TOKEN=$(openssl rand -hex 24)"
            )
        if not self.token and self.host not in LOOPBACK_HOSTS:
            raise ConfigurationError(
                f"TXBOX_DASHBOARD_HOST={self.host}: without TXBOX_DASHBOARD_TOKEN the dashboard binds loopback only "
                "(anyone who reaches it could read every message). Set a token, e.g. "
                "TXBOX_DASHBOARD_TOKEN=$(openssl rand -hex 24), or bind TXBOX_DASHBOARD_HOST=127.0.0.1"
            )
        for name in ("max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"TXBOX_DASHBOARD_{name.upper()} must be at least 1")
        if self.session_ttl <= 0 or self.header_timeout <= 0:
            raise ConfigurationError(
                "TXBOX_DASHBOARD_SESSION_TTL and TXBOX_DASHBOARD_HEADER_TIMEOUT must be positive durations, "
                "e.g. 8h, 10s"
            )

    @property
    def views_need_token(self) -> bool:
        return bool(self.token) if self.view_requires_token is None else self.view_requires_token

    @property
    def hosts(self) -> list[str]:
        """Host header names the dashboard answers (anything else: 400, against DNS rebinding)."""
        extra = [h.strip() for h in self.allowed_hosts.split(",") if h.strip()]
        bound = [] if self.host in ("0.0.0.0", "::", "") else [self.host]
        return [*LOOPBACK_HOSTS, *bound, *extra]


class Source:
    """One service's database the dashboard shows (and replays into)."""

    def __init__(self, name: str, database_url: str, *, schema: str, contracts_dir: Path) -> None:
        self.name = name
        self.database_url = database_url
        self.schema = schema
        self.contracts_dir = contracts_dir

    @cached_property
    def engine(self) -> Engine:
        from framework.db import create_engine

        return create_engine(self.database_url, pool_size=4, max_overflow=4, pool_timeout=5)

    @cached_property
    def registry(self) -> Registry:
        return load_registry(self.contracts_dir)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _bucket(seconds: int) -> str:
    return f"{seconds // 3600} h" if seconds >= 3600 else f"{seconds // 60} min"


def shown(value: Any) -> Any:
    """Every value a page prints, on its way out: credentials of URLs and DSNs masked
    (docs/explanation/operations.md, "Secrets"). The rows were masked when read; this also covers
    what is not a row (a filter's choices, an error's text, whatever a page adds later).
    Markup is the page's own (charts drawn from numbers): it passes as it is."""
    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return mask_credentials(value)
    return value


class MaskedJSON(JSONResponse):
    """Every answer of the JSON API: its strings, keys too, through :func:`shown`'s masker."""

    def render(self, content: Any) -> bytes:
        return super().render(credentials_masked(content))


def _time(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def create_app(
    sources: Sequence[Source],
    settings: DashboardSettings | None = None,
    *,
    tenants: TenantRegistry | RegistryFollower | None = None,
) -> Starlette:
    """The dashboard over ``sources``; with ``tenants``, over each tenant's database and
    schema instead, the tenant chosen by ``?tenant=KEY`` (framework/dashboard/tenants_view.py):
    a registry as it is, or a follower's snapshot in force at each request."""
    if not sources:
        raise ConfigurationError("the dashboard needs at least one source (TXBOX_* environment or --source name=url)")
    settings = settings or DashboardSettings()
    dashboard = _Dashboard(sources, settings)
    from framework.dashboard import tenants_view  # it imports this module: here, once this one is loaded

    routes: list[Route | Mount] = dashboard.routes()
    if tenants is not None:
        routes = [Mount("", app=tenants_view.TenantRouter(dashboard, tenants))]
    return Starlette(
        routes=routes,
        middleware=[
            Middleware(Shield, allowed_hosts=settings.hosts, max_body_bytes=settings.max_body_bytes),
            Middleware(ViewGuard, auth=dashboard.auth),
            *([Middleware(tenants_view.WithoutRegistry, dashboard=dashboard)] if tenants is None else []),
        ],
        exception_handlers={
            HttpError: dashboard.on_http_error,
            TxboxError: dashboard.on_txbox_error,
            Exception: dashboard.on_crash,
        },
    )


class _Dashboard:
    """The pages, the JSON API and their helpers over ``sources``; one per app."""

    def __init__(
        self, sources: Sequence[Source], settings: DashboardSettings, *, auth: Auth | None = None, tenant: str = ""
    ) -> None:
        self.sources = sources
        self.settings = settings
        self.tenant = tenant  # "" without a registry: links and redirects carry no ?tenant=
        self.by_name = {s.name: s for s in sources}
        self.auth = auth or Auth(
            settings.token,
            settings.views_need_token,
            session_ttl=float(settings.session_ttl),
            secure_cookies=settings.secure_cookies,
        )
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            finalize=shown,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self.env.filters.update(
            time=_time, age=_age, pretty=jsoncodec.pretty, intcomma=lambda v: f"{int(v or 0):,}", bucket=_bucket, ms=_ms
        )
        self.env.globals.update(
            sources=[s.name for s in sources],
            statuses=dead_letters_sql.STATUSES,
            windows=list(queries.WINDOWS),
            # Every link keeps the tenant: `tq` opens a query string, `ta` adds to one.
            tenant=tenant,
            tq="?" + urlencode({"tenant": tenant}) if tenant else "",
            ta="&" + urlencode({"tenant": tenant}) if tenant else "",
        )
        self.choice_cache: dict[tuple[str, str], tuple[float, list[str]]] = {}

    def kept(self, params: dict[str, Any]) -> str:
        """``params`` as a query string, with this dashboard's tenant (if any) kept."""
        return urlencode({**params, "tenant": self.tenant} if self.tenant else params)

    def source(self, name: str | None) -> Source:
        if name is None or name == "":
            return self.sources[0]
        if name not in self.by_name:
            raise HttpError(404, f"no source named {name!r}")
        return self.by_name[name]

    def render(self, request: Request, template: str, code: int = 200, **context: Any) -> HTMLResponse:
        html = self.env.get_template(template).render(
            request=request,
            path=request.url.path,
            auth_enabled=self.auth.enabled,
            logged_in=self.auth.authenticated(request),
            csrf=self.auth.csrf_token(request),
            **context,
        )
        return HTMLResponse(html, status_code=code)

    def filters_from(self, request: Request) -> dead_letters_sql.Filters:
        q = request.query_params
        try:
            return dead_letters_sql.Filters(
                status=q.get("status") or "open",  # type: ignore[arg-type]
                source=q.get("origin") or None,
                message_type=q.get("message_type"),
                reason=q.get("reason"),
                fingerprint=q.get("fingerprint"),
                message_id=q.get("message_id"),
                since=queries.parse_when(q["since"]) if q.get("since") else None,
                until=queries.parse_when(q["until"]) if q.get("until") else None,
            )
        except ValueError as exc:
            raise HttpError(400, f"bad filter: {exc}") from None

    def page_of(self, request: Request) -> int:
        try:
            return max(1, min(int(request.query_params.get("page", "1")), 100_000))
        except ValueError:
            raise HttpError(400, "page must be a number") from None

    def window_of(self, request: Request) -> str:
        window = request.query_params.get("window", "1h")
        if window not in queries.WINDOWS:
            raise HttpError(400, f"window must be one of {', '.join(queries.WINDOWS)}")
        return window

    def require_change_rights(self, request: Request, form_csrf: str | None) -> None:
        """Pages' forms: session cookie + CSRF token (``form_csrf``); the JSON API: Bearer only.

        The API takes no cookie: a page of another origin (another port of 127.0.0.1 is
        one, and SameSite does not see ports) could otherwise POST with the browser's.
        """
        if not self.auth.enabled:
            raise HttpError(403, "replay and discard are disabled: start the dashboard with TXBOX_DASHBOARD_TOKEN set")
        if not self.auth.authenticated(request):
            raise HttpError(401, "log in with the dashboard token (or send Authorization: Bearer <token>)")
        if form_csrf is None and not self.auth.bearer(request):
            raise HttpError(403, "the JSON API needs the header Authorization: Bearer <token> (cookies are for pages)")
        if form_csrf is not None and not self.auth.csrf_ok(request, form_csrf):
            raise HttpError(403, "the form's CSRF token is missing or stale: reload the page and try again")

    # --- data ------------------------------------------------------------------------

    def overview_data(self, window: str) -> list[dict[str, Any]]:
        cards = []
        for s in self.sources:
            try:
                with queries.connection(s.engine) as conn:
                    cards.append(
                        {
                            "name": s.name,
                            "stats": queries.overview(conn, s.schema),
                            "timeline": queries.timeline(conn, s.schema, window),
                            "groups": masked(
                                dead_letters_sql.groups(conn, s.schema, dead_letters_sql.Filters(), limit=5)
                            ),
                            "analytics": self.analytics_of(s, conn),
                            "daemons": [b.view() for b in heartbeats_sql.read(conn, s.schema, s.name)],
                            "error": None,
                        }
                    )
            except TxboxError as exc:
                cards.append({"name": s.name, "error": str(exc)})
        return cards

    def analytics_of(self, s: Source, conn: Any) -> dict[str, Any] | None:
        """The last ``txbox analyze`` run covering ``s``: in its own database, else in another
        source's (the job writes one report, by default into its first source's database)."""
        found = reports_sql.analytics(conn, s.schema, s.name)
        for other in self.sources:
            if found is not None:
                break
            if other is not s:
                with queries.connection(other.engine) as report:
                    found = reports_sql.analytics(report, other.schema, s.name, covering=True)
        # All message types in one figure per stage (docs/explanation/analytics.md, "Dashboard: latency per stage").
        if found is not None:
            found["latency"] = latency.per_stage(found["latency"])
        return found

    def groups_data(self, request: Request) -> list[dict[str, Any]]:
        filters = self.filters_from(request)
        wanted = [self.source(request.query_params["service"])] if request.query_params.get("service") else self.sources
        out = []
        for s in wanted:
            with queries.connection(s.engine) as conn:
                out += [
                    {"service": s.name, **g}
                    for g in masked(dead_letters_sql.groups(conn, s.schema, filters, limit=100))
                ]
        out.sort(key=lambda g: (-g["count"], g["service"]))
        return out

    def letters_data(self, request: Request) -> dict[str, Any]:
        s = self.source(request.query_params.get("service"))
        filters = self.filters_from(request)
        page = self.page_of(request)
        with queries.connection(s.engine) as conn:
            total = dead_letters_sql.count_letters(conn, s.schema, filters)
            rows = dead_letters_sql.list_letters(
                conn, s.schema, filters, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE
            )
            choices = {c: self.cached_choices(conn, s, c) for c in ("message_type", "reason")}
        return {
            "service": s.name,
            "filters": filters,
            "page": page,
            "pages": max(1, math.ceil(total / PAGE_SIZE)),
            "total": total,
            "rows": masked(rows),
            "choices": choices,
        }

    def cached_choices(self, conn: Any, s: Source, column: str) -> list[str]:
        """Drop-down values, cached a minute: they scan the table and rarely change."""
        key = (s.name, column)
        hit = self.choice_cache.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        values = dead_letters_sql.distinct_values(conn, s.schema, column)
        self.choice_cache[key] = (time.monotonic() + CHOICES_TTL, values)
        return values

    def letter_data(self, name: str, letter_id: int) -> tuple[Source, dict[str, Any]]:
        s = self.source(name)
        with queries.connection(s.engine) as conn:
            row = dead_letters_sql.get_letter(conn, s.schema, letter_id)
        if row is None:
            raise HttpError(404, f"no dead letter {letter_id} in {s.name}")
        return s, masked(row)

    def act(
        self, s: Source, action: str, ids: list[int], *, dry_run: bool, auth_token: str | None = None
    ) -> list[replay.Outcome]:
        """Replay or discard ``ids``; ``auth_token``: the operator's, for the replayed messages only."""
        if action not in ACTIONS:
            raise HttpError(404, f"unknown action {action!r}")
        with queries.connection(s.engine) as conn:
            if action == "replay":
                return replay.replay(conn, s.schema, s.registry, s.name, ids, dry_run=dry_run, auth_token=auth_token)
            return replay.discard(conn, s.schema, ids, dry_run=dry_run)

    def group_ids(self, s: Source, fingerprint: str) -> list[int]:
        with queries.connection(s.engine) as conn:
            return dead_letters_sql.ids_matching(conn, s.schema, dead_letters_sql.Filters(fingerprint=fingerprint))

    # --- pages -----------------------------------------------------------------------

    def overview_page(self, request: Request) -> Response:
        window = self.window_of(request)
        cards = self.overview_data(window)
        for card in cards:
            if card.get("error"):
                continue
            t = card["timeline"]
            flow = [
                charts.Series("processed", t["series"]["processed"], "#2f6fdf"),
                charts.Series("received", t["series"]["received"], "#9aa5b1", "line"),
            ]
            dead = [charts.Series("dead letters", t["series"]["dead"], "#d64545")]
            card["flow_chart"] = charts.bar_chart(
                f"{card['name']}: inbox throughput", t["buckets"], t["bucket_seconds"], flow
            )
            card["flow_legend"] = charts.legend(flow)
            card["dead_chart"] = charts.bar_chart(
                f"{card['name']}: dead letters", t["buckets"], t["bucket_seconds"], dead
            )
            card["dead_legend"] = charts.legend(dead)
            if card["analytics"] and card["analytics"]["latency"]:
                card["latency_chart"] = charts.latency_chart(card["analytics"]["latency"])
                card["latency_legend"] = charts.legend(charts.LATENCY_LEGEND)
        return self.render(request, "overview.html", cards=cards, window=window, title="Overview")

    def groups_page(self, request: Request) -> Response:
        filters = self.filters_from(request)
        return self.render(
            request,
            "groups.html",
            groups=self.groups_data(request),
            filters=filters,
            title="Failure groups",
            service=request.query_params.get("service", ""),
        )

    def letters_page(self, request: Request) -> Response:
        data = self.letters_data(request)
        base = {k: v for k, v in request.query_params.items() if k != "page"}
        link = lambda p: "/letters?" + urlencode({**base, "page": p})  # noqa: E731
        return self.render(request, "letters.html", title="Dead letters", link=link, **data)

    def letter_page(self, request: Request) -> Response:
        s, row = self.letter_data(request.path_params["service"], request.path_params["id"])
        return self.render(
            request,
            "letter.html",
            title=f"Dead letter {row['id']}",
            service=s.name,
            row=row,
            done=request.query_params.get("done", ""),
        )

    async def confirm_or_act(
        self, request: Request, what: str, page: Callable[..., Response], post: Callable[..., Response]
    ) -> Response:
        """GET: the page confirming ``action`` on a letter or group; POST: do it (rights and CSRF checked first)."""
        name, key, action = (request.path_params[p] for p in ("service", what, "action"))
        if request.method == "POST":
            form = await request.form()
            token = form.get(REPLAY_TOKEN_FIELD)
            return await _in_thread(lambda: post(request, name, key, action, str(form.get("csrf", "")), token))
        if action not in ACTIONS:
            raise HttpError(404, f"unknown action {action!r}")
        return await _in_thread(lambda: page(request, name, key, action))

    async def confirm_letter(self, request: Request) -> Response:
        return await self.confirm_or_act(request, "id", self._confirm_letter_page, self._post_letter)

    async def confirm_group(self, request: Request) -> Response:
        return await self.confirm_or_act(request, "fingerprint", self._confirm_group_page, self._post_group)

    def _confirm_letter_page(self, request: Request, name: str, letter_id: int, action: str) -> Response:
        s, row = self.letter_data(name, letter_id)
        preview = [row]
        return self.render(
            request,
            "confirm.html",
            title=f"{action.title()} dead letter {letter_id}",
            service=s.name,
            action=action,
            what=f"dead letter {letter_id} ({row['message_type'] or 'no type'}, {row['reason']})",
            preview=preview,
            back=f"/letters/{s.name}/{letter_id}" + (f"?{self.kept({})}" if self.tenant else ""),
            count=1,
        )

    def _post_letter(
        self, request: Request, name: str, letter_id: int, action: str, csrf: str, form_token: Any
    ) -> Response:
        self.require_change_rights(request, csrf)
        token = operator_token(form_token, f"the form's {REPLAY_TOKEN_FIELD} field")
        s = self.source(name)
        [outcome] = self.act(s, action, [letter_id], dry_run=False, auth_token=token)
        return RedirectResponse(
            f"/letters/{s.name}/{letter_id}?" + self.kept({"done": f"{outcome.action}: {outcome.detail}"}), 303
        )

    def _confirm_group_page(self, request: Request, name: str, fp: str, action: str) -> Response:
        s = self.source(name)
        ids = self.group_ids(s, fp)
        with queries.connection(s.engine) as conn:
            preview = masked(
                dead_letters_sql.list_letters(
                    conn, s.schema, dead_letters_sql.Filters(fingerprint=fp), limit=20, offset=0
                )
            )
        return self.render(
            request,
            "confirm.html",
            title=f"{action.title()} group {fp}",
            service=s.name,
            action=action,
            what=f"all {len(ids)} open dead letters of failure group {fp}",
            preview=preview,
            back="/letters?" + self.kept({"service": s.name, "fingerprint": fp}),
            count=len(ids),
        )

    def _post_group(self, request: Request, name: str, fp: str, action: str, csrf: str, form_token: Any) -> Response:
        self.require_change_rights(request, csrf)
        token = operator_token(form_token, f"the form's {REPLAY_TOKEN_FIELD} field")
        s = self.source(name)
        outcomes = self.act(s, action, self.group_ids(s, fp), dry_run=False, auth_token=token)
        ok = sum(o.ok for o in outcomes)
        return RedirectResponse(
            "/letters?"
            + self.kept(
                {"service": s.name, "fingerprint": fp, "status": "all", "done": f"{action}: {ok} of {len(outcomes)}"}
            ),
            303,
        )

    def login_page(self, request: Request, code: int = 200, *, error: str = "", nxt: str = "/") -> Response:
        """The form, with a double-submit CSRF token: the same random value in a cookie and a field."""
        token = request.cookies.get(LOGIN_COOKIE, "")
        if len(token) != len(secrets.token_urlsafe(32)):  # keep a browser's (other tabs' forms stay valid)
            token = secrets.token_urlsafe(32)
        response = self.render(request, "login.html", code, title="Log in", error=error, next=nxt, login_csrf=token)
        response.set_cookie(LOGIN_COOKIE, token, max_age=3600, **self.auth.cookie_options(request))
        return response

    async def login(self, request: Request) -> Response:
        if request.method == "GET":
            return await _in_thread(lambda: self.login_page(request, nxt=_local(request.query_params.get("next", "/"))))
        form = await request.form()
        nxt = _local(str(form.get("next", "/")))
        client = client_of(request)
        wait = self.auth.throttle.retry_after(client)
        if wait > 0:
            response = self.login_page(
                request, 429, error=f"too many failed logins: try again in {math.ceil(wait)} s", nxt=nxt
            )
            response.headers["Retry-After"] = str(math.ceil(wait))
            return response
        expected = request.cookies.get(LOGIN_COOKIE, "")
        if not expected or not hmac.compare_digest(str(form.get("csrf", "")).encode(), expected.encode()):
            return self.login_page(request, 403, error="the form is stale: log in again", nxt=nxt)
        if not self.auth.enabled:
            return self.login_page(request, 403, error="no TXBOX_DASHBOARD_TOKEN is configured", nxt=nxt)
        if not self.auth.check_token(str(form.get("token", ""))):
            self.auth.throttle.failed(client)
            return self.login_page(request, 401, error="wrong token", nxt=nxt)
        self.auth.throttle.succeeded(client)
        self.auth.sessions.revoke(request.cookies.get(COOKIE, ""))
        response = RedirectResponse(nxt, 303)
        response.set_cookie(
            COOKIE,
            self.auth.sessions.create(),
            max_age=int(self.settings.session_ttl),
            **self.auth.cookie_options(request),
        )
        response.delete_cookie(LOGIN_COOKIE, path="/")
        return response

    async def logout(self, request: Request) -> Response:
        form = await request.form()
        if not self.auth.csrf_ok(request, str(form.get("csrf", ""))):
            raise HttpError(403, "the logout form's CSRF token is missing or stale: reload the page and try again")
        self.auth.sessions.revoke(request.cookies.get(COOKIE, ""))
        response = RedirectResponse("/", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # --- JSON API --------------------------------------------------------------------

    def api_overview(self, request: Request) -> Response:
        return MaskedJSON(
            jsoncodec.plain(
                {"window": self.window_of(request), "services": self.overview_data(self.window_of(request))}
            )
        )

    def api_groups(self, request: Request) -> Response:
        return MaskedJSON(jsoncodec.plain({"groups": self.groups_data(request)}))

    def api_letters(self, request: Request) -> Response:
        data = self.letters_data(request)
        data["filters"] = data["filters"].as_query()
        data.pop("choices")
        return MaskedJSON(jsoncodec.plain(data))

    def api_letter(self, request: Request) -> Response:
        s, row = self.letter_data(request.path_params["service"], request.path_params["id"])
        return MaskedJSON(jsoncodec.plain({"service": s.name, "letter": row}))

    def api_act_letter(self, request: Request) -> Response:
        self.require_change_rights(request, None)
        s = self.source(request.path_params["service"])
        dry = request.query_params.get("dry_run") in ("1", "true")
        token = operator_token(request.headers.get(REPLAY_TOKEN_HEADER), f"the {REPLAY_TOKEN_HEADER} header")
        outcomes = self.act(
            s, request.path_params["action"], [request.path_params["id"]], dry_run=dry, auth_token=token
        )
        return MaskedJSON({"dry_run": dry, "outcomes": [o.as_dict() for o in outcomes]})

    def api_act_group(self, request: Request) -> Response:
        self.require_change_rights(request, None)
        s = self.source(request.path_params["service"])
        dry = request.query_params.get("dry_run") in ("1", "true")
        token = operator_token(request.headers.get(REPLAY_TOKEN_HEADER), f"the {REPLAY_TOKEN_HEADER} header")
        ids = self.group_ids(s, request.path_params["fingerprint"])
        outcomes = self.act(s, request.path_params["action"], ids, dry_run=dry, auth_token=token)
        return MaskedJSON({"dry_run": dry, "outcomes": [o.as_dict() for o in outcomes]})

    def healthz(self, request: Request) -> Response:
        return MaskedJSON({"ok": True, "sources": [s.name for s in self.sources]})

    # --- plumbing --------------------------------------------------------------------

    def error_response(self, request: Request, status: int, message: str) -> Response:
        if request.url.path.startswith("/api/"):
            return MaskedJSON({"error": message}, status_code=status)
        return self.render(request, "error.html", status, title=f"Error {status}", status=status, message=message)

    async def on_http_error(self, request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return await _in_thread(lambda: self.error_response(request, exc.status, exc.message))

    async def on_txbox_error(self, request: Request, exc: Exception) -> Response:
        return await _in_thread(lambda: self.error_response(request, 503, redact_text(str(exc))))

    async def on_crash(self, request: Request, exc: Exception) -> Response:
        """A bug: no detail (it could quote data), the security headers all the same (this
        response is made outside the middleware, by Starlette's outermost layer)."""
        return PlainTextResponse("internal error: see the dashboard's log", 500, headers=dict(SECURITY_HEADERS))

    def routes(self) -> list[Route | Mount]:
        from framework.dashboard import pending_view  # it imports this module: here, once this one is loaded

        return [
            Route("/", self.overview_page),
            Route("/groups", self.groups_page),
            Route("/letters", self.letters_page),
            Route("/letters/{service}/{id:int}", self.letter_page),
            Route("/letters/{service}/{id:int}/{action}", self.confirm_letter, methods=["GET", "POST"]),
            Route("/groups/{service}/{fingerprint}/{action}", self.confirm_group, methods=["GET", "POST"]),
            Route("/login", self.login, methods=["GET", "POST"]),
            Route("/logout", self.logout, methods=["POST"]),
            Route("/healthz", self.healthz),
            *pending_view.routes(self.source, self.render),
            Route("/api/overview", self.api_overview),
            Route("/api/groups", self.api_groups),
            Route("/api/letters", self.api_letters),
            Route("/api/letters/{service}/{id:int}", self.api_letter),
            Route("/api/letters/{service}/{id:int}/{action}", self.api_act_letter, methods=["POST"]),
            Route("/api/groups/{service}/{fingerprint}/{action}", self.api_act_group, methods=["POST"]),
            Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
        ]


class ViewGuard:
    """Viewing needs the token (when so configured): pages redirect to the login, the API says 401."""

    def __init__(self, app: ASGIApp, auth: Auth) -> None:
        self.app = app
        self.auth = auth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        open_path = path in ("/login", "/healthz") or path.startswith("/static/")
        if scope["type"] == "http" and not open_path and not self.auth.may_view(Request(scope)):
            response: Response
            if path.startswith("/api/"):
                response = MaskedJSON({"error": "send Authorization: Bearer <token>"}, status_code=401)
            else:
                query = scope.get("query_string", b"").decode("latin-1")
                nxt = f"{path}?{query}" if query else path  # the query keeps the tenant
                response = RedirectResponse("/login?" + urlencode({"next": nxt}), 303)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _in_thread(fn: Callable[[], Response]) -> Response:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn)


def _local(path: str) -> str:
    """Only a path of this site: "//host" and "/\\host" would leave it."""
    return path if path.startswith("/") and not path.startswith(("//", "/\\")) else "/"
