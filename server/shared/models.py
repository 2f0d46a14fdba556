"""Model repository: `models/<name>/config.yaml` and `models/<name>/<version>/model.onnx` (+ tokenizer.json).

The config names the task, the input limits, the outputs, the batcher's sequence-length buckets and
the cache policy. Frontends read it to validate requests; the worker also loads the files.

A version is either a whole graph (model.onnx, and/or the torch form) or a head on an encoder of the
repository: head.json names the encoder model and version whose output it reads, head.npz holds its
weights (`infercache train-head` writes this form). The worker runs the encoder once per miss and keeps
its output in the feature tier (L2, server/worker/store/features.py), so a new head version reuses it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from server.shared.answer_match import AnswerMatchPolicy, answer_match_from_config
from server.shared.errors import ModelNotFound
from server.shared.generation_spec import (DECODER_FILE, DECODER_WEIGHTS_FILE, GENERATION_KEYS, PREFIX_KEYS,
                                           GenerationSpec, PrefixSpec, generation_from_config, prefix_from_config)
from server.shared.match_policy import CalibratedPolicy, MatchPolicy, policy_from_config
from server.shared import synonyms as synonym_files, ttl_classes
from server.shared.synonyms import Synonyms
from server.shared.ttl_classes import TtlClasses
from server.shared.upstream_spec import UPSTREAM_KEYS, UpstreamSpec, upstream_from_config, upstream_generation

MODEL_FILE = "model.onnx"
TORCH_CONFIG_FILE = "torch.json"          # the torch form (server/engines/torch_bert.py): its architecture
TORCH_WEIGHTS_FILE = "torch.safetensors"  # and its weights, the torch-cuda runtime's source
TOKENIZER_FILE = "tokenizer.json"
LABELS_FILE = "labels.json"       # classification models: score column -> label
HEAD_FILE = "head.json"           # a head version: {"encoder": model, "encoder_version": v, "input": output name}
HEAD_WEIGHTS_FILE = "head.npz"    # its weights: "weight" (dim x classes), "bias" (numpy, read without pickle)
TASKS = ("embedding", "classification", "generate")
PII_MODES = ("off", "redact", "no_store")  # privacy.pii: see server/shared/pii.py and README "Security"


class ModelConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ModelSpec:
    name: str
    root: Path
    task: str
    serving_version: str
    versions: tuple[str, ...]
    outputs: tuple[str, ...]
    max_text_chars: int
    max_tokens: int
    buckets: tuple[int, ...]          # ascending token counts; one engine profile each
    max_batch_size: int
    max_queue_delay_ms: float
    ttl_s: int                        # the default TTL class's; 0 = results are never cached
    precision: str = ""               # engine precision override ("int8-qdq" for Q/DQ models); "" = server default
    semantic: CalibratedPolicy | MatchPolicy | None = None  # near-duplicate matching (classification); None = exact only
    pii: str = "off"                  # privacy.pii: redact (placeholders before keying), no_store, off
    share_features: bool = False      # l2.share_across_tenants: a head model's encoder outputs (L2)
                                      # are keyed without the tenant (the text alone decides them)
    hot_key_text: bool = False        # hot_keys.keep_text: GetHotKeys shows the hottest keys' texts
    generation: GenerationSpec | None = None  # task generate: the `generate:` section (server/shared/generation_spec.py)
    prefix: PrefixSpec | None = None          # task generate: its `prefix_cache:` section
    # cache.classes (server/shared/ttl_classes.py); load_model sets it, with cache.ttl_s as one class
    ttl_classes: TtlClasses = TtlClasses(((ttl_classes.DEFAULT_CLASS, 0),), ttl_classes.DEFAULT_CLASS)
    synonyms: Synonyms | None = None  # normalize.synonyms: the model's dictionary (server/shared/synonyms.py)
    # task generate with a `semantic:` section: semantic answers (server/shared/answer_match.py)
    answer_match: AnswerMatchPolicy | None = None
    semantic_off: bool = False        # a `semantic:` section is there without `enabled: true` (said at start)
    upstream: UpstreamSpec | None = None  # runtime: upstream: the server that computes its misses
    stale_if_error_s: int = 0         # cache.stale_if_error_s: how long past its TTL an entry may still answer
                                      # when the model cannot (entries are kept that much longer; 0 = off)

    @property
    def key_variant(self) -> str:
        """What the namespace of this model's keys holds beyond tenant, model and version: the synonym
        dictionary's fingerprint (a changed dictionary never serves keys made under the old one)."""
        return f"synonyms:{self.synonyms.fingerprint}" if self.synonyms is not None else ""

    def version_dir(self, version: str) -> Path:
        return self.root / version

    def head(self, version: str) -> "HeadRef | None":
        """The encoder a head version reads (None for a whole-graph version)."""
        return read_head(self.version_dir(version))

    def resolve_version(self, version: str) -> str:
        """The requested version, or the serving one for ""; ModelNotFound if absent."""
        if not version:
            return self.serving_version
        if version not in self.versions:
            raise ModelNotFound(
                f"model {self.name!r} has no version {version!r} (available: {', '.join(self.versions) or 'none'})"
            )
        return version


@dataclass(frozen=True)
class HeadRef:
    encoder: str          # model of the repository
    encoder_version: str  # the version whose outputs the head was trained on
    input: str            # the encoder output it reads


def read_head(version_dir: Path) -> HeadRef | None:
    path = version_dir / HEAD_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        return HeadRef(str(data["encoder"]), str(data["encoder_version"]), str(data.get("input", "embedding")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelConfigError(f"{path}: {exc!r}") from None


def _is_version(path: Path) -> bool:
    return any((path / name).is_file()
               for name in (MODEL_FILE, TORCH_WEIGHTS_FILE, HEAD_FILE, DECODER_FILE, DECODER_WEIGHTS_FILE))


# Every key a config.yaml may hold: a section's own keys, or None for a value (semantic: its rule checks
# its keys, server/shared/match_policy.py). Anything else is an error, so that a typo never does nothing.
KNOWN_KEYS: dict[str, frozenset[str] | None] = {
    "task": None, "serving_version": None, "outputs": None, "semantic": None, "runtime": None,
    "input": frozenset({"max_text_chars", "max_tokens"}),
    "batching": frozenset({"buckets", "max_batch_size", "max_queue_delay_ms"}),
    "cache": frozenset({"ttl_s", "classes", "default_class", "stale_if_error_s"}),
    "engine": frozenset({"precision"}),
    "privacy": frozenset({"pii"}),
    "l2": frozenset({"share_across_tenants"}),
    "hot_keys": frozenset({"keep_text"}),
    "normalize": frozenset({"synonyms"}),
    "generate": GENERATION_KEYS,
    "prefix_cache": PREFIX_KEYS,
    "upstream": UPSTREAM_KEYS,
}
RUNTIMES = ("local", "upstream")  # where a model's misses are computed: here, or by the server upstream: names


def check_keys(data: dict) -> None:
    """ModelConfigError naming the first key that is not a setting, and the ones that are."""
    for key, value in data.items():
        if key not in KNOWN_KEYS:
            raise ModelConfigError(f"unknown key {key!r} (known: {', '.join(KNOWN_KEYS)})")
        inner = KNOWN_KEYS[key]
        if inner is None or value is None:
            continue
        if not isinstance(value, dict):
            raise ModelConfigError(f"{key!r} must be a mapping of {', '.join(sorted(inner))}, got {value!r}")
        for name in value:
            if name not in inner:
                raise ModelConfigError(f"unknown key '{key}.{name}' (known in {key}: {', '.join(sorted(inner))})")


def _get(data: dict, path: str, kind: type, default: Any = None) -> Any:
    node: Any = data
    for part in path.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    if node is None:
        if default is None:
            raise ModelConfigError(f"missing required setting {path!r}")
        return default
    try:
        return kind(node)
    except (TypeError, ValueError):
        raise ModelConfigError(f"setting {path!r} must be {kind.__name__}, got {node!r}") from None


def _synonyms(root: Path, data: dict, generation: GenerationSpec | None) -> Synonyms | None:
    name = (data.get("normalize") or {}).get("synonyms")
    if not name:
        return None
    if generation is not None and generation.normalize != "text":
        raise ModelConfigError("normalize.synonyms needs generate.normalize: text (prompts are otherwise kept as sent)")
    try:
        return synonym_files.load(root / str(name))
    except synonym_files.SynonymError as exc:
        raise ModelConfigError(f"normalize.synonyms: {exc}") from None


def _lifetimes(spec: ModelSpec, max_ttl_s: int, jitter: float) -> ModelSpec:
    """TTLs capped by retention (cache.max_ttl_s), the stale window too: no entry is kept past it."""
    classes = dataclasses.replace(spec.ttl_classes.capped(max_ttl_s), jitter=jitter)
    stale_s = spec.stale_if_error_s
    if max_ttl_s:
        stale_s = max(0, min(stale_s, max_ttl_s - max(s for _, s in classes.pairs)))
    return dataclasses.replace(spec, ttl_classes=classes, ttl_s=classes.ttl_s(classes.default), stale_if_error_s=stale_s)


def load_model(root: Path) -> ModelSpec:
    config_path = root / "config.yaml"
    try:
        data = yaml.safe_load(config_path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ModelConfigError(f"{config_path}: {exc}") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{config_path}: expected a mapping of settings, got {type(data).__name__}")
    try:
        check_keys(data)
        task = _get(data, "task", str)
        if task not in TASKS:
            raise ModelConfigError(f"task must be one of {', '.join(TASKS)}, got {task!r}")
        generation = prefix = upstream = None
        runtime = _get(data, "runtime", str, "local")
        if runtime not in RUNTIMES:
            raise ModelConfigError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        if (runtime == "upstream") != ("upstream" in data):
            raise ModelConfigError("runtime: upstream and an upstream: section go together")
        if runtime == "upstream":  # no tokenizer, engine or buckets here: texts go to the upstream as they are keyed
            upstream = upstream_from_config(data["upstream"])
            upstream.check(task)
            if stray := [k for k in ("batching", "engine", "prefix_cache") if k in data] + \
                    (["generate"] if "generate" in data and task != "generate" else []) + \
                    (["input.max_tokens"] if "max_tokens" in (data.get("input") or {}) else []):
                raise ModelConfigError(f"{', '.join(stray)}: not settings of an upstream model (its batches are "
                                       "upstream.max_batch_texts and max_delay_ms)")
            chars = _get(data, "input.max_text_chars", int, 8192 if task != "generate" else 65536)
            shape = {"outputs": tuple(_get(data, "outputs", list, ["embedding"])), "max_tokens": chars,
                     "max_text_chars": chars, "buckets": (chars,), "max_batch_size": upstream.max_batch_texts,
                     "max_queue_delay_ms": upstream.max_delay_ms}
            if task == "generate":
                generation = upstream_generation(data.get("generate"))
                shape["outputs"] = ("text",)
        elif task == "generate":  # no batching, input or outputs: the generate section says it all
            generation = generation_from_config(data.get("generate"))
            prefix = prefix_from_config(data.get("prefix_cache"))
            shape = {"outputs": ("text",), "max_tokens": generation.context_length,
                     "max_text_chars": _get(data, "input.max_text_chars", int, 8 * generation.context_length),
                     "buckets": (generation.context_length,), "max_batch_size": generation.max_streams,
                     "max_queue_delay_ms": 0.0}
        elif "generate" in data or "prefix_cache" in data:
            raise ModelConfigError(f"generate and prefix_cache sections need task: generate (this model's task is {task})")
        else:
            shape = {"outputs": tuple(_get(data, "outputs", list)), "max_tokens": _get(data, "input.max_tokens", int),
                     "max_text_chars": _get(data, "input.max_text_chars", int),
                     "buckets": tuple(sorted(int(b) for b in _get(data, "batching.buckets", list))),
                     "max_batch_size": _get(data, "batching.max_batch_size", int),
                     "max_queue_delay_ms": _get(data, "batching.max_queue_delay_ms", float)}
        buckets, max_tokens = shape["buckets"], shape["max_tokens"]
        lifetimes = ttl_classes.from_config(data.get("cache"))
        spec = ModelSpec(
            name=root.name,
            root=root,
            task=task,
            serving_version=str(_get(data, "serving_version", str)),
            versions=tuple(sorted({p.name for p in root.iterdir() if _is_version(p)}
                                  | ({str(data.get("serving_version"))} if upstream is not None else set()))),
            ttl_s=lifetimes.ttl_s(lifetimes.default),
            ttl_classes=lifetimes,
            synonyms=_synonyms(root, data, generation),
            precision=str((data.get("engine") or {}).get("precision", "")),
            semantic=None if task == "generate" else policy_from_config(data.get("semantic")),
            answer_match=answer_match_from_config(data.get("semantic")) if task == "generate" else None,
            semantic_off=bool(data.get("semantic")) and not data["semantic"].get("enabled", False),
            pii=str((data.get("privacy") or {}).get("pii", "off")),
            share_features=bool((data.get("l2") or {}).get("share_across_tenants", False)),
            hot_key_text=bool((data.get("hot_keys") or {}).get("keep_text", False)),
            generation=generation,
            prefix=prefix,
            upstream=upstream,
            stale_if_error_s=_get(data, "cache.stale_if_error_s", int, 0),
            **shape,
        )
    except (ModelConfigError, ValueError) as exc:  # (a TtlClassError is a ValueError)
        raise ModelConfigError(f"{config_path}: {exc}") from None
    if not buckets or buckets[-1] < max_tokens:
        raise ModelConfigError(f"{config_path}: the largest bucket must be >= input.max_tokens ({max_tokens})")
    if spec.semantic is not None and spec.task != "classification":
        raise ModelConfigError(f"{config_path}: semantic matching needs a classification model (an answer to agree on)")
    if spec.stale_if_error_s < 0 or (spec.stale_if_error_s and (spec.task == "generate" or spec.semantic is not None)):
        raise ModelConfigError(f"{config_path}: cache.stale_if_error_s must be >= 0, and is for embedding and "
                               "classification models without semantic matching")
    if spec.pii not in PII_MODES:
        raise ModelConfigError(f"{config_path}: privacy.pii must be one of {', '.join(PII_MODES)}, got {spec.pii!r}")
    if spec.max_batch_size < 1 or spec.max_text_chars < 1 or spec.ttl_s < 0:
        raise ModelConfigError(f"{config_path}: max_batch_size and max_text_chars must be >= 1, ttl_s >= 0")
    return spec


class ModelRepository:
    """The models of a directory. `max_ttl_s` (cache.max_ttl_s, retention) caps every TTL class of every
    model; `ttl_jitter` (cache.ttl_jitter) is the share of random jitter on the TTL of what they store."""

    def __init__(self, models_dir: Path, max_ttl_s: int = 0, ttl_jitter: float = 0.0) -> None:
        self.root = models_dir
        if not models_dir.is_dir():
            raise ModelConfigError(f"model repository {models_dir} does not exist")
        specs = [load_model(p) for p in sorted(models_dir.iterdir()) if (p / "config.yaml").is_file()]
        specs = [_lifetimes(s, max_ttl_s, ttl_jitter) for s in specs]
        self.models = {spec.name: spec for spec in specs}
        self._no_upstream_encoders()

    def _no_upstream_encoders(self) -> None:
        """A model computed upstream answers whole requests only: no embedder of semantic matching or
        answers, nor an encoder of heads (their features and token ids are this host's)."""
        upstream = {name for name, spec in self.models.items() if spec.upstream is not None}
        for spec in self.models.values():
            named = {spec.semantic.embedder} if spec.semantic is not None else set()
            if spec.answer_match is not None:
                named.add(spec.answer_match.rule.embedder)
            for version in spec.versions:
                try:
                    head = spec.head(version)
                except ModelConfigError:  # (such a version is not served: said where it is loaded)
                    continue
                if head is not None:
                    named.add(head.encoder)
            if found := sorted(named & upstream):
                raise ModelConfigError(f"{spec.root / 'config.yaml'}: {found[0]} is computed upstream; it cannot be "
                                       "an embedder or a head's encoder (those run on this host)")

    @classmethod
    def of(cls, config) -> "ModelRepository":
        """The repository a server process serves, with the cache settings that shape its TTLs."""
        return cls(Path(config.server.models_dir), config.cache.max_ttl_s, config.cache.ttl_jitter)

    def get(self, name: str) -> ModelSpec:
        spec = self.models.get(name)
        if spec is None:
            known = ", ".join(sorted(self.models)) or "none"
            raise ModelNotFound(f"unknown model {name!r} (served: {known})")
        return spec

    def servable(self) -> list[ModelSpec]:
        """Models whose serving version has its files in place."""
        return [m for m in self.models.values() if m.serving_version in m.versions]
