"""The prefix key/value cache through a real server, with SmolLM2's real weights on the CPU: answers are
token-identical with and without it, tenants stay walled off (but for a public system prompt), blocks
move from memory to disk and come back, survive a restart, a damaged block is recomputed and deleted,
Invalidate erases a tenant's or a model's blocks from every tier, and a block store with damaged pages is
set aside for a fresh one."""

from __future__ import annotations

import os
import signal
import struct
from collections import Counter

import lmdb
import pytest

from cachestore.env import DB_NAMESPACES, DB_RESULTS
from cachestore.keys import namespace_id
from cachestore.records import checked
from harness.servers import REPO, ServerProcess, link_model
from tests.helpers import wait_for

GEN_VERSION_DIR = REPO / "models" / "smollm2" / "1"
CONFIG = (REPO / "models" / "smollm2" / "config.yaml").read_text()
PUBLIC = "You answer questions for Example Bank's customers, briefly and politely. " * 6
SYSTEM = ("You are the assistant of a bank. Answer in one sentence. Card payments can be disputed within 60 days; "
          "refunds take 5 to 10 working days; a frozen card can be unfrozen in the app. ") * 3
NEW = 10

pytestmark = pytest.mark.skipif(not (GEN_VERSION_DIR / "decoder.onnx").is_file(),
                                reason="the generative model is not prepared: run `make model` (make test does)")


def _models(root, small_mb: int = 2):
    link_model(root, "plain", CONFIG + "prefix_cache: {enabled: false}\n", {"1": GEN_VERSION_DIR})
    link_model(root, "cached", CONFIG + f"prefix_cache: {{block_tokens: 16, public_prompts: {{bank: {PUBLIC!r}}}}}\n",
               {"1": GEN_VERSION_DIR})
    # 2 blocks of memory: the rest is demoted to disk and read back from there
    link_model(root, "small", CONFIG + f"prefix_cache: {{block_tokens: 16, host_mb: {small_mb}}}\n", {"1": GEN_VERSION_DIR})
    link_model(root, "torch", CONFIG.replace("generate:\n", "generate:\n  runtime: torch\n")
               + "prefix_cache: {block_tokens: 16}\n", {"1": GEN_VERSION_DIR})
    return root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _models(tmp_path_factory.mktemp("prefix-models"))


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("prefix-server")
    srv = ServerProcess(workdir, models, frontends=1)
    yield srv
    srv.stop()


def _ask(server, model, question, system=SYSTEM, tenant="", history=()):
    messages = ([{"role": "system", "content": system}] if system else []) + list(history) + \
        [{"role": "user", "content": question}]
    with server.client(timeout_s=300) as client:
        return client.generate(model, messages=messages, max_new_tokens=NEW, tenant=tenant, mode="NO_STORE")


def _prefix(server, model) -> Counter:
    """The worker's prefix cache figures of `model` (GetStats), 0 for those not counted yet."""
    counters = server.stats().worker.counters
    return Counter({k.split(".", 3)[3]: v for k, v in counters.items() if k.startswith(f"prefix.{model}.")})


def _reused(server, model, question, tenant="") -> int:
    """Prompt tokens the question's generation reused from any tier."""
    before = _prefix(server, model)
    _ask(server, model, question, tenant=tenant)
    after = _prefix(server, model)
    return sum(after[f"prefix_tokens_{tier}"] - before[f"prefix_tokens_{tier}"] for tier in ("memory", "host", "disk"))


def _kv(server) -> Counter:
    """The worker's block store figures (GetStats kv.*)."""
    return Counter({k[3:]: v for k, v in server.stats().worker.counters.items() if k.startswith("kv.")})


@pytest.mark.parametrize("model", ["cached", "small", "torch"])
def test_answers_are_token_identical_with_and_without_the_prefix_cache(server, model):
    questions = ["How do I get a refund?", "Why was my card declined?", "How do I get a refund?",
                 "Can I unfreeze my card?", "How long does a refund take?"]
    before = _prefix(server, model)
    for question in questions:
        assert _ask(server, model, question).token_ids == _ask(server, "plain", question).token_ids, question
    after = _prefix(server, model)
    reused = sum(after.get(f"prefix_tokens_{t}", 0) - before.get(f"prefix_tokens_{t}", 0)
                 for t in ("memory", "host", "disk"))
    if model == "small":  # two blocks of memory: the rest went to disk and came back from there
        assert after["prefix_demoted_disk"] > before.get("prefix_demoted_disk", 0)
        assert after["prefix_tokens_disk"] > before.get("prefix_tokens_disk", 0)
        assert after["memory_bytes"] <= 2 << 20  # its cap
    else:
        assert reused >= 4 * 16 * 4, after  # each later question reused the system prompt's blocks, at least


def test_a_conversation_reuses_its_earlier_turns_answers_included(server):
    first = _ask(server, "cached", "What is a chargeback?")
    before = _prefix(server, "cached")
    history = [{"role": "user", "content": "What is a chargeback?"}, {"role": "assistant", "content": first.text}]
    second = _ask(server, "cached", "And how long does it take?", history=history)
    after = _prefix(server, "cached")
    assert second.token_ids == _ask(server, "plain", "And how long does it take?", history=history).token_ids
    # the second turn's prompt starts with the first's prompt and answer: all but their last partial block
    reused = after["prefix_tokens_memory"] - before["prefix_tokens_memory"]
    assert reused >= (first.prompt_tokens + len(first.token_ids)) // 16 * 16 - 16 * 2, (reused, first.prompt_tokens)


def test_tenants_never_reuse_each_others_blocks_but_share_a_public_system_prompt(server):
    system = SYSTEM.replace("bank", "credit union")  # a prompt no other test sends
    _ask(server, "cached", "Hello?", system=system, tenant="tenant-a")
    before = _prefix(server, "cached")
    _ask(server, "cached", "Hello?", system=system, tenant="tenant-b")
    assert _prefix(server, "cached")["prefix_tokens_memory"] == before["prefix_tokens_memory"]
    _ask(server, "cached", "Hello?", system=system, tenant="tenant-a")  # its own blocks: reused
    assert _prefix(server, "cached")["prefix_tokens_memory"] > before["prefix_tokens_memory"]

    question = "Good morning! I would like to know more about the savings accounts you offer and their rates."
    _ask(server, "cached", question, system=PUBLIC, tenant="tenant-c")
    reused = []
    for tenant in ("tenant-d", "tenant-c"):
        before = _prefix(server, "cached")
        answer = _ask(server, "cached", question, system=PUBLIC, tenant=tenant)
        reused.append(_prefix(server, "cached")["prefix_tokens_memory"] - before["prefix_tokens_memory"])
        assert answer.token_ids == _ask(server, "plain", question, system=PUBLIC).token_ids
    shared, own = reused
    assert shared >= 16 * 4  # tenant-d reused the public prompt's whole blocks, computed for tenant-c
    assert own > shared  # and only those: tenant-c reuses its question's blocks too


def test_blocks_on_disk_survive_a_restart_and_a_damaged_one_is_recomputed(models, tmp_path):
    cache = tmp_path / "cache"
    question = "Which documents do I need to open an account?"
    (tmp_path / "one").mkdir()
    with ServerProcess(tmp_path / "one", models, frontends=1, cache_dir=cache) as server:
        expected = _ask(server, "plain", question).token_ids
        _ask(server, "small", question)
        _ask(server, "small", "Something else entirely, to push the first out of memory?")
        wait_for(lambda: _prefix(server, "small").get("prefix_demoted_disk", 0) > 0 and
                 server.stats().worker.counters.get("kv.backlog", 1) == 0, 30, "blocks written to disk")
    stored = _records(cache)
    assert stored and all(checked(v) for v in stored.values())  # every record whole
    (tmp_path / "two").mkdir()
    with ServerProcess(tmp_path / "two", models, frontends=1, cache_dir=cache) as server:
        assert _ask(server, "small", question).token_ids == expected
        assert _prefix(server, "small")["prefix_tokens_disk"] >= 16  # a new worker read them back
    env = lmdb.open(str(cache / "kv"), max_dbs=16, map_size=8 << 30)
    with env.begin(write=True, db=env.open_db(DB_RESULTS)) as txn:  # damage every record: flipped payload bytes
        for key, value in stored.items():
            txn.put(key, value[:-8] + bytes(b ^ 0xFF for b in value[-8:]))
    env.close()
    # Memory enough for every block: what is computed again stays there, and what is on disk is what the
    # damage left, less what the server deleted.
    roomy = _models(tmp_path / "roomy", small_mb=64)
    (tmp_path / "three").mkdir()
    with ServerProcess(tmp_path / "three", roomy, frontends=1, cache_dir=cache) as server:
        assert _ask(server, "small", question).token_ids == expected
        assert _prefix(server, "small")["prefix_tokens_disk"] == 0
        wait_for(lambda: _kv(server)["unreadable_deleted"] == _kv(server)["unreadable"] >= 1, 30,
                 "the unreadable blocks deleted")
        deleted = _kv(server)["unreadable_deleted"]
        log = server.log_text()
    assert log.count("not reused, deleting it") == deleted  # each read (and warned about) once
    left = _records(cache)
    assert len(left) == len(stored) - deleted and set(left) < set(stored)


def test_invalidate_erases_a_tenants_and_a_models_prefix_blocks_from_every_tier(models, tmp_path):
    cache = tmp_path / "cache"
    mine, theirs = "Which documents do I need to open an account?", "How do I close my savings account?"
    (tmp_path / "one").mkdir()
    with ServerProcess(tmp_path / "one", models, frontends=1, cache_dir=cache) as server:
        _ask(server, "small", mine, tenant="tenant-a")
        _ask(server, "small", theirs, tenant="tenant-b")
        reused = _reused(server, "small", mine, tenant="tenant-a")
        assert reused >= 16 * 4 and _prefix(server, "small")["prefix_tokens_disk"] > 0  # from memory and disk
        with server.client() as client:
            removed = client.invalidate(tenant="tenant-a")
            assert removed >= reused // 16  # the blocks it reused, and those it kept since (memory and disk)
            assert _reused(server, "small", mine, tenant="tenant-a") == 0
            assert client.invalidate(tenant="tenant-a") > 0  # (what that computed again)
        assert _reused(server, "small", theirs, tenant="tenant-b") >= 16 * 2  # another tenant's stay
    mine_ns, theirs_ns = (namespace_id(t, "small", "1") for t in ("tenant-a", "tenant-b"))
    stored = _records(cache)
    assert not any(key.startswith(mine_ns) for key in stored) and any(key.startswith(theirs_ns) for key in stored)
    assert mine_ns not in _records(cache, DB_NAMESPACES)
    (tmp_path / "two").mkdir()
    with ServerProcess(tmp_path / "two", models, frontends=1, cache_dir=cache) as server:
        assert _reused(server, "small", mine, tenant="tenant-a") == 0  # nothing of it came back from disk
        assert _reused(server, "small", theirs, tenant="tenant-b") >= 16  # read back from disk
        with server.client() as client:
            assert client.invalidate(model="small") > 0
            assert _reused(server, "small", theirs, tenant="tenant-b") == 0
            assert client.invalidate(model="small") > 0
    assert not _records(cache) and not _records(cache, DB_NAMESPACES)


def test_a_block_store_with_damaged_pages_is_set_aside_and_blocks_go_to_a_fresh_one(models, tmp_path):
    cache = tmp_path / "cache"
    question, other = "Can I open a joint account with my partner?", "Something else, to push the first out of memory?"
    (tmp_path / "one").mkdir()
    with ServerProcess(tmp_path / "one", models, frontends=1, cache_dir=cache) as server:
        expected = _ask(server, "small", question).token_ids
        _ask(server, "small", other)
    assert _records(cache)
    _damage_main_root(cache / "kv" / "data.mdb")
    (tmp_path / "two").mkdir()
    with ServerProcess(tmp_path / "two", models, frontends=1, cache_dir=cache) as server:
        assert _ask(server, "small", question).token_ids == expected
        _ask(server, "small", other)
        wait_for(lambda: _kv(server)["written"] > 0, 30, "blocks written to the fresh store")
        assert _kv(server)["replaced"] == 1
        log = server.log_text()
    assert log.count("prefix block store damaged") == 1
    aside = list(cache.glob("kv.damaged-*"))
    assert len(aside) == 1 and (aside[0] / "data.mdb").is_file()
    assert _records(cache)  # the fresh store keeps blocks across restarts again


def test_a_worker_killed_while_it_writes_blocks_leaves_only_whole_records(models, tmp_path):
    cache = tmp_path / "cache"
    (tmp_path / "one").mkdir()
    with ServerProcess(tmp_path / "one", models, frontends=1, cache_dir=cache) as server:
        for n in range(3):
            _ask(server, "small", f"Question number {n} about my savings account and its interest?")
        os.kill(server.worker_pid(), signal.SIGKILL)
    records = _records(cache)
    assert records and all(checked(v) for v in records.values())


def _records(cache, db: bytes = DB_RESULTS) -> dict[bytes, bytes]:
    """The block store's records (or the rows of another of its databases), read with LMDB itself (no
    server running)."""
    env = lmdb.open(str(cache / "kv"), max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(db, create=False)) as txn:
            return {bytes(k): bytes(v) for k, v in txn.cursor()}
    finally:
        env.close()


def _damage_main_root(data_file) -> None:
    """Zeros over the page the newest meta page names as the main tree's root (the index of the store's
    databases), as a torn write or a bad disk leaves it (cachestore/integrity.py: the meta page layout).
    (Garbage that reads as a page with entries can send LMDB's search past the end of the file, a SIGBUS
    no process survives: no store can be set aside from there.)"""
    raw = bytearray(data_file.read_bytes())
    metas = []
    for offset in (0, struct.unpack_from("<I", raw, 40)[0]):
        page_size, = struct.unpack_from("<I", raw, offset + 40)
        root, txn_id = struct.unpack_from("<Q", raw, offset + 128)[0], struct.unpack_from("<Q", raw, offset + 144)[0]
        metas.append((txn_id, page_size, root))
    _, page_size, root = max(metas)
    raw[root * page_size:(root + 1) * page_size] = bytes(page_size)
    data_file.write_bytes(bytes(raw))
