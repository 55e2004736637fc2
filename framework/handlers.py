"""Handler base classes users subclass.

A handler runs inside the worker's transaction that marks its inbox row processed:
whatever it writes through ``session`` and ``outbox`` commits exactly once with that
mark, or not at all. Raise RetryableError (or anything else) to retry later,
PermanentError to abandon at once.

``handle`` must be a plain function for now: the worker does not await coroutines, so
``Service.check()`` and the worker refuse an ``async def handle`` rather than mark its
message processed with its effects never run.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from framework.envelope import Message
    from framework.outbox import Outbox


class Handler:
    """Common base; use CommandHandler or EventHandler."""

    kind: ClassVar[str] = ""
    message_type: ClassVar[str] = ""
    #: Seconds one run may take before it counts as failed (None: the worker default).
    timeout: ClassVar[float | None] = None
    #: Attempts before the message is abandoned (None: the worker default).
    max_attempts: ClassVar[int | None] = None

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


ASYNC_HANDLE_FIX = (
    "`handle` is a coroutine function (async def), which the worker does not await yet: its message "
    "would be marked processed without its effects. Define it as a plain "
    "`def handle(self, message, session, outbox)`"
)


def is_coroutine_handler(handler: Handler) -> bool:
    """``handler.handle`` is ``async def`` (or another coroutine function): the worker refuses it."""
    return inspect.iscoroutinefunction(handler.handle)
