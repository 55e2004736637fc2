"""The chaos run's tenants (``--tenants N``): every service keeps each tenant in a database of its own.

A run without tenants has one :class:`Cell`: the two services' databases. With N tenants
it has N: tenant ``t<k>`` has a database of each service (``chaos_<service>_t<k>``),
listed in that service's registry file, and each service's `txbox run` serves all of
them from its own database (``chaos_<service>``: the receiver's turn, the heartbeats,
the letters of deliveries naming no tenant). The orders are shared out between the
tenants, each tenant's saga stays in its tenant, and the verdict is judged per tenant
(docs/how-to/tenants.md, "One set of daemons for every tenant").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from framework.db import conninfo

SERVICES = {"orders": "order-service", "inventory": "inventory-service"}  # short name → service id


@dataclass(frozen=True)
class Cell:
    """One tenant's databases of both services, by short name; ``key`` None: no tenants."""

    key: str | None
    urls: dict[str, str]

    def label(self, short: str) -> str:
        """How reports name this cell's database of ``short``: ``orders`` or ``orders/t1``."""
        return short if self.key is None else f"{short}/{self.key}"

    def dsns(self) -> dict[str, str]:
        return {self.label(short): conninfo(url) for short, url in self.urls.items()}


def key(n: int) -> str:
    return f"t{n}"


def share(total: int, parts: int, n: int) -> int:
    """Part ``n`` of ``total`` shared out between ``parts`` as evenly as can be (the first get one more)."""
    return total // parts + (1 if n < total % parts else 0)


def registry_files(folder: Path, cells: list[Cell]) -> dict[str, Path]:
    """Each service's registry file, listing its database of every tenant: by short name."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for short in SERVICES:
        path = folder / f"tenants-{short}.toml"
        path.write_text("".join(f'[tenants.{c.key}]\ndatabase_url = "{c.urls[short]}"\n' for c in cells))
        files[short] = path
    return files


def analyze_config(folder: Path, registries: dict[str, Path]) -> Path:
    """`txbox analyze --sources-file`: each service's tenants read from its registry file."""
    path = folder / "analyze-tenants.yaml"
    path.write_text(
        "sources:\n" + "".join(f"  {SERVICES[short]}: {{tenants_file: '{p}'}}\n" for short, p in registries.items())
    )
    return path
