"""Event signatures (docs/explanation/receive.md, "Event signing"): what each policy makes of a
delivery's headers and body, and what a key's text may be."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from framework import signing
from framework.errors import ConfigurationError
from framework.reasons import Reason
from framework.signing import KEY_VERSION_HEADER, SIGNATURE_HEADER, Policy, SignatureRejected, Signer, Verifier

BODY = b'{"payload":{"id":1},"message_type":"WidgetCreated"}'


@pytest.fixture(scope="module")
def key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


@pytest.fixture(scope="module")
def other_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def mosaic_private_text(key: rsa.RSAPrivateKey) -> str:
    """The private key as Mosaic's RMQ_EVENT_SIGNING_PRIVATE_KEY holds it: PKCS#8 base64, no armour."""
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return base64.b64encode(der).decode()


def verifier(key: rsa.RSAPrivateKey, policy: Policy, version: int = 3) -> Verifier:
    return Verifier(keys={("ax-media-service", version): key.public_key()}, policies={"ax-media-service": policy})


def rejected(v: Verifier, headers: dict[str, object], body: bytes = BODY, producer: str = "ax-media-service") -> Reason:
    with pytest.raises(SignatureRejected) as caught:
        v.verify(producer, headers, body)
    return caught.value.reason


def test_a_signed_body_verifies_and_any_change_of_it_does_not(key: rsa.RSAPrivateKey) -> None:
    headers = Signer(signing.load_private_key(mosaic_private_text(key)), 3).headers(BODY)
    assert headers[KEY_VERSION_HEADER] == 3
    v = verifier(key, Policy.REQUIRED)
    v.verify("ax-media-service", headers, BODY)
    assert rejected(v, headers, BODY.replace(b"1", b"2")) is Reason.SIGNATURE_INVALID
    assert rejected(v, headers, BODY + b" ") is Reason.SIGNATURE_INVALID


def test_each_policy_judges_an_unsigned_event(key: rsa.RSAPrivateKey) -> None:
    assert rejected(verifier(key, Policy.REQUIRED), {}) is Reason.SIGNATURE_MISSING
    verifier(key, Policy.WHEN_PRESENT).verify("ax-media-service", {}, BODY)
    verifier(key, Policy.OFF).verify("ax-media-service", {SIGNATURE_HEADER: "junk"}, BODY)
    # A producer the policies do not name gets the default.
    Verifier(keys={}).verify("someone-else", {SIGNATURE_HEADER: "junk"}, BODY)


def test_a_signature_that_is_there_must_hold_even_when_optional(key: rsa.RSAPrivateKey) -> None:
    headers = Signer(key, 3).headers(BODY)
    forged = {**headers, SIGNATURE_HEADER: headers[SIGNATURE_HEADER][:-8] + "AAAAAAA="}
    assert rejected(verifier(key, Policy.WHEN_PRESENT), forged) is Reason.SIGNATURE_INVALID
    # One header without the other is a broken signature, not an unsigned event.
    assert rejected(verifier(key, Policy.WHEN_PRESENT), {KEY_VERSION_HEADER: 3}) is Reason.SIGNATURE_INVALID


def test_a_wrong_or_stale_key_version_is_its_own_reason(key: rsa.RSAPrivateKey, other_key: rsa.RSAPrivateKey) -> None:
    v = verifier(key, Policy.REQUIRED, version=3)
    assert rejected(v, Signer(key, 2).headers(BODY)) is Reason.SIGNING_KEY_UNKNOWN
    # Signed with another key under the version the receiver knows: the signature fails.
    assert rejected(v, Signer(other_key, 3).headers(BODY)) is Reason.SIGNATURE_INVALID
    # Another producer's valid signature is not this producer's.
    everyone = Verifier(keys=v.keys, default=Policy.REQUIRED)
    assert rejected(everyone, Signer(key, 3).headers(BODY), producer="ax-other") is Reason.SIGNING_KEY_UNKNOWN


@pytest.mark.parametrize(
    "headers",
    [
        {SIGNATURE_HEADER: "A" * 5000, KEY_VERSION_HEADER: 3},
        {SIGNATURE_HEADER: "not base64 !", KEY_VERSION_HEADER: 3},
        {SIGNATURE_HEADER: "QUJD", KEY_VERSION_HEADER: "3; drop"},
        {SIGNATURE_HEADER: "QUJD", KEY_VERSION_HEADER: True},
        {SIGNATURE_HEADER: "QUJD", KEY_VERSION_HEADER: -1},
        {SIGNATURE_HEADER: "QUJD", KEY_VERSION_HEADER: 2**40},
        {SIGNATURE_HEADER: "QUJD", KEY_VERSION_HEADER: {"nested": 1}},
        {SIGNATURE_HEADER: b"\xff" * 10, KEY_VERSION_HEADER: b"3"},
        {SIGNATURE_HEADER: 12, KEY_VERSION_HEADER: 3},
    ],
)
def test_hostile_signature_headers_end_as_a_reason(key: rsa.RSAPrivateKey, headers: dict[str, object]) -> None:
    assert rejected(verifier(key, Policy.REQUIRED), headers) in (Reason.SIGNATURE_INVALID, Reason.SIGNING_KEY_UNKNOWN)


def test_version_headers_as_text_or_bytes_are_read_as_numbers(key: rsa.RSAPrivateKey) -> None:
    headers = Signer(key, 3).headers(BODY)
    verifier(key, Policy.REQUIRED).verify("ax-media-service", {**headers, KEY_VERSION_HEADER: "3"}, BODY)
    verifier(key, Policy.REQUIRED).verify("ax-media-service", {**headers, KEY_VERSION_HEADER: b"3"}, BODY)


def test_keys_load_from_pem_and_from_mosaic_base64_only(key: rsa.RSAPrivateKey) -> None:
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    assert signing.load_private_key(pem.decode()).private_numbers() == key.private_numbers()
    public = signing.public_key_text(key)
    assert signing.load_public_key(public).public_numbers() == key.public_key().public_numbers()
    for text in ("", "not a key", "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----", public):
        with pytest.raises(ConfigurationError) as caught:
            signing.load_private_key(text)
        assert "AAAA" not in str(caught.value)
    small = rsa.generate_private_key(public_exponent=65537, key_size=1024)
    with pytest.raises(ConfigurationError, match="at least 2048"):
        signing.load_private_key(mosaic_private_text(small))
    with pytest.raises(ConfigurationError, match="version"):
        Signer(key, 0)


def test_a_keys_folder_takes_named_regular_files_only(tmp_path: Path, key: rsa.RSAPrivateKey) -> None:
    (tmp_path / "ax-media-service.3.pem").write_text(signing.public_key_text(key))
    assert set(signing.keys_from_folder(tmp_path)) == {("ax-media-service", 3)}
    (tmp_path / "media.pem").write_text(signing.public_key_text(key))
    with pytest.raises(ConfigurationError, match=r"media\.pem.*<service>\.<version>\.pem"):
        signing.keys_from_folder(tmp_path)
    (tmp_path / "media.pem").unlink()
    os.mkfifo(tmp_path / "ax-other.1.pem")  # opening a FIFO for reading would wait for a writer
    with pytest.raises(ConfigurationError, match="not a regular file"):
        signing.keys_from_folder(tmp_path)
    (tmp_path / "ax-other.1.pem").unlink()
    (tmp_path / "ax-other.1.pem").symlink_to("/etc/passwd")
    with pytest.raises(ConfigurationError, match="does not load"):
        signing.keys_from_folder(tmp_path)
    (tmp_path / "ax-other.1.pem").unlink()
    (tmp_path / "ax-other.1.pem").symlink_to("/dev/zero")
    with pytest.raises(ConfigurationError, match="not a regular file"):
        signing.keys_from_folder(tmp_path)


def test_a_verified_producer_without_a_key_fails_at_start(key: rsa.RSAPrivateKey) -> None:
    Verifier(keys={("ax-media-service", 1): key.public_key()}, policies={"ax-media-service": Policy.REQUIRED}).check()
    with pytest.raises(ConfigurationError, match=r"ax-other.*no public key"):
        Verifier(keys={}, policies={"ax-other": Policy.WHEN_PRESENT}).check()
