"""L3 engine store: built engine artifacts, persisted and verified, shared by every pod that mounts it.

    {root}/artifacts/{name}{suffix}        the artifact (TensorRT plan, optimized ONNX, ...)
    {root}/artifacts/{name}.json           its manifest: checksum, sizes, build seconds, runtime, device, profiles
    {root}/timing/{device}_{runtime}.cache timing caches, per device and runtime version, shared across models
    {root}/locks/{name}.lock               POSIX lock held while one process builds `name`

The name holds everything that invalidates an artifact:
`{model}_{version}_{device}_{runtime+version}_{precision}_{profile-set hash}`. The manifest is written
last (temp file + rename), so an artifact without a valid manifest was never finished. A missing,
corrupt or mismatched artifact is rebuilt, never trusted. Builders in several pods on one shared
directory serialize on the lock: the first builds, the others wait and then load its artifact (side by
side: the lock is held to build, never to load).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

log = logging.getLogger("infercache.engines")

MANIFEST_FORMAT = 2
CHECKSUM_MISMATCH = "artifact checksum mismatch"
_UNSAFE = re.compile(r"[^A-Za-z0-9.+-]+")


def _part(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-") or "none"


@dataclass(frozen=True)
class ArtifactKey:
    """Everything an artifact depends on. Two keys with the same name are interchangeable."""

    model: str
    version: str
    device: str                 # "cpu-x86_64-<isa hash>", "sm90-nvidia-h200", "aot-sm80-sm86-sm89-sm120", ...
    runtime: str                # "onnxruntime", "tensorrt", "tensorrt_rtx"
    runtime_version: str
    precision: str              # "fp32", "fp16", "int8-qdq"
    profiles: tuple[tuple[int, ...], ...]  # one (min_batch, opt_batch, max_batch, min_seq, opt_seq, max_seq) per profile
    suffix: str = ".plan"

    @property
    def profile_hash(self) -> str:
        return hashlib.blake2b(json.dumps(self.profiles).encode(), digest_size=6).hexdigest()

    @property
    def name(self) -> str:
        return "_".join(_part(p) for p in (
            self.model, self.version, self.device, f"{self.runtime}-{self.runtime_version}", self.precision,
            self.profile_hash,
        ))


@dataclass
class Manifest:
    name: str
    artifact: str
    sha256: str
    size_bytes: int
    source_sha256: str
    source_stat: list[int]      # [size, mtime_ns] of the source when built: skips re-hashing it on every start
    build_seconds: float
    built_at: str
    built_by: str
    key: dict
    details: dict = field(default_factory=dict)  # runtime-specific: GPU name, compute capability, timing cache use
    format: int = MANIFEST_FORMAT


class _Source:
    """The model file an artifact is built from; hashed only when its size or mtime changed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        stat = path.stat()
        self.stat = [stat.st_size, stat.st_mtime_ns]
        self._sha256: str | None = None

    @property
    def sha256(self) -> str:
        if self._sha256 is None:
            self._sha256 = sha256_file(self.path)
        return self._sha256

    def matches(self, manifest: "Manifest") -> bool:
        if self.stat == manifest.source_stat:
            return True
        return self.sha256 == manifest.source_sha256  # copied or touched: same bytes still count


@dataclass(frozen=True)
class Loaded:
    path: Path
    manifest: Manifest
    built: bool                 # this call built it (a cold start)
    rebuilt_reason: str = ""    # why an existing artifact was not trusted


Builder = Callable[[Path], dict]  # writes the artifact to the given path; returns manifest details


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; pods with other UIDs read the shared store
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class EngineStore:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.artifacts = root / "artifacts"
        self.timing = root / "timing"
        self.locks = root / "locks"
        for folder in (self.artifacts, self.timing, self.locks):
            folder.mkdir(parents=True, exist_ok=True)

    # ---- paths ---------------------------------------------------------------------------------------

    def artifact_path(self, key: ArtifactKey) -> Path:
        return self.artifacts / f"{key.name}{key.suffix}"

    def manifest_path(self, name: str) -> Path:
        return self.artifacts / f"{name}.json"

    def timing_cache_path(self, device: str, runtime: str, runtime_version: str) -> Path:
        """Per device and runtime version; every model built there shares it."""
        return self.timing / f"{_part(device)}_{_part(runtime)}-{_part(runtime_version)}.cache"

    # ---- reading -------------------------------------------------------------------------------------

    def read_manifest(self, name: str) -> Manifest | None:
        try:
            data = json.loads(self.manifest_path(name).read_text())
            if data.get("format") != MANIFEST_FORMAT:
                return None
            return Manifest(**data)
        except (OSError, ValueError, TypeError):
            return None

    def _trusted(self, key: ArtifactKey, source: _Source) -> tuple[Manifest | None, str]:
        """Every check but the artifact checksum (which runs while the artifact loads)."""
        manifest = self.read_manifest(key.name)
        path = self.artifact_path(key)
        if manifest is None:
            return None, "no valid manifest" if path.exists() else "not built yet"
        if manifest.key != _key_dict(key):
            return None, "manifest describes a different build"
        if not source.matches(manifest):
            return None, "the source model changed since the build"
        if problem := _size_problem(path, manifest):
            return None, problem
        return manifest, ""

    def _verified_load(self, path: Path, manifest: Manifest, load: Callable[[Path], object] | None):
        """(loaded object, "") once the checksum matched, or (None, why not). Hashing and loading
        overlap; a load whose checksum fails is dropped before anyone uses it."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            digest = pool.submit(sha256_file, path)
            try:
                engine, failure = (load(path) if load is not None else None), None
            except Exception as exc:  # a damaged file may not even parse: the checksum decides
                engine, failure = None, exc
            if digest.result() != manifest.sha256:
                return None, CHECKSUM_MISMATCH
        if failure is not None:
            raise failure  # intact but not loadable here (wrong GPU, missing runtime): not fixed by a rebuild
        return engine, ""

    def list(self) -> list[Manifest]:
        names = sorted(p.stem for p in self.artifacts.glob("*.json"))
        return [m for m in (self.read_manifest(n) for n in names) if m is not None]

    def verify_all(self) -> list[tuple[str, str]]:
        """(name, problem) for every artifact that would not be trusted ("" = ok)."""
        out = []
        for manifest in self.list():
            path = self.artifacts / manifest.artifact
            problem = _size_problem(path, manifest)
            if not problem and sha256_file(path) != manifest.sha256:
                problem = CHECKSUM_MISMATCH
            out.append((manifest.name, problem))
        return out

    # ---- building ------------------------------------------------------------------------------------

    @contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        with open(self.locks / f"{name}.lock", "a+") as handle:
            try:
                fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                log.info("%s: another process is building it; waiting for its result", name)
                fcntl.lockf(handle, fcntl.LOCK_EX)  # lockf (POSIX record locks) also works on NFS
            try:
                yield
            finally:
                fcntl.lockf(handle, fcntl.LOCK_UN)

    def get_or_build(self, key: ArtifactKey, source: Path, build: Builder, *,
                     load: Callable[[Path], object] | None = None, allow_build: bool = True) -> tuple[Loaded, object]:
        """The trusted artifact for `key` (built first if missing or untrusted) and load(artifact).

        The lock is held to build, never to load: processes that waited for another's build load its
        artifact side by side (several workers on one GPU start in parallel, not one after another)."""
        src = _Source(source)
        path = self.artifact_path(key)
        manifest, why = self._trusted(key, src)
        if manifest is not None:
            engine, why = self._verified_load(path, manifest, load)
            if not why:
                return Loaded(path, manifest, built=False), engine
        if not allow_build:
            raise FileNotFoundError(f"engine {key.name} is not in the store ({why}); run `infercache engines build`")
        with self._lock(key.name):
            built = None
            waited_for, _ = self._trusted(key, src)  # built by whoever held the lock before us
            if waited_for is None or waited_for == manifest:  # (the one found untrusted above is no answer)
                built = self._rebuild(key, src, build, why)
        if built is None:
            engine, why = self._verified_load(path, waited_for, load)
            if not why:
                return Loaded(path, waited_for, built=False), engine
            with self._lock(key.name):  # damaged between its build and this load
                built = self._rebuild(key, src, build, why)
        engine = load(path) if load is not None else None
        return Loaded(path, built, built=True, rebuilt_reason="" if why == "not built yet" else why), engine

    def _rebuild(self, key: ArtifactKey, source: _Source, build: Builder, why: str) -> Manifest:
        if why != "not built yet":
            log.warning("%s: rebuilding, stored artifact not trusted: %s", key.name, why)
        return self._build(key, source, build)

    def _build(self, key: ArtifactKey, source: _Source, build: Builder) -> Manifest:
        path = self.artifact_path(key)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.building")
        started = time.monotonic()
        stop = threading.Event()
        threading.Thread(target=_heartbeat, args=(key.name, started, stop), daemon=True).start()
        try:
            details = build(tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            seconds = time.monotonic() - started
            manifest = Manifest(
                name=key.name, artifact=path.name, sha256=sha256_file(tmp), size_bytes=tmp.stat().st_size,
                source_sha256=source.sha256, source_stat=source.stat, build_seconds=round(seconds, 3),
                built_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                built_by=f"{socket.gethostname()}:{os.getpid()}", key=_key_dict(key), details=details,
            )
            self.manifest_path(key.name).unlink(missing_ok=True)  # never a manifest beside a foreign artifact
            os.replace(tmp, path)
            write_atomic(self.manifest_path(key.name), json.dumps(asdict(manifest), indent=2).encode())
        finally:
            stop.set()
            tmp.unlink(missing_ok=True)
        log.info("%s: built in %.1f s (%d bytes)", key.name, manifest.build_seconds, manifest.size_bytes)
        return manifest

    # ---- pruning -------------------------------------------------------------------------------------

    def prune(self, keep: Callable[[Manifest], bool], *, dry_run: bool = False) -> list[str]:
        """Removes artifacts whose manifest `keep` rejects, unfinished builds and orphans; returns names."""
        removed = []
        manifests = {m.name: m for m in self.list()}
        for name, manifest in manifests.items():
            if not keep(manifest):
                removed.append(name)
                if not dry_run:
                    self.manifest_path(name).unlink(missing_ok=True)  # manifest first: the artifact is no longer trusted
                    (self.artifacts / manifest.artifact).unlink(missing_ok=True)
        known = {m.artifact for m in manifests.values()} | {f"{n}.json" for n in manifests}
        for path in self.artifacts.iterdir():
            if path.name not in known and not _build_in_progress(path):
                removed.append(path.name)
                if not dry_run:
                    path.unlink(missing_ok=True)
        return removed


def _size_problem(path: Path, manifest: Manifest) -> str:
    if not path.is_file() or path.stat().st_size != manifest.size_bytes:
        return "artifact missing or truncated"
    return ""


def _build_in_progress(path: Path) -> bool:
    if not path.name.endswith(".building"):
        return False
    try:
        os.kill(int(path.name.rsplit(".", 2)[-2]), 0)
        return True
    except (ValueError, ProcessLookupError, PermissionError):
        return False


def _key_dict(key: ArtifactKey) -> dict:
    data = asdict(key)
    data["profiles"] = [list(p) for p in key.profiles]
    return data


def _heartbeat(name: str, started: float, stop: threading.Event) -> None:
    """Progress on long builds (TensorRT takes minutes on large models)."""
    while not stop.wait(15.0):
        log.info("%s: still building (%.0f s)", name, time.monotonic() - started)
