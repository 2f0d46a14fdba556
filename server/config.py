"""Server configuration: one settings object with defaults.

Sources, later ones winning: built-in defaults < YAML file < environment (INFERCACHE_<SECTION>_<FIELD>)
< command-line overrides. Only `server.__main__` calls `load`; everything else receives the frozen
object (spawned children receive it as an argument and never read argv or the environment). The files
that settings name (tokens, TLS certificates, the encryption key) are read by `load` too, once, into
`Config.secrets`, which never appears in a repr or a log.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import yaml

from cachestore.env import StoreSettings
from cachestore.sealing import KeyFileError, read_key_file
from server.shared.auth import Grant, TokenFileError, read_tokens
from server.shared.devices import RUNTIMES, SHARING_MODES


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerSection:
    host: str = "127.0.0.1"
    port: int = 50051
    frontends: int = 0                 # 0 = one per CPU
    workers: int = 0                   # inference workers; 0 = workers_per_gpu per visible GPU (GPU runtime), else 1
    workers_per_gpu: int = 0           # with workers = 0 on a GPU host: worker processes feeding each GPU;
                                       # 0 = one per 4 CPUs per GPU, 1 to 4 (server/shared/devices.py auto_per_gpu)
    gpu_sharing: str = "auto"          # workers sharing a GPU: auto (a private CUDA MPS daemon where installed),
                                       # mps (required), timeslice (never MPS): server/mps.py
    models_dir: str = "models"
    socket_dir: str = ""               # the workers' unix sockets; "" = a fresh temporary directory
    worker_timeout_s: float = 30.0     # longest a frontend waits for the worker when the client sets no deadline
    worker_wait_s: float = 2.0         # how long a call waits for a restarting worker before UNAVAILABLE
    drain_s: float = 10.0              # grace for in-flight requests on SIGTERM
    max_queue: int = 1024              # requests admitted to the batcher before RESOURCE_EXHAUSTED
    max_queue_wait_s: float = 0.0      # refuse a miss when the queue implies a longer wait; 0 = the deadline only
    max_batch_texts: int = 256         # most texts in one InferBatch call
    max_request_bytes: int = 4 << 20   # a request's serialized size, at most (larger: INVALID_ARGUMENT)
    max_pending_calls: int = 20000     # calls a frontend's gRPC holds before its handlers take them up; past
                                       # it gRPC itself cancels new ones (CANCELLED), so keep it above bursts
    engine_threads: int = 0            # ONNX Runtime intra-op threads; 0 = the CPUs shared among CPU workers
    length_groups: bool = True         # an engine that pads a batch to its longest row (ONNX Runtime) gets
                                       # batches of like lengths, finer than the buckets (server/worker/batcher.py)
    cpu_worker_nice: int = 19          # how much nicer a CPU worker's engine (its batches' threads, its work off
                                       # the event loop) runs than its event loop and the frontends: on shared
                                       # cores hits and refusals go before engine batches; 0 = the same priority
    log_level: str = "INFO"
    metrics_port: int = 0              # GET /metrics (Prometheus) on this port; 0 = off (calls record no figures)
    metrics_host: str = "127.0.0.1"    # its bind address (0.0.0.0 for a scraper outside the pod)
    hot_keys: int = 256                # hottest keys tracked per model and frontend (GetHotKeys); 0 = off
    http_port: int = 0                 # the OpenAI-compatible HTTP door on this port (server.host, its TLS and
                                       # tokens; server/frontend/openai_api.py); 0 = off
    http_header_timeout_s: float = 10.0  # an HTTP request's headers must arrive within this of its first byte
    http_request_timeout_s: float = 30.0  # and its whole body within this (past either: 408, connection closed)
    http_max_client_connections: int = 1024  # HTTP connections one client address holds open per frontend
                                       # (more: 503; a sidecar's application is one address: size it above
                                       # its connection pools); 0 = no bound
    kserve: bool = True                # the KServe v2 gRPC service (inference.GRPCInferenceService) on server.port


@dataclass(frozen=True)
class CacheSection:
    dir: str = "var/cache"
    map_size_mb: int = 2048            # LMDB map (sparse file; the hard ceiling)
    budget_mb: int = 1536              # eviction keeps live data under this; must be below map_size_mb
    sync: bool = True                  # flush commits to disk (false: when the kernel pleases)
    sync_interval_ms: int = 200        # with sync: commits are flushed together this long after the first of
                                       # them (power loss may lose this window, or damage the store where the
                                       # file system reorders writes: set aside when met); 0 = each commit flushed;
                                       # invalidations are flushed at once
    write_batch: int = 512             # most operations per write transaction (fewer on a small disk)
    group_commit_ms: int = 50          # a put waits up to this long for others to share its transaction
    sweep_interval_s: float = 30.0     # how often expired entries are deleted
    max_ttl_s: int = 0                 # retention: no entry lives longer, whatever its model's TTL; 0 = no cap
    ttl_jitter: float = 0.1            # each stored entry's TTL less up to this share, at random (L1, the fleet
                                       # tier and L2): entries written together do not expire together
    encryption_key_file: str = ""      # AES-256-GCM at rest (cachestore/sealing.py); "" = stored in clear


@dataclass(frozen=True)
class L2Section:
    """The feature tier (server/worker/store/features.py): encoder outputs that head models read."""

    enabled: bool = True
    device_fraction: float = 0.2       # GPU hosts: the memory LRU's cap, a share of the GPU's memory (divided
                                       # among the workers on it)
    memory_mb: int = 256               # CPU hosts: the memory LRU's cap; every host: what its index may take
    dir: str = ""                      # the host's LMDB feature store; "" = <cache.dir>/features
    map_size_mb: int = 1024
    budget_mb: int = 768               # eviction keeps live features under this; must be below map_size_mb
    ttl_s: int = 7 * 86400             # a feature's life (cache.max_ttl_s caps it too); 0 = no expiry
    frontend_head_mb: int = 16         # heads (weights) up to this size also run in frontends, on features
                                       # read from the host's store (server/frontend/features.py); 0 = only
                                       # workers answer FEATURE


@dataclass(frozen=True)
class KvSection:
    """The prefix key/value cache's disk tier (server/worker/prefix/prefix_cache.py): blocks of generative models'
    prompts that every worker of the host reuses, kept across restarts."""

    dir: str = ""                      # the host's LMDB block store; "" = <cache.dir>/kv
    map_size_mb: int = 8192
    budget_mb: int = 6144              # eviction keeps live blocks under this; must be below map_size_mb
    ttl_s: int = 86400                 # a block's life (cache.max_ttl_s caps it too); 0 = no expiry
    write_queue_mb: int = 2048         # demoted blocks waiting for a worker's disk writer, at most; past it a
                                       # block is dropped (kv.dropped_backlog), computed again when next asked


@dataclass(frozen=True)
class EnginesSection:
    dir: str = "var/engines"           # L3 engine store (may be shared by pods: NFS, a PVC)
    runtime: str = "auto"              # auto, onnxruntime (CPU), torch-cuda or tensorrt (GPU): server/shared/devices.py
    precision: str = "fp16"            # requested; a runtime without FP16 builds fp32; config.yaml may override
    build_missing: bool = True         # build at start when the store lacks an engine (logged and counted)


@dataclass(frozen=True)
class SecuritySection:
    tokens_file: str = ""              # bearer tokens (server/shared/auth.py); "" = no authentication
    allow_anonymous: bool = False      # serve a non-loopback address without tokens_file (not advised)
    tls_cert_file: str = ""            # PEM certificate chain of the public port; "" = plaintext
    tls_key_file: str = ""             # its PEM private key
    tls_client_ca_file: str = ""       # PEM CA bundle: set = mutual TLS, clients need a certificate it signed


@dataclass(frozen=True)
class FleetSection:
    """The fleet tier (server/fleet/): results shared by every pod through Redis or a Redis Cluster."""

    redis: str = ""                    # "" = off; redis://host:port[/db], or redis-cluster://host:port,host:port
    prefix: str = "icache"             # of every Redis key and channel (several deployments on one Redis)
    timeout_ms: float = 5.0            # budget of one lookup, lease or invalidation call; past it: a miss
    write_timeout_ms: float = 100.0    # budget of one pipelined batch of writes (behind the replies)
    breaker_failures: int = 3          # consecutive failures that open the circuit (the tier is skipped)
    breaker_open_s: float = 2.0        # how long it stays open before one call probes Redis again
    lease_ms: int = 10000              # a computing pod's claim on a key; expires if the pod dies
    lease_wait_s: float = 2.0          # longest another pod's computation is waited for before computing
    ttl_jitter: float = 0.0            # Redis expiry = the record's remaining TTL (already spread by
                                       # cache.ttl_jitter) less up to this further share, at random
    refresh_s: float = 5.0             # namespace generations re-read this often (missed broadcasts)
    key_filter_keys: int = 1_000_000   # the pod's Bloom filter of fleet keys (server/fleet/key_filter.py): keys
                                       # it is sized for; a miss it rules out skips the lookup. 0 = off
    key_filter_fp: float = 0.01        # its false-positive rate at that many keys (each: one lookup for nothing)
    key_filter_refresh_s: float = 60.0  # rebuilt from a SCAN of the fleet's keys this often (drops expired ones)


@dataclass(frozen=True)
class Secrets:
    """What the files named by the security settings hold, read once by `load`."""

    keys: tuple[bytes, ...] = field(default=(), repr=False)          # encryption at rest, sealing key first
    tokens: dict[bytes, Grant] | None = field(default=None, repr=False)  # sha256(token) -> grant; None = off
    tls: tuple[bytes, bytes, bytes | None] | None = field(default=None, repr=False)  # cert, key, client CA


@dataclass(frozen=True)
class Config:
    server: ServerSection = field(default_factory=ServerSection)
    cache: CacheSection = field(default_factory=CacheSection)
    l2: L2Section = field(default_factory=L2Section)
    kv: KvSection = field(default_factory=KvSection)
    engines: EnginesSection = field(default_factory=EnginesSection)
    security: SecuritySection = field(default_factory=SecuritySection)
    fleet: FleetSection = field(default_factory=FleetSection)
    secrets: Secrets = field(default_factory=Secrets, repr=False)  # not a section: derived from the files

    @property
    def frontend_count(self) -> int:
        return self.server.frontends or os.cpu_count() or 1


_SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "secrets"}


def _coerce(section: str, name: str, kind: type, value: Any) -> Any:
    try:
        if kind is bool and isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{section}.{name}: expected {kind.__name__}, got {value!r}") from None


def _apply(config: Config, section: str, values: Mapping[str, Any], origin: str) -> Config:
    if section not in _SECTIONS:
        raise ConfigError(f"{origin}: unknown section {section!r} (known: {', '.join(_SECTIONS)})")
    current = getattr(config, section)
    types = {f.name: f.type for f in dataclasses.fields(current)}
    changes = {}
    for name, value in values.items():
        if name not in types:
            raise ConfigError(f"{origin}: unknown setting {section}.{name} (known: {', '.join(types)})")
        kind = {"str": str, "int": int, "float": float, "bool": bool}[types[name]]
        changes[name] = _coerce(section, name, kind, value)
    return dataclasses.replace(config, **{section: dataclasses.replace(current, **changes)})


def load(path: str | None, environ: Mapping[str, str], overrides: Mapping[str, Any]) -> Config:
    """overrides: {"section.field": value} from the command line."""
    config = Config()
    if path:
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections")
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{path}: section {section!r} must be a mapping")
            config = _apply(config, section, values, path)
    for name, value in environ.items():
        if name.startswith("INFERCACHE_") and name != "INFERCACHE_CONFIG":
            section, _, key = name[len("INFERCACHE_"):].lower().partition("_")
            config = _apply(config, section, {key: value}, f"environment {name}")
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        config = _apply(config, section, {key: value}, f"option {dotted}")
    validate(config)
    return dataclasses.replace(config, secrets=read_secrets(config))


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror or exc}") from None


def read_secrets(config: Config) -> Secrets:
    """Reads the token, certificate and key files the settings name; ConfigError saying what is wrong."""
    security = config.security
    try:
        keys = read_key_file(config.cache.encryption_key_file) if config.cache.encryption_key_file else ()
        tokens = read_tokens(security.tokens_file) if security.tokens_file else None
    except (KeyFileError, TokenFileError) as exc:
        raise ConfigError(str(exc)) from None
    tls = None
    if security.tls_cert_file or security.tls_key_file:
        if not (security.tls_cert_file and security.tls_key_file):
            raise ConfigError("TLS needs both security.tls_cert_file and security.tls_key_file")
        tls = (_read(security.tls_cert_file, "TLS certificate"), _read(security.tls_key_file, "TLS key"),
               _read(security.tls_client_ca_file, "TLS client CA") if security.tls_client_ca_file else None)
    elif security.tls_client_ca_file:
        raise ConfigError("security.tls_client_ca_file (mutual TLS) needs TLS: set tls_cert_file and tls_key_file")
    if tokens is None and not security.allow_anonymous and not _loopback(config.server.host):
        raise ConfigError(
            f"server.host {config.server.host} is reachable from other hosts and no security.tokens_file is set: "
            "anyone who can reach the port could read every tenant's answers and invalidate them. Set "
            "security.tokens_file (README: Security), or security.allow_anonymous=true to serve without it")
    return Secrets(keys=keys, tokens=tokens, tls=tls)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def validate(config: Config) -> None:
    if not 0 < config.server.port < 65536:
        raise ConfigError(f"server.port must be 1..65535, got {config.server.port}")
    if not 0 <= config.server.metrics_port <= 65535:
        raise ConfigError(f"server.metrics_port must be within 0..65535 (0 = off), got {config.server.metrics_port}")
    if config.server.metrics_port and config.server.metrics_port == config.server.port:
        raise ConfigError("server.metrics_port must differ from server.port")
    if not 0 <= config.server.http_port <= 65535:
        raise ConfigError(f"server.http_port must be within 0..65535 (0 = off), got {config.server.http_port}")
    if config.server.http_port and config.server.http_port in (config.server.port, config.server.metrics_port):
        raise ConfigError("server.http_port must differ from server.port and server.metrics_port")
    if not 0 < config.server.http_header_timeout_s <= config.server.http_request_timeout_s:
        raise ConfigError("server.http_header_timeout_s must be positive and at most server.http_request_timeout_s, "
                          f"got {config.server.http_header_timeout_s} and {config.server.http_request_timeout_s}")
    if config.server.http_max_client_connections < 0:
        raise ConfigError("server.http_max_client_connections must be 0 (no bound) or more, got "
                          f"{config.server.http_max_client_connections}")
    if config.server.hot_keys < 0:
        raise ConfigError("server.hot_keys must be >= 0 (0 = off)")
    if config.server.frontends < 0:
        raise ConfigError("server.frontends must be >= 0 (0 = one per CPU)")
    if config.server.workers < 0:
        raise ConfigError("server.workers must be >= 0 (0 = workers_per_gpu per GPU, or one on a CPU host)")
    if config.server.workers_per_gpu < 0:
        raise ConfigError("server.workers_per_gpu must be >= 0 (0 = from the host's CPUs)")
    if config.server.gpu_sharing not in SHARING_MODES:
        raise ConfigError(f"server.gpu_sharing must be one of {', '.join(SHARING_MODES)}")
    if config.server.max_batch_texts < 1:
        raise ConfigError("server.max_batch_texts must be >= 1")
    if not 1024 <= config.server.max_request_bytes <= 1 << 30:
        raise ConfigError(f"server.max_request_bytes must be within 1024..{1 << 30} (1 KiB..1 GiB), got "
                          f"{config.server.max_request_bytes}")
    if not 0 < config.cache.budget_mb < config.cache.map_size_mb:
        raise ConfigError(
            f"cache.budget_mb ({config.cache.budget_mb}) must be positive and below cache.map_size_mb "
            f"({config.cache.map_size_mb}), so eviction runs before the map is full"
        )
    if config.server.max_queue_wait_s < 0:
        raise ConfigError("server.max_queue_wait_s must be >= 0 (0 = only the caller's deadline bounds the wait)")
    if config.server.max_queue < 1:
        raise ConfigError("server.max_queue must be >= 1")
    if config.server.max_pending_calls < 1:
        raise ConfigError("server.max_pending_calls must be >= 1")
    if not 0 <= config.server.cpu_worker_nice <= 19:
        raise ConfigError(f"server.cpu_worker_nice must be within 0..19, got {config.server.cpu_worker_nice}")
    if config.engines.runtime not in RUNTIMES:
        raise ConfigError(f"engines.runtime must be one of {', '.join(RUNTIMES)}, got {config.engines.runtime!r}")
    if config.cache.max_ttl_s < 0:
        raise ConfigError("cache.max_ttl_s must be >= 0 (0 = no cap beyond each model's TTL)")
    if not 0 <= config.cache.ttl_jitter < 1:
        raise ConfigError(f"cache.ttl_jitter must be within 0..1 (a share of each TTL), got {config.cache.ttl_jitter}")
    if config.cache.sweep_interval_s <= 0 or config.cache.write_batch < 1:
        raise ConfigError("cache.sweep_interval_s must be positive and cache.write_batch >= 1 "
                          f"(got {config.cache.sweep_interval_s} and {config.cache.write_batch})")
    if not 0 <= config.cache.group_commit_ms <= 1000:
        raise ConfigError(f"cache.group_commit_ms must be within 0..1000, got {config.cache.group_commit_ms}")
    if not 0 <= config.cache.sync_interval_ms <= 60_000:
        raise ConfigError(f"cache.sync_interval_ms must be within 0..60000, got {config.cache.sync_interval_ms}")
    fleet = config.fleet
    if fleet.redis and not fleet.redis.startswith(("redis://", "rediss://", "redis-cluster://")):
        raise ConfigError(f"fleet.redis must start with redis://, rediss:// or redis-cluster://, got {fleet.redis!r}")
    if fleet.timeout_ms <= 0 or fleet.write_timeout_ms <= 0 or fleet.lease_ms <= 0 or fleet.refresh_s <= 0:
        raise ConfigError("fleet.timeout_ms, write_timeout_ms, lease_ms and refresh_s must be positive")
    if not 0 <= fleet.ttl_jitter < 1:
        raise ConfigError(f"fleet.ttl_jitter must be within 0..1, got {fleet.ttl_jitter}")
    if fleet.key_filter_keys < 0 or not 0 < fleet.key_filter_fp < 0.5 or fleet.key_filter_refresh_s <= 0:
        raise ConfigError("fleet.key_filter_keys must be >= 0 (0 = off), key_filter_fp within 0..0.5 (exclusive) "
                          "and key_filter_refresh_s positive")
    if fleet.breaker_failures < 1 or fleet.lease_wait_s < 0 or fleet.breaker_open_s < 0:
        raise ConfigError("fleet.breaker_failures must be >= 1, lease_wait_s and breaker_open_s >= 0")
    l2 = config.l2
    if not 0 <= l2.device_fraction <= 0.9 or l2.memory_mb < 0 or l2.ttl_s < 0 or l2.frontend_head_mb < 0:
        raise ConfigError("l2.device_fraction must be within 0..0.9, l2.memory_mb, l2.ttl_s and "
                          "l2.frontend_head_mb >= 0")
    if not 0 < l2.budget_mb < l2.map_size_mb:
        raise ConfigError(f"l2.budget_mb ({l2.budget_mb}) must be positive and below l2.map_size_mb ({l2.map_size_mb})")
    if config.kv.write_queue_mb <= 0:
        raise ConfigError(f"kv.write_queue_mb must be positive, not {config.kv.write_queue_mb}")
    if not 0 < config.kv.budget_mb < config.kv.map_size_mb:
        raise ConfigError(f"kv.budget_mb ({config.kv.budget_mb}) must be positive and below kv.map_size_mb "
                          f"({config.kv.map_size_mb})")
    if config.engines.precision not in ("fp16", "fp32", "int8-qdq"):
        raise ConfigError(f"engines.precision must be fp16, fp32 or int8-qdq, got {config.engines.precision!r}")


def store_settings(config: Config) -> StoreSettings:
    mb = 1024 * 1024
    return StoreSettings(
        path=Path(config.cache.dir), map_size=config.cache.map_size_mb * mb,
        budget=config.cache.budget_mb * mb, sync=config.cache.sync, keys=config.secrets.keys,
        sync_interval_s=config.cache.sync_interval_ms / 1000,
    )


def kv_store_settings(config: Config) -> StoreSettings:
    """The prefix cache's block store: its own LMDB environment, sealed like the result store when that is."""
    mb = 1024 * 1024
    return StoreSettings(
        path=Path(config.kv.dir or Path(config.cache.dir) / "kv"), map_size=config.kv.map_size_mb * mb,
        budget=config.kv.budget_mb * mb, sync=config.cache.sync, keys=config.secrets.keys,
    )


def feature_store_settings(config: Config) -> StoreSettings:
    """The L2 feature store: its own LMDB environment, sealed like the result store when that is."""
    mb = 1024 * 1024
    return StoreSettings(
        path=Path(config.l2.dir or Path(config.cache.dir) / "features"), map_size=config.l2.map_size_mb * mb,
        budget=config.l2.budget_mb * mb, sync=config.cache.sync, keys=config.secrets.keys,
        sync_interval_s=config.cache.sync_interval_ms / 1000,
    )
