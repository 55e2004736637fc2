"""TXBOX_DATABASE_URL with several hosts: engine and raw connections reach the same servers.

docs/explanation/operations.md, "PostgreSQL failover".
"""

from __future__ import annotations

import psycopg
import psycopg.conninfo
import pytest

from framework import db
from framework.analytics.sources import jdbc_target
from framework.errors import ConfigurationError
from framework.settings import Settings

SAME_HOSTS = [
    "postgresql+psycopg://postgres:pw@/orders?host=pg-a:5432&host=pg-b:5433&target_session_attrs=read-write",
    "postgresql://postgres:pw@/orders?host=pg-a,pg-b&port=5432,5433&target_session_attrs=read-write",
]


@pytest.mark.parametrize("url", SAME_HOSTS)
def test_both_multi_host_forms_give_libpq_a_host_list(url: str) -> None:
    params = psycopg.conninfo.conninfo_to_dict(db.conninfo(url))
    assert params == {
        "host": "pg-a,pg-b",
        "port": "5432,5433",
        "dbname": "orders",
        "user": "postgres",
        "password": "pw",
        "target_session_attrs": "read-write",
    }


@pytest.mark.parametrize("url", SAME_HOSTS)
def test_raw_connections_and_the_engine_use_the_same_parameters(url: str) -> None:
    engine = db.create_engine(url)
    _, engine_params = engine.dialect.create_connect_args(engine.url)
    raw = psycopg.conninfo.conninfo_to_dict(db.conninfo(url))
    assert {k: str(v) for k, v in engine_params.items() if k in raw} == raw
    engine.dispose()


def test_a_single_host_keeps_its_options() -> None:
    params = psycopg.conninfo.conninfo_to_dict(db.conninfo("postgresql://u@h:6432/db?sslmode=disable"))
    assert params == {"host": "h", "port": "6432", "dbname": "db", "user": "u", "sslmode": "disable"}


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("postgresql+psycopg://postgres@pg-a:5432,pg-b:5432/orders", "as query parameters"),
        ("postgresql+psycopg://postgres@/orders?host=pg-a,pg-b", "target_session_attrs=read-write"),
        ("postgresql+psycopg://postgres@/orders?host=a:1&host=b:2&target_session_attrs=any", "several hosts"),
        ("postgresql+psycopg://postgres@/orders?host=a,b&port=1,2,3&target_session_attrs=read-write", "don't match"),
        ("postgresql+psycopg://postgres@/orders?host=a:1&host=b:2&port=3&target_session_attrs=primary", "mix"),
        ("postgresql+psycopg://postgres@h/orders?target_session_attrs=rw", "is not one of"),
        ("postgresql+psycopg://postgres@h/orders?no_such_option=1", "no_such_option"),
    ],
)
def test_a_bad_url_fails_at_start_with_the_fix(url: str, says: str) -> None:
    env = {"TXBOX_SERVICE": "order-service", "TXBOX_DATABASE_URL": url}
    with pytest.raises(ConfigurationError) as info:
        Settings.from_env(env)
    assert says in str(info.value)
    assert "Example: TXBOX_DATABASE_URL=postgresql+psycopg://" in str(info.value)


def test_a_read_only_server_is_an_infrastructure_error() -> None:
    """A standby (or a demoted primary) refuses writes: reconnect, do not blame the message."""
    error = psycopg.errors.ReadOnlySqlTransaction("cannot execute INSERT in a read-only transaction")
    assert db.is_infrastructure_error(error)


@pytest.mark.parametrize(
    ("url", "jdbc"),
    [
        (SAME_HOSTS[0], "jdbc:postgresql://pg-a:5432,pg-b:5433/orders?targetServerType=primary"),
        (
            "postgresql://u@/orders?host=pg-a,pg-b&target_session_attrs=read-write&sslmode=require",
            "jdbc:postgresql://pg-a:5432,pg-b:5432/orders?sslmode=require&targetServerType=primary",
        ),
    ],
)
def test_the_spark_job_follows_the_same_hosts(url: str, jdbc: str) -> None:
    assert jdbc_target(url).url == jdbc
