"""The benchmarks' own tools, against a real server: the C++ load generator (bench/native/loadgen.cc)."""

from __future__ import annotations

import subprocess

import pytest

from bench.native_load import loadgen, run_each_once_native
from infercache.v1 import infercache_pb2 as pb


@pytest.fixture(scope="module")
def native():
    binary = loadgen()
    if binary is None:
        pytest.skip("the C++ load generator does not build here: needs g++, pkg-config and libgrpc++-dev "
                    "(`make bench-deps`, which `make test` runs as root)")
    return binary


def test_the_native_generator_sends_each_request_once_and_returns_every_answer(native, start_server):
    server = start_server()
    texts = [f"native load generator text {i}" for i in range(300)]
    requests = [pb.InferRequest(model="minilm", text=t, tenant="native") for t in texts]
    first = run_each_once_native(native, server.address, requests, concurrency=8)
    assert (first.requests, first.errors, first.sources) == (300, 0, {"MISS": 300})
    assert len(first.latencies_ms) == 300 and first.latencies_ms.min() > 0 and first.seconds > 0
    bad = [pb.InferRequest(model="no-such-model", text="x", tenant="native")] + requests[:5]
    again = run_each_once_native(native, server.address, bad, concurrency=2)
    assert again.errors == 1 and sum(again.sources.values()) == 5  # an error is counted, not fatal
    assert set(again.sources) <= {"RESULT_EXACT", "COALESCED", "MISS"}


def test_the_native_generator_fails_loudly_without_a_server(native):
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_each_once_native(native, "127.0.0.1:1", [pb.InferRequest(model="minilm", text="x")], concurrency=1,
                             timeout=1.0)
    assert failed.value.returncode == 3  # could not connect
