"""Producers' public signing keys fetched from a URL: a JWKS document or Mosaic's key service.

docs/explanation/receive.md, "Event signing". Two shapes of answer, one per
``TXBOX_SIGNING_KEYS_FORMAT``:

- ``jwks``: a JSON Web Key Set (RFC 7517) fetched with ``GET``. Each key is RSA (``kty``
  ``RSA``, ``n`` and ``e`` in base64url) with ``kid`` its version; when the URL holds
  ``{service}`` it is fetched once per producer and ``kid`` is the bare version, else one
  document serves every producer and ``kid`` is ``<service>.<version>``.
- ``mosaic``: Mosaic's key service as its message bus asks it: ``POST <url>/graphql``
  with the query ``GetPublicSigningKeys`` filtered to the producers' service ids, the
  answer ``{"data": {"publicKeys": {"nodes": [{serviceId, key, version, isActive}]}}}``,
  ``key`` the base64 SubjectPublicKeyInfo. Unlike Mosaic's verifier, a key marked
  ``isActive: false`` (revoked) is not used.

A fetch is outside input from end to end: it runs on a thread of its own for at most
``timeout`` seconds (name resolution included), the answer is read up to
:data:`MAX_ANSWER_BYTES`, and what it holds is checked entry by entry; an entry that does
not load is skipped and named in the log. A fetch that fails in any way changes nothing:
the keys fetched before stay.

:class:`RemoteKeys` is owned by the thread that verifies (the receiver's loop thread,
after the first fetch at start): it fetches when a producer's version is unknown
or its keys are older than ``max_age``, at most once per ``refresh`` seconds per
document, and so blocks that thread for at most ``timeout`` that often.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import json
import logging
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from cryptography.hazmat.primitives.asymmetric import rsa

from framework import names, redaction
from framework.errors import ConfigurationError, TxboxError
from framework.signing import MAX_VERSION, MIN_KEY_BITS, load_public_key, read_key_file

log = logging.getLogger("txbox.receiver.keys")

FORMATS = ("jwks", "mosaic")
SERVICE_PLACEHOLDER = "{service}"
MAX_ANSWER_BYTES = 1024 * 1024
MAX_KEYS = 1000  # entries looked at in one answer
MAX_TOKEN_BYTES = 16 * 1024
# An RSA-8192 modulus is 1,024 bytes, 1,366 characters of base64url.
MAX_MODULUS_CHARS = 1400
MAX_KEY_CHARS = 8192  # a key service entry's base64 SubjectPublicKeyInfo (RSA-8192: ~1,400)
LOOPBACK = ("127.0.0.1", "::1", "localhost")

# What Mosaic's message bus asks its key service (docs/explanation/receive.md, "Event signing").
KEY_SERVICE_QUERY = (
    "query GetPublicSigningKeys($filter: PublicKeyFilter!) {\n"
    "  publicKeys(filter: $filter) {\n"
    "    nodes {\n      serviceId\n      key\n      version\n      isActive\n    }\n"
    "  }\n"
    "}\n"
)

_VERSION = re.compile(r"[0-9]{1,10}")
_SERVICE_VERSION = re.compile(r"([a-z0-9][a-z0-9_-]{0,199})\.([0-9]{1,10})")
_BASE64URL = re.compile(r"[A-Za-z0-9_-]{1,1400}={0,2}")

KeyMap = dict[tuple[str, int], rsa.RSAPublicKey]


class FetchFailed(TxboxError):
    """A fetch of keys gave no usable answer; the text names why, never a credential."""


def check_url(url: str, key_format: str) -> None:
    """Raise :class:`ConfigurationError` unless ``url`` can be fetched as ``key_format``."""
    if key_format not in FORMATS:
        raise ConfigurationError(f"TXBOX_SIGNING_KEYS_FORMAT={key_format!r}: give one of {', '.join(FORMATS)}")
    parts = urlsplit(url)
    shown = redaction.mask_credentials(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigurationError(
            f"TXBOX_SIGNING_KEYS_URL={shown!r}: give an https:// URL. "
            "Example: TXBOX_SIGNING_KEYS_URL=https://keys.example/{service}/jwks.json"
        )
    if parts.scheme == "http" and parts.hostname not in LOOPBACK:
        # Keys fetched in the clear could be swapped on the way: anyone could sign events.
        raise ConfigurationError(
            f"TXBOX_SIGNING_KEYS_URL={shown!r}: fetch the keys over https (plain http only on loopback)"
        )
    if key_format == "mosaic" and SERVICE_PLACEHOLDER in url:
        raise ConfigurationError(
            f"TXBOX_SIGNING_KEYS_URL={shown!r}: Mosaic's key service is one base URL for every producer; "
            "{service} is for JWKS documents"
        )


def _b64url_int(value: Any, what: str) -> int:
    if not isinstance(value, str) or _BASE64URL.fullmatch(value) is None:
        raise ValueError(f"{what} is not base64url")
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
    except (binascii.Error, ValueError):
        raise ValueError(f"{what} is not base64url") from None
    return int.from_bytes(raw, "big")


def jwk_public_key(jwk: Mapping[str, Any]) -> rsa.RSAPublicKey:
    """The RSA public key of one JWK (``kty`` RSA, ``n``, ``e``); ValueError says why not.

    A key for another use (``use`` not ``sig``) or algorithm (``alg`` not ``RS256``), or
    shorter than 2,048 bits, is refused: Mosaic signs with RSA-SHA256.
    """
    if jwk.get("kty") != "RSA":
        raise ValueError("kty is not RSA")
    if jwk.get("use", "sig") != "sig" or jwk.get("alg", "RS256") != "RS256":
        raise ValueError("not an RS256 signing key (use, alg)")
    modulus, exponent = _b64url_int(jwk.get("n"), "n"), _b64url_int(jwk.get("e"), "e")
    if exponent.bit_length() > 64:
        raise ValueError("e is not a usable exponent")
    key = rsa.RSAPublicNumbers(exponent, modulus).public_key()  # ValueError for a bad pair
    if key.key_size < MIN_KEY_BITS:
        raise ValueError(f"{key.key_size} bits, fewer than {MIN_KEY_BITS}")
    return key


def _kid(value: Any, service: str | None) -> tuple[str, int]:
    """(service, version) of a JWK's ``kid``: the bare version in a producer's own document,
    ``<service>.<version>`` in a shared one."""
    if not isinstance(value, str) or len(value) > 212:
        raise ValueError("kid is missing or too long")
    if _VERSION.fullmatch(value):
        if service is None:
            raise ValueError("kid is a bare version but the URL names no {service}")
        version, owner = int(value), service
    else:
        match = _SERVICE_VERSION.fullmatch(value)
        if match is None or not names.valid_service_id(match.group(1)):
            raise ValueError("kid is neither <version> nor <service>.<version>")
        owner, version = match.group(1), int(match.group(2))
        if service is not None and owner != service:
            raise ValueError(f"kid names {owner} in the document of {service}")
    if not 0 < version <= MAX_VERSION:
        raise ValueError("the version is not a whole number from 1")
    return owner, version


def _entries(items: Any, what: str) -> list[Any]:
    if not isinstance(items, list):
        raise FetchFailed(f"the answer is not {what}")
    return items[:MAX_KEYS]


def keys_from_jwks(document: Any, service: str | None, producers: Sequence[str]) -> tuple[KeyMap, list[str]]:
    """The keys of ``producers`` in a JWKS document, and why each other entry was skipped.

    Raises :class:`FetchFailed` for a document that is not a key set at all.
    """
    if not isinstance(document, dict):
        raise FetchFailed('the answer is not a JWKS document ({"keys": [...]})')
    keys: KeyMap = {}
    skipped: list[str] = []
    for n, jwk in enumerate(_entries(document.get("keys"), 'a JWKS document ({"keys": [...]})')):
        try:
            if not isinstance(jwk, dict):
                raise ValueError("not an object")
            owner, version = _kid(jwk.get("kid"), service)
            if owner not in producers:
                continue
            keys[(owner, version)] = jwk_public_key(jwk)
        except ValueError as exc:
            skipped.append(f"keys[{n}]: {exc}")
    return keys, skipped


def keys_from_key_service(document: Any, producers: Sequence[str]) -> tuple[KeyMap, list[str]]:
    """The keys of ``producers`` in an answer of Mosaic's key service, and why each other
    entry was skipped; a revoked key (``isActive: false``) is skipped."""
    if not isinstance(document, dict):
        raise FetchFailed("the answer is not a GraphQL response")
    errors = document.get("errors")
    if errors:
        first = errors[0] if isinstance(errors, list) else errors
        text = first.get("message") if isinstance(first, dict) else first
        raise FetchFailed(f"the key service answered with an error: {str(text)[:200]!r}")
    data = document.get("data")
    connection = data.get("publicKeys") if isinstance(data, dict) else None
    nodes = connection.get("nodes") if isinstance(connection, dict) else None
    keys: KeyMap = {}
    skipped: list[str] = []
    for n, node in enumerate(_entries(nodes, "data.publicKeys.nodes of GetPublicSigningKeys")):
        where = f"nodes[{n}]"
        if not isinstance(node, dict):
            skipped.append(f"{where}: not an object")
            continue
        owner, version, text, active = node.get("serviceId"), node.get("version"), node.get("key"), node.get("isActive")
        if not isinstance(owner, str) or owner not in producers:
            continue
        if isinstance(version, bool) or not isinstance(version, int) or not 0 < version <= MAX_VERSION:
            skipped.append(f"{where}: version is not a whole number from 1")
            continue
        if active is False:
            skipped.append(f"{where}: {owner} key {version} is revoked (isActive: false)")
            continue
        if not isinstance(text, str) or len(text) > MAX_KEY_CHARS:
            skipped.append(f"{where}: key is not a public key's base64")
            continue
        try:
            keys[(owner, version)] = load_public_key(text, f"{owner} key {version}")
        except ConfigurationError as exc:
            skipped.append(f"{where}: {exc}")
    return keys, skipped


@dataclass(frozen=True)
class Request:
    """One HTTP request of a fetch: ``body`` None is a GET."""

    url: str
    body: bytes | None
    headers: Mapping[str, str]


class _Fetch(threading.Thread):
    """One HTTP exchange on a thread of its own, so its caller can stop waiting for it.

    The caller reads ``answer``/``error`` only after :meth:`join` returned with the thread
    ended; after a timeout it calls :meth:`cut` and never reads them.
    """

    def __init__(self, request: Request, timeout: float, max_bytes: int) -> None:
        super().__init__(name="txbox signing keys fetch", daemon=True)
        self.request, self.timeout, self.max_bytes = request, timeout, max_bytes
        self.answer: bytes | None = None
        self.error = "no answer"
        self._connection: http.client.HTTPConnection | None = None

    def run(self) -> None:
        try:
            self.answer = self._exchange()
        except FetchFailed as exc:
            self.error = str(exc)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            self.error = f"the request failed ({type(exc).__name__})"

    def _exchange(self) -> bytes:
        parts = urlsplit(self.request.url)
        host, port = parts.hostname or "", parts.port
        if parts.scheme == "https":
            connection: http.client.HTTPConnection = http.client.HTTPSConnection(
                host, port, timeout=self.timeout, context=ssl.create_default_context()
            )
        else:
            connection = http.client.HTTPConnection(host, port, timeout=self.timeout)
        self._connection = connection
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            method = "GET" if self.request.body is None else "POST"
            connection.request(method, target, body=self.request.body, headers=dict(self.request.headers))
            response = connection.getresponse()
            if response.status != 200:
                raise FetchFailed(f"HTTP {response.status} from the key source")
            length = response.getheader("Content-Length", "")
            if length.isdigit() and len(length) < 20 and int(length) > self.max_bytes:
                raise FetchFailed(f"the answer is {length} bytes, more than {self.max_bytes}")
            data = bytearray()
            while len(data) <= self.max_bytes:
                chunk = response.read(min(64 * 1024, self.max_bytes + 1 - len(data)))
                if not chunk:
                    break
                data += chunk
            if len(data) > self.max_bytes:
                raise FetchFailed(f"the answer is more than {self.max_bytes} bytes")
            return bytes(data)
        finally:
            connection.close()

    def cut(self) -> None:
        """Shut the exchange's socket so the thread ends soon (from the waiting thread:
        only the socket is touched, never the answer)."""
        connection = self._connection
        sock = connection.sock if connection is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def exchange(request: Request, *, timeout: float, max_bytes: int = MAX_ANSWER_BYTES) -> bytes:
    """The body of a 200 answer to ``request``, within ``timeout`` seconds in all.

    Raises :class:`FetchFailed` for anything else: no answer in time (a slow server, name
    resolution included), another status, a larger answer than ``max_bytes``.
    """
    fetch = _Fetch(request, timeout, max_bytes)
    started = time.monotonic()
    fetch.start()
    fetch.join(timeout)
    if fetch.is_alive() or time.monotonic() - started > timeout:
        fetch.cut()
        raise FetchFailed(f"no whole answer within {timeout:g} s")
    if fetch.answer is None:
        raise FetchFailed(fetch.error)
    return fetch.answer


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        raise FetchFailed("the answer is not JSON") from None


@dataclass(frozen=True)
class KeySource:
    """Where producers' keys are fetched from (``TXBOX_SIGNING_KEYS_*``)."""

    url: str
    format: str = "jwks"
    token_file: str = ""
    timeout: float = 5.0

    def __post_init__(self) -> None:
        check_url(self.url, self.format)

    @property
    def shown(self) -> str:
        """The URL as logs and dead letters show it: without credentials."""
        return redaction.mask_credentials(self.url)

    @property
    def per_producer(self) -> bool:
        """Whether each producer has a document of its own (a JWKS URL with ``{service}``)."""
        return self.format == "jwks" and SERVICE_PLACEHOLDER in self.url

    def _headers(self) -> dict[str, str]:
        headers = {"Accept": "application/json", "User-Agent": "txbox"}
        if self.token_file:
            try:
                token = read_key_file(Path(self.token_file), max_bytes=MAX_TOKEN_BYTES).strip()
            except ConfigurationError as exc:
                raise FetchFailed(f"TXBOX_SIGNING_KEYS_TOKEN_FILE: {exc}") from None
            if not token or any(c in token for c in "\r\n"):
                raise FetchFailed("TXBOX_SIGNING_KEYS_TOKEN_FILE holds no single-line token")
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def fetch(self, producers: Sequence[str]) -> tuple[KeyMap, list[str]]:
        """The keys of ``producers`` (one document's worth) and the entries skipped.

        With ``{service}`` in a JWKS URL, ``producers`` is one producer. Raises
        :class:`FetchFailed`.
        """
        headers = self._headers()
        if self.format == "mosaic":
            body = json.dumps(
                {
                    "query": KEY_SERVICE_QUERY,
                    "variables": {"filter": {"serviceId": {"in": list(producers)}}},
                    "operationName": "GetPublicSigningKeys",
                }
            ).encode()
            request = Request(urljoin(self.url, "graphql"), body, {**headers, "Content-Type": "application/json"})
            return keys_from_key_service(_json(exchange(request, timeout=self.timeout)), producers)
        service = producers[0] if self.per_producer else None
        url = self.url.replace(SERVICE_PLACEHOLDER, service) if service is not None else self.url
        return keys_from_jwks(_json(exchange(Request(url, None, headers), timeout=self.timeout)), service, producers)


class RemoteKeys:
    """Producers' keys from a :class:`KeySource`, fetched at start and again when needed.

    Owned by one thread at a time: built and first fetched (:meth:`start`) by the thread
    that starts the receiver, then used by its consuming thread only. A document is
    fetched again when a lookup finds no key of that version, or finds its keys older
    than ``max_age``, but never sooner than ``refresh`` seconds after its last fetch; a
    fetch that fails keeps the keys it had and is logged once until one succeeds.
    """

    def __init__(
        self,
        source: KeySource,
        producers: Sequence[str],
        *,
        refresh: float = 30.0,
        max_age: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.producers = tuple(sorted(set(producers)))
        self.refresh, self.max_age, self.clock = refresh, max_age, clock
        self.keys: KeyMap = {}
        self.fetches = 0  # fetches tried, for tests and logs
        self._tried: dict[str, float] = {}  # document → when last fetched (monotonic)
        self._loaded: dict[str, float] = {}  # document → when last fetched successfully
        self._failure: dict[str, str] = {}  # document → why its last fetch failed

    def _document(self, producer: str) -> str:
        return producer if self.source.per_producer else ""

    def _members(self, document: str) -> tuple[str, ...]:
        return (document,) if document else self.producers

    def start(self) -> None:
        """Fetch every document once; failures are logged, not raised (keys may come later)."""
        for document in {self._document(p) for p in self.producers}:
            self._fetch(document)

    def lookup(self, producer: str, version: int) -> rsa.RSAPublicKey | None:
        """``producer``'s key of ``version``, fetching again first if allowed and needed."""
        if producer not in self.producers:
            return None
        document = self._document(producer)
        key = self.keys.get((producer, version))
        now = self.clock()
        stale = now - self._loaded.get(document, -float("inf")) > self.max_age
        if (key is None or stale) and now - self._tried.get(document, -float("inf")) >= self.refresh:
            self._fetch(document)
            key = self.keys.get((producer, version))
        return key

    def known(self, producer: str) -> list[int]:
        return sorted(v for service, v in self.keys if service == producer)

    def status(self, producer: str) -> str:
        """What a dead letter says of the key source for ``producer``."""
        document = self._document(producer)
        tried = self._tried.get(document)
        if tried is None:
            return f"the key source {self.source.shown} was not asked"
        ago = f"{max(0.0, self.clock() - tried):.0f} s ago"
        failure = self._failure.get(document)
        if failure is not None:
            return f"the key source {self.source.shown} failed {ago}: {failure}"
        return f"the key source {self.source.shown} was asked {ago}"

    def _fetch(self, document: str) -> None:
        members = self._members(document)
        self._tried[document] = self.clock()
        self.fetches += 1
        try:
            fetched, skipped = self.source.fetch(members)
        except FetchFailed as exc:
            if document not in self._failure:
                log.warning(
                    "fetching signing keys from %s failed: %s; keeping the %d keys fetched before",
                    self.source.shown,
                    exc,
                    sum(1 for service, _ in self.keys if service in members),
                )
            self._failure[document] = str(exc)
            return
        self.keys = {k: v for k, v in self.keys.items() if k[0] not in members} | fetched
        self._loaded[document] = self._tried[document]
        if self._failure.pop(document, None) is not None:
            log.warning("fetching signing keys from %s works again", self.source.shown)
        if skipped:
            log.warning(
                "%s: %d entries skipped (%s%s)",
                self.source.shown,
                len(skipped),
                "; ".join(skipped[:5]),
                "; ..." if len(skipped) > 5 else "",
            )
        log.info("signing keys from %s: %s", self.source.shown, ", ".join(f"{s}.{v}" for s, v in sorted(fetched)))
