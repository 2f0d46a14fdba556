"""The torch-cuda runtime: FP16 on the GPU under CUDA graphs, through the L3 store and a real server.

The GPU tests run on a lent GPU machine (docs/contributing.md) and skip elsewhere with the reason; the
batch classes and the source check run everywhere torch is installed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (the prepare extra)")

from cachestore.engine_store import EngineStore  # noqa: E402
from harness.servers import REPO, link_model  # noqa: E402
from server.engines.artifacts import get_runtime, prepare  # noqa: E402
from server.engines.onnxruntime import OrtEngine  # noqa: E402
from server import mps  # noqa: E402
from server.engines.torch_cuda import TorchCudaRuntime, batch_classes, next_capture  # noqa: E402
from server.shared.models import load_model  # noqa: E402
from server.shared.tokenization import TextEncoder, pad_batch  # noqa: E402
from tests.helpers import wait_for  # noqa: E402

GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
MINILM = REPO / "models" / "minilm"
TEXTS = ["how do I reset my card pin", "transfer failed", "why was I charged a fee on my statement this month "
         "when I only made one small transfer to my friend abroad", "top up", "lost card", "hello " * 40]


def test_batch_classes_pad_at_most_half_again():
    assert batch_classes(128) == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
    assert batch_classes(32)[-1] == 32 and batch_classes(1) == (1,) and batch_classes(10)[-1] == 10
    for rows in range(1, 129):
        padded = next(c for c in batch_classes(128) if c >= rows)
        assert padded <= max(rows + 1, rows * 1.5)


def test_graphs_are_captured_for_the_shapes_traffic_runs_first_then_largest_first():
    order = [(64, 4), (64, 1), (16, 4), (16, 1)]
    assert next_capture(order, {}, Counter()) == (64, 4)
    assert next_capture(order, {(64, 4): None}, Counter()) == (64, 1)
    demand = Counter({(16, 1): 3, (64, 1): 1})
    assert next_capture(order, {}, demand) == (16, 1)
    assert next_capture(order, {(16, 1): None}, demand) == (64, 1)
    assert next_capture(order, dict.fromkeys(order), demand) is None


def test_a_version_without_its_torch_form_is_refused_with_the_reason(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"onnx only")
    reason = TorchCudaRuntime.cannot_serve(TorchCudaRuntime.__new__(TorchCudaRuntime), tmp_path)
    assert "torch.safetensors is missing" in reason and "prepare-model" in reason


def _engine_and_texts(tmp_path, copies: int):
    """MiniLM's torch-cuda engine from a fresh L3 store, and TEXTS `copies` times, each made distinct, tokenized."""
    spec = load_model(MINILM)
    _, engine = prepare(EngineStore(tmp_path / "l3"), get_runtime("torch-cuda"), spec, "1", "fp16", load=True)
    encoder = TextEncoder(MINILM / "1" / "tokenizer.json", spec.max_tokens)
    return engine, [encoder.encode(f"{t} {n}") for n, t in enumerate(TEXTS * copies)]


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@GPU
def test_engine_from_the_l3_store_matches_onnx_runtime_at_every_batch_class(tmp_path):
    spec = load_model(MINILM)
    runtime = get_runtime("torch-cuda")
    artifact, engine = prepare(EngineStore(tmp_path / "l3"), runtime, spec, "1", "fp16", load=True)
    assert artifact.built and "_sm" in artifact.manifest.name and "_fp16_" in artifact.manifest.name
    again, _ = prepare(EngineStore(tmp_path / "l3"), runtime, spec, "1", "fp16")
    assert not again.built  # found and verified, not rebuilt
    encoder = TextEncoder(MINILM / "1" / "tokenizer.json", spec.max_tokens)
    reference = OrtEngine(MINILM / "1" / "model.onnx")
    sequences = [encoder.encode(t) for t in TEXTS]
    batches = []
    for rows in (1, 3, 5, 7, 17, 32):  # between classes too: padded rows must not leak into real ones
        batch = [sequences[i % len(sequences)] for i in range(rows)]
        batches.append(pad_batch(batch, max(map(len, batch))))
    eager = [engine.run(inputs)["embedding"] for inputs in batches]  # served before any graph is captured
    assert engine.counters()["eager_runs"] == len(batches) and not engine.graphs
    assert engine.wait_warm(120) and engine.warm_phases()["capture"] > 0
    assert len(engine.graphs) == len(engine.seqs) * len(engine.classes)
    for inputs, before in zip(batches, eager):
        got, want = engine.run(inputs)["embedding"], reference.run(inputs)["embedding"]
        assert got.shape == want.shape and got.dtype == np.float32
        assert _cosines(got, want).min() >= 0.999, len(got)
        np.testing.assert_array_equal(got, before)  # the same answer with its graph as without
    counters = engine.counters()
    assert counters["replays"] == counters["eager_runs"] == len(batches)
    assert counters["padded_rows"] > 0 and counters["rows"] == 2 * (1 + 3 + 5 + 7 + 17 + 32)


@GPU
def test_graphs_are_captured_behind_live_traffic_without_changing_an_answer(tmp_path):
    engine, sequences = _engine_and_texts(tmp_path, 4)
    inputs = [pad_batch(sequences[i:i + rows], max(map(len, sequences[i:i + rows])))
              for rows in (1, 2, 5) for i in range(0, len(sequences) - rows, rows)]
    want = [engine.run(i)["embedding"] for i in inputs]  # eager
    stop = threading.Event()

    def serve() -> int:
        rounds = 0
        while not stop.is_set():
            for i, w in zip(inputs, want):
                np.testing.assert_array_equal(engine.run(i)["embedding"], w)
            rounds += 1
        return rounds

    with ThreadPoolExecutor(engine.slots) as pool:  # two threads serving before, while and after it captures
        serving = [pool.submit(serve) for _ in range(engine.slots)]
        try:
            wait_for(lambda: engine.counters()["eager_runs"] >= 2 * len(inputs), 60, "traffic before the capture")
            engine.warm_behind_traffic()
            wait_for(lambda: engine.warm_since() is not None, 120, "every graph captured")
            replays = engine.counters().get("replays", 0)
            wait_for(lambda: engine.counters().get("replays", 0) > replays + len(inputs), 60, "traffic on the graphs")
        finally:
            stop.set()
        assert all(f.result() >= 2 for f in serving)
    counters = engine.counters()
    assert counters["replays"] > 0 and counters["eager_runs"] > len(inputs), counters


@GPU
def test_two_slots_at_once_give_each_caller_its_own_answers(tmp_path):
    engine, sequences = _engine_and_texts(tmp_path, 20)
    inputs = [pad_batch([ids], len(ids)) for ids in sequences]
    alone = [engine.run(i)["embedding"] for i in inputs]
    with ThreadPoolExecutor(engine.slots) as pool:
        together = list(pool.map(lambda i: engine.run(i)["embedding"], inputs))
    for a, b in zip(alone, together):
        assert _cosines(a, b).min() > 0.9999


@GPU
def test_a_gpu_host_serves_on_the_gpu_by_default(start_server, tmp_path):
    models = tmp_path / "models"
    link_model(models, "minilm", (MINILM / "config.yaml").read_text(), {"1": MINILM / "1"})
    server = start_server(models=models)
    [worker] = server.wait_warm()
    assert {"imports", "runtime_import", "device_init", "ready", "warm"} <= set(worker.start_seconds)
    assert worker.engines[0].warmup_seconds["capture"] > 0
    with server.client() as client:
        [info] = client.models()
        assert [(e.runtime, e.precision) for e in info.engines] == [("torch-cuda", "fp16")]
        assert info.engines[0].device.startswith("cuda:0 (")
        results = client.infer_batch("minilm", TEXTS)
    encoder = TextEncoder(MINILM / "1" / "tokenizer.json", 256)
    reference = OrtEngine(MINILM / "1" / "model.onnx")
    for text, result in zip(TEXTS, results):
        want = reference.run(pad_batch([encoder.encode(" ".join(text.split()))], 1 + len(encoder.encode(text))))
        assert result.source == "MISS" and result.outputs["embedding"].shape == (384,)
        assert _cosines(result.outputs["embedding"][None], want["embedding"][:1]).min() >= 0.999
    counters = server.stats().worker.counters
    assert counters["engine.minilm.1.replays"] >= 1


MPS_CONTROL = shutil.which(mps.CONTROL)


@GPU
@pytest.mark.skipif(MPS_CONTROL is None, reason=f"needs {mps.CONTROL} (the NVIDIA driver's utilities)")
def test_workers_sharing_the_gpu_run_through_a_private_mps_daemon_that_stops_with_the_server(start_server, tmp_path):
    models = tmp_path / "models"
    link_model(models, "minilm", (MINILM / "config.yaml").read_text(), {"1": MINILM / "1"})
    server = start_server(models=models, settings=(f"server.workers={2 * torch.cuda.device_count()}",))
    pipe = server.workdir / "run" / "mps-pipe"
    env = {**os.environ, mps.PIPE_ENV: str(pipe)}

    def ask(command: str) -> subprocess.CompletedProcess:
        return subprocess.run([MPS_CONTROL], input=f"{command}\n".encode(), env=env, capture_output=True, timeout=10)

    texts = [f"{text} {n}" for n in range(16) for text in TEXTS[:4]]  # keys spread over both workers
    server.wait_warm()
    with server.client() as client:
        results = client.infer_batch("minilm", texts)
    assert all(r.source == "MISS" and r.outputs["embedding"].shape == (384,) for r in results)
    workers = server.stats().workers
    assert len(workers) == 2 * torch.cuda.device_count()
    assert all(w.counters["engine.minilm.1.replays"] >= 1 for w in workers)
    servers = ask("get_server_list").stdout.split()
    assert servers, "no MPS server: the workers did not reach the daemon"
    assert "CUDA MPS daemon started" in server.log_text()
    daemon = int((pipe / "nvidia-cuda-mps-control.pid").read_text())
    assert server.stop() == 0
    assert not os.path.exists(f"/proc/{daemon}"), "the MPS daemon outlived the server"
