"""Output and history locations as the running session's Hadoop file systems see them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from framework.analytics.locations import Storage, location
from framework.errors import ConfigurationError


def test_a_write_the_driver_cannot_see_fails_loudly(spark: Any, tmp_path: Path) -> None:
    """What an executor-local path does on a cluster: the commit leaves only _SUCCESS on the driver's side."""
    storage = Storage(spark, location(str(tmp_path), "--parquet"), "--parquet")
    (tmp_path / "analytics_runs" / "run_id=x").mkdir(parents=True)
    (tmp_path / "analytics_runs" / "run_id=x" / "_SUCCESS").touch()
    with pytest.raises(ConfigurationError, match=r"driver sees no Parquet file.*shared mount"):
        storage.check_written("analytics_runs/run_id=x")
    spark.range(3).write.parquet(f"{storage.uri}/analytics_runs/run_id=y")
    storage.check_written("analytics_runs/run_id=y")
    assert storage.parquet_files("analytics_runs", limit=10) >= 1


def test_storage_this_spark_cannot_reach_fails_at_start(spark: Any) -> None:
    with pytest.raises(ConfigurationError, match="hadoop-aws"):
        Storage(spark, location("s3a://bucket/txbox", "--parquet"), "--parquet")
