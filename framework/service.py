"""`Service`: one service's settings, contracts, handlers and the assembly check."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from framework.contracts import MessageSpec, Registry, ServiceContract, load_registry
from framework.errors import AssemblyError, ConfigurationError, ContractError, Problem, SelectorError
from framework.handlers import Handler, unhandled_versions
from framework.middleware import Middleware
from framework.outbox import Outbox
from framework.permissions import JwtSettings, PermissionGuard, TokenVerifier
from framework.selectors import Selector, parse
from framework.settings import Settings, load

if TYPE_CHECKING:
    from sqlalchemy import Connection
    from sqlalchemy.engine import Engine
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
    from sqlalchemy.orm import Session

    from framework.envelope import Message

H = TypeVar("H", bound=Handler)


class Service:
    """A service: who it is, where its database and broker are, and its handlers.

    ``Service(name=..., database_url=..., amqp_url=..., contracts_dir=...)`` or
    ``Service.from_env()`` (the ``TXBOX_*`` variables).
    """

    def __init__(
        self,
        name: str | None = None,
        database_url: str | None = None,
        amqp_url: str | None = None,
        contracts_dir: str | Path | None = None,
        schema: str | None = None,
        queue_type: str | None = None,
        *,
        settings: Settings | None = None,
    ) -> None:
        if settings is None:
            given = {
                "service": name,
                "database_url": database_url,
                "amqp_url": amqp_url,
                "contracts_dir": Path(contracts_dir) if contracts_dir is not None else None,
                "schema": schema,
                "queue_type": queue_type,
            }
            settings = Settings.from_env(environ={}, **given)
        self.settings = settings
        self._handlers: dict[str, Handler] = {}
        self._claims: dict[str, list[Handler]] = defaultdict(list)
        self._selectors: dict[str, Selector] = {}
        self._middleware: list[Middleware] = []
        #: How the permission guard verifies tokens; None: the ``TXBOX_JWT_*`` variables,
        #: read when the guard is first needed (``check()`` at start).
        self.jwt: JwtSettings | None = None

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: Any) -> Service:
        return cls(settings=Settings.from_env(environ, **overrides))

    def with_settings(self, **changes: Any) -> Service:
        """The same service — handlers, middleware, token settings — with other settings
        (``database_url=…``, ``amqp_url=…``): how tools point an app at their own servers."""
        fresh = Service(settings=dataclasses.replace(self.settings, **changes))
        for handler in self._handlers.values():
            fresh.register(handler)
        fresh._middleware = list(self._middleware)
        fresh.jwt = self.jwt
        return fresh

    @property
    def name(self) -> str:
        return self.settings.service

    @cached_property
    def registry(self) -> Registry:
        """All contracts of the contracts folder, loaded once (validators compiled once)."""
        return load_registry(self.settings.contracts_dir)

    @property
    def contract(self) -> ServiceContract:
        return self.registry.service(self.name)

    @cached_property
    def engine(self) -> Engine:
        from framework.db import create_engine

        return create_engine(self.settings.database_url)

    def register(self, handler: H) -> H:
        """Add a handler instance; conflicts are reported by :meth:`check`.

        Its ``selector`` is parsed here, so a malformed one stops the start with its position
        (docs/explanation/receive.md, "Expiry and filters").
        """
        if isinstance(handler, type):
            raise TypeError(f"register an instance: service.register({handler.__name__}())")
        selector = None
        if handler.selector is not None:
            try:
                selector = parse(handler.selector)
            except SelectorError as exc:
                raise SelectorError(f"{handler.name}.selector: {exc}") from None
        self._claims[handler.message_type].append(handler)
        if self._handlers.setdefault(handler.message_type, handler) is handler and selector is not None:
            self._selectors[handler.message_type] = selector
        return handler

    @property
    def handlers(self) -> dict[str, Handler]:
        return dict(self._handlers)

    def handler_for(self, message_type: str) -> Handler | None:
        return self._handlers.get(message_type)

    @property
    def selectors(self) -> dict[str, Selector]:
        """Message type → the selector its handler declared; the receiver stores only what matches."""
        return dict(self._selectors)

    def add_middleware(self, middleware: Middleware) -> Middleware:
        """Append ``middleware`` to the hooks around every handler run (framework/middleware.py)."""
        if not isinstance(middleware, Middleware):
            raise TypeError(f"{type(middleware).__name__} is not a framework.middleware.Middleware subclass instance")
        self._middleware.append(middleware)
        return middleware

    @property
    def middleware(self) -> tuple[Middleware, ...]:
        """The hooks around every handler run, in order: the permission guard first when a
        handler declares permissions (no other hook sees a message it refuses), then those added."""
        if any(h.permissions is not None for h in self._handlers.values()):
            return (self.permission_guard, *self._middleware)
        return tuple(self._middleware)

    @cached_property
    def permission_guard(self) -> PermissionGuard:
        """Verifies tokens for handlers that declare permissions; raises ConfigurationError
        (naming the variable and the fix) when ``TXBOX_JWT_*`` does not add up."""
        return PermissionGuard(self._permissions_for, TokenVerifier(self.jwt or load(JwtSettings)))

    def _permissions_for(self, message_type: str) -> Collection[str] | None:
        handler = self._handlers.get(message_type)
        return handler.permissions if handler is not None else None

    def outbox(
        self, session: Session | Connection | AsyncSession | AsyncConnection, *, incoming: Message | None = None
    ) -> Outbox:
        """An outbox writing into ``session``'s current transaction (blocking or asyncio:
        docs/explanation/write.md, "Async outbox")."""
        return Outbox(
            session,
            self.registry,
            schema=self.settings.schema,
            incoming=incoming,
            commit_pipeline=self.settings.outbox_commit_pipeline,
        )

    def problems(self, *, runs_handlers: bool = True) -> list[Problem]:
        """Everything that does not fit (errors) or looks wrong (warnings).

        ``runs_handlers=False`` (the receiver, the publisher, the collector): a message type
        the service receives without a handler is no misfit of a daemon that runs none;
        every other finding, on the handlers registered too, stands.
        """
        try:
            registry = load_registry(self.settings.contracts_dir, strict=False)
        except ContractError as exc:
            return [Problem("error", "contracts", str(exc))]
        problems = list(registry.problems)
        if registry.errors:
            return problems
        if self.name not in registry.services:
            problems.append(
                Problem(
                    "error",
                    "contracts",
                    f"no contract declares service {self.name!r} "
                    f"(found: {', '.join(sorted(registry.services)) or 'none'})",
                )
            )
            return problems
        accepted = {spec.message_type: spec for spec in registry.accepted_types(self.name)}
        for message_type, claimants in self._claims.items():
            problems += self._claim_problems(registry, accepted, message_type, claimants)
        try:
            self.middleware  # noqa: B018 -- builds the permission guard if needed: bad settings fail at start
        except ConfigurationError as exc:
            problems.append(Problem("error", "permissions", str(exc)))
        for message_type, spec in sorted(accepted.items()) if runs_handlers else ():
            if message_type not in self._handlers:
                what = "accepts command" if spec.kind == "command" else "subscribes to event"
                problems.append(
                    Problem("error", self.name, f"{what} {message_type} but no handler is registered for it")
                )
        return problems

    def _claim_problems(
        self, registry: Registry, accepted: dict[str, MessageSpec], message_type: str, claimants: list[Handler]
    ) -> list[Problem]:
        """What does not fit in the handlers that claim ``message_type``."""
        where = ", ".join(h.name for h in claimants)
        if not message_type:
            return [Problem("error", where, "handler does not set `message_type`")]
        problems = []
        if len(claimants) > 1:
            problems.append(
                Problem("error", where, f"{len(claimants)} handlers claim message type {message_type!r}; keep one")
            )
        handler = claimants[0]
        spec = registry.messages.get(message_type)
        if spec is None:
            one_type = registry.aliases.get(message_type)
            problems.append(
                Problem(
                    "error",
                    handler.name,
                    f"handles {message_type!r}, an alias of {one_type!r} (messages are stored and handled under "
                    f"that type): set message_type = {one_type!r}"
                    if one_type
                    else f"handles unknown message type {message_type!r}: no contract declares it",
                )
            )
            return problems
        if handler.kind and handler.kind != spec.kind:
            what, base = ("a command", "CommandHandler") if spec.kind == "command" else ("an event", "EventHandler")
            problems.append(Problem("error", handler.name, f"{message_type} is {what}: subclass {base}"))
        if message_type not in accepted:
            how = (
                f"it is a command of {spec.service}"
                if spec.kind == "command"
                else f"add {spec.routing_key!r} to `x-subscribes` in {registry.services[self.name].path}"
            )
            problems.append(Problem("error", handler.name, f"{self.name} does not receive {message_type} ({how})"))
            return problems
        return [*problems, *_version_problems(self.name, handler, spec), *_permission_problems(handler)]

    def check(self, *, runs_handlers: bool = True) -> list[Problem]:
        """Assembly validation: raise AssemblyError naming every misfit.

        Returns the warnings when nothing is wrong. ``runs_handlers``: as :meth:`problems`.
        """
        problems = self.problems(runs_handlers=runs_handlers)
        errors = [p for p in problems if p.severity == "error"]
        if errors:
            raise AssemblyError(errors)
        return problems

    def __repr__(self) -> str:
        return f"Service(name={self.name!r}, handlers={sorted(self._handlers)})"


def _permission_problems(handler: Handler) -> list[Problem]:
    """``permissions = "orders:write"`` would be read as letters: a collection of names is needed."""
    permissions = handler.permissions
    if permissions is None:
        return []
    if isinstance(permissions, str | bytes) or not all(isinstance(p, str) and p.strip() for p in permissions):
        return [
            Problem(
                "error",
                handler.name,
                f"permissions = {permissions!r}: name them in a collection of non-empty strings, "
                "e.g. permissions = {'inventory:restock'}",
            )
        ]
    return []


def _version_problems(service: str, handler: Handler, spec: MessageSpec) -> list[Problem]:
    """A version the service receives that its handler cannot take is an error (its messages
    would be dead-lettered); naming one the contract does not declare is a warning (a typo,
    or a version no receiver admits)."""
    problems = [
        Problem(
            "error",
            handler.name,
            f"{service} receives {spec.message_type} version {version!r} but the handler cannot take it: "
            f"add {version!r} to its `versions`, or an upcaster for it to its `upcasters`",
        )
        for version in unhandled_versions(handler, spec)
    ]
    unknown = sorted({*(handler.versions or ()), *handler.upcasters} - set(spec.versions))
    if unknown:
        problems.append(
            Problem(
                "warning",
                handler.name,
                f"names {spec.message_type} version(s) {', '.join(map(repr, unknown))} that its contract does not "
                f"declare (declared: {', '.join(spec.versions) or 'none, see x-message-version'})",
            )
        )
    return problems
