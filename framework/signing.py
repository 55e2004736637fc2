"""Event signatures as Mosaic's message bus makes and checks them.

docs/explanation/receive.md, "Event signing". A signed event carries two AMQP headers:
``x-mosaic-signature``, the base64 RSA-SHA256 (PKCS#1 v1.5) signature of the body's
bytes, and ``x-mosaic-signature-key-version``, the version (a whole number) of the
producer's key. The body is the envelope as sent: a verifier checks the bytes it
received, as Mosaic's ``validateSignedEventMiddleware`` does, never a re-serialised
copy.

Keys are RSA: a PEM block, or the bare base64 body of one as Mosaic's configuration
holds it (``RMQ_EVENT_SIGNING_PRIVATE_KEY`` is PKCS#8 without its armour lines; public
keys are SubjectPublicKeyInfo). Everything a delivery brings (the headers) is outside
input and is bounded before it is decoded; key files are read as regular files of
bounded size. Producers' public keys come from a folder or a file of PEMs and, with
``TXBOX_SIGNING_KEYS_URL``, from a JWKS document or Mosaic's key service
(:mod:`framework.signing_keys`).

No broker, no database here: :class:`Signer` makes the headers of one body;
:class:`Verifier` judges one delivery's headers and body against the producer's keys and
policy and raises :class:`SignatureRejected` with its reason; :class:`SigningConfig`
builds both from ``TXBOX_SIGNING_*`` at start, where a bad key or folder fails.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

from framework import names
from framework.errors import ConfigurationError, TxboxError
from framework.reasons import Reason
from framework.settings import FromEnv, Seconds, setting

if TYPE_CHECKING:
    from framework.signing_keys import RemoteKeys

SIGNATURE_HEADER = "x-mosaic-signature"
KEY_VERSION_HEADER = "x-mosaic-signature-key-version"

# An RSA-8192 signature is 1,024 bytes, 1,368 in base64: a longer header is not one.
MAX_SIGNATURE_CHARS = 1400
MAX_VERSION = 2**31 - 1  # the key service's version is a GraphQL Int
MAX_KEY_FILE_BYTES = 64 * 1024
MAX_KEYS_FILE_BYTES = 1024 * 1024  # a file of many producers' PEMs
MIN_KEY_BITS = 2048

# A key file of a folder: <service>.<version>.pem, the service id as names.valid_service_id has it.
_KEY_FILE = re.compile(r"([a-z0-9][a-z0-9_-]{0,199})\.([0-9]{1,10})\.pem")
_BASE64 = re.compile(r"[A-Za-z0-9+/]+={0,2}")
# The label line before each PEM block of a keys file: <service>.<version>.
_KEY_LABEL = re.compile(r"([a-z0-9][a-z0-9_-]{0,199})\.([0-9]{1,10})")


class SignatureRejected(TxboxError):
    """A delivery's signature does not hold; ``reason`` is its dead letter's reason."""

    def __init__(self, reason: Reason, message: str) -> None:
        self.reason = reason
        super().__init__(message)


class Policy(StrEnum):
    """What a receiver asks of one producer's events."""

    REQUIRED = "required"  # unsigned or badly signed: dead-lettered
    WHEN_PRESENT = "when-present"  # a signature that is there must hold; none is accepted
    OFF = "off"  # signatures are not looked at


def _key_bytes(text: str, armour: str) -> bytes:
    """PEM bytes of ``text``: a PEM block as it is, or Mosaic's bare base64 body armoured
    (text that is neither fails to load as PEM: the callers say what was expected)."""
    stripped = text.strip()
    if stripped.startswith("-----BEGIN"):
        return stripped.encode("ascii", "replace")
    body = "".join(stripped.split())
    return f"-----BEGIN {armour}-----\n{body}\n-----END {armour}-----\n".encode("ascii", "replace")


def _rsa_bits(key: rsa.RSAPrivateKey | rsa.RSAPublicKey, what: str) -> None:
    if key.key_size < MIN_KEY_BITS:
        raise ConfigurationError(f"{what} has {key.key_size} bits: use an RSA key of at least {MIN_KEY_BITS}")


def load_private_key(text: str) -> rsa.RSAPrivateKey:
    """An RSA private key from PEM or from Mosaic's bare base64 PKCS#8 body.

    Raises :class:`ConfigurationError` (naming no part of the key) for anything else.
    """
    try:
        key = serialization.load_pem_private_key(_key_bytes(text, "PRIVATE KEY"), password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigurationError(
            "the event signing key does not load: give an unencrypted RSA private key, PEM or "
            f"base64 PKCS#8 as Mosaic's RMQ_EVENT_SIGNING_PRIVATE_KEY ({type(exc).__name__})"
        ) from None
    if not isinstance(key, rsa.RSAPrivateKey):
        raise ConfigurationError("the event signing key is not an RSA key: Mosaic signs with RSA-SHA256")
    _rsa_bits(key, "the event signing key")
    return key


def load_public_key(text: str, where: str = "a public key") -> rsa.RSAPublicKey:
    """An RSA public key from PEM or from a bare base64 SubjectPublicKeyInfo body."""
    try:
        key = serialization.load_pem_public_key(_key_bytes(text, "PUBLIC KEY"))
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise ConfigurationError(
            f"{where} does not load: give an RSA public key, PEM or base64 ({type(exc).__name__})"
        ) from None
    if not isinstance(key, rsa.RSAPublicKey):
        raise ConfigurationError(f"{where} is not an RSA key: Mosaic signs with RSA-SHA256")
    _rsa_bits(key, where)
    return key


def public_key_text(key: rsa.RSAPrivateKey | rsa.RSAPublicKey) -> str:
    """The bare base64 SubjectPublicKeyInfo of ``key``, the form Mosaic's key service lists."""
    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey) else key
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(der).decode("ascii")


@dataclass(frozen=True)
class Signer:
    """Signs the events of one producer with its key of ``version``."""

    key: rsa.RSAPrivateKey
    version: int

    def __post_init__(self) -> None:
        if not 0 < self.version <= MAX_VERSION:
            raise ConfigurationError(f"the signing key's version is {self.version}: give a whole number from 1")

    def headers(self, body: bytes) -> dict[str, Any]:
        """The two headers that sign ``body``, the exact bytes to be published."""
        signature = self.key.sign(body, padding.PKCS1v15(), hashes.SHA256())
        return {SIGNATURE_HEADER: base64.b64encode(signature).decode("ascii"), KEY_VERSION_HEADER: self.version}


def read_key_file(path: Path, max_bytes: int = MAX_KEY_FILE_BYTES) -> str:
    """The text of a key file: a regular file (not a FIFO or device) of at most ``max_bytes``.

    Links are followed (Kubernetes mounts secrets and config maps as links); what they
    reach must be a regular file. A FIFO is opened without blocking and then refused.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise ConfigurationError(f"{path}: cannot open the key file ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as handle:
        info = os.fstat(handle.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ConfigurationError(f"{path}: not a regular file; a key is read from a file only")
        data = handle.read(max_bytes + 1)
        if info.st_size > max_bytes or len(data) > max_bytes:
            raise ConfigurationError(f"{path}: {info.st_size} bytes, more than a key file holds ({max_bytes})")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise ConfigurationError(f"{path}: a key file is ASCII text (PEM or base64)") from None


def keys_from_folder(folder: Path) -> dict[tuple[str, int], rsa.RSAPublicKey]:
    """Producers' public keys from ``folder``: one ``<service>.<version>.pem`` file each.

    Other files are an error that names them, so a misnamed key is not silently unused.
    """
    if not folder.is_dir():
        raise ConfigurationError(f"{folder}: the producers' public keys are a folder of <service>.<version>.pem files")
    keys: dict[tuple[str, int], rsa.RSAPublicKey] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        match = _KEY_FILE.fullmatch(path.name)
        if match is None or not names.valid_service_id(match.group(1)):
            raise ConfigurationError(
                f"{path}: a public key file is named <service>.<version>.pem (e.g. ax-media-service.1.pem)"
            )
        version = int(match.group(2))
        if not 0 < version <= MAX_VERSION:
            raise ConfigurationError(f"{path}: the key's version must be a whole number from 1 to {MAX_VERSION}")
        keys[(match.group(1), version)] = load_public_key(read_key_file(path), str(path))
    return keys


def _labelled(label: str, where: str) -> tuple[str, int]:
    match = _KEY_LABEL.fullmatch(label)
    if match is None or not names.valid_service_id(match.group(1)) or not 0 < int(match.group(2)) <= MAX_VERSION:
        raise ConfigurationError(
            f"{where}: {label[:80]!r} is not <service>.<version> (e.g. ax-media-service.1), "
            "the line that names the PEM block after it"
        )
    return match.group(1), int(match.group(2))


def keys_from_file(path: Path) -> dict[tuple[str, int], rsa.RSAPublicKey]:
    """Producers' public keys from one file: PEM blocks, each after a line ``<service>.<version>``.

    Blank lines and lines starting with ``#`` are ignored; any other text, a block without
    its label line, or a (service, version) given twice is an error naming the line.
    """
    keys: dict[tuple[str, int], rsa.RSAPublicKey] = {}
    label: tuple[str, int] | None = None
    block: list[str] | None = None
    for number, raw in enumerate(read_key_file(path, MAX_KEYS_FILE_BYTES).splitlines(), start=1):
        line, where = raw.strip(), f"{path}, line {number}"
        if block is not None:
            block.append(line)
            if line.startswith("-----END"):
                assert label is not None
                if label in keys:
                    raise ConfigurationError(f"{where}: {label[0]}.{label[1]} is given twice")
                keys[label] = load_public_key("\n".join(block), f"{path}: {label[0]}.{label[1]}")
                label, block = None, None
        elif not line or line.startswith("#"):
            continue
        elif line.startswith("-----BEGIN"):
            if label is None:
                raise ConfigurationError(f"{where}: a PEM block needs a line <service>.<version> before it")
            block = [line]
        elif label is None:
            label = _labelled(line, where)
        else:
            raise ConfigurationError(f"{where}: a PEM block was expected after {label[0]}.{label[1]}")
    if block is not None or label is not None:
        raise ConfigurationError(f"{path}: the file ends inside a key (a label without its whole PEM block)")
    return keys


def public_keys_from(path: Path) -> dict[tuple[str, int], rsa.RSAPublicKey]:
    """Producers' public keys from a folder (:func:`keys_from_folder`) or a file (:func:`keys_from_file`)."""
    return keys_from_folder(path) if path.is_dir() else keys_from_file(path)


def _version(value: Any) -> int | None:
    """The key version a header holds: an integer, or the digits of one (bounded)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, bytes):
        value = value[:12].decode("ascii", "replace")
    if isinstance(value, str) and 0 < len(value) <= 10 and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int) and 0 < value <= MAX_VERSION:
        return value
    return None


def _signature(value: Any) -> bytes | None:
    if isinstance(value, bytes):
        value = value.decode("ascii", "replace") if len(value) <= MAX_SIGNATURE_CHARS else None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SIGNATURE_CHARS or not _BASE64.fullmatch(value):
        return None
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None


@dataclass(frozen=True)
class Verifier:
    """Checks producers' signed events against their public keys and policies.

    ``policies`` maps a producer's service id to its :class:`Policy`; producers it does
    not name get ``default``. A producer whose policy is not ``off`` but has no key at
    all is a configuration error at start (:meth:`check`), not a dead letter per event,
    unless keys are fetched (``remote``): a key missing from ``keys`` is looked up there.
    """

    keys: Mapping[tuple[str, int], rsa.RSAPublicKey]
    policies: Mapping[str, Policy] = field(default_factory=dict)
    default: Policy = Policy.OFF
    remote: RemoteKeys | None = None

    def policy(self, producer: str) -> Policy:
        return self.policies.get(producer, self.default)

    def check(self) -> None:
        """Raise :class:`ConfigurationError` for a producer that must be verified but has no key."""
        if self.remote is not None:
            return  # the key source may hold them; a missing one is signing_key_unknown
        with_keys = {service for service, _ in self.keys}
        missing = sorted(p for p, policy in self.policies.items() if policy is not Policy.OFF and p not in with_keys)
        if missing:
            raise ConfigurationError(
                f"signatures of {', '.join(missing)} are to be verified but no public key is given for them: "
                "add <service>.<version>.pem files to the keys folder, or set their policy to off"
            )

    def verify(self, producer: str, headers: Mapping[str, Any], body: bytes) -> None:
        """Return if the event passes ``producer``'s policy; else raise :class:`SignatureRejected`.

        Costs one RSA verification at most: the headers are bounded before they are
        decoded, and the key is looked up by (producer, version), never tried in turn.
        """
        policy = self.policy(producer)
        if policy is Policy.OFF:
            return
        raw_signature, raw_version = headers.get(SIGNATURE_HEADER), headers.get(KEY_VERSION_HEADER)
        if raw_signature is None and raw_version is None:
            if policy is Policy.REQUIRED:
                raise SignatureRejected(
                    Reason.SIGNATURE_MISSING, f"events of {producer} must be signed; this one is not"
                )
            return
        signature, version = _signature(raw_signature), _version(raw_version)
        if signature is None or version is None:
            raise SignatureRejected(
                Reason.SIGNATURE_INVALID,
                f"the event's {SIGNATURE_HEADER} and {KEY_VERSION_HEADER} headers must be base64 and a whole number",
            )
        key = self.keys.get((producer, version))
        if key is None and self.remote is not None:
            key = self.remote.lookup(producer, version)
        if key is None:
            known = {v for service, v in self.keys if service == producer}
            status = ""
            if self.remote is not None:
                known.update(self.remote.known(producer))
                status = f"; {self.remote.status(producer)}"
            raise SignatureRejected(
                Reason.SIGNING_KEY_UNKNOWN,
                f"no public key of {producer} has version {version} "
                f"(known: {', '.join(map(str, sorted(known))) or 'none'}{status})",
            )
        try:
            key.verify(signature, body, padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            raise SignatureRejected(
                Reason.SIGNATURE_INVALID, f"the signature does not match the body under {producer}'s key {version}"
            ) from None


_POLICY_ENTRY = re.compile(r"([a-z0-9*][a-z0-9_*-]{0,199})=([a-z-]{1,20})")


def parse_policies(text: str) -> tuple[dict[str, Policy], Policy | None]:
    """``ax-media-service=required,*=when-present`` → ({service: policy}, default or None)."""
    policies: dict[str, Policy] = {}
    default: Policy | None = None
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _POLICY_ENTRY.fullmatch(part)
        if match is None or match.group(2) not in Policy.__members__.values():
            raise ConfigurationError(
                f"TXBOX_SIGNING_VERIFY: {part[:80]!r} is not <service>=<policy> with a policy of "
                f"{', '.join(p.value for p in Policy)}. Example: TXBOX_SIGNING_VERIFY=ax-media-service=required,*=off"
            )
        service, policy = match.group(1), Policy(match.group(2))
        if service == "*":
            default = policy
        elif names.valid_service_id(service):
            policies[service] = policy
        else:
            raise ConfigurationError(f"TXBOX_SIGNING_VERIFY: {service!r} is not a service id nor *")
    return policies, default


@dataclass(frozen=True, kw_only=True)
class SigningConfig(FromEnv):
    """Event signing (``TXBOX_SIGNING_*``; docs/explanation/receive.md, "Event signing")."""

    key_file: str = setting(
        "TXBOX_SIGNING_KEY_FILE",
        "/run/secrets/signing-key.pem",
        default="",
        help="this service's RSA private key (PEM, or Mosaic's base64 PKCS#8): its events are signed",
    )
    key_version: int = setting(
        "TXBOX_SIGNING_KEY_VERSION", "1", default=0, help="the version the key is registered under"
    )
    public_keys: str = setting(
        "TXBOX_SIGNING_PUBLIC_KEYS",
        "/etc/txbox/keys",
        default="",
        help="producers' public keys: a folder of SERVICE.VERSION.pem files, or one file of "
        "PEM blocks each after a line SERVICE.VERSION",
    )
    keys_url: str = setting(
        "TXBOX_SIGNING_KEYS_URL",
        "https://keys.example/{service}/jwks.json",
        default="",
        help="producers' public keys fetched from a JWKS document ({service}: one per producer) "
        "or Mosaic's key service (its base URL, with TXBOX_SIGNING_KEYS_FORMAT=mosaic)",
    )
    keys_format: str = setting(
        "TXBOX_SIGNING_KEYS_FORMAT",
        "mosaic",
        default="jwks",
        help="what TXBOX_SIGNING_KEYS_URL answers: jwks (RFC 7517, kid = version) or mosaic (GetPublicSigningKeys)",
    )
    keys_token_file: str = setting(
        "TXBOX_SIGNING_KEYS_TOKEN_FILE",
        "/run/secrets/key-service-token",
        default="",
        help="a bearer token sent with each fetch (read each time, so it can be renewed)",
    )
    keys_timeout: Seconds = setting(
        "TXBOX_SIGNING_KEYS_TIMEOUT", "5s", default=Seconds(5.0), help="a fetch of keys gives up after this"
    )
    keys_refresh: Seconds = setting(
        "TXBOX_SIGNING_KEYS_REFRESH",
        "30s",
        default=Seconds(30.0),
        help="an unknown key version fetches the keys again, at most this often",
    )
    keys_max_age: Seconds = setting(
        "TXBOX_SIGNING_KEYS_MAX_AGE",
        "10m",
        default=Seconds(600.0),
        help="keys fetched longer ago are fetched again at the next event (a revoked key is dropped)",
    )
    verify: str = setting(
        "TXBOX_SIGNING_VERIFY",
        "ax-media-service=required,*=off",
        default="",
        help="per producer: required, when-present or off (* for the others); "
        "default: required for producers with a key, off for the rest",
    )

    def signer(self) -> Signer | None:
        """The signer of this service's events, or None when no key is configured."""
        if not self.key_file:
            if self.key_version:
                raise ConfigurationError(
                    "TXBOX_SIGNING_KEY_VERSION is set without TXBOX_SIGNING_KEY_FILE: give the key's file too"
                )
            return None
        if not self.key_version:
            raise ConfigurationError(
                "TXBOX_SIGNING_KEY_FILE needs TXBOX_SIGNING_KEY_VERSION, the version its public key is "
                "registered under. Example: TXBOX_SIGNING_KEY_VERSION=1"
            )
        return Signer(load_private_key(read_key_file(Path(self.key_file))), self.key_version)

    def verifier(self, producers: Collection[str] = ()) -> Verifier | None:
        """The verifier of producers' events, or None when nothing is to be verified.

        ``producers`` are the services whose events the receiver takes: the ones whose
        keys are fetched from ``TXBOX_SIGNING_KEYS_URL`` (those whose policy is not off),
        once here, before this returns.
        """
        keys = public_keys_from(Path(self.public_keys)) if self.public_keys else {}
        policies, default = parse_policies(self.verify)
        if self.keys_url and not self.verify:
            raise ConfigurationError(
                "TXBOX_SIGNING_KEYS_URL needs TXBOX_SIGNING_VERIFY, whose events must be signed. "
                "Example: TXBOX_SIGNING_VERIFY=*=required"
            )
        if not self.verify:
            policies = {service: Policy.REQUIRED for service, _ in keys}
        verifier = Verifier(keys=keys, policies=policies, default=default or Policy.OFF)
        if verifier.default is Policy.OFF and all(p is Policy.OFF for p in verifier.policies.values()):
            return None
        if self.keys_url:
            from framework.signing_keys import KeySource, RemoteKeys  # it imports this module

            source = KeySource(self.keys_url, self.keys_format, self.keys_token_file, float(self.keys_timeout))
            remote = RemoteKeys(
                source,
                [p for p in {*producers, *verifier.policies} if verifier.policy(p) is not Policy.OFF],
                refresh=float(self.keys_refresh),
                max_age=float(self.keys_max_age),
            )
            remote.start()
            verifier = dataclasses.replace(verifier, remote=remote)
        verifier.check()
        if verifier.default is not Policy.OFF and not keys and verifier.remote is None:
            raise ConfigurationError(
                "TXBOX_SIGNING_VERIFY asks every producer's events to be verified, but "
                "TXBOX_SIGNING_PUBLIC_KEYS names no keys: give the keys folder or file, or TXBOX_SIGNING_KEYS_URL"
            )
        return verifier
