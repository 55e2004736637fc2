"""Rebuild scripts/advisories.json from a checkout of the PyPA advisory database.

    git clone --depth 1 https://github.com/pypa/advisory-database /tmp/advisory-database
    .venv/bin/python scripts/build_advisories.py /tmp/advisory-database

The audit step of `make test` (scripts/audit.py) must not need a vulnerability service
on the network: OSV's API is unreachable from the machines that run it. It reads this
file instead, a compact copy of every PyPI advisory in OSV format: the identifiers,
summary and ECOSYSTEM version ranges that pip-audit reads (the explicit version list is
kept only for the few records that carry no range). Refresh it whenever you can reach
GitHub; the file records the commit and date it was built from.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

OUT = Path(__file__).resolve().parent / "advisories.json"
DETAILS_LIMIT = 300  # characters of the description kept when there is no summary


def compact(record: dict[str, Any]) -> dict[str, Any] | None:
    affected = []
    for entry in record.get("affected") or []:
        package = entry.get("package") or {}
        if package.get("ecosystem") != "PyPI":
            continue
        ranges = [r for r in entry.get("ranges") or [] if r.get("type") == "ECOSYSTEM"]
        kept: dict[str, Any] = {"package": {"name": package["name"], "ecosystem": "PyPI"}}
        if ranges:
            kept["ranges"] = [{"type": "ECOSYSTEM", "events": r["events"]} for r in ranges]
        else:
            kept["versions"] = [str(v) for v in entry.get("versions") or []]
        affected.append(kept)
    if not affected:
        return None
    out: dict[str, Any] = {"id": record["id"], "aliases": record.get("aliases") or [], "affected": affected}
    summary = record.get("summary") or " ".join(str(record.get("details") or "").split())[:DETAILS_LIMIT]
    out["summary"] = summary
    for key in ("published", "modified", "withdrawn"):
        if record.get(key):
            out[key] = _rfc3339(record[key])
    return out


def _rfc3339(value: Any) -> str:
    """YAML reads these as datetimes; pip-audit parses them back with a `...Z` format."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(value)


def main(checkout: str) -> int:
    root = Path(checkout)
    commit, date = subprocess.run(
        ["git", "-C", str(root), "log", "-1", "--format=%H %cI"], check=True, capture_output=True, text=True
    ).stdout.split()
    records = []
    for path in sorted((root / "vulns").rglob("*.yaml")):
        record = compact(yaml.safe_load(path.read_text()))
        if record is not None:
            records.append(record)
    source = {"repository": "https://github.com/pypa/advisory-database", "commit": commit, "date": date}
    # One record per line: a refresh shows in review as the advisories it adds or changes.
    lines = ",\n".join(json.dumps(r, separators=(",", ":"), sort_keys=True) for r in records)
    OUT.write_text(f'{{"source":{json.dumps(source, sort_keys=True)},\n"vulns":[\n{lines}\n]}}\n')
    print(f"{len(records)} advisories from {commit[:12]} ({date}) -> {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
