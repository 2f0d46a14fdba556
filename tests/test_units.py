"""Normalization, configuration and the error table."""

from __future__ import annotations

import asyncio
import csv
import subprocess
import sys

import grpc
import numpy as np
import pytest

from bench import BANKING77
from infercache.v1 import infercache_pb2 as pb
from server import config
from server.shared import errors
from server.shared.normalize import DEFAULT_STEPS, Normalizer
from harness.servers import REPO


@pytest.mark.parametrize("variant", [
    "How do I return an item?", "how do i return an item", "  HOW   do I return an ITEM!!  ",
    "Ｈｏｗ ｄｏ Ｉ return an item？", "How\u00a0do I return an item…", "how-do-i return an item",
])
def test_variants_normalize_to_one_form(variant):
    assert Normalizer()(variant) == "how do i return an item"


def test_normalization_keeps_what_changes_meaning():
    norm = Normalizer()
    assert norm("return 2 items") != norm("return 3 items")
    assert norm("Straße") == norm("STRASSE")  # case folding, not just lower()
    assert norm("?!") == ""


def test_ascii_fast_path_equals_the_steps():
    """Normalizer folds an ASCII text in one pass; it must give what the steps give, for every ASCII
    character alone, in runs and mixed (the cache key depends on it), and for Banking77's texts (a
    few are not ASCII: the steps themselves)."""
    import random

    def steps(text: str) -> str:
        for step in DEFAULT_STEPS:
            text = step(text)
        return text

    fast = Normalizer()
    assert fast._ascii_fold  # (else this compares the steps with themselves)
    alphabet = [chr(c) for c in range(128)]
    rng = random.Random(7)
    texts = alphabet + [c * 3 + "a" + c for c in alphabet]
    texts += ["".join(rng.choices(alphabet, k=rng.randint(0, 40))) for _ in range(20_000)]
    if BANKING77.is_file():
        with BANKING77.open(newline="", encoding="utf-8") as f:
            texts += [row["text"] for row in csv.DictReader(f)]
    for text in texts:
        assert fast(text) == steps(text), repr(text)


def test_config_layers_file_env_and_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("server: {port: 6000, frontends: 3}\ncache: {budget_mb: 100, map_size_mb: 200}\n")
    loaded = config.load(str(path), {"INFERCACHE_SERVER_PORT": "7000", "INFERCACHE_CACHE_SYNC": "false",
                                     "OTHER": "x"}, {"server.frontends": 5})
    assert loaded.server.port == 7000 and loaded.server.frontends == 5 and loaded.frontend_count == 5
    assert loaded.cache.sync is False and loaded.cache.budget_mb == 100


@pytest.mark.parametrize("environ, message", [
    ({"INFERCACHE_SERVER_PORTT": "1"}, "unknown setting server.portt"),
    ({"INFERCACHE_NOPE_X": "1"}, "unknown section 'nope'"),
    ({"INFERCACHE_CACHE_SYNC": "maybe"}, "expected bool"),
    ({"INFERCACHE_SERVER_GPU_SHARING": "spatial"}, "server.gpu_sharing must be one of auto, mps, timeslice"),
    ({"INFERCACHE_CACHE_SWEEP_INTERVAL_S": "0"}, "cache.sweep_interval_s must be positive"),  # a writer's busy loop
    ({"INFERCACHE_CACHE_WRITE_BATCH": "0"}, "cache.write_batch >= 1"),
    ({"INFERCACHE_CACHE_GROUP_COMMIT_MS": "-1"}, "cache.group_commit_ms must be within 0..1000"),
    ({"INFERCACHE_CACHE_GROUP_COMMIT_MS": "1001"}, "cache.group_commit_ms must be within 0..1000"),
    ({"INFERCACHE_CACHE_SYNC_INTERVAL_MS": "-1"}, "cache.sync_interval_ms must be within 0..60000"),
    ({"INFERCACHE_SERVER_CPU_WORKER_NICE": "-1"}, "server.cpu_worker_nice must be within 0..19"),  # needs privileges
])
def test_config_errors_name_the_setting(environ, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load(None, environ, {})


def test_every_domain_error_has_one_status_code():
    for cls in errors.InferCacheError.__subclasses__():
        code, message = errors.status_of(cls("why"))
        assert code != grpc.StatusCode.INTERNAL and message == "why"
    assert errors.status_of(KeyError("secret"))[0] == grpc.StatusCode.INTERNAL
    assert "secret" not in errors.status_of(KeyError("secret"))[1]
    assert isinstance(errors.from_worker_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), errors.Overloaded)


def test_answers_from_the_template_equal_protobuf_answers_field_for_field():
    from server.shared.answers import _Template, to_tensors

    rng = np.random.default_rng(3)
    first = rng.standard_normal(384).astype(np.float32)
    key = bytes(range(24))

    def answer(vector: np.ndarray, k: bytes) -> pb.InferResponse:
        return pb.InferResponse(outputs=to_tensors({"embedding": vector}),
                                cache=pb.CacheInfo(model_version="7", key=k.hex()))

    template = _Template(answer(first, key).SerializeToString(), first.tobytes(), key.hex().encode())
    for _ in range(20):
        vector, other = rng.standard_normal(384).astype(np.float32), rng.bytes(24)
        rendered = pb.InferResponse.FromString(template.render(vector.tobytes(), other.hex().encode()))
        assert rendered == answer(vector, other)
    with pytest.raises(ValueError):  # data that is not in the answer: no template
        _Template(answer(first, key).SerializeToString(), b"\x01" * 1536, key.hex().encode())


def test_a_classifiers_rendered_answers_are_protobufs_bytes():
    import dataclasses

    from server.shared.answers import Answers, response_of
    from server.shared.models import ModelRepository

    spec = dataclasses.replace(ModelRepository(REPO / "models").get("minilm"), outputs=("scores",))
    labels = ["card_arrival", "", "é" * 100, "x" * 300]  # an empty label, and labels of 2-byte lengths
    rng = np.random.default_rng(5)
    odd = {7: [0.0] * 4, 8: [-0.0] * 4, 9: [float("nan"), 0.1, 0.2, 0.3], 10: [1e-46, 0.0, 0.0, 0.0],
           11: [3e38, 1.0, 0.0, 0.0]}  # left out by protobuf, NaN, under / near float32's range
    for dtype in (np.float32, np.float16, np.float64):  # (a GPU engine's FP16 scores; wider ones)
        answers = Answers(spec, "3", labels)
        for n in range(100):
            logits = rng.standard_normal(len(labels)) * 4
            with np.errstate(over="ignore"):  # (3e38 is inf in float16)
                scores = np.asarray(odd.get(n, np.exp(logits) / np.exp(logits).sum())).astype(dtype)
            key = rng.bytes(24)
            assert answers.payload({"scores": scores}, key) == \
                response_of(spec, "3", labels, {"scores": scores}, key).SerializeToString(), (dtype, n)
        assert (answers._template is not None) == (dtype != np.float64)  # (rendered, not serialized, after the first)


def test_frames_split_anywhere_arrive_whole_and_a_bad_one_closes_the_connection():
    from server.shared.framing import HEADER, FrameProtocol

    class Transport:
        closed = False

        def close(self):
            self.closed = True

    got = []

    def on_frame(frame: bytes) -> None:
        if frame == b"bad":
            raise ValueError("does not parse")
        got.append(frame)

    protocol = FrameProtocol(on_frame, lambda exc: None, bytes)
    protocol.connection_made(Transport())
    frames = [b"", b"a", bytes(range(256)) * 3, b"zz"]
    stream = b"".join(len(f).to_bytes(HEADER, "little") + f for f in frames)
    for start in range(0, len(stream), 7):  # chunks that cut headers and bodies
        protocol.data_received(stream[start:start + 7])
    assert got == frames and not protocol.transport.closed
    protocol.data_received((3).to_bytes(HEADER, "little") + b"bad" + (1).to_bytes(HEADER, "little") + b"x")
    assert protocol.transport.closed and got == frames  # nothing after the bad frame is handled


def test_flush_later_gathers_items_into_one_write_that_a_flush_soon_brings_forward():
    """Over a real unix socket pair: items queued with flush_later go in one frame after the delay; a
    flush_soon meanwhile sends them at once (and its timer no longer fires); close() leaves no timer."""
    import socket

    from infercache.v1 import worker_pb2
    from server.shared.framing import FrameProtocol, complete_frames

    async def run():
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.setblocking(False)
        _, protocol = await loop.create_unix_connection(
            lambda: FrameProtocol(lambda frame: None, lambda exc: None, worker_pb2.ComputeBatch), sock=ours)
        received = bytearray()

        async def frames_after(seconds: float) -> list:
            await asyncio.sleep(seconds)
            try:
                received.extend(theirs.recv(1 << 16))
            except BlockingIOError:
                pass
            return [worker_pb2.ComputeBatch.FromString(f) for f in complete_frames(received)]

        for key in (b"a", b"b", b"c"):
            protocol.out.items.add(key=key)
            protocol.flush_later(0.2)
        early = await frames_after(0.05)
        late = await frames_after(0.3)
        protocol.out.items.add(key=b"d")
        protocol.flush_later(5.0)
        protocol.out.items.add(key=b"e")
        protocol.flush_soon()
        soon = await frames_after(0.05)
        protocol.out.items.add(key=b"f")
        protocol.flush_later(5.0)
        pending = protocol._flush_timer
        protocol.close()
        theirs.close()
        return early, late, soon, pending

    early, late, soon, pending = asyncio.run(run())
    assert early == []
    assert [[i.key for i in f.items] for f in late] == [[b"a", b"b", b"c"]]
    assert [[i.key for i in f.items] for f in soon] == [[b"d", b"e"]]
    assert pending.cancelled()


def test_compute_fails_at_its_deadline_and_tells_the_worker_to_drop_the_item(tmp_path):
    """A worker that takes items and never answers (a real unix socket): compute raises DeadlineExceeded
    at worker_timeout_s, not later, and the worker is sent a cancel for the item; nothing is left for
    asyncio to log as an exception nobody retrieved."""
    from collections import Counter

    from infercache.v1 import worker_pb2
    from server.shared.errors import DeadlineExceeded
    from server.shared.framing import complete_frames
    from server.frontend.workers import WorkerPool

    async def run():
        loop = asyncio.get_running_loop()
        unretrieved = []
        loop.set_exception_handler(lambda _, context: unretrieved.append(context))
        received: list = []

        async def silent(reader, writer):
            buffer = bytearray()
            while data := await reader.read(1 << 16):
                buffer += data
                received.extend(worker_pb2.ComputeBatch.FromString(f) for f in complete_frames(buffer))

        listening = await asyncio.start_unix_server(silent, path=str(tmp_path / "worker-0.items"))
        pool = WorkerPool([tmp_path / "worker-0.sock"], wait_s=1.0, default_timeout_s=0.3, counters=Counter())
        assert await pool.all_up(5.0)
        started = loop.time()
        with pytest.raises(DeadlineExceeded):
            await pool.compute([(0, lambda item: setattr(item, "key", b"k1"))], None)
        took = loop.time() - started
        await asyncio.sleep(0.1)  # the cancel's frame
        await pool.close()
        listening.close()
        import gc
        gc.collect()  # (a future whose exception nobody retrieved is logged when it is collected)
        return took, received, unretrieved

    took, received, unretrieved = asyncio.run(run())
    assert 0.29 <= took < 1.5
    assert [(i.id, i.key) for frame in received for i in frame.items] == [(1, b"k1")]
    assert [item_id for frame in received for item_id in frame.cancel] == [1]
    assert unretrieved == []


def test_pad_batch_pads_each_row_to_the_length():
    from server.shared.tokenization import pad_batch

    rows = [[101, 7, 102], np.array([101, 102], dtype="<i4"), [], list(range(1, 9))]
    out = pad_batch(rows, 8)
    for n, row in enumerate(rows):
        assert out["input_ids"][n].tolist() == list(row) + [0] * (8 - len(row))
        assert out["attention_mask"][n].tolist() == [1] * len(row) + [0] * (8 - len(row))
    assert out["input_ids"].dtype == out["attention_mask"].dtype == np.int64
    assert pad_batch([[5, 6]], 4)["input_ids"].tolist() == [[5, 6, 0, 0]]


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.replace("cache:\n  ttl_s:", "cache:\n  ttl_sec:"), r"unknown key 'cache.ttl_sec' \(known in cache: classes, default_class, stale_if_error_s, ttl_s\)"),
    (lambda c: c + "batchng: {max_batch_size: 4}\n", r"unknown key 'batchng' \(known: task, serving_version, outputs"),
    (lambda c: c + "semantic: {enabled: false, max_eror: 0.01}\n", r"semantic: max_eror not settings of either rule"),
    (lambda c: c + "privacy: redact\n", r"'privacy' must be a mapping of pii"),
])
def test_a_model_config_with_an_unknown_key_names_the_file_the_key_and_the_known_ones(tmp_path, edit, message):
    from server.shared.models import ModelConfigError, load_model

    root = tmp_path / "minilm"
    root.mkdir()
    (root / "config.yaml").write_text(edit((REPO / "models" / "minilm" / "config.yaml").read_text()))
    with pytest.raises(ModelConfigError, match=message) as raised:
        load_model(root)
    assert str(root / "config.yaml") in str(raised.value)


def test_the_server_refuses_to_start_on_a_model_config_typo(tmp_path):
    root = tmp_path / "models" / "minilm"
    root.mkdir(parents=True)
    (root / "config.yaml").write_text((REPO / "models" / "minilm" / "config.yaml").read_text()
                                      .replace("max_queue_delay_ms", "max_queue_delay"))
    done = subprocess.run([sys.executable, "-m", "server", "serve", "--models-dir", str(tmp_path / "models"),
                           "--cache-dir", str(tmp_path / "cache"), "--port", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0
    assert "unknown key 'batching.max_queue_delay'" in done.stderr + done.stdout, done.stderr[-2000:]


def test_every_cli_option_says_what_it_is_and_operations_lists_every_command():
    import argparse

    from server.__main__ import build_parser

    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    silent = [f"{name} {action.option_strings}" for name, sub in commands.choices.items() for action in sub._actions
              if action.option_strings and not action.help]
    assert not silent, silent
    assert "(default: 127.0.0.1:50051)" in commands.choices["generate"].format_help()
    operations = (REPO / "docs" / "operations.md").read_text()
    missing = [name for name in commands.choices if name not in operations.split("subcommands (", 1)[1].split(")")[0]]
    assert not missing, missing


def test_stale_if_error_keeps_entries_within_retention_and_is_refused_where_it_cannot_apply(tmp_path):
    from server.shared.answers import answer_record
    from server.shared.models import ModelConfigError, ModelRepository

    config = (REPO / "models" / "minilm" / "config.yaml").read_text().replace("ttl_s:", "stale_if_error_s: 500\n  ttl_s:")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.yaml").write_text(config)
    spec = ModelRepository(tmp_path).get("m")
    assert spec.stale_if_error_s == 500
    record = answer_record(spec, 1_000_000, b"answer")
    assert record.expires_us == 1_000_000 + (spec.ttl_s + 500) * 1_000_000  # (no jitter: cache.ttl_jitter is 0)
    capped = ModelRepository(tmp_path, max_ttl_s=spec.ttl_s + 100).get("m")  # retention: the window shrinks
    assert capped.stale_if_error_s == 100
    generative = (REPO / "models" / "smollm2" / "config.yaml").read_text()
    (tmp_path / "m" / "config.yaml").write_text(generative.replace("ttl_s:", "stale_if_error_s: 5\n  ttl_s:", 1))
    with pytest.raises(ModelConfigError, match="stale_if_error_s"):
        ModelRepository(tmp_path)
