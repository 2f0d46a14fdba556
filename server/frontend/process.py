"""Frontend process: the public gRPC API.

Several frontends listen on one port (SO_REUSEPORT) and do the per-request CPU work in parallel:
validate, normalize, derive the key, read L1, and tokenize what missed. A fresh hit is answered here;
misses go to the inference workers in micro-batches of token ids (server/worker_pool.py), so the
workers only batch, launch and write behind. Frontends never write the store.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import os
import signal
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from cachestore import records, wire
from cachestore.keys import KEY_BYTES, NS_ID_BYTES, Namespace, entry_key, namespace_id, parse_hex_key
from cachestore.results import ResultCache, now_us
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.frontend import hot_keys
from server.shared import process, telemetry
from server.shared.stats import process_stats
from server.shared.auth import ADMIN, CLIENT, Gate, Grant, TokenFileError, bind_tenant, read_in_force
from server.config import Config, store_settings
from server.shared.admission import bucket_of
from server.shared.errors import (Disabled, InvalidArgument, ModelNotFound, NotCached, WorkerUnavailable,
                           grpc_errors, lenient, parsed, quoted, status_of)
from server.frontend.metrics import (FEATURE, MISS, RESULT_EXACT, RESULT_FLEET, RESULT_SEMANTIC, SAVING,
                                     FrontendMetrics)
from server.frontend.features import FeatureAnswers, FrontHead, feature_key
from server.frontend.hot_keys import HotKeys
from server.shared.models import TOKENIZER_FILE, ModelRepository, ModelSpec
from server.shared.normalize import DEFAULT_STEPS, REDACTING_STEPS, Normalizer, holds_pii
from server.frontend.read_cache import ReadCache
from server.shared.tokenization import TextEncoder
from server.frontend.workers import WorkerPool

log = logging.getLogger("infercache.frontend")

Mode = pb.CachePolicy.Mode
_MODES = frozenset(Mode.values())  # (values() builds a list each call)
# Read per call: as plain ints (an attribute of a protobuf enum wrapper costs about a microsecond).
BYPASS, ONLY_IF_CACHED = Mode.BYPASS, Mode.ONLY_IF_CACHED
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceCache"].full_name
STATS_WAIT_S = 1.0  # GetStats and ListModels wait this long for workers whose connection is not open
TOKENIZE_INLINE_MAX = 32  # longer batches are tokenized in a thread, off the event loop
HOT_KEYS_SHOWN = 20  # GetHotKeys without a limit
PLANS_KEPT = 1024  # plans of distinct _plan_keys kept; past it they start over
PREPARED_KEPT = 8192      # serialized requests whose plan and key are kept (see prepared); past it, start over
PREPARED_MAX_BYTES = 512  # longer requests are prepared anew each time
# Identifiers a client sends; longer ones are INVALID_ARGUMENT (they become store rows and cached strings).
LIMITS = {"tenant": 256, "model": 128, "version": 64, "key": 2 * KEY_BYTES}


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
    return (request.model, request.version, request.tenant, request.cache.mode,
            _overrides(request.semantic) if request.HasField("semantic") else None)


def _overrides(semantic: pb.SemanticPolicy) -> tuple:
    return (semantic.enabled if semantic.HasField("enabled") else None,
            semantic.min_similarity if semantic.HasField("min_similarity") else None, semantic.explain)


def _copied(semantic: pb.SemanticPolicy) -> pb.SemanticPolicy:
    """A request's semantic overrides on their own, known fields only: a kept plan must not hold the
    request (its text), nor bytes a client added."""
    enabled, min_similarity, explain = _overrides(semantic)
    return pb.SemanticPolicy(enabled=enabled, min_similarity=min_similarity, explain=explain)


def _keep(table: dict, key, value, limit: int) -> None:
    """Into a memo table of at most `limit` entries: a full one starts over (no LRU bookkeeping on hits)."""
    if len(table) >= limit:
        table.clear()
    table[key] = value


_INFER_REQUEST = lenient(pb.InferRequest)  # Infer's requests arrive serialized (see add_servicer)


@dataclass(slots=True)
class _Served:
    """What a frontend needs of one model version to send its misses: tokenizers and routing."""

    spec: ModelSpec
    version: str
    encoder: TextEncoder
    embed_encoder: TextEncoder | None  # the semantic embedder's, when its ids differ from the model's
    by_namespace: bool                 # semantic models: a namespace's index lives in one worker
    normalize: Normalizer              # with the PII redaction step when the model's privacy.pii says redact
    no_store: bool                     # privacy.pii: no_store: texts holding PII are never cached
    embedder: tuple[str, str] | None   # (model, version) of the semantic embedder, for /metrics
    feature_source: tuple[str, str, str] | None  # a head model's encoder (model, version, output): its features
    head: FrontHead | None             # a head this frontend runs on stored features (server/front_features.py)

    def route(self, key: bytes) -> int:
        return int.from_bytes(key[:NS_ID_BYTES] if self.by_namespace else key[NS_ID_BYTES:NS_ID_BYTES + 8], "little")



@dataclass(slots=True)
class _Plan:
    """One call's model, version and cache policy, validated."""

    served: _Served
    tenant: str
    mode: int
    cached_ok: bool
    store: bool
    max_age_us: int  # the model's TTL, or less by the request's max_age_s
    semantic: pb.SemanticPolicy | None
    ns: Namespace    # (tenant, model, version): the fleet tier's keys need it


class FrontendCore:
    """Transport-free request handling: validation, normalization, keys, L1, tokenizing and sending misses."""

    def __init__(self, config: Config, repository: ModelRepository, workers: WorkerPool, counters: Counter,
                 fleet=None, metrics: FrontendMetrics | None = None, hot: HotKeys | None = None) -> None:
        self.config = config
        self.repository = repository
        self.workers = workers
        self.counters = counters  # the process's counters, written on its event loop only
        self.fleet = fleet        # server/fleet/tier.py FleetTier (lookups only), or None
        self.metrics = metrics    # /metrics figures (server/frontend_metrics.py), None when it is off
        self.hot = hot            # the hottest keys (server/hot_keys.py), None when server.hot_keys is 0
        self.hot_published = None  # () -> every frontend's published hot keys (set by _serve)
        self._l1 = ReadCache(store_settings(config), "result cache")
        # FEATURE answers made here (server/front_features.py), where heads may run in frontends
        self.features = FeatureAnswers(config, counters) if config.l2.enabled and config.l2.frontend_head_mb else None
        self._served: dict[tuple[str, str], _Served] = {}
        self._encoders: dict[tuple[bytes, int], TextEncoder] = {}  # (tokenizer file digest, max_tokens): shared
        self._plans: dict[tuple, _Plan] = {}  # see _plan_key
        self._prepared: dict[bytes, tuple[_Plan, tuple[str, bytes, bool]]] = {}  # see prepared

    def l1(self) -> ResultCache | None:
        """The result cache, opened on first use and re-tried while the store is unavailable."""
        return self._l1.get()

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
        frontend) for the tokenizer's loading, 85 ms on the 2-core machine. A version that cannot be
        prepared is left to its requests, which say why; it never stops the frontend."""
        for spec in self.repository.servable():
            for version in spec.versions:
                try:
                    self.served(spec, version)
                except Exception as exc:  # noqa: BLE001 (whatever a broken version raises)
                    log.debug("%s version %s not prepared: %s", spec.name, version, exc)

    def served(self, spec: ModelSpec, version: str) -> _Served:
        found = self._served.get((spec.name, version))
        if found is None:
            encoder = self._encoder(spec, version)
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
            if head is not None and self.features is not None:
                try:
                    front = FrontHead.load(self.repository, spec, version, head, self.features.max_head_bytes)
                except (OSError, ValueError) as exc:  # the workers refuse it too (their log says why)
                    log.warning("%s version %s: no FEATURE answers in this frontend: %s", spec.name, version, exc)
            found = self._served[(spec.name, version)] = _Served(
                spec, version, encoder, embed_encoder, spec.semantic is not None,
                Normalizer(REDACTING_STEPS if spec.pii == "redact" else DEFAULT_STEPS), spec.pii == "no_store",
                embedded_by, (head.encoder, head.encoder_version, head.input) if head is not None else None, front)
        return found

    def prepared(self, raw: bytes) -> tuple[_Plan, tuple[str, bytes, bool]]:
        """prepare() of a serialized InferRequest. A request that repeats byte for byte (the traffic a
        cache is for) reuses what its first arrival worked out: no parsing, validation, normalization or
        hashing on the hit path. Only what depends on the bytes alone is kept: common requests (see
        _plan_key) of models without a privacy.pii setting (the bytes would keep the raw text in memory)."""
        found = self._prepared.get(raw)
        if found is None:
            request = parsed(_INFER_REQUEST(raw))
            found = self.prepare(request)
            if len(raw) <= PREPARED_MAX_BYTES and _plan_key(request) is not None and found[0].served.spec.pii == "off":
                _keep(self._prepared, raw, found, PREPARED_KEPT)
        return found

    def prepare(self, request: pb.InferRequest) -> tuple[_Plan, tuple[str, bytes, bool]]:
        """A call's plan and its (normalized text, key, private)."""
        plan = self._plan(request)
        return plan, self._keyed(request.tenant, plan.served, request.text)

    def model_named(self, request: pb.InferRequest | bytes) -> str:
        """The model a call names (a /metrics label), from the request or its serialized form."""
        if isinstance(request, bytes):
            found = self._prepared.get(request)
            if found is not None:
                return found[0].served.spec.name
            request = _INFER_REQUEST(request)
        return getattr(request, "model", "")

    def _plan(self, request) -> _Plan:
        """The call's validated plan. A request without max_age_s reuses the plan of its _plan_key: a
        hit then skips the lookups and checks."""
        key = _plan_key(request)
        if key is not None and (found := self._plans.get(key)) is not None:
            return found
        plan = self._new_plan(request)
        if key is not None:
            _keep(self._plans, key, plan, PLANS_KEPT)
        return plan

    def _new_plan(self, request) -> _Plan:
        check_identifiers(request)
        if not request.model:
            raise InvalidArgument("model is required; ListModels shows the served models")
        spec = self.repository.get(request.model)
        version = spec.resolve_version(request.version)
        mode = request.cache.mode
        if mode not in _MODES:
            raise InvalidArgument(f"cache.mode {mode} is not one of {sorted(Mode.keys())}")
        if request.semantic.HasField("min_similarity") and not 0.0 <= request.semantic.min_similarity <= 1.0:
            raise InvalidArgument(f"semantic.min_similarity must be within 0..1, got {request.semantic.min_similarity}")
        cached_at_all = spec.ttl_s > 0
        # No entry older than the model's TTL (capped by cache.max_ttl_s) is served, also one stored
        # while the TTL was longer: retention holds from the moment the setting does.
        max_age_us = spec.ttl_s * 1_000_000
        if request.cache.HasField("max_age_s"):
            max_age_us = min(max_age_us, request.cache.max_age_s * 1_000_000)
        return _Plan(
            served=self.served(spec, version), tenant=request.tenant, mode=mode,
            cached_ok=mode != Mode.BYPASS and cached_at_all, store=cached_at_all and mode != Mode.NO_STORE,
            max_age_us=max_age_us, semantic=_copied(request.semantic) if request.HasField("semantic") else None,
            ns=Namespace(request.tenant, spec.name, version),
        )

    def _keyed(self, tenant: str, served: _Served, text: str) -> tuple[str, bytes, bool]:
        """(normalized text, cache key, private) of a request's text; INVALID_ARGUMENT when unusable.
        private: the text holds PII and its model says no_store (answered, never looked up or stored)."""
        spec = served.spec
        if len(text) > spec.max_text_chars:
            raise InvalidArgument(f"text has {len(text)} characters; this model accepts at most {spec.max_text_chars}")
        normalized = served.normalize(text)
        if not normalized:
            raise InvalidArgument("text is empty (or only punctuation and whitespace); send the text to run")
        private = served.no_store and holds_pii(text)
        if private:
            self.counters["pii_not_stored"] += 1
        return normalized, entry_key(namespace_id(tenant, spec.name, served.version), normalized), private

    def _hit(self, plan: _Plan, key: bytes, private: bool = False) -> bytes | None:
        """The serialized answer of a fresh entry (stored bytes, never parsed), or None."""
        if plan.cached_ok and not private and (cache := self.l1()) is not None:
            answer = cache.lookup(key, plan.max_age_us)
            if answer is not None:
                self.counters["hit_exact"] += 1
                return answer
        return None

    def _why_missed(self, plan: _Plan, private: bool) -> str:
        """Why _hit (just now) found no answer: a miss reason of /metrics."""
        if not plan.cached_ok:
            return "bypass" if plan.mode == BYPASS else "not_cacheable"  # (the model's ttl_s is 0)
        if private:
            return "no_store"
        if self._l1.cache is None:
            return "store_error"
        reason = self._l1.cache.missed_because
        if reason == "too_old" and plan.max_age_us >= plan.served.spec.ttl_s * 1_000_000:
            return "expired"  # the model's TTL cut it (lowered since it was stored), not the request
        return reason

    def _seen(self, plan: _Plan, keyed: list[tuple[str, bytes, bool]]) -> None:
        """The call's keys into the hot-key sketch (texts where the model keeps them)."""
        served = plan.served
        keep = served.spec.hot_key_text
        tenant = plan.tenant if keep else ""
        for text, key, private in keyed:
            if not private:
                self.hot.add(served.spec.name, served.version, key, tenant, text if keep else "")

    def _counted(self, sources: list, plan: _Plan, keyed: tuple[str, bytes, bool], source: int,
                 reason: str | None = None, rejected: bool = False) -> None:
        """One answered text into /metrics: its source, and a hit's model time saved or a miss's reason."""
        sources.append(source)
        served = plan.served
        if source in SAVING:
            spared = served.feature_source[:2] if source == FEATURE and served.feature_source else None
            spent = served.embedder if source == RESULT_SEMANTIC else None
            self.metrics.hit(served.spec.name, served.version, len(keyed[0]), spared, spent)
        elif source == MISS:
            self.metrics.missed(served.spec.name, "semantic_rejected" if rejected else reason)

    async def _fleet_hit(self, plan: _Plan, key: bytes, private: bool) -> bytes | None:
        """A fresh entry of the fleet tier as the answer, its copy sent to the key's worker for L1; or
        None (and the worker need not look again)."""
        if not plan.cached_ok or private:
            return None
        record = await self.fleet.get(key, plan.ns, plan.max_age_us)
        if record is None:
            return None
        self.counters["hit_fleet"] += 1
        if plan.store:
            self._copy(plan, key, records.encode(record), RESULT_FLEET)
        return record.payload + wire.cache_info(pb.CacheInfo.RESULT_FLEET, record.age_s(now_us()))

    def _copy(self, plan: _Plan, key: bytes, raw: bytes, source: int) -> None:
        """A record this frontend answered from (encoded, cachestore/records.py; `source`: how) to the
        key's worker, for L1."""
        served = plan.served
        self.workers.send(served.route(key), functools.partial(
            _copy_item, model=served.spec.name, version=served.version, tenant=plan.tenant, key=key, raw=raw,
            source=source))

    def _feature_answers(self, plan: _Plan, keyed: list[tuple[str, bytes, bool]]) -> list[bytes | None]:
        """For each (text, key, private) that L1 missed: a FEATURE answer made here from a stored feature
        (a repeated text's record sent on for L1), or None. Only for a head this frontend runs."""
        served = plan.served
        public = [n for n, (_, _, private) in enumerate(keyed) if not private]
        found = self.features.answers(served.head, [
            (keyed[n][1], feature_key(served.spec, served.feature_source, plan.tenant, keyed[n][0])) for n in public],
            plan.store)
        answers: list[bytes | None] = [None] * len(keyed)
        for n, made in zip(public, found):
            if made is not None:
                payload, record = made
                if record is not None:
                    self._copy(plan, keyed[n][1], record, FEATURE)
                answers[n] = payload + wire.cache_info(FEATURE)
        return answers

    def _items(self, plan: _Plan, keyed: list[tuple[str, bytes, bool]], fleet_looked: bool = False,
               lengths: list | None = None) -> list[tuple[int, object]]:
        """(route, fill) for each missed (text, key, private): token ids here, in this process. With
        `lengths`, each text's token count is appended to it."""
        served = plan.served
        texts = [text for text, _, _ in keyed]
        ids = served.encoder.encode_batch(texts) if len(texts) > 1 else [served.encoder.encode(texts[0])]
        if lengths is not None:
            lengths.extend(len(one) for one in ids)
        embed_ids = served.embed_encoder.encode_batch(texts) if served.embed_encoder is not None else None
        spec, version, source = served.spec, served.version, served.feature_source

        def fill(item, n: int, key: bytes, private: bool) -> None:
            item.model, item.version, item.tenant, item.key = spec.name, version, plan.tenant, key
            item.ids = np.asarray(ids[n], dtype="<i4").tobytes()
            if embed_ids is not None:
                item.embed_ids = np.asarray(embed_ids[n], dtype="<i4").tobytes()
            item.store, item.cached_ok = plan.store and not private, plan.cached_ok and not private
            item.max_age_us = plan.max_age_us
            item.fleet_looked = fleet_looked
            if source is not None:
                item.feature_key = feature_key(spec, source, plan.tenant, texts[n])
            if plan.semantic is not None:
                item.semantic.CopyFrom(plan.semantic)

        return [(served.route(key), functools.partial(fill, n=n, key=key, private=private))
                for n, (_, key, private) in enumerate(keyed)]

    @staticmethod
    def _answer(result) -> bytes:
        """A worker's answer as sent: its serialized response marked with how it was answered."""
        return result.response + wire.cache_info(result.source)

    def _tokenized(self, plan: _Plan, keyed: list[tuple[str, bytes, bool]], lengths: list[int]) -> None:
        served = plan.served
        for (text, _, _), tokens in zip(keyed, lengths):
            self.metrics.tokenized(served.spec.name, served.version, len(text), bucket_of(served.spec.buckets, tokens))

    async def infer(self, request: pb.InferRequest | bytes, time_remaining: float | None,
                    sources: list | None = None) -> bytes:
        """The serialized InferResponse (answers leave as bytes: cachestore/wire.py) of a request or its
        serialized form. With `sources` (/metrics on), the answer's source is appended to it."""
        plan, keyed = self.prepared(request) if isinstance(request, bytes) else self.prepare(request)
        if self.hot is not None:
            self._seen(plan, [keyed])
        if (hit := self._hit(plan, keyed[1], keyed[2])) is not None:
            if sources is not None:
                self._counted(sources, plan, keyed, RESULT_EXACT)
            return hit
        reason = self._why_missed(plan, keyed[2]) if sources is not None else None
        looked = self.fleet is not None and self.fleet.usable
        if looked and (hit := await self._fleet_hit(plan, keyed[1], keyed[2])) is not None:
            if sources is not None:
                self._counted(sources, plan, keyed, RESULT_FLEET)
            return hit
        if plan.mode == ONLY_IF_CACHED:
            self.counters["not_cached"] += 1
            raise NotCached("no fresh cached entry for this input (cache.mode is ONLY_IF_CACHED)")
        if plan.served.head is not None and plan.cached_ok:  # a stored feature: answered here
            [answer] = self._feature_answers(plan, [keyed])
            if answer is not None:
                if sources is not None:
                    self._counted(sources, plan, keyed, FEATURE)
                return answer
        self.workers.admit(plan.served.spec.name, plan.served.version, (plan.served.route(keyed[1]),), time_remaining)
        self.counters["forwarded"] += 1
        lengths = [] if sources is not None else None
        items = self._items(plan, [keyed], looked, lengths)
        [result] = await self.workers.compute(items, time_remaining)
        if sources is not None:
            self._tokenized(plan, [keyed], lengths)
            self._counted(sources, plan, keyed, result.source, reason, result.semantic_rejected)
        return self._answer(result)

    async def infer_batch(self, request: pb.InferBatchRequest, time_remaining: float | None,
                          sources: list | None = None) -> bytes:
        """The serialized InferBatchResponse. With `sources`, each text's source is appended to it."""
        plan = self._plan(request)
        limit = self.config.server.max_batch_texts
        if not request.texts:
            raise InvalidArgument("texts is empty; send at least one text")
        if len(request.texts) > limit:
            raise InvalidArgument(f"texts has {len(request.texts)} items; at most {limit} per call (server.max_batch_texts)")
        keyed, answers, missed, reasons = [], [], [], {}
        for n, text in enumerate(request.texts):
            try:
                keyed.append(self._keyed(request.tenant, plan.served, text))
            except InvalidArgument as exc:
                raise InvalidArgument(f"texts[{n}]: {exc}") from None
            answers.append(self._hit(plan, keyed[-1][1], keyed[-1][2]))
            if answers[-1] is None:
                missed.append(n)
                if sources is not None:
                    reasons[n] = self._why_missed(plan, keyed[-1][2])
        if self.hot is not None:
            self._seen(plan, keyed)
        self.counters["batch_calls"] += 1
        self.counters["batch_texts"] += len(keyed)
        here: dict[int, int] = {}  # texts L1 missed, answered here all the same: their sources
        looked = bool(missed) and self.fleet is not None and self.fleet.usable
        if looked:  # one pipeline for all of them
            found = await asyncio.gather(*(self._fleet_hit(plan, keyed[n][1], keyed[n][2]) for n in missed))
            missed = self._answered_here(answers, missed, found, here, RESULT_FLEET)
        if missed and plan.mode == ONLY_IF_CACHED:
            self.counters["not_cached"] += len(missed)
            raise NotCached(f"texts[{missed[0]}]: no fresh cached entry ({len(missed)} of {len(keyed)} texts have "
                            "none; cache.mode is ONLY_IF_CACHED)")
        if missed and plan.served.head is not None and plan.cached_ok:  # stored features: answered here
            found = self._feature_answers(plan, [keyed[n] for n in missed])
            missed = self._answered_here(answers, missed, found, here, FEATURE)
        results, lengths = [], [] if sources is not None else None
        if missed:
            miss_keyed = [keyed[n] for n in missed]
            served = plan.served
            self.workers.admit(served.spec.name, served.version, [served.route(k) for _, k, _ in miss_keyed],
                               time_remaining)
            self.counters["forwarded"] += len(missed)
            if len(missed) > TOKENIZE_INLINE_MAX:  # a long batch tokenizes off the event loop
                items = await asyncio.to_thread(self._items, plan, miss_keyed, looked, lengths)
            else:
                items = self._items(plan, miss_keyed, looked, lengths)
            results = await self.workers.compute(items, time_remaining)
            if sources is not None:
                self._tokenized(plan, miss_keyed, lengths)
        if sources is not None:
            self._count_batch(sources, plan, keyed, answers, dict(zip(missed, results)), reasons, here)
        computed = iter(results)
        return wire.batch_response([self._answer(next(computed)) if answer is None else answer for answer in answers])

    @staticmethod
    def _answered_here(answers: list, missed: list[int], found: list, here: dict[int, int], source: int) -> list[int]:
        """Takes the answers `found` for the `missed` texts (None: not found) from `source`; returns
        the texts still missed."""
        for n, answer in zip(missed, found):
            if answer is not None:
                answers[n], here[n] = answer, source
        return [n for n in missed if answers[n] is None]

    def _count_batch(self, sources: list, plan: _Plan, keyed: list, answers: list, results: dict, reasons: dict,
                     here: dict[int, int]) -> None:
        for n in range(len(answers)):
            if n in results:
                result = results[n]
                self._counted(sources, plan, keyed[n], result.source, reasons[n], result.semantic_rejected)
            else:  # answered here: L1, or for a text L1 missed the fleet tier or a stored feature
                self._counted(sources, plan, keyed[n], here.get(n, RESULT_EXACT))

    async def invalidate(self, request: pb.InvalidateRequest, time_remaining: float | None) -> pb.InvalidateResponse:
        if not (request.model or request.version or request.tenant or request.match_empty_tenant
                or request.text or request.key):
            raise InvalidArgument("set at least one of model, version, tenant, match_empty_tenant, text, key")
        if (request.version or request.text) and not request.model:
            raise InvalidArgument("version and text select within a model; set model too")
        if request.features and (request.text or request.key):
            raise InvalidArgument("features are selected by tenant, encoder model and version; text and key "
                                  "name results")
        check_identifiers(request)
        forwarded = pb.InvalidateRequest()
        forwarded.CopyFrom(request)
        if request.key:
            try:
                parse_hex_key(request.key)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
        if request.text:
            spec = self.repository.get(request.model)
            _, key, _ = self._keyed(request.tenant, self.served(spec, spec.resolve_version(request.version)),
                                    request.text)
            if request.key and request.key != key.hex():
                raise InvalidArgument("text and key name different entries; set one of them")
            forwarded.key, forwarded.text = key.hex(), ""
        # Every worker: each one's delete is ordered after the writes it has queued (a miss answered just
        # before is not committed yet), and each one's semantic index hears of what it removed.
        removed = await self.workers.call_all("Invalidate", forwarded, time_remaining)
        return pb.InvalidateResponse(removed=sum(r.removed for r in removed))

    async def _worker_stats(self) -> list[pb.ProcessStats]:
        async def one(link):
            try:
                return await self.workers.call(link, "Stats", pb.GetStatsRequest(), 1.0)
            except WorkerUnavailable as exc:
                log.info("worker %d stats unavailable: %s", link.index, exc)
                return None
        # A connection opens a moment after its worker is ready (or is down while it restarts): wait a little.
        await self.workers.all_up(timeout=min(STATS_WAIT_S, self.config.server.worker_wait_s))
        found = await asyncio.gather(*(one(link) for link in self.workers.links if link.up))
        return [stats for stats in found if stats is not None]

    async def stats(self, full: bool = True) -> pb.GetStatsResponse:
        """full=False (a client token): the answering frontend's own counters only."""
        groups = [("frontend", self.counters)]
        if self._l1.cache is not None:
            groups.append(("l1", self._l1.cache.counters))
        if self.features is not None and (feature_store := self.features.stats()):
            groups.append(("features", feature_store))
        if self.fleet is not None:
            groups.append(("fleet", {**self.fleet.counters, "ready": int(self.fleet.ready),
                                     "breaker_open": int(self.fleet.link.open)}))
        response = pb.GetStatsResponse(frontend=process_stats("frontend", *groups))
        if not full:
            return response
        workers = await self._worker_stats()
        response.workers.extend(workers)
        if workers:
            response.worker.CopyFrom(workers[0])
        cache = self.l1()
        if cache is not None:
            response.store.CopyFrom(pb.StoreStats(**cache.store.stats()))
        return response

    async def hot_keys(self, request: pb.GetHotKeysRequest) -> pb.GetHotKeysResponse:
        """The model's hottest keys over every frontend: this one's sketch as it is now, the others' as
        they last published it."""
        check_identifiers(request)
        spec = self.repository.get(request.model)
        if self.hot is None:
            raise Disabled("hot keys are not tracked on this server (server.hot_keys is 0)")
        limit = min(request.limit or HOT_KEYS_SHOWN, self.hot.capacity)
        others = await asyncio.to_thread(self.hot_published) if self.hot_published is not None else []
        tops = [self.hot.top(spec.name)] + [published[spec.name] for published in others if spec.name in published]
        return pb.GetHotKeysResponse(keys=[
            pb.HotKey(key=key, count=count, error=error, version=version, tenant=tenant, text=text)
            for key, count, error, version, tenant, text in hot_keys.merge_tops(tops, limit)])

    async def list_models(self) -> pb.ListModelsResponse:
        engines: dict[str, list[pb.EngineInfo]] = {}
        for stats in await self._worker_stats():
            for info in stats.engines:
                engines.setdefault(info.model, []).append(pb.EngineInfo(
                    model=info.model, version=info.version, runtime=info.runtime, precision=info.precision,
                    device=info.device, worker=stats.index))
        return pb.ListModelsResponse(models=[
            pb.ModelInfo(
                name=m.name, serving_version=m.serving_version, versions=m.versions, task=m.task,
                outputs=m.outputs, max_text_chars=m.max_text_chars, buckets=m.buckets, ttl_s=m.ttl_s,
                engines=engines.get(m.name, []), max_batch_texts=self.config.server.max_batch_texts,
            )
            for m in self.repository.servable()
        ])


class FrontendServicer(infercache_pb2_grpc.InferenceCacheServicer):
    """Each call is authenticated (server/auth.py) before its request is looked at."""

    def __init__(self, core: FrontendCore, gate: Gate) -> None:
        self.core = core
        self.gate = gate
        self.calls = 0  # calls begun: a drain waits until it stops moving (see _quiesce)

    def _admit(self, request, context, role: str) -> Grant:
        """The caller's grant for a call that needs `role`; then the request must have parsed, and a
        tenant-bound token's tenant is filled in (or another tenant refused)."""
        grant = self._grant(context, role)
        self._bind(grant, request)
        return grant

    def _grant(self, context, role: str) -> Grant:
        self.calls += 1
        return self.gate.admit(context, role)

    @staticmethod
    def _bind(grant: Grant, request) -> None:
        parsed(request)
        if grant.tenant is not None and hasattr(request, "tenant"):
            bind_tenant(grant, request)

    @grpc_errors
    async def Infer(self, request: bytes, context):
        """`request` arrives serialized (add_servicer): FrontendCore.prepared parses it, unless it repeats
        a request already seen. A tenant-bound token's request is parsed here, to bind its tenant."""
        grant = self._grant(context, CLIENT)
        if grant.tenant is not None:
            request = _INFER_REQUEST(request)
            self._bind(grant, request)
        if self.core.metrics is None:
            return await self.core.infer(request, context.time_remaining())
        return await self._measured(self.core.infer, request, context, 1)

    @grpc_errors
    async def InferBatch(self, request, context):
        self._admit(request, context, CLIENT)
        if self.core.metrics is None:
            return await self.core.infer_batch(request, context.time_remaining())
        return await self._measured(self.core.infer_batch, request, context, len(request.texts))

    async def _measured(self, call, request, context, texts: int) -> bytes:
        """A call with /metrics on: its texts by source and status code, and its latency."""
        metrics, started, sources = self.core.metrics, time.perf_counter(), []
        try:
            answer = await call(request, context.time_remaining(), sources)
        except BaseException as exc:
            if isinstance(exc, asyncio.CancelledError):  # gRPC cancels the handler at the client's deadline
                remaining = context.time_remaining()
                code = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
            else:
                code = status_of(exc)[0].name
            metrics.failed(metrics.model_label(self.core.model_named(request)), texts, code,
                           time.perf_counter() - started)
            raise
        metrics.answered(self.core.model_named(request), sources, time.perf_counter() - started)
        return answer

    @grpc_errors
    async def Invalidate(self, request, context):
        self._admit(request, context, ADMIN)
        return await self.core.invalidate(request, context.time_remaining())

    @grpc_errors
    async def GetStats(self, request, context):
        grant = self._admit(request, context, CLIENT)
        return await self.core.stats(full=grant.role == ADMIN)

    @grpc_errors
    async def ListModels(self, request, context):
        self._admit(request, context, CLIENT)
        return await self.core.list_models()

    @grpc_errors
    async def GetHotKeys(self, request, context):
        self._admit(request, context, ADMIN)
        return await self.core.hot_keys(request)


def _copy_item(item, *, model: str, version: str, tenant: str, key: bytes, raw: bytes, source: int) -> None:
    item.model, item.version, item.tenant, item.key, item.answered_record = model, version, tenant, key, raw
    item.answered_from = source


PASS_THROUGH = ("Infer", "InferBatch")  # handlers that return their answer already serialized
RAW_REQUESTS = ("Infer",)  # handlers that take their request serialized (FrontendCore.prepared)


def add_servicer(servicer: FrontendServicer, server: grpc.aio.Server) -> None:
    """The generated registration, except that Infer and InferBatch answers go out as the bytes their
    handlers compose (no response serializer: the hit path never builds a message), that Infer takes
    its request as bytes (a repeated request is never parsed), and that request bytes that do not parse
    reach the handler as Malformed (INVALID_ARGUMENT, see server/errors.py)."""
    service = pb.DESCRIPTOR.services_by_name["InferenceCache"]
    handlers = {}
    for method in service.methods:
        response = getattr(pb, method.output_type.name)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name),
            request_deserializer=None if method.name in RAW_REQUESTS else lenient(getattr(pb, method.input_type.name)),
            response_serializer=None if method.name in PASS_THROUGH else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def server_options(config: Config) -> list[tuple[str, int]]:
    """The public server's gRPC options. gRPC core holds calls that arrive before the application asks for
    them (grpc.aio asks one at a time) and, past 1,000 such calls, cancels a random share of new ones, up
    to all past 3,000: a burst of a few thousand calls got CANCELLED for requests no client cancelled.
    Raised to server.max_pending_calls (soft and hard limit alike), overload is left to admission
    control, which answers RESOURCE_EXHAUSTED."""
    pending = config.server.max_pending_calls
    return [("grpc.so_reuseport", 1), ("grpc.server.max_pending_requests", pending),
            ("grpc.server.max_pending_requests_hard_limit", pending)]


async def reload_tokens(gate: Gate, path: Path) -> None:
    """At start and on SIGHUP (sent by the supervisor once it changed it): the token set in force, which
    the supervisor alone writes (server/supervisor.py). One that cannot be read keeps the tokens this
    frontend has."""
    try:
        gate.tokens = await asyncio.to_thread(read_in_force, path)
        log.debug("token set in force read: %d token(s)", len(gate.tokens))
    except TokenFileError as exc:
        log.error("token set in force not read, this frontend keeps its tokens: %s", exc)


def listen(server: grpc.aio.Server, address: str, tls: tuple[bytes, bytes, bytes | None] | None) -> int:
    """The public port: plaintext, TLS, or mutual TLS when a client CA is given (clients without a
    certificate it signed fail the handshake). The port number, 0 when it cannot listen."""
    if tls is None:
        return server.add_insecure_port(address)
    cert, key, client_ca = tls
    credentials = grpc.ssl_server_credentials([(key, cert)], root_certificates=client_ca,
                                              require_client_auth=client_ca is not None)
    return server.add_secure_port(address, credentials)


class _Published:
    """This frontend's figures out, the other processes' in, through the files of server/telemetry.py:
    its /metrics snapshot (frontend-N.json, summed by the supervisor) and its hot keys (frontend-N.hot,
    read by the frontend that answers GetHotKeys; apart, so that no scrape parses them, and rewritten
    only when they changed)."""

    def __init__(self, core: FrontendCore, directory: Path, index: int) -> None:
        self.core = core
        self.directory = directory
        self.path = telemetry.snapshot_path(directory, "frontend", index)
        self.hot_path = self.path.with_suffix(".hot")
        self.base = telemetry.predecessor(self.path)  # a restarted frontend continues its counters
        self._hot_written = -1                        # core.hot.changes when last written
        if core.hot is not None:                        # and its hot keys
            core.hot.adopt(telemetry.read_snapshot(self.hot_path) or {})

    def snapshot(self) -> dict:
        core = self.core
        recorded = self.base.plus(core.metrics.recorder) if core.metrics is not None else telemetry.Recorder()
        return recorded.snapshot()

    def _others(self, pattern: str) -> list[dict]:
        found = [telemetry.read_snapshot(path) for path in sorted(self.directory.glob(pattern))
                 if path not in (self.path, self.hot_path)]
        return [snapshot for snapshot in found if snapshot is not None]

    def hot_keys(self) -> list[dict]:
        """The other frontends' published hot keys (in a thread: file reads)."""
        return self._others("frontend-*.hot")

    async def refresh(self) -> None:
        """Before each publish: hits into model time saved at the workers' latest times (their mean per
        bucket where several serve the model), and the hot keys out if they changed."""
        if self.core.metrics is not None:
            seen: dict[tuple[str, str], dict[int, list[float]]] = {}
            for snapshot in await asyncio.to_thread(self._others, "worker-*.json"):
                for name, times in (snapshot.get("means") or {}).items():
                    model, _, version = name.partition(telemetry.MEANS_SEP)
                    for bucket, seconds in times.items():
                        seen.setdefault((model, version), {}).setdefault(int(bucket), []).append(float(seconds))
            self.core.metrics.settle({key: {bucket: sum(values) / len(values) for bucket, values in times.items()}
                                      for key, times in seen.items()})
        hot = self.core.hot
        if hot is not None and hot.changes != self._hot_written:
            self._hot_written = hot.changes
            await asyncio.to_thread(telemetry.write_snapshot, self.hot_path, hot.published())


QUIET_S = 0.25  # a drain's quiet spell: no call begun for this long


async def _quiesce(servicer: FrontendServicer, limit_s: float) -> None:
    """A drain's first step: serve on until no call has begun for QUIET_S (or limit_s passed). gRPC's
    stop cancels the calls its transport already holds but the server has not taken up yet (CANCELLED,
    grpc/grpc#41785), and a loaded frontend can hold a burst of them; each one taken up here is answered."""
    loop = asyncio.get_running_loop()
    until, seen = loop.time() + limit_s, -1
    while servicer.calls != seen and loop.time() < until:
        seen = servicer.calls
        await asyncio.sleep(min(QUIET_S, max(0.0, until - loop.time())))


async def _serve(config: Config, index: int, socket_paths: list[Path], ready, stop: asyncio.Event,
                 metrics_dir: Path | None = None, tokens_path: Path | None = None) -> None:
    repository = ModelRepository(Path(config.server.models_dir), config.cache.max_ttl_s)
    counters: Counter[str] = Counter()
    workers = WorkerPool(socket_paths, wait_s=config.server.worker_wait_s,
                         default_timeout_s=config.server.worker_timeout_s, counters=counters,
                         max_queue_wait_s=config.server.max_queue_wait_s)
    fleet = None
    if config.fleet.redis:  # redis-py is imported only then
        from server.fleet import tier

        fleet = tier.start(config)
    metrics = FrontendMetrics(repository.models) if config.server.metrics_port else None
    hot = HotKeys(config.server.hot_keys) if config.server.hot_keys else None
    core = FrontendCore(config, repository, workers, counters, fleet, metrics, hot)
    core.prepare_models()
    core.l1()
    publisher = None
    if metrics_dir is not None and (metrics is not None or hot is not None):
        published = _Published(core, metrics_dir, index)
        core.hot_published = published.hot_keys
        publisher = telemetry.Publisher(published.path, published.snapshot, published.refresh)
    server = grpc.aio.server(options=server_options(config))
    gate = Gate(config.secrets.tokens)
    servicer = FrontendServicer(core, gate)
    add_servicer(servicer, server)
    if tokens_path is not None:
        loop, reloads = asyncio.get_running_loop(), set()  # tasks referenced until done

        def on_sighup() -> None:
            task = loop.create_task(reload_tokens(gate, tokens_path))
            reloads.add(task)
            task.add_done_callback(reloads.discard)
        loop.add_signal_handler(signal.SIGHUP, on_sighup)
        # After the handler is in place: a change made while this process started reaches it either way.
        await reload_tokens(gate, tokens_path)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.server.host}:{config.server.port}"
    if listen(server, address, config.secrets.tls) == 0:
        raise SystemExit(f"frontend {index}: cannot listen on {address}")
    await server.start()

    async def serving_once_worker_is_up() -> None:
        # Hits are answered from the start; health says SERVING, and the supervisor hears this frontend
        # is ready, once misses can be computed too: its connection to every worker is open (a worker
        # opens its socket only after loading and warming up every engine). Reporting ready before
        # that let a client that started at "ready" meet a frontend still in its reconnect backoff.
        await workers.all_up()
        for service in ("", SERVICE_NAME):
            await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
        process.settle_gc()
        ready.put(("frontend", index, os.getpid()))

    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_task = asyncio.get_running_loop().create_task(serving_once_worker_is_up())
    log.info("frontend %d listening on %s (pid %d)", index, address, os.getpid())
    await stop.wait()
    log.info("draining")
    health_task.cancel()
    await health_servicer.enter_graceful_shutdown()
    started = time.monotonic()
    await _quiesce(servicer, config.server.drain_s / 2)
    await server.stop(max(0.0, config.server.drain_s - (time.monotonic() - started)))
    await workers.close()
    if fleet is not None:
        await fleet.close()
    if publisher is not None:
        await publisher.close()  # the last figures
    log.info("frontend stopped")


def main(config: Config, index: int, socket_paths: list[str], ready, metrics_dir: str | None = None,
         tokens_path: Path | None = None) -> None:
    """Entry point of a spawned frontend process."""
    # The frontends are the parallelism: each tokenizes on its own thread, not on a pool per process.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # a reload that arrives before the loop's handler is not an exit
    process.setup_logging(config.server.log_level, f"frontend-{index}")
    process.run(lambda stop: _serve(config, index, [Path(p) for p in socket_paths], ready, stop,
                                    Path(metrics_dir) if metrics_dir else None, tokens_path))
