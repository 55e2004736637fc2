"""The dashboard replays a guarded handler's letter with the token the operator types in,
never one the letter kept; the token shows in no page, redirect or letter (HTTP + database)."""

from __future__ import annotations

import json
from typing import Any

from tests.integration.dead_letters.test_dashboard import TOKEN, _csrf, _login, base, http
from tests.integration.dead_letters.test_replay_route import KEPT_TOKEN, OPERATOR_TOKEN, Letter, rows

__all__ = ["base"]  # the dashboard fixture, shared with test_dashboard


def test_the_replay_form_and_api_take_the_operators_token(base: str, conn: Any) -> None:
    by_form, by_api, without = (Letter("broker", "PlaceOrder", auth_token=KEPT_TOKEN) for _ in range(3))
    ids = [x.insert(conn) for x in (by_form, by_api, without)]
    cookie = _login(base)
    path = f"/letters/order-service/{ids[0]}/replay"
    csrf = _csrf(base, path, cookie)

    status, headers, page = http(base + path, data={"csrf": csrf, "auth_token": OPERATOR_TOKEN}, headers=cookie)
    assert status == 303 and "outbox-insert" in headers["location"], (status, headers)
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    api = f"/api/letters/order-service/{ids[1]}/replay"
    status, _, body = http(base + api, method="POST", headers={**bearer, "X-Txbox-Replay-Auth-Token": OPERATOR_TOKEN})
    assert status == 200 and json.loads(body)["outcomes"][0]["ok"], body
    status, _, body = http(base + f"/api/letters/order-service/{ids[2]}/replay", method="POST", headers=bearer)
    assert status == 200, body
    bad = {**bearer, "X-Txbox-Replay-Auth-Token": "not a token"}
    status, _, refusal = http(base + f"/api/letters/order-service/{ids[2]}/replay", method="POST", headers=bad)

    assert status == 400 and "not a token" not in refusal
    for letter in (by_form, by_api):
        [row] = rows(conn, "outbox", letter.message_id)
        assert row["metadata"]["auth_token"] == OPERATOR_TOKEN
    [row] = rows(conn, "outbox", without.message_id)
    assert "auth_token" not in row["metadata"], "the letter's token must not be sent"
    shown = http(base + headers["location"], headers=cookie)[2]
    assert OPERATOR_TOKEN not in headers["location"] + page + body + shown
    letters = conn.execute("SELECT string_agg(t::text, ' ') AS s FROM txbox.dead_letters t").fetchone()["s"]
    assert OPERATOR_TOKEN not in letters
