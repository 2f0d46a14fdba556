"""A call's plan, worked out before anything is looked up: the model version it names (with what a
frontend needs of it: tokenizers, routing, normalization), its validated cache policy, and for each text
the normalized form, the key and whether it is private. What depends on a request's bytes alone is kept,
so that a request that repeats byte for byte (the traffic a cache is for) is neither parsed nor
validated, normalized or hashed again.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import NamedTuple

from cachestore.keys import KEY_BYTES, NS_ID_BYTES, Namespace, entry_key, namespace_id
from infercache.v1 import infercache_pb2 as pb
from server.frontend.features import FrontHead
from server.shared.errors import InvalidArgument, ModelNotFound, lenient, parsed, quoted
from server.shared.models import TOKENIZER_FILE, ModelRepository, ModelSpec
from server.shared.normalize import Normalizer, holds_pii
from server.shared.tokenization import TextEncoder

log = logging.getLogger("infercache.frontend")

Mode = pb.CachePolicy.Mode
_MODES = frozenset(Mode.values())  # (values() builds a list each call)
PLANS_KEPT = 1024  # plans of distinct _plan_keys kept; past it they start over
PREPARED_KEPT = 8192      # serialized requests whose plan and key are kept (see Planner.prepared); past it, start over
PREPARED_MAX_BYTES = 512  # longer requests are prepared anew each time
# Identifiers a client sends; longer ones are INVALID_ARGUMENT (they become store rows and cached strings).
LIMITS = {"tenant": 256, "model": 128, "version": 64, "key": 2 * KEY_BYTES}

INFER_REQUEST = lenient(pb.InferRequest)  # Infer's requests arrive serialized (server/frontend/servicer.py)


class Keyed(NamedTuple):
    """One text of a call, ready to look up."""

    text: str      # normalized
    key: bytes     # its cache key
    private: bool  # it holds PII and its model says no_store: answered, never looked up or stored


def check_identifiers(request) -> None:
    """INVALID_ARGUMENT naming the first identifier over its limit (LIMITS)."""
    for field, limit in LIMITS.items():
        value = getattr(request, field, "")
        if len(value) > limit:
            raise InvalidArgument(f"{field} has {len(value)} characters; at most {limit}: {quoted(value)}")


def _plan_key(request) -> tuple | None:
    """What a request's plan depends on, where it can be reused: model, version, tenant, mode and the
    semantic overrides' known fields (not their bytes: unknown fields would make keys of any size);
    None for a request with max_age_s (its plan holds that age)."""
    if request.cache.HasField("max_age_s"):
        return None
    return (request.model, request.version, request.tenant, request.cache.mode, request.cache.ttl_class,
            _overrides(request.semantic) if request.HasField("semantic") else None)


def _overrides(semantic: pb.SemanticPolicy) -> tuple:
    return (semantic.enabled if semantic.HasField("enabled") else None,
            semantic.min_similarity if semantic.HasField("min_similarity") else None, semantic.explain)


def _copied(semantic: pb.SemanticPolicy) -> pb.SemanticPolicy:
    """A request's semantic overrides on their own, known fields only: a kept plan must not hold the
    request (its text), nor bytes a client added."""
    enabled, min_similarity, explain = _overrides(semantic)
    return pb.SemanticPolicy(enabled=enabled, min_similarity=min_similarity, explain=explain)


def keep(table: dict, key, value, limit: int) -> None:
    """Into a memo table of at most `limit` entries: a full one starts over (no LRU bookkeeping on hits)."""
    if len(table) >= limit:
        table.clear()
    table[key] = value


def namespace_route(key: bytes) -> int:
    """Which worker computes the misses of a semantic namespace: every key of it meets its index there."""
    return int.from_bytes(key[:NS_ID_BYTES], "little")


def key_route(key: bytes) -> int:
    """Which worker computes a key's misses (server/frontend/workers.py: route % workers): from the
    key's hash part, so identical requests meet in one worker."""
    return int.from_bytes(key[NS_ID_BYTES:NS_ID_BYTES + 8], "little")


@dataclass(slots=True)
class Served:
    """What a frontend needs of one model version to send its misses: tokenizers and routing."""

    spec: ModelSpec
    version: str
    encoder: TextEncoder | None        # None: a model computed upstream (its misses are sent as text)
    embed_encoder: TextEncoder | None  # the semantic embedder's, when its ids differ from the model's
    by_namespace: bool                 # semantic models: a namespace's index lives in one worker
    normalize: Normalizer              # with the PII redaction step when the model's privacy.pii says redact
    no_store: bool                     # privacy.pii: no_store: texts holding PII are never cached
    embedder: tuple[str, str] | None   # (model, version) of the semantic embedder, for /metrics
    feature_source: tuple[str, str, str] | None  # a head model's encoder (model, version, output): its features
    head: FrontHead | None             # a head this frontend runs on stored features (server/frontend/features.py)

    def route(self, key: bytes) -> int:
        return namespace_route(key) if self.by_namespace else key_route(key)


@dataclass(slots=True)
class Plan:
    """One call's model, version and cache policy, validated."""

    served: Served
    tenant: str
    mode: int
    cached_ok: bool
    store: bool
    max_age_us: int  # the TTL of the request's class, or less by the request's max_age_s
    ttl_class: str   # the TTL class of what it stores (server/shared/ttl_classes.py)
    ttl_us: int      # that class's TTL
    semantic: pb.SemanticPolicy | None
    ns: Namespace    # (tenant, model, version): the fleet tier's keys need it


class Planner:
    """Plans and keyed texts of calls, with the memo tables that let repeated requests skip the work.
    Used on the frontend's event loop only. `max_head_bytes`: heads up to that size answer from stored
    features here (None: no FEATURE answers in this frontend)."""

    def __init__(self, repository: ModelRepository, counters, max_head_bytes: int | None = None) -> None:
        self.repository = repository
        self.counters = counters  # the process's counters
        self.max_head_bytes = max_head_bytes
        self._served: dict[tuple[str, str], Served] = {}
        self._encoders: dict[tuple[bytes, int], TextEncoder] = {}  # (tokenizer file digest, max_tokens): shared
        self._plans: dict[tuple, Plan] = {}  # see _plan_key
        self._prepared: dict[bytes, tuple[Plan, Keyed]] = {}  # see prepared

    def _encoder(self, spec: ModelSpec, version: str) -> TextEncoder:
        """The version's tokenizer, one per distinct file (a head's versions share their encoder's)."""
        path = spec.version_dir(version) / TOKENIZER_FILE
        try:
            shape = hashlib.blake2b(path.read_bytes(), digest_size=16).digest(), spec.max_tokens
            found = self._encoders.get(shape)
            if found is None:
                found = self._encoders[shape] = TextEncoder(path, spec.max_tokens)
            return found
        except Exception as exc:  # (tokenizers raises a bare Exception for a file it cannot read)
            raise ModelNotFound(f"model {spec.name!r} version {version!r} cannot be served here: {exc}") from None

    def prepare_models(self) -> None:
        """What the frontend needs of every version of the served models (tokenizers, heads), made before
        it listens: made at a version's first request, it held the event loop (and every call of this
        frontend) for the tokenizer's loading, 85 ms on a 2-core host. A version that cannot be
        prepared is left to its requests, which say why; it never stops the frontend."""
        for spec in self.repository.servable():
            if spec.task == "generate":  # (server/frontend/prompts.py)
                continue
            for version in spec.versions:
                try:
                    self.served(spec, version)
                except Exception as exc:  # noqa: BLE001 (whatever a broken version raises)
                    log.debug("%s version %s not prepared: %s", spec.name, version, exc)

    def served(self, spec: ModelSpec, version: str) -> Served:
        found = self._served.get((spec.name, version))
        if found is None:
            encoder = self._encoder(spec, version) if spec.upstream is None else None
            embed_encoder = embedded_by = None
            if spec.semantic is not None and spec.semantic.embedder in self.repository.models:
                embedder = self.repository.get(spec.semantic.embedder)  # an embedding model: no recursion
                other = self.served(embedder, embedder.serving_version).encoder
                embed_encoder = None if other.fingerprint == encoder.fingerprint else other
                embedded_by = (embedder.name, embedder.serving_version)
            front = None
            try:
                head = spec.head(version)
            except (OSError, ValueError):  # a head the workers could not load either: no FEATURE answers
                head = None
            if head is not None and self.max_head_bytes is not None:
                try:
                    front = FrontHead.load(self.repository, spec, version, head, self.max_head_bytes)
                except (OSError, ValueError) as exc:  # the workers refuse it too (their log says why)
                    log.warning("%s version %s: no FEATURE answers in this frontend: %s", spec.name, version, exc)
            found = self._served[(spec.name, version)] = Served(
                spec, version, encoder, embed_encoder, spec.semantic is not None,
                Normalizer.of(spec), spec.pii == "no_store",
                embedded_by, (head.encoder, head.encoder_version, head.input) if head is not None else None, front)
        return found

    def prepared(self, raw: bytes) -> tuple[Plan, Keyed]:
        """prepare() of a serialized InferRequest. A request that repeats byte for byte reuses what its
        first arrival worked out: no parsing, validation, normalization or hashing on the hit path. Only
        what depends on the bytes alone is kept: common requests (see _plan_key) of models without a
        privacy.pii setting (the bytes would keep the raw text in memory)."""
        found = self._prepared.get(raw)
        if found is None:
            request = parsed(INFER_REQUEST(raw))
            found = self.prepare(request)
            if len(raw) <= PREPARED_MAX_BYTES and _plan_key(request) is not None and found[0].served.spec.pii == "off":
                keep(self._prepared, raw, found, PREPARED_KEPT)
        return found

    def prepare(self, request: pb.InferRequest) -> tuple[Plan, Keyed]:
        """A call's plan and its keyed text."""
        plan = self.plan(request)
        return plan, self.keyed(request.tenant, plan.served, request.text)

    def model_named(self, request: pb.InferRequest | bytes) -> str:
        """The model a call names (a /metrics label), from the request or its serialized form."""
        if isinstance(request, bytes):
            found = self._prepared.get(request)
            if found is not None:
                return found[0].served.spec.name
            request = INFER_REQUEST(request)
        return getattr(request, "model", "")

    def plan(self, request) -> Plan:
        """The call's validated plan. A request without max_age_s reuses the plan of its _plan_key: a
        hit then skips the lookups and checks."""
        key = _plan_key(request)
        if key is not None and (found := self._plans.get(key)) is not None:
            return found
        plan = self._new_plan(request)
        if key is not None:
            keep(self._plans, key, plan, PLANS_KEPT)
        return plan

    def _new_plan(self, request) -> Plan:
        check_identifiers(request)
        if not request.model:
            raise InvalidArgument("model is required; ListModels shows the served models")
        spec = self.repository.get(request.model)
        if spec.task == "generate":
            raise InvalidArgument(f"model {spec.name!r} generates text: call Generate, not Infer")
        version = spec.resolve_version(request.version)
        mode = request.cache.mode
        if mode not in _MODES:
            raise InvalidArgument(f"cache.mode {mode} is not one of {sorted(Mode.keys())}")
        if request.semantic.HasField("min_similarity") and not 0.0 <= request.semantic.min_similarity <= 1.0:
            raise InvalidArgument(f"semantic.min_similarity must be within 0..1, got {request.semantic.min_similarity}")
        ttl_class, ttl_s = spec.ttl_classes.resolve(request.cache.ttl_class, spec.name)
        cached_at_all = ttl_s > 0
        # No entry older than the class's TTL (capped by cache.max_ttl_s) is served, also one stored for
        # a longer-lived class, or while the TTL was longer: retention holds from the moment the setting does.
        max_age_us = ttl_s * 1_000_000
        if request.cache.HasField("max_age_s"):
            max_age_us = min(max_age_us, request.cache.max_age_s * 1_000_000)
        return Plan(
            served=self.served(spec, version), tenant=request.tenant, mode=mode,
            cached_ok=mode != Mode.BYPASS and cached_at_all, store=cached_at_all and mode != Mode.NO_STORE,
            max_age_us=max_age_us, ttl_class=ttl_class, ttl_us=ttl_s * 1_000_000,
            semantic=_copied(request.semantic) if request.HasField("semantic") else None,
            ns=Namespace(request.tenant, spec.name, version),
        )

    def keyed(self, tenant: str, served: Served, text: str) -> Keyed:
        """A request's text, normalized and keyed; INVALID_ARGUMENT when unusable."""
        spec = served.spec
        if len(text) > spec.max_text_chars:
            raise InvalidArgument(f"text has {len(text)} characters; this model accepts at most {spec.max_text_chars}")
        normalized = served.normalize(text)
        if not normalized:
            raise InvalidArgument("text is empty (or only punctuation and whitespace); send the text to run")
        private = served.no_store and holds_pii(text)
        if private:
            self.counters["pii_not_stored"] += 1
        ns_id = namespace_id(tenant, spec.name, served.version, spec.key_variant)
        return Keyed(normalized, entry_key(ns_id, normalized), private)
