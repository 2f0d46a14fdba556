"""Engines through the L3 store: find the artifact for (model, version, device, runtime, precision,
profiles), build it if it is missing or untrusted, load it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from cachestore.engine_store import ArtifactKey, EngineStore, Loaded
from server.config import Config
from server.engines.base import Engine, Profile, Runtime, RuntimeUnavailable, profiles_for
from server.shared.devices import RUNTIMES, resolve_runtime, visible_gpus
from server.shared.models import ModelConfigError, ModelRepository, ModelSpec

log = logging.getLogger("infercache.engines")


def get_runtime(name: str) -> Runtime:
    """The runtime named (`auto` resolved for this host); each module is imported only here, lazily."""
    if name == "auto":
        name = resolve_runtime(name, visible_gpus())
    if name == "onnxruntime":
        from server.engines.onnxruntime import OrtRuntime

        return OrtRuntime()
    if name == "torch-cuda":
        from server.engines.torch_cuda import TorchCudaRuntime

        return TorchCudaRuntime()
    if name == "tensorrt":
        from server.engines.tensorrt import TensorRTRuntime

        return TensorRTRuntime()
    if name == "null":
        from server.engines.null import NullRuntime

        return NullRuntime()
    raise RuntimeUnavailable(f"unknown runtime {name!r} (known: {', '.join(RUNTIMES)})")


def model_profiles(spec: ModelSpec) -> tuple[Profile, ...]:
    return profiles_for(spec.buckets, spec.max_batch_size)


def artifact_key(runtime: Runtime, spec: ModelSpec, version: str, precision: str) -> ArtifactKey:
    device, _ = runtime.device()
    return ArtifactKey(
        model=spec.name, version=version, device=device, runtime=runtime.name,
        runtime_version=runtime.version, precision=runtime.precision(spec.precision or precision),
        profiles=tuple(p.shapes() for p in model_profiles(spec)), suffix=runtime.suffix,
    )


def prepare(store: EngineStore, runtime: Runtime, spec: ModelSpec, version: str, precision: str, *,
            allow_build: bool = True, load: bool = False, threads: int = 0) -> tuple[Loaded, Engine | None]:
    """The stored artifact for this model version on this host (built first if need be), and with
    load=True the engine loaded from it."""
    key = artifact_key(runtime, spec, version, precision)
    source = spec.version_dir(version) / runtime.source_file
    timing = store.timing_cache_path(key.device, runtime.name, runtime.version)
    profiles = model_profiles(spec)
    return store.get_or_build(
        key, source, lambda out: runtime.build(source, profiles, key.precision, out, timing),
        load=(lambda path: runtime.load(path, profiles, threads=threads)) if load else None,
        allow_build=allow_build,
    )


def engine_versions(spec: ModelSpec) -> list[str]:
    """The versions that need an engine: not heads (they run on their encoder's), not a generative
    model's (their decoder runs in server/worker/generation/scheduler.py), not an upstream model's
    (another server computes them), and not a version whose head.json is malformed (logged: it is not
    served)."""
    if spec.task == "generate" or spec.upstream is not None:
        return []
    out = []
    for version in spec.versions:
        try:
            if spec.head(version) is None:
                out.append(version)
        except ModelConfigError as exc:
            log.error("%s version %s not served: %s", spec.name, version, exc)
    return out


@dataclass(frozen=True)
class LoadedEngine:
    engine: Engine
    runtime: str
    precision: str
    device: str
    built_s: float = 0.0  # seconds spent building it at start; 0 = loaded from the store
    load_s: float = 0.0   # seconds to load it (the build not counted)


def load_engines(config: Config, repository: ModelRepository, counters: Counter, runtime: Runtime, *,
                 threads: int) -> dict[tuple[str, str], LoadedEngine]:
    """An engine on `runtime` for every servable model version with one of its own (engine_versions),
    from the L3 store (built there if missing). A model version the runtime cannot serve (a GPU runtime
    and a model without its source form) runs on ONNX Runtime instead, with a warning."""
    store = EngineStore(Path(config.engines.dir))
    fallback: Runtime | None = None
    engines = {}
    for spec in repository.servable():
        for version in engine_versions(spec):
            started = time.monotonic()
            chosen = runtime
            reason = runtime.cannot_serve(spec.version_dir(version))
            if reason is not None:
                fallback = fallback or get_runtime("onnxruntime")
                log.warning("%s version %s runs on %s instead of %s: %s", spec.name, version, fallback.name,
                            runtime.name, reason)
                counters["engines_fallback"] += 1
                chosen = fallback
            artifact, engine = prepare(store, chosen, spec, version, config.engines.precision, load=True,
                                       threads=threads, allow_build=config.engines.build_missing)
            if artifact.built:
                counters["engines_built_at_start"] += 1
                counters["engine_build_ms"] += int(artifact.manifest.build_seconds * 1000)
                log.warning("built engine %s at serve time in %.1f s%s; prebuild it with `infercache engines "
                            "build` so pods only load", artifact.manifest.name, artifact.manifest.build_seconds,
                            f" (stored one not trusted: {artifact.rebuilt_reason})" if artifact.rebuilt_reason else "")
            counters["engines_loaded"] += 1
            built_s = artifact.manifest.build_seconds if artifact.built else 0.0
            load_s = round(max(0.0, time.monotonic() - started - built_s), 3)
            engines[(spec.name, version)] = LoadedEngine(
                engine, chosen.name, artifact.manifest.key["precision"], chosen.device_label(), built_s, load_s)
            log.info("loaded %s version %s (%s) in %.2f s", spec.name, version, artifact.manifest.name, load_s)
    return engines
