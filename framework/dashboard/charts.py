"""Charts as inline SVG drawn on the server: no JavaScript, no chart library, readable in
a screenshot, and safe under a strict Content-Security-Policy."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from html import escape
from typing import Any

from markupsafe import Markup

WIDTH, HEIGHT = 560, 150
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 10, 22


@dataclass(frozen=True)
class Series:
    label: str
    values: list[int]
    color: str
    kind: str = "bar"  # "bar" or "line"


def _nice_max(value: int) -> int:
    if value <= 5:
        return 5
    magnitude = 10 ** (len(str(value)) - 1)
    for step in (1, 2, 2.5, 5, 10):
        top = int(step * magnitude)
        if top >= value:
            return top
    return value


def _label(iso: str, bucket_seconds: int) -> str:
    at = datetime.fromisoformat(iso)
    return at.strftime("%H:%M") if bucket_seconds < 6 * 3600 else at.strftime("%d %b %H:%M")


def bar_chart(title: str, buckets: list[str], bucket_seconds: int, series: list[Series]) -> Markup:
    """Bars for the first ``bar`` series side by side, ``line`` series drawn over them."""
    n = max(len(buckets), 1)
    top = _nice_max(max((max(s.values, default=0) for s in series), default=0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    slot = plot_w / n
    bars = [s for s in series if s.kind == "bar"]
    bar_w = max(slot * 0.8 / max(len(bars), 1), 1.0)

    def y(v: int) -> float:
        return TOP + plot_h - (v / top) * plot_h

    out = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
    ]
    for frac in (0.0, 0.5, 1.0):  # grid with labels
        gy = y(int(top * frac))
        out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{gy:.1f}" y2="{gy:.1f}" class="grid"/>')
        out.append(f'<text x="{LEFT - 6}" y="{gy + 4:.1f}" text-anchor="end" class="axis">{int(top * frac):,}</text>')
    for i, s in enumerate(bars):
        for j, v in enumerate(s.values):
            if v <= 0:
                continue
            x = LEFT + j * slot + slot * 0.1 + i * bar_w
            out.append(
                f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bar_w:.1f}" height="{TOP + plot_h - y(v):.1f}" '
                f'fill="{s.color}"><title>{escape(s.label)} {_label(buckets[j], bucket_seconds)}: {v:,}</title></rect>'
            )
    for s in series:
        if s.kind != "line" or not s.values:
            continue
        points = " ".join(f"{LEFT + (j + 0.5) * slot:.1f},{y(v):.1f}" for j, v in enumerate(s.values))
        out.append(f'<polyline points="{points}" fill="none" stroke="{s.color}" stroke-width="2"/>')
    for j in sorted({0, n // 2, n - 1}):  # time labels: start, middle, end
        if j < len(buckets):
            x = LEFT + (j + 0.5) * slot
            anchor = "start" if j == 0 else "end" if j == n - 1 else "middle"
            out.append(
                f'<text x="{x:.1f}" y="{HEIGHT - 6}" text-anchor="{anchor}" class="axis">'
                f"{_label(buckets[j], bucket_seconds)}</text>"
            )
    out.append("</svg>")
    return Markup("".join(out))  # every interpolated text is escaped above


def legend(series: list[Series]) -> Markup:
    items = "".join(
        f'<span class="key"><svg width="12" height="12" aria-hidden="true"><rect width="12" height="12" '
        f'fill="{s.color}"/></svg> {escape(s.label)}</span>'
        for s in series
    )
    return Markup(f'<div class="legend">{items}</div>')


P50_COLOR, P99_COLOR = "#2f6fb0", "#a9c7e6"
LATENCY_LEGEND = [Series("p50", [], P50_COLOR), Series("p99", [], P99_COLOR)]


def latency_chart(stages: list[dict[str, Any]]) -> Markup:
    """Horizontal bars of p50 and p99 per stage, from the last ``txbox analyze`` run.

    A log scale: stages differ by orders of magnitude (a publish takes milliseconds, a
    message waiting out a retry minutes), and each row is labelled with its figures.
    """
    rows = [s for s in stages if s.get("p99_ms") is not None or s.get("p50_ms") is not None]
    row_h, label_w, width = 26, 250, WIDTH
    height = TOP + 6 + row_h * max(len(rows), 1)
    top = max((float(s.get("p99_ms") or s.get("p50_ms") or 0) for s in rows), default=1.0)
    span = math.log10(max(top, 1.0) + 1) or 1.0
    plot_w = width - label_w - RIGHT

    def w(ms: float) -> float:
        return max(plot_w * math.log10(max(ms, 0.0) + 1) / span, 1.0)

    title = "Latency per stage (p50, p99; log scale)"
    out = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
    ]
    for i, s in enumerate(rows):
        y = TOP + i * row_h
        p50, p99 = float(s.get("p50_ms") or 0), float(s.get("p99_ms") or 0)
        text = f"{s['stage']} p50 {p50:.0f} ms · p99 {p99:.0f} ms"
        out.append(f'<text x="4" y="{y + 15}" class="axis">{escape(text)}</text>')
        out.append(
            f'<rect x="{label_w}" y="{y + 3}" width="{w(p99):.1f}" height="18" fill="{P99_COLOR}">'
            f"<title>{escape(s['stage'])} p99: {p99:,.1f} ms</title></rect>"
        )
        out.append(
            f'<rect x="{label_w}" y="{y + 7}" width="{w(p50):.1f}" height="10" fill="{P50_COLOR}">'
            f"<title>{escape(s['stage'])} p50: {p50:,.1f} ms</title></rect>"
        )
    out.append("</svg>")
    return Markup("".join(out))  # every interpolated text is escaped above
