"""Record format of the result cache.

    header (24 bytes, little-endian) + payload

    B   format version (1)
    B   flags (bit 0: payload sealed with AES-256-GCM, cachestore/sealing.py; bit 1: the checksum is
        xxh3_64's low 32 bits)
    H   key id of the sealing key (0 = not sealed)
    I   checksum of the payload as stored: crc32, or for payloads of XXH3_FROM_BYTES and more (prefix
        key/value blocks are megabytes) xxh3_64's low 32 bits, 6-8x faster to check on one core here
        (a build older than the flag reads such a record as corrupt: a miss)
    q   created, microseconds since the epoch
    q   expires, microseconds since the epoch (0 = never)

The payload is a serialized protobuf message (never pickle: a cache file must not be able to run code).
With encryption on it is sealed, with the header (less its checksum) and the entry's key as associated
data: a record copied under another key, or whose times were edited, does not open. A record whose
version is unknown, whose checksum fails, or that does not open is treated as absent; so is a sealed
record without a key ring, and a record in clear while encryption is on (written before it was turned on).
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import xxhash

from cachestore.errors import CorruptRecord, Unsealable
from cachestore.sealing import KeyRing

FORMAT_VERSION = 1
HEADER = struct.Struct("<BBHIqq")
FLAG_ENCRYPTED = 0x01
FLAG_XXH3 = 0x02
XXH3_FROM_BYTES = 64 << 10  # payloads from this size on are checked with xxh3
_TABLE = b"results\x00"  # associated data names the table: a semantic-log row cannot pass for a record


@dataclass(slots=True)  # not frozen: one is made per stored answer, and frozen ones cost 2-3x more to make
class Record:
    created_us: int
    expires_us: int  # 0 = never
    payload: bytes   # in clear (sealing happens in encode, opening in decode)
    flags: int = 0
    key_id: int = 0

    def is_fresh(self, now_us: int, max_age_us: int | None = None) -> bool:
        return fresh(self.created_us, self.expires_us, now_us, max_age_us)

    def age_s(self, now_us: int) -> float:
        return age_s(self.created_us, now_us)


def age_s(created_us: int, now_us: int) -> float:
    return max(0, now_us - created_us) / 1e6


def fresh(created_us: int, expires_us: int, now_us: int, max_age_us: int | None = None) -> bool:
    """Not expired (expires_us 0 = never), and no older than max_age_us where given."""
    if expires_us and now_us >= expires_us:
        return False
    return max_age_us is None or now_us - created_us <= max_age_us


def _aad(key: bytes, flags: int, kid: int, created: int, expires: int) -> bytes:
    return _TABLE + key + HEADER.pack(FORMAT_VERSION, flags, kid, 0, created, expires)


def encode(record: Record, key: bytes = b"", ring: KeyRing | None = None) -> bytes:
    """The stored form; with `ring`, the payload sealed and bound to `key` (the entry's LMDB key)."""
    payload, kid = record.payload, 0
    flags = FLAG_XXH3 if len(payload) >= XXH3_FROM_BYTES else 0
    if ring is not None:
        flags, kid = flags | FLAG_ENCRYPTED, ring.sealing_id
        payload = ring.seal(payload, _aad(key, flags, kid, record.created_us, record.expires_us))
    header = HEADER.pack(FORMAT_VERSION, flags, kid, _checksum(flags, payload), record.created_us, record.expires_us)
    return header + payload


def _checksum(flags: int, payload) -> int:
    # (xxhash's hasher object releases the GIL while it hashes; its one-shot xxh3_64_intdigest does not,
    # and a prefix block's check would stall the worker's event loop)
    return xxhash.xxh3_64(payload).intdigest() & 0xFFFFFFFF if flags & FLAG_XXH3 else zlib.crc32(payload)


def decode_times(raw: bytes | memoryview) -> tuple[int, int]:
    """(created_us, expires_us) without copying or checking the payload (for index maintenance)."""
    if len(raw) < HEADER.size:
        raise CorruptRecord("record shorter than its header")
    _, _, _, _, created, expires = HEADER.unpack_from(raw)
    return created, expires


def checked(raw: bytes | memoryview) -> tuple[int, int, int, int, memoryview]:
    """(flags, key id, created_us, expires_us, payload as stored) of a record whose format and
    checksum hold, else CorruptRecord. The payload is a view of `raw`, not a copy: what the hit path
    sends on (still sealed when flags say so; `decode` opens it)."""
    if len(raw) < HEADER.size:
        raise CorruptRecord("record shorter than its header")
    version, flags, kid, crc, created, expires = HEADER.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise CorruptRecord(f"record format {version}, expected {FORMAT_VERSION}")
    payload = memoryview(raw)[HEADER.size:]
    if _checksum(flags, payload) != crc:
        raise CorruptRecord("record checksum mismatch")
    return flags, kid, created, expires, payload


def opened(flags: int, kid: int, created: int, expires: int, stored: memoryview, key: bytes,
           ring: KeyRing | None) -> bytes:
    """The payload in clear of a record that `checked` passed; Unsealable when it does not open (or is in
    clear while encryption is on)."""
    if flags & FLAG_ENCRYPTED:
        if ring is None:
            raise Unsealable("record is encrypted and no encryption key is configured")
        return ring.open(kid, bytes(stored), _aad(key, flags, kid, created, expires))
    if ring is not None:
        raise Unsealable("record stored in clear, and encryption is on")
    return bytes(stored)


def decode(raw: bytes | memoryview, key: bytes = b"", ring: KeyRing | None = None) -> Record:
    """The record with its payload in clear; CorruptRecord (Unsealable for sealing) when it is unusable."""
    flags, kid, created, expires, stored = checked(raw)
    return Record(created, expires, opened(flags, kid, created, expires, stored, key, ring), flags, kid)
