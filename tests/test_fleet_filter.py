"""The pod's Bloom filter of fleet keys (server/fleet/key_filter.py): with two real servers on a real
Redis, a miss nobody computed skips the lookup, another pod's key is looked up, and the false negatives
the design allows cost what it says."""

from __future__ import annotations

import os
import struct
import time
from collections import Counter

import pytest

from server.fleet import key_filter
from harness import redis_servers
from tests.helpers import unique
from tests.test_fleet import entry, pods, redis_server, until  # noqa: F401 (fixtures)

pytestmark = pytest.mark.skipif(redis_servers.available() is not None, reason=redis_servers.available() or "")


def frontend(server, name: str) -> int:
    return int(server.stats().frontend.counters.get(f"fleet.{name}", 0))


def worker(server, name: str) -> int:
    return sum(int(w.counters.get(name, 0)) for w in server.stats().workers)


def test_false_positives_stay_near_the_configured_rate_at_capacity():
    m, k = key_filter.sized(100_000, 0.01)
    assert (m, k) == (958_506, 7)  # 9.6 bits a key: 1.14 MiB per million keys
    bits = key_filter.Bits(m, k)
    held = [key_filter.digest(f"icache:r:{{{os.urandom(24).hex()}:0}}") for _ in range(100_000)]
    bits.add(b"".join(held))
    assert all(bits.may_hold(d) for d in held)  # no false negative for a key it was told of
    absent = sum(bits.may_hold(key_filter.digest(f"never written {n}")) for n in range(20_000))
    assert 0.005 < absent / 20_000 < 0.02


def test_a_reader_uses_only_a_filter_whose_owner_stamps_it(tmp_path):
    m, k = key_filter.sized(1000, 0.01)
    path = tmp_path / key_filter.FILE_NAME
    path.write_bytes(key_filter.HEADER.pack(key_filter.MAGIC, m, k, 0, time.time_ns() // 1000) + bytes((m + 7) // 8))
    reader = key_filter.Reader(path, Counter())
    assert reader.absent("icache:r:{00:0}")  # empty and freshly stamped: rules everything out
    with open(path, "r+b") as f:  # the owner stopped stamping (dead, or its subscription lost)
        f.seek(key_filter.STAMP_OFFSET)
        f.write(struct.pack("<q", time.time_ns() // 1000 - int(key_filter.STALE_S * 2e6)))
    reader._check_at = 0
    assert not reader.absent("icache:r:{00:0}")  # stale: every key is looked up, as without a filter
    reader.close()


def test_misses_skip_the_lookup_and_other_pods_keys_are_found(redis_server, pods):
    import redis

    a, b = pods(redis_server.url, settings=("fleet.key_filter_refresh_s=2",))
    known, new = unique("computed by pod a"), unique("nobody asked this")
    with a.client() as client_a, b.client() as client_b:
        # (the frontend looks at the filter's stamp when it looks a key up)
        until(lambda: client_b.infer("minilm", "warming up", mode="NO_STORE") and
              frontend(b, "key_filter_usable") == 1)
        assert client_a.infer("minilm", known).source == "MISS"
        until(lambda: redis.Redis(port=redis_server.port).exists(f"icache:r:{{{entry(known).hex()}:0}}"))

        def found_by_b_frontend():  # a's key reaches b's filter one broadcast after it is written
            return client_b.infer("minilm", known, mode="NO_STORE").source == "RESULT_FLEET" \
                and frontend(b, "hits") >= 1
        until(found_by_b_frontend)
        skipped = frontend(b, "key_filter_skipped")
        assert client_b.infer("minilm", new).source == "MISS"
        assert frontend(b, "key_filter_skipped") == skipped + 1  # no round trip for it

        # False negatives: records set in Redis behind the pods' backs (no broadcast), as one written
        # while this pod's subscription was down.
        store = redis.Redis(port=redis_server.port)
        record = store.get(f"icache:r:{{{entry(known).hex()}:0}}")
        stored, private = unique("set behind the filter"), unique("set behind the filter too")
        for text in (stored, private):
            store.set(f"icache:r:{{{entry(text).hex()}:0}}", record, px=600_000)
        computed, rebuilds = worker(b, "worker.computed"), worker(b, "fleet.key_filter_rebuilds")
        # A request that stores takes the key's lease, and that step finds the record: no recompute.
        assert client_b.infer("minilm", stored).source == "RESULT_FLEET"
        assert worker(b, "worker.computed") == computed
        # A NO_STORE request takes no lease: the one recompute the design allows, until the next rebuild.
        source = client_b.infer("minilm", private, mode="NO_STORE").source
        if worker(b, "fleet.key_filter_rebuilds") == rebuilds:  # (no rebuild came in between)
            assert source == "MISS" and worker(b, "worker.computed") == computed + 1
        # The rebuild (every 2 s here) scans Redis: then b's frontend finds it.
        until(lambda: client_b.infer("minilm", private, mode="NO_STORE").source == "RESULT_FLEET")
        store.close()
