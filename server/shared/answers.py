"""How a model version's outputs become an answer: the serialized InferResponse that is replied and
stored, and the record L1 keeps. The workers make answers of computed outputs; a frontend makes them of
stored features (server/frontend/features.py), byte for byte the same."""

from __future__ import annotations

import struct

import numpy as np

from cachestore import records
from infercache.v1 import infercache_pb2 as pb
from server.shared.models import ModelSpec

_FLOAT32 = struct.Struct("<f")  # a classification's probability, as protobuf writes a float

_DTYPE_NAMES: dict[np.dtype, str] = {}  # str(dtype) is slow Python code; it runs once per answer


def to_tensors(outputs: dict[str, np.ndarray]) -> list[pb.Tensor]:
    tensors = []
    for name, array in outputs.items():
        dtype = _DTYPE_NAMES.get(array.dtype) or _DTYPE_NAMES.setdefault(array.dtype, str(array.dtype))
        tensors.append(pb.Tensor(name=name, dtype=dtype, shape=array.shape, data=array.tobytes()))
    return tensors


def response_of(spec: ModelSpec, version: str, labels: list[str], outputs: dict[str, np.ndarray], key: bytes
                ) -> pb.InferResponse:
    """The InferResponse of a model version's outputs for one text (a classifier's: with its label)."""
    response = pb.InferResponse(outputs=to_tensors({name: outputs[name] for name in spec.outputs}),
                                cache=pb.CacheInfo(model_version=version, key=key.hex()))
    if labels:
        scores = outputs["scores"]
        best = int(np.argmax(scores))
        response.classification.label = labels[best]
        response.classification.probability = float(scores[best])
    return response


def answer_record(spec: ModelSpec, created_us: int, payload: bytes, ttl_class: str = "") -> records.Record:
    """An answer as stored in L1: it expires after the TTL of its class ("" = the model's default),
    less its jitter (server/shared/ttl_classes.py), and is kept cache.stale_if_error_s longer (lookups
    take nothing older than the class's TTL but for that fallback: server/frontend/core.py)."""
    expires_us = spec.ttl_classes.expires_us(ttl_class, created_us)
    return records.Record(created_us, expires_us + spec.stale_if_error_s * 1_000_000 if expires_us > created_us
                          else expires_us, payload)


class _Template:
    """The bytes every serialized answer of a one-output model version shares: all but the tensor data
    and the key. Cut from one answer that protobuf serialized, and used only if it reproduces it byte for
    byte."""

    def __init__(self, serialized: bytes, data: bytes, key_hex: bytes) -> None:
        i = serialized.find(data)
        j = serialized.find(key_hex, i + len(data))
        if i < 0 or j < 0 or serialized.find(data, i + 1) >= 0:
            raise ValueError("no unique data / key position")
        self.parts = (serialized[:i], serialized[i + len(data):j], serialized[j + len(key_hex):])
        self.size = len(data)
        if self.render(data, key_hex) != serialized:
            raise ValueError("template does not reproduce the answer")

    def render(self, data: bytes, key_hex: bytes) -> bytes:
        head, middle, tail = self.parts
        return b"".join((head, data, middle, key_hex, tail))


class Answers:
    """A model version's answers, serialized (what is replied and stored). Protobuf serializes the first;
    where the version answers one output tensor, the rest are rendered from a template cut from it
    (_Template), with a classifier's label and probability appended: InferResponse.classification is its
    last field, and per label its bytes differ only in the probability's four. An answer the template
    would not reproduce (a probability of 0, which protobuf leaves out; scores wider than float32) goes
    through protobuf, which made about a third of a frontend's own work per FEATURE answer (22 of 60 us
    on a 2-core host)."""

    def __init__(self, spec: ModelSpec, version: str, labels: list[str]) -> None:
        self.spec = spec
        self.version = version
        self.labels = labels
        self._template: _Template | None = None
        self._templated = len(spec.outputs) == 1 and (not labels or spec.outputs[0] == "scores")
        self._classified: dict[int, bytes] = {}  # label index -> its classification field but the probability

    def response(self, outputs: dict[str, np.ndarray], key: bytes) -> pb.InferResponse:
        return response_of(self.spec, self.version, self.labels, outputs, key)

    def payload(self, outputs: dict[str, np.ndarray], key: bytes) -> bytes:
        if not self._templated:
            return self._serialized(outputs, key)
        data = outputs[self.spec.outputs[0]].tobytes()
        key_hex = key.hex().encode()
        tail = b""
        if self.labels:
            scores = outputs["scores"]
            best = int(scores.argmax())
            probability = np.float32(scores[best])  # as protobuf stores it; 0 is left out
            if scores.dtype.itemsize > 4 or probability == 0:
                return self._serialized(outputs, key)
            tail = self._classification(best) + _FLOAT32.pack(probability)
        if self._template is not None and len(data) == self._template.size:
            return self._template.render(data, key_hex) + tail
        serialized = self._serialized(outputs, key)
        try:
            if not serialized.endswith(tail):
                raise ValueError("the classification is not the answer's last field")
            self._template = _Template(serialized[:len(serialized) - len(tail)], data, key_hex)
        except ValueError:  # cannot happen for these answers; protobuf keeps answering if it does
            self._templated = False
        return serialized

    def _serialized(self, outputs: dict[str, np.ndarray], key: bytes) -> bytes:
        return self.response(outputs, key).SerializeToString()

    def _classification(self, best: int) -> bytes:
        found = self._classified.get(best)
        if found is None:
            classified = pb.InferResponse(classification=pb.Classification(label=self.labels[best], probability=1.0))
            found = self._classified[best] = classified.SerializeToString()[:-4]  # (the float is its last 4 bytes)
        return found
