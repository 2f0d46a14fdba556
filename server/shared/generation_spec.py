"""A generative model's settings (`task: generate`, the config.yaml `generate:` section) and what its
version directory holds. Both sides read them: a frontend renders, tokenizes and keys prompts with them;
a worker runs the decoder and its scheduler within them."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

GENERATION_FILE = "generation.json"  # chat template, end-of-answer token ids, the context the weights know
DECODER_FILE = "decoder.onnx"  # the decoder with its past keys and values (server/engines/ort_decoder.py runs it)
DECODER_CONFIG_FILE = "decoder.json"  # its architecture
DECODER_WEIGHTS_FILE = "decoder.safetensors"  # its weights (server/engines/llama.py: the torch runtime's source)
NORMALIZE_MODES = ("none", "text")  # none: keys and prompts as sent; text: Infer's normalization of each turn
# auto: torch on a GPU worker (bf16, CUDA graphs), ONNX Runtime on a CPU one; torch on a CPU runs fp32, eager
DECODER_RUNTIMES = ("auto", "onnxruntime", "torch")


@dataclass(frozen=True)
class GenerationSpec:
    context_length: int = 2048      # prompt plus answer, in tokens; a longer prompt is INVALID_ARGUMENT
    max_new_tokens: int = 256       # default of a request that sets none; also the most a request may ask
    temperature: float = 0.0        # defaults of a request that sets none (0: greedy)
    top_p: float = 1.0
    top_k: int = 0                  # 0: no top-k cut
    normalize: str = "none"         # NORMALIZE_MODES: "text" for FAQ-style traffic (case, punctuation, spaces)
    max_streams: int = 8            # generations in the running batch at once (each holds a key/value slot)
    max_waiting: int = 64           # generations queued behind them; past it RESOURCE_EXHAUSTED
    prefill_tokens: int = 512       # prompt tokens read per scheduler step, across new generations
    runtime: str = "auto"           # DECODER_RUNTIMES

    def check(self) -> None:
        """ValueError naming the first setting out of range."""
        if self.context_length < 2 or not 1 <= self.max_new_tokens < self.context_length:
            raise ValueError("generate: context_length must be >= 2 and 1 <= max_new_tokens < context_length")
        if not (self.temperature >= 0 and 0 < self.top_p <= 1 and self.top_k >= 0):
            raise ValueError("generate: temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        if self.normalize not in NORMALIZE_MODES:
            raise ValueError(f"generate: normalize must be one of {', '.join(NORMALIZE_MODES)}, got {self.normalize!r}")
        if self.max_streams < 1 or self.max_waiting < 0 or self.prefill_tokens < 1:
            raise ValueError("generate: max_streams and prefill_tokens must be >= 1 and max_waiting >= 0")
        if self.runtime not in DECODER_RUNTIMES:
            raise ValueError(f"generate: runtime must be one of {', '.join(DECODER_RUNTIMES)}, got {self.runtime!r}")


GENERATION_KEYS = frozenset(f.name for f in fields(GenerationSpec))


@dataclass(frozen=True)
class PrefixSpec:
    """A generative model's prefix key/value cache (the config.yaml `prefix_cache:` section;
    server/worker/prefix/prefix_cache.py): prompt blocks computed once, reused by every request that starts
    with them, from device memory, host memory or disk."""

    enabled: bool = True
    block_tokens: int = 64          # tokens per block: a prefix is reused in whole blocks
    device_fraction: float = 0.2    # GPU worker: the share of device memory free after loading, for blocks
    device_mb: int = 0              # GPU worker: device memory for blocks, in MiB, instead of device_fraction
    host_mb: int = 1024             # host memory for blocks (pinned on a GPU worker; the only memory tier on a CPU)
    disk: bool = True               # blocks demoted to the host's LMDB block store (the server's kv section)
    public_prompts: tuple[tuple[str, str], ...] = ()  # (name, system prompt): blocks every tenant shares

    def check(self) -> None:
        if self.block_tokens < 1 or not 0 <= self.device_fraction <= 0.9 or self.host_mb < 0 or self.device_mb < 0:
            raise ValueError("prefix_cache: block_tokens >= 1, 0 <= device_fraction <= 0.9, device_mb and host_mb >= 0")


PREFIX_KEYS = frozenset(f.name for f in fields(PrefixSpec))


def prefix_from_config(section: dict | None) -> PrefixSpec:
    section = dict(section or {})
    public = section.pop("public_prompts", None) or {}
    if not isinstance(public, dict) or not all(isinstance(v, str) and v for v in public.values()):
        raise ValueError("prefix_cache.public_prompts must map names to system prompt texts")
    try:
        spec = PrefixSpec(**{k: type(getattr(PrefixSpec, k))(v) for k, v in section.items()},
                          public_prompts=tuple((str(k), v) for k, v in public.items()))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"prefix_cache: {exc}") from None
    spec.check()
    return spec


def generation_from_config(section: dict | None) -> GenerationSpec:
    section = section or {}
    try:
        spec = GenerationSpec(**{k: type(getattr(GenerationSpec, k))(v) for k, v in section.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"generate: {exc}") from None
    spec.check()
    return spec


@dataclass(frozen=True)
class PromptFormat:
    """What a version's generation.json says: its chat template (Jinja, as the model was trained with),
    the token ids that end an answer, and the longest context its weights know."""

    chat_template: str
    end_ids: tuple[int, ...]
    max_positions: int

    @classmethod
    def read(cls, version_dir: Path) -> "PromptFormat":
        data = json.loads((version_dir / GENERATION_FILE).read_text())
        return cls(str(data["chat_template"]), tuple(int(i) for i in data["end_ids"]), int(data["max_positions"]))
