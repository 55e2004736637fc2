"""The output format of `txbox bench`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class Result:
    stage: str
    messages: int
    seconds: float
    raw_limit_rate: float
    raw_limit: str  # what the raw limit measures, for people
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.messages / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "messages": self.messages,
            "seconds": round(self.seconds, 3),
            "rate": round(self.rate, 1),
            "raw_limit_rate": round(self.raw_limit_rate, 1),
            "ratio": round(self.rate / self.raw_limit_rate, 3) if self.raw_limit_rate else None,
            "raw_limit": self.raw_limit,
            **self.extra,
        }

    def report(self, as_json: bool) -> str:
        data = self.as_dict()
        if as_json:
            return json.dumps(data)
        lines = [f"{self.stage}: {data['messages']} messages in {data['seconds']} s = {data['rate']:,} msg/s"]
        lines.append(f"raw limit ({self.raw_limit}): {data['raw_limit_rate']:,} msg/s; ratio {data['ratio']}")
        lines += [f"{k}: {v}" for k, v in self.extra.items()]
        return "\n".join(lines)
