"""Which database errors mean "the database failed" (retry elsewhere) and which blame the data."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa
from psycopg import errors

from framework import db
from framework.errors import DatabaseUnavailable


def wrapped(exc: Exception) -> sa.exc.DBAPIError:
    """As SQLAlchemy hands a driver error to a handler or the worker."""
    return sa.exc.DBAPIError.instance("SELECT 1", {}, exc, psycopg.Error)


@pytest.mark.parametrize(
    "exc",
    [
        psycopg.OperationalError("connection refused"),  # no SQLSTATE: below SQL
        psycopg.InterfaceError("the connection is closed"),
        errors.AdminShutdown("terminating connection due to administrator command"),
        errors.CannotConnectNow("the database system is starting up"),
        errors.TooManyConnections("sorry, too many clients already"),
        errors.DiskFull("could not extend file"),
        errors.ConnectionFailure("connection failure"),
        DatabaseUnavailable("cannot connect to PostgreSQL"),
    ],
    ids=type,
)
def test_infrastructure_failures(exc: Exception) -> None:
    assert db.is_infrastructure_error(exc)
    if isinstance(exc, psycopg.Error):
        assert db.is_infrastructure_error(wrapped(exc))


@pytest.mark.parametrize(
    "exc",
    [
        # psycopg files these under OperationalError, but they are about the statement.
        errors.ProgramLimitExceeded("index row size 9000 exceeds btree version 4 maximum 2704"),
        errors.LockNotAvailable("could not obtain lock on row"),
        errors.QueryCanceled("canceling statement due to statement timeout"),
        errors.UntranslatableCharacter("unsupported Unicode escape sequence"),
        errors.UniqueViolation("duplicate key value"),
        psycopg.ProgrammingError("the query has 2 placeholders but 1 parameters were passed"),
        ConnectionRefusedError("a handler's HTTP call failed"),
        ValueError("a handler's bug"),
    ],
    ids=type,
)
def test_failures_of_the_statement_or_the_handler(exc: Exception) -> None:
    assert not db.is_infrastructure_error(exc)
    if isinstance(exc, psycopg.Error):
        assert not db.is_infrastructure_error(wrapped(exc))


def test_conflicts_are_transient_and_not_outages() -> None:
    for exc in (errors.SerializationFailure("could not serialize"), errors.DeadlockDetected("deadlock")):
        assert db.is_transient_conflict(exc) and db.is_transient_conflict(wrapped(exc))
        assert not db.is_infrastructure_error(exc)
