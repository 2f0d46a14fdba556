"""Semantic tier of the inference worker: near-duplicate requests answered from cached entries.

One hnswlib index per namespace (tenant, model, version), so tenants never match each other. One
thread owns every index (lookups, inserts, deletions, resizes, snapshots run there in order), so the
event loop never blocks on them. Entries come from the write-behind after each commit; the semantic
log in LMDB is the source of truth, and an index is rebuilt on start from its snapshot plus the log
rows the snapshot lacks. Until that finishes, lookups report no neighbours (requests just miss).
With encryption at rest on, no snapshot is written (an hnswlib file holds the embeddings in clear) and
any left from before is deleted: indexes are rebuilt from the sealed log alone.

The same thread keeps a cache-wide fit of the model's scores (server/shared/surrogate.py) for each namespace that
a calibrated search has asked for: built from its indexed entries at the first such search (that search
goes without it), then fed every entry indexed after.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import hnswlib
import numpy as np
from google.protobuf.message import DecodeError

from cachestore import records
from cachestore import semantic_log as log_rows
from cachestore.env import DB_RESULTS, DIR_MODE, FILE_MODE, Store
from cachestore.errors import CorruptRecord
from cachestore.log_limit import RateLimitedLog
from cachestore.results import now_us
from cachestore.semantic_log import Row
from infercache.v1 import infercache_pb2 as pb
from server.shared.match_policy import Assessment, Neighbor, assess
from server.shared.surrogate import Surrogate

log = logging.getLogger("infercache.semantic")

INITIAL_CAPACITY = 1024
HISTOGRAM_EDGES = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95, 0.98)
# Entries whose embedding and class scores searches keep decoded (an LRU over every namespace, about
# 2 KB each for MiniLM and 77 classes): reading them from hnswlib and the store each time cost about
# 0.4 ms of every calibrated lookup.
MEMO_ENTRIES = 16384
# Namespaces with a fit of the model's scores (about 1.7 MB each for MiniLM and 77 classes); the rule goes
# without the fit's agreement in a namespace beyond them (counted: fits_refused).
MAX_FITS = 64
FIT_CHUNK = 4096  # entries added to a fit at once when it is built (float64 rows: about 12 MB)
MAX_CLASSES = 4096  # a scores output longer than this is not fitted (its map would be dim x classes doubles)


class _Index:
    """One namespace: the hnswlib graph plus label -> (key, answer) of its live entries."""

    def __init__(self, dim: int, capacity: int = INITIAL_CAPACITY, snapshot: Path | None = None) -> None:
        self.dim = dim
        self.graph = hnswlib.Index(space="ip", dim=dim)  # unit vectors: inner product = cosine
        if snapshot is None:
            self.graph.init_index(max_elements=capacity, ef_construction=128, M=16)
        else:
            self.graph.load_index(str(snapshot), max_elements=capacity)
        self.graph.set_ef(64)
        self.rows: dict[int, tuple[bytes, str]] = {}

    def add(self, rows: list[Row]) -> list[Row]:
        """Indexes the rows; returns those that were not indexed yet."""
        fresh = [r for r in rows if r.label not in self.rows]
        needed = self.graph.element_count + len(fresh)
        if needed > self.graph.get_max_elements():  # grow in place; lookups wait a moment, never fail
            self.graph.resize_index(max(needed, 2 * self.graph.get_max_elements()))
        if fresh:
            self.graph.add_items(np.stack([r.embedding for r in fresh]), [r.label for r in fresh])
        for row in rows:
            self.rows[row.label] = (row.key, row.answer)
        return fresh

    def remove(self, label: int) -> bool:
        if self.rows.pop(label, None) is None:
            return False
        self.graph.mark_deleted(label)
        return True

    def search(self, vector: np.ndarray, k: int, alive) -> list[tuple[int, Neighbor]]:
        """The k nearest live entries with their labels; entries whose record is gone or expired
        (another worker swept, evicted or invalidated them: only the worker that deletes hears of it)
        leave the index here. `alive(key)`: whether the entry's record is there and unexpired."""
        k = min(k, len(self.rows))
        while k > 0:
            try:
                labels, distances = self.graph.knn_query(vector.reshape(1, -1), k=k)
                break
            except RuntimeError:  # too few reachable live elements for k (many deleted): ask for fewer
                k -= 1
        if k == 0:
            return []
        out = []
        for label, distance in zip(labels[0], distances[0]):
            if int(label) in self.rows:
                key, answer = self.rows[int(label)]
                if not alive(key):
                    self.remove(int(label))
                    continue
                out.append((int(label), Neighbor(float(1.0 - distance), key, answer)))
        return out


class SemanticTier:
    def __init__(self, store: Store, snapshot_dir: Path, dim: int) -> None:
        self.store = store
        self.snapshot_dir = snapshot_dir
        self.snapshots = store.ring is None  # see the module docstring
        self.dim = dim
        self.ready = False
        # One writer each: lookups count on the event loop, the index on its owner thread; GetStats
        # reads their sum (`counters`).
        self._lookups: Counter[str] = Counter()
        self._index_counters: Counter[str] = Counter()
        self._indexes: dict[bytes, _Index] = {}
        # (ns_id, label) -> (the record's header when decoded, embedding, class scores); the owner thread's
        self._memo: OrderedDict[tuple[bytes, int], tuple[bytes, np.ndarray, np.ndarray]] = OrderedDict()
        self._fits: dict[bytes, Surrogate] = {}  # the owner thread's, as is:
        self._asked: set[bytes] = set()           # namespaces a calibrated search asked a fit of
        self._owner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="semantic")
        self._search_failed = RateLimitedLog(log)  # (a damaged store fails every search that reads it)

    @property
    def counters(self) -> Counter[str]:
        merged = Counter(self._lookups)
        merged.update(self._index_counters)  # (not `+`: that drops zeros such as rebuild_ms=0)
        return merged

    def entries(self) -> int:
        """Rows in every namespace's index (read from any thread: sizes of dicts only)."""
        return sum(len(index.rows) for index in list(self._indexes.values()))

    # ---- called from the event loop -----------------------------------------------------------------

    def start(self) -> asyncio.Future:
        """Rebuilds every index in the background (exact hits and misses are served meanwhile)."""
        return asyncio.get_running_loop().run_in_executor(self._owner, self._load_all)

    async def search(self, ns_id: bytes, vector: np.ndarray, k: int, labels: list[str] | None = None
                     ) -> tuple[list[Neighbor], Assessment | None]:
        """The k nearest live entries; with the model's `labels` (the calibrated rule), also what their
        class scores say of the query (match_policy.assess), None when fewer than two could tell."""
        if not self.ready:
            self._lookups["lookups_before_ready"] += 1
            return [], None
        try:
            neighbors, assessment = await asyncio.get_running_loop().run_in_executor(
                self._owner, self._search, ns_id, vector, k, labels)
        except Exception:  # a failed search is a miss, never a failed request
            self._lookups["search_errors"] += 1
            self._search_failed(logging.ERROR, "semantic search failed; answering as a miss", exc_info=True)
            return [], None
        self._observe(neighbors)
        return neighbors, assessment

    def _observe(self, neighbors: list[Neighbor]) -> None:
        """Histogram of the nearest similarity of every lookup, hit or miss (GetStats)."""
        self._lookups["lookups"] += 1
        if not neighbors:
            self._lookups["nearest.none"] += 1
            return
        nearest = neighbors[0].similarity
        lower = max((e for e in HISTOGRAM_EDGES if nearest >= e), default=0.0)
        self._lookups[f"nearest.ge_{lower:.2f}"] += 1

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._owner, self._snapshot_all)
        self._owner.shutdown(wait=True)

    def use_store(self, store: Store) -> None:
        """The store was replaced by a fresh one (its writer found it damaged): every index starts empty,
        and fills with the fresh store's rows (applied after this, in order)."""
        self._owner.submit(self._reset, store)

    # ---- called from the write-behind thread after each commit ----------------------------------------

    def apply(self, added: list[Row], removed: list[tuple[bytes, int]]) -> None:
        try:
            self._owner.submit(self._apply, added, removed)
        except RuntimeError:  # shut down: these rows are in the LMDB log, the next start indexes them
            log.info("%d semantic index update(s) after shutdown are left to the next start", len(added) + len(removed))

    # ---- the owner thread ---------------------------------------------------------------------------

    def _reset(self, store: Store) -> None:
        self.store = store
        self._indexes.clear()
        self._memo.clear()
        self._fits.clear()
        self._asked.clear()
        self._index_counters["store_replaced"] += 1
        self.ready = True  # (an empty store: nothing to rebuild)

    def _index(self, ns_id: bytes) -> _Index:
        index = self._indexes.get(ns_id)
        if index is None:
            index = self._indexes[ns_id] = _Index(self.dim)
        return index

    def _search(self, ns_id: bytes, vector: np.ndarray, k: int, labels: list[str] | None
                ) -> tuple[list[Neighbor], Assessment | None]:
        index = self._indexes.get(ns_id)
        if index is None:
            return [], None
        now = now_us()
        results_db = self.store.dbs[DB_RESULTS]
        raws: dict[bytes, memoryview] = {}
        with self.store.begin(buffers=True) as txn:
            def alive(key: bytes) -> bool:
                raw = txn.get(key, db=results_db)
                if raw is None:
                    return False
                try:
                    _, expires = records.decode_times(raw)
                except CorruptRecord:
                    return False
                raws[key] = raw
                return not expires or expires > now

            before = len(index.rows)
            found = index.search(vector, k, alive)
            self._index_counters["stale_dropped"] += before - len(index.rows)
            assessment = self._assess(ns_id, index, raws, vector, found, labels) if labels else None
        return [n for _, n in found], assessment

    def _fitted(self, ns_id: bytes, vector: np.ndarray, labels: list[str]) -> str | None:
        """What the namespace's fit answers at `vector` (None while it has none, or none ready). The first
        ask builds it from the indexed entries, as a task of its own after this search."""
        if ns_id not in self._asked:
            self._asked.add(ns_id)
            try:
                self._owner.submit(self._build_fit, ns_id)
            except RuntimeError:  # shutting down
                pass
        fit = self._fits.get(ns_id)
        if fit is None or not fit.ready or fit.classes != len(labels):
            return None
        try:
            return labels[fit.answer(vector)]
        except (np.linalg.LinAlgError, ValueError):  # a fit that cannot answer is no fit; a lost match at most
            self._index_counters["fit_errors"] += 1
            return None

    def _assess(self, ns_id: bytes, index: _Index, raws: dict[bytes, memoryview], vector: np.ndarray,
                found: list[tuple[int, Neighbor]], labels: list[str]) -> Assessment | None:
        """Interpolates the found entries' stored class scores at the query (entries whose record
        does not open, or carries no scores of the model's shape, are left out). Inside the read
        transaction: `raws` are its buffers."""
        vectors, scores = [], []
        for label, neighbor in found:
            known = self._decoded(ns_id, index, label, neighbor.key, raws[neighbor.key], len(labels))
            if known is None:
                self._index_counters["assess_unusable"] += 1  # a lost match, never a wrong one
                continue
            vectors.append(known[0])
            scores.append(known[1])
        if len(vectors) < 2:
            return None
        return assess(vector, np.stack(vectors), np.stack(scores), labels, self._fitted(ns_id, vector, labels))

    def _decoded(self, ns_id: bytes, index: _Index, label: int, key: bytes, raw: memoryview,
                 classes: int) -> tuple[np.ndarray, np.ndarray] | None:
        """An entry's embedding and class scores: from the memo while its record is the one they were
        read from (another worker of the host may have rewritten it without this index hearing of it),
        else read and remembered."""
        memo_key = (ns_id, label)
        known = self._memo.get(memo_key)
        if known is not None and known[0] == bytes(raw[:records.HEADER.size]):  # (a namespace is one model version)
            self._memo.move_to_end(memo_key)
            return known[1], known[2]
        values = self._scores(raw, key)
        if values is None or values.shape != (classes,):
            return None
        embedding = np.asarray(index.graph.get_items([label])[0], dtype=np.float32)
        self._remember(memo_key, raw, embedding, values)
        return embedding, values

    def _scores(self, raw: memoryview, key: bytes) -> np.ndarray | None:
        """The class scores in an entry's record (None: it does not open, or carries none)."""
        try:
            record = records.decode(raw, key, self.store.ring)
            response = pb.InferResponse.FromString(record.payload)
            tensor = next(t for t in response.outputs if t.name == "scores")
            values = np.frombuffer(tensor.data, dtype=np.dtype(tensor.dtype)).astype(np.float32)
        except (CorruptRecord, DecodeError, StopIteration, TypeError, ValueError):
            return None
        return values if values.ndim == 1 and np.all(np.isfinite(values)) else None

    def _remember(self, memo_key: tuple[bytes, int], raw: memoryview, embedding: np.ndarray, values: np.ndarray) -> None:
        self._memo[memo_key] = (bytes(raw[:records.HEADER.size]), embedding, values)
        self._memo.move_to_end(memo_key)
        if len(self._memo) > MEMO_ENTRIES:
            self._memo.popitem(last=False)

    def _build_fit(self, ns_id: bytes) -> None:
        index = self._indexes.get(ns_id)
        if index is None or ns_id in self._fits:
            return
        labels = list(index.rows)
        for start in range(0, len(labels), FIT_CHUNK):
            chunk = labels[start:start + FIT_CHUNK]
            embeddings = np.asarray(index.graph.get_items(chunk), dtype=np.float32)
            self._learn(ns_id, [(label, index.rows[label][0], e) for label, e in zip(chunk, embeddings)],
                        remember=False)

    def _learn(self, ns_id: bytes, entries: list[tuple[int, bytes, np.ndarray]], remember: bool = True) -> None:
        """Adds (label, key, embedding) entries whose records carry class scores to the namespace's fit
        (and, with `remember`, their decoded form to the memo: new entries are searched soon). Any failure
        drops the fit (the rule goes without it) and never reaches the index's own updates."""
        try:
            fit = self._fits.get(ns_id)
            classes = fit.classes if fit is not None else None
            embeddings, scores = [], []
            with self.store.begin(buffers=True) as txn:
                for label, key, embedding in entries:
                    embedding = np.asarray(embedding, dtype=np.float32)
                    raw = txn.get(key, db=self.store.dbs[DB_RESULTS])
                    values = None if raw is None else self._scores(raw, key)
                    if values is None or not 0 < len(values) <= MAX_CLASSES or not np.all(np.isfinite(embedding)):
                        continue  # no scores (gone since it was written, or another kind of answer)
                    if classes is None:
                        classes = len(values)
                    elif len(values) != classes:
                        self._index_counters["fit_mismatched"] += 1
                        continue
                    if remember:
                        self._remember((ns_id, label), raw, embedding, values)
                    embeddings.append(embedding)
                    scores.append(values)
            if not scores:
                return
            if fit is None:
                if len(self._fits) >= MAX_FITS:
                    self._index_counters["fits_refused"] += 1
                    return
                fit = self._fits[ns_id] = Surrogate(self.dim, classes)
            fit.add(np.stack(embeddings), np.stack(scores))
            self._index_counters["fit_rows"] += len(scores)
        except Exception:
            self._fits.pop(ns_id, None)
            self._index_counters["fit_errors"] += 1
            log.exception("semantic fit of %s dropped (its calibrated rule goes without it)", ns_id.hex())

    def _apply(self, added: list[Row], removed: list[tuple[bytes, int]]) -> None:
        try:
            unindexed = 0
            for ns_id, label in removed:
                self._memo.pop((ns_id, label), None)
                if ns_id in self._indexes:
                    unindexed += self._indexes[ns_id].remove(label)
                    if not self._indexes[ns_id].rows:  # emptied: the next calibrated search fits it anew
                        self._fits.pop(ns_id, None)
                        self._asked.discard(ns_id)
            by_ns: dict[bytes, list[Row]] = {}
            for row in added:
                by_ns.setdefault(row.ns_id, []).append(row)
            for ns_id, rows in by_ns.items():
                fresh = self._index(ns_id).add(rows)
                if ns_id in self._fits:
                    self._learn(ns_id, [(row.label, row.key, row.embedding) for row in fresh])
            self._index_counters["indexed"] += len(added)
            self._index_counters["unindexed"] += unindexed
        except Exception:  # a failed index update loses matches, never answers
            self._index_counters["index_errors"] += 1
            log.exception("semantic index update failed")

    def _snapshot_path(self, ns_id: bytes) -> Path:
        return self.snapshot_dir / f"{ns_id.hex()}.hnsw"

    def _load_all(self) -> None:
        started = time.monotonic()
        if not self.snapshots and self.snapshot_dir.exists():
            shutil.rmtree(self.snapshot_dir, ignore_errors=True)
            log.info("encryption at rest is on: deleted the semantic snapshots in clear (%s)", self.snapshot_dir)
        try:
            with self.store.begin() as txn:
                spaces = log_rows.namespaces(self.store, txn)
            for ns_id in spaces:
                self._load(ns_id)
        except Exception:
            self._index_counters["index_errors"] += 1
            log.exception("semantic index rebuild failed; serving exact matches only")
            return
        self.ready = True
        total = sum(len(i.rows) for i in self._indexes.values())
        self._index_counters["rebuild_ms"] = int((time.monotonic() - started) * 1000)
        log.info("semantic indexes ready: %d namespaces, %d entries in %.2f s", len(self._indexes), total,
                 time.monotonic() - started)

    def _load(self, ns_id: bytes) -> None:
        index = self._try_snapshot(ns_id)
        in_graph = set(index.graph.get_ids_list()) if index is not None else set()
        with self.store.begin(buffers=True) as txn:
            rows = list(log_rows.scan(self.store, txn, ns_id))
        if index is None:
            index = _Index(self.dim, max(INITIAL_CAPACITY, 2 * len(rows)))
        live = {row.label for row in rows}
        tail = [row for row in rows if row.label not in in_graph]
        index.rows = {row.label: (row.key, row.answer) for row in rows if row.label in in_graph}
        for label in in_graph - live:  # deleted since the snapshot
            try:
                index.graph.mark_deleted(label)
            except RuntimeError:
                pass  # already marked in the snapshot
        index.add(tail)
        self._indexes[ns_id] = index
        self._index_counters["rebuilt_from_log"] += len(tail)
        self._index_counters["rebuilt_from_snapshot"] += len(rows) - len(tail)

    def _try_snapshot(self, ns_id: bytes) -> _Index | None:
        if not self.snapshots:
            return None
        path = self._snapshot_path(ns_id)
        meta_path = path.with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text())
            if meta.get("store_id") != self.store.store_id or meta.get("dim") != self.dim:
                return None
            return _Index(self.dim, max(INITIAL_CAPACITY, int(meta["capacity"])), snapshot=path)
        except (OSError, ValueError, KeyError, RuntimeError):
            return None

    def _snapshot_all(self) -> None:
        if not self.snapshots:
            return
        self.snapshot_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        for ns_id, index in self._indexes.items():
            path = self._snapshot_path(ns_id)
            try:
                tmp = path.with_suffix(".tmp")
                index.graph.save_index(str(tmp))
                tmp.chmod(FILE_MODE)
                tmp.replace(path)
                meta = {"store_id": self.store.store_id, "dim": self.dim, "capacity": index.graph.get_max_elements()}
                path.with_suffix(".json").write_text(json.dumps(meta))
            except (OSError, RuntimeError):
                log.exception("semantic snapshot of %s failed (the next start rebuilds from the log)", ns_id.hex())
