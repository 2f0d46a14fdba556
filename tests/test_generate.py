"""Generative models through a real server: SmolLM2-135M-Instruct's real weights (the repository's
prepared decoder on ONNX Runtime), streamed over gRPC with the real client, against transformers' own
greedy `generate` on the same weights."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest

from infercache.v1 import infercache_pb2 as pb
from harness.servers import REPO, link_model
from tests.helpers import unique, wait_for

GEN_VERSION_DIR = REPO / "models" / "smollm2" / "1"
GEN_CONFIG = (REPO / "models" / "smollm2" / "config.yaml").read_text()
SMALL = """
task: generate
serving_version: "1"
generate: {context_length: 96, max_new_tokens: 64, max_streams: 1, max_waiting: 0}
cache: {ttl_s: 600}
"""
ANSWER_TOKENS = 24  # long enough to diverge where a runtime differs, short enough for a 2-core host

pytestmark = pytest.mark.skipif(not (GEN_VERSION_DIR / "decoder.onnx").is_file(),
                                reason="the generative model is not prepared: run `make model` (make test does)")


@pytest.fixture(scope="module")
def gen_models(tmp_path_factory):
    """minilm, smollm2 as shipped (two versions: the same files), and smollm2-small (a 96-token context, one
    generation at a time and no queue)."""
    from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR

    root = tmp_path_factory.mktemp("gen-models")
    link_model(root, "minilm", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    link_model(root, "smollm2", GEN_CONFIG, {"1": GEN_VERSION_DIR, "2": GEN_VERSION_DIR})
    # The same weights on the torch decoder (the GPU runtime's code, here fp32 and eager on the CPU).
    link_model(root, "smollm2-torch", GEN_CONFIG.replace("generate:\n", "generate:\n  runtime: torch\n"),
               {"1": GEN_VERSION_DIR})
    link_model(root, "smollm2-small", SMALL, {"1": GEN_VERSION_DIR})
    link_model(root, "smollm2-redact", GEN_CONFIG + "privacy: {pii: redact}\n", {"1": GEN_VERSION_DIR})
    link_model(root, "smollm2-nostore", GEN_CONFIG + "privacy: {pii: no_store}\n", {"1": GEN_VERSION_DIR})
    return root


@pytest.fixture(scope="module")
def reference():
    """transformers' own model from the same GGUF weights: (tokenizer, greedy answer ids of messages)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from server.tools.export_decoder import default_gguf

    gguf = default_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()

    def greedy(messages: list[dict], new: int) -> tuple[list[int], list[int]]:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        answer = out[0, len(prompt):].tolist()
        return prompt, [t for t in answer if t != tokenizer.eos_token_id]

    return tokenizer, greedy


@pytest.fixture(scope="module")
def server(gen_models, tmp_path_factory, engines_dir):
    from harness.servers import ServerProcess

    workdir = tmp_path_factory.mktemp("gen-server")
    srv = ServerProcess(workdir, gen_models, frontends=2, engines_dir=engines_dir, wait=False)
    try:
        srv.wait_ready(timeout=300)  # five decoders load one after another: 35 s here, minutes on a busy machine
    except BaseException:
        srv.stop()
        raise
    yield srv
    srv.stop()


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _messages(n_rules: int) -> list[dict]:
    rules = "\n".join(f"Rule {i + 1}: card payments can be disputed within {30 + i} days of the payment." for i in range(n_rules))
    return [{"role": "system", "content": f"You answer for a bank. Use these rules.\n{rules}"},
            {"role": "user", "content": "How do I get a refund for a card payment?"}]


@pytest.mark.parametrize("model", ["smollm2", "smollm2-torch"])
@pytest.mark.parametrize("messages", [_user("How do I get a refund?"), _messages(6), _messages(20)],
                         ids=["short", "medium", "long"])
def test_greedy_answers_equal_transformers_generate_token_for_token(server, reference, messages, model):
    tokenizer, greedy = reference
    prompt, expected = greedy(messages, ANSWER_TOKENS)
    with server.client(timeout_s=120) as client:
        got = client.generate(model, messages=messages, max_new_tokens=ANSWER_TOKENS)
    assert got.prompt_tokens == len(prompt)
    assert got.token_ids == expected, (got.text, tokenizer.decode(expected))
    assert got.text == tokenizer.decode(expected, skip_special_tokens=True)
    assert got.source == "MISS"


@pytest.mark.parametrize("model", ["smollm2", "smollm2-torch"])
def test_generations_that_join_a_running_batch_answer_as_each_alone(server, model):
    """Three questions at once (the batch changes as they join, read their prompts and end) answer as each
    does alone, NO_STORE so that each runs."""
    questions = [unique("Can I freeze my card?"), _messages(12), unique("Where is my transfer?")]

    def ask(question) -> list[int]:
        options = {"messages": question} if isinstance(question, list) else {"prompt": question}
        with server.client(timeout_s=120) as client:
            return client.generate(model, max_new_tokens=20, mode="NO_STORE", **options).token_ids

    alone = [ask(q) for q in questions]
    results: list = [None] * len(questions)
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, ask(questions[i]))) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert results == alone and len({tuple(a) for a in alone}) == 3


def test_a_hit_streams_the_identical_answer_at_once(server):
    question = unique("What is a chargeback?")
    with server.client(timeout_s=120) as client:
        first = client.generate("smollm2", question, max_new_tokens=16)
        # Until its entry is committed, the finished generation answers (COALESCED, replayed); then L1.
        wait_for(lambda: client.generate("smollm2", question, max_new_tokens=16).source == "RESULT_EXACT", 10,
                 "the answer stored")
        pieces = list(client.generate_stream("smollm2", question, max_new_tokens=16))
    assert first.source == "MISS" and first.finish_reason in ("STOP", "LENGTH")
    [hit] = pieces  # the whole answer and its end in one message
    assert hit.end.cache.source == pb.CacheInfo.RESULT_EXACT and hit.end.cache.age_s > 0
    assert hit.text == first.text and list(hit.token_ids) == first.token_ids
    assert hit.end.completion_tokens == len(first.token_ids) and hit.end.cache.key == first.key
    assert hit.end.finish_reason == pb.GenerationEnd.FinishReason.Value(first.finish_reason)


def test_sixteen_identical_calls_in_flight_compute_once_and_get_the_same_stream(server):
    question = unique("Why was my card declined abroad?")
    before = server.stats().worker.counters
    results, errors = [None] * 16, []

    def call(n: int) -> None:
        try:
            with server.client(timeout_s=120) as client:
                results[n] = client.generate("smollm2", question, max_new_tokens=32)
        except Exception as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(n,)) for n in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert not errors
    assert len({(r.text, tuple(r.token_ids)) for r in results}) == 1
    after = server.stats().worker.counters
    assert after["worker.generated"] - before.get("worker.generated", 0) == 1  # computed once
    assert {r.source for r in results} <= {"MISS", "COALESCED", "RESULT_EXACT"}
    assert sum(r.source == "MISS" for r in results) == 1


def test_stop_strings_and_max_new_tokens(server):
    question = unique("How long does a transfer take?")
    with server.client(timeout_s=120) as client:
        whole = client.generate("smollm2", question, max_new_tokens=24, mode="BYPASS")
        five = client.generate("smollm2", question, max_new_tokens=5, mode="BYPASS")
        word = whole.text.split()[3]
        stopped = client.generate("smollm2", question, max_new_tokens=24, stop=[word], mode="BYPASS")
    assert five.finish_reason == "LENGTH" and len(five.token_ids) == 5 and whole.text.startswith(five.text)
    assert stopped.finish_reason == "STOP" and word not in stopped.text
    assert whole.text.startswith(stopped.text) and whole.text[len(stopped.text):].lstrip().startswith(word)


def test_a_prompt_over_the_context_is_invalid_with_the_limit_in_the_message(server):
    with server.client() as client:
        with pytest.raises(grpc.RpcError) as raised:
            client.generate("smollm2-small", "refund " * 80)  # under the 768 characters (template included), over the tokens
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "96" in raised.value.details()
    with server.client() as client:
        with pytest.raises(grpc.RpcError) as raised:
            client.generate("minilm-not-here", "x")
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


def test_tenants_never_share_answers_and_a_version_bump_starts_empty(server):
    question = unique("Can I change my PIN?")
    with server.client(timeout_s=120) as client:
        assert client.generate("smollm2", question, max_new_tokens=8, tenant="a").source == "MISS"
        wait_for(lambda: client.generate("smollm2", question, max_new_tokens=8, tenant="a").source == "RESULT_EXACT",
                 10, "tenant a's answer stored")
        assert client.generate("smollm2", question, max_new_tokens=8, tenant="b").source == "MISS"
        assert client.generate("smollm2", question, max_new_tokens=8, tenant="a", version="2").source == "MISS"
        assert client.invalidate(model="smollm2", version="1", tenant="a") >= 1
        answer = client.generate("smollm2", question, max_new_tokens=8, tenant="a")
        assert answer.source == "MISS"
        wait_for(lambda: client.generate("smollm2", question, max_new_tokens=8, tenant="a").source == "RESULT_EXACT",
                 10, "stored again")
        assert client.invalidate(key=answer.key) == 1  # one answer, by the key its stream ended with
        with pytest.raises(grpc.RpcError) as raised:
            client.invalidate(model="smollm2", text=question)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "by its key" in raised.value.details()


def test_a_seeded_sample_is_reproducible_and_cached_an_unseeded_one_is_not(server):
    question = unique("Tell me about savings accounts.")
    with server.client(timeout_s=120) as client:
        seeded = client.generate("smollm2", question, max_new_tokens=12, temperature=0.9, seed=7, mode="NO_STORE")
        again = client.generate("smollm2", question, max_new_tokens=12, temperature=0.9, seed=7, mode="NO_STORE")
        assert (seeded.text, seeded.token_ids) == (again.text, again.token_ids) and again.source == "MISS"
        client.generate("smollm2", question, max_new_tokens=12, temperature=0.9, seed=7)
        wait_for(lambda: client.generate("smollm2", question, max_new_tokens=12, temperature=0.9,
                                         seed=7).source == "RESULT_EXACT", 10, "the seeded answer stored")
        unseeded = [client.generate("smollm2", question, max_new_tokens=12, temperature=0.9) for _ in range(2)]
    assert [u.source for u in unseeded] == ["MISS", "MISS"]


def test_a_cancelled_stream_frees_its_place_and_overload_is_refused_fast(server):
    """smollm2-small runs one generation at a time with no queue: a second one is refused at once while
    the first runs, and taken once the first's caller went away."""
    with server.client(timeout_s=120) as client:
        stream = client.generate_stream("smollm2-small", unique("Describe every fee."), max_new_tokens=64, mode="BYPASS")
        next(stream)  # running now
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as raised:
            client.generate("smollm2-small", unique("What is an IBAN?"), max_new_tokens=4, mode="BYPASS")
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() - started < 5
        stream.cancel()
        answer = wait_for(lambda: _try(client, "smollm2-small", unique("What is a SWIFT code?")), 30,
                          "the cancelled generation's place")
    assert answer.source == "MISS"
    counters = server.stats().worker.counters
    assert counters["worker.generate_cancelled"] >= 1


def _try(client, model: str, question: str):
    try:
        return client.generate(model, question, max_new_tokens=4, mode="BYPASS")
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise
        return None


def test_infer_on_a_generative_model_and_generate_on_an_encoder_say_which_call_to_use(server):
    with server.client() as client:
        for call in (lambda: client.infer("smollm2", "hello"), lambda: client.generate("minilm", "hello")):
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "call Generate" in raised.value.details() or "use Infer" in raised.value.details()


def test_the_doors_agree_on_roles_and_refuse_an_infinite_temperature(server):
    """gRPC takes OpenAI's "developer" role as the HTTP door does (as "system"), and refuses a temperature
    that is not a finite number >= 0."""
    question = unique("What is a chargeback?")
    with server.client(timeout_s=120) as client:
        as_developer = client.generate("smollm2", messages=[{"role": "developer", "content": "Be brief."},
                                                            {"role": "user", "content": question}], max_new_tokens=4)
        as_system = client.generate("smollm2", messages=[{"role": "system", "content": "Be brief."},
                                                         {"role": "user", "content": question}], max_new_tokens=4)
        assert as_developer.key == as_system.key and as_developer.prompt_tokens == as_system.prompt_tokens
        for temperature in (float("inf"), float("nan"), -1.0):
            with pytest.raises(grpc.RpcError) as refused:
                client.generate("smollm2", question, temperature=temperature, max_new_tokens=4)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, temperature


def test_a_killed_worker_fails_its_streams_with_unavailable_never_a_hang(gen_models, tmp_path, engines_dir):
    from harness.servers import ServerProcess

    srv = ServerProcess(tmp_path, gen_models, frontends=1, engines_dir=engines_dir)
    try:
        with srv.client(timeout_s=120) as client:
            stream = client.generate_stream("smollm2", unique("Explain overdrafts in detail."), max_new_tokens=200)
            next(stream)
            os.kill(srv.worker_pid(), signal.SIGKILL)
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as raised:
                for _ in stream:
                    pass
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 30
    finally:
        srv.stop()


def test_pii_is_redacted_before_the_prompt_is_keyed_or_run_and_no_store_keeps_nothing(server):
    """privacy.pii applies to Generate as to Infer: with redact, two questions that differ only in their
    card number are one key (the model saw the placeholder); with no_store, a prompt holding PII is
    answered and never stored."""
    tail = unique("why was this card declined")
    with server.client(timeout_s=120) as client:
        first = client.generate("smollm2-redact", f"My card 4111 1111 1111 1111: {tail}", max_new_tokens=8)
        assert "4111" not in first.text
        wait_for(lambda: client.generate("smollm2-redact", f"My card 5555 5555 5555 4444: {tail}",
                                         max_new_tokens=8).source == "RESULT_EXACT", 10, "one key for both numbers")
        private = [client.generate("smollm2-nostore", f"My card 4111 1111 1111 1111: {tail}", max_new_tokens=8)
                   for _ in range(2)]
    assert first.source == "MISS" and [p.source for p in private] == ["MISS", "MISS"]


def test_a_long_prompt_is_tokenized_beside_the_event_loop_a_short_one_on_it(tmp_path):
    """Prompts of more than TOKENIZE_INLINE_CHARS characters are tokenized on a thread while the event loop
    goes on (a ticker task runs meanwhile); shorter ones inline, without yielding. Either way the plan
    holds the tokens the model's tokenizer gives."""
    import asyncio

    from tokenizers import Tokenizer

    from server.frontend.prompts import TOKENIZE_INLINE_CHARS, Prompts
    from server.shared.models import ModelRepository

    link_model(tmp_path, "smollm2-long", GEN_CONFIG.replace("context_length: 2048", "context_length: 8192"),
               {"1": GEN_VERSION_DIR})
    prompts = Prompts(ModelRepository(tmp_path))
    tokenizer = Tokenizer.from_file(str(GEN_VERSION_DIR / "tokenizer.json"))
    rule = "Rule {}: card payments can be disputed within {} days of the payment.\n"
    long = "".join(rule.format(i, 30 + i) for i in range(140))
    short = long[:2000]
    assert len(short) <= TOKENIZE_INLINE_CHARS < len(long)

    async def planned(prompt: str):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0)
        before = ticks
        plan = await prompts.plan(pb.GenerateRequest(model="smollm2-long", prompt=prompt))
        task.cancel()
        return plan, ticks - before

    for prompt, yields in ((long, True), (short, False)):
        plan, ticked = asyncio.run(planned(prompt))
        assert plan.ids == tokenizer.encode(prompt, add_special_tokens=False).ids
        assert (ticked > 0) == yields, (len(prompt), ticked)


def test_the_callers_deadline_bounds_a_generation_not_the_servers_default(tmp_path, engines_dir):
    """server.worker_timeout_s bounds only calls that carry no deadline: a generation whose caller allows
    longer runs to its end; one whose caller sets none ends at worker_timeout_s."""
    from harness.servers import ServerProcess

    models = tmp_path / "models"
    link_model(models, "smollm2-small", SMALL, {"1": GEN_VERSION_DIR})
    default_s = 0.2
    srv = ServerProcess(tmp_path, models, frontends=1, engines_dir=engines_dir,
                        settings=(f"server.worker_timeout_s={default_s}",))
    try:
        with srv.client(timeout_s=120) as client:
            started = time.monotonic()
            answer = client.generate("smollm2-small", unique("Write a long story about a bank."), max_new_tokens=64)
            took = time.monotonic() - started
        assert answer.finish_reason in ("LENGTH", "STOP") and answer.source == "MISS"
        assert took > default_s, f"the generation took {took:.2f} s: too short to tell (the premise of this test)"
        with srv.client(timeout_s=None) as client:
            with pytest.raises(grpc.RpcError) as cut:
                client.generate("smollm2-small", unique("Write another long story about a bank."), max_new_tokens=64)
        # (refused at once where the queue implies a longer wait, or cut at the default)
        assert cut.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
    finally:
        srv.stop()
