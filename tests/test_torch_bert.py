"""The torch source of a model version (server/engines/torch_bert.py) against its ONNX graph.

CPU tests compare the fp32 module with ONNX Runtime on the exported minilm and on a head trained by
train-head; the CUDA test compares FP16 on the GPU (eager and replayed from a CUDA graph) with ONNX
Runtime fp32, and is skipped without a GPU.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from server.engines.onnxruntime import OrtEngine
from server.shared.tokenization import TextEncoder, pad_batch

try:
    import torch

    from server.engines import torch_bert
except ImportError as exc:  # torch comes with the prepare extra
    torch = torch_bert = None
    TORCH_MISSING = f"needs torch ({exc}); install the prepare extra"
else:
    TORCH_MISSING = ""

REPO = Path(__file__).resolve().parents[1]
MINILM = REPO / "models" / "minilm" / "1"
BANKING77 = REPO / "bench" / "data" / "banking77" / "train.csv"
FAQ = REPO / "examples" / "faq.csv"
MAX_TOKENS = 256  # models/minilm/config.yaml input.max_tokens

needs_torch = pytest.mark.skipif(torch is None, reason=TORCH_MISSING)
needs_cuda = pytest.mark.skipif(torch is None or not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (torch.cuda.is_available() is false)")

FIXED = [
    "How do I return an item?", "hi", "Where is my order?", "My card was charged twice for the same purchase.",
    "Can I change the PIN of my card at an ATM, or do I have to visit a branch?",
    "The exchange rate you applied to my transfer in euros looks wrong, please explain how it was calculated.",
    "ok", "What's the fee for a top-up by bank transfer?", "Why was my transfer declined?!",
    "I lost my phone and need to freeze my account right now before anyone uses it",
]


def _texts(count: int = 64) -> list[str]:
    """Varied lengths: every n-th Banking77 training text by length, or fixed sentences, plus long ones."""
    if BANKING77.is_file():
        with open(BANKING77, newline="") as f:
            rows = sorted({row["text"] for row in csv.DictReader(f)}, key=len)
        texts = [rows[i * (len(rows) - 1) // (count - 3)] for i in range(count - 2)]
    else:
        texts = [FIXED[i % len(FIXED)] + " " * (i // len(FIXED)) + "!" * (i // len(FIXED)) for i in range(count - 2)]
    return texts + [" ".join(FIXED[:5]), " ".join(FIXED * 8)]  # the last one is truncated at MAX_TOKENS


def _batches(encoder: TextEncoder, texts: list[str]) -> list[dict[str, np.ndarray]]:
    """Shuffled batches of 1..20 rows padded to their longest; the last one padded far past it."""
    ids = [encoder.encode(t) for t in texts]
    order = np.random.default_rng(7).permutation(len(ids))
    batches, start = [], 0
    for size in (1, 7, 16, 3, 20, 5):
        chunk = [ids[i] for i in order[start:start + size]]
        start += size
        batches.append(pad_batch(chunk, max(map(len, chunk))))
    chunk = [ids[i] for i in order[start:]]
    batches.append(pad_batch(chunk, MAX_TOKENS))  # far more padding than needed
    assert sum(len(b["input_ids"]) for b in batches) == len(ids)
    return batches


def _run(model, batch: dict[str, np.ndarray], device: str = "cpu") -> dict[str, np.ndarray]:
    with torch.inference_mode():
        outputs = model(torch.from_numpy(batch["input_ids"]).to(device),
                        torch.from_numpy(batch["attention_mask"]).to(device))
    return {name: t.float().cpu().numpy() for name, t in zip(model.output_names, outputs)}


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def _compare(version_dir: Path, *, device: str = "cpu", dtype=None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Per-row cosine of torch vs ONNX embeddings over all batches, and the max abs difference per output."""
    model = torch_bert.load_torch_source(version_dir, device=device, dtype=dtype or torch.float32)
    engine = OrtEngine(version_dir / "model.onnx")
    assert model.output_names == engine.output_names
    cosines, diffs = [], {name: 0.0 for name in model.output_names}
    for batch in _batches(TextEncoder(version_dir / "tokenizer.json", MAX_TOKENS), _texts()):
        ours, reference = _run(model, batch, device), engine.run(batch)
        cosines.append(_cosines(ours["embedding"], reference["embedding"]))
        for name in diffs:
            diffs[name] = max(diffs[name], float(np.abs(ours[name] - reference[name]).max()))
    return np.concatenate(cosines), diffs


@pytest.fixture(scope="module")
def minilm() -> Path:
    if not (MINILM / torch_bert.TORCH_CONFIG_FILE).is_file():
        pytest.fail(f"{MINILM} has no torch source: run "
                    "`.venv/bin/infercache prepare-model --models-dir models --force`")
    return MINILM


@pytest.fixture(scope="module")
def faq_head(tmp_path_factory, minilm) -> Path:
    """models/faq/1 trained by train-head on examples/faq.csv as one graph with minilm/1 (a link)."""
    from server.tools.train_head import train
    from harness.servers import link_model

    root = tmp_path_factory.mktemp("torch-models")
    link_model(root, "minilm", (REPO / "models" / "minilm" / "config.yaml").read_text(), {"1": minilm})
    return train(FAQ, text_column="text", label_column="intent", models_dir=root, encoder="minilm", name="faq",
                 whole_graph=True, progress=lambda line: None)


@needs_torch
def test_fp32_on_cpu_matches_onnx_runtime(minilm):
    cosines, diffs = _compare(minilm)
    print(f"\nminilm fp32 CPU vs ONNX Runtime: {len(cosines)} rows, min cosine {cosines.min():.7f}, "
          f"max abs diff {diffs['embedding']:.2e}")
    assert len(cosines) == 64 and cosines.min() >= 0.999


@needs_torch
def test_fully_padded_rows_are_finite_and_leave_real_rows_alone(minilm):
    model = torch_bert.load_torch_source(minilm, device="cpu", dtype=torch.float32)
    encoder = TextEncoder(minilm / "tokenizer.json", MAX_TOKENS)
    real = pad_batch([encoder.encode(t) for t in FIXED[:3]], 24)
    padded = {name: np.concatenate([a, np.zeros((2, 24), dtype=a.dtype)]) for name, a in real.items()}
    alone, together = _run(model, real)["embedding"], _run(model, padded)["embedding"]
    assert np.isfinite(together).all()
    np.testing.assert_allclose(together[:3], alone, atol=1e-5)
    as_int32 = {name: a.astype(np.int32) for name, a in padded.items()}  # the runtime may feed int32
    np.testing.assert_allclose(_run(model, as_int32)["embedding"], together, atol=1e-6)


@needs_torch
def test_head_version_gets_a_torch_source_matching_its_onnx_scores(faq_head):
    config = json.loads((faq_head / torch_bert.TORCH_CONFIG_FILE).read_text())
    labels = json.loads((faq_head / "labels.json").read_text())
    assert config["head_classes"] == len(labels) and config["format"] == 1 and config["pooling"] == "mean"
    cosines, diffs = _compare(faq_head)
    print(f"\nfaq head fp32 CPU vs ONNX Runtime: min cosine {cosines.min():.7f}, "
          f"max abs diff scores {diffs['scores']:.2e}")
    assert cosines.min() >= 0.999 and diffs["scores"] < 1e-3


@needs_torch
def test_train_head_without_an_encoder_torch_source_writes_none(tmp_path, minilm):
    from server.tools.train_head import train
    from harness.servers import link_model

    onnx_only = tmp_path / "onnx-only"
    onnx_only.mkdir()
    for name in ("model.onnx", "tokenizer.json"):
        (onnx_only / name).symlink_to(minilm / name)
    config = (REPO / "models" / "minilm" / "config.yaml").read_text()
    link_model(tmp_path / "models", "minilm", config, {"1": onnx_only})
    lines: list[str] = []
    target = train(FAQ, text_column="text", label_column="intent", models_dir=tmp_path / "models", encoder="minilm",
                   name="faq", epochs=20, whole_graph=True, progress=lines.append)
    assert (target / "model.onnx").is_file() and not (target / torch_bert.TORCH_CONFIG_FILE).exists()
    assert any("no torch source" in line for line in lines)


@needs_torch
def test_write_load_round_trip_and_checks(tmp_path):
    arch = torch_bert.BertArchitecture(vocab_size=50, hidden=32, layers=2, heads=4, intermediate=64,
                                       max_position=16, type_vocab=2, layer_norm_eps=1e-12)
    model = torch_bert.random_bert(arch, device="cpu", dtype=torch.float32, seed=1)
    arch, tensors = torch_bert.with_head(arch, model.state_dict(), torch.randn(32, 3), torch.randn(3))
    torch_bert.write_torch_source(tmp_path, arch, tensors)
    assert sorted(p.name for p in tmp_path.iterdir()) == [torch_bert.TORCH_CONFIG_FILE, torch_bert.TORCH_WEIGHTS_FILE]
    loaded = torch_bert.load_torch_source(tmp_path, device="cpu", dtype=torch.float32)
    assert loaded.arch == arch and loaded.output_names == ("embedding", "scores")
    ids = torch.randint(1, 50, (2, 16))
    embedding, scores = loaded(ids, torch.ones_like(ids))
    assert embedding.shape == (2, 32) and torch.allclose(scores.sum(dim=1), torch.ones(2))
    assert torch.allclose(model(ids, torch.ones_like(ids))[0], embedding, atol=1e-6)
    assert torch_bert.BertArchitecture.from_json(json.loads(json.dumps(arch.to_json()))) == arch
    with pytest.raises(ValueError, match="do not match"):
        torch_bert.write_torch_source(tmp_path, arch, {k: v for k, v in tensors.items() if k != "head.bias"})


@needs_cuda
def test_fp16_on_cuda_matches_onnx_runtime_fp32_eager_and_in_a_cuda_graph(minilm):
    cosines, _ = _compare(minilm, device="cuda", dtype=torch.float16)
    print(f"\nminilm fp16 CUDA vs ONNX Runtime fp32: min cosine {cosines.min():.7f}")
    assert cosines.min() >= 0.999

    model = torch_bert.load_torch_source(minilm, device="cuda", dtype=torch.float16)
    encoder = TextEncoder(minilm / "tokenizer.json", MAX_TOKENS)
    batch = pad_batch([encoder.encode(t) for t in FIXED[:6]] + [[], []], 32)  # two fully padded rows
    ids, mask = (torch.from_numpy(batch[n]).cuda() for n in ("input_ids", "attention_mask"))
    static_ids, static_mask = torch.zeros_like(ids), torch.zeros_like(mask)
    with torch.inference_mode():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up outside the graph (kernel selection, allocator)
                model(static_ids, static_mask)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            (static_out,) = model(static_ids, static_mask)
        static_ids.copy_(ids)
        static_mask.copy_(mask)
        graph.replay()
        replayed = static_out.cpu().numpy()
    eager = _run(model, batch, "cuda")["embedding"]
    assert np.isfinite(replayed).all() and np.isfinite(eager).all()
    np.testing.assert_allclose(replayed, eager, atol=2e-3)
    reference = OrtEngine(minilm / "model.onnx").run(batch)["embedding"]
    assert _cosines(replayed[:6], reference[:6]).min() >= 0.999
