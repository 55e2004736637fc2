"""txbox's event signatures against Mosaic's own signing code, both ways.

Mosaic's message bus signs with ``generateSignature`` and checks with
``validateSignature`` of ``@axinom/mosaic-service-common`` (the peer's npm packages):
the test runs those functions in Node on keys in Mosaic's configuration form, and
txbox's :mod:`framework.signing` on the same keys and bytes.
"""

from __future__ import annotations

import base64
import json
import subprocess
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa

from framework import signing
from framework.reasons import Reason
from framework.signing import SIGNATURE_HEADER, Policy, SignatureRejected, Signer, Verifier
from tests.interop.test_mosaic_peer import PEER_DIR, node_peer_ready

pytestmark = pytest.mark.integration

MOSAIC = """
const { generateSignature, validateSignature } = require('@axinom/mosaic-service-common');
const input = JSON.parse(require('fs').readFileSync(0, 'utf8'));
const signed = generateSignature(input.envelope, input.privateKey);
const checks = input.checks.map((c) => validateSignature(c.body, c.signature, input.publicKey));
process.stdout.write(JSON.stringify({ signed, checks }));
"""

ENVELOPE = {
    "payload": {"title": "Ümlaut ✓ \u2028 line", "id": 7, "tags": ["b", "a"], "nested": {"z": 1, "a": None}},
    "message_context": {"tenant": "t1"},
    "message_id": "3b8f8a0e-3c1b-4df6-9f5e-9a7d2d0b8c11",
    "timestamp": "2026-12-01T10:00:00.000Z",
    "message_type": "MediaPublished",
    "aggregate_id": "m-1",
    "aggregate_type": "media",
    "message_version": "1.0",
}


def mosaic(private_key: str, public_key: str, checks: list[dict[str, str]]) -> dict[str, Any]:
    node = node_peer_ready()
    script = {"envelope": ENVELOPE, "privateKey": private_key, "publicKey": public_key, "checks": checks}
    done = subprocess.run(
        [node, "-e", MOSAIC],
        check=False,
        input=json.dumps(script),
        cwd=PEER_DIR,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_txbox_and_mosaic_verify_each_others_signatures() -> None:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    der = key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    private_text, public_text = base64.b64encode(der).decode(), signing.public_key_text(key)
    body = json.dumps(ENVELOPE, ensure_ascii=False, separators=(",", ":")).encode()
    ours = Signer(signing.load_private_key(private_text), 2).headers(body)
    tampered = body.replace(b'"id":7', b'"id":8')
    result = mosaic(
        private_text,
        public_text,
        [
            {"body": body.decode(), "signature": ours[SIGNATURE_HEADER]},
            {"body": tampered.decode(), "signature": ours[SIGNATURE_HEADER]},
        ],
    )
    # Mosaic accepts what txbox signed, and refuses it once the body changed.
    assert result["checks"] == [True, False]
    # txbox accepts what Mosaic signed (the body it sends is the string it signed) ...
    theirs = {SIGNATURE_HEADER: result["signed"]["signature"], signing.KEY_VERSION_HEADER: 2}
    sent = result["signed"]["stringifiedValue"].encode()
    verifier = Verifier(keys={("ax-media-service", 2): signing.load_public_key(public_text)}, default=Policy.REQUIRED)
    verifier.verify("ax-media-service", theirs, sent)
    # ... and refuses it tampered with, or re-serialised: the bytes received are what is signed.
    for body_received in (sent.replace(b'"id":7', b'"id":8'), json.dumps(json.loads(sent)).encode()):
        with pytest.raises(SignatureRejected) as caught:
            verifier.verify("ax-media-service", theirs, body_received)
        assert caught.value.reason is Reason.SIGNATURE_INVALID
