"""A BERT sentence encoder in plain torch, and the "torch source" format of a model version.

The torch-cuda runtime serves encoder models from this module (FP16, CUDA graphs) instead of the ONNX
graph; `infercache prepare-model` and `train-head` write its weights beside model.onnx, from the same
checkpoint. The numerics follow Hugging Face BertModel (post-LayerNorm, exact erf GELU), then masked mean
pooling and L2 normalization, then the optional classification head: the same outputs as the ONNX graph.
No `transformers` import; torch is imported at module level, so only the GPU runtime and tools import
this module (lazily).

A version directory's torch source is `torch.json` (the architecture plus format, pooling, normalize)
and `torch.safetensors` (fp32 state dict in this module's naming: fused QKV, "head.weight" [dim, classes]).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from server.shared.models import TORCH_CONFIG_FILE, TORCH_WEIGHTS_FILE

FORMAT = 1
_SOURCE = {"format": FORMAT, "pooling": "mean", "normalize": True}  # what the module computes


@dataclass(frozen=True)
class BertArchitecture:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    intermediate: int
    max_position: int
    type_vocab: int
    layer_norm_eps: float
    head_classes: int = 0  # 0: embedding only; else a softmax head with this many classes

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> BertArchitecture:
        """From a to_json() dict; other keys (torch.json's format fields) are ignored."""
        missing = [f.name for f in fields(cls) if f.name not in data and f.name != "head_classes"]
        if missing:
            raise ValueError(f"architecture lacks {', '.join(missing)}")
        return cls(**{f.name: (float if f.type == "float" else int)(data[f.name])
                      for f in fields(cls) if f.name in data})


# BERT-base with the uncased vocabulary: the size benchmarks use with random_bert().
BERT_BASE = BertArchitecture(vocab_size=30522, hidden=768, layers=12, heads=12, intermediate=3072,
                             max_position=512, type_vocab=2, layer_norm_eps=1e-12)


def architecture_from_hf_config(config: Mapping[str, Any]) -> BertArchitecture:
    """From a Hugging Face BertConfig dict (config.json); refuses what this module does not compute."""
    if config.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only exact 'gelu')")
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type {config['position_embedding_type']!r} is not supported")
    return BertArchitecture(
        vocab_size=int(config["vocab_size"]), hidden=int(config["hidden_size"]),
        layers=int(config["num_hidden_layers"]), heads=int(config["num_attention_heads"]),
        intermediate=int(config["intermediate_size"]), max_position=int(config["max_position_embeddings"]),
        type_vocab=int(config.get("type_vocab_size", 2)), layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
    )


class _Layer(nn.Module):
    def __init__(self, arch: BertArchitecture) -> None:
        super().__init__()
        self.heads = arch.heads
        self.qkv = nn.Linear(arch.hidden, 3 * arch.hidden)
        self.attention_out = nn.Linear(arch.hidden, arch.hidden)
        self.attention_norm = nn.LayerNorm(arch.hidden, eps=arch.layer_norm_eps)
        self.intermediate = nn.Linear(arch.hidden, arch.intermediate)
        self.output = nn.Linear(arch.intermediate, arch.hidden)
        self.output_norm = nn.LayerNorm(arch.hidden, eps=arch.layer_norm_eps)

    def forward(self, x: torch.Tensor, additive_mask: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, seq, 3, self.heads, hidden // self.heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask)
        x = self.attention_norm(x + self.attention_out(context.transpose(1, 2).reshape(batch, seq, hidden)))
        return self.output_norm(x + self.output(F.gelu(self.intermediate(x))))


class _Head(nn.Module):
    """logits = embedding @ weight + bias: weight is [dim, classes], as train-head fits it."""

    def __init__(self, dim: int, classes: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, classes))
        self.bias = nn.Parameter(torch.empty(classes))


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding table left uninitialized (its weights are assigned or initialized after): nn.Embedding's
    own normal_ init, on the meta device, imports torch._dynamo (5 s of a GPU worker's start)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


class TorchBert(nn.Module):
    """forward(input_ids, attention_mask) -> outputs in the order of `output_names`.

    input_ids / attention_mask: [batch, seq] int64 or int32, right-padded. The encoder runs in the
    module's dtype; pooling, normalization and the head run in fp32, so outputs are fp32. No host sync
    and no branching on values: capturable in a CUDA graph (one graph per input shape).
    """

    def __init__(self, arch: BertArchitecture) -> None:
        super().__init__()
        self.arch = arch
        self.output_names: tuple[str, ...] = ("embedding", "scores") if arch.head_classes else ("embedding",)
        self.word_embeddings = _embedding(arch.vocab_size, arch.hidden)
        self.position_embeddings = _embedding(arch.max_position, arch.hidden)
        self.token_type_embeddings = _embedding(arch.type_vocab, arch.hidden)  # only type 0 is used
        self.embeddings_norm = nn.LayerNorm(arch.hidden, eps=arch.layer_norm_eps)
        self.layers = nn.ModuleList(_Layer(arch) for _ in range(arch.layers))
        self.head = _Head(arch.hidden, arch.head_classes) if arch.head_classes else None

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        x = self.embeddings_norm(x)
        # Additive mask, [batch, 1, 1, seq]: 0 for tokens, the dtype's minimum for padding (finite, so a
        # fully padded row softmaxes to a uniform row instead of NaN).
        mask = attention_mask.to(x.dtype)
        additive = ((1.0 - mask) * torch.finfo(x.dtype).min)[:, None, None, :]
        for layer in self.layers:
            x = layer(x, additive)
        weights = attention_mask.to(torch.float32).unsqueeze(-1)
        pooled = (x.float() * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        embedding = F.normalize(pooled, p=2.0, dim=1)
        if self.head is None:
            return (embedding,)
        logits = embedding @ self.head.weight.float() + self.head.bias.float()
        return embedding, logits.softmax(dim=-1)


def _shapes(arch: BertArchitecture) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in TorchBert(arch).state_dict().items()}


def convert_hf_state_dict(state: Mapping[str, torch.Tensor], arch: BertArchitecture) -> dict[str, torch.Tensor]:
    """Hugging Face BertModel weights (an optional "bert." prefix is dropped) -> this module's names, fp32."""
    hf = {name.removeprefix("bert."): t for name, t in state.items()}
    out = {
        "word_embeddings.weight": hf["embeddings.word_embeddings.weight"],
        "position_embeddings.weight": hf["embeddings.position_embeddings.weight"],
        "token_type_embeddings.weight": hf["embeddings.token_type_embeddings.weight"],
        "embeddings_norm.weight": hf["embeddings.LayerNorm.weight"],
        "embeddings_norm.bias": hf["embeddings.LayerNorm.bias"],
    }
    for i in range(arch.layers):
        p, q = f"encoder.layer.{i}.", f"layers.{i}."
        for kind in ("weight", "bias"):
            out[q + "qkv." + kind] = torch.cat([hf[f"{p}attention.self.{n}.{kind}"] for n in ("query", "key", "value")])
            out[q + "attention_out." + kind] = hf[f"{p}attention.output.dense.{kind}"]
            out[q + "attention_norm." + kind] = hf[f"{p}attention.output.LayerNorm.{kind}"]
            out[q + "intermediate." + kind] = hf[f"{p}intermediate.dense.{kind}"]
            out[q + "output." + kind] = hf[f"{p}output.dense.{kind}"]
            out[q + "output_norm." + kind] = hf[f"{p}output.LayerNorm.{kind}"]
    return {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in out.items()}


def _replace_atomically(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.chmod(tmp, 0o644)  # safetensors creates 0600; readable like model.onnx
    os.replace(tmp, path)


def write_torch_source(version_dir: Path, arch: BertArchitecture, tensors: Mapping[str, torch.Tensor]) -> None:
    """Writes torch.safetensors, then torch.json (each to a temp name, then renamed). Checks names and shapes."""
    expected = _shapes(arch)
    got = {name: tuple(t.shape) for name, t in tensors.items()}
    if got != expected:
        wrong = sorted(set(expected.items()) ^ set(got.items()))
        raise ValueError(f"tensors do not match the architecture: {wrong[:6]}")
    state = {name: t.detach().to("cpu", torch.float32).contiguous() for name, t in tensors.items()}
    version_dir = Path(version_dir)
    _replace_atomically(version_dir / TORCH_WEIGHTS_FILE, lambda tmp: save_file(state, str(tmp)))
    config = json.dumps({**_SOURCE, **arch.to_json()}, indent=2) + "\n"
    _replace_atomically(version_dir / TORCH_CONFIG_FILE, lambda tmp: tmp.write_text(config))


def read_architecture(version_dir: Path) -> BertArchitecture:
    """torch.json of a version directory; ValueError if it describes something this module does not compute."""
    data = json.loads((Path(version_dir) / TORCH_CONFIG_FILE).read_text())
    for key, value in _SOURCE.items():
        if data.get(key) != value:
            raise ValueError(f"{Path(version_dir) / TORCH_CONFIG_FILE}: {key} is {data.get(key)!r}, expected {value!r}")
    return BertArchitecture.from_json(data)


def load_torch_source(version_dir: Path, *, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.float32) -> TorchBert:
    """The model version's TorchBert, in eval mode, without gradients, on `device` in `dtype`."""
    arch = read_architecture(version_dir)
    state = load_file(str(Path(version_dir) / TORCH_WEIGHTS_FILE))
    with torch.device("meta"):  # no random init: the weights are assigned from the file
        model = TorchBert(arch)
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def random_bert(arch: BertArchitecture = BERT_BASE, *, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float16, seed: int = 0) -> TorchBert:
    """Random weights (BERT's init: normal(0, 0.02), LayerNorm 1/0) for throughput measurements only."""
    with torch.device("meta"):
        model = TorchBert(arch)
    model = model.to_empty(device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model.to(dtype=dtype).eval().requires_grad_(False)


def with_head(arch: BertArchitecture, tensors: Mapping[str, torch.Tensor], weight: torch.Tensor,
              bias: torch.Tensor) -> tuple[BertArchitecture, dict[str, torch.Tensor]]:
    """An encoder's architecture and tensors plus a head (weight [dim, classes], bias [classes])."""
    if weight.shape != (arch.hidden, bias.shape[0]):
        raise ValueError(f"head weight {tuple(weight.shape)} does not fit hidden {arch.hidden} "
                         f"and {bias.shape[0]} classes")
    tensors = {name: t for name, t in tensors.items() if not name.startswith("head.")}
    return replace(arch, head_classes=int(bias.shape[0])), {**tensors, "head.weight": weight, "head.bias": bias}
