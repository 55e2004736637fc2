"""framework.redaction: what the text scan catches, in linear time; masking; what a dead letter stores."""

from __future__ import annotations

import sys
import time
import uuid

import pytest

from framework import redaction
from framework.dead_letters import DeadLetter, decode_body
from framework.dead_letters.present import printable
from framework.errors import ConfigurationError
from framework.redaction import REDACTED, masked, redact_bytes, redact_text
from framework.settings import RedactionSettings, load

SECRET = "s3cr3t-VALUE-42"
WORDS = RedactionSettings().keys


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"auth_token": "s3cr3t-VALUE-42", "n": 1}', '{"auth_token": "[redacted]", "n": 1}'),
        ("{'auth_token': 's3cr3t-VALUE-42'}", "{'auth_token': '[redacted]'}"),
        ('{\\"auth_token\\":\\"s3cr3t-VALUE-42\\"}', '{\\"auth_token\\":\\"[redacted]\\"}'),
        ("user=bob&password=s3cr3t-VALUE-42&x=1", "user=bob&password=[redacted]&x=1"),
        ("Authorization: Bearer s3cr3t-VALUE-42\r\nHost: x", "Authorization: [redacted]\r\nHost: x"),
        ("X-Api-Key = s3cr3t-VALUE-42", "X-Api-Key = [redacted]"),
        ('"apiKey":"s3cr3t-VALUE-42"', '"apiKey":"[redacted]"'),
        ('"AUTH_TOKEN" : "s3cr3t \\" VALUE-42"', '"AUTH_TOKEN" : "[redacted]"'),
        ('"auth_token": "s3cr3t-VALUE-42 and no closing quote', '"auth_token": "[redacted]'),
        ("client_secret: s3cr3t-VALUE-42, next: 1", "client_secret: [redacted], next: 1"),
        ("KeyError: 'price' at order o-1", "KeyError: 'price' at order o-1"),
        ('{"customer": "ada", "quantity": 3}', '{"customer": "ada", "quantity": 3}'),
    ],
)
def test_the_text_scan(text: str, expected: str) -> None:
    out = redact_text(text, WORDS)
    assert out == expected
    if expected != text:
        assert "VALUE-42" not in out


def test_what_the_text_scan_does_not_catch() -> None:
    """Documented limits: a bare token without its key, keys spelled with escapes."""
    assert redact_text(f"the token is {SECRET}", WORDS) == f"the token is {SECRET}"
    assert SECRET in redact_text(f'{{"p\\u0061ssword": "{SECRET}"}}', WORDS)


@pytest.mark.parametrize(
    "hostile",
    [
        "token" * 200_000,
        '"auth_token' * 100_000,
        "password:" + " " * 16 + '"' + "a\\" * 400_000,
        "token " * 200_000,
        "x" * 1_000_000,
        "tokentoken-" * 100_000 + ":",
    ],
)
def test_the_text_scan_is_linear_on_hostile_input(hostile: str) -> None:
    started = time.perf_counter()
    redact_text(hostile, WORDS)
    redact_bytes(hostile.encode(), WORDS)
    # ~1 MB each: a backtracking pattern would take minutes or hours here.
    assert time.perf_counter() - started < 10


def test_bytes_in_any_encoding_keep_everything_but_the_secret() -> None:
    body = b"\x00\xff\xfe" + f'{{"auth_token":"{SECRET}"}}'.encode() + b"\x80"
    assert redact_bytes(body, WORDS) == b'\x00\xff\xfe{"auth_token":"[redacted]"}\x80'


def test_views_mask_every_sensitive_key_at_any_depth() -> None:
    value = {
        "payload": {"Password": SECRET, "items": [{"API-Key": SECRET, "sku": "A"}], "count": 3},
        "message_context": {"session_cookie": SECRET, "note": f"secret={SECRET}"},
        "headers": {"Authorization": f"Bearer {SECRET}", "x-retries": 2},
        "auth_token": None,
        "refresh_token": 12345,
    }
    shown = masked(value, WORDS)
    assert SECRET not in repr(shown)
    assert shown["payload"]["Password"] == f"•••• (masked, {len(SECRET)} chars)"
    assert shown["payload"]["items"][0]["sku"] == "A" and shown["payload"]["count"] == 3
    assert shown["headers"]["x-retries"] == 2 and shown["auth_token"] is None
    assert shown["refresh_token"] == "•••• (masked)"
    assert shown["message_context"]["note"] == f"secret={REDACTED}"


def test_a_dead_letter_is_stored_without_the_token() -> None:
    message = {
        "message_id": str(uuid.uuid4()),
        "auth_token": SECRET,
        "payload": {"password": "kept-for-replay", "note": f'{{"auth_token": "{SECRET}"}}'},
    }
    letter = DeadLetter(
        source="broker",
        reason="schema_invalid",
        error=f"handler said {SECRET}; password=hunter2",
        message=message,
        raw_body=f'{{"auth_token": "{SECRET}", "x": 1}}'.encode(),
        headers={"Authorization": "Bearer abc", "auth_token": SECRET, "x-death": [{"queue": "q"}]},
        attempts={"note": f"auth_token={SECRET}"},
    )
    row = letter.row()
    stored = repr(row) + decode_body(row["raw_body"], row["raw_encoding"]).decode()
    assert SECRET not in stored and "hunter2" not in stored
    assert "auth_token" not in letter.message  # type: ignore[operator]
    assert letter.message["payload"]["password"] == "kept-for-replay"  # type: ignore[index]
    assert letter.headers == {"Authorization": REDACTED, "auth_token": REDACTED, "x-death": [{"queue": "q"}]}
    assert row["raw_body"] == '{"auth_token": "[redacted]", "x": 1}'


def test_the_list_is_configurable_and_always_holds_auth_token() -> None:
    settings = load(RedactionSettings, {"TXBOX_SENSITIVE_KEYS": "ssn, Pin-Code"})
    assert settings.keys == ("auth_token", "pin_code", "ssn")
    assert redaction.is_sensitive("X-PIN-CODE", settings.keys) and not redaction.is_sensitive("password", settings.keys)
    assert redaction.is_sensitive("pinCode", settings.keys) and redaction.is_sensitive("authToken", WORDS)
    assert set(load(RedactionSettings, {}).keys) >= {
        "auth_token",
        "token",
        "password",
        "secret",
        "api_key",
        "authorization",
        "cookie",
    }
    with pytest.raises(ConfigurationError, match="TXBOX_SENSITIVE_KEYS"):
        load(RedactionSettings, {"TXBOX_SENSITIVE_KEYS": "token,pass word"})


def test_terminal_output_escapes_control_characters() -> None:
    text = "a\x1b[2Jb\rc\x07d\u202eevil\x9b31m\nnext\tcol é"
    out = printable(text)
    assert out == "a\\x1b[2Jb\\x0dc\\x07d\\u202eevil\\x9b31m\nnext\tcol é"


def test_a_bad_list_fails_every_command_at_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from framework.cli import main

    monkeypatch.setenv("TXBOX_SENSITIVE_KEYS", "token,bad word")
    redaction.sensitive_keys.cache_clear()
    try:
        assert main(["dlq", "show", "1"]) == 2
        assert "TXBOX_SENSITIVE_KEYS" in capsys.readouterr().err
    finally:
        monkeypatch.delenv("TXBOX_SENSITIVE_KEYS")
        redaction.sensitive_keys.cache_clear()


# --- credentials in URLs and DSNs -------------------------------------------------------

PW = "Pw-CaNaRy-9f3"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"postgresql://app:{PW}@db:5432/orders", "postgresql://app:***@db:5432/orders"),
        (f"postgresql+psycopg://app:{PW}@db/orders", "postgresql+psycopg://app:***@db/orders"),
        (f"postgresql://app:{PW}@a:5432,b:5433/orders", "postgresql://app:***@a:5432,b:5433/orders"),
        (f"postgresql://app:{PW}@[::1]:5432/orders", "postgresql://app:***@[::1]:5432/orders"),
        (f"amqp://u:{PW}@[fe80::1%25eth0]:5672/%2F", "amqp://u:***@[fe80::1%25eth0]:5672/%2F"),
        (f"amqp://g:{PW}@mq1/%2F,amqp://g:{PW}x@mq2/%2F", "amqp://g:***@mq1/%2F,amqp://g:***@mq2/%2F"),
        (f"amqps://g:{PW}@mq1/; amqp://h:{PW}@mq2", "amqps://g:***@mq1/; amqp://h:***@mq2"),
        (f"redis://:{PW}@cache:6379/0", "redis://:***@cache:6379/0"),
        (f"postgresql://u:{PW}@:/?#x@db/orders", "postgresql://u:***@db/orders"),
        (f"postgresql://u:a'{PW}\"b@db/x", "postgresql://u:***@db/x"),
        (f"postgresql://u:{PW}%40%2F@db/x", "postgresql://u:***@db/x"),
        (f"postgresql://u:pässwörd-{PW}@db/x", "postgresql://u:***@db/x"),
        (f"postgresql://ü:{PW}@dß/x", "postgresql://ü:***@dß/x"),
        (f"cannot reach postgresql://app:{PW}@db/x: timeout", "cannot reach postgresql://app:***@db/x: timeout"),
        (f"('postgresql://a:{PW}@h/x', 'amqp://b:{PW}@m')", "('postgresql://a:***@h/x', 'amqp://b:***@m')"),
        (
            f"jdbc:postgresql://h/db?user=u&password={PW}&ssl=true",
            "jdbc:postgresql://h/db?user=u&password=***&ssl=true",
        ),
        (f"postgresql://h/db?password={PW}#frag", "postgresql://h/db?password=***#frag"),
        (f"host=db password={PW} dbname=orders", "host=db password=*** dbname=orders"),
        (f"host=db password = '{PW} with \\' quote' user=u", "host=db password = '***' user=u"),
        (f'dsn: password="{PW} b" port=5432', 'dsn: password="***" port=5432'),
        (f"PGPASSWORD={PW} sslpassword={PW}", "PGPASSWORD=*** sslpassword=***"),
        (f"password={PW}&;@:", "password=***"),
        ("postgresql://app@db/orders and http://host:8080/x", "postgresql://app@db/orders and http://host:8080/x"),
        ("no secret here: a@b.c, 10:30", "no secret here: a@b.c, 10:30"),
    ],
)
def test_credentials_in_every_url_and_dsn_form_are_masked(text: str, expected: str) -> None:
    assert redaction.mask_credentials(text) == expected
    # The one scrub masks them whatever the configured keys say.
    assert PW not in redact_text(text, ("auth_token",))
    assert PW.encode() not in redact_bytes(text.encode(), ("auth_token",))


@pytest.mark.parametrize(
    "hostile",
    [
        "a://" * 300_000,
        "postgresql://u:" + "@" * 1_000_000,
        ("x" * 40 + "://") * 30_000,
        "amqp://u:p@h," * 100_000,
        "password=" + "'" + "\\x" * 400_000,
        "?password=" * 100_000,
        "a" * 1_000_000 + "://",
    ],
)
def test_credential_masking_is_linear_on_hostile_input(hostile: str) -> None:
    started = time.perf_counter()
    redaction.mask_credentials(hostile)
    assert time.perf_counter() - started < 10


def test_a_cli_error_never_prints_a_url_password(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from framework.cli import main

    first, second = "CaNaRy-one-5d1", "CaNaRy-two-7e2"
    # The app module reads the environment when imported: another test may have imported it already.
    monkeypatch.delitem(sys.modules, "examples.orders.app", raising=False)
    monkeypatch.setenv("TXBOX_SERVICE", "order-service")
    monkeypatch.setenv("TXBOX_DATABASE_URL", f"mysql://app:{first}@{second}@db/orders")
    assert main(["check", "--app", "examples.orders.app:service"]) == 2
    monkeypatch.setenv("TXBOX_DATABASE_URL", "postgresql://postgres@127.0.0.1/x")
    monkeypatch.setenv("TXBOX_AMQP_URL", f"amqp://g:g@mq1/%2F,ftp://u:{first}@{second}@mq2/")
    monkeypatch.delitem(sys.modules, "examples.orders.app", raising=False)
    assert main(["check", "--app", "examples.orders.app:service"]) == 2
    out = capsys.readouterr()
    text = out.out + out.err
    assert text.count("error:") == 2 and "***" in text
    assert first not in text and second not in text


def test_a_bad_argument_never_prints_a_url_password(capsys: pytest.CaptureFixture[str]) -> None:
    from framework.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["dlq", "show", f"postgresql://app:{PW}@db/orders"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "invalid int value" in err and "app:***@db" in err
    assert PW not in err


def test_clip_drops_a_url_the_cut_runs_through_and_keeps_the_rest() -> None:
    text = "lost postgresql://app:hunter2-long-password@db/x, retrying"
    cut = text.index("hunter2") + 7  # inside the password: no @ left to mark it
    assert redaction.mask_credentials(text[:cut]).endswith("hunter2")  # what a plain cut would show
    assert redaction.clip(text, cut) == "lost "
    assert redaction.clip(text, len(text)) == text  # not cut: as it is
    assert redaction.clip(text, len(text) - 3) == "lost postgresql://app:hunter2-long-password@db/x, retry"
    many = "amqp://a:pw1@h1,amqp://b:pw2-secret@h2"
    assert redaction.clip(many, many.index("pw2") + 3) == "amqp://a:pw1@h1,"
    assert redaction.clip(None, 5) is None
    assert redaction.mask_credentials(redaction.clip("x password='a b c' y", 14) or "") == "x password='***'"


def test_credentials_masked_masks_every_string_and_key_and_is_idempotent() -> None:
    value = {"postgresql://u:pw@h": ["password=pw", 3, None], "n": ("amqp://u:pw@h",)}
    once = redaction.credentials_masked(value)
    assert once == {"postgresql://u:***@h": ["password=***", 3, None], "n": ["amqp://u:***@h"]}
    assert redaction.credentials_masked(once) == once
