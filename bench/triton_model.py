"""MiniLM behind NVIDIA Triton with its response cache, through PyTriton: the peer the peers section's
hits part measures infercache against. Runs in the peer's own virtualenv (bench/peer_envs.py), so it
imports nothing of infercache: the same ONNX graph (mean pooling and L2 normalization inside) and
tokenizer, in ONNX Runtime, truncated at the model's max_tokens.

    python bench/triton_model.py MODEL_VERSION_DIR MAX_TOKENS GRPC_PORT HTTP_PORT METRICS_PORT CACHE_BYTES

Serves model "minilm": input "text" (BYTES, one per request row), output "embedding" (FP32, 384),
Triton's dynamic batcher up to 32 rows, the response cache on (Triton's local cache of CACHE_BYTES).
Prints "ready" once Triton serves it, and serves until SIGINT/SIGTERM."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig
from tokenizers import Tokenizer

MAX_BATCH = 32


def main() -> None:
    version_dir, max_tokens = Path(sys.argv[1]), int(sys.argv[2])
    grpc_port, http_port, metrics_port, cache_bytes = map(int, sys.argv[3:7])
    tokenizer = Tokenizer.from_file(str(version_dir / "tokenizer.json"))
    tokenizer.enable_truncation(max_tokens)
    tokenizer.no_padding()
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(version_dir / "model.onnx"), options, providers=["CPUExecutionProvider"])

    @batch
    def infer(text: np.ndarray) -> dict[str, np.ndarray]:
        ids = [e.ids for e in tokenizer.encode_batch([t[0].decode() for t in text])]
        width = max(map(len, ids))
        input_ids = np.zeros((len(ids), width), dtype=np.int64)
        mask = np.zeros((len(ids), width), dtype=np.int64)
        for row, sequence in enumerate(ids):
            input_ids[row, :len(sequence)] = sequence
            mask[row, :len(sequence)] = 1
        (embedding,) = session.run(["embedding"], {"input_ids": input_ids, "attention_mask": mask})
        return {"embedding": embedding.astype(np.float32)}

    config = TritonConfig(grpc_port=grpc_port, http_port=http_port, metrics_port=metrics_port,
                          cache_config=[f"local,size={cache_bytes}"], log_verbose=0)
    with Triton(config=config) as triton:
        triton.bind(model_name="minilm", infer_func=infer,
                    inputs=[Tensor(name="text", dtype=bytes, shape=(1,))],
                    outputs=[Tensor(name="embedding", dtype=np.float32, shape=(384,))],
                    config=ModelConfig(max_batch_size=MAX_BATCH, batcher=DynamicBatcher(), response_cache=True),
                    strict=True)
        triton.run()
        print("ready", flush=True)
        triton.serve()


if __name__ == "__main__":
    main()
