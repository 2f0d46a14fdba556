"""A small Python client for infercache.

    from infercache.client import Client
    with Client("127.0.0.1:50051") as client:
        result = client.infer("minilm", "How do I return an item?")
        print(result.source, result.outputs["embedding"].shape)
        for piece in client.generate_stream("smollm2", "How do I return an item?"):
            print(piece.text, end="", flush=True)
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import numpy as np

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc

Mode = pb.CachePolicy.Mode


@dataclass(frozen=True)
class Result:
    outputs: dict[str, np.ndarray]
    source: str          # "MISS", "RESULT_EXACT", ...
    age_s: float
    model_version: str
    key: str             # pass to Client.invalidate(key=...) to drop exactly this entry
    label: str = ""      # classification models: the answer ...
    probability: float = 0.0  # ... and its probability
    similarity: float = 0.0   # RESULT_SEMANTIC: similarity of the matched request
    stale: bool = False       # an expired entry answered because the model could not (cache.stale_if_error_s)


@dataclass(frozen=True)
class Generated:
    """A whole generated answer (Client.generate)."""

    text: str
    token_ids: list[int]
    finish_reason: str   # "STOP" (the model ended, or a stop string came) or "LENGTH"
    prompt_tokens: int
    source: str          # "MISS", "RESULT_EXACT", "COALESCED", ...
    age_s: float
    model_version: str
    key: str
    similarity: float = 0.0   # RESULT_SEMANTIC: similarity of the matched question
    verdict: str = "VERDICT_UNSPECIFIED"  # RESULT_SEMANTIC: "ESTIMATED" or "VERIFIED" (CacheInfo.Verdict)


def decode_outputs(response: pb.InferResponse) -> dict[str, np.ndarray]:
    return {t.name: np.frombuffer(t.data, dtype=t.dtype).reshape(tuple(t.shape)) for t in response.outputs}


def to_result(response: pb.InferResponse) -> Result:
    info = response.cache
    return Result(decode_outputs(response), pb.CacheInfo.Source.Name(info.source), info.age_s,
                  info.model_version, info.key, response.classification.label,
                  response.classification.probability, info.similarity, info.stale)


def channel(target: str, *, ca: bytes | None = None, cert: bytes | None = None, key: bytes | None = None,
            server_name: str | None = None) -> grpc.Channel:
    """A channel to the server: plaintext, or TLS when `ca` (PEM of the CA that signed the server's
    certificate) is given; `cert` and `key` (PEM) are this client's certificate for mutual TLS."""
    if ca is None:
        return grpc.insecure_channel(target)
    options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(target, credentials, options=options)


class Client:
    """token: sent as `authorization: Bearer <token>` on every call (security.tokens_file on the server).
    ca / cert / key / server_name: TLS, see `channel`."""

    def __init__(self, target: str = "127.0.0.1:50051", *, timeout_s: float = 10.0, token: str | None = None,
                 ca: bytes | None = None, cert: bytes | None = None, key: bytes | None = None,
                 server_name: str | None = None) -> None:
        self.channel = channel(target, ca=ca, cert=cert, key=key, server_name=server_name)
        self.stub = infercache_pb2_grpc.InferenceCacheStub(self.channel)
        self.timeout_s = timeout_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None

    def infer(self, model: str, text: str, *, version: str = "", tenant: str = "", mode: str = "DEFAULT",
              max_age_s: int | None = None, semantic: bool | None = None,
              min_similarity: float | None = None, ttl_class: str = "") -> Result:
        policy = pb.CachePolicy(mode=Mode.Value(mode), max_age_s=max_age_s, ttl_class=ttl_class)
        matching = pb.SemanticPolicy(enabled=semantic, min_similarity=min_similarity)
        request = pb.InferRequest(model=model, version=version, tenant=tenant, text=text, cache=policy,
                                  semantic=matching)
        return to_result(self.stub.Infer(request, timeout=self.timeout_s, metadata=self.metadata))

    def infer_batch(self, model: str, texts: list[str], *, version: str = "", tenant: str = "",
                    mode: str = "DEFAULT", max_age_s: int | None = None, semantic: bool | None = None,
                    min_similarity: float | None = None, ttl_class: str = "") -> list[Result]:
        """One Result per text, in order (hits and misses mixed); at most ListModels' max_batch_texts."""
        request = pb.InferBatchRequest(
            model=model, version=version, tenant=tenant, texts=texts,
            cache=pb.CachePolicy(mode=Mode.Value(mode), max_age_s=max_age_s, ttl_class=ttl_class),
            semantic=pb.SemanticPolicy(enabled=semantic, min_similarity=min_similarity),
        )
        response = self.stub.InferBatch(request, timeout=self.timeout_s, metadata=self.metadata)
        return [to_result(r) for r in response.results]

    def generate_stream(self, model: str, prompt: str | None = None, *, messages: list[dict] | None = None,
                        version: str = "", tenant: str = "", max_new_tokens: int = 0, stop: list[str] | None = None,
                        temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
                        seed: int | None = None, mode: str = "DEFAULT", max_age_s: int | None = None,
                        ttl_class: str = ""):
        """The GenerateResponse messages as they come, an iterator with cancel(): a user's question
        (`prompt`, with the model's chat template) or `messages` ([{"role": "user", "content": "..."},
        ...]); the last message has `end` set."""
        if messages is None:
            messages = [{"role": "user", "content": prompt}]
        request = pb.GenerateRequest(
            model=model, version=version, tenant=tenant, messages=[pb.ChatMessage(**m) for m in messages],
            max_new_tokens=max_new_tokens, stop=stop or [], temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, cache=pb.CachePolicy(mode=Mode.Value(mode), max_age_s=max_age_s, ttl_class=ttl_class))
        return self.stub.Generate(request, timeout=self.timeout_s, metadata=self.metadata)

    def generate(self, model: str, prompt: str | None = None, **options) -> Generated:
        """The whole answer (options as for generate_stream)."""
        text, ids = [], []
        for message in self.generate_stream(model, prompt, **options):
            text.append(message.text)
            ids.extend(message.token_ids)
            if message.HasField("end"):
                end = message.end
                return Generated("".join(text), ids, pb.GenerationEnd.FinishReason.Name(end.finish_reason),
                                 end.prompt_tokens, pb.CacheInfo.Source.Name(end.cache.source), end.cache.age_s,
                                 end.cache.model_version, end.cache.key, end.cache.similarity,
                                 pb.CacheInfo.Verdict.Name(end.cache.verdict))
        raise RuntimeError("the stream ended without its last message")

    def invalidate(self, **selector) -> int:
        request = pb.InvalidateRequest(**selector)
        return self.stub.Invalidate(request, timeout=self.timeout_s, metadata=self.metadata).removed

    def stats(self) -> pb.GetStatsResponse:
        return self.stub.GetStats(pb.GetStatsRequest(), timeout=self.timeout_s, metadata=self.metadata)

    def models(self) -> list[pb.ModelInfo]:
        response = self.stub.ListModels(pb.ListModelsRequest(), timeout=self.timeout_s, metadata=self.metadata)
        return list(response.models)

    def hot_keys(self, model: str, limit: int = 0) -> list[pb.HotKey]:
        """The model's hottest keys, most requested first (an admin token when tokens are on)."""
        request = pb.GetHotKeysRequest(model=model, limit=limit)
        return list(self.stub.GetHotKeys(request, timeout=self.timeout_s, metadata=self.metadata).keys)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
