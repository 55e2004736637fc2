"""Handler middleware: hooks around every handler run, in the worker's transaction.

A middleware subclasses :class:`Middleware` and overrides the hooks it needs (the others
are no-ops); ``service.add_middleware(m)`` appends it to the service's ordered list
(docs/explanation/handle.md, "Handler middleware and the permission guard"):

- ``before(message, session)`` in list order, before ``handle``; raising fails the
  message as ``handle`` raising would (a :class:`~framework.errors.PermanentError`
  dead-letters it), and ``handle`` does not run;
- ``after(message, session, sent)`` in reverse order once ``handle`` returned; ``sent``
  holds the messages the handler wrote to its outbox;
- ``on_failure(message, exc)`` in reverse order, for each middleware whose ``before``
  ran, when ``before``, ``handle`` or ``after`` raised; what it raises itself is logged
  and dropped, the message fails with the original exception.

``before`` and ``after`` get the handler's own session: their writes commit exactly once
with the message, or not at all. A run that is rolled back (a batch mate failed) runs
again, hooks included; only what goes through ``session`` happens exactly once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from framework.envelope import Message
    from framework.outbox import Outbox
    from framework.sql.outbox import OutboxRow

log = logging.getLogger("txbox.middleware")


class Middleware:
    """Base of handler middleware: every hook does nothing until overridden."""

    def before(self, message: Message, session: Session) -> None:
        """Before ``handle``, in the message's transaction."""

    def after(self, message: Message, session: Session, sent: Sequence[OutboxRow]) -> None:
        """After ``handle`` returned, in the message's transaction (not yet committed)."""

    def on_failure(self, message: Message, exc: BaseException) -> None:
        """``before``, ``handle`` or ``after`` raised ``exc``; the transaction is rolled back after."""


@contextmanager
def hooks(chain: Sequence[Middleware], message: Message, session: Session, outbox: Outbox) -> Iterator[None]:
    """Run ``chain``'s hooks around the body of the ``with`` (one handler run)."""
    entered: list[Middleware] = []
    try:
        for middleware in chain:
            entered.append(middleware)
            middleware.before(message, session)
        yield
        for middleware in reversed(chain):
            middleware.after(message, session, outbox.written)
    except BaseException as exc:
        for middleware in reversed(entered):
            try:
                middleware.on_failure(message, exc)
            except Exception as again:  # a failing hook must not hide why the message failed
                log.error("%s.on_failure raised %s", type(middleware).__name__, type(again).__name__)
        raise
