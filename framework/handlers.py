"""Handler base classes users subclass.

A handler runs inside the worker's transaction that marks its inbox row processed:
whatever it writes through ``session`` and ``outbox`` commits exactly once with that
mark, or not at all. Raise RetryableError (or anything else) to retry later,
PermanentError to abandon at once.

Message versions (docs/explanation/receive.md, "Message versions"): a handler takes the
contract's current version of its message type unless ``versions`` names the versions it
takes as they are; ``upcasters`` turns an older version's payload into the current one
before ``handle`` sees it.

``handle`` may be ``async def handle(self, message, session, outbox)``: its ``session``
is then an ``AsyncSession`` joined to the same transaction, and every worker guarantee
holds as for a plain handler (docs/explanation/handle.md, "Async handlers"). Sync and async
handlers mix in one service.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar

from framework.errors import PayloadValidationError, PermanentError, VersionNotHandled

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from framework.contracts import MessageSpec
    from framework.envelope import Message
    from framework.outbox import Outbox

#: Turns the payload of an older message version into a payload of the current version.
Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class Handler:
    """Common base; use CommandHandler or EventHandler."""

    kind: ClassVar[str] = ""
    message_type: ClassVar[str] = ""
    #: Seconds one run may take before it counts as failed (None: the worker default).
    timeout: ClassVar[float | None] = None
    #: Attempts before the message is abandoned (None: the worker default).
    max_attempts: ClassVar[int | None] = None
    #: The ``message_version`` values ``handle`` takes as they are (None: the contract's
    #: current version, or any version when the contract declares none).
    versions: ClassVar[Collection[str] | None] = None
    #: Older version → function returning its payload as the current version's; ``handle``
    #: then gets the message as the current version.
    upcasters: ClassVar[Mapping[str, Upcaster]] = MappingProxyType({})
    #: Permissions the message's ``auth_token`` must grant before ``handle`` runs (None: no
    #: token needed; empty: a valid token, no particular permission), else its message is
    #: dead-lettered as ``unauthorized``
    #: (docs/explanation/handle.md, "Handler middleware and the permission guard").
    permissions: ClassVar[Collection[str] | None] = None
    #: Which messages of the type this service takes at all (None: every one): a selector on
    #: headers and envelope fields, e.g. ``"headers['x-tenant'] = 'acme' AND payload.count > 0"``.
    #: The receiver acks and counts a message it does not match without storing it; parsed
    #: at ``register`` (framework/selectors.py; docs/explanation/receive.md, "Expiry and filters").
    selector: ClassVar[str | None] = None

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement handle()")

    @property
    def name(self) -> str:
        return f"{type(self).__module__}.{type(self).__qualname__}"


class CommandHandler(Handler):
    """Handles a command this service accepts (its contract `publish`es it)."""

    kind = "command"


class EventHandler(Handler):
    """Handles an event this service subscribes to (its contract lists it in `x-subscribes`)."""

    kind = "event"


AWAITABLE_FIX = (
    "`handle` is a plain function that returned an awaitable: nothing of it ran, and its session is the "
    "synchronous one. Define it as `async def handle(self, message, session, outbox)` to be awaited with an "
    "AsyncSession, or return nothing"
)


# Handler class → whether its ``handle`` is a coroutine function: the worker asks per
# message, and the inspect call cost more than the answer's lookup.
_COROUTINE_CLASSES: dict[type[Handler], bool] = {}


def is_coroutine_handler(handler: Handler) -> bool:
    """``handler.handle`` is ``async def`` (or another coroutine function): it runs awaited, with an
    ``AsyncSession`` (docs/explanation/handle.md, "Async handlers"). Decided once per handler class; a
    ``handle`` set on the instance itself is looked at every time."""
    if "handle" in getattr(handler, "__dict__", ()):
        return inspect.iscoroutinefunction(handler.handle)
    cls = type(handler)
    known = _COROUTINE_CLASSES.get(cls)
    if known is None:
        known = _COROUTINE_CLASSES[cls] = inspect.iscoroutinefunction(handler.handle)
    return known


def takes_as_is(handler: Handler, spec: MessageSpec, version: str) -> bool:
    """``handle`` takes messages of ``version`` without an upcaster."""
    if handler.versions is not None:
        return version in handler.versions
    return spec.version is None or version == spec.version


def unhandled_versions(handler: Handler, spec: MessageSpec) -> list[str]:
    """Versions the contract declares that ``handler`` neither takes nor upcasts."""
    return [v for v in spec.versions if not takes_as_is(handler, spec, v) and v not in handler.upcasters]


def as_handled(handler: Handler, message: Message, spec: MessageSpec) -> Message:
    """``message`` in a version ``handler`` takes: as it is, or upcast to the current version.

    Raises VersionNotHandled (a PermanentError: the message is dead-lettered at once, a
    retry would not change it) when the handler has no way to take the version, and
    PermanentError when an upcaster returns a payload the current schema refuses.
    """
    version = message.message_version
    if takes_as_is(handler, spec, version):
        return message
    upcaster = handler.upcasters.get(version)
    if upcaster is None:
        takes = ", ".join(sorted(handler.versions)) if handler.versions is not None else str(spec.version)
        raise VersionNotHandled(
            f"{handler.name} does not take {message.message_type} version {version[:40]!r} (it takes "
            f"{takes}): add the version to its `versions`, or an upcaster for it to its `upcasters`"
        )
    payload = upcaster(dict(message.payload))
    try:
        spec.validate(payload)
    except PayloadValidationError as exc:
        raise PermanentError(
            f"the upcaster of {message.message_type} version {version[:40]!r} returned a payload the current "
            f"version's schema refuses: {exc}"
        ) from None
    return replace(message, payload=payload, message_version=spec.version or version)
