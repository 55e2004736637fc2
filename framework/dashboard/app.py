"""The dashboard's Starlette application: pages, the JSON API that mirrors them, security.

Endpoints are plain (sync) functions: Starlette runs them in its thread pool, each
borrowing a pooled psycopg connection of the source's engine. Every filter reaches SQL
as a bound parameter (framework.dlq.queries); every value reaches HTML through Jinja2's
autoescaping; secrets are masked before they reach a template (framework.dlq.present).
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from framework.contracts import Registry, load_registry
from framework.dashboard import charts
from framework.dashboard.security import COOKIE, Auth
from framework.dlq import queries, replay
from framework.dlq.present import masked
from framework.errors import ConfigurationError, TxboxError
from framework.settings import setting

HERE = Path(__file__).parent
PAGE_SIZE = 50
CHOICES_TTL = 60.0
ACTIONS = ("replay", "discard")


@dataclass(frozen=True, kw_only=True)
class DashboardSettings:
    """`txbox dashboard`: where it listens and who may replay or discard."""

    token: str | None = setting(
        "TXBOX_DASHBOARD_TOKEN",
        "s3cr3t-long-random-string",
        default=None,
        help="secret for replay/discard (and viewing, if required); unset: read-only dashboard",
    )
    view_requires_token: bool = setting(
        "TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN", "true", default=False, help="require the token to view pages too"
    )
    host: str = setting("TXBOX_DASHBOARD_HOST", "127.0.0.1", default="127.0.0.1", help="address to bind")
    port: int = setting("TXBOX_DASHBOARD_PORT", "8470", default=8470, help="port to bind")

    def __post_init__(self) -> None:
        if self.view_requires_token and not self.token:
            raise ConfigurationError(
                "TXBOX_DASHBOARD_VIEW_REQUIRES_TOKEN=true needs TXBOX_DASHBOARD_TOKEN. "
                "Example: TXBOX_DASHBOARD_TOKEN=$(openssl rand -hex 24)"
            )


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


class HttpError(Exception):
    def __init__(self, status: int, message: str) -> None:
        self.status = status
        self.message = message
        super().__init__(message)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = float(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f} {unit}"
    return f"{seconds:.0f} s"


def _bucket(seconds: int) -> str:
    return f"{seconds // 3600} h" if seconds >= 3600 else f"{seconds // 60} min"


def _time(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str, sort_keys=False)


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def create_app(sources: Sequence[Source], settings: DashboardSettings | None = None) -> Starlette:
    if not sources:
        raise ConfigurationError("the dashboard needs at least one source (TXBOX_* environment or --source name=url)")
    settings = settings or DashboardSettings()
    by_name = {s.name: s for s in sources}
    auth = Auth(settings.token, settings.view_requires_token)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(time=_time, age=_age, pretty=_pretty, intcomma=lambda v: f"{int(v or 0):,}", bucket=_bucket)
    env.globals.update(sources=[s.name for s in sources], statuses=queries.STATUSES, windows=list(queries.WINDOWS))

    # --- helpers -------------------------------------------------------------------

    def source(name: str | None) -> Source:
        if name is None or name == "":
            return sources[0]
        if name not in by_name:
            raise HttpError(404, f"no source named {name!r}")
        return by_name[name]

    def render(request: Request, template: str, code: int = 200, **context: Any) -> HTMLResponse:
        html = env.get_template(template).render(
            request=request,
            path=request.url.path,
            auth_enabled=auth.enabled,
            logged_in=auth.authenticated(request),
            csrf=auth.csrf_token(request),
            **context,
        )
        return HTMLResponse(html, status_code=code)

    def filters_from(request: Request) -> queries.Filters:
        q = request.query_params
        try:
            return queries.Filters(
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

    def page_of(request: Request) -> int:
        try:
            return max(1, min(int(request.query_params.get("page", "1")), 100_000))
        except ValueError:
            raise HttpError(400, "page must be a number") from None

    def window_of(request: Request) -> str:
        window = request.query_params.get("window", "1h")
        if window not in queries.WINDOWS:
            raise HttpError(400, f"window must be one of {', '.join(queries.WINDOWS)}")
        return window

    def require_change_rights(request: Request, form_csrf: str | None) -> None:
        """Pages' forms: session cookie + CSRF token (``form_csrf``); the JSON API: Bearer only.

        The API takes no cookie: a page of another origin (another port of 127.0.0.1 is
        one, and SameSite does not see ports) could otherwise POST with the browser's.
        """
        if not auth.enabled:
            raise HttpError(403, "replay and discard are disabled: start the dashboard with TXBOX_DASHBOARD_TOKEN set")
        if not auth.authenticated(request):
            raise HttpError(401, "log in with the dashboard token (or send Authorization: Bearer <token>)")
        if form_csrf is None and not auth.bearer(request):
            raise HttpError(403, "the JSON API needs the header Authorization: Bearer <token> (cookies are for pages)")
        if form_csrf is not None and not auth.csrf_ok(request, form_csrf):
            raise HttpError(403, "the form's CSRF token is missing or stale: reload the page and try again")

    # --- data ------------------------------------------------------------------------

    def overview_data(window: str) -> list[dict[str, Any]]:
        cards = []
        for s in sources:
            try:
                with queries.connection(s.engine) as conn:
                    _resolve(conn, s.schema)
                    cards.append(
                        {
                            "name": s.name,
                            "stats": queries.overview(conn, s.schema),
                            "timeline": queries.timeline(conn, s.schema, window),
                            "groups": queries.groups(conn, s.schema, queries.Filters(), limit=5),
                            "analytics": analytics_of(s, conn),
                            "error": None,
                        }
                    )
            except TxboxError as exc:
                cards.append({"name": s.name, "error": str(exc)})
        return cards

    def analytics_of(s: Source, conn: Any) -> dict[str, Any] | None:
        """The last ``txbox analyze`` run covering ``s``: in its own database, else in another
        source's (the job writes one report, by default into its first source's database)."""
        found = queries.analytics(conn, s.schema, s.name)
        for other in sources:
            if found is not None:
                break
            if other is not s:
                with queries.connection(other.engine) as report:
                    found = queries.analytics(report, other.schema, s.name, covering=True)
        return found

    def groups_data(request: Request) -> list[dict[str, Any]]:
        filters = filters_from(request)
        wanted = [source(request.query_params["service"])] if request.query_params.get("service") else sources
        out = []
        for s in wanted:
            with queries.connection(s.engine) as conn:
                out += [{"service": s.name, **g} for g in queries.groups(conn, s.schema, filters, limit=100)]
        out.sort(key=lambda g: (-g["count"], g["service"]))
        return out

    def letters_data(request: Request) -> dict[str, Any]:
        s = source(request.query_params.get("service"))
        filters = filters_from(request)
        page = page_of(request)
        with queries.connection(s.engine) as conn:
            _resolve(conn, s.schema)
            total = queries.count_letters(conn, s.schema, filters)
            rows = queries.list_letters(conn, s.schema, filters, limit=PAGE_SIZE, offset=(page - 1) * PAGE_SIZE)
            choices = {c: cached_choices(conn, s, c) for c in ("message_type", "reason")}
        return {
            "service": s.name,
            "filters": filters,
            "page": page,
            "pages": max(1, math.ceil(total / PAGE_SIZE)),
            "total": total,
            "rows": rows,
            "choices": choices,
        }

    choice_cache: dict[tuple[str, str], tuple[float, list[str]]] = {}

    def cached_choices(conn: Any, s: Source, column: str) -> list[str]:
        """Drop-down values, cached a minute: they scan the table and rarely change."""
        key = (s.name, column)
        hit = choice_cache.get(key)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        values = queries.distinct_values(conn, s.schema, column)
        choice_cache[key] = (time.monotonic() + CHOICES_TTL, values)
        return values

    def letter_data(name: str, letter_id: int) -> tuple[Source, dict[str, Any]]:
        s = source(name)
        with queries.connection(s.engine) as conn:
            _resolve(conn, s.schema)
            row = queries.get_letter(conn, s.schema, letter_id)
        if row is None:
            raise HttpError(404, f"no dead letter {letter_id} in {s.name}")
        return s, masked(row)

    def act(s: Source, action: str, ids: list[int], *, dry_run: bool) -> list[replay.Outcome]:
        if action not in ACTIONS:
            raise HttpError(404, f"unknown action {action!r}")
        with queries.connection(s.engine) as conn:
            if action == "replay":
                return replay.replay(conn, s.schema, s.registry, s.name, ids, dry_run=dry_run)
            return replay.discard(conn, s.schema, ids, dry_run=dry_run)

    def group_ids(s: Source, fingerprint: str) -> list[int]:
        with queries.connection(s.engine) as conn:
            return queries.ids_matching(conn, s.schema, queries.Filters(fingerprint=fingerprint))

    # --- pages -----------------------------------------------------------------------

    def overview_page(request: Request) -> Response:
        window = window_of(request)
        cards = overview_data(window)
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
        return render(request, "overview.html", cards=cards, window=window, title="Overview")

    def groups_page(request: Request) -> Response:
        filters = filters_from(request)
        return render(
            request,
            "groups.html",
            groups=groups_data(request),
            filters=filters,
            title="Failure groups",
            service=request.query_params.get("service", ""),
        )

    def letters_page(request: Request) -> Response:
        data = letters_data(request)
        base = {k: v for k, v in request.query_params.items() if k != "page"}
        link = lambda p: "/letters?" + urlencode({**base, "page": p})  # noqa: E731
        return render(request, "letters.html", title="Dead letters", link=link, **data)

    def letter_page(request: Request) -> Response:
        s, row = letter_data(request.path_params["service"], request.path_params["id"])
        return render(
            request,
            "letter.html",
            title=f"Dead letter {row['id']}",
            service=s.name,
            row=row,
            done=request.query_params.get("done", ""),
        )

    async def confirm_letter(request: Request) -> Response:
        name, letter_id, action = (
            request.path_params["service"],
            request.path_params["id"],
            request.path_params["action"],
        )
        if request.method == "POST":
            form = await request.form()
            return await _in_thread(lambda: _post_letter(request, name, letter_id, action, str(form.get("csrf", ""))))
        return await _in_thread(lambda: _confirm_letter_page(request, name, letter_id, action))

    def _confirm_letter_page(request: Request, name: str, letter_id: int, action: str) -> Response:
        s, row = letter_data(name, letter_id)
        preview = act(s, action, [letter_id], dry_run=True)
        return render(
            request,
            "confirm.html",
            title=f"{action.title()} dead letter {letter_id}",
            service=s.name,
            action=action,
            what=f"dead letter {letter_id} ({row['message_type'] or 'no type'}, {row['reason']})",
            preview=preview,
            back=f"/letters/{s.name}/{letter_id}",
            count=1,
        )

    def _post_letter(request: Request, name: str, letter_id: int, action: str, csrf: str) -> Response:
        require_change_rights(request, csrf)
        s = source(name)
        [outcome] = act(s, action, [letter_id], dry_run=False)
        return RedirectResponse(
            f"/letters/{s.name}/{letter_id}?" + urlencode({"done": f"{outcome.action}: {outcome.detail}"}), 303
        )

    async def confirm_group(request: Request) -> Response:
        name, fp, action = (
            request.path_params["service"],
            request.path_params["fingerprint"],
            request.path_params["action"],
        )
        if request.method == "POST":
            form = await request.form()
            return await _in_thread(lambda: _post_group(request, name, fp, action, str(form.get("csrf", ""))))
        return await _in_thread(lambda: _confirm_group_page(request, name, fp, action))

    def _confirm_group_page(request: Request, name: str, fp: str, action: str) -> Response:
        s = source(name)
        ids = group_ids(s, fp)
        preview = act(s, action, ids[:20], dry_run=True)
        return render(
            request,
            "confirm.html",
            title=f"{action.title()} group {fp}",
            service=s.name,
            action=action,
            what=f"all {len(ids)} open dead letters of failure group {fp}",
            preview=preview,
            back="/letters?" + urlencode({"service": s.name, "fingerprint": fp}),
            count=len(ids),
        )

    def _post_group(request: Request, name: str, fp: str, action: str, csrf: str) -> Response:
        require_change_rights(request, csrf)
        s = source(name)
        outcomes = act(s, action, group_ids(s, fp), dry_run=False)
        ok = sum(o.ok for o in outcomes)
        return RedirectResponse(
            "/letters?"
            + urlencode(
                {"service": s.name, "fingerprint": fp, "status": "all", "done": f"{action}: {ok} of {len(outcomes)}"}
            ),
            303,
        )

    async def login(request: Request) -> Response:
        if request.method == "GET":
            return render(request, "login.html", title="Log in", error="", next=request.query_params.get("next", "/"))
        form = await request.form()
        nxt = str(form.get("next", "/"))
        # Only a path of this site: "//host" and "/\\host" would leave it.
        nxt = nxt if nxt.startswith("/") and not nxt.startswith(("//", "/\\")) else "/"
        if not auth.enabled:
            return render(
                request, "login.html", 403, title="Log in", error="no TXBOX_DASHBOARD_TOKEN is configured", next=nxt
            )
        if not auth.check_token(str(form.get("token", ""))):
            return render(request, "login.html", 401, title="Log in", error="wrong token", next=nxt)
        response = RedirectResponse(nxt, 303)
        response.set_cookie(COOKIE, auth.session_value(), httponly=True, samesite="strict", path="/")
        return response

    async def logout(request: Request) -> Response:
        response = RedirectResponse("/", 303)
        response.delete_cookie(COOKIE, path="/")
        return response

    # --- JSON API --------------------------------------------------------------------

    def api_overview(request: Request) -> Response:
        return JSONResponse(_jsonable({"window": window_of(request), "services": overview_data(window_of(request))}))

    def api_groups(request: Request) -> Response:
        return JSONResponse(_jsonable({"groups": groups_data(request)}))

    def api_letters(request: Request) -> Response:
        data = letters_data(request)
        data["filters"] = data["filters"].as_query()
        data.pop("choices")
        return JSONResponse(_jsonable(data))

    def api_letter(request: Request) -> Response:
        s, row = letter_data(request.path_params["service"], request.path_params["id"])
        return JSONResponse(_jsonable({"service": s.name, "letter": row}))

    def api_act_letter(request: Request) -> Response:
        require_change_rights(request, None)
        s = source(request.path_params["service"])
        dry = request.query_params.get("dry_run") in ("1", "true")
        outcomes = act(s, request.path_params["action"], [request.path_params["id"]], dry_run=dry)
        return JSONResponse({"dry_run": dry, "outcomes": [o.as_dict() for o in outcomes]})

    def api_act_group(request: Request) -> Response:
        require_change_rights(request, None)
        s = source(request.path_params["service"])
        dry = request.query_params.get("dry_run") in ("1", "true")
        outcomes = act(s, request.path_params["action"], group_ids(s, request.path_params["fingerprint"]), dry_run=dry)
        return JSONResponse({"dry_run": dry, "outcomes": [o.as_dict() for o in outcomes]})

    def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, "sources": [s.name for s in sources]})

    # --- plumbing --------------------------------------------------------------------

    def error_response(request: Request, status: int, message: str) -> Response:
        if request.url.path.startswith("/api/"):
            return JSONResponse({"error": message}, status_code=status)
        return render(request, "error.html", status, title=f"Error {status}", status=status, message=message)

    class Guard(BaseHTTPMiddleware):
        """View permission and the security headers on every response."""

        async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
            path = request.url.path
            open_path = path in ("/login", "/healthz") or path.startswith("/static/")
            if not open_path and not auth.may_view(request):
                if path.startswith("/api/"):
                    response: Response = JSONResponse({"error": "send Authorization: Bearer <token>"}, status_code=401)
                else:
                    response = RedirectResponse("/login?" + urlencode({"next": path}), 303)
            else:
                response = await call_next(request)
            response.headers["Content-Security-Policy"] = (
                "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
                "frame-ancestors 'none'; base-uri 'none'"
            )
            response.headers["X-Content-Type-Options"] = "nosniff"
            response.headers["Referrer-Policy"] = "same-origin"
            response.headers["X-Frame-Options"] = "DENY"
            response.headers.setdefault("Cache-Control", "no-store")
            return response

    routes = [
        Route("/", overview_page),
        Route("/groups", groups_page),
        Route("/letters", letters_page),
        Route("/letters/{service}/{id:int}", letter_page),
        Route("/letters/{service}/{id:int}/{action}", confirm_letter, methods=["GET", "POST"]),
        Route("/groups/{service}/{fingerprint}/{action}", confirm_group, methods=["GET", "POST"]),
        Route("/login", login, methods=["GET", "POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", healthz),
        Route("/api/overview", api_overview),
        Route("/api/groups", api_groups),
        Route("/api/letters", api_letters),
        Route("/api/letters/{service}/{id:int}", api_letter),
        Route("/api/letters/{service}/{id:int}/{action}", api_act_letter, methods=["POST"]),
        Route("/api/groups/{service}/{fingerprint}/{action}", api_act_group, methods=["POST"]),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HttpError)
        return await _in_thread(lambda: error_response(request, exc.status, exc.message))

    async def on_txbox_error(request: Request, exc: Exception) -> Response:
        return await _in_thread(lambda: error_response(request, 503, str(exc)))

    return Starlette(
        routes=routes,
        middleware=[Middleware(Guard)],
        exception_handlers={HttpError: on_http_error, TxboxError: on_txbox_error},
    )


async def _in_thread(fn: Callable[[], Response]) -> Response:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn)


def _resolve(conn: Any, schema: str) -> None:
    """Resolve replayed letters whose message got processed (cheap: a small partial index);
    harmless if the dashboard's role may not write — the collector does it as well."""
    import psycopg

    with contextlib.suppress(psycopg.errors.InsufficientPrivilege):
        replay.resolve_replayed(conn, schema)
