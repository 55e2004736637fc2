"""Secrets out of every view and every stored copy: the one list of sensitive keys.

Two jobs, one list (``TXBOX_SENSITIVE_KEYS``, see :class:`framework.settings.RedactionSettings`):

* **Views** (dashboard, ``txbox dlq``): :func:`masked` returns a copy of any JSON-like
  value with the value of every sensitive key replaced by :func:`mask` (kind and length
  only), at any depth, and every string scanned by :func:`redact_text`.
* **Storage** (dead letters, archives): :func:`scrub_letter` drops ``auth_token`` from a
  message before it is written and redacts raw bodies, headers and error texts, so the
  token is never at rest where it is no longer needed. The envelope's payload is kept as
  it is (a replay needs it); only views mask its other sensitive keys.

A key is sensitive when its lower-case name, ``-`` and ``_`` ignored, contains one of the
listed words: ``token`` covers ``auth_token``, ``x-auth-token`` and ``accessToken``.

**Text that is not JSON** (raw bodies of rejected messages, error texts) is scanned for
``<key><sep><value>`` where ``<key>`` contains a listed word, ``<sep>`` is ``:`` or ``=``
(optionally after a closing quote, with up to 16 blanks around) and ``<value>`` is a
double-quoted JSON string (escapes honoured, up to its closing quote or the end), a
single-quoted string, an optional ``Bearer``/``Basic`` scheme plus one bare word, or one
bare word (up to a blank, ``,``, ``;``, ``&``, a quote or a bracket). That catches JSON,
Python reprs, ``key=value`` query and form strings, HTTP header lines and log-style text,
also inside escaped JSON (``\\"auth_token\\":\\"...\\"``). It does NOT catch a secret
without its key (a bare token), keys spelled with escapes (``auth\\u005ftoken``) or in
another encoding (UTF-16, compressed, base64 bodies are scanned as bytes, so only their
ASCII-compatible spans), nor a value split across lines. The pattern is linear: every
repetition is bounded or over disjoint character classes, and a match consumes what it
scanned; bodies are bounded by the receiver's size limit anyway.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

AUTH_TOKEN = "auth_token"
REDACTED = "[redacted]"

_MARK = "•••• (masked)"


@functools.cache
def sensitive_keys() -> tuple[str, ...]:
    """The configured list, read once from the environment (``TXBOX_SENSITIVE_KEYS``)."""
    from framework.settings import RedactionSettings, load

    return load(RedactionSettings).keys


def _norm(key: Any) -> str:
    return str(key).lower().replace("-", "_")


def _squeeze(text: str) -> str:
    return text.lower().replace("-", "").replace("_", "")


@functools.lru_cache(maxsize=4096)
def _is_sensitive(key: str, words: tuple[str, ...]) -> bool:
    # Separators ignored on both sides: `api_key` also matches `apiKey`, `X-API-KEY`.
    low = _squeeze(key)
    return any(_squeeze(w) in low for w in words)


def is_sensitive(key: Any, words: Iterable[str] | None = None) -> bool:
    """True when ``key`` names a secret (contains a listed word, ``-`` read as ``_``)."""
    return _is_sensitive(str(key), tuple(words) if words is not None else sensitive_keys())


def mask(value: Any) -> str:
    """A secret as its kind and length only: enough to tell 'present' from 'empty'."""
    if value == "":
        return ""
    if not isinstance(value, str):
        return _MARK
    return f"•••• (masked, {len(value)} chars)"


def masked(value: Any, words: Iterable[str] | None = None) -> Any:
    """A copy of ``value`` for people to see: sensitive keys masked, strings scanned, at any depth."""
    keys = tuple(words) if words is not None else sensitive_keys()
    return _masked(value, keys)


def _masked(value: Any, keys: tuple[str, ...]) -> Any:
    if isinstance(value, dict):
        return {
            k: mask(v) if v is not None and _is_sensitive(str(k), keys) else _masked(v, keys) for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_masked(v, keys) for v in value]
    if isinstance(value, str):
        return redact_text(value, keys)
    return value


# --- text ----------------------------------------------------------------------------

_VALUE = (
    r"(?P<value>"
    r'\\"[^"\\]*'  # inside escaped JSON: \"value\" (ends at the backslash)
    r'|"(?:[^"\\]|\\.)*"?'  # a JSON string, to its closing quote or the end
    r"|'[^'\n]*'?"  # a single-quoted string
    r"|(?:(?i:bearer|basic|token|digest)[ \t]+)?[^\s,;&\"'<>()\[\]{}\\]+"  # [scheme] one bare word
    r")"
)


def _word_pattern(word: str) -> str:
    # `api_key` also as `api-key` / `apikey` / `apiKey`: separators optional, case ignored.
    parts = [re.escape(p) for p in re.split(r"[-_]", word) if p]
    return r"[-_]?".join(parts)


@functools.lru_cache(maxsize=16)
def _pattern(words: tuple[str, ...]) -> re.Pattern[str]:
    alternatives = "|".join(sorted({_word_pattern(w) for w in words}, key=len, reverse=True))
    return re.compile(
        rf"(?P<key>(?i:{alternatives})[\w-]{{0,64}}+(?:\\?[\"'])?+[ \t]{{0,16}}+[:=][ \t]{{0,16}}+)" + _VALUE
    )


@functools.lru_cache(maxsize=16)
def _bytes_pattern(words: tuple[str, ...]) -> re.Pattern[bytes]:
    return re.compile(_pattern(words).pattern.encode())


def _mentions(lowered: str, words: tuple[str, ...]) -> bool:
    """Cheap pre-check (C speed): could any word occur? Most texts name no secret at all."""
    return any(re.split(r"[-_]", w)[0] in lowered for w in words)


def _replace(value: str) -> str:
    if value.startswith('\\"'):
        return '\\"' + REDACTED
    if value.startswith('"'):
        return '"' + REDACTED + ('"' if len(value) > 1 and value.endswith('"') else "")
    if value.startswith("'"):
        return "'" + REDACTED + ("'" if len(value) > 1 and value.endswith("'") else "")
    return REDACTED


def redact_text(text: str, words: Iterable[str] | None = None) -> str:
    """The one scrub for text that leaves the process (logs, CLI errors, views, stored letters):
    credentials in URLs and DSNs masked (:func:`mask_credentials`, whatever the configured
    keys), then the value of every ``<sensitive key>: <value>`` replaced by ``[redacted]``."""
    keys = tuple(words) if words is not None else sensitive_keys()
    text = mask_credentials(text)
    if not text or not _mentions(text.lower(), keys):
        return text
    return _pattern(keys).sub(lambda m: m.group("key") + _replace(m.group("value")), text)


def redact_bytes(body: bytes, words: Iterable[str] | None = None) -> bytes:
    """:func:`redact_text` over bytes: works on any encoding whose keys are ASCII bytes (UTF-8, Latin-1)."""
    keys = tuple(words) if words is not None else sensitive_keys()
    if body:
        # Latin-1 maps every byte to one character and back: only the masked spans change.
        body = mask_credentials(body.decode("latin-1")).encode("latin-1")
    if not body or not _mentions(body.decode("latin-1").lower(), keys):
        return body
    return _bytes_pattern(keys).sub(
        lambda m: m.group("key") + _replace(m.group("value").decode("latin-1")).encode(), body
    )


# --- credentials in URLs and DSNs ------------------------------------------------------

CREDENTIAL_MARK = "***"
"""What a masked password reads as: ``postgresql://app:***@db/orders``, ``password=***``."""

_BLANK = " \t\r\n\f\v"
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]{0,32}+://"
_URL_START = re.compile(_SCHEME)
# The rest of one URL: up to a blank, or a `,`/`;` that starts the next URL (a list of
# AMQP URLs). Alternatives are disjoint and the lookahead bounded: linear.
_URL_REST = re.compile(rf"(?:[^{_BLANK},;]|[,;](?!{_SCHEME})){{0,4096}}+")
# libpq `password=...` (bare to a blank, or quoted with backslash escapes) and URL query
# `?password=...` / `&password=...` (to `&` or `#`), whatever TXBOX_SENSITIVE_KEYS says.
_KEY = r"(?i:(?:pg|ssl)?(?:password|passwd|pwd))[ \t]{0,16}+=[ \t]{0,16}+"
_KEY_VALUE = re.compile(
    rf"(?<=[?&])(?P<qkey>{_KEY})(?P<qvalue>[^{_BLANK}&#]{{1,4096}}+)"
    rf"|(?<![?&A-Za-z0-9_])(?P<key>{_KEY})(?P<value>'(?:[^'\\]|\\.){{0,4096}}+'?"
    rf'|"(?:[^"\\]|\\.){{0,4096}}+"?|[^{_BLANK}\'"][^{_BLANK}]{{0,4095}}+)'
)


def mask_credentials(text: str) -> str:
    """``text`` with every password a URL or DSN can carry replaced by :data:`CREDENTIAL_MARK`.

    Forms: ``scheme://user:pw@host`` (also multi-host ``postgresql://u:pw@a,b/db``, IPv6
    hosts, several URLs separated by ``,`` or ``;``), ``?password=``/``&password=`` query
    parameters and libpq ``password=pw`` / ``password='a b'`` (also ``passwd``, ``pwd``,
    ``sslpassword``, ``PGPASSWORD``). A password may hold ``@ : / ? #`` and quotes: the
    userinfo ends at the last ``@`` before a blank or the next URL, so when in doubt more is
    masked, never less. Not caught: a raw blank inside a URL's password (not a valid URL).
    Linear on any input: every repetition is bounded or possessive (docs/explanation/operations.md, "Secrets").
    """
    lowered = text.lower()
    if "://" not in text and "pass" not in lowered and "pwd" not in lowered:
        return text
    out: list[str] = []
    pos = 0
    while (start := _URL_START.search(text, pos)) is not None:
        rest = _URL_REST.match(text, start.end())
        end = rest.end() if rest else start.end()
        at = text.rfind("@", start.end(), end)
        colon = text.find(":", start.end(), at) if at > 0 else -1
        if colon >= 0 and colon + 1 < at:
            out.append(text[pos : colon + 1] + CREDENTIAL_MARK + text[at:end])
        else:
            out.append(text[pos:end])
        pos = end
    out.append(text[pos:])
    return _KEY_VALUE.sub(_mask_value, "".join(out))


def credentials_masked(value: Any) -> Any:
    """A copy of a JSON-like ``value`` with every string, keys too, through :func:`mask_credentials`.

    For an exit whose data may have been masked already (:func:`masked` is not
    idempotent, this is): the dashboard's JSON answers (docs/explanation/operations.md, "Secrets")."""
    if isinstance(value, dict):
        return {credentials_masked(k): credentials_masked(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [credentials_masked(v) for v in value]
    if isinstance(value, str):
        return mask_credentials(value)
    return value


def clip(text: str | None, limit: int) -> str | None:
    """At most ``limit`` characters of ``text`` for a list or a summary, and never a cut URL's password.

    Cut inside its user info, ``scheme://user:pass`` has lost the ``@`` that tells
    :func:`mask_credentials` a password is there: a URL the cut runs through is dropped
    from its scheme on. ``text`` may be SQL's ``left(error, limit + 1)``: longer than
    ``limit`` is what says it was cut. The ``password=`` forms need nothing: masked up
    to the end of the text, a cut one is masked all the same. Linear (one scan).
    """
    if text is None or len(text) <= limit:
        return text
    kept = text[:limit]
    last = None
    for last in _URL_START.finditer(kept):  # noqa: B007 (the last one is wanted)
        pass
    if last is not None:
        rest = _URL_REST.match(kept, last.end())
        if rest is not None and rest.end() == len(kept):
            kept = kept[: last.start()]
    return kept


def _mask_value(m: re.Match[str]) -> str:
    if m.group("qkey") is not None:
        return m.group("qkey") + CREDENTIAL_MARK
    value = m.group("value")
    quote = value[0] if value[0] in "'\"" else ""
    return m.group("key") + quote + CREDENTIAL_MARK + quote


def scrub_values(text: str, secrets: Iterable[str]) -> str:
    """``text`` without any literal occurrence of the known secret values (bare tokens in error texts)."""
    for secret in secrets:
        if len(secret) >= 4 and secret in text:
            text = text.replace(secret, REDACTED)
    return text


# --- storage --------------------------------------------------------------------------


def drop_key(value: Any, key: str = AUTH_TOKEN) -> Any:
    """A copy of ``value`` without ``key`` at any depth (what a replay must not carry)."""
    if isinstance(value, dict):
        return {k: drop_key(v, key) for k, v in value.items() if _norm(k) != key}
    if isinstance(value, list | tuple):
        return [drop_key(v, key) for v in value]
    return value


def found_tokens(value: Any) -> list[str]:
    """Every string value of an ``auth_token`` key in ``value``, at any depth."""
    out: list[str] = []
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for k, v in item.items():
                if _norm(k) == AUTH_TOKEN and isinstance(v, str):
                    out.append(v)
                else:
                    stack.append(v)
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return out


def tokens_in_text(text: bytes | str) -> list[str]:
    """The values the text scan would redact for ``auth_token`` (to scrub their bare copies too)."""
    raw = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
    out = []
    for m in _pattern((AUTH_TOKEN,)).finditer(raw):
        value = m.group("value").strip("\\\"'")
        value = re.sub(r"^(?i:bearer|basic|token|digest)[ \t]+", "", value)
        if value:
            out.append(value)
    return out


def scrub_tree(value: Any, secrets: list[str], keys: tuple[str, ...]) -> Any:
    """Headers and attempt facts as stored: sensitive keys redacted, strings scanned, known secrets removed."""
    if isinstance(value, dict):
        return {
            k: REDACTED if v is not None and _is_sensitive(str(k), keys) else scrub_tree(v, secrets, keys)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [scrub_tree(v, secrets, keys) for v in value]
    if isinstance(value, str):
        return scrub_values(redact_text(value, keys), secrets)
    return value


def scrub_letter(letter: Any) -> None:
    """Make a dead letter storable: ``auth_token`` dropped from its message (also where a
    string of it spells ``auth_token: ...``); headers, attempts and error text redacted
    for every sensitive key; bare copies of the token removed from all of them.

    ``letter`` is a :class:`framework.dead_letters.DeadLetter` (not imported: it imports
    this module). Its raw body is redacted when encoded for storage
    (:func:`framework.dead_letters.stored_body`, the one place every writer's body goes through).
    """
    keys = sensitive_keys()
    secrets = found_tokens(letter.message) + found_tokens(letter.headers)
    if letter.raw_body is not None:
        secrets += tokens_in_text(letter.raw_body)
    if letter.message is not None:
        # Only the token goes: the payload's other keys are the message (a replay needs them).
        letter.message = scrub_tree(drop_key(letter.message), secrets, (AUTH_TOKEN,))
    letter.headers = scrub_tree(letter.headers, secrets, keys)
    letter.attempts = scrub_tree(letter.attempts, secrets, keys)
    letter.error = scrub_values(redact_text(letter.error, keys), secrets)
