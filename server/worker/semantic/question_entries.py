"""A cached question's entry (semantic answers of generative models: server/worker/semantic/answer_matching.py,
server/worker/semantic/answer_equivalence.py): an InferResponse stored under the question's key that holds the
question's guard marks, the key of the answer it points at (CacheInfo.key), and what its judge keeps
beside them (the classifier's scores, or the answer's embedding). Reading one is a miss on any failure."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from cachestore import records
from infercache.v1 import infercache_pb2 as pb
from server.shared import question_guards as guards

MARKS = "question_marks"  # the entry's tensor of the question's guard marks (utf-8)


@dataclass
class QuestionEntry:
    outputs: dict[str, pb.Tensor]  # the entry's tensors by name
    marks: tuple[str, ...]         # the cached question's guard marks
    answer: records.Record         # the fresh answer it points at


def add_marks(response: pb.InferResponse, marks: str) -> None:
    """The question's guard marks into the entry it is stored as."""
    data = marks.encode()
    response.outputs.add(name=MARKS, dtype="uint8", shape=[len(data)], data=data)


def read(cache, key: bytes, now: int, max_age_us: int | None) -> QuestionEntry | None:
    """The entry under `key` with the fresh answer it points at; None where either is absent, too old or
    does not read (an entry another judge wrote lacks what the caller looks up: its KeyError is the caller's)."""
    record = cache.get(key, now)
    if record is None:
        return None
    try:
        entry = pb.InferResponse.FromString(record.payload)
        outputs = {tensor.name: tensor for tensor in entry.outputs}
        marks = guards.decode(bytes(outputs[MARKS].data).decode())
        answer_key = bytes.fromhex(entry.cache.key)
    except (DecodeError, KeyError, UnicodeDecodeError, ValueError):
        return None
    answer = cache.get(answer_key, now, max_age_us)
    return None if answer is None else QuestionEntry(outputs, marks, answer)
