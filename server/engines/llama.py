"""A Llama-family decoder in plain torch, reading and writing a pool of key/value slots.

The numerics follow Hugging Face's LlamaForCausalLM (RMSNorm in fp32 then cast, rotary embeddings with
rotate_half, grouped-query attention, SwiGLU): with the same weights in fp32 its greedy answers equal
transformers' own `generate` token for token (tests/test_decoder_engine.py). Q, K and V are one matrix
product, and so are the MLP's gate and up projections.

One `forward` serves both prompt chunks and decode steps: rows of new tokens at given positions, each
row a sequence that owns one slot of the pool; each row's keys and values are written at its positions,
then each row attends to the first `span` positions of its slot, masked to those at or before each query.
Grouped-query attention without copying keys: a row's query heads that share a key head are laid out
as extra query positions of that key head (a [rows, kv_heads, group x tokens, head_dim] query against
[rows, kv_heads, span, head_dim] keys).

Weights: `decoder.safetensors` beside decoder.json, in Hugging Face's names (written by prepare-model from
the GGUF through transformers; a benchmark's random weights are written in the same names).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from server.shared.generation_spec import DECODER_CONFIG_FILE



@dataclass(frozen=True)
class LlamaArchitecture:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    rope_theta: float
    rms_eps: float
    tie_embeddings: bool
    max_positions: int

    @classmethod
    def read(cls, directory: Path) -> "LlamaArchitecture":
        data = json.loads((directory / DECODER_CONFIG_FILE).read_text())
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise ValueError(f"{directory / DECODER_CONFIG_FILE} lacks {', '.join(missing)} "
                             "(written by an older prepare-model: run it again)")
        return cls(**{f.name: type(getattr(LLAMA3_8B, f.name))(data[f.name]) for f in fields(cls)})

    def write(self, directory: Path, extra: dict | None = None) -> None:
        """decoder.json, as read() reads it (and, for the ONNX decoder, the fields it reads: layers,
        kv_heads, head_dim, vocab, which the architecture has under the same names)."""
        (directory / DECODER_CONFIG_FILE).write_text(json.dumps({**self.to_json(), **(extra or {})}, indent=1))

    @classmethod
    def from_hf(cls, config) -> "LlamaArchitecture":
        """From a transformers LlamaConfig."""
        rope = getattr(config, "rope_parameters", None) or {}
        kind = rope.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"rope type {kind!r} is not supported (only the default rotary embedding)")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        return cls(
            vocab=int(config.vocab_size), hidden=int(config.hidden_size), layers=int(config.num_hidden_layers),
            heads=int(config.num_attention_heads), kv_heads=int(config.num_key_value_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads),
            intermediate=int(config.intermediate_size),
            rope_theta=float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))),
            rms_eps=float(config.rms_norm_eps), tie_embeddings=bool(config.tie_word_embeddings),
            max_positions=int(config.max_position_embeddings))

    def to_json(self) -> dict:
        return asdict(self)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()

    def parameters(self) -> int:
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        per_layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        head = 0 if self.tie_embeddings else self.vocab * self.hidden
        return self.vocab * self.hidden + self.layers * per_layer + self.hidden + head


# Shapes the benchmarks use with random weights.
LLAMA3_8B = LlamaArchitecture(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128,
                              intermediate=14336, rope_theta=500000.0, rms_eps=1e-5, tie_embeddings=False,
                              max_positions=8192)
SMOLLM2_135M = LlamaArchitecture(vocab=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
                                 intermediate=1536, rope_theta=100000.0, rms_eps=1e-5, tie_embeddings=True,
                                 max_positions=8192)


def hf_weight_names(arch: LlamaArchitecture) -> dict[str, tuple[int, ...]]:
    """Hugging Face's tensor names and shapes for this architecture."""
    h, d = arch.hidden, arch.head_dim
    names = {"model.embed_tokens.weight": (arch.vocab, h), "model.norm.weight": (h,)}
    for n in range(arch.layers):
        p = f"model.layers.{n}."
        names.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (arch.heads * d, h), p + "self_attn.k_proj.weight": (arch.kv_heads * d, h),
            p + "self_attn.v_proj.weight": (arch.kv_heads * d, h), p + "self_attn.o_proj.weight": (h, arch.heads * d),
            p + "mlp.gate_proj.weight": (arch.intermediate, h), p + "mlp.up_proj.weight": (arch.intermediate, h),
            p + "mlp.down_proj.weight": (h, arch.intermediate),
        })
    if not arch.tie_embeddings:
        names["lm_head.weight"] = (arch.vocab, h)
    return names


def random_weights(arch: LlamaArchitecture, dtype: torch.dtype, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of this shape in Hugging Face's names (benchmarks: speed does not depend on them).
    Norms are ones; matrices are normal with std 0.02, so activations stay finite through the layers."""
    generator = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in hf_weight_names(arch).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            out[name] = (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * 0.02).to(dtype)
    return out


class _Layer(nn.Module):
    def __init__(self, arch: LlamaArchitecture) -> None:
        super().__init__()
        h, d = arch.hidden, arch.head_dim
        self.norm1 = nn.Parameter(torch.empty(h))
        self.qkv = nn.Parameter(torch.empty((arch.heads + 2 * arch.kv_heads) * d, h))
        self.out = nn.Parameter(torch.empty(h, arch.heads * d))
        self.norm2 = nn.Parameter(torch.empty(h))
        self.gate_up = nn.Parameter(torch.empty(2 * arch.intermediate, h))
        self.down = nn.Parameter(torch.empty(h, arch.intermediate))


class Llama(nn.Module):
    def __init__(self, arch: LlamaArchitecture) -> None:
        super().__init__()
        self.arch = arch
        self.embed = nn.Parameter(torch.empty(arch.vocab, arch.hidden))
        self.layers = nn.ModuleList(_Layer(arch) for _ in range(arch.layers))
        self.norm = nn.Parameter(torch.empty(arch.hidden))
        self.head = self.embed if arch.tie_embeddings else nn.Parameter(torch.empty(arch.vocab, arch.hidden))
        inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @classmethod
    def from_hf_state(cls, arch: LlamaArchitecture, state: dict[str, torch.Tensor], dtype: torch.dtype,
                      device: str | torch.device) -> "Llama":
        """The module from Hugging Face-named tensors, cast to `dtype` on `device` (fused as it computes)."""
        expected = hf_weight_names(arch)
        missing = sorted(set(expected) - set(state))
        if missing:
            raise ValueError(f"weights lack {len(missing)} tensors, e.g. {missing[0]}")
        for name, shape in expected.items():
            if tuple(state[name].shape) != shape:
                raise ValueError(f"{name} has shape {tuple(state[name].shape)}, the architecture says {shape}")

        def get(name: str) -> torch.Tensor:
            return state[name].to(device=device, dtype=dtype)

        with torch.device("meta"):
            module = cls(arch)
        module.embed = nn.Parameter(get("model.embed_tokens.weight"), requires_grad=False)
        module.norm = nn.Parameter(get("model.norm.weight"), requires_grad=False)
        module.head = module.embed if arch.tie_embeddings else nn.Parameter(get("lm_head.weight"), requires_grad=False)
        for n, layer in enumerate(module.layers):
            p = f"model.layers.{n}."
            layer.norm1 = nn.Parameter(get(p + "input_layernorm.weight"), requires_grad=False)
            layer.norm2 = nn.Parameter(get(p + "post_attention_layernorm.weight"), requires_grad=False)
            layer.qkv = nn.Parameter(torch.cat([get(p + f"self_attn.{x}_proj.weight") for x in "qkv"]),
                                     requires_grad=False)
            layer.out = nn.Parameter(get(p + "self_attn.o_proj.weight"), requires_grad=False)
            layer.gate_up = nn.Parameter(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                                         requires_grad=False)
            layer.down = nn.Parameter(get(p + "mlp.down_proj.weight"), requires_grad=False)
        inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, arch.head_dim, 2, dtype=torch.float32) / arch.head_dim))
        module.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        return module.eval()

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weight, self.arch.rms_eps)  # one kernel, fp32 inside

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                slots: torch.Tensor | None, span: int, last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [rows, vocab] of each row's token at `last` (its last token when None).

        ids, positions: [rows, tokens] (int64); keys, values: the pool, [layers, slots, kv_heads, length,
        head_dim]; slots: [rows] the slot of each row, or None when row r is slot r (decode steps: the
        rows' keys are then a view of the pool, not a copy); span: the positions attended, at least every
        row's last position + 1. A position past the pool's length is not allowed; padding rows or tokens
        write where nothing reads (see server/engines/torch_decoder.py)."""
        arch = self.arch
        rows, tokens = ids.shape
        group = arch.heads // arch.kv_heads
        d = arch.head_dim
        x = F.embedding(ids, self.embed)
        freqs = positions.unsqueeze(-1).to(torch.float32) * self.inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos = angles.cos().to(x.dtype).unsqueeze(2)    # [rows, tokens, 1, d]
        sin = angles.sin().to(x.dtype).unsqueeze(2)
        allowed = torch.arange(span, device=ids.device) <= positions.unsqueeze(-1)  # [rows, tokens, span]
        allowed = allowed.unsqueeze(1).repeat(1, 1, group, 1)  # [rows, 1, group * tokens, span] (group-major)
        where = (slots.unsqueeze(1) if slots is not None else torch.arange(rows, device=ids.device).unsqueeze(1),
                 positions)
        for n, layer in enumerate(self.layers):
            h = self._rms(x, layer.norm1)
            qkv = F.linear(h, layer.qkv).view(rows, tokens, arch.heads + 2 * arch.kv_heads, d)
            qk = _rotate(qkv[:, :, :arch.heads + arch.kv_heads], cos, sin)  # queries and keys in one pass
            q, k = qk.split((arch.heads, arch.kv_heads), dim=2)
            v = qkv[:, :, arch.heads + arch.kv_heads:]
            pool_k, pool_v = keys[n], values[n]
            pool_k[where[0], :, where[1]] = k      # index [rows, tokens] on dims 0 and 2: [rows, tokens, kv, d]
            pool_v[where[0], :, where[1]] = v
            if slots is None:
                k_all, v_all = pool_k[:rows, :, :span], pool_v[:rows, :, :span]
            else:
                k_all, v_all = pool_k[slots, :, :span], pool_v[slots, :, :span]
            # [rows, tokens, kv, group, d] -> [rows, kv, group * tokens, d]
            q = q.view(rows, tokens, arch.kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(
                rows, arch.kv_heads, group * tokens, d)
            a = self._attend(q, k_all, v_all, allowed)
            a = a.view(rows, arch.kv_heads, group, tokens, d).permute(0, 3, 1, 2, 4).reshape(rows, tokens, arch.heads * d)
            x = x + F.linear(a, layer.out)
            h = self._rms(x, layer.norm2)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        x = x[:, -1] if last is None else x[torch.arange(rows, device=ids.device), last]
        return F.linear(self._rms(x, self.norm), self.head)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel (memory-efficient attention with a mask): as fast as explicit products for
        # decode steps and faster for prompt chunks on an H200 (docs/benchmarks.md), and as exact on a CPU
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=self.arch.head_dim ** -0.5)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, Hugging Face's layout: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    return torch.addcmul(x * cos, torch.cat((-x[..., half:], x[..., :half]), dim=-1), sin)
