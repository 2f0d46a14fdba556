"""Engines through the L3 store: find the artifact for (model, version, device, runtime, precision,
profiles), build it if it is missing or untrusted, load it."""

from __future__ import annotations

import logging
import time
from collections import Counter
from pathlib import Path

from cachestore.engines import ArtifactKey, EngineStore, Loaded
from server.config import Config
from server.engines.base import Engine, Profile, Runtime, RuntimeUnavailable, profiles_for
from server.models import MODEL_FILE, ModelRepository, ModelSpec

log = logging.getLogger("infercache.engines")

RUNTIMES = ("onnxruntime", "tensorrt")


def get_runtime(name: str) -> Runtime:
    if name == "onnxruntime":
        from server.engines.onnxruntime import OrtRuntime

        return OrtRuntime()
    if name == "tensorrt":
        from server.engines.tensorrt import TensorRTRuntime

        return TensorRTRuntime()
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
    source = spec.version_dir(version) / MODEL_FILE
    timing = store.timing_cache_path(key.device, runtime.name, runtime.version)
    profiles = model_profiles(spec)
    return store.get_or_build(
        key, source, lambda out: runtime.build(source, profiles, key.precision, out, timing),
        load=(lambda path: runtime.load(path, profiles, threads=threads)) if load else None,
        allow_build=allow_build,
    )


def load_engines(config: Config, repository: ModelRepository, counters: Counter) -> dict[tuple[str, str], Engine]:
    """An engine for every servable model version, from the L3 store (built there if missing)."""
    store = EngineStore(Path(config.engines.dir))
    runtime = get_runtime(config.engines.runtime)
    engines = {}
    for spec in repository.servable():
        for version in spec.versions:
            started = time.monotonic()
            artifact, engine = prepare(store, runtime, spec, version, config.engines.precision, load=True,
                                       threads=config.server.engine_threads, allow_build=config.engines.build_missing)
            if artifact.built:
                counters["engines_built_at_start"] += 1
                counters["engine_build_ms"] += int(artifact.manifest.build_seconds * 1000)
                log.warning("built engine %s at serve time in %.1f s%s; prebuild it with `infercache engines "
                            "build` so pods only load", artifact.manifest.name, artifact.manifest.build_seconds,
                            f" (stored one not trusted: {artifact.rebuilt_reason})" if artifact.rebuilt_reason else "")
            counters["engines_loaded"] += 1
            engines[(spec.name, version)] = engine
            log.info("loaded %s version %s (%s) in %.2f s", spec.name, version, artifact.manifest.name,
                     time.monotonic() - started)
    return engines
