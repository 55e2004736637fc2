"""The permission guard: a handler's required permissions, checked against the message's JWT.

A handler declares ``permissions`` (framework/handlers.py); before it runs, the
:class:`PermissionGuard` middleware verifies the message's ``auth_token`` with PyJWT
(signature against the configured keys or JWKS, expiry, audience, issuer) and checks that
the token grants every permission. A missing, invalid or insufficient token raises
:class:`~framework.errors.Unauthorized`: the message is dead-lettered at once with reason
``unauthorized``. A JWKS endpoint that cannot be reached is not the message's fault: a
:class:`~framework.errors.RetryableError`. The token itself appears in no error text
(docs/explanation/handle.md, "Handler middleware and the permission guard").

The configuration (``TXBOX_JWT_*``, :class:`JwtSettings`) is read and checked when the
service starts (``Service.check()``), and PyJWT is imported then: the ``jwt`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from framework.errors import ConfigurationError, RetryableError, Unauthorized
from framework.middleware import Middleware
from framework.settings import Seconds, setting

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from framework.envelope import Message

INSTALL = "the permission guard needs PyJWT: pip install 'txbox[jwt]'"
#: Longer tokens are refused unread: every check below runs on bounded input.
MAX_TOKEN_CHARS = 16 * 1024
#: At most this many permissions are read from a token.
MAX_PERMISSIONS = 1000
MIN_SECRET_BYTES = 32  # RFC 7518 §3.2: an HS256 key at least as long as the hash
JWKS_TIMEOUT = 5.0
LOOPBACK = ("127.0.0.1", "::1", "localhost")
#: Key type (JWK ``kty``) each algorithm family verifies with: a key is only tried for its own
#: family, so a public key is never taken for an HMAC secret (algorithm confusion).
FAMILY = {"HS": "oct", "RS": "RSA", "PS": "RSA", "ES": "EC", "Ed": "OKP"}


@dataclass(frozen=True, kw_only=True)
class JwtSettings:
    """How the permission guard verifies tokens (``TXBOX_JWT_*``)."""

    keys: str = setting(
        "TXBOX_JWT_KEYS",
        "/etc/txbox/issuer-public.pem",
        default="",
        help="comma-separated files, each a PEM public key or an HMAC secret (HS* algorithms)",
    )
    jwks: str = setting(
        "TXBOX_JWT_JWKS",
        "https://issuer.example/.well-known/jwks.json",
        default="",
        help="a JWKS file, or its https:// URL (fetched and cached for 5 minutes)",
    )
    audience: str = setting(
        "TXBOX_JWT_AUDIENCE",
        "inventory-service",
        default="",
        help="the `aud` a token must name; required once a handler declares permissions",
    )
    issuer: str = setting("TXBOX_JWT_ISSUER", "https://issuer.example/", default="", help="the `iss` a token must name")
    algorithms: str = setting(
        "TXBOX_JWT_ALGORITHMS",
        "RS256,ES256",
        default="RS256,ES256,EdDSA",
        help="comma-separated allow-list of signing algorithms (never none)",
    )
    permissions_claim: str = setting(
        "TXBOX_JWT_PERMISSIONS_CLAIM",
        "scope",
        default="permissions",
        help="claim holding the permissions: a list, or a space-separated string",
    )
    leeway: Seconds = setting("TXBOX_JWT_LEEWAY", "30s", default=Seconds(30), help="clock skew allowed on exp/nbf/iat")


class TokenVerifier:
    """Verifies ``auth_token`` values; built (and every setting checked) once, at start."""

    def __init__(self, settings: JwtSettings) -> None:
        try:
            import jwt
        except ImportError:
            raise ConfigurationError(INSTALL) from None
        self._jwt = jwt
        self.settings = settings
        self.algorithms = _algorithms(settings.algorithms, set(jwt.algorithms.get_default_algorithms()))
        if not settings.audience:
            raise ConfigurationError(
                "TXBOX_JWT_AUDIENCE is not set: a handler declares permissions, and tokens must be for this "
                "service. Example: TXBOX_JWT_AUDIENCE=inventory-service"
            )
        if not settings.keys and not settings.jwks:
            raise ConfigurationError(
                "a handler declares permissions but no key verifies tokens: set TXBOX_JWT_KEYS to PEM public key "
                "or secret files, or TXBOX_JWT_JWKS to a JWKS file or https:// URL. "
                "Example: TXBOX_JWT_JWKS=https://issuer.example/.well-known/jwks.json"
            )
        self._keys: list[tuple[str, Any]] = []  # (kty, key) of TXBOX_JWT_KEYS
        for name in filter(None, (n.strip() for n in settings.keys.split(","))):
            self._load_key(Path(name))
        self._jwks: list[Any] = []
        self._client: Any = None
        if settings.jwks.startswith(("https://", "http://")):
            if urlsplit(settings.jwks).scheme == "http" and urlsplit(settings.jwks).hostname not in LOOPBACK:
                # Keys fetched in the clear could be swapped on the way: anyone could sign tokens.
                raise ConfigurationError(
                    f"TXBOX_JWT_JWKS={settings.jwks!r}: fetch the keys over https (plain http only on loopback). "
                    "Example: TXBOX_JWT_JWKS=https://issuer.example/.well-known/jwks.json"
                )
            self._client = jwt.PyJWKClient(settings.jwks, lifespan=300, timeout=JWKS_TIMEOUT)
        elif settings.jwks:
            self._jwks = _jwks_file(jwt, Path(settings.jwks))
        if any(kty == "oct" for kty, _ in self._keys) and not any(a.startswith("HS") for a in self.algorithms):
            raise ConfigurationError(
                f"TXBOX_JWT_KEYS holds HMAC secrets but TXBOX_JWT_ALGORITHMS={settings.algorithms!r} allows no HS "
                "algorithm. Example: TXBOX_JWT_ALGORITHMS=HS256"
            )

    def _load_key(self, path: Path) -> None:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigurationError(
                f"TXBOX_JWT_KEYS names {str(path)!r}, which cannot be read ({exc.strerror}). "
                "Example: TXBOX_JWT_KEYS=/etc/txbox/issuer-public.pem"
            ) from None
        if data.lstrip().startswith(b"-----BEGIN"):
            from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, rsa
            from cryptography.hazmat.primitives.serialization import load_pem_public_key

            try:
                key = load_pem_public_key(data)
            except ValueError:
                raise ConfigurationError(
                    f"TXBOX_JWT_KEYS: {str(path)!r} is PEM but not a public key (a private key or certificate "
                    "does not belong here): export it with `openssl pkey -pubout`"
                ) from None
            kinds = (
                (rsa.RSAPublicKey, "RSA"),
                (ec.EllipticCurvePublicKey, "EC"),
                (ed25519.Ed25519PublicKey | ed448.Ed448PublicKey, "OKP"),
            )
            kty = next((kty for kind, kty in kinds if isinstance(key, kind)), "")
            if not kty:
                raise ConfigurationError(
                    f"TXBOX_JWT_KEYS: {str(path)!r} holds a {type(key).__name__}, no JWT signing key"
                )
            self._keys.append((kty, key))
            return
        secret = data.strip()
        if len(secret) < MIN_SECRET_BYTES:
            raise ConfigurationError(
                f"TXBOX_JWT_KEYS: the secret in {str(path)!r} has {len(secret)} bytes; an HMAC secret needs at "
                f"least {MIN_SECRET_BYTES}. Example: openssl rand -hex 32 > {path}"
            )
        self._keys.append(("oct", secret))

    def verify(self, token: str | None) -> Mapping[str, Any]:
        """The token's claims; raises Unauthorized (never naming the token) when it does not verify."""
        jwt = self._jwt
        if not token:
            raise Unauthorized("the message carries no auth_token")
        if len(token) > MAX_TOKEN_CHARS:
            raise Unauthorized(f"the auth_token is longer than {MAX_TOKEN_CHARS} characters")
        try:
            header = jwt.get_unverified_header(token)
        except jwt.PyJWTError:
            raise Unauthorized("the auth_token is not a JWT") from None
        alg = header.get("alg")
        if alg not in self.algorithms:
            raise Unauthorized(
                f"the auth_token is signed with {str(alg)[:20]!r}, not an allowed algorithm "
                f"({', '.join(self.algorithms)})"
            )
        for key in self._keys_for(alg, header.get("kid")):
            try:
                claims: Mapping[str, Any] = jwt.decode(
                    token,
                    key,
                    algorithms=[alg],
                    audience=self.settings.audience,
                    issuer=self.settings.issuer or None,
                    leeway=float(self.settings.leeway),
                    options={"require": ["exp"]},
                )
                return claims
            except (jwt.InvalidSignatureError, jwt.InvalidKeyError):
                continue  # another configured key may have signed it
            except jwt.PyJWTError as exc:
                raise Unauthorized(f"the auth_token is refused: {_why(jwt, exc)}") from None
        raise Unauthorized("the auth_token's signature matches no configured key")

    def _keys_for(self, alg: str, kid: object) -> list[Any]:
        """Keys of the family of ``alg`` only: a public key is never tried as an HMAC secret."""
        kty = FAMILY[alg[:2]]
        keys = [key for family, key in self._keys if family == kty]
        jwks = self._jwks
        if self._client is not None:
            try:
                jwks = self._client.get_signing_keys()
            except (
                self._jwt.PyJWKClientError
            ) as exc:  # unreachable, or no keys: the issuer's trouble, not the message's
                raise RetryableError(f"the JWKS at {self.settings.jwks} gives no keys: {exc}") from None
        for jwk in jwks:
            if jwk.key_type == kty and (kid is None or jwk.key_id in (None, kid)):
                keys.append(jwk.key)
        return keys


class PermissionGuard(Middleware):
    """Middleware: before a handler that declares ``permissions`` runs, its message's token
    must verify and grant them all. Other handlers' messages pass unread."""

    def __init__(self, required: Callable[[str], Collection[str] | None], verifier: TokenVerifier) -> None:
        self._required = required
        self.verifier = verifier

    def before(self, message: Message, session: Session) -> None:
        needed = self._required(message.message_type)
        if needed is None:
            return
        claims = self.verifier.verify(message.auth_token)
        missing = sorted(set(needed) - granted(claims, self.verifier.settings.permissions_claim))
        if missing:
            raise Unauthorized(
                f"the auth_token does not grant {', '.join(missing)}, which {message.message_type} requires "
                f"(claim {self.verifier.settings.permissions_claim!r})"
            )


def granted(claims: Mapping[str, Any], claim: str) -> frozenset[str]:
    """The permissions a token grants: a list of strings, or one space-separated string (OAuth ``scope``)."""
    value = claims.get(claim)
    if isinstance(value, str):
        return frozenset(value[:MAX_TOKEN_CHARS].split()[:MAX_PERMISSIONS])
    if isinstance(value, list):
        return frozenset(v for v in value[:MAX_PERMISSIONS] if isinstance(v, str))
    return frozenset()


def _algorithms(text: str, known: set[str]) -> tuple[str, ...]:
    algorithms = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [a for a in algorithms if a not in known or a[:2] not in FAMILY]
    if bad or not algorithms:
        raise ConfigurationError(
            f"TXBOX_JWT_ALGORITHMS={text!r}: {', '.join(map(repr, bad)) or 'empty'} not allowed; name signing "
            f"algorithms of {', '.join(sorted(known - {'none'}))}. Example: TXBOX_JWT_ALGORITHMS=RS256,ES256"
        )
    return algorithms


def _jwks_file(jwt: Any, path: Path) -> list[Any]:
    try:
        keys: list[Any] = jwt.PyJWKSet.from_json(path.read_text()).keys
    except OSError as exc:
        raise ConfigurationError(
            f"TXBOX_JWT_JWKS names {str(path)!r}, which cannot be read ({exc.strerror}). "
            "Example: TXBOX_JWT_JWKS=/etc/txbox/jwks.json"
        ) from None
    except (jwt.PyJWTError, json.JSONDecodeError, ValueError) as exc:
        raise ConfigurationError(f"TXBOX_JWT_JWKS: {str(path)!r} is not a usable JWK Set ({exc})") from None
    return keys


def _why(jwt: Any, exc: Exception) -> str:
    """Why PyJWT refused a token, in words that never quote it."""
    for kind, why in (
        (jwt.ExpiredSignatureError, "it has expired"),
        (jwt.ImmatureSignatureError, "it is not valid yet"),
        (jwt.InvalidAudienceError, "it is not for this audience"),
        (jwt.InvalidIssuerError, "it is from another issuer"),
        (jwt.MissingRequiredClaimError, f"it lacks the claim {getattr(exc, 'claim', '?')!r}"),
        (jwt.DecodeError, "it cannot be decoded"),
    ):
        if isinstance(exc, kind):
            return why
    return type(exc).__name__
