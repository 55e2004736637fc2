"""Wait until the daemons processed messages: for tests that do run them (docs/explanation/development.md,
"Testing handlers").

It polls the service's inbox table until every message is processed, and fails at once
when one was abandoned (its handler gave up): a test waiting for it would only time out.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable
from typing import Any

from psycopg import sql

from framework import db, names, tables
from framework.errors import NotProcessed
from framework.service import Service

POLL_INTERVAL = 0.05  # seconds between two looks at the inbox


def wait_until_processed(
    where: Service | str,
    message_ids: Iterable[uuid.UUID | str],
    *,
    timeout: float = 30.0,
    schema: str | None = None,
) -> None:
    """Return once the inbox of ``where`` (a Service, or a database URL) holds every one of
    ``message_ids`` processed; raise :class:`NotProcessed` if one is abandoned, or at the
    deadline naming those not received yet and those still pending (with their last error).
    """
    if isinstance(where, Service):
        url, schema = where.settings.database_url, schema or where.settings.schema
    else:
        url = where
    wanted = sorted({uuid.UUID(str(m)) for m in message_ids})
    query = sql.SQL(
        "SELECT id, processed_at IS NOT NULL, abandoned_at IS NOT NULL, last_error FROM {} WHERE id = ANY(%s)"
    ).format(sql.Identifier(schema or tables.SCHEMA, names.INBOX))
    deadline = time.monotonic() + timeout
    with db.connect(url, autocommit=True) as conn:
        while True:
            rows: dict[uuid.UUID, tuple[Any, ...]] = {r[0]: r for r in conn.execute(query, (wanted,))}
            abandoned = [f"{i}: {r[3]}" for i, r in rows.items() if r[2]]
            if abandoned:
                raise NotProcessed("abandoned instead of processed: " + "; ".join(abandoned))
            if all(i in rows and rows[i][1] for i in wanted):
                return
            if time.monotonic() >= deadline:
                missing = [str(i) for i in wanted if i not in rows]
                pending = [f"{i} (last error: {rows[i][3]})" for i in wanted if i in rows and not rows[i][1]]
                raise NotProcessed(
                    f"not processed within {timeout:g}s: "
                    + "; ".join(
                        part
                        for part in (
                            f"not in the inbox yet: {', '.join(missing)}" if missing else "",
                            f"received, not processed: {', '.join(pending)}" if pending else "",
                        )
                        if part
                    )
                )
            time.sleep(POLL_INTERVAL)
