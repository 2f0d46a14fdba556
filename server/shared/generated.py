"""A generated answer as bytes, the form it is stored in and sent as: one serialized GenerateResponse with
the whole text, its token ids and its `end` (finish reason, token counts, model version, key). Where it
came from is appended at the last moment (marked): protobuf merges a message repeated in the bytes, so
the suffix sets `end.cache.source` and `age_s` without parsing the stored answer, as cachestore/wire.py
does for InferResponse."""

from __future__ import annotations

from infercache.v1 import infercache_pb2 as pb

# An answer's finish reason as OpenAI's API names it (its doors answer so; its upstreams answer so).
FINISH_NAMES = {pb.GenerationEnd.STOP: "stop", pb.GenerationEnd.LENGTH: "length"}


def whole_answer(text: str, token_ids: list[int], finish_reason: int, prompt_tokens: int, version: str,
                 key: bytes, completion_tokens: int | None = None) -> bytes:
    """completion_tokens: the answer's tokens where its ids are not known (an upstream's count); else len(token_ids)."""
    return pb.GenerateResponse(text=text, token_ids=token_ids, end=pb.GenerationEnd(
        finish_reason=finish_reason, prompt_tokens=prompt_tokens,
        completion_tokens=len(token_ids) if completion_tokens is None else completion_tokens,
        cache=pb.CacheInfo(model_version=version, key=key.hex()))).SerializeToString()


def marked(answer: bytes, source: int, age_s: float = 0.0, similarity: float = 0.0, verdict: int = 0) -> bytes:
    """The answer with where it came from and its age (MISS, age 0: the answer as it is); a semantic
    answer also with the matched question's similarity and the judge's verdict."""
    return answer + pb.GenerateResponse(end=pb.GenerationEnd(cache=pb.CacheInfo(
        source=source, age_s=age_s, similarity=similarity, verdict=verdict))).SerializeToString()


def end_only(answer: bytes) -> bytes:
    """The answer's last message alone, for a stream that sent its text already."""
    return pb.GenerateResponse(end=pb.GenerateResponse.FromString(answer).end).SerializeToString()
