"""Record format of the result cache.

    header (24 bytes, little-endian) + payload

    B   format version (1)
    B   flags (bit 0: payload encrypted; reserved for encryption at rest)
    H   key id of the sealing key (0 = none)
    I   crc32 of the payload
    q   created, microseconds since the epoch
    q   expires, microseconds since the epoch (0 = never)

The payload is a serialized protobuf message (never pickle: a cache file must not be able to run code).
A record whose version is unknown or whose checksum fails is treated as absent.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

from cachestore.errors import CorruptRecord

FORMAT_VERSION = 1
HEADER = struct.Struct("<BBHIqq")
FLAG_ENCRYPTED = 0x01


@dataclass(slots=True)  # not frozen: one is made per stored answer, and frozen ones cost 2-3x more to make
class Record:
    created_us: int
    expires_us: int  # 0 = never
    payload: bytes
    flags: int = 0
    key_id: int = 0

    def is_fresh(self, now_us: int, max_age_us: int | None = None) -> bool:
        if self.expires_us and now_us >= self.expires_us:
            return False
        if max_age_us is not None and now_us - self.created_us > max_age_us:
            return False
        return True

    def age_s(self, now_us: int) -> float:
        return max(0, now_us - self.created_us) / 1e6


def encode(record: Record) -> bytes:
    header = HEADER.pack(
        FORMAT_VERSION, record.flags, record.key_id, zlib.crc32(record.payload),
        record.created_us, record.expires_us,
    )
    return header + record.payload


def decode_times(raw: bytes | memoryview) -> tuple[int, int]:
    """(created_us, expires_us) without copying or checking the payload (for index maintenance)."""
    if len(raw) < HEADER.size:
        raise CorruptRecord("record shorter than its header")
    _, _, _, _, created, expires = HEADER.unpack_from(raw)
    return created, expires


def decode(raw: bytes | memoryview) -> Record:
    if len(raw) < HEADER.size:
        raise CorruptRecord("record shorter than its header")
    version, flags, key_id, crc, created, expires = HEADER.unpack_from(raw)
    if version != FORMAT_VERSION:
        raise CorruptRecord(f"record format {version}, expected {FORMAT_VERSION}")
    payload = bytes(raw[HEADER.size:])
    if zlib.crc32(payload) != crc:
        raise CorruptRecord("record checksum mismatch")
    return Record(created, expires, payload, flags, key_id)
