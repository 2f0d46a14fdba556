"""The container images' build steps (deploy/docker/build.sh), run for real on this host.

Container registries are unreachable here, so `docker build` never runs; the Dockerfiles only order the
stages of build.sh, and this module runs the same stages in the same order as Dockerfile.cpu:

    stage 1 (build):   build.sh stubs; build.sh export OUT/models; build.sh wheels OUT/wheels
    stage 2 (runtime): build.sh runtime PREFIX OUT/models ENGINES (with the serving config)

on a copy of the source made from Dockerfile.cpu's own COPY lines (without the generated gRPC stubs, as
in a clean clone), with this interpreter (the repository's .venv: it has the build and prepare extras).
Then it checks what the image would hold: a virtualenv without torch, the gRPC stubs installed, the L3
artifact prebuilt, and a server started from that virtualenv that answers Infer and built no engine.

Timings on the 2-core CI-class machine, pip's cache warm: stubs 0.2 s, export 7-8 s, wheels 18-20 s,
runtime 30-33 s (pip install about 24 s of it, engines build under 1 s), server to ready 1.4-1.8 s; the
module 59-69 s over three runs. hnswlib ships only a source distribution: compiled without pip's cache it
takes about 45 s more (pip keeps the wheel it built, so only the first run pays).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml

from infercache.client import Client
from harness.servers import REPO, free_port
from tests.helpers import unique, wait_cached

DOCKER = REPO / "deploy" / "docker"
BUILD_SH = DOCKER / "build.sh"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "cuda": DOCKER / "Dockerfile.cuda"}
IMAGE_CONFIG = DOCKER / "config.yaml"
MODEL = "minilm"
NOT_SERVING = ("torch", "sentence-transformers", "transformers", "grpcio-tools", "onnx")  # build-only packages


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without INFERCACHE_* (the server reads them all as settings)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("INFERCACHE_") and k != "PYTHONPATH"}
    env.update(extra)
    return env


def build_sh(*args: str, script: Path = BUILD_SH, cwd: Path, timeout: float = 600,
             **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], check=False, cwd=cwd,
                          env=clean_env(**{"PYTHON": sys.executable, **env}), capture_output=True, text=True,
                          timeout=timeout)


def stage_one(dockerfile: Path) -> list[str]:
    """The instructions of the Dockerfile's first stage, continuation lines joined."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            stages.append([])
        elif stages and line and not line.startswith("#"):
            stages[-1].append(line)
    return stages[0]


def copy_build_context(dockerfile: Path, dest_root: Path) -> list[str]:
    """What stage 1's `COPY <path...> /src/...` lines copy, into dest_root (standing for /src), minus
    caches and the generated stubs (a clean clone has none); returns the copied paths."""
    copied = []
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "*_pb2.py", "*_pb2_grpc.py", "*_pb2.pyi")
    for line in stage_one(dockerfile):
        if not line.startswith("COPY "):
            continue
        parts = [p for p in line.split()[1:] if not p.startswith("--")]
        sources, dest = parts[:-1], parts[-1]
        assert dest.startswith("/src/"), f"{dockerfile.name}: stage 1 copies into /src only: {line}"
        target = dest_root / dest[len("/src/"):]
        for source in sources:
            path = REPO / source
            to = target / path.name if dest.endswith("/") else target
            to.parent.mkdir(parents=True, exist_ok=True)
            if path.is_dir():
                shutil.copytree(path, to, ignore=ignore)
            else:
                shutil.copy2(path, to)
            copied.append(source)
    return copied


def server_settings() -> set[str]:
    from server.config import ServerSection

    return {f.name for f in dataclasses.fields(ServerSection)}


@dataclasses.dataclass
class Image:
    root: Path
    src: Path
    models: Path
    wheels: Path
    prefix: Path
    engines: Path
    config: Path            # deploy/docker/config.yaml with this host's paths and free ports
    settings: dict
    outputs: dict[str, str]
    timings: dict[str, float]

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"


def serving_config(root: Path, models: Path, engines: Path) -> tuple[Path, dict]:
    """The image's config.yaml with paths under root, free ports and one frontend (2-core host)."""
    settings = yaml.safe_load(IMAGE_CONFIG.read_text())
    server = settings["server"]
    server.update(models_dir=str(models), port=free_port(), frontends=1)
    if "metrics_port" in server:
        if {"metrics_port", "metrics_host"} <= server_settings():
            server["metrics_port"] = free_port()
            server["metrics_host"] = "127.0.0.1"
        else:  # added to server/config.py by a change in progress
            warnings.warn("server.metrics_port/metrics_host are not settings of server/config.py yet: "
                          "left out of the test's config")
            server.pop("metrics_port", None)
            server.pop("metrics_host", None)
    settings["cache"]["dir"] = str(root / "cache")
    settings["engines"]["dir"] = str(engines)
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(settings))
    return path, settings


@pytest.fixture(scope="module")
def image(tmp_path_factory) -> Image:
    """Runs every stage once for the module, like `docker build -f deploy/docker/Dockerfile.cpu`."""
    root = tmp_path_factory.mktemp("image")
    src = root / "src"
    copy_build_context(DOCKERFILES["cpu"], src)
    assert not list((src / "infercache" / "v1").glob("*_pb2*.py")), "the copy must start without stubs"
    script = src / "deploy" / "docker" / "build.sh"
    models, wheels = root / "out" / "models", root / "out" / "wheels"
    prefix, engines = root / "opt" / "venv", root / "opt" / "engines"
    config, settings = serving_config(root, models, engines)
    outputs: dict[str, str] = {}
    timings: dict[str, float] = {}

    def stage(name: str, *args: str, **env: str) -> None:
        started = time.monotonic()
        done = build_sh(name, *args, script=script, cwd=root, **env)
        timings[name] = time.monotonic() - started
        outputs[name] = done.stdout + done.stderr
        noise = "WARNING: Location 'file:"  # this host's pip config names local indexes lacking some packages
        stderr = "\n".join(line for line in done.stderr.splitlines() if not line.startswith(noise))
        print(f"\n---- build.sh {name} ({timings[name]:.1f} s, exit {done.returncode})\n{done.stdout}{stderr[-3000:]}")
        assert done.returncode == 0, f"build.sh {name} failed:\n{outputs[name][-6000:]}"

    # Dockerfile.cpu stage 1
    stage("stubs")
    stage("export", str(models))
    stage("wheels", str(wheels))
    # Dockerfile.cpu stage 2 (the source as a read-only bind mount there; here it is only read too)
    stage("runtime", str(prefix), str(models), str(engines), WHEELS_DIR=str(wheels), SERVE_CONFIG=str(config))
    yield Image(root, src, models, wheels, prefix, engines, config, settings, outputs, timings)
    total = sum(timings.values())
    print("\nbuild.sh stages: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()) + f"; total {total:.1f} s")
    for bulky in (prefix, wheels, models, engines):  # ~700 MB a run; the logs and configs stay for a look
        shutil.rmtree(bulky, ignore_errors=True)


# ---- the script on its own -------------------------------------------------------------------------------


def test_bad_arguments_are_refused_with_usage(tmp_path):
    none = build_sh(cwd=tmp_path)
    assert none.returncode == 2 and "no stage given" in none.stderr and "build.sh runtime PREFIX" in none.stderr
    unknown = build_sh("deploy", cwd=tmp_path)
    assert unknown.returncode == 2 and "unknown stage 'deploy'" in unknown.stderr
    short = build_sh("runtime", "prefix", "models", cwd=tmp_path)
    assert short.returncode == 2 and "'runtime' takes 3 argument(s): PREFIX MODELS_DIR ENGINES_DIR (got 2)" in short.stderr
    assert build_sh("export", cwd=tmp_path).returncode == 2

    missing = build_sh("runtime", "venv", "no-models", "engines", cwd=tmp_path)
    assert missing.returncode == 1 and f"MODELS_DIR {tmp_path}/no-models is not a folder" in missing.stderr
    (tmp_path / "empty-models").mkdir()
    empty = build_sh("runtime", "venv", "empty-models", "engines", cwd=tmp_path)
    assert empty.returncode == 1 and "holds no model" in empty.stderr
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").write_text("")
    used = build_sh("runtime", "used", "empty-models", "engines", cwd=tmp_path)
    assert used.returncode == 1 and "exists and is not empty" in used.stderr
    assert not (tmp_path / "venv").exists(), "nothing is created before the arguments are checked"


def test_stages_that_need_generated_files_say_how_to_make_them(tmp_path):
    copy_build_context(DOCKERFILES["cpu"], tmp_path / "src")
    script = tmp_path / "src" / "deploy" / "docker" / "build.sh"
    (tmp_path / "models" / MODEL).mkdir(parents=True)
    (tmp_path / "models" / MODEL / "config.yaml").write_text("task: embedding\n")
    for stage, args in (("runtime", ("venv", "models", "engines")), ("wheels", ("wheels",))):
        done = build_sh(stage, *args, script=script, cwd=tmp_path)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "gRPC stubs missing" in done.stderr and "build.sh stubs" in done.stderr, done.stderr
    assert not (tmp_path / "venv").exists()


def test_dockerfiles_run_the_script_with_the_paths_of_the_image_config():
    """The Dockerfiles are not built here: what they say must agree with config.yaml and build.sh."""
    config = yaml.safe_load(IMAGE_CONFIG.read_text())
    server, cache, engines = config["server"], config["cache"], config["engines"]
    assert server["metrics_port"] == 9090 and server["metrics_host"] == "0.0.0.0"
    assert engines["runtime"] == "auto"
    runtime_call = (f"build.sh runtime /opt/infercache/venv {server['models_dir']} {engines['dir']}")
    copies = {}
    for kind, path in DOCKERFILES.items():
        text = re.sub(r"\\\n", " ", path.read_text())
        assert " ".join(runtime_call.split()) in " ".join(text.split()), f"{path.name}: {runtime_call}"
        for stage in ("stubs", "export", "wheels"):
            assert f"build.sh {stage}" in text, f"{path.name} does not run build.sh {stage}"
        assert "COPY deploy/docker/config.yaml /etc/infercache/config.yaml" in text
        assert f"COPY --from=build /out/models {server['models_dir']}" in text
        assert "INFERCACHE_CONFIG=/etc/infercache/config.yaml" in text and "SERVE_CONFIG=/etc/infercache/config.yaml" in text
        assert "USER 10001:10001" in text
        assert f'VOLUME ["{cache["dir"]}", "/tmp"]' in text
        assert f"EXPOSE {server['port']} {server['metrics_port']}" in text
        assert 'ENTRYPOINT ["infercache", "serve"]' in text
        copies[kind] = [line for line in stage_one(path) if line.startswith("COPY ")]
    assert copies["cpu"] == copies["cuda"], "both images build from the same source files"
    cpu, cuda = DOCKERFILES["cpu"].read_text(), DOCKERFILES["cuda"].read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in cpu and "EXTRAS=" not in cpu
    assert "ARG CUDA_IMAGE=nvidia/cuda:" in cuda and "EXTRAS=cuda" in cuda


def test_image_config_loads_with_the_server_loader(tmp_path):
    from server import config as config_mod

    try:
        loaded = config_mod.load(str(IMAGE_CONFIG), {}, {})
    except config_mod.ConfigError as exc:
        if "metrics_" in str(exc) and not {"metrics_port", "metrics_host"} <= server_settings():
            pytest.xfail(f"server.metrics_* not in server/config.py yet: {exc}")
        raise
    assert loaded.server.models_dir == "/opt/infercache/models" and loaded.engines.dir == "/opt/infercache/engines"
    assert loaded.cache.dir == "/var/cache/infercache" and loaded.server.host == "127.0.0.1"


# ---- what the stages produced ----------------------------------------------------------------------------


def test_build_stage_generates_stubs_and_exports_the_default_model(image):
    prepared_model = REPO / "models" / MODEL / "1" / "model.onnx"
    if not prepared_model.is_file():
        pytest.fail("default model missing: run `make model` (make test does it)")
    stubs = sorted(p.name for p in (image.src / "infercache" / "v1").glob("*_pb2*.py"))
    assert stubs == ["infercache_pb2.py", "infercache_pb2_grpc.py", "worker_pb2.py", "worker_pb2_grpc.py",
                     "writer_pb2.py", "writer_pb2_grpc.py"]
    assert sorted(p.name for p in (image.src / "infercache" / "kserve").glob("*_pb2*.py")) == [
        "grpc_service_pb2.py", "grpc_service_pb2_grpc.py"]
    version = image.models / MODEL / "1"
    assert (image.models / MODEL / "config.yaml").read_text() == (REPO / "models" / MODEL / "config.yaml").read_text()
    for name in ("model.onnx", "tokenizer.json", "torch.json", "torch.safetensors"):
        assert (version / name).is_file(), name
    # The exported graph embeds like the repository's prepared one (`make model`, the same export).
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    encoded = tokenizer.encode_batch(["How do I return an item?", "Where is my card?"])
    width = max(len(e.ids) for e in encoded)
    ids = np.array([e.ids + [0] * (width - len(e.ids)) for e in encoded], dtype=np.int64)
    mask = np.array([[1] * len(e.ids) + [0] * (width - len(e.ids)) for e in encoded], dtype=np.int64)

    def embed(path: Path) -> np.ndarray:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return session.run(None, {"input_ids": ids, "attention_mask": mask})[0]

    ours, prepared = embed(version / "model.onnx"), embed(prepared_model)
    assert ours.shape == (2, 384)
    assert np.min(np.sum(ours * prepared, axis=1)) > 0.99999
    wheels = {p.name.split("-")[0].lower() for p in image.wheels.glob("*.whl")}
    assert {"infercache", "hnswlib", "onnxruntime", "grpcio"} <= wheels and "torch" not in wheels


def test_runtime_venv_has_the_serving_dependencies_and_no_torch(image):
    no_torch = subprocess.run([str(image.python), "-c", "import torch"], check=False, cwd="/", env=clean_env(),
                              capture_output=True, text=True, timeout=60)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    frozen = subprocess.run([str(image.python), "-m", "pip", "list", "--format=freeze"], check=True, env=clean_env(),
                            capture_output=True, text=True, timeout=120).stdout
    installed = {line.split("==")[0].lower().replace("_", "-") for line in frozen.splitlines()}
    assert {"infercache", "onnxruntime", "grpcio", "hnswlib", "lmdb", "tokenizers"} <= installed
    assert not installed & set(NOT_SERVING), installed & set(NOT_SERVING)
    # Non-editable: the package and its generated stubs live in the venv, not in the source copy.
    where = subprocess.run(
        [str(image.python), "-c", ("import infercache.v1.infercache_pb2 as m, infercache.v1.worker_pb2_grpc as g; "
                                   "print(m.__file__); print(g.__file__)")],
        check=False, cwd="/", env=clean_env(), capture_output=True, text=True, timeout=60)
    assert where.returncode == 0, where.stderr
    for line in where.stdout.split():
        assert line.startswith(f"{image.prefix}/lib/") and "site-packages/infercache/v1/" in line, line
    summary = image.outputs["runtime"]
    assert "== infercache runtime ready" in summary and "torch       not importable" in summary
    assert "1 artifact(s)" in summary and "verified" in summary
    # The export stage refuses an interpreter without the prepare extra, saying so.
    refused = build_sh("export", str(image.root / "never"), script=image.src / "deploy/docker/build.sh",
                       cwd=image.root, PYTHON=str(image.python))
    assert refused.returncode == 1 and "install the prepare extra" in refused.stderr
    assert not (image.root / "never").exists()


def test_engine_store_holds_the_prebuilt_artifact(image):
    artifacts = image.engines / "artifacts"
    manifests = sorted(artifacts.glob("*.json"))
    assert len(manifests) == 1, sorted(p.name for p in artifacts.iterdir())
    manifest = json.loads(manifests[0].read_text())
    key = manifest["key"]
    assert (key["model"], key["version"], key["runtime"]) == (MODEL, "1", "onnxruntime"), key
    assert manifest["name"].startswith(f"{MODEL}_1_cpu-") and manifests[0].stem == manifest["name"]
    artifact = artifacts / manifest["artifact"]
    assert artifact.stat().st_size == manifest["size_bytes"]
    assert hashlib.sha256(artifact.read_bytes()).hexdigest() == manifest["sha256"]
    assert (image.engines / "locks").is_dir() and (image.engines / "timing").is_dir()
    assert not [p for p in artifacts.iterdir() if p.name.endswith(".building")]


def test_server_from_the_venv_starts_warm_and_answers(image):
    """`PREFIX/bin/infercache serve` with the image's config: the engine is loaded from the prebuilt
    store (no build at start), Infer answers, the worker runs the venv's ONNX Runtime."""
    (image.root / "cache").mkdir(exist_ok=True)  # a volume in the image: it exists before the server starts
    workdir = image.root / "serve"
    workdir.mkdir()
    log_path = workdir / "server.log"
    server = image.settings["server"]
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(image.prefix / "bin" / "infercache"), "serve", "--config", str(image.config)],
                                cwd=workdir, env=clean_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while "infercache: ready" not in log_path.read_text():
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log_path.read_text()}"
            assert time.monotonic() < deadline, f"not ready after 90 s:\n{log_path.read_text()}"
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        print(f"\nserver from the venv: ready after {ready_s:.1f} s")
        with Client(f"127.0.0.1:{server['port']}") as client:
            text = unique("How do I return an item?")
            first = client.infer(MODEL, text)
            assert first.source == "MISS" and first.outputs["embedding"].shape == (384,)
            assert abs(np.linalg.norm(first.outputs["embedding"]) - 1) < 1e-5
            wait_cached(client, MODEL, text)
            assert client.infer(MODEL, text).source == "RESULT_EXACT"
            stats = client.stats()
            [info] = [m for m in client.models() if m.name == MODEL]
        log_text = log_path.read_text()
        built = sum(int(w.counters.get("worker.engines_built_at_start", 0)) for w in stats.workers)
        loaded = sum(int(w.counters.get("worker.engines_loaded", 0)) for w in stats.workers)
        assert built == 0 and loaded >= 1, (built, loaded, log_text)
        assert "built engine" not in log_text, log_text
        name = json.loads(next((image.engines / "artifacts").glob("*.json")).read_text())["name"]
        assert f"loaded {MODEL} version 1 ({name})" in log_text, log_text
        assert {e.runtime for e in info.engines} == {"onnxruntime"}
        maps = Path(f"/proc/{stats.workers[0].pid}/maps").read_text()
        assert f"{image.prefix}/lib/" in maps and "onnxruntime" in maps, "the worker runs the venv's packages"
        if "metrics_port" in server:
            with urllib.request.urlopen(f"http://127.0.0.1:{server['metrics_port']}/metrics", timeout=10) as reply:
                assert reply.status == 200 and reply.read()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, log_path.read_text()
