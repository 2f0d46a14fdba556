"""Encryption at rest: AES-256-GCM over every stored payload.

A sealed payload is `nonce (12 bytes) + ciphertext + tag (16 bytes)`. What binds it to its place is the
associated data, authenticated but not stored with it: the table, the row's LMDB key and, for result
records, the record header (times, flags, key id). A payload copied under another key or into another
table, or a header whose expiry was pushed out, fails to open: the reader sees a miss, never an error.

Keys come from `cache.encryption_key_file`: either exactly 32 raw bytes, or text with one base64 (or
64-digit hex) key per line, `#` comments allowed. The first key seals new payloads; the others only
open what they sealed earlier, so a new key is rolled in by putting it first and keeping the old one
below it until the old records have expired (the model's TTL, capped by `cache.max_ttl_s`). Each key's
id (stored in the header, so a reader knows which key to try) is derived from the key itself: every
process agrees on it without coordination, and two keys whose ids collide are refused at load.

Nonces are random (96 bits); a key should seal fewer than 2^32 payloads (NIST SP 800-38D), far more
than a cache writes between two key rotations.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from cachestore.errors import Unsealable

KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = NONCE_BYTES + TAG_BYTES


class KeyFileError(ValueError):
    """The key file is missing, unreadable or malformed; the message says which and how to fix it."""


def key_id(key: bytes) -> int:
    """1..65535, derived from the key (0 in a header means "not sealed")."""
    digest = hashlib.blake2b(key, digest_size=2, person=b"icache-keyid").digest()
    return int.from_bytes(digest, "little") % 0xFFFF + 1


def parse_keys(raw: bytes, origin: str = "key file") -> tuple[bytes, ...]:
    """The keys in a key file's bytes, sealing key first (see the module docstring for the format)."""
    if len(raw) == KEY_BYTES:
        return (raw,)
    try:
        lines = raw.decode("ascii").splitlines()
    except UnicodeDecodeError:
        raise KeyFileError(f"{origin}: expected 32 raw bytes or base64/hex keys one per line, got {len(raw)} "
                           "bytes of binary data") from None
    keys = []
    for number, line in enumerate(lines, 1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            key = bytes.fromhex(text) if len(text) == 2 * KEY_BYTES else base64.b64decode(text, validate=True)
        except (ValueError, binascii.Error):
            raise KeyFileError(f"{origin} line {number}: not base64 or hex") from None
        if len(key) != KEY_BYTES:
            raise KeyFileError(f"{origin} line {number}: a key must be {KEY_BYTES} bytes, this one is {len(key)} "
                               "(make one with: head -c 32 /dev/urandom | base64)")
        keys.append(key)
    if not keys:
        raise KeyFileError(f"{origin}: no key in it (make one with: head -c 32 /dev/urandom | base64)")
    return tuple(keys)


def read_key_file(path: str) -> tuple[bytes, ...]:
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise KeyFileError(f"cannot read encryption key file {path}: {exc.strerror or exc}") from None
    return parse_keys(raw, path)


class KeyRing:
    """Seals with the first key, opens with whichever key sealed the payload.

    Built in each process from the key bytes (AESGCM objects do not cross process boundaries)."""

    def __init__(self, keys: tuple[bytes, ...]) -> None:
        if not keys:
            raise KeyFileError("a key ring needs at least one key")
        self._ciphers: dict[int, AESGCM] = {}
        for key in keys:
            kid = key_id(key)
            if kid in self._ciphers:
                raise KeyFileError(f"two keys of the key file share the id {kid}; replace one of them")
            self._ciphers[kid] = AESGCM(key)
        self.sealing_id = key_id(keys[0])
        self._sealing = self._ciphers[self.sealing_id]

    def seal(self, plaintext: bytes, aad: bytes) -> bytes:
        """The sealed payload under the sealing key (whose id is `sealing_id`)."""
        nonce = os.urandom(NONCE_BYTES)
        return nonce + self._sealing.encrypt(nonce, plaintext, aad)

    def open(self, kid: int, sealed: bytes | memoryview, aad: bytes) -> bytes:
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise Unsealable(f"sealed with key id {kid}, which is not in the key file")
        if len(sealed) < OVERHEAD:
            raise Unsealable("sealed payload shorter than its nonce and tag")
        sealed = memoryview(sealed)  # slices without copies
        try:
            return cipher.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
        except InvalidTag:
            raise Unsealable("authentication failed (tampered, or moved from another key)") from None
