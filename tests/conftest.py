"""Shared fixtures: a model repository for tests and real server processes on free ports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.servers import REPO, ServerProcess, link_model, reap

# The fast tier (`make test-fast`: `-m "not processes"`) is every test that starts no process: one is
# marked `processes` where it uses a fixture that starts a server or trains a head, or where its module
# starts one itself (a server, Redis, Prometheus, a peer, any subprocess).
PROCESS_FIXTURES = frozenset({"server", "start_server", "faq_models"})
STARTS_PROCESSES = re.compile(r"\b(ServerProcess|RedisProcess|RedisCluster|PrometheusServer|PeerServer|TritonPeer)\(|"
                              r"\bsubprocess\.(run|Popen|call|check_call|check_output)\(|multiprocessing|run_children")


def pytest_collection_modifyitems(config, items):
    starts: dict[Path, bool] = {}
    for item in items:
        module = item.path
        if module not in starts:
            starts[module] = bool(STARTS_PROCESSES.search(module.read_text()))
        if starts[module] or PROCESS_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.processes)


MODEL_VERSION_DIR = REPO / "models" / "minilm" / "1"
FAQ = REPO / "examples" / "faq.csv"
MINILM_CONFIG = (REPO / "models" / "minilm" / "config.yaml").read_text()
SHORT_TTL_S = 2

SHORT_CONFIG = f"""
task: embedding
serving_version: "1"
input: {{max_text_chars: 200, max_tokens: 64}}
outputs: [embedding]
batching: {{buckets: [16, 64], max_batch_size: 8, max_queue_delay_ms: 2}}
cache: {{ttl_s: {SHORT_TTL_S}}}
"""


def _with_minilm(root: Path) -> Path:
    if not (MODEL_VERSION_DIR / "model.onnx").is_file():
        pytest.fail("default model missing: run `make model` (make test does it)")
    link_model(root, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    return root


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """minilm (the shipped config) alone: each engine a worker loads is a second or so of its start."""
    return _with_minilm(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def versioned_models(tmp_path_factory) -> Path:
    """minilm and shortlived (same weights, 2 s TTL, two versions): a module whose tests need TTLs or model
    versions makes this its models_dir."""
    root = _with_minilm(tmp_path_factory.mktemp("versioned-models"))
    link_model(root, "shortlived", SHORT_CONFIG, {"1": MODEL_VERSION_DIR, "2": MODEL_VERSION_DIR})
    return root


@pytest.fixture(scope="session")
def faq_models(tmp_path_factory) -> Path:
    """minilm and faq (a head trained on examples/faq.csv by the CLI), and faq-short (its entries live 2 s)."""
    root = tmp_path_factory.mktemp("semantic-models")
    link_model(root, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    trained = subprocess.run(
        [sys.executable, "-m", "server", "train-head", str(FAQ), "--name", "faq", "--label-column", "intent",
         "--models-dir", str(root)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert trained.returncode == 0, trained.stdout + trained.stderr
    assert "accuracy" in trained.stdout and (root / "faq" / "1" / "labels.json").is_file()
    from server.tools.train_head import with_consensus

    calibrated = (root / "faq" / "config.yaml").read_text()
    assert "max_error: 0.01" in calibrated  # train-head writes the calibrated rule's settings
    # The tests of a few cached texts use the fixed consensus rule (the calibrated one answers only
    # once hundreds of outcomes bound its error: tests/test_calibrated.py).
    config = with_consensus(calibrated, "minilm")
    (root / "faq" / "config.yaml").write_text(config)
    link_model(root, "faq-short", config.replace("ttl_s: 604800", "ttl_s: 2"), {"1": root / "faq" / "1"})
    link_model(root, "faq-calibrated", calibrated, {"1": root / "faq" / "1"})
    return root


@pytest.fixture(scope="session")
def engines_dir(tmp_path_factory) -> Path:
    """One L3 store for the servers of the whole session: each engine is built once."""
    return tmp_path_factory.mktemp("engines")


@pytest.fixture
def start_server(tmp_path, models_dir, engines_dir):
    """Factory for servers that a test owns (and may crash); all are stopped afterwards."""
    started: list[ServerProcess] = []

    def start(models: Path | None = None, **kwargs) -> ServerProcess:
        workdir = tmp_path / f"server{len(started)}"
        workdir.mkdir()
        kwargs.setdefault("engines_dir", engines_dir)
        server = ServerProcess(workdir, models or models_dir, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:  # (a test may have crashed one: their exit codes are not checked)
        server.stop_later()


@pytest.fixture(scope="module")
def server(tmp_path_factory, models_dir, engines_dir):
    """One server shared by a test module (2 frontends). Tests use unique texts to stay independent; each
    such server must exit 0 (checked once every server has drained, at the end of the session)."""
    srv = ServerProcess(tmp_path_factory.mktemp("server"), models_dir, engines_dir=engines_dir)
    yield srv
    srv.stop_later()
    SHARED.append(srv)


SHARED: list[ServerProcess] = []  # the module servers, whose exit codes reap_servers checks


@pytest.fixture(scope="session", autouse=True)
def reap_servers():
    """Servers are stopped by their fixtures without waiting (the next tests start while they drain); here
    every one of them is waited for, and a shared server that did not exit 0 fails the session."""
    yield
    codes = reap()
    failed = [server for server in SHARED if codes.get(server) != 0]
    assert not failed, "\n\n".join(f"exit {codes.get(s)}:\n{s.log_text()[-4000:]}" for s in failed)


@pytest.fixture(scope="session")
def reference_encoder():
    """sentence-transformers' own encoder for the default model (the parity reference)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    from server.tools.export_model import default_encoder_dir

    return SentenceTransformer(str(default_encoder_dir()), device="cpu")


@pytest.fixture
def small_disk(tmp_path):
    """A 12 MiB tmpfs (needs root with CAP_SYS_ADMIN, as CI has, or a mount namespace: `unshare -m make
    test`; skipped elsewhere with the reason)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12m", "tmpfs", str(mount)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.strip() or made.returncode}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)
