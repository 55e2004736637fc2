"""`txbox bench latency`'s bars: ratios to the raw path of the same run, and the medians of
``--runs`` (tools/txbox_tools/bench/latency.py)."""

from __future__ import annotations

from typing import Any

import pytest

from txbox_tools.bench.latency import medians, ratios
from txbox_tools.bench.result import Result


def figures(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "p50_ms": 6.0,
        "raw_p50_ms": 2.5,
        "p99_ms": 9.0,
        "raw_p99_ms": 4.0,
        "cpu_cores": 0.6,
        "raw_cpu_cores": 0.3,
        "cpu_cores_by_component": {"run": 0.3, "postgres": 0.2},
        "deployment": "run",
    }
    return {**base, **overrides}


def result(**overrides: Any) -> Result:
    extra = figures(**overrides)
    extra.update(ratios(extra))
    return Result(stage="latency", messages=100, seconds=1.0, raw_limit_rate=100.0, raw_limit="raw", extra=extra)


def test_ratios_are_to_the_raw_path_of_the_run() -> None:
    got = ratios(figures())
    assert got["cpu_ratio"] == 2.0 and got["p50_ratio"] == 2.4 and got["p99_ratio"] == 2.25
    assert got["within_bars"] is True


def test_a_raw_latency_under_the_floor_counts_as_the_floor() -> None:
    got = ratios(figures(raw_p50_ms=0.5, raw_p99_ms=1.0, p50_ms=6.0, p99_ms=7.0))
    assert got["p50_ratio"] == 3.0 and got["p99_ratio"] == 3.5
    assert got["within_bars"] is False  # the p99's 3.5 is over 3


def test_cpu_over_its_bar_is_outside_the_bars() -> None:
    assert ratios(figures(cpu_cores=0.61))["within_bars"] is False


def test_medians_take_each_figure_run_by_run_and_keep_the_spread() -> None:
    runs = [
        result(cpu_cores=c, p50_ms=p, cpu_cores_by_component={"run": c / 2, "postgres": 0.2})
        for c, p in ((0.9, 5.0), (0.5, 8.0), (0.6, 6.0))
    ]
    got = medians(runs).as_dict()
    assert got["runs"] == 3
    assert got["cpu_cores"] == 0.6 and got["cpu_ratio"] == 2.0
    assert got["p50_ms"] == 6.0 and got["p50_ratio"] == 2.4
    assert got["spread"]["cpu_ratio"] == [pytest.approx(1.67), 3.0]
    assert got["spread"]["p50_ms"] == [5.0, 8.0]
    assert got["cpu_cores_by_component"] == {"run": 0.3, "postgres": 0.2}  # each part's own median
    assert got["deployment"] == "run"
    assert got["within_bars"] is True  # the medians are, though one run was not
