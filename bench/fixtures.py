"""What the benchmarks serve and send: the texts (Banking77, or generated ones where it is missing), the
GPU sections' model repositories, requests pre-serialized for the load generators, and waiting for the
first answer of a starting server."""

from __future__ import annotations

import csv
import random
import time
from pathlib import Path

import grpc

from bench import BANKING77, banking77_missing
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from harness.servers import REPO, ServerProcess


INFER_BATCH = "/infercache.v1.InferenceCache/InferBatch"


MINILM_GPU_CONFIG = """
task: embedding
serving_version: "1"
input: {max_text_chars: 2048, max_tokens: 256}
outputs: [embedding]
batching: {buckets: [16, 32, 64, 128, 256], max_batch_size: 128, max_queue_delay_ms: 0}
cache: {ttl_s: 604800}
"""


BERT_BASE_CONFIG = """
task: embedding
serving_version: "1"
input: {max_text_chars: 8192, max_tokens: 128}
outputs: [embedding]
batching: {buckets: [128], max_batch_size: 128, max_queue_delay_ms: 0}
cache: {ttl_s: 604800}
"""


def distinct_texts(texts: list[str], count: int, seed: int) -> list[str]:
    """`count` distinct texts: real queries, each with a short reference number so none repeats."""
    rng = random.Random(seed)
    return [f"{rng.choice(texts)} ref {seed}-{i}" for i in range(count)]


def long_texts(texts: list[str], count: int, seed: int) -> list[str]:
    """Distinct texts of 128+ tokens (several queries joined), for the BERT-base runs."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        parts, size = [f"case {seed}-{i}:"], 0
        while size < 700:
            parts.append(rng.choice(texts))
            size += len(parts[-1]) + 1
        out.append(" ".join(parts))
    return out


def single_payloads(model: str, texts: list[str]) -> list[bytes]:
    return [pb.InferRequest(model=model, text=t).SerializeToString() for t in texts]


def batch_payloads(model: str, texts: list[str], per_call: int, mode: int = pb.CachePolicy.DEFAULT) -> list[bytes]:
    policy = pb.CachePolicy(mode=mode)
    return [pb.InferBatchRequest(model=model, texts=texts[i:i + per_call], cache=policy).SerializeToString()
            for i in range(0, len(texts) - per_call + 1, per_call)]


def make_gpu_models(root: Path, on_gpu: bool) -> Path:
    """minilm with GPU batching (max batch 128) and, on a GPU, bert-base: random BERT-base weights in the
    torch form with MiniLM's tokenizer (the same 30522-token vocabulary)."""
    source = REPO / "models" / "minilm" / "1"
    (root / "minilm").mkdir(parents=True)
    (root / "minilm" / "config.yaml").write_text(MINILM_GPU_CONFIG)
    (root / "minilm" / "1").symlink_to(source)
    if on_gpu:
        import torch

        from server.engines.torch_bert import BERT_BASE, random_bert, write_torch_source

        target = root / "bert-base" / "1"
        target.mkdir(parents=True)
        (root / "bert-base" / "config.yaml").write_text(BERT_BASE_CONFIG)
        (target / "tokenizer.json").symlink_to(source / "tokenizer.json")
        module = random_bert(BERT_BASE, device="cpu", dtype=torch.float32)
        write_torch_source(target, BERT_BASE, module.state_dict())
    return root



def make_models(root: Path, unbatched: bool = False) -> Path:
    """minilm as shipped, and with `unbatched` minilm-b1: the same weights with max_batch_size 1 (the
    no-batching baseline; a second engine each server loads)."""
    source = REPO / "models" / "minilm"
    for name, batch in (("minilm", None), ("minilm-b1", 1))[:2 if unbatched else 1]:
        (root / name).mkdir(parents=True)
        config = (source / "config.yaml").read_text()
        if batch is not None:
            config = config.replace("max_batch_size: 32", f"max_batch_size: {batch}")
        (root / name / "config.yaml").write_text(config)
        (root / name / "1").symlink_to(source / "1")
    return root


def load_texts() -> list[str]:
    """Banking77's texts; where the file is missing, generated ones (and a line that says so)."""
    if BANKING77.is_file():
        with open(BANKING77, newline="") as f:
            return [row["text"] for row in csv.DictReader(f)]
    print(f"generated texts instead of Banking77's: {banking77_missing()}", flush=True)
    return [f"customer question number {i} about cards, refunds and transfers" for i in range(10_000)]


def first_success(address: str, request: pb.InferRequest, started: float, timeout: float = 120,
                  server: ServerProcess | None = None) -> float:
    """Seconds from `started` until `request` succeeds (polling every 5 ms on fresh connections)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server is not None and server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log_text()[-3000:]}")
        with grpc.insecure_channel(address) as channel:
            try:
                infercache_pb2_grpc.InferenceCacheStub(channel).Infer(request, timeout=5)
                return time.monotonic() - started
            except grpc.RpcError:
                pass
        time.sleep(0.005)
    raise TimeoutError(f"no answer within {timeout} s")
