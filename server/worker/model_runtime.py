"""One model version loaded in an inference worker: its engine (from the L3 store), its batcher, and
how its outputs become an answer."""

from __future__ import annotations

import json
import time

import numpy as np

from infercache.v1 import infercache_pb2 as pb
from server.shared.admission import length_groups
from server.worker.batcher import Batcher
from server.worker.flights import token_ids
from server.config import Config
from server.shared.answers import Answers
from server.engines.artifacts import LoadedEngine, model_profiles
from server.shared.models import LABELS_FILE, TOKENIZER_FILE, ModelSpec
from server.shared.tokenization import TextEncoder, pad_batch

SEED_ROWS = 4  # rows of the longest profile the warmup times, beside one (server/worker/batcher.py's row model)


class ModelRuntime:
    def __init__(self, spec: ModelSpec, version: str, loaded: LoadedEngine, config: Config, nice: int = 0) -> None:
        self.spec = spec
        self.version = version
        self.nice = nice  # how much nicer than the event loop its engine's threads run (a CPU worker's)
        self.engine = loaded.engine
        self.info = pb.EngineInfo(model=spec.name, version=version, runtime=loaded.runtime,
                                  precision=loaded.precision, device=loaded.device)
        self.built_s = loaded.built_s  # building its engine at start took this long (0: loaded)
        self.load_s = loaded.load_s    # loading it (from the L3 store, or after its build)
        self.warmup_s = 0.0            # set by the worker once warmed up
        # Frontends tokenize requests; the worker needs the tokenizer only for its warmup batches.
        self.encoder = TextEncoder(spec.version_dir(version) / TOKENIZER_FILE, spec.max_tokens)
        labels_path = spec.version_dir(version) / LABELS_FILE
        self.labels: list[str] = json.loads(labels_path.read_text()) if spec.task == "classification" else []
        self.answers = Answers(spec, version, self.labels)
        groups = length_groups(spec.buckets) if self.engine.any_length and config.server.length_groups else None
        self.batcher = Batcher(
            self._run_batch, buckets=spec.buckets, max_batch=spec.max_batch_size,
            max_delay_s=spec.max_queue_delay_ms / 1000, max_queue=config.server.max_queue,
            concurrency=self.engine.slots, name=f"{spec.name}-{version}", max_wait_s=config.server.max_queue_wait_s,
            nice=nice, groups=groups,
        )

    def phases(self) -> dict[str, float]:
        """Seconds of each phase of its engine's start (server/worker/startup.py): its load (weights
        to the device, the first batch), the worker's warmup batches, and the engine's own (the CUDA
        graphs' capture once done). A build has its own figure (built_s)."""
        return {"load": self.load_s, "warmup": self.warmup_s, **self.engine.warm_phases()}

    def input_of(self, item) -> np.ndarray:
        """What the batcher takes of a ComputeItem: its token ids."""
        return token_ids(item.ids)

    def _run_batch(self, sequences: list) -> list[dict[str, np.ndarray]]:
        outputs = self.engine.run(pad_batch(sequences, max(len(s) for s in sequences)))
        return [{name: values[row] for name, values in outputs.items()} for row in range(len(sequences))]

    def response(self, outputs: dict[str, np.ndarray], key: bytes) -> pb.InferResponse:
        return self.answers.response(outputs, key)

    def payload(self, outputs: dict[str, np.ndarray], key: bytes) -> bytes:
        """The serialized InferResponse of a computed result (what is replied and stored)."""
        return self.answers.payload(outputs, key)

    def output_dim(self, name: str) -> int:
        return int(self._run_batch([self.encoder.encode("dimension")])[0][name].shape[-1])

    def warmup(self) -> None:
        """One batch per profile before the worker reports ready (TensorRT initializes lazily), then one
        more of the longest, timed: the batcher's first estimate of a batch's duration (admission), and
        one of SEED_ROWS such rows: what a row adds (the batcher's row model)."""
        cls, sep = self.encoder.encode("")[:1] or [0], self.encoder.encode("")[-1:] or [0]
        longest = None
        for profile in model_profiles(self.spec):
            longest = [cls + [sep[0]] * (profile.max_seq - 1)]
            self._run_batch(longest)
        if longest is not None:
            started = time.perf_counter()
            self._run_batch(longest)
            one = time.perf_counter() - started
            rows = min(SEED_ROWS, self.spec.max_batch_size)
            if rows < 2:
                self.batcher.seed_timing(one)
                return
            self._run_batch(longest * rows)  # (a new shape's first run is not what it costs)
            started = time.perf_counter()
            self._run_batch(longest * rows)
            self.batcher.seed_timing(one, time.perf_counter() - started, rows)
