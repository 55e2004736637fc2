"""How commands print for people: aligned tables, clipped text, UTC times, safe lines.

Shared by `txbox dlq` and `txbox outbox|inbox list`, so every listing looks alike.
"""

from __future__ import annotations

from datetime import UTC, datetime

from framework.dead_letters.present import printable


def emit(text: str) -> None:
    """Every line a listing prints: secrets masked already, control characters escaped."""
    print(printable(text))


def utc(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def clip(text: str | None, width: int) -> str:
    text = " ".join((text or "").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    return "\n".join([line(header), *(line(r) for r in rows)])
