"""`infercache train-head`: a classification head on an encoder of the model repository.

Reads a labelled CSV, embeds the (normalized) texts with the encoder's ONNX model, fits a softmax
regression in numpy, and writes a new model version: by default the head alone (head.json naming the
encoder version, head.npz with its weights), which the worker runs on the encoder's output, kept in the
feature tier; labels.json maps score columns to labels, and the encoder's tokenizer is copied (frontends
tokenize for the encoder with it), and label_calibration.json what the head is worth as the judge of a
generative model's semantic answers, measured by heads that never saw the rows they judge
(server/tools/judge_calibration.py, server/worker/semantic/label_calibration.py). With `whole_graph`, the format
before the feature tier instead: one ONNX graph of encoder + head (and, when the encoder has a torch
source, the same as torch weights).
Whole-graph versions need the `onnx` package (the prepare extra); serving never imports this module.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import fields
from pathlib import Path

import numpy as np

from server.engines.onnxruntime import OrtEngine
from server.shared.models import (HEAD_FILE, HEAD_WEIGHTS_FILE, LABELS_FILE, MODEL_FILE, TOKENIZER_FILE, TORCH_CONFIG_FILE,
                           TORCH_WEIGHTS_FILE, load_model)
from server.shared.match_policy import CalibratedPolicy, MatchPolicy
from server.tools.judge_calibration import FOLDS, calibrate
from server.tools.labelled_csv import read_labelled_csv
from server.shared.normalize import Normalizer
from server.shared.tokenization import TextEncoder, pad_batch
from server.worker.semantic.label_calibration import LABEL_CALIBRATION_FILE

class TrainError(ValueError):
    pass


def embed(engine: OrtEngine, encoder: TextEncoder, texts: list[str], progress, batch: int = 64) -> np.ndarray:
    ids = [encoder.encode(t) for t in texts]
    order = np.argsort([len(i) for i in ids])  # similar lengths together: little padding
    out = np.zeros((len(texts), 0), dtype=np.float32)
    started = time.monotonic()
    for n, start in enumerate(range(0, len(ids), batch)):
        chunk = [ids[i] for i in order[start:start + batch]]
        vectors = engine.run(pad_batch(chunk, max(map(len, chunk))))["embedding"]
        if out.shape[1] == 0:
            out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
        out[order[start:start + batch]] = vectors
        if n % 20 == 0 or start + batch >= len(ids):
            progress(f"  embedded {min(start + batch, len(ids))}/{len(ids)} ({time.monotonic() - started:.0f} s)")
    return out


def fit_softmax(x: np.ndarray, y: np.ndarray, classes: int, *, epochs: int, l2: float, lr: float = 0.05,
                seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Multinomial logistic regression, full-batch Adam. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    w = rng.normal(0, 0.01, (x.shape[1], classes)).astype(np.float32)
    b = np.zeros(classes, dtype=np.float32)
    onehot = np.eye(classes, dtype=np.float32)[y]
    m = [np.zeros_like(w), np.zeros_like(b)]
    v = [np.zeros_like(w), np.zeros_like(b)]
    for step in range(1, epochs + 1):
        logits = x @ w + b
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        grad = (p - onehot) / len(x)
        grads = [x.T @ grad + l2 * w, grad.sum(axis=0)]
        for i, (param, g) in enumerate(zip((w, b), grads)):
            m[i] = 0.9 * m[i] + 0.1 * g
            v[i] = 0.999 * v[i] + 0.001 * g * g
            param -= lr * (m[i] / (1 - 0.9 ** step)) / (np.sqrt(v[i] / (1 - 0.999 ** step)) + 1e-8)
    return w, b


def compose(encoder_onnx: Path, w: np.ndarray, b: np.ndarray, out: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    model = onnx.load(str(encoder_onnx))
    graph = model.graph
    graph.initializer.extend([numpy_helper.from_array(w, "head_weight"), numpy_helper.from_array(b, "head_bias")])
    graph.node.extend([
        helper.make_node("MatMul", ["embedding", "head_weight"], ["head_matmul"]),
        helper.make_node("Add", ["head_matmul", "head_bias"], ["head_logits"]),
        helper.make_node("Softmax", ["head_logits"], ["scores"], axis=-1),
    ])
    graph.output.append(helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", w.shape[1]]))
    onnx.checker.check_model(model)
    onnx.save(model, str(out))


def torch_source_with_head(encoder_dir: Path, out: Path, w: np.ndarray, b: np.ndarray, progress) -> None:
    """Writes the encoder's torch source plus the head into `out`; skipped (with a line) if there is none."""
    try:
        import torch
        from safetensors.torch import load_file

        from server.engines import torch_bert
    except ImportError as exc:  # torch comes with the prepare extra, like onnx
        progress(f"infercache: no torch source for the new version ({exc})")
        return
    if not (encoder_dir / TORCH_CONFIG_FILE).is_file():
        progress(f"infercache: {encoder_dir} has no torch source; the new version gets none (ONNX only)")
        return
    arch, tensors = torch_bert.with_head(torch_bert.read_architecture(encoder_dir),
                                         load_file(str(encoder_dir / TORCH_WEIGHTS_FILE)),
                                         torch.tensor(w, dtype=torch.float32), torch.tensor(b, dtype=torch.float32))
    torch_bert.write_torch_source(out, arch, tensors)


def with_consensus(config: str, embedder: str) -> str:
    """A config.yaml that train-head wrote (its `semantic:` section last) with that section choosing the
    fixed consensus rule at its defaults instead (the expert override)."""
    policy = MatchPolicy(embedder=embedder)
    return (config.split("semantic:")[0] + "semantic:\n  enabled: true\n"
            + "".join(f"  {f.name}: {getattr(policy, f.name)}\n" for f in fields(policy)))


def _config_text(encoder_name: str, encoder_config: str, semantic: bool) -> str:
    lines = [f"# Classification head on {encoder_name}, written by `infercache train-head`.", "task: classification"]
    for line in encoder_config.splitlines():
        if line.startswith(("task:", "outputs:", "#")):
            continue
        lines.append(line.split("#", 1)[0].rstrip())  # the encoder's comments describe the encoder
    lines.append("outputs: [scores]       # class probabilities; the label and its probability come in `classification`")
    if semantic:
        policy = CalibratedPolicy()
        lines += [
            "semantic:               # near-duplicate requests answered from the cache (see README, Semantic matching)",
            "  enabled: true",
            f"  embedder: {encoder_name}       # the model whose embedding output finds neighbours",
            f"  max_error: {policy.max_error}        # P(a semantic hit differs from the model's answer) to stay under",
            f"  coverage: {policy.coverage}          # farther from the cached neighbours' hull: a miss, unless the fit is proven",
            f"  k: {policy.k}                 # neighbours whose class scores are interpolated",
            f"  verify_fraction: {policy.verify_fraction}   # hits recomputed in the background (all while an entry is unproven)",
            "  # Expert override, a fixed consensus rule instead (setting min_similarity chooses it):",
            "  # " + ", ".join(f"{f.name}: {getattr(MatchPolicy(), f.name)}" for f in fields(MatchPolicy) if f.name != "embedder"),
        ]
    return "\n".join(lines) + "\n"


def train(csv_path: Path, *, text_column: str, label_column: str, models_dir: Path, encoder: str, name: str,
          version: str | None = None, epochs: int = 300, l2: float = 1e-4, limit: int | None = None,
          whole_graph: bool = False, progress=print) -> Path:
    encoder_spec = load_model(models_dir / encoder)
    encoder_dir = encoder_spec.version_dir(encoder_spec.serving_version)
    rows = read_labelled_csv(csv_path, text_column, label_column, limit)
    texts, labels = [t for t, _ in rows], [label for _, label in rows]
    normalize = Normalizer()
    texts = [normalize(t) for t in texts]  # the server runs the model on normalized text
    classes = sorted(set(labels))
    y = np.array([classes.index(label) for label in labels])
    progress(f"infercache: {len(texts)} rows, {len(classes)} labels; embedding with {encoder} ...")
    engine = OrtEngine(encoder_dir / MODEL_FILE)
    x = embed(engine, TextEncoder(encoder_dir / TOKENIZER_FILE, encoder_spec.max_tokens), texts, progress)

    def fit(x_fit: np.ndarray, y_fit: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return fit_softmax(x_fit, y_fit, len(classes), epochs=epochs, l2=l2)

    # Heads that never saw a row judge it: the accuracy on unseen rows, and the calibration of the head
    # as a judge of semantic answers (server/worker/semantic/label_calibration.py).
    calibration, held_out_accuracy = calibrate(x, y, len(classes), fit)
    w, b = fit(x, y)
    train_accuracy = float(((x @ w + b).argmax(axis=1) == y).mean())
    threshold = calibration.threshold(CalibratedPolicy().max_error)
    progress(f"infercache: accuracy {train_accuracy:.3f} on the training rows, {held_out_accuracy:.3f} held out "
             f"({FOLDS} folds); as a judge of semantic answers: temperature {calibration.temperature:.3f}, "
             f"{int(calibration.n.sum())} labelled pairs, "
             + (f"same-label probability >= {threshold:.3f} for max_error {CalibratedPolicy().max_error}"
                if threshold <= 1 else f"too few pairs for max_error {CalibratedPolicy().max_error}"))

    root = models_dir / name
    existing = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    version = version or str(max(existing, default=0) + 1)
    target = root / version
    if target.exists():
        raise TrainError(f"{target} exists; choose another --version")
    staging = root / f".{version}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    w, b = w.astype(np.float32), b.astype(np.float32)
    if whole_graph:
        compose(encoder_dir / MODEL_FILE, w, b, staging / MODEL_FILE)
        torch_source_with_head(encoder_dir, staging, w, b, progress)
    else:
        np.savez(staging / HEAD_WEIGHTS_FILE, weight=w, bias=b)
        (staging / HEAD_FILE).write_text(json.dumps(
            {"encoder": encoder, "encoder_version": encoder_spec.serving_version, "input": "embedding"}, indent=2))
    shutil.copy(encoder_dir / TOKENIZER_FILE, staging / TOKENIZER_FILE)
    (staging / LABELS_FILE).write_text(json.dumps(classes, indent=0))
    (staging / "training.json").write_text(json.dumps({
        "csv": str(csv_path), "rows": len(texts), "labels": len(classes), "encoder": f"{encoder}/{encoder_spec.serving_version}",
        "epochs": epochs, "l2": l2, "train_accuracy": train_accuracy, "held_out_accuracy": held_out_accuracy,
        "folds": FOLDS,
    }, indent=2))
    (staging / LABEL_CALIBRATION_FILE).write_text(json.dumps(calibration.to_json(), separators=(",", ":")))
    staging.rename(target)
    if not (root / "config.yaml").exists():
        config = _config_text(encoder, (models_dir / encoder / "config.yaml").read_text(), semantic=True)
        (root / "config.yaml").write_text(config.replace(f'serving_version: "{encoder_spec.serving_version}"',
                                                          f'serving_version: "{version}"'))
    progress(f"infercache: wrote {target} (serve it as model {name!r}, version {version})")
    return target
