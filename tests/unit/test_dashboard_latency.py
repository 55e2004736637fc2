"""The dashboard's latency per stage summarises every message type of a service."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from framework.dashboard.latency import per_stage, summarise


def _row(message_type: str | None, samples: int, p50: float, p99: float, **more: Any) -> dict[str, Any]:
    row = {"stage": "end_to_end", "message_type": message_type, "samples": samples, "p50_ms": p50, "p99_ms": p99}
    return {**row, **more}


def test_one_row_keeps_its_own_figures() -> None:
    out = summarise([_row("A", 10, 12.4, 80.6, p90_ms=40.0, max_ms=120.0, mean_ms=20.0)])
    assert out["samples"] == 10
    assert out["p50_ms"] == pytest.approx(12.4) and out["p90_ms"] == pytest.approx(40.0)
    assert out["p99_ms"] == pytest.approx(80.6) and out["max_ms"] == 120.0 and out["mean_ms"] == 20.0


def test_a_rare_slow_type_does_not_stand_for_the_service() -> None:
    common = _row("OrderPlaced", 10_000, 10.0, 20.0, p90_ms=15.0, max_ms=30.0, mean_ms=11.0)
    rare = _row("AuditExported", 5, 5_000.0, 9_000.0, p90_ms=8_000.0, max_ms=9_500.0, mean_ms=5_500.0)
    (stage,) = per_stage([rare, common])
    assert stage["samples"] == 10_005
    assert 9.0 < stage["p50_ms"] < 11.0  # the largest p50 of the parts said 5000
    assert stage["p99_ms"] < 30.0  # 5 of 10,005 samples are beyond the 99.9th percentile
    assert stage["max_ms"] == 9_500.0
    assert stage["mean_ms"] == pytest.approx((10_000 * 11.0 + 5 * 5_500.0) / 10_005)
    assert [t["message_type"] for t in stage["types"]] == ["OrderPlaced", "AuditExported"]
    assert stage["types"][1]["p50_ms"] == pytest.approx(5_000.0)


def test_rows_of_one_type_from_two_publishers_are_one_detail() -> None:
    rows = [_row("A", 100, 10.0, 20.0, publisher="x"), _row("A", 100, 30.0, 40.0, publisher="y")]
    (stage,) = per_stage(rows)
    assert len(stage["types"]) == 1 and stage["types"][0]["samples"] == 200
    assert 10.0 < stage["p50_ms"] < 30.0


def test_rows_without_samples_or_percentiles_give_no_figures() -> None:
    assert summarise([_row("A", 0, 1.0, 2.0)])["p50_ms"] is None
    assert summarise([])["samples"] == 0


_ms = st.floats(min_value=0, max_value=1e7, allow_nan=False)


@given(st.lists(st.tuples(st.integers(0, 10**6), _ms, _ms, _ms), min_size=1, max_size=8))
def test_the_summary_lies_within_its_parts(parts: list[tuple[int, float, float, float]]) -> None:
    rows = [_row(str(i), n, a, b, max_ms=c) for i, (n, a, b, c) in enumerate(parts)]
    out = summarise(rows)
    counted = [r for r in rows if r["samples"]]
    if not counted:
        assert out["p50_ms"] is None
        return
    assert out["p50_ms"] <= out["p90_ms"] <= out["p99_ms"]
    top = max(max(r["p50_ms"], r["p99_ms"], r["max_ms"]) for r in counted)
    assert 0 <= out["p50_ms"] <= top * (1 + 1e-9) + 1e-9
