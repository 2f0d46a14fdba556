"""`infercache engines build|list|verify|prune`: operator tooling for the L3 engine store.

`build` is what CI/CD images and init containers run, so that serving processes only load.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from cachestore.engine_store import EngineStore, Manifest
from server.config import Config
from server.shared.devices import GPU_RUNTIMES
from server.engines.artifacts import artifact_key, engine_versions, get_runtime, prepare
from server.engines.base import EngineBuildError, RuntimeUnavailable
from server.shared.errors import ModelNotFound
from server.shared.models import ModelConfigError, ModelRepository


def _say(text: str) -> None:
    print(text, flush=True)


def build(config: Config, *, model: str | None, force: bool) -> int:
    try:
        repository = ModelRepository(Path(config.server.models_dir))
    except ModelConfigError as exc:
        _say(f"infercache: {exc}")
        return 2
    store = EngineStore(Path(config.engines.dir))
    try:
        runtime = get_runtime(config.engines.runtime)
    except RuntimeUnavailable as exc:
        _say(f"infercache: {exc}")
        return 2
    try:
        specs = [repository.get(model)] if model else repository.servable()
    except ModelNotFound as exc:
        _say(f"infercache: {exc}")
        return 2
    jobs = [(spec, version) for spec in specs for version in engine_versions(spec)]
    if not jobs:
        _say(f"infercache: {_nothing_to_build(specs, model)}")
        return 0 if model and specs[0].versions else 2
    failures = 0
    for n, (spec, version) in enumerate(jobs, 1):
        key = artifact_key(runtime, spec, version, config.engines.precision)
        _say(f"[{n}/{len(jobs)}] {spec.name} {version}: {key.name}")
        if force:
            store.manifest_path(key.name).unlink(missing_ok=True)
        started = time.monotonic()
        try:
            loaded, _ = prepare(store, runtime, spec, version, config.engines.precision)
        except (EngineBuildError, RuntimeUnavailable, OSError) as exc:
            failures += 1
            _say(f"    FAILED: {exc}")
            continue
        what = f"built in {loaded.manifest.build_seconds:.1f} s" if loaded.built else "already in the store, verified"
        _say(f"    {what} ({loaded.manifest.size_bytes / 1e6:.1f} MB, {time.monotonic() - started:.1f} s)")
    return 1 if failures else 0


def _nothing_to_build(specs, model: str | None) -> str:
    """Why no engine is built: what the model named runs on, or that the repository has no model files."""
    if not model:
        return "no model files to build (run `infercache prepare-model`)"
    spec = specs[0]
    if not spec.versions:
        return f"{spec.name} has no version folder with model files (run `infercache prepare-model` for the defaults)"
    if spec.upstream is not None:
        return f"{spec.name} is computed upstream ({spec.upstream.kind}): no engine to build here"
    if spec.task == "generate":
        return f"{spec.name} generates text: its decoder is loaded from its model files as they are, no engine to build"
    encoder = "its encoder"
    for version in spec.versions:
        try:
            head = spec.head(version)
        except ModelConfigError as exc:
            return f"{spec.name} version {version} is not served: {exc}"
        if head is not None:
            encoder = head.encoder
    return f"{spec.name} is a head on {encoder}: it runs on that model's engine (`infercache engines build --model " \
           f"{encoder}`)"


def list_(config: Config) -> int:
    store = EngineStore(Path(config.engines.dir))
    manifests = store.list()
    if not manifests:
        _say(f"no engines in {store.root}")
        return 0
    _say(f"{'name':<72} {'MB':>8} {'build s':>8}  built at")
    for m in manifests:
        _say(f"{m.name:<72} {m.size_bytes / 1e6:8.1f} {m.build_seconds:8.1f}  {m.built_at}")
    return 0


def verify(config: Config) -> int:
    store = EngineStore(Path(config.engines.dir))
    results = store.verify_all()
    for name, problem in results:
        _say(f"{'BAD ' if problem else 'ok  '} {name}{': ' + problem if problem else ''}")
    bad = sum(1 for _, problem in results if problem)
    _say(f"{len(results) - bad} ok, {bad} bad")
    return 1 if bad else 0


def prune(config: Config, *, dry_run: bool) -> int:
    """Keeps artifacts of model versions in the repository built by the installed runtime versions."""
    repository = ModelRepository(Path(config.server.models_dir))
    store = EngineStore(Path(config.engines.dir))
    installed = {}
    for name in ("onnxruntime", *GPU_RUNTIMES):
        try:
            runtime = get_runtime(name)
            installed[runtime.name] = runtime.version
        except RuntimeUnavailable:
            pass

    def keep(manifest: Manifest) -> bool:
        key = manifest.key
        spec = repository.models.get(key["model"])
        return (spec is not None and key["version"] in spec.versions
                and installed.get(key["runtime"]) == key["runtime_version"])

    removed = store.prune(keep, dry_run=dry_run)
    for name in removed:
        _say(f"{'would remove' if dry_run else 'removed'} {name}")
    _say(f"{len(removed)} {'to remove' if dry_run else 'removed'}")
    return 0


def main(config: Config, command: str, *, model: str | None = None, force: bool = False,
         dry_run: bool = False) -> int:
    if command == "build":
        return build(config, model=model, force=force)
    if command == "list":
        return list_(config)
    if command == "verify":
        return verify(config)
    if command == "prune":
        return prune(config, dry_run=dry_run)
    print(f"unknown engines command {command!r}", file=sys.stderr)
    return 2
