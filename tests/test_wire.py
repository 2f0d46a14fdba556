"""Answers composed as bytes (cachestore/wire.py) decode exactly like the messages the server built before."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from cachestore import wire
from infercache.v1 import infercache_pb2 as pb

Source = pb.CacheInfo.Source


def _stored_answers() -> dict[str, pb.InferResponse]:
    embedding = np.linspace(-1, 1, 384, dtype=np.float32)
    tensor = pb.Tensor(name="embedding", dtype="float32", shape=[384], data=embedding.tobytes())
    key = "ab" * 24
    return {
        "embedding": pb.InferResponse(outputs=[tensor], cache=pb.CacheInfo(model_version="1", key=key)),
        "classification": pb.InferResponse(
            outputs=[pb.Tensor(name="scores", dtype="float32", shape=[3], data=np.float32([0.1, 0.7, 0.2]).tobytes())],
            cache=pb.CacheInfo(model_version="2", key=key), classification=pb.Classification(label="card", probability=0.7)),
        "explained": pb.InferResponse(  # a semantic answer with explain: neighbours and a similarity
            outputs=[tensor], classification=pb.Classification(label="refund", probability=0.9),
            cache=pb.CacheInfo(model_version="1", key=key, similarity=0.97,
                               neighbors=[pb.Neighbor(similarity=0.97, answer="refund", age_s=3.5),
                                          pb.Neighbor(similarity=0.91, answer="card", age_s=1.0)])),
    }


@pytest.mark.parametrize("name, source, age_s", list(itertools.product(
    ["embedding", "classification", "explained"], Source.values(), [0.0, 1e-6, 2.5, 86_400.0 * 365])))
def test_suffix_sets_cache_fields_like_protobuf(name, source, age_s):
    stored = _stored_answers()[name]
    expected = pb.InferResponse()
    expected.CopyFrom(stored)
    expected.cache.source = source
    expected.cache.age_s = age_s
    composed = pb.InferResponse.FromString(stored.SerializeToString() + wire.cache_info(source, age_s))
    assert composed == expected
    assert composed.cache.source == source and composed.cache.age_s == age_s
    assert list(composed.outputs) == list(stored.outputs)  # a suffix never repeats the outputs


def test_batch_response_frames_each_answer_in_order():
    answers = list(_stored_answers().values())
    raw = [a.SerializeToString() + wire.cache_info(Source.RESULT_EXACT, 1.0) for a in answers]
    decoded = pb.InferBatchResponse.FromString(wire.batch_response(raw))
    assert [r.SerializeToString() for r in decoded.results] == [pb.InferResponse.FromString(r).SerializeToString()
                                                                  for r in raw]
    assert pb.InferBatchResponse.FromString(wire.batch_response([])) == pb.InferBatchResponse()


@pytest.mark.parametrize("value", [0, 1, 127, 128, 300, 16_383, 16_384, 2**21, 2**31, 2**63 - 1])
def test_varint_is_protobufs(value):
    decoded = sum((byte & 0x7F) << (7 * i) for i, byte in enumerate(wire.varint(value)))
    assert decoded == value and all(b >= 0x80 for b in wire.varint(value)[:-1]) and wire.varint(value)[-1] < 0x80
    if 0 < value <= 2**21:  # what protobuf writes before a bytes field of that length
        assert pb.Tensor(data=b"x" * value).SerializeToString().startswith(b"\x22" + wire.varint(value))
