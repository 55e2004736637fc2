"""Producers' keys from a URL and from a file of PEMs (docs/explanation/receive.md, "Event signing"):
what a JWKS document or Mosaic's key service may answer, when keys are fetched again, and
what a hostile answer ends in. The key sources are served by the test over loopback."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from framework import signing
from framework.errors import ConfigurationError
from framework.reasons import Reason
from framework.signing import Policy, SignatureRejected, Signer, SigningConfig, Verifier
from framework.signing_keys import (
    KEY_SERVICE_QUERY,
    FetchFailed,
    KeySource,
    RemoteKeys,
    check_url,
    jwk_public_key,
    keys_from_jwks,
    keys_from_key_service,
)
from tests.key_server import KeyServer, jwk, key_service_answer, spki_b64

BODY = b'{"payload":{"id":1},"message_type":"MediaCreated"}'
MEDIA = "ax-media-service"


@pytest.fixture(scope="module")
def key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def new_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture
def server() -> Iterator[KeyServer]:
    with KeyServer() as running:
        yield running


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def same(a: rsa.RSAPublicKey | None, b: rsa.RSAPrivateKey) -> bool:
    return a is not None and a.public_numbers() == b.public_key().public_numbers()


def test_a_jwk_gives_the_rsa_key_of_its_numbers_and_nothing_else(key: rsa.RSAPrivateKey) -> None:
    assert same(jwk_public_key(jwk(key, "1")), key)
    assert same(jwk_public_key({k: v for k, v in jwk(key, "1").items() if k not in ("use", "alg")}), key)
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    for bad, why in [
        (jwk(key, "1", kty="EC"), "kty"),
        (jwk(key, "1", use="enc"), "use"),
        (jwk(key, "1", alg="PS256"), "alg"),
        (jwk(key, "1", n="not base64!"), "base64url"),
        (jwk(key, "1", e=123), "base64url"),
        (jwk(key, "1", n="A" * 5000), "base64url"),
        (jwk(small, "1"), "fewer than 2048"),
    ]:
        with pytest.raises(ValueError, match=why):
            jwk_public_key(bad)


def test_a_jwks_kid_is_the_version_in_a_producers_document_and_names_the_producer_in_a_shared_one(
    key: rsa.RSAPrivateKey, new_key: rsa.RSAPrivateKey
) -> None:
    own = {"keys": [jwk(key, "1"), jwk(new_key, "2"), jwk(key, "ax-other.5"), {"kid": "3"}, "junk"]}
    keys, skipped = keys_from_jwks(own, MEDIA, [MEDIA])
    assert set(keys) == {(MEDIA, 1), (MEDIA, 2)} and same(keys[(MEDIA, 2)], new_key)
    assert len(skipped) == 3 and "names ax-other" in skipped[0] and "not an object" in skipped[2]
    shared = {"keys": [jwk(key, f"{MEDIA}.7"), jwk(key, "1"), jwk(key, "ax-not-asked.1")]}
    keys, skipped = keys_from_jwks(shared, None, [MEDIA])
    assert set(keys) == {(MEDIA, 7)}  # a producer not asked for is left out, not an error
    assert skipped == ["keys[1]: kid is a bare version but the URL names no {service}"]
    for document in ([], {"keys": {}}, {"nokeys": []}, "text"):
        with pytest.raises(FetchFailed, match="JWKS"):
            keys_from_jwks(document, MEDIA, [MEDIA])


def test_the_key_service_answer_gives_active_keys_of_the_producers_asked(
    key: rsa.RSAPrivateKey, new_key: rsa.RSAPrivateKey
) -> None:
    nodes = [
        {"serviceId": MEDIA, "version": 1, "key": spki_b64(key), "isActive": False},
        {"serviceId": MEDIA, "version": 2, "key": spki_b64(new_key), "isActive": True},
        {"serviceId": MEDIA, "version": True, "key": spki_b64(key), "isActive": True},
        {"serviceId": MEDIA, "version": 3, "key": "bm90IGEga2V5", "isActive": True},
        {"serviceId": "ax-other", "version": 1, "key": spki_b64(key), "isActive": True},
    ]
    keys, skipped = keys_from_key_service(json.loads(key_service_answer(nodes)), [MEDIA])
    assert set(keys) == {(MEDIA, 2)} and same(keys[(MEDIA, 2)], new_key)
    assert [s.split(":")[0] for s in skipped] == ["nodes[0]", "nodes[2]", "nodes[3]"]
    assert "revoked" in skipped[0]
    with pytest.raises(FetchFailed, match="answered with an error: 'Unauthorized'"):
        keys_from_key_service({"errors": [{"message": "Unauthorized"}], "data": None}, [MEDIA])
    for answer in ({"data": {"publicKeys": None}}, {"data": []}, [1]):
        with pytest.raises(FetchFailed, match=r"GetPublicSigningKeys|GraphQL"):
            keys_from_key_service(answer, [MEDIA])


def test_a_key_url_must_be_https_or_loopback_and_fit_its_format() -> None:
    check_url("https://keys.example/{service}/jwks.json", "jwks")
    check_url("http://127.0.0.1:8080/", "mosaic")
    with pytest.raises(ConfigurationError, match="over https"):
        check_url("http://keys.example/jwks.json", "jwks")
    with pytest.raises(ConfigurationError, match="https:// URL"):
        check_url("ftp://keys.example/jwks.json", "jwks")
    with pytest.raises(ConfigurationError, match="one base URL"):
        check_url("https://keys.example/{service}/", "mosaic")
    with pytest.raises(ConfigurationError, match="TXBOX_SIGNING_KEYS_FORMAT"):
        check_url("https://keys.example/", "pem")
    with pytest.raises(ConfigurationError) as caught:
        check_url("ftp://user:hunter2@keys.example/", "jwks")
    assert "hunter2" not in str(caught.value)


def test_the_key_service_is_asked_as_mosaic_asks_it_with_the_token(
    server: KeyServer, key: rsa.RSAPrivateKey, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    server.serve(key_service_answer([{"serviceId": MEDIA, "version": 1, "key": spki_b64(key), "isActive": True}]))
    keys, _ = KeySource(f"{server.base}/", "mosaic", str(token)).fetch([MEDIA, "ax-other"])
    assert set(keys) == {(MEDIA, 1)}
    asked = server.requests[0]
    assert (asked["method"], asked["path"], asked["auth"]) == ("POST", "/graphql", "Bearer s3cret-token")
    body = json.loads(asked["body"])
    assert body["query"] == KEY_SERVICE_QUERY
    assert body["variables"] == {"filter": {"serviceId": {"in": [MEDIA, "ax-other"]}}}
    token.unlink()
    with pytest.raises(FetchFailed, match="TXBOX_SIGNING_KEYS_TOKEN_FILE"):
        KeySource(f"{server.base}/", "mosaic", str(token)).fetch([MEDIA])


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        ({"kind": "huge", "size": 4 * 1024 * 1024}, "more than 1048576 bytes"),
        ({"kind": "slow"}, r"no whole answer within 1 s"),
        ({"kind": "trickle"}, r"no whole answer within 1 s"),
        ({"kind": "drop"}, "the request failed"),
        ({"body": b"<html>not json</html>"}, "not JSON"),
        ({"body": b"[" * 100_000}, "not JSON"),
        ({"body": b'{"keys": []}', "status": 500}, "HTTP 500"),
        ({"body": b'{"keys": []}', "status": 302}, "HTTP 302"),
    ],
)
def test_a_hostile_answer_ends_as_a_failed_fetch(server: KeyServer, answer: dict[str, object], why: str) -> None:
    if "kind" in answer:
        server.hostile(str(answer["kind"]), int(answer.get("size", 0)))  # type: ignore[call-overload]
    else:
        server.serve(answer["body"], int(answer.get("status", 200)))  # type: ignore[arg-type, call-overload]
    with pytest.raises(FetchFailed, match=why):
        KeySource(f"{server.base}/{{service}}.json", timeout=1.0).fetch([MEDIA])


def test_unknown_versions_fetch_again_at_most_once_per_refresh_and_failures_keep_the_keys(
    server: KeyServer, key: rsa.RSAPrivateKey, new_key: rsa.RSAPrivateKey, caplog: pytest.LogCaptureFixture
) -> None:
    server.serve({"keys": [jwk(key, "1")]})
    clock = Clock()
    remote = RemoteKeys(
        KeySource(f"{server.base}/keys/{{service}}.json"), [MEDIA], refresh=30, max_age=600, clock=clock
    )
    remote.start()
    assert server.requests[0]["path"] == f"/keys/{MEDIA}.json" and server.requests[0]["method"] == "GET"
    assert same(remote.lookup(MEDIA, 1), key) and remote.fetches == 1
    server.serve({"keys": [jwk(key, "1"), jwk(new_key, "2")]})  # rotation: version 2 appears
    assert remote.lookup(MEDIA, 2) is None and remote.fetches == 1  # asked at start, too recently
    clock.now += 30
    assert same(remote.lookup(MEDIA, 2), new_key) and remote.fetches == 2
    assert remote.lookup(MEDIA, 9) is None and remote.fetches == 2
    assert remote.lookup("ax-not-a-producer", 1) is None and remote.fetches == 2
    # The source turns hostile: every fetch fails, the keys stay, the failure is logged once.
    server.serve(b"garbage")
    caplog.set_level(logging.WARNING, logger="txbox.receiver.keys")
    for _ in range(3):
        clock.now += 31
        assert remote.lookup(MEDIA, 9) is None
    assert remote.fetches == 5 and same(remote.lookup(MEDIA, 2), new_key)
    failures = [r for r in caplog.records if "failed" in r.getMessage()]
    assert len(failures) == 1 and "keeping the 2 keys" in failures[0].getMessage()
    assert "failed" in remote.status(MEDIA) and "not JSON" in remote.status(MEDIA)
    # Healthy again, version 1 withdrawn: the keys older than max_age are fetched again.
    server.serve({"keys": [jwk(new_key, "2")]})
    clock.now += 600
    assert same(remote.lookup(MEDIA, 2), new_key) and remote.fetches == 6
    assert remote.known(MEDIA) == [2]
    assert any("works again" in r.getMessage() for r in caplog.records)


def test_the_verifier_takes_a_fetched_key_and_says_what_the_source_did(
    server: KeyServer, key: rsa.RSAPrivateKey, new_key: rsa.RSAPrivateKey
) -> None:
    server.serve({"keys": [jwk(key, f"{MEDIA}.1")]})
    remote = RemoteKeys(KeySource(f"{server.base}/jwks.json"), [MEDIA], refresh=0)
    remote.start()
    verifier = Verifier(keys={}, policies={MEDIA: Policy.REQUIRED}, remote=remote)
    verifier.check()  # no key at start is no error: the source may hold it
    verifier.verify(MEDIA, Signer(key, 1).headers(BODY), BODY)
    server.serve({"keys": [jwk(key, f"{MEDIA}.1"), jwk(new_key, f"{MEDIA}.2")]})
    verifier.verify(MEDIA, Signer(new_key, 2).headers(BODY), BODY)
    with pytest.raises(SignatureRejected) as caught:
        verifier.verify(MEDIA, Signer(new_key, 3).headers(BODY), BODY)
    assert caught.value.reason is Reason.SIGNING_KEY_UNKNOWN
    assert "known: 1, 2" in str(caught.value) and f"{server.base}/jwks.json was asked" in str(caught.value)
    with pytest.raises(SignatureRejected) as caught:
        verifier.verify(MEDIA, Signer(key, 2).headers(BODY), BODY)  # the right version, the wrong key
    assert caught.value.reason is Reason.SIGNATURE_INVALID


def test_signing_config_fetches_the_producers_keys_at_start(
    server: KeyServer, key: rsa.RSAPrivateKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.serve(key_service_answer([{"serviceId": MEDIA, "version": 4, "key": spki_b64(key), "isActive": True}]))
    monkeypatch.setenv("TXBOX_SIGNING_KEYS_URL", f"{server.base}/")
    monkeypatch.setenv("TXBOX_SIGNING_KEYS_FORMAT", "mosaic")
    with pytest.raises(ConfigurationError, match="needs TXBOX_SIGNING_VERIFY"):
        SigningConfig.from_env().verifier([MEDIA])
    assert server.count() == 0
    monkeypatch.setenv("TXBOX_SIGNING_VERIFY", "*=required,ax-unsigned=off")
    verifier = SigningConfig.from_env().verifier([MEDIA, "ax-unsigned"])
    assert verifier is not None and verifier.remote is not None
    assert json.loads(server.requests[0]["body"])["variables"]["filter"]["serviceId"]["in"] == [MEDIA]
    assert same(verifier.remote.keys[(MEDIA, 4)], key)
    monkeypatch.setenv("TXBOX_SIGNING_KEYS_FORMAT", "x509")
    with pytest.raises(ConfigurationError, match="TXBOX_SIGNING_KEYS_FORMAT"):
        SigningConfig.from_env().verifier([MEDIA])


def pem(key: rsa.RSAPrivateKey) -> str:
    return (
        key.public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        .decode()
    )


def test_a_keys_file_holds_labelled_pem_blocks(
    tmp_path: Path, key: rsa.RSAPrivateKey, new_key: rsa.RSAPrivateKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "producers.pem"
    path.write_text(f"# producers' keys\n\n{MEDIA}.1\n{pem(key)}\nax-other.12\n{pem(new_key)}")
    keys = signing.public_keys_from(path)
    assert set(keys) == {(MEDIA, 1), ("ax-other", 12)} and same(keys[("ax-other", 12)], new_key)
    monkeypatch.setenv("TXBOX_SIGNING_PUBLIC_KEYS", str(path))
    verifier = SigningConfig.from_env().verifier()
    assert verifier is not None and verifier.policy("ax-other") is Policy.REQUIRED
    for text, why in [
        (pem(key), r"line 1: a PEM block needs a line <service>\.<version>"),
        (f"{MEDIA}\n{pem(key)}", r"line 1: 'ax-media-service' is not <service>\.<version>"),
        (f"{MEDIA}.1\n{pem(key)}{MEDIA}.1\n{pem(key)}", "ax-media-service.1 is given twice"),
        (f"{MEDIA}.1\n{MEDIA}.2\n{pem(key)}", "line 2: a PEM block was expected"),
        (f"{MEDIA}.1\n{pem(key)[:100]}", "ends inside a key"),
        (f"{MEDIA}.1\n-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n", "does not load"),
        (f"{MEDIA}.0\n{pem(key)}", r"not <service>\.<version>"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigurationError, match=why):
            signing.public_keys_from(path)
    path.write_text(f"{MEDIA}.1\n{pem(key)}" * 3000)  # over 1 MiB: refused by its size
    with pytest.raises(ConfigurationError, match="more than a key file holds"):
        signing.public_keys_from(path)
