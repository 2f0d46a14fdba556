"""The benchmarks' own tools, against real servers: the C++ load generator (bench/native/loadgen.cc), the
native gRPC floor (bench/native/floor.cc), the GPU and write-path benches' dry runs, and every section's
dry run through `python -m bench` as `make bench` runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest

from bench.native_load import loadgen, native as native_binary, run_each_once_native, start_floor
from bench.sections import BY_NAME, REGISTRY, SECTIONS
from infercache.v1 import infercache_pb2 as pb
from harness.servers import REPO


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


def test_the_native_floor_answers_every_method_with_its_bytes(tmp_path):
    binary = native_binary("floor")
    if binary is None:
        pytest.skip("the native floor does not build here: needs g++, pkg-config and libgrpc++-dev")
    answer = bytes(range(256)) * 3
    address, proc = start_floor(binary, answer, tmp_path)
    try:
        with grpc.insecure_channel(address) as channel:
            for method in ("/inference.GRPCInferenceService/ModelInfer", "/infercache.v1.InferenceCache/Infer"):
                call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
                assert call(b"any request", timeout=10) == answer
                assert call(b"", timeout=10) == answer
    finally:
        proc.kill()
        proc.wait(10)


def test_the_http_load_processes_send_each_request_once_and_count_every_answer():
    from bench import echo
    from bench.http_load import post, run_http_processes

    address, procs = echo.start(2, echo.http_main, b'{"ok":true}', [(b"x-infercache-source", b"RESULT_EXACT")])
    try:
        host, port = address.rsplit(":", 1)
        requests = [post("/v1/embeddings", b'{"input":"%d"}' % i) for i in range(301)]
        result = run_http_processes(host, int(port), requests, processes=3, concurrency=4)
    finally:
        echo.stop(procs)
    assert (result.requests, result.errors, len(result.latencies_ms)) == (301, 0, 301)
    assert result.seconds > 0 and result.latencies_ms.min() > 0


def test_the_gpu_generate_bench_runs_every_step_on_a_cpu_with_a_tiny_model(tmp_path):
    """bench/generate_gpu.py's dry run: random weights written, the raw loop in its child, the server's waves
    from client processes, the figures and their ratios (torch on the CPU; an H200 runs the real shapes)."""
    pytest.importorskip("torch")
    from bench.generate_gpu import NEW_TOKENS, bench_generate_gpu

    report = bench_generate_gpu(tmp_path, rounds=1, quick=False, models=("tiny",), streams=(1, 3), device="cpu")
    tiny = report["tiny"]
    for n in ("1", "3"):
        assert tiny["raw"][n]["decode_tokens_per_s"] > 0 and tiny["raw"][n]["prefill_s"] > 0
        served = tiny["server"][n]
        assert served["rounds"][0]["tokens"] == int(n) * NEW_TOKENS
        assert served["decode_tokens_per_s"] > 0 and 0 < served["ttft_p50_ms"] <= served["ttft_p99_ms"]
        assert tiny["ratios"][n]["decode_vs_raw"] > 0


def test_the_gpu_prefix_bench_runs_every_step_on_a_cpu_with_a_tiny_model(tmp_path):
    """bench/prefix.py's GPU part, dry: tiers (computed, device, host, disk after a restart), waves with the
    cache on and off, conversations; every figure there (torch on the CPU; an H200 runs the 8B shape)."""
    pytest.importorskip("torch")
    from bench.prefix import bench_prefix_gpu

    report = bench_prefix_gpu(tmp_path, rounds=1, quick=True, report={}, arch_name="tiny", device="cpu")
    tiers = report["tiers"]
    assert set(tiers["ratios"]) == {"device", "host", "disk"} and all(v > 0 for v in tiers["ratios"].values())
    assert tiers["reused_tokens"]["memory"] > 0 and tiers["reused_tokens"]["disk"] > 0
    assert set(tiers["decoder_alone_ms"]) == {"computed", "device", "host"}
    assert all(v > 0 for v in tiers["decoder_alone_ms"].values()) and set(tiers["server_adds_ms"]) == {"computed", "device", "host"}
    assert report["no_reuse"]["decode_ratio_on_off"] > 0
    conversations = report["conversations"]
    assert conversations["reused_tokens"] > 0 and conversations["off_over_on"] > 0


def test_the_write_path_bench_commits_every_put_under_both_flush_settings(tmp_path):
    """A dry run of `--sections write` (few puts), with this commit as the baseline (checked out beside the
    tree, run from there): every put is committed, none dropped, the interval setting flushes without a
    flush per commit, and the reads beside it found every entry."""
    from bench.write_path import bench_write_path

    result = bench_write_path(tmp_path, rounds=1, quick=True, puts=2_000, read_s=0.5, baseline="HEAD")
    for name in ("per_commit", "interval", "baseline"):
        (row,) = result["writer"][name]
        assert row["puts"] == 2_000 and row["dropped"] == 0 and row["reads_writing"] > 0
        assert row["writer_cpu_us_per_put"] > 0
    assert result["writer"]["interval"][0]["disk_flushes"] >= 1
    assert result["writer"]["per_commit"][0]["disk_flushes"] == 0
    assert result["ceiling"]["per_commit"][0] > 0 and result["ceiling"]["interval"][0] > 0
    assert result["ratios"]["writer_over_baseline"] > 0


def test_every_registered_section_has_a_runner():
    """Each entry of bench/sections.py names a module whose section(run) runs it (its source read, not
    imported: some load KServe's messages, which tritonclient's clash with in one process)."""
    for section in REGISTRY:
        source = (REPO / (section.module.replace(".", "/") + ".py")).read_text()
        assert "\ndef section(run: Run) -> None:" in source, section.name
        for key in section.parts:
            assert f'"{key}"' in source, (section.name, key)


@pytest.mark.parametrize("section", SECTIONS)
def test_each_section_runs_every_step_in_a_dry_run(section, tmp_path):
    """`make bench ARGS="--dry-run --sections <section>"`: every step at its smallest, in a process of its own
    as `make bench` runs it, its file where a trial run's go (BENCH_RESULTS: here a temporary folder)."""
    from bench import banking77_missing, machine

    entry = BY_NAME[section]
    if entry.banking77 and banking77_missing():
        pytest.skip(banking77_missing())
    env = {**{k: v for k, v in os.environ.items() if k != "BENCH_COMMAND"}, "BENCH_RESULTS": str(tmp_path / "results")}
    run = subprocess.run([sys.executable, "-m", "bench", "--dry-run", "--sections", section], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert "Traceback" not in run.stderr, run.stderr[-4000:]
    tag = machine()["tag"]
    for key in entry.parts:
        path = tmp_path / "results" / f"{entry.file_stem}-dry-{tag}.json"  # (result_path, under this BENCH_RESULTS)
        assert str(path) in run.stdout.splitlines()[-1]  # `wrote ...`
        report = json.loads(path.read_text())
        assert report["recorded"]["command"].endswith(f"--dry-run --sections {section}")
        assert report[key], f"{key}: {report[key]!r}"
        if set(report[key]) == {"skipped"}:
            pytest.skip(f"{section}: {report[key]['skipped']}")


def test_trial_runs_write_where_git_ignores_them():
    from bench.sections import result_path

    for trial in ("quick", "dry"):
        path = result_path("serving", "2core", trial)
        assert path.name == f"serving-{trial}-2core.json"
        if "BENCH_RESULTS" not in os.environ:
            assert path.parent == REPO / "var" / "bench"
            ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO)
            assert ignored.returncode == 0, f"{path} would show as an untracked file"
    assert result_path("serving", "2core") == REPO / "bench" / "results" / "serving-2core.json" \
        or "BENCH_RESULTS" in os.environ
