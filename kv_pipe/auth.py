"""Mutual authentication of a side-channel connection by a shared secret, without sending the secret.

The connecting side sends HELLO (with a fresh nonce); the listening side answers CHALLENGE: its own nonce and an
HMAC-SHA256, under the secret, of both nonces and the HELLO, which proves it knows the secret. The connecting side
checks that, then sends AUTH: its engine session and its own HMAC over the same plus the session. Only then does the
listening side reveal anything about memory (WELCOME: its engine session and staging ring). Both proofs are bound to
this connection's nonces and HELLO, so neither can be replayed on another connection or turned around.

The secret comes from ``MOONCAKE_KV_SECRET`` or mooncake.json's ``auth_secret``; with none on either side the proofs
are made with an empty key (no protection, the documented default on a trusted network); if the two sides hold
different secrets, the handshake fails with an error that says so.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from kv_pipe.errors import ProtocolError

NONCE_HEX = 64  # 32 random bytes
PROOF_HEX = 64  # SHA-256


def nonce() -> str:
    return secrets.token_hex(NONCE_HEX // 2)


def proof(secret: bytes, role: str, *parts: bytes | str) -> str:
    """HMAC-SHA256 under ``secret`` of ``role`` ("endpoint" or "link", so a proof never serves the other side) and
    ``parts``, each length-prefixed."""
    mac = hmac.new(secret, role.encode(), hashlib.sha256)
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        mac.update(len(data).to_bytes(8, "big") + data)
    return mac.hexdigest()


def _check_hex(value: str, digits: int, what: str) -> str:
    if len(value) != digits or any(c not in "0123456789abcdef" for c in value):
        raise ProtocolError(f"{what} must be {digits} lowercase hex digits")
    return value


def check_nonce(value: str, who: str) -> str:
    return _check_hex(value, NONCE_HEX, f"{who}: the nonce")


def verify(secret: bytes, role: str, given: str, *parts: bytes | str, who: str) -> None:
    """Raise ``ProtocolError`` unless ``given`` is the proof of ``role`` over ``parts``."""
    _check_hex(given, PROOF_HEX, f"{who}: a proof")
    if not hmac.compare_digest(given.encode(), proof(secret, role, *parts).encode()):
        raise ProtocolError(f"{who} does not prove that it knows this pipe's secret: set the same auth_secret in "
                            "both sides' mooncake.json (or MOONCAKE_KV_SECRET in both environments)")
