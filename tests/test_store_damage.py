"""A store whose pages are damaged while its meta pages are intact (nothing to see at start): the first
read or write that meets the damage has the writer set the store aside and start a fresh one while the
server serves. It used to stop caching for good: every write transaction failed (a traceback each) and
every failed read logged a warning of its own."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from cachestore import integrity, records
from cachestore.env import Store, StoreSettings
from cachestore.keys import Namespace, entry_key, parse_hex_key
from cachestore.results import ResultCache, now_us
from cachestore.writer import WriteBehind
from harness.servers import REPO, link_model, settled
from tests.helpers import unique, wait_cached, wait_for

MODEL = "minilm"
PAGE = 4096
STRIDE = 256 * 1024


def damage(data: Path, seed: int = 7) -> int:
    """Overwrites one random 4 KB page in every 256 KB of the file past the first (the meta pages stay);
    returns how many."""
    rng, size, count = random.Random(seed), data.stat().st_size, 0
    with open(data, "r+b") as f:
        for start in range(STRIDE, size - PAGE, STRIDE):
            f.seek(start + rng.randrange(0, (STRIDE - PAGE) // PAGE) * PAGE)
            f.write(rng.randbytes(PAGE))
            count += 1
    return count


def _same(embedding: np.ndarray, stored: bytes) -> bool:
    """The same text's answer (computed again in another batch, it differs in the last bits only)."""
    return np.allclose(embedding, np.frombuffer(stored, dtype=np.float32), atol=1e-5)


def _settings(path: Path) -> StoreSettings:
    return StoreSettings(path, 64 << 20, 48 << 20, sync=False)


def test_a_write_that_meets_damage_replaces_the_store_and_lands_in_the_fresh_one(tmp_path, caplog):
    ns = Namespace("tenant", "model", "1")
    path = tmp_path / "cache"
    store = Store(_settings(path), readonly=False)
    writer = WriteBehind(store)
    keys = [entry_key(ns.ns_id, f"text {i}") for i in range(3000)]
    for key in keys:
        writer.put(key, ns, records.Record(now_us(), 0, os.urandom(1500)))
    writer.flush().result()
    writer.close()
    store.close()
    assert damage(path / "data.mdb") >= 10 and integrity.problem(path) is None  # nothing shows at start

    told: list[str] = []
    store = Store(_settings(path), readonly=False)
    writer = WriteBehind(store, threaded=False, what="result store", on_replaced=told.append)
    fresh = [entry_key(ns.ns_id, f"after {i}") for i in range(50)]
    for round_ in range(20):  # puts over the whole key space, until one meets a damaged page
        for key in random.Random(round_).sample(keys, 100) + fresh:
            writer.put(key, ns, records.Record(now_us(), 0, b"answer"))
        writer.drain()
        if told:
            break
    assert len(told) == 1 and ("MDB_CORRUPTED" in told[0] or "MDB_PAGE_NOTFOUND" in told[0]), told
    assert writer.counters["replaced"] == 1 and writer.store is not store
    [aside] = tmp_path.glob("cache.damaged-*")
    assert (aside / "data.mdb").is_file() and (path / "data.mdb").is_file()
    cache = ResultCache(writer.store)  # (one process opens an environment once: the writer's handle)
    assert all(cache.get(key, now_us()) is not None for key in fresh)  # the failed batch, in the fresh store
    writer.close()
    writer.store.close()
    failures = [r for r in caplog.records if "write-behind failed" in r.getMessage()]
    assert len(failures) <= 1, [r.getMessage() for r in failures]  # rate-limited (one per FAILURE_LOG_S)


def test_a_store_damaged_while_stopped_is_replaced_while_serving_and_caching_goes_on(start_server, tmp_path):
    cache_dir = tmp_path / "cache"
    texts = [unique(f"damaged store {i}") for i in range(2500)]
    first = start_server(cache_dir=cache_dir, settings=("cache.sync=false",))
    with first.client(timeout_s=120) as client:
        expected = {}
        for start in range(0, len(texts), 100):
            for text, result in zip(texts[start:start + 100], client.infer_batch(MODEL, texts[start:start + 100])):
                expected[text] = result.outputs["embedding"].tobytes()
        wait_cached(client, MODEL, texts[-1])
    assert first.stop() == 0
    assert damage(cache_dir / "data.mdb") >= 10

    server = start_server(cache_dir=cache_dir, settings=("cache.sync=false",))
    # Its meta pages are sound: the start-up check passes it. (The writer's start-up sweep may meet the
    # damage already; that is a run-time finding, handled like any other.)
    assert "store damaged" not in server.log_text().replace("result store damaged (at run time", "")
    with server.client(timeout_s=120) as client:
        for start in range(0, len(texts), 100):  # hits, and misses where the damage is (computed, stored)
            chunk = texts[start:start + 100]
            for text, result in zip(chunk, client.infer_batch(MODEL, chunk)):
                assert _same(result.outputs["embedding"], expected[text]), text  # no wrong answer
            if "result store damaged (at run time" in server.log_text():
                break
        wait_for(lambda: "result store damaged (at run time" in server.log_text(), 60, "the store to be replaced")
        [aside] = tmp_path.glob("cache.damaged-*")
        assert (aside / "data.mdb").stat().st_size > 0
        # Caching goes on: the fresh store takes new answers, and the frontend reads it
        after = [unique("after the damage") for _ in range(20)]
        client.infer_batch(MODEL, after)
        for text in after:
            wait_cached(client, MODEL, text, timeout=30)
            assert client.infer(MODEL, text).source == "RESULT_EXACT"
        again = client.infer(MODEL, texts[0])  # the old entries went with the damaged store
        assert _same(again.outputs["embedding"], expected[texts[0]])
    assert settled(server, "writer.replaced") == 1
    log = server.log_text()
    assert log.count("write-behind failed") <= 3 and log.count("result cache read failed") <= 6, log


def test_a_store_too_damaged_to_open_is_replaced_when_the_writer_opens_it(start_server, tmp_path):
    """Garbage in every page but the two meta pages: the start-up check passes, and opening the store's
    databases meets the damage. It used to be served without a store, every request a miss."""
    cache_dir = tmp_path / "cache"
    first = start_server(cache_dir=cache_dir, settings=("cache.sync=false",))
    with first.client(timeout_s=120) as client:
        client.infer_batch(MODEL, [unique(f"soon garbage {i}") for i in range(100)])
    assert first.stop() == 0
    data = cache_dir / "data.mdb"
    with open(data, "r+b") as f:
        for page in range(2, data.stat().st_size // PAGE):
            f.seek(page * PAGE)
            f.write(random.Random(page).randbytes(PAGE))

    server = start_server(cache_dir=cache_dir)
    text = unique("on the fresh store")
    with server.client() as client:
        assert client.infer(MODEL, text).source == "MISS"
        wait_cached(client, MODEL, text, timeout=30)
    assert "result store damaged (at open:" in server.log_text()
    assert "serving without it" not in server.log_text()
    assert len(list(tmp_path.glob("cache.damaged-*"))) == 1


GEN_VERSION_DIR = REPO / "models" / "smollm2" / "1"


def _damage_sparing(data: Path, key: bytes) -> None:
    """damage(), with the first seed whose damage leaves `key`'s entry readable (its pages untouched)."""
    sound = data.read_bytes()
    for seed in range(100):
        assert damage(data, seed) >= 10
        try:
            store = Store(_settings(data.parent), readonly=True)
        except Exception:  # noqa: BLE001 (this seed damaged what opening reads: the next one)
            store = None
        if store is not None:
            readable = ResultCache(store).get(key, now_us()) is not None
            store.close()
            if readable:
                return
        data.write_bytes(sound)
    raise AssertionError("no seed spared the entry")


@pytest.mark.skipif(not (GEN_VERSION_DIR / "decoder.onnx").is_file(),
                    reason="the generative model is not prepared: run `make model` (make test does)")
def test_generate_reads_the_fresh_store_once_a_damaged_one_is_replaced(start_server, tmp_path):
    """A Generate that misses in the frontend looks the key up once more in the worker (an answer
    committed since): after the writer set the damaged store aside, that lookup reads the fresh store,
    not the one set aside, so an answer stored before the replacement is computed again."""
    from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR

    models = tmp_path / "models"
    link_model(models, MODEL, MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    link_model(models, "smollm2", (REPO / "models" / "smollm2" / "config.yaml").read_text(), {"1": GEN_VERSION_DIR})
    cache_dir = tmp_path / "cache"
    question = unique("How long does a refund take?")
    texts = [unique(f"damaged store {i}") for i in range(2500)]
    first = start_server(models, cache_dir=cache_dir, settings=("cache.sync=false",))
    with first.client(timeout_s=120) as client:
        stored = client.generate("smollm2", question, max_new_tokens=4)
        for start in range(0, len(texts), 100):
            client.infer_batch(MODEL, texts[start:start + 100])
        wait_cached(client, MODEL, texts[-1])
        wait_for(lambda: client.generate("smollm2", question, max_new_tokens=4).source == "RESULT_EXACT", 30,
                 "the answer stored")
    assert first.stop() == 0
    assert stored.source == "MISS"
    _damage_sparing(cache_dir / "data.mdb", parse_hex_key(stored.key))

    server = start_server(models, cache_dir=cache_dir, settings=("cache.sync=false",))
    with server.client(timeout_s=120) as client:
        for start in range(0, len(texts), 100):  # until a read or a write meets the damage
            client.infer_batch(MODEL, texts[start:start + 100])
            if "result store damaged (at run time" in server.log_text():
                break
        wait_for(lambda: "result store damaged (at run time" in server.log_text(), 60, "the store to be replaced")
        # This client's frontend reads the fresh store (it looks at least once a second): an answer stored
        # since is a hit there (ONLY_IF_CACHED is answered by the frontend alone).
        after = unique("after the damage")
        client.infer(MODEL, after)
        wait_cached(client, MODEL, after, timeout=30)
        late_hits = settled(server, "worker.late_hit")
        again = client.generate("smollm2", question, max_new_tokens=4)
    assert again.source == "MISS", again  # not the set-aside store's answer (a late hit, RESULT_EXACT)
    assert again.text == stored.text
    assert settled(server, "worker.late_hit") == late_hits
