"""Latency per stage of one service, summarised over all its message types.

``txbox analyze`` writes percentiles per (publisher, message type, stage) into
``analytics_latency``: percentiles of parts do not add up to percentiles of the whole, and
the largest p50 of the parts (what the dashboard showed first) lets one rare slow type
stand for the whole service. Here each part's percentiles are read as its distribution
(a quantile function through ``(0, 0)``, ``(0.5, p50)``, ``(0.9, p90)``, ``(0.99, p99)``
and ``(1, max)``, linear between them), the parts are mixed in proportion to their
samples, and the service's percentiles are read off the mix. A part alone keeps its own
figures exactly; mean and max are exact (docs/explanation/analytics.md, "Dashboard: latency per
stage").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

_KNOTS = ((0.5, "p50_ms"), (0.9, "p90_ms"), (0.99, "p99_ms"), (1.0, "max_ms"))
_STEPS = 64  # bisection steps: far below a millisecond for any latency a run reports


class _Part:
    """One row's distribution: a piecewise-linear quantile function through its percentiles."""

    def __init__(self, row: dict[str, Any]) -> None:
        self.samples = max(int(row.get("samples") or 0), 0)
        self.knots: list[tuple[float, float]] = [(0.0, 0.0)]
        for u, key in _KNOTS:
            value = row.get(key)
            if value is not None:
                # Non-decreasing even if a report row is not: a quantile function never falls.
                self.knots.append((u, max(float(value), self.knots[-1][1])))
        if self.knots[-1][0] < 1.0:  # no max: the last percentile known is taken as the top
            self.knots.append((1.0, self.knots[-1][1]))

    @property
    def top(self) -> float:
        return self.knots[-1][1]

    def cdf(self, x: float) -> float:
        """Share of this part's samples at most ``x`` ms."""
        if x >= self.top:
            return 1.0
        for (u0, x0), (u1, x1) in zip(self.knots, self.knots[1:], strict=False):
            if x < x1:
                return u0 if x1 == x0 else u0 + (u1 - u0) * (max(x, x0) - x0) / (x1 - x0)
        return 1.0


def _quantile(parts: Sequence[_Part], total: int, q: float) -> float:
    """The smallest latency at which ``q`` of all samples of ``parts`` have arrived."""
    lo, hi = 0.0, max(p.top for p in parts)
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        if sum(p.samples * p.cdf(mid) for p in parts) / total >= q:
            hi = mid
        else:
            lo = mid
    return hi


def summarise(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Samples, p50, p90, p99, max and mean of ``rows`` taken together (None where no row has samples)."""
    rows = list(rows)
    parts = [p for p in map(_Part, rows) if p.samples]
    total = sum(p.samples for p in parts)
    if not total:
        return {"samples": 0, "p50_ms": None, "p90_ms": None, "p99_ms": None, "max_ms": None, "mean_ms": None}
    # Rows without samples carry no mean; the mean is exact only when every counted row has one.
    counted = [r for r in rows if int(r.get("samples") or 0) > 0]
    mean = None
    if all(r.get("mean_ms") is not None for r in counted):
        mean = sum(int(r["samples"]) * float(r["mean_ms"]) for r in counted) / total
    maxes = [float(r["max_ms"]) for r in rows if r.get("max_ms") is not None]
    return {
        "samples": total,
        "p50_ms": _quantile(parts, total, 0.5),
        "p90_ms": _quantile(parts, total, 0.9),
        "p99_ms": _quantile(parts, total, 0.99),
        "max_ms": max(maxes) if maxes else None,
        "mean_ms": mean,
    }


def per_stage(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per stage: the summary over every message type, and ``types``, one summary each."""
    stages: dict[str, dict[str | None, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for row in rows:
        stages[str(row["stage"])][row.get("message_type")].append(row)
    out = []
    for stage in sorted(stages):
        by_type = stages[stage]
        types = sorted(
            ({"message_type": message_type, **summarise(parts)} for message_type, parts in by_type.items()),
            key=lambda t: (-t["samples"], t["message_type"] or ""),
        )
        out.append({"stage": stage, **summarise(r for parts in by_type.values() for r in parts), "types": types})
    return out
