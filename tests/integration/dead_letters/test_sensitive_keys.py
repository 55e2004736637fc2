"""Every sensitive key is masked in every view, also of letters stored before redaction existed.

The letter is inserted with plain SQL (as an older version, or a tool, could have stored
it), so what is checked here is the views' masking, not the storage's redaction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from framework.dashboard.app import DashboardSettings, create_app
from framework.dashboard.server import serving
from tests.conftest import CONTRACTS, ROOT
from tests.integration.dead_letters.test_dashboard import TOKEN, _source, http

SECRETS = {
    "password": "pw-" + uuid.uuid4().hex,
    "api_key": "ak-" + uuid.uuid4().hex,
    "cookie": "ck-" + uuid.uuid4().hex,
    "authorization": "au-" + uuid.uuid4().hex,
    "raw": "rw-" + uuid.uuid4().hex,
    "error": "er-" + uuid.uuid4().hex,
    "token": "tk-" + uuid.uuid4().hex,
}
ESCAPE = "\x1b]0;pwned\x07\x1b[2J\r"


def _insert(conn: Any) -> tuple[int, int]:
    message = {
        "message_id": str(uuid.uuid4()),
        "message_type": "PlaceOrder",
        "payload": {"customer": "ada", "password": SECRETS["password"], "items": [{"Api-Key": SECRETS["api_key"]}]},
        "message_context": {"session_cookie": SECRETS["cookie"]},
        "auth_token": SECRETS["token"],
    }
    headers = {"Authorization": f"Bearer {SECRETS['authorization']}", "x-attempt": 1}
    ids = []
    for body_json, raw in ((message, None), (None, f"not json; secret={SECRETS['raw']}")):
        row = conn.execute(
            """INSERT INTO txbox.dead_letters (message_id, source, reason, error, fingerprint, message_type,
                   message, raw_body, raw_encoding, headers, attempts)
               VALUES (%s, 'broker', 'schema_invalid', %s, 'f00d', 'PlaceOrder', %s, %s, %s, %s, '{}')
               RETURNING id""",
            (
                message["message_id"] if body_json else None,
                f"rejected {ESCAPE} with password={SECRETS['error']}",
                json.dumps(body_json) if body_json else None,
                raw,
                "utf-8" if raw else None,
                json.dumps(headers),
            ),
        ).fetchone()
        ids.append(row["id"])
    return ids[0], ids[1]


def _assert_clean(where: str, text: str) -> None:
    leaked = [k for k, v in SECRETS.items() if v in text]
    assert not leaked, f"{where} shows {leaked}"


def test_dashboard_pages_and_api_mask_every_sensitive_key(database_url: str, conn: Any) -> None:
    envelope_id, raw_id = _insert(conn)
    for settings in (DashboardSettings(token=TOKEN), DashboardSettings()):
        with serving(create_app([_source(database_url)], settings)) as base:
            headers = {"Authorization": f"Bearer {TOKEN}"} if settings.token else {}
            for path in (
                "/",
                "/groups?status=all",
                "/letters?status=all",
                f"/letters/order-service/{envelope_id}",
                f"/letters/order-service/{raw_id}",
                f"/letters/order-service/{envelope_id}/replay",
                "/groups/order-service/f00d/replay",
                "/api/overview",
                "/api/groups?status=all",
                "/api/letters?status=all",
                f"/api/letters/order-service/{envelope_id}",
                f"/api/letters/order-service/{raw_id}",
            ):
                status, _, body = http(base + path, headers=headers)
                assert status == 200, (path, body[:300])
                _assert_clean(path, body)
            page = http(base + f"/letters/order-service/{envelope_id}", headers=headers)[2]
            assert "masked" in page and "&#34;customer&#34;: &#34;ada&#34;" in page


def _dlq(database_url: str, *args: str) -> str:
    env = {
        **os.environ,
        "TXBOX_SERVICE": "order-service",
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_CONTRACTS_DIR": str(CONTRACTS),
    }
    done = subprocess.run(
        [str(Path(sys.executable).parent / "txbox"), "dlq", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_txbox_dlq_masks_and_escapes_what_it_prints(database_url: str, conn: Any) -> None:
    envelope_id, raw_id = _insert(conn)
    outputs = {
        "list": _dlq(database_url, "list", "--status", "all"),
        "list --json": _dlq(database_url, "list", "--status", "all", "--json"),
        "list --groups": _dlq(database_url, "list", "--groups", "--status", "all"),
        "list --groups --json": _dlq(database_url, "list", "--groups", "--status", "all", "--json"),
    }
    for lid in (envelope_id, raw_id):
        outputs[f"show {lid}"] = _dlq(database_url, "show", str(lid))
        outputs[f"show {lid} --json"] = _dlq(database_url, "show", str(lid), "--json")
    for where, text in outputs.items():
        _assert_clean(where, text)
        assert "\x1b" not in text and "\x07" not in text and "\r" not in text, where
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in outputs[f"show {envelope_id}"]  # (the CR ends the line)
    assert "masked" in outputs[f"show {envelope_id}"] and "[redacted]" in outputs[f"show {raw_id}"]
