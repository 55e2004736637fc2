"""The permission guard's token checks (framework/permissions.py), with keys made here."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from framework.envelope import Message
from framework.errors import ConfigurationError, RetryableError, Unauthorized
from framework.middleware import Middleware, hooks
from framework.permissions import JwtSettings, PermissionGuard, TokenVerifier, granted

AUDIENCE = "inventory-service"
SECRET = b"unit-test-only-hmac-secret-" + b"0123456789abcdef" * 3


@pytest.fixture(scope="module")
def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def write(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(data)
    return str(path)


def claims(**over: Any) -> dict[str, Any]:
    return {"aud": AUDIENCE, "exp": int(time.time()) + 60, "permissions": ["inventory:restock"], **over}


@pytest.fixture
def verifier(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> TokenVerifier:
    return TokenVerifier(JwtSettings(keys=write(tmp_path, "pub.pem", pem(rsa_key)), audience=AUDIENCE))


def refused(verifier: TokenVerifier, token: str | None, why: str) -> None:
    with pytest.raises(Unauthorized, match=why) as caught:
        verifier.verify(token)
    if token:
        assert token not in str(caught.value)


def test_a_good_token_verifies(verifier: TokenVerifier, rsa_key: rsa.RSAPrivateKey) -> None:
    token = jwt.encode(claims(), rsa_key, algorithm="RS256")
    assert verifier.verify(token)["permissions"] == ["inventory:restock"]


def test_an_expired_token_is_refused(verifier: TokenVerifier, rsa_key: rsa.RSAPrivateKey) -> None:
    refused(verifier, jwt.encode(claims(exp=int(time.time()) - 120), rsa_key, algorithm="RS256"), "expired")


def test_a_token_without_expiry_is_refused(verifier: TokenVerifier, rsa_key: rsa.RSAPrivateKey) -> None:
    no_exp = {k: v for k, v in claims().items() if k != "exp"}
    refused(verifier, jwt.encode(no_exp, rsa_key, algorithm="RS256"), "lacks the claim 'exp'")


def test_a_token_for_another_audience_is_refused(verifier: TokenVerifier, rsa_key: rsa.RSAPrivateKey) -> None:
    refused(verifier, jwt.encode(claims(aud="order-service"), rsa_key, algorithm="RS256"), "audience")


def test_a_token_signed_by_another_key_is_refused(verifier: TokenVerifier) -> None:
    other = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    refused(verifier, jwt.encode(claims(), other, algorithm="RS256"), "matches no configured key")


def test_a_missing_or_garbled_token_is_refused(verifier: TokenVerifier) -> None:
    refused(verifier, None, "carries no auth_token")
    refused(verifier, "", "carries no auth_token")
    refused(verifier, "not.a-jwt", "not a JWT")
    refused(verifier, "x" * 20_000, "longer than")


def test_alg_none_is_refused(verifier: TokenVerifier) -> None:
    refused(verifier, jwt.encode(claims(), None, algorithm="none"), "'none', not an allowed algorithm")


def test_the_public_key_is_never_taken_for_an_hmac_secret(tmp_path: Path, rsa_key: rsa.RSAPrivateKey) -> None:
    """Algorithm confusion: an HS256 token "signed" with the public PEM as secret."""
    both = TokenVerifier(
        JwtSettings(keys=write(tmp_path, "pub.pem", pem(rsa_key)), audience=AUDIENCE, algorithms="RS256,HS256")
    )
    forged = jwt.api_jws.PyJWS()
    forged._algorithms["HS256"].prepare_key = lambda key: key  # type: ignore[method-assign]
    token = forged.encode(json.dumps(claims()).encode(), pem(rsa_key), algorithm="HS256")
    refused(both, token, "matches no configured key")


def test_hmac_secret_and_issuer(tmp_path: Path) -> None:
    verifier = TokenVerifier(
        JwtSettings(
            keys=write(tmp_path, "secret", SECRET + b"\n"), audience=AUDIENCE, algorithms="HS256", issuer="https://i/"
        )
    )
    assert verifier.verify(jwt.encode(claims(iss="https://i/"), SECRET, algorithm="HS256"))
    refused(verifier, jwt.encode(claims(iss="https://evil/"), SECRET, algorithm="HS256"), "another issuer")
    refused(verifier, jwt.encode(claims(), SECRET, algorithm="HS384"), "not an allowed algorithm")


def test_jwks_file_picks_the_key_by_kid(tmp_path: Path) -> None:
    signing = ec.generate_private_key(ec.SECP256R1())
    jwk = json.loads(jwt.algorithms.ECAlgorithm.to_jwk(signing.public_key()))
    jwks = write(tmp_path, "jwks.json", json.dumps({"keys": [{**jwk, "kid": "k1", "use": "sig"}]}).encode())
    verifier = TokenVerifier(JwtSettings(jwks=jwks, audience=AUDIENCE, algorithms="ES256"))
    assert verifier.verify(jwt.encode(claims(), signing, algorithm="ES256", headers={"kid": "k1"}))
    refused(verifier, jwt.encode(claims(), signing, algorithm="ES256", headers={"kid": "k2"}), "no configured key")


def test_an_unreachable_jwks_url_is_retried_not_a_rejection(rsa_key: rsa.RSAPrivateKey) -> None:
    verifier = TokenVerifier(JwtSettings(jwks="http://127.0.0.1:9/jwks.json", audience=AUDIENCE))
    with pytest.raises(RetryableError, match="gives no keys"):
        verifier.verify(jwt.encode(claims(), rsa_key, algorithm="RS256"))


@pytest.mark.parametrize(
    ("settings", "fix"),
    [
        (dict(keys="{secret}", algorithms="HS256"), "TXBOX_JWT_AUDIENCE is not set"),
        (dict(audience=AUDIENCE), "set TXBOX_JWT_KEYS"),
        (dict(keys="{secret}", audience=AUDIENCE, algorithms="none"), "TXBOX_JWT_ALGORITHMS='none'"),
        (dict(keys="{secret}", audience=AUDIENCE, algorithms="HS256,XX1"), "'XX1'"),
        (dict(keys="{secret}", audience=AUDIENCE), "allows no HS algorithm"),
        (dict(keys="{short}", audience=AUDIENCE, algorithms="HS256"), "needs at least 32"),
        (dict(keys="/nonexistent/key.pem", audience=AUDIENCE), "cannot be read"),
        (dict(jwks="{short}", audience=AUDIENCE), "not a usable JWK Set"),
        (dict(jwks="http://issuer.example/jwks.json", audience=AUDIENCE), "over https"),
    ],
)
def test_bad_settings_fail_at_start_with_the_fix(tmp_path: Path, settings: dict[str, str], fix: str) -> None:
    files = {"secret": write(tmp_path, "s", SECRET), "short": write(tmp_path, "short", b"tiny")}
    with pytest.raises(ConfigurationError, match=fix.replace("(", r"\(")):
        TokenVerifier(JwtSettings(**{k: v.format(**files) for k, v in settings.items()}))


def test_settings_come_from_the_environment() -> None:
    from framework.settings import load

    settings = load(JwtSettings, {"TXBOX_JWT_AUDIENCE": "a", "TXBOX_JWT_PERMISSIONS_CLAIM": "scope"})
    assert (settings.audience, settings.permissions_claim, settings.algorithms) == ("a", "scope", "RS256,ES256,EdDSA")


def test_permissions_are_a_list_or_a_space_separated_string() -> None:
    assert granted({"p": ["a", "b", 3]}, "p") == {"a", "b"}
    assert granted({"scope": "a  b c"}, "scope") == {"a", "b", "c"}
    assert granted({"p": {"a": 1}}, "p") == frozenset()
    assert granted({}, "p") == frozenset()


def message(token: str | None, message_type: str = "RestockItem") -> Message:
    return Message(
        message_id=uuid.uuid4(),
        message_type=message_type,
        aggregate_type="item",
        aggregate_id="1",
        payload={},
        auth_token=token,
    )


def test_the_guard_checks_the_permissions_a_handler_requires(
    verifier: TokenVerifier, rsa_key: rsa.RSAPrivateKey
) -> None:
    required = {"RestockItem": {"inventory:restock"}, "Open": None}
    guard = PermissionGuard(required.get, verifier)
    session: Any = None
    guard.before(message(jwt.encode(claims(), rsa_key, algorithm="RS256")), session)
    guard.before(message(None, "Open"), session)  # this handler needs no token
    weak = jwt.encode(claims(permissions=["inventory:read"]), rsa_key, algorithm="RS256")
    with pytest.raises(Unauthorized, match="does not grant inventory:restock") as caught:
        guard.before(message(weak), session)
    assert weak not in str(caught.value)
    with pytest.raises(Unauthorized, match="no auth_token"):
        guard.before(message(None), session)


class Recorder(Middleware):
    def __init__(self, name: str, calls: list[str], fail_before: bool = False) -> None:
        self.name, self.calls, self.fail_before = name, calls, fail_before

    def before(self, message: Message, session: Any) -> None:
        self.calls.append(f"{self.name}.before")
        if self.fail_before:
            raise Unauthorized("no")

    def after(self, message: Message, session: Any, sent: Any) -> None:
        self.calls.append(f"{self.name}.after:{len(sent)}")

    def on_failure(self, message: Message, exc: BaseException) -> None:
        self.calls.append(f"{self.name}.on_failure:{type(exc).__name__}")
        raise RuntimeError("a broken hook does not hide the failure")


def test_hooks_run_in_order_and_unwind_in_reverse() -> None:
    calls: list[str] = []
    outbox = cast(Any, SimpleNamespace(written=["row"]))
    chain = [Recorder("a", calls), Recorder("b", calls)]
    with hooks(chain, message(None), cast(Any, None), outbox):
        calls.append("handle")
    assert calls == ["a.before", "b.before", "handle", "b.after:1", "a.after:1"]
    calls.clear()
    with pytest.raises(ValueError), hooks(chain, message(None), cast(Any, None), outbox):
        raise ValueError
    assert calls == ["a.before", "b.before", "b.on_failure:ValueError", "a.on_failure:ValueError"]
    calls.clear()
    chain = [Recorder("a", calls), Recorder("b", calls, fail_before=True), Recorder("c", calls)]
    with pytest.raises(Unauthorized), hooks(chain, message(None), cast(Any, None), outbox):
        calls.append("handle")
    assert calls == ["a.before", "b.before", "b.on_failure:Unauthorized", "a.on_failure:Unauthorized"]
