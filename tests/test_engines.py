"""The L3 engine store with real builds: ONNX Runtime's optimized model and TensorRT(-RTX) plans.

TensorRT-RTX (installed by `make test`) parses ONNX and builds and serializes engines on this CPU-only
machine; running an engine needs a supported NVIDIA GPU, so those tests skip with the reason.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cachestore.engine_store import EngineStore
from server.engines.artifacts import artifact_key, get_runtime, model_profiles, prepare
from server.engines.base import RuntimeUnavailable
from server.engines.onnxruntime import OrtEngine
from server.shared.models import load_model
from server.shared.tokenization import TextEncoder, pad_batch
from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR, REPO
from harness.servers import link_model

SPEC = load_model(REPO / "models" / "minilm")


def tensorrt_runtime():
    try:
        return get_runtime("tensorrt")
    except RuntimeUnavailable as exc:
        pytest.skip(f"TensorRT not installed here: {exc}")


def flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_onnxruntime_artifact_is_built_once_verified_and_equivalent(tmp_path):
    store = EngineStore(tmp_path / "engines")
    runtime = get_runtime("onnxruntime")
    first = prepare(store, runtime, SPEC, "1", "fp16")[0]
    assert first.built and first.path.is_file() and first.path.suffix == ".onnx"
    manifest = json.loads(store.manifest_path(first.manifest.name).read_text())
    assert manifest["sha256"] == first.manifest.sha256 and manifest["size_bytes"] == first.path.stat().st_size
    assert manifest["key"]["runtime"] == "onnxruntime" and manifest["key"]["precision"] == "fp32"
    assert len(manifest["key"]["profiles"]) == len(SPEC.buckets) and manifest["build_seconds"] > 0
    assert manifest["details"]["graph_optimization"] == "ORT_ENABLE_ALL"
    assert first.manifest.name.startswith("minilm_1_cpu-")

    second = prepare(store, runtime, SPEC, "1", "fp16")[0]
    assert not second.built and second.manifest == first.manifest

    encoder = TextEncoder(MODEL_VERSION_DIR / "tokenizer.json", 256)
    batch = pad_batch([encoder.encode(t) for t in ("how do i return an item", "card not arrived")], 8)
    stored = runtime.load(second.path, model_profiles(SPEC), threads=1).run(batch)["embedding"]
    original = OrtEngine(MODEL_VERSION_DIR / "model.onnx", threads=1).run(batch)["embedding"]
    np.testing.assert_allclose(stored, original, atol=1e-5)


@pytest.mark.parametrize("damage, reason", [
    (flip_a_byte, "checksum mismatch"),
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), "missing or truncated"),
    (lambda p: p.with_suffix(".json").write_text("{not json"), "no valid manifest"),
])
def test_damaged_artifact_is_rebuilt_not_trusted(tmp_path, caplog, damage, reason):
    store = EngineStore(tmp_path / "engines")
    runtime = get_runtime("onnxruntime")
    built = prepare(store, runtime, SPEC, "1", "fp16")[0]
    damage(built.path)
    with caplog.at_level(logging.WARNING, logger="infercache.engines"):
        again, engine = prepare(store, runtime, SPEC, "1", "fp16", load=True)  # loading a damaged file is no error
    assert again.built and reason in again.rebuilt_reason and engine is not None
    assert any(reason in r.getMessage() for r in caplog.records)
    assert store.verify_all() == [(again.manifest.name, "")]


def test_changed_profiles_or_source_invalidate(tmp_path):
    store = EngineStore(tmp_path / "engines")
    runtime = get_runtime("onnxruntime")
    base = prepare(store, runtime, SPEC, "1", "fp16")[0]
    other = prepare(store, runtime, replace(SPEC, buckets=(32, 256)), "1", "fp16")[0]
    assert other.built and other.manifest.name != base.manifest.name
    assert base.manifest.name.rsplit("_", 1)[0] == other.manifest.name.rsplit("_", 1)[0]  # only the hash differs

    copy = tmp_path / "models" / "minilm"
    shutil.copytree(MODEL_VERSION_DIR, copy / "1")
    moved = replace(SPEC, root=copy)
    assert not prepare(store, runtime, moved, "1", "fp16")[0].built  # same bytes, same artifact
    flip_a_byte(copy / "1" / "model.onnx")
    changed = prepare(store, runtime, moved, "1", "fp16")[0]
    assert changed.built and "source model changed" in changed.rebuilt_reason


def test_tensorrt_build_profiles_manifest_and_timing_cache(tmp_path):
    runtime = tensorrt_runtime()
    store = EngineStore(tmp_path / "engines")
    spec = replace(SPEC, buckets=(16, 32), max_batch_size=8)
    first = prepare(store, runtime, spec, "1", "fp16")[0]
    assert first.built and first.path.suffix == ".plan" and first.path.stat().st_size > 10_000_000
    key = first.manifest.key
    assert key["runtime"] == runtime.name and key["runtime_version"] == runtime.version
    assert key["profiles"] == [[1, 4, 8, 1, 16, 16], [1, 4, 8, 17, 32, 32]]
    details = first.manifest.details
    assert details["inputs"] == ["input_ids", "attention_mask"] and "compute_capability" in details
    timing = store.timing_cache_path(key["device"], runtime.name, runtime.version)
    assert timing.is_file() and details["timing_cache_saved_bytes"] == timing.stat().st_size > 0
    assert details["timing_cache_loaded_bytes"] == 0  # the first build on this device

    assert not prepare(store, runtime, spec, "1", "fp16")[0].built
    flip_a_byte(first.path)
    rebuilt = prepare(store, runtime, spec, "1", "fp16")[0]
    assert rebuilt.built and "checksum" in rebuilt.rebuilt_reason
    # A new profile set is a new artifact, and its build starts from the device's timing cache.
    wider = prepare(store, runtime, replace(spec, buckets=(64,)), "1", "fp16")[0]
    assert wider.built and wider.manifest.name != first.manifest.name
    assert wider.manifest.details["timing_cache_loaded_bytes"] == timing.stat().st_size


def test_two_builders_into_one_directory_build_once(tmp_path):
    tensorrt_runtime()
    engines = tmp_path / "shared-engines"
    command = [sys.executable, "-m", "server", "engines", "build", "--runtime", "tensorrt",
               "--engines-dir", str(engines), "--models-dir", str(REPO / "models")]
    builders = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for _ in range(2)]
    outputs = [b.communicate(timeout=600)[0] for b in builders]
    assert [b.returncode for b in builders] == [0, 0], outputs
    assert sum("built in" in out for out in outputs) == 1, outputs
    assert sum("already in the store" in out for out in outputs) == 1, outputs
    artifacts = sorted(p.name for p in (engines / "artifacts").iterdir())
    assert len(artifacts) == 2 and artifacts[0].endswith(".json") and artifacts[1].endswith(".plan")
    assert EngineStore(engines).verify_all()[0][1] == ""


def test_engines_cli_list_verify_prune(tmp_path):
    engines = tmp_path / "engines"
    models = tmp_path / "models"
    for name in ("minilm", "retired"):
        link_model(models, name, MINILM_CONFIG, {"1": MODEL_VERSION_DIR})

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "server", "engines", *args, "--engines-dir", str(engines),
                               "--models-dir", str(models)], cwd=REPO, capture_output=True, text=True, timeout=300)

    built = cli("build")
    assert built.returncode == 0 and "[1/2] minilm 1" in built.stdout and "[2/2] retired 1" in built.stdout
    unknown = cli("build", "--model", "no-such-model")
    assert unknown.returncode == 2 and "unknown model 'no-such-model'" in unknown.stdout
    link_model(models, "chat", (REPO / "models" / "smollm2" / "config.yaml").read_text(),
               {"1": REPO / "models" / "smollm2" / "1"})
    nothing = cli("build", "--model", "chat")  # (not 'run prepare-model', which changes nothing)
    assert nothing.returncode == 0 and "generates text" in nothing.stdout and "prepare-model" not in nothing.stdout
    shutil.rmtree(models / "chat")
    listed = cli("list").stdout
    assert "minilm_1_cpu-" in listed and "retired_1_cpu-" in listed
    assert cli("verify").returncode == 0

    shutil.rmtree(models / "retired")
    (engines / "artifacts" / ".orphan.onnx.999999999.building").write_bytes(b"left by a crashed build")
    assert "would remove retired_1_" in cli("prune", "--dry-run").stdout
    pruned = cli("prune")
    assert pruned.returncode == 0 and "removed retired_1_" in pruned.stdout and "orphan" in pruned.stdout
    assert "retired" not in cli("list").stdout

    flip_a_byte(next((engines / "artifacts").glob("*.onnx")))
    bad = cli("verify")
    assert bad.returncode == 1 and "BAD" in bad.stdout and "checksum mismatch" in bad.stdout


def test_server_builds_into_an_empty_store_and_then_only_loads(start_server, tmp_path, versioned_models):
    engines = tmp_path / "fresh-engines"
    cold = start_server(versioned_models, engines_dir=engines)
    counters = cold.stats().worker.counters
    assert counters["worker.engines_built_at_start"] == counters["worker.engines_loaded"] == 3
    assert counters["worker.engine_build_ms"] > 0
    assert "built engine minilm_1_" in cold.log_text() and "infercache engines build" in cold.log_text()
    assert cold.stop() == 0

    warm = start_server(versioned_models, engines_dir=engines)
    counters = warm.stats().worker.counters
    assert counters["worker.engines_built_at_start"] == 0 and counters["worker.engines_loaded"] == 3
    with warm.client() as client:
        assert client.infer("minilm", "loaded, not built").outputs["embedding"].shape == (384,)


def test_tensorrt_execution_matches_onnxruntime(tmp_path):
    runtime = tensorrt_runtime()
    from server.engines.cuda import device_info

    gpu = device_info()
    if gpu is None:
        pytest.skip("TensorRT execution needs an NVIDIA GPU; this host has none (engines were built, not run)")
    if runtime.is_rtx and (gpu.major, gpu.minor) not in ((7, 5), (8, 0), (8, 6), (8, 9), (12, 0), (12, 1)):
        pytest.skip(f"TensorRT-RTX engines do not run on compute capability {gpu.major}.{gpu.minor} ({gpu.name})")
    store = EngineStore(tmp_path / "engines")
    _, engine = prepare(store, runtime, SPEC, "1", "fp32", load=True)
    encoder = TextEncoder(MODEL_VERSION_DIR / "tokenizer.json", 256)
    batch = pad_batch([encoder.encode(t) for t in ("how do i return an item", "card not arrived")], 12)
    got = engine.run(batch)["embedding"]
    want = OrtEngine(MODEL_VERSION_DIR / "model.onnx", threads=1).run(batch)["embedding"]
    assert np.min(np.sum(got * want, axis=1)) > 0.999
    assert artifact_key(runtime, SPEC, "1", "fp32").device == gpu.tag


def test_onnxruntime_runs_a_batch_beside_another_on_its_shared_threads():
    """A lone batch runs on all the engine's threads; one that starts while another runs, on the second
    session's share of them. Both give the same embeddings."""
    import threading

    engine = OrtEngine(MODEL_VERSION_DIR / "model.onnx", threads=2, shared_threads=1)
    encoder = TextEncoder(MODEL_VERSION_DIR / "tokenizer.json", 256)
    batch = pad_batch([encoder.encode("where is my card"), encoder.encode("how do I top up by card")], 10)
    alone = engine.run(batch)["embedding"]
    assert engine.counters() == {"runs_alone": 1, "runs_shared": 0}
    started, release = threading.Event(), threading.Event()
    session = engine.session

    class Held:  # the lone batch's session, held inside its run until the second batch has run
        def run(self, names, feeds):
            started.set()
            release.wait(30)
            return session.run(names, feeds)

    engine.session = Held()
    first = threading.Thread(target=engine.run, args=(batch,))
    first.start()
    assert started.wait(30)
    beside = engine.run(batch)["embedding"]
    release.set()
    first.join(30)
    assert engine.counters() == {"runs_alone": 2, "runs_shared": 1}
    np.testing.assert_allclose(beside, alone, atol=1e-5)
    assert OrtEngine(MODEL_VERSION_DIR / "model.onnx", threads=1).counters() == {}  # one session: nothing to count
    wider = OrtEngine(MODEL_VERSION_DIR / "model.onnx", threads=4, shared_threads=2)
    assert len(wider.shared) == wider.slots  # a pool of 2 threads each: one session per slot, none split


_STORE_USER = """
import fcntl, logging, subprocess, sys, time
from pathlib import Path
from cachestore.engine_store import ArtifactKey, EngineStore

root, source, marks = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
key = ArtifactKey(model="m", version="1", device="cpu", runtime="test", runtime_version="1", precision="fp32",
                  profiles=((1, 1, 1, 1, 1, 1),), suffix=".bin")
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
store = EngineStore(root)
lock = store.locks / f"{key.name}.lock"
PROBE = "import fcntl, sys; fcntl.lockf(open(sys.argv[1], 'a+'), fcntl.LOCK_EX | fcntl.LOCK_NB)"

def build(out):
    (marks / "building").touch()
    while not (marks / "go").exists():
        time.sleep(0.02)
    out.write_bytes(b"artifact")
    return {}

def load(path):  # another process tries the lock: free while this one loads?
    probe = subprocess.run([sys.executable, "-c", PROBE, str(lock)], capture_output=True)
    return "lock free" if probe.returncode == 0 else "lock held"

loaded, held = store.get_or_build(key, source, build, load=load)
print("built" if loaded.built else "loaded", held, flush=True)
"""


def test_processes_that_waited_for_a_build_load_outside_the_lock(tmp_path):
    """Workers that found another one building wait for it, then load side by side: none loads while
    holding the lock (four workers on one GPU loaded one after another)."""
    source, marks = tmp_path / "model.onnx", tmp_path / "marks"
    source.write_bytes(b"source")
    marks.mkdir()
    command = [sys.executable, "-c", _STORE_USER, str(tmp_path / "engines"), str(source), str(marks)]
    builder = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (marks / "building").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    waiters = [subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for _ in range(2)]
    # both are waiting for the lock before the build may finish
    waiting = "another process is building it"
    logs = [""] * len(waiters)
    for i, waiter in enumerate(waiters):
        while waiting not in logs[i] and time.monotonic() < deadline:
            logs[i] += waiter.stdout.readline()
    assert all(waiting in log for log in logs), logs
    (marks / "go").touch()
    outputs = [p.communicate(timeout=60)[0] for p in (builder, *waiters)]
    assert [p.returncode for p in (builder, *waiters)] == [0, 0, 0], outputs
    assert outputs[0].strip().endswith("built lock free"), outputs[0]
    assert all(out.strip().endswith("loaded lock free") for out in outputs[1:]), outputs
