"""What `txbox analyze` decides before Spark starts: locations, read partitions, the master."""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime, timedelta

import pytest

from framework.analytics.locations import location
from framework.analytics.read import partition_count, range_predicates
from framework.analytics.session import check_master, join_jars, parse_master, spark_conf
from framework.analytics.settings import AnalyzeSettings
from framework.analytics.sources import warn_if_loopback
from framework.errors import ConfigurationError


@pytest.mark.parametrize(
    ("given", "uri"),
    [
        ("s3a://bucket/txbox/reports", "s3a://bucket/txbox/reports"),
        ("hdfs://namenode:8020/txbox/", "hdfs://namenode:8020/txbox"),
        ("file:///srv/shared/txbox", "file:///srv/shared/txbox"),
        ("file:/srv/shared/txbox", "file:///srv/shared/txbox"),
        ("file://localhost/srv/x", "file:///srv/x"),
        ("/srv/plain path", "file:///srv/plain path"),
    ],
)
def test_locations_stay_uris(given: str, uri: str) -> None:
    assert location(given, "--parquet") == uri
    assert location(uri, "--parquet") == uri  # resolving twice changes nothing


def test_a_relative_path_is_the_drivers() -> None:
    assert location("reports", "--parquet") == "file://" + os.path.join(os.getcwd(), "reports")


@pytest.mark.parametrize(
    ("given", "fix"),
    [
        ("s3://bucket/x", "s3a://bucket/x"),
        ("ftp://host/x", "unknown storage scheme"),
        ("file://otherhost/x", "three slashes"),
        ("hdfs:///x", "needs a host"),
        ("  ", "is empty"),
    ],
)
def test_bad_locations_name_the_fix(given: str, fix: str) -> None:
    with pytest.raises(ConfigurationError, match=fix):
        location(given, "--parquet")


def test_range_predicates_cover_every_row_once() -> None:
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    cuts = [t0 + timedelta(hours=h) for h in (2, 1, 1, 3)]  # unsorted, with a repeat
    preds = range_predicates("created_at", cuts)
    assert len(preds) == 4
    assert preds[0] == "created_at < '2026-01-01T01:00:00+00:00'::timestamptz"
    assert preds[1] == (
        "created_at >= '2026-01-01T01:00:00+00:00'::timestamptz "
        "AND created_at < '2026-01-01T02:00:00+00:00'::timestamptz"
    )
    assert preds[-1] == "created_at >= '2026-01-01T03:00:00+00:00'::timestamptz"
    assert range_predicates("created_at", []) == ["TRUE"]


def test_partition_count() -> None:
    settings = AnalyzeSettings(partition_rows=100, max_partitions=8)
    assert [partition_count(n, settings) for n in (0, 1, 100, 101, 450, 10**6)] == [1, 1, 1, 2, 5, 8]


@pytest.mark.parametrize(
    "url", ["local", "local[*]", "local[4]", "local[2,3]", "yarn", "k8s://https://k8s.example:6443", "spark://a:7077"]
)
def test_master_forms(url: str) -> None:
    assert parse_master(url).url == url


def test_standalone_masters_and_loopback() -> None:
    master = parse_master("spark://m1:7077,[::1]:7078")
    assert master.addresses == (("m1", 7077), ("::1", 7078))
    assert not master.on_loopback
    assert parse_master("spark://127.0.0.1:7077").on_loopback and parse_master("local[2]").on_loopback


@pytest.mark.parametrize(
    ("url", "fix"),
    [
        ("sprak://host:7077", "not a Spark master URL"),
        ("spark://host", "is not HOST:PORT"),
        ("spark://host:99999", "is not HOST:PORT"),
        ("local[0]", "not a Spark master URL"),
        ("x" * 2000, "characters long"),
    ],
)
def test_wrong_masters_name_the_fix(url: str, fix: str) -> None:
    with pytest.raises(ConfigurationError, match=fix):
        parse_master(url)


def test_an_unreachable_master_fails_at_once() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(ConfigurationError, match=rf"spark://127.0.0.1:{port} is unreachable.*--master"):
            check_master(f"spark://127.0.0.1:{port}", timeout=2)
        sock.listen()
        assert check_master(f"spark://127.0.0.1:{port}", timeout=2).addresses == (("127.0.0.1", port),)


def test_spark_conf() -> None:
    assert spark_conf("spark.executor.memory = 512m") == ("spark.executor.memory", "512m")
    with pytest.raises(ConfigurationError, match=r"spark\.KEY=VALUE"):
        spark_conf("executor.memory=512m")


def test_loopback_sources_are_named_on_a_cluster(caplog: pytest.LogCaptureFixture) -> None:
    warn_if_loopback("postgresql://u@db.internal:5432/orders")
    assert not caplog.records
    warn_if_loopback("postgresql://u@127.0.0.1:5432/orders")
    warn_if_loopback("postgresql://u@localhost/orders")
    assert [r.message.count("each executor's own machine") for r in caplog.records] == [1, 1]


def test_jars_of_spark_submit_and_conf_are_kept_once() -> None:
    submitted = "file:///usr/share/java/postgresql.jar,file:///root/.ivy2/jars/hadoop-aws-3.4.1.jar"
    assert join_jars(submitted, "", "/usr/share/java/postgresql.jar") == submitted
    assert join_jars("", "/opt/a.jar, /opt/b.jar", "/usr/share/java/postgresql.jar").split(",") == [
        "/opt/a.jar",
        "/opt/b.jar",
        "/usr/share/java/postgresql.jar",
    ]
