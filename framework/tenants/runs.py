"""`txbox migrate` and `txbox check` over every tenant: a bounded pool, one outcome each.

One tenant's failure (its server down, its schema broken) is that tenant's outcome; the
others go on, and the caller's exit code says how many failed (docs/explanation/operations.md,
"Tenants: the registry"). Migrations run in processes, checks in threads: Alembic keeps
the migration being run in module globals (``alembic.op``, ``alembic.context``), one per
process, so two migrations in threads of one process would interleave their operations.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from framework import db, names, redaction
from framework.errors import TxboxError
from framework.tenants.model import Tenant

CONNECT_TIMEOUT = 10
"""Seconds a tenant's server has to answer, unless its URL sets ``connect_timeout`` itself."""
MAX_DETAIL_CHARS = 400


@dataclass(frozen=True)
class Outcome:
    """What happened to one tenant: ``ok`` and a line for people (masked, one line)."""

    tenant: Tenant
    ok: bool
    detail: str

    def __str__(self) -> str:
        where = f"{self.tenant.display_url} schema {self.tenant.schema}"
        state = "ok" if self.ok else "FAILED"
        return redaction.mask_credentials(f"tenant {self.tenant.key}: {state}: {where}: {self.detail}")


def error_text(exc: BaseException) -> str:
    """One masked line of ``exc`` (a driver's text without its SQL and its links)."""
    text = str(exc)
    for cut in ("\n[SQL:", "\n(Background on this error", "(Background on this error"):
        text = text.partition(cut)[0]
    text = " ".join(text.split())
    if not isinstance(exc, TxboxError):
        text = f"{type(exc).__name__}: {text}"
    return redaction.clip(redaction.redact_text(text), MAX_DETAIL_CHARS) or ""


def engine_for(database_url: str) -> Any:
    """An engine of one tenant's database: no pool (a command's few statements), and
    :data:`CONNECT_TIMEOUT` unless the URL sets its own. The caller disposes of it."""
    from sqlalchemy.pool import NullPool

    args = {} if "connect_timeout" in db.connect_params(database_url) else {"connect_timeout": CONNECT_TIMEOUT}
    return db.create_engine(database_url, poolclass=NullPool, connect_args=args)


def _revision(conn: Any, schema: str) -> str | None:
    from alembic.runtime.migration import MigrationContext

    ctx = MigrationContext.configure(
        conn, opts={"version_table": names.ALEMBIC_VERSION_TABLE, "version_table_schema": schema}
    )
    return ctx.get_current_revision()


def _quiet_worker() -> None:
    """A migration process's initializer: Alembic's INFO lines would interleave, untagged,
    with those of the other tenants; the parent prints one line per tenant instead."""
    logging.getLogger("alembic").setLevel(logging.WARNING)


def migrate_one(database_url: str, schema: str, revision: str, downgrade: bool) -> tuple[bool, str]:
    """Migrate one tenant (run in a worker process): (ok, "before → after" or the error).

    Returns rather than raises: a driver's exception need not survive pickling back.
    """
    from framework import migrate

    try:
        engine = engine_for(database_url)
        try:
            with db.database_errors("cannot migrate"), engine.connect() as conn:
                before = _revision(conn, schema)
                conn.rollback()
                step = migrate.downgrade if downgrade else migrate.upgrade
                step(database_url, schema, revision, connection=conn)
                after = _revision(conn, schema)
                conn.rollback()
        finally:
            engine.dispose()
    except Exception as exc:  # the tenant's failure, whatever raised it (the last resort)
        return False, error_text(exc)
    return True, f"{before or 'base'} → {after or 'base'}"


def migrate_all(
    tenants: Iterable[Tenant],
    *,
    revision: str = "head",
    downgrade: bool = False,
    jobs: int,
    report: Callable[[Outcome], None],
) -> list[Outcome]:
    """Migrate every tenant, ``jobs`` at a time, each in a process; ``report`` each as it ends."""
    tenants = list(tenants)
    outcomes: list[Outcome] = []
    if not tenants:
        return outcomes
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
    pool = ProcessPoolExecutor(max_workers=min(jobs, len(tenants)), mp_context=context, initializer=_quiet_worker)
    try:
        futures: dict[Future[tuple[bool, str]], Tenant] = {
            pool.submit(migrate_one, t.database_url, t.schema, revision, downgrade): t for t in tenants
        }
        for future in as_completed(futures):
            tenant = futures[future]
            try:
                ok, detail = future.result()
            except BrokenProcessPool:
                ok, detail = (
                    False,
                    (
                        f"the migration's process ended before it reported; run `txbox migrate --tenant {tenant.key}` "
                        "again and see its own output"
                    ),
                )
            except Exception as exc:  # what a worker could not return (the last resort)
                ok, detail = False, error_text(exc)
            outcome = Outcome(tenant, ok, detail)
            outcomes.append(outcome)
            report(outcome)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return outcomes


_REVISION = re.compile(r"[A-Za-z0-9_]{1,64}")


def check_one(tenant: Tenant, head: str | None, known: frozenset[str]) -> Outcome:
    """Whether ``tenant``'s database answers and its framework tables are at ``head``."""
    fix = f"run `txbox migrate --tenant {tenant.key}`"
    try:
        engine = engine_for(tenant.database_url)
        try:
            with db.database_errors("cannot connect"), engine.connect() as conn:
                revision = _revision(conn, tenant.schema)
        finally:
            engine.dispose()
    except Exception as exc:  # the tenant's failure, whatever raised it (the last resort)
        return Outcome(tenant, False, error_text(exc))
    if revision == head:
        return Outcome(tenant, True, f"migrated ({revision})")
    if revision is None:
        return Outcome(tenant, False, f"not migrated: no txbox tables yet; {fix}")
    shown = revision if _REVISION.fullmatch(revision) else repr(revision[:64])
    if revision not in known:
        return Outcome(
            tenant, False, f"at revision {shown}, which this txbox does not know: a newer txbox migrated it; upgrade"
        )
    return Outcome(tenant, False, f"at revision {shown}, head is {head}; {fix}")


def check_all(tenants: Iterable[Tenant], *, jobs: int, report: Callable[[Outcome], None]) -> list[Outcome]:
    """Check every tenant's database, ``jobs`` at a time; ``report`` each as it ends."""
    from alembic.script import ScriptDirectory

    from framework import migrate

    script = ScriptDirectory.from_config(migrate.alembic_config("postgresql+psycopg://", "txbox"))
    head = script.get_current_head()
    known = frozenset(r.revision for r in script.walk_revisions())
    tenants = list(tenants)
    outcomes: list[Outcome] = []
    if not tenants:
        return outcomes
    with ThreadPoolExecutor(max_workers=min(jobs, len(tenants)), thread_name_prefix="txbox-check") as pool:
        futures = [pool.submit(check_one, t, head, known) for t in tenants]
        for future in as_completed(futures):
            outcome = future.result()  # check_one returns every failure as an outcome
            outcomes.append(outcome)
            report(outcome)
    return outcomes
