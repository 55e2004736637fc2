"""The dashboard over a tenant registry: ``?tenant=KEY`` picks whose dead letters a request reads.

Each tenant is served by a dashboard of its own over the tenant's database and schema
(an engine each, made once: framework/tenants/runs.py, ``engine_for``), built on its
first request and kept; the app's guards (login, CSRF, host check, body limit:
framework/dashboard/security.py) sit in front of every one of them unchanged. Without
``?tenant=``, ``/`` lists the tenants and the login, logout, health and static paths are
served as ever; any other path is a 400 asking for a tenant. An unknown key is a 404
naming the known ones (docs/how-to/tenants.md, "The dashboard per tenant").

Given a :class:`~framework.tenants.follow.RegistryFollower`, each request reads the
snapshot in force: a tenant added is served from the next request on, one removed is a
404, and a changed one (another database or schema) gets a dashboard anew. The tenants'
dashboards are the event loop's: only its thread builds and drops them.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from sqlalchemy.engine import Engine
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from framework.dashboard.app import HERE, Source, _Dashboard, _in_thread
from framework.errors import HttpError, TxboxError
from framework.tenants.follow import RegistryFollower
from framework.tenants.model import Registry, Tenant

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable

OPEN_PATHS = ("/login", "/logout", "/healthz")
"""Served without a tenant: they read no tenant's data."""


class TenantSource(Source):
    """A service's framework tables in one tenant's database and schema."""

    @cached_property
    def engine(self) -> Engine:
        from framework.tenants.runs import engine_for

        engine: Engine = engine_for(self.database_url)
        return engine


class TenantRouter:
    """The ASGI app behind the guards: one dashboard per tenant, chosen by ``?tenant=``."""

    def __init__(self, bare: _Dashboard, tenants: Registry | RegistryFollower) -> None:
        self.bare = bare  # the app's own: its auth, its settings, its service and contracts
        self._follower = tenants if isinstance(tenants, RegistryFollower) else None
        self.registry = tenants.registry if isinstance(tenants, RegistryFollower) else tenants
        self.apps: dict[str, tuple[Tenant, Starlette]] = {}  # at most one per tenant of the registry
        self.lobby = Starlette(
            routes=[
                Route("/", self.tenants_page),
                Route("/login", bare.login, methods=["GET", "POST"]),
                Route("/logout", bare.logout, methods=["POST"]),
                Route("/healthz", bare.healthz),
                Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
            ],
            exception_handlers=self.handlers(bare),
        )

    @staticmethod
    def handlers(d: _Dashboard) -> dict[Any, Callable[[Request, Exception], Awaitable[Response]]]:
        return {HttpError: d.on_http_error, TxboxError: d.on_txbox_error, Exception: d.on_crash}

    def tenants_page(self, request: Request) -> Response:
        return self.bare.render(
            request,
            "tenants.html",
            title="Tenants",
            lobby=True,  # its menu: this list only (the other pages need a tenant)
            tenants=list(self.registry),
            keys=self.registry.keys(),
            registry_source=self.registry.source,
        )

    def app_of(self, tenant: Tenant) -> Starlette:
        """The dashboard of ``tenant``, made on its first request and kept while the tenant
        is listed as it is (a tenant that changed gets a new one)."""
        made = self.apps.get(tenant.key)
        if made is None or made[0] != tenant:
            bare = self.bare
            sources = [
                TenantSource(s.name, tenant.database_url, schema=tenant.schema, contracts_dir=s.contracts_dir)
                for s in bare.sources
            ]
            d = _Dashboard(sources, bare.settings, auth=bare.auth, tenant=tenant.key)
            made = self.apps[tenant.key] = (tenant, Starlette(routes=d.routes(), exception_handlers=self.handlers(d)))
        return made[1]

    def _follow(self) -> None:
        """Take up the follower's snapshot when it is newer: drop the dashboards of tenants
        it no longer lists (their engines open a connection per request: nothing to close)."""
        if self._follower is None:
            return
        latest = self._follower.registry
        if latest is not self.registry:
            self.registry = latest
            for key in [k for k in self.apps if k not in latest]:
                del self.apps[key]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._follow()
        if scope["type"] != "http":
            await self.lobby(scope, receive, send)
            return
        key = tenant_param(scope)
        path = scope.get("path", "")
        if key is None or key == "":
            if path == "/" or path in OPEN_PATHS or path.startswith("/static/"):
                await self.lobby(scope, receive, send)
                return
            await refuse(
                self.bare,
                scope,
                receive,
                send,
                400,
                f"{self.registry.source} lists the tenants: name one with ?tenant=KEY "
                f"(the list: /). Its tenants: {self.registry.listed()}",
            )
            return
        tenant = self.registry.get(key)
        if tenant is None:
            await refuse(
                self.bare,
                scope,
                receive,
                send,
                404,
                f"no tenant {key[:80]!r} in {self.registry.source}. Its tenants: {self.registry.listed()}",
            )
            return
        await self.app_of(tenant)(scope, receive, send)


def tenant_param(scope: Scope) -> str | None:
    """The request's ``?tenant=`` (the first one; "" when given empty), or None."""
    query_string: bytes = scope.get("query_string", b"")
    values = parse_qs(query_string.decode("latin-1"), keep_blank_values=True).get("tenant")
    return values[0] if values else None


async def refuse(dashboard: _Dashboard, scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
    """Answer with ``dashboard``'s error page (or JSON under /api/) instead of any app."""
    request = Request(scope, receive)
    response = await _in_thread(lambda: dashboard.error_response(request, status, message))
    await response(scope, receive, send)


NO_REGISTRY = (
    "?tenant= needs a tenant registry: start the dashboard with TXBOX_TENANTS_FILE (or --tenants-file) or "
    "TXBOX_TENANTS_DATABASE_URL set. Example: TXBOX_TENANTS_FILE=tenants.toml"
)


class WithoutRegistry:
    """The dashboard without a registry, as ever; a request naming a tenant is a 400 saying
    how to configure one (rather than the default database's letters under a tenant's name)."""

    def __init__(self, app: ASGIApp, dashboard: _Dashboard) -> None:
        self.app = app
        self.dashboard = dashboard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and tenant_param(scope) is not None:
            await refuse(self.dashboard, scope, receive, send, 400, NO_REGISTRY)
            return
        await self.app(scope, receive, send)
