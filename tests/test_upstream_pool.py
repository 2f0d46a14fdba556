"""The upstream pool's routing, retries and circuit breakers, model-free: clients that answer or fail as a
test says (the pool's own logic is under test; tests/test_upstream.py runs it against real servers)."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from server.shared.errors import InvalidArgument, UpstreamFailed
from server.shared.models import ModelConfigError
from server.shared.upstream_spec import UpstreamSpec
from server.worker.upstream.credentials import read_credential
from server.worker.upstream.errors import Failure
from server.worker.upstream.pool import TextRow, UpstreamPool


class Client:
    def __init__(self, url: str) -> None:
        self.url = url
        self.down = False
        self.refuses: set[str] = set()  # texts it answers 400 for, with the rest of their call
        self.calls: list[list[str]] = []

    async def embed(self, texts, tenant, timeout_s):
        self.calls.append(list(texts))
        if self.down:
            raise Failure("connect", "cannot reach it: connection refused")
        if self.refuses & set(texts):
            raise Failure.of_status(400, "input too long")
        return [np.full(2, float(len(t)), np.float32) for t in texts]

    def close(self):
        pass


def _pool(n: int = 2, **settings) -> tuple[UpstreamPool, list[Client]]:
    clients = [Client(f"http://upstream-{i}:8000/v1") for i in range(n)]
    spec = UpstreamSpec(kind="openai", urls=tuple(c.url for c in clients), retries=1, retry_backoff_ms=0,
                        breaker_failures=2, breaker_open_s=0.2, **settings)
    return UpstreamPool("m", "1", spec, clients), clients


def _embed(pool: UpstreamPool, rows: list[TextRow]) -> list:
    return asyncio.run(pool.embed(rows))


def _rows(n: int) -> list[TextRow]:
    return [TextRow.of(f"text {i}", i.to_bytes(16, "little"), "") for i in range(n)]


def test_keys_stick_to_their_server_and_a_failing_one_s_keys_move_and_come_back():
    pool, clients = _pool()
    rows = _rows(40)
    _embed(pool, rows)
    first = {c.url: sum(map(len, c.calls)) for c in clients}
    assert all(first.values())  # rendezvous spreads the keys over both
    for c in clients:
        c.calls.clear()
    _embed(pool, rows)
    assert {c.url: sum(map(len, c.calls)) for c in clients} == first  # the same keys to the same servers
    clients[0].down = True
    for _ in range(3):
        answers = _embed(pool, rows)
        assert all(isinstance(a, np.ndarray) for a in answers)  # retried on the next server of each ranking
    assert pool.in_rotation() == {clients[0].url: False, clients[1].url: True}
    clients[0].calls.clear()
    _embed(pool, rows)
    assert clients[0].calls == []  # out of rotation: not even tried
    clients[0].down = False
    time.sleep(0.25)
    _embed(pool, rows)  # one trial call, then its keys again
    _embed(pool, rows)
    assert pool.in_rotation() == {clients[0].url: True, clients[1].url: True}
    assert sum(map(len, clients[0].calls)) >= first[clients[0].url]


def test_every_server_out_of_rotation_refuses_at_once_and_a_trial_is_never_left_open():
    pool, clients = _pool(1, timeout_s=5.0)
    clients[0].down = True
    for _ in range(2):
        [answer] = _embed(pool, _rows(1))
        assert isinstance(answer, UpstreamFailed)
    calls = len(clients[0].calls)
    [answer] = _embed(pool, _rows(1))
    assert isinstance(answer, UpstreamFailed) and "out of rotation" in str(answer) and len(clients[0].calls) == calls
    time.sleep(0.25)
    clients[0].down = False
    assert isinstance(_embed(pool, _rows(1))[0], np.ndarray)  # the trial succeeded: back in rotation
    assert pool.in_rotation() == {clients[0].url: True}


def test_an_input_the_upstream_refuses_fails_its_own_row_alone():
    pool, clients = _pool(1)
    rows = _rows(4)
    clients[0].refuses = {str(rows[2])}
    answers = _embed(pool, rows)
    assert isinstance(answers[2], InvalidArgument) and "refused the input" in str(answers[2])
    assert [isinstance(a, np.ndarray) for a in answers] == [True, True, False, True]


def test_a_credential_that_cannot_go_in_a_header_is_refused_without_its_value(tmp_path):
    secret = tmp_path / "token"
    secret.write_text("first-half\nsecond-half\n")
    spec = UpstreamSpec(kind="openai", urls=("http://u:1/v1",), credential_file=str(secret))
    with pytest.raises(ModelConfigError) as refused:
        read_credential("m", spec)
    assert "half" not in str(refused.value) and str(secret) in str(refused.value)
    secret.write_text("  s3cret-token \n")
    credential = read_credential("m", spec)
    assert credential.header() == "Bearer s3cret-token" and "s3cret" not in repr(credential)


def test_an_upstream_model_cannot_be_an_embedder(tmp_path):
    from server.shared.models import ModelRepository
    from harness.servers import REPO

    (tmp_path / "minilm").mkdir()
    (tmp_path / "minilm" / "config.yaml").write_text(
        "task: embedding\nserving_version: '1'\nruntime: upstream\n"
        "upstream: {kind: openai, urls: 'http://u:1/v1'}\ncache: {ttl_s: 60}\n")
    (tmp_path / "faq").mkdir()
    classifier = (REPO / "models" / "minilm" / "config.yaml").read_text().replace("task: embedding", "task: classification")
    (tmp_path / "faq" / "config.yaml").write_text(classifier + "semantic: {enabled: true, embedder: minilm}\n")
    with pytest.raises(ModelConfigError, match="computed upstream"):
        ModelRepository(tmp_path)
