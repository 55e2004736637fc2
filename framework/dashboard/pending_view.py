"""The dashboard's pending page: per service, what its outbox and inbox still hold.

``/pending/{service}`` (HTML) and ``/api/pending/{service}`` (JSON): the pending rows of
one table with their state, age, attempts and last error, and the count of each state
in both tables (framework/pending.py). Rows are masked exactly as dead letters are
(framework/dead_letters/present.py) before they reach a template or the API; the app's guards
(login, host check, security headers: framework/dashboard/security.py) cover these
routes as every other. Reads only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from framework import jsoncodec, names, pending
from framework.dashboard.app import MaskedJSON, Source
from framework.dead_letters import queries
from framework.dead_letters.present import masked
from framework.errors import HttpError
from framework.settings import parse_duration
from framework.sql import pending as pending_sql


def routes(source: Callable[[str], Source], render: Callable[..., HTMLResponse]) -> list[Route]:
    """The page and its JSON mirror; ``source`` and ``render`` are the app's own."""
    from framework.worker.config import WorkerConfig

    # What is parked depends on the worker's segment policy: the dashboard reads the same
    # setting, so a misconfigured one fails at start, not on the first page view.
    park = WorkerConfig.from_env().segment_policy == "park"

    def filters_from(request: Request) -> pending_sql.Filters:
        q = request.query_params
        try:
            return pending_sql.Filters(
                table=q.get("table") or names.INBOX,
                state=q.get("state"),
                message_type=q.get("message_type"),
                segment=q.get("segment"),
                older_than=parse_duration(q["older_than"]) if q.get("older_than") else None,
                limit=int(q.get("limit") or pending_sql.DEFAULT_LIMIT),
                park=park,
            )
        except ValueError as exc:
            raise HttpError(400, f"bad filter: {exc}") from None

    def data(request: Request) -> dict[str, Any]:
        s = source(request.path_params["service"])
        filters = filters_from(request)
        with queries.connection(s.engine) as conn:
            rows = pending.list_pending(conn, s.schema, filters)
            summary = {table: pending.counts(conn, s.schema, table, park=park) for table in pending_sql.TABLES}
        return {"service": s.name, "filters": filters, "rows": masked(rows), "counts": summary, "park": park}

    def page(request: Request) -> Response:
        found = data(request)
        return render(
            request,
            "pending.html",
            title=f"Pending · {found['service']}",
            tables=pending_sql.TABLES,
            states=pending_sql.STATES,
            older_than=request.query_params.get("older_than", ""),
            **found,
        )

    def api(request: Request) -> Response:
        found = data(request)
        f = found.pop("filters")
        found["filters"] = {k: v for k, v in vars(f).items() if v is not None and k != "park"}
        return MaskedJSON(jsoncodec.plain(found))

    return [Route("/pending/{service}", page), Route("/api/pending/{service}", api)]
