"""Serialized answers composed as bytes, without building protobuf messages.

Protobuf's wire format merges concatenated messages: for a singular message field the later occurrence
is merged into the earlier, field by field, and a later scalar wins. So a stored serialized InferResponse
followed by a serialized `InferResponse{cache{source, age_s}}` decodes exactly like the stored response
with those two CacheInfo fields set, and an InferBatchResponse is its items, each framed as field 1.
The hit path sends stored bytes this way: no parse, no re-serialization (tests/test_wire.py checks the
composed bytes against protobuf, field for field).

Limit: a suffix can set a field, never clear one (a zero is not written); stored answers never carry a
source or an age, so nothing needs clearing.
"""

from __future__ import annotations

import struct

_DOUBLE = struct.Struct("<d")
_CACHE_FIELD = b"\x12"     # InferResponse.cache: field 2, length-delimited
_SOURCE_FIELD = b"\x08"    # CacheInfo.source: field 1, varint
_AGE_FIELD = b"\x11"       # CacheInfo.age_s: field 2, 64-bit
_RESULTS_FIELD = b"\x0a"   # InferBatchResponse.results: field 1, length-delimited


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _suffix_prefix(source: int, with_age: bool) -> bytes:
    inner = (_SOURCE_FIELD + varint(source) if source else b"") + (_AGE_FIELD if with_age else b"")
    size = len(inner) + (_DOUBLE.size if with_age else 0)
    return _CACHE_FIELD + varint(size) + inner if size else b""


# Each source's suffix up to its age's 8 bytes, with and without an age (made once: this is per hit).
_PREFIXES = {(source, with_age): _suffix_prefix(source, with_age)
             for source in range(128) for with_age in (False, True)}


def cache_info(source: int, age_s: float = 0.0) -> bytes:
    """The suffix that sets CacheInfo.source and .age_s of the InferResponse it follows ("" for zeros)."""
    if age_s:
        return _PREFIXES[source, True] + _DOUBLE.pack(age_s)
    return _PREFIXES[source, False]


def batch_response(answers: list[bytes]) -> bytes:
    """A serialized InferBatchResponse of serialized InferResponses, in order."""
    return b"".join(_RESULTS_FIELD + varint(len(answer)) + answer for answer in answers)
