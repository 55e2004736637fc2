"""A server that refuses writes (a standby now) makes the engine drop its pool.

docs/explanation/operations.md, "PostgreSQL failover". A session with
``default_transaction_read_only`` stands in for a demoted server: its writes fail with
SQLSTATE 25006 exactly as a standby's do.
"""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from framework import db


def test_a_read_only_connection_is_invalidated_and_not_handed_out_again(database_url: str) -> None:
    engine = db.create_engine(database_url, pool_size=1, max_overflow=0)
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("CREATE TABLE t (n int)")
            conn.commit()
            conn.exec_driver_sql("SET SESSION default_transaction_read_only = on")
            conn.commit()
            with pytest.raises(sa.exc.DBAPIError) as info:
                conn.exec_driver_sql("INSERT INTO t VALUES (1)")
            assert info.value.connection_invalidated
            assert db.is_infrastructure_error(info.value)
        with engine.begin() as conn:  # a new connection: it takes writes
            conn.exec_driver_sql("INSERT INTO t VALUES (2)")
            assert conn.exec_driver_sql("SHOW default_transaction_read_only").scalar() == "off"
    finally:
        engine.dispose()
