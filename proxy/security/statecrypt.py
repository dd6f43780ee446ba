"""Sealing the secrets the proxy must keep in Redis and send on later: engine API keys.

Owns the key (state.secret_key, else derived from proxy.admin_token; replicas must share it) and
AES-256-GCM sealing bound to the worker it belongs to. Worker secrets are never kept at all (only
their SHA-256, controlauth.py). The standard library has no authenticated cipher, so this uses the
`cryptography` package's AESGCM; nothing here is hand-made cryptography.
"""

from __future__ import annotations

import base64
import os

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

_VERSION = "v1"
_INFO = b"kvroute state secrets v1"
_NONCE_BYTES = 12


class SecretBox:
    """Seals and opens short secrets with one key; without a key it seals nothing (`can_seal` False)."""

    def __init__(self, material: str | None) -> None:
        self._aead = AESGCM(_derive(material)) if material else None

    @classmethod
    def from_config(cls, secret_key: str | None, admin_token: str | None) -> SecretBox:
        return cls(secret_key or admin_token)

    @property
    def can_seal(self) -> bool:
        return self._aead is not None

    def seal(self, secret: str, owner: str) -> str | None:
        """`secret` encrypted and authenticated for `owner` (a worker id: a sealed key moved to another
        worker's entry does not open); None without a key."""
        if self._aead is None:
            return None
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, secret.encode(), owner.encode())
        return f"{_VERSION}:{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def open(self, sealed: str, owner: str) -> str | None:
        """The secret sealed for `owner`, or None (no key, another key, another owner, tampered, garbage)."""
        if self._aead is None or not isinstance(sealed, str) or not sealed.startswith(_VERSION + ":"):
            return None
        try:
            raw = base64.urlsafe_b64decode(sealed[len(_VERSION) + 1:])
            return self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], owner.encode()).decode()
        except (ValueError, InvalidTag, UnicodeDecodeError):
            return None


def _derive(material: str) -> bytes:
    """A 256-bit key from a configured secret of any length (HKDF-SHA256)."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(material.encode())
