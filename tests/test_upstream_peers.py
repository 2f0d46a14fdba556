"""Models computed by the model servers teams already run, each a real server started here: NVIDIA Triton
(through PyTriton, in its own virtualenv: bench/peer_envs.py) serving MiniLM is the KServe v2 upstream
(kind kserve) of an infercache that has no MiniLM files, and is called directly with the real
`tritonclient` package to compare."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml

from tests.helpers import unique, wait_cached
from tests.servers import ServerProcess

MODEL = "up-triton"


@pytest.fixture(scope="module")
def triton(tmp_path_factory):
    from bench.peer_envs import triton_env
    from bench.triton_peer import TritonPeer

    env = triton_env()
    if isinstance(env, str):
        pytest.skip(f"Triton cannot run here: {env}")
    peer = TritonPeer(env, tmp_path_factory.mktemp("triton") / "server")
    yield peer
    peer.stop()


@pytest.fixture(scope="module")
def front(tmp_path_factory, triton, engines_dir):
    work = tmp_path_factory.mktemp("front")
    (work / "models" / MODEL).mkdir(parents=True)
    (work / "models" / MODEL / "config.yaml").write_text(yaml.safe_dump({
        "task": "embedding", "serving_version": "1", "runtime": "upstream", "cache": {"ttl_s": 600},
        "upstream": {"kind": "kserve", "urls": [f"http://{triton.address}"], "model": "minilm", "output": "embedding",
                     "max_batch_texts": 32, "timeout_s": 20}}))
    server = ServerProcess(work, work / "models", engines_dir=engines_dir, frontends=1)
    yield server
    server.stop()


def _direct(triton, texts: list[str]) -> np.ndarray:
    import tritonclient.grpc as triton_grpc

    client = triton_grpc.InferenceServerClient(triton.address)
    text = triton_grpc.InferInput("text", [len(texts), 1], "BYTES")
    text.set_data_from_numpy(np.array([[t.encode()] for t in texts], dtype=object))
    return client.infer("minilm", [text]).as_numpy("embedding")


def test_answers_equal_tritons_and_a_repeat_is_a_hit(front, triton):
    from server.shared.normalize import Normalizer

    texts = [unique(f"How do I close my account ({n})?") for n in range(3)]
    normalize = Normalizer()  # (the model's: what a miss sends is the text as keyed)
    expected = _direct(triton, [normalize(t) for t in texts])
    with front.client() as client:
        first = client.infer_batch(MODEL, texts)
        assert [r.source for r in first] == ["MISS"] * 3
        for result, vector in zip(first, expected):
            np.testing.assert_allclose(result.outputs["embedding"], vector, rtol=1e-4, atol=1e-5)
        wait_cached(client, MODEL, texts[-1])
        again = client.infer(MODEL, texts[0])
        assert again.source == "RESULT_EXACT"
        np.testing.assert_array_equal(again.outputs["embedding"], first[0].outputs["embedding"])
    assert "upstream-kserve" in {e.runtime for e in front.stats().worker.engines}


def test_identical_concurrent_calls_make_one_triton_request(front, triton):
    text = unique("sixteen callers at once, one Triton request")
    before = triton.metric("nv_inference_request_success")
    with front.client(timeout_s=30) as client, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: client.infer(MODEL, text), range(16)))
    assert {a.source for a in answers} <= {"MISS", "COALESCED", "RESULT_EXACT"}
    assert triton.metric("nv_inference_request_success") - before == 1
