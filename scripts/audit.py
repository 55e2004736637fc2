"""Vulnerability audit of the installed set (.venv), offline: pip-audit against scripts/advisories.json.

    .venv/bin/python scripts/audit.py            # part of `make test` (scripts/test.sh)
    .venv/bin/python scripts/audit.py --self-test-only

pip-audit's own services need the network: its `pypi` service asks PyPI's per-release
JSON API and its `osv` service asks api.osv.dev, and neither answers from the machines
that run `make test`. pip-audit can be pointed at any OSV-compatible query endpoint
(`--osv-url`), so this script serves one on 127.0.0.1 from the vendored copy of the PyPA
advisory database (scripts/advisories.json, rebuilt by scripts/build_advisories.py) and
runs pip-audit against it. The advisories are as recent as that file's `source.date`.

Before auditing the environment it audits a requirement known to be vulnerable
(orjson 3.9.14, CVE-2024-27454: unbounded recursion on deep JSON) and fails unless that
is reported: an empty or unreadable advisory file must not pass as "no vulnerabilities".
Exit status: 0 clean, 1 a known vulnerability installed (or the self-test failed).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

ADVISORIES = Path(__file__).resolve().parent / "advisories.json"
KNOWN_BAD = ("orjson", "3.9.14", "PYSEC-2024-40")


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def _in_range(version: Version, events: list[dict[str, str]]) -> bool:
    """OSV ECOSYSTEM range: introduced ≤ v < fixed (or ≤ last_affected), events in version order."""
    affected = False
    for event in events:
        if "introduced" in event:
            bound = _version(event["introduced"])
            if event["introduced"] == "0" or (bound is not None and version >= bound):
                affected = True
        elif "fixed" in event:
            bound = _version(event["fixed"])
            if bound is not None and version >= bound:
                affected = False
        elif "last_affected" in event:
            bound = _version(event["last_affected"])
            if bound is not None and version > bound:
                affected = False
    return affected


class Advisories:
    def __init__(self, path: Path) -> None:
        data = json.loads(path.read_text())
        self.source: dict[str, str] = data["source"]
        self.by_package: dict[str, list[dict[str, Any]]] = {}
        for vuln in data["vulns"]:
            for name in {canonicalize_name(a["package"]["name"]) for a in vuln["affected"]}:
                self.by_package.setdefault(name, []).append(vuln)

    def affecting(self, name: str, version_text: str) -> list[dict[str, Any]]:
        name = canonicalize_name(name)
        version = _version(version_text)
        found = []
        for vuln in self.by_package.get(name, []):
            for affected in vuln["affected"]:
                if canonicalize_name(affected["package"]["name"]) != name:
                    continue
                if version_text in affected.get("versions", ()) or (
                    version is not None and any(_in_range(version, r["events"]) for r in affected.get("ranges", ()))
                ):
                    # pip-audit compares the advisory's name with its canonical one.
                    found.append(_renamed(vuln, name))
                    break
        return found


def _renamed(vuln: dict[str, Any], name: str) -> dict[str, Any]:
    affected = [
        {**a, "package": {**a["package"], "name": name}} if canonicalize_name(a["package"]["name"]) == name else a
        for a in vuln["affected"]
    ]
    return {**vuln, "affected": affected}


def serve(advisories: Advisories) -> ThreadingHTTPServer:
    """An OSV `POST /v1/query` endpoint on a free loopback port, answered from ``advisories``."""

    class Query(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            query = json.loads(self.rfile.read(length) or b"{}")
            package = query.get("package") or {}
            vulns = advisories.affecting(str(package.get("name", "")), str(query.get("version", "")))
            body = json.dumps({"vulns": vulns} if vulns else {}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # quiet: pip-audit prints the verdict
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Query)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def pip_audit(url: str, cache: str, *args: str) -> subprocess.CompletedProcess[str]:
    command = [
        sys.executable, "-m", "pip_audit",
        "--vulnerability-service", "osv", "--osv-url", url,
        "--cache-dir", cache, "--progress-spinner", "off", "--desc", "on", "--aliases", "on",
        *args,
    ]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, check=False)


def main(argv: list[str]) -> int:
    advisories = Advisories(ADVISORIES)
    server = serve(advisories)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/query"
    src = advisories.source
    print(f"audit: advisories of {src['repository']} at {src['commit'][:12]} ({src['date'][:10]})")
    try:
        with tempfile.TemporaryDirectory(prefix="txbox-audit-") as cache:
            name, version, vuln_id = KNOWN_BAD
            requirement = Path(cache) / "known-bad.txt"
            requirement.write_text(f"{name}=={version}\n")
            probe = pip_audit(url, cache, "--no-deps", "--disable-pip", "-r", str(requirement))
            if probe.returncode != 1 or vuln_id not in probe.stdout:
                print(f"audit: self-test failed: {name} {version} was not reported as {vuln_id}", file=sys.stderr)
                print(probe.stdout, probe.stderr, sep="\n", file=sys.stderr)
                return 1
            if "--self-test-only" in argv:
                print(f"audit: self-test passed ({name} {version} reported as {vuln_id})")
                return 0
            # The installed set, less this project itself (an editable install, not on PyPI).
            result = pip_audit(url, cache, "--skip-editable")
    finally:
        server.shutdown()
    print(result.stdout, end="")
    print(result.stderr, end="", file=sys.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
