"""One model version loaded in an inference worker: its engine (from the L3 store), its batcher, and
how its outputs become an answer."""

from __future__ import annotations

import json

import numpy as np

from infercache.v1 import infercache_pb2 as pb
from server.batcher import Batcher
from server.config import Config
from server.engines.artifacts import LoadedEngine, model_profiles
from server.models import LABELS_FILE, TOKENIZER_FILE, ModelSpec
from server.tokenization import TextEncoder, pad_batch


_DTYPE_NAMES: dict[np.dtype, str] = {}  # str(dtype) is slow Python code; it runs once per answer


def to_tensors(outputs: dict[str, np.ndarray]) -> list[pb.Tensor]:
    tensors = []
    for name, array in outputs.items():
        dtype = _DTYPE_NAMES.get(array.dtype) or _DTYPE_NAMES.setdefault(array.dtype, str(array.dtype))
        tensors.append(pb.Tensor(name=name, dtype=dtype, shape=array.shape, data=array.tobytes()))
    return tensors


class ModelRuntime:
    def __init__(self, spec: ModelSpec, version: str, loaded: LoadedEngine, config: Config) -> None:
        self.spec = spec
        self.version = version
        self.engine = loaded.engine
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime=loaded.runtime,
                                  precision=loaded.precision, device=loaded.device)
        # Frontends tokenize requests; the worker needs the tokenizer only for its warmup batches.
        self.encoder = TextEncoder(spec.version_dir(version) / TOKENIZER_FILE, spec.max_tokens)
        labels_path = spec.version_dir(version) / LABELS_FILE
        self.labels: list[str] = json.loads(labels_path.read_text()) if spec.task == "classification" else []
        self.batcher = Batcher(
            self._run_batch, buckets=spec.buckets, max_batch=spec.max_batch_size,
            max_delay_s=spec.max_queue_delay_ms / 1000, max_queue=config.server.max_queue,
            concurrency=self.engine.slots, name=f"{spec.name}-{version}",
        )

    def _run_batch(self, sequences: list) -> list[dict[str, np.ndarray]]:
        outputs = self.engine.run(pad_batch(sequences, max(len(s) for s in sequences)))
        return [{name: values[row] for name, values in outputs.items()} for row in range(len(sequences))]

    def response(self, outputs: dict[str, np.ndarray], key: bytes) -> pb.InferResponse:
        response = pb.InferResponse(outputs=to_tensors({name: outputs[name] for name in self.spec.outputs}),
                                    cache=pb.CacheInfo(model_version=self.version, key=key.hex()))
        if self.labels:
            scores = outputs["scores"]
            best = int(np.argmax(scores))
            response.classification.label = self.labels[best]
            response.classification.probability = float(scores[best])
        return response

    def output_dim(self, name: str) -> int:
        return int(self._run_batch([self.encoder.encode("dimension")])[0][name].shape[-1])

    def warmup(self) -> None:
        """One batch per profile before the worker reports ready (TensorRT initializes lazily)."""
        cls, sep = self.encoder.encode("")[:1] or [0], self.encoder.encode("")[-1:] or [0]
        for profile in model_profiles(self.spec):
            self._run_batch([cls + [sep[0]] * (profile.max_seq - 1)])
