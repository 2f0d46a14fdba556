"""Models computed by the model servers teams already run, each a real server started here in its own
virtualenv (bench/peer_envs.py), in front of an infercache that has no MiniLM files: NVIDIA Triton (through
PyTriton) serving MiniLM is the KServe v2 upstream (kind kserve), called directly with the real
`tritonclient` package to compare; infinity serving MiniLM on the CPU is the OpenAI-compatible embedding
upstream (kind openai), called directly with the real `openai` package."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import yaml

from tests.helpers import unique, wait_cached
from harness.servers import ServerProcess

MODEL = "up-triton"
INFINITY = "up-infinity"


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
def infinity(tmp_path_factory):
    from bench.peer_envs import infinity_env
    from bench.peers_infinity import InfinityPeer, minilm_source

    env = infinity_env()
    if isinstance(env, str):
        pytest.skip(f"infinity cannot run here: {env}")
    peer = InfinityPeer(env, minilm_source(), tmp_path_factory.mktemp("infinity") / "server", on_gpu=False)
    yield peer
    peer.stop()


def _front(work, engines_dir, models: dict[str, dict]) -> ServerProcess:
    for name, upstream in models.items():
        (work / "models" / name).mkdir(parents=True)
        (work / "models" / name / "config.yaml").write_text(yaml.safe_dump({
            "task": "embedding", "serving_version": "1", "runtime": "upstream", "cache": {"ttl_s": 600},
            "upstream": {"model": "minilm", "max_batch_texts": 32, "timeout_s": 20, **upstream}}))
    return ServerProcess(work, work / "models", engines_dir=engines_dir, frontends=1)


@pytest.fixture(scope="module")
def front(tmp_path_factory, triton, engines_dir):
    server = _front(tmp_path_factory.mktemp("front"), engines_dir, {MODEL: {
        "kind": "kserve", "urls": [f"http://{triton.address}"], "output": "embedding"}})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def infinity_front(tmp_path_factory, infinity, engines_dir):
    server = _front(tmp_path_factory.mktemp("infinity-front"), engines_dir, {INFINITY: {
        "kind": "openai", "urls": [f"http://127.0.0.1:{infinity.port}"]}})
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
        _equal_then_hit(client, MODEL, texts, expected)
    assert "upstream-kserve" in {e.runtime for e in front.stats().worker.engines}


def _equal_then_hit(client, model: str, texts: list[str], expected) -> None:
    """Misses answered as the upstream answers directly (`expected`), then a repeat answered from L1."""
    first = client.infer_batch(model, texts)
    assert [r.source for r in first] == ["MISS"] * len(texts)
    for result, vector in zip(first, expected):
        np.testing.assert_allclose(result.outputs["embedding"], vector, rtol=1e-4, atol=1e-5)
    wait_cached(client, model, texts[-1])
    again = client.infer(model, texts[0])
    assert again.source == "RESULT_EXACT"
    np.testing.assert_array_equal(again.outputs["embedding"], first[0].outputs["embedding"])


def test_identical_concurrent_calls_make_one_triton_request(front, triton):
    text = unique("sixteen callers at once, one Triton request")
    before = triton.metric("nv_inference_request_success")
    with front.client(timeout_s=30) as client, ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: client.infer(MODEL, text), range(16)))
    assert {a.source for a in answers} <= {"MISS", "COALESCED", "RESULT_EXACT"}
    assert triton.metric("nv_inference_request_success") - before == 1


def _infinity_calls(infinity) -> int:
    """Embedding calls infinity has answered (its server's access log)."""
    return infinity.log_path.read_text(errors="replace").count('"POST /embeddings HTTP/1.1" 200')


def test_answers_equal_infinitys_through_the_openai_package_and_a_repeat_is_a_hit(infinity_front, infinity):
    import openai

    from server.shared.normalize import Normalizer

    texts = [unique(f"Where is my refund ({n})?") for n in range(3)]
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{infinity.port}", api_key="unused", max_retries=0)
    expected = [d.embedding for d in direct.embeddings.create(model="minilm", input=[Normalizer()(t) for t in texts]).data]
    with infinity_front.client() as client:
        _equal_then_hit(client, INFINITY, texts, expected)
        text = unique("sixteen callers at once, one infinity call")
        before = _infinity_calls(infinity)
        with ThreadPoolExecutor(16) as pool:
            answers = list(pool.map(lambda _: client.infer(INFINITY, text), range(16)))
    assert {a.source for a in answers} <= {"MISS", "COALESCED", "RESULT_EXACT"}
    assert _infinity_calls(infinity) - before == 1
