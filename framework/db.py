"""Database adapter: engines, raw connections for the hot paths, error conversion.

SQLAlchemy serves the public API (the caller's Session or Connection); the daemons' hot
paths use raw psycopg connections with named SQL, which cost less per row than ORM
objects and their unit of work. Both come from one URL.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
import psycopg._queries
import psycopg.conninfo
import psycopg.sql
import sqlalchemy as sa
from psycopg.types.json import set_json_loads
from sqlalchemy.dialects.postgresql.psycopg import PGDialect_psycopg
from sqlalchemy.engine import URL, Dialect, Engine, make_url

from framework import jsoncodec, logs
from framework.errors import ConfigurationError, DatabaseUnavailable

# SQLSTATEs that mean "the database failed", not "this statement (so its message) is bad":
# connection exceptions (08), insufficient resources (53: disk full, out of memory, too
# many connections), the server shutting down or refusing connections (57P0x), system
# errors (58), and a read-only transaction (25006): with target_session_attrs=read-write
# that means the server became a standby under us, so reconnect, which finds the primary
# (docs/explanation/operations.md, "PostgreSQL failover"). Everything else a statement raises is
# about that statement — psycopg files a program limit (54000), a lock timeout (55P03) or
# a cancelled statement (57014) under OperationalError too, but retrying them elsewhere
# would only fail the same way.
_INFRA_SQLSTATE_PREFIXES = ("08", "53", "57P", "58", "25006")


def widen_statement_cache() -> None:
    """Let psycopg cache the parse of the daemons' large batch statements (process-wide, once).

    psycopg parses a statement's placeholders once and caches the result, but only for
    statements under 4 KB with at most 50 parameters, to keep ORMs' one-off INSERTs with a
    varying number of rows out of its cache. The worker's batches are not one-off: every
    full batch flushes the same multi-row INSERT (500 rows, 2,000 parameters), and parsing
    it again at every batch was a measurable share of the worker's time
    (benchmarks/code-choices.md, "The worker's batch INSERT and psycopg's parse cache").
    The cache stays bounded (128 statements, each at most 1 MB here); the limits are
    module attributes of psycopg since 3.0, set only if they are still there. Called by
    :func:`framework.drivers.tune_drivers` when a daemon starts, never at import.
    """
    if hasattr(psycopg._queries, "MAX_CACHED_STATEMENT_PARAMS"):
        psycopg._queries.MAX_CACHED_STATEMENT_PARAMS = max(psycopg._queries.MAX_CACHED_STATEMENT_PARAMS, 1 << 16)
        psycopg._queries.MAX_CACHED_STATEMENT_LENGTH = max(psycopg._queries.MAX_CACHED_STATEMENT_LENGTH, 1 << 20)


EXAMPLE_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/orders"
EXAMPLE_MULTI_HOST_URL = (
    "postgresql+psycopg://postgres@/orders?host=pg-a:5432&host=pg-b:5432&target_session_attrs=read-write"
)

# What libpq's target_session_attrs accepts; with several hosts only the two that reach a
# server taking writes will do (docs/explanation/operations.md, "PostgreSQL failover").
_SESSION_ATTRS = ("any", "read-write", "read-only", "primary", "standby", "prefer-standby")
_WRITABLE_ATTRS = ("read-write", "primary")
_DIALECT: Dialect = PGDialect_psycopg()  # type: ignore[no-untyped-call]  # untyped in SQLAlchemy


def parse_url(database_url: str) -> URL:
    """The SQLAlchemy URL of ``TXBOX_DATABASE_URL`` (driver psycopg); a bad form fails with the fix."""
    try:
        url = make_url(database_url)
        url.port  # noqa: B018 - a libpq-style host list ('a:5432,b:5432') fails only here
    except (sa.exc.ArgumentError, ValueError) as exc:
        if "," in database_url.partition("?")[0]:
            raise ConfigurationError(
                "TXBOX_DATABASE_URL lists several hosts before the database name, which SQLAlchemy cannot "
                "read: give them as query parameters (host=HOST:PORT once per host, or host=a,b&port=p1,p2). "
                f"Example: TXBOX_DATABASE_URL={EXAMPLE_MULTI_HOST_URL}"
            ) from None
        raise ConfigurationError(
            f"TXBOX_DATABASE_URL is not a valid URL ({exc}). Example: TXBOX_DATABASE_URL={EXAMPLE_URL}"
        ) from None
    if url.drivername in ("postgresql", "postgres"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def connect_params(database_url: str) -> dict[str, str]:
    """libpq keywords of a SQLAlchemy URL: exactly what the engine's own connections use.

    The psycopg dialect turns the multi-host forms (``host=a:5432&host=b:5432`` or
    ``host=a,b&port=5432,5432``) into libpq's ``host=a,b port=5432,5432``, so the raw
    connections (hot paths, LISTEN) reach the same server as the engine's pool.
    """
    url = parse_url(database_url)
    try:
        _, params = _DIALECT.create_connect_args(url)
    except sa.exc.ArgumentError as exc:
        raise ConfigurationError(
            f"TXBOX_DATABASE_URL: {exc}. Example: TXBOX_DATABASE_URL={EXAMPLE_MULTI_HOST_URL}"
        ) from None
    attrs = params.get("target_session_attrs")
    if attrs is not None and attrs not in _SESSION_ATTRS:
        raise ConfigurationError(
            f"TXBOX_DATABASE_URL: target_session_attrs={attrs!r} is not one of {', '.join(_SESSION_ATTRS)}. "
            f"Example: TXBOX_DATABASE_URL={EXAMPLE_MULTI_HOST_URL}"
        )
    if len(str(params.get("host") or "").split(",")) > 1 and attrs not in _WRITABLE_ATTRS:
        # Without it libpq takes the first server that answers, a standby as well: every
        # write would then fail as "read-only transaction" until someone restarts us.
        raise ConfigurationError(
            "TXBOX_DATABASE_URL lists several hosts but not target_session_attrs=read-write (or primary): "
            "the daemons write, so they must reach the primary whichever host it is. "
            f"Example: TXBOX_DATABASE_URL={EXAMPLE_MULTI_HOST_URL}"
        )
    return {k: str(v) for k, v in params.items()}


def conninfo(database_url: str) -> str:
    """libpq connection string (keyword form) of a SQLAlchemy URL: see :func:`connect_params`."""
    try:
        return psycopg.conninfo.make_conninfo("", **connect_params(database_url))
    except psycopg.ProgrammingError as exc:  # an option libpq does not know
        raise ConfigurationError(
            f"TXBOX_DATABASE_URL: {str(exc).strip()}. Example: TXBOX_DATABASE_URL={EXAMPLE_URL}"
        ) from None


def create_engine(database_url: str, **kwargs: Any) -> Engine:
    url = parse_url(database_url)
    # A pooled connection may be to a server that died or failed over: the ping finds it
    # before a statement does (docs/explanation/operations.md, "PostgreSQL failover").
    kwargs.setdefault("pool_pre_ping", True)
    kwargs.setdefault("json_deserializer", jsoncodec.loads)
    engine = sa.create_engine(url, **kwargs)
    # Plain INSERTs of many ORM rows (a batch of handlers' writes, flushed together) go out
    # as multi-row INSERT ... VALUES statements, as SQLAlchemy does for psycopg2, instead of
    # one pipelined statement per row: one statement per batch for PostgreSQL to parse and
    # psycopg to send, instead of one per row.
    engine.dialect.use_insertmanyvalues_wo_returning = True
    sa.event.listen(engine, "handle_error", _read_only_is_a_disconnect)
    return engine


def _read_only_is_a_disconnect(context: sa.engine.ExceptionContext) -> None:
    """A server refusing writes is a standby now: drop the pool, whose next connections
    (target_session_attrs=read-write) find the primary."""
    orig = context.original_exception
    if isinstance(orig, psycopg.errors.ReadOnlySqlTransaction):
        context.is_disconnect = True


def connect(
    database_url: str,
    *,
    autocommit: bool = False,
    synchronous_commit: bool = True,
    generic_plans: bool = False,
    **kwargs: Any,
) -> psycopg.Connection[Any]:
    """A raw psycopg connection; connection failures become DatabaseUnavailable.

    ``synchronous_commit=False``: its commits do not wait for the WAL flush, for the
    daemons' leases and marks that a database crash may lose without harm (each caller
    says why). ``generic_plans=True``: its prepared statements keep one plan instead of
    being planned again on every run (docs/explanation/daemons.md, "Generic plans"), for
    statements whose plan does not depend on their parameters' values. Both are set per
    session, so options in the URL stay as they are.
    """
    try:
        conn = psycopg.connect(conninfo(database_url), autocommit=autocommit, **kwargs)
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to PostgreSQL: {exc}".strip()) from exc
    settings = []
    if not synchronous_commit:
        settings.append("SET synchronous_commit = off")
    if generic_plans:
        settings.append("SET plan_cache_mode = force_generic_plan")
    if settings:
        try:
            for statement in settings:
                conn.execute(statement)
            if not autocommit:
                conn.commit()
        except BaseException:
            conn.close()
            raise
    set_json_loads(jsoncodec.loads, conn)
    return conn


def is_infrastructure_error(exc: BaseException) -> bool:
    """True when ``exc`` says the database (not the data) failed: retry, don't blame the message."""
    if isinstance(exc, sa.exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig if exc.orig is not None else exc
    if isinstance(exc, psycopg.InterfaceError):
        return True
    if isinstance(exc, psycopg.Error):
        if exc.sqlstate is None:  # failed below SQL: refused, closed or reset connection
            return isinstance(exc, psycopg.OperationalError)
        return exc.sqlstate.startswith(_INFRA_SQLSTATE_PREFIXES)
    # Not ConnectionError: a handler's failed HTTP call is the message's failure to retry,
    # not a reason for the worker to drop its database connection.
    return isinstance(exc, DatabaseUnavailable)


def is_transient_conflict(exc: BaseException) -> bool:
    """Serialization failure or deadlock: retry the transaction, not the handler's fault."""
    if isinstance(exc, sa.exc.DBAPIError) and exc.orig is not None:
        exc = exc.orig
    return isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected)


@contextmanager
def database_errors(what: str) -> Iterator[None]:
    """Convert driver connection errors to DatabaseUnavailable at the adapter boundary."""
    try:
        yield
    except (psycopg.OperationalError, sa.exc.OperationalError) as exc:
        raise DatabaseUnavailable(f"{what}: {exc}".strip()) from exc


# The columns the daemons' claims filter, join and order on: the only statistics their
# plans need. Leaving out the JSON columns, the widest, makes an ANALYZE cheap enough
# for the daemons to run one whenever a burst made the statistics wrong
# (benchmarks/code-choices.md, "Planner statistics: ANALYZE and the slow-claim bar").
PLANNING_COLUMNS = (
    "id",
    "segment",
    "priority",
    "concurrency",
    "created_at",
    "locked_until",
    "processed_at",
    "abandoned_at",
    "started_attempts",
    "finished_attempts",
)


def needs_analyze(schema: str, table: str) -> psycopg.sql.Composed:
    """True when more rows changed since the last ANALYZE than it counted (and > 1,000).

    The daemons' claims lean on partial indexes over pending rows; statistics taken
    before a burst make the planner misjudge them badly (seconds per claim), and
    autovacuum may not analyze for a minute or more. So the daemons check this now and
    then and run :func:`analyze` themselves (see :class:`Statistics`).
    """
    return psycopg.sql.SQL(
        "SELECT n_mod_since_analyze > greatest(1000, n_live_tup / 2) "
        "FROM pg_stat_user_tables WHERE relid = {}::regclass"
    ).format(psycopg.sql.Literal(f"{schema}.{table}"))


def analyze(schema: str, table: str) -> psycopg.sql.Composed:
    """ANALYZE of the :data:`PLANNING_COLUMNS` of a txbox table."""
    return psycopg.sql.SQL("ANALYZE {} ({})").format(
        psycopg.sql.Identifier(schema, table),
        psycopg.sql.SQL(", ").join(psycopg.sql.Identifier(c) for c in PLANNING_COLUMNS),
    )


class Statistics:
    """Keeps the planner's statistics of one txbox table fit for its daemon's claims.

    Statistics taken while every row was processed say "no pending rows", and statistics
    taken while the table was small misjudge it once it has grown. Each plan we saw go
    wrong that way is now written so it cannot (the ``ctid`` matches and the spellings of
    "pending" in framework/tables.py); the worst made an inbox claim probe every pending
    row for each head of a segment (benchmarks/code-choices.md, "Planner statistics:
    ANALYZE and the slow-claim bar"). This refresh stays as the second line for plans
    not seen yet: :meth:`refresh` is called on a timer (the gauges) and,
    ``urgent``, right after a slow claim, so a bad plan lasts one claim rather than until
    the next timer tick.
    """

    URGENT_INTERVAL = 2.0  # seconds between two ANALYZEs after slow claims, at least

    def __init__(self, schema: str, table: str, *, min_interval: float) -> None:
        self._table = f"{schema}.{table}"
        self._needs = needs_analyze(schema, table)
        self._analyze = analyze(schema, table)
        self._min_interval = min_interval
        self._last = -min_interval

    @staticmethod
    def slow(seconds: float, rows: int) -> bool:
        """A claim far slower than a fresh plan makes it: over 50 ms plus 0.5 ms per row.

        The bar sits above what fresh plans took on a machine kept busy by the daemons and
        below what misplanned ones took, so a busy moment does not cost an ANALYZE
        (benchmarks/code-choices.md, "Planner statistics: ANALYZE and the slow-claim bar").
        """
        return seconds > 0.05 + 0.0005 * rows

    def after_claim(self, conn: psycopg.Connection[Any], seconds: float, rows: int, log: logs.Log) -> None:
        """Call after each claim: if it was :meth:`slow`, ANALYZE now when stale.

        Never raises: the claim is done, and a failure here must not cost its rows. Leaves
        no transaction open (an idle one would hold back vacuum).
        """
        if not self.slow(seconds, rows):
            return
        try:
            with conn.cursor() as cur:
                if self.refresh(cur, time.monotonic(), urgent=True):
                    log.info(
                        "slow claim (%.0f ms for %d rows): %s statistics refreshed", seconds * 1000, rows, self._table
                    )
            if not conn.autocommit:
                conn.commit()
        except psycopg.Error as exc:
            log.debug("could not refresh the statistics of %s: %r", self._table, exc)
            if not conn.autocommit:
                with suppress(psycopg.Error):
                    conn.rollback()

    def refresh(self, cur: psycopg.Cursor[Any], now: float, *, urgent: bool = False) -> bool:
        """ANALYZE if stale, at most once per ``min_interval`` (``urgent``: once per
        :attr:`URGENT_INTERVAL`). True if it ran."""
        if now - self._last < (self.URGENT_INTERVAL if urgent else self._min_interval):
            return False
        row = cur.execute(self._needs).fetchone()
        if not (row and row[0]):
            return False
        cur.execute(self._analyze)
        self._last = now
        return True
