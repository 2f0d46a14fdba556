"""PII through the real server: 1,000 requests with planted PII of every kind in `redact` mode leave no
trace of it in any file under the cache directory (semantic snapshots included) or in the log, while the
redacted variants share entries; `no_store` answers such requests and never caches them."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from harness.servers import ServerProcess, link_model
from infercache.v1 import infercache_pb2 as pb
from server.shared.normalize import DEFAULT_STEPS, Normalizer
from tests.conftest import MINILM_CONFIG, MODEL_VERSION_DIR
from tests.helpers import is_cached, wait_cached

REDACT = "privacy:\n  pii: redact\n"
TEMPLATES = {
    "email": "please send the statement to {} today",
    "iban": "my transfer to {} has not arrived",
    "card": "my card {} was declined at the shop",
    "national_id": "my social security number is {}, update my profile",
    "ip": "my login was blocked from {} this morning",
    "phone": "call me back at {} about my refund",
}


def luhn_card(rng: random.Random) -> str:
    digits = [4] + [rng.randrange(10) for _ in range(14)]
    total = sum(d if i % 2 else (2 * d if 2 * d < 10 else 2 * d - 9) for i, d in enumerate(reversed(digits)))
    number = "".join(map(str, digits + [(10 - total % 10) % 10]))
    return " ".join(number[i:i + 4] for i in range(0, 16, 4))


def iban(rng: random.Random) -> str:
    bban = "".join(str(rng.randrange(10)) for _ in range(18))
    check = 98 - int(bban + "131400") % 97  # D=13, E=14, check digits 00
    return f"DE{check:02d}{bban}"


def planted(kind: str, n: int, rng: random.Random) -> str:
    return {
        "email": lambda: f"customer.{n}+bank@example{n % 7}.com",
        "iban": lambda: iban(rng),
        "card": lambda: luhn_card(rng),
        "national_id": lambda: f"{rng.randrange(100, 665)}-{rng.randrange(10, 99)}-{rng.randrange(1000, 9999)}",
        "ip": lambda: f"10.{rng.randrange(256)}.{rng.randrange(256)}.{rng.randrange(1, 255)}",
        "phone": lambda: f"+1 415 555 {rng.randrange(10000):04d}",
    }[kind]()


def traces(value: str) -> set[bytes]:
    """The forms a value could be stored in: as sent, case-folded, normalized without redaction, digits only."""
    forms = {value, value.lower(), Normalizer(DEFAULT_STEPS)(value)}
    digits = "".join(c for c in value if c.isdigit())
    if len(digits) >= 7:
        forms.add(digits)
    return {form.encode() for form in forms}


@pytest.fixture(scope="module")
def private_server(tmp_path_factory, faq_models, engines_dir):
    root = tmp_path_factory.mktemp("private-models")
    link_model(root, "minilm", MINILM_CONFIG + REDACT, {"1": MODEL_VERSION_DIR})
    link_model(root, "minilm-no-store", MINILM_CONFIG + "privacy:\n  pii: no_store\n", {"1": MODEL_VERSION_DIR})
    faq = (faq_models / "faq" / "config.yaml").read_text()
    link_model(root, "faq", faq + REDACT, {"1": faq_models / "faq" / "1"})
    srv = ServerProcess(tmp_path_factory.mktemp("private-server"), root, engines_dir=engines_dir, frontends=1)
    yield srv
    srv.stop()


def test_text_of_a_refused_request_stays_out_of_the_log(private_server):
    channel, stub = private_server.stub()
    with channel:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Infer(pb.InferRequest(model="minilm", text="x" * 5000 + " my card 4111 1111 1111 1111"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "4111" not in private_server.log_text()


def test_planted_pii_is_nowhere_on_disk_nor_in_the_log_and_variants_share_entries(private_server):
    rng = random.Random(77)
    jobs = []
    for n in range(1000):
        kind = list(TEMPLATES)[n % len(TEMPLATES)]
        model = "faq" if (n // len(TEMPLATES)) % 2 else "minilm"
        jobs.append((model, kind, planted(kind, n, rng)))
    with private_server.client() as client, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda job: client.infer(job[0], TEMPLATES[job[1]].format(job[2])), jobs))
        keys: dict[tuple[str, str], set[str]] = {}
        for (model, kind, _), answer in zip(jobs, answers):
            keys.setdefault((model, kind), set()).add(answer.key)
        assert all(len(found) == 1 for found in keys.values()), keys  # every variant: one entry
        sources = [a.source for a in answers]
        # (a repeat before its entry is written is answered by the worker from memory: COALESCED)
        assert sources.count("RESULT_EXACT") + sources.count("COALESCED") >= 900, sources
        card_answers = [a for (m, k, _), a in zip(jobs, answers) if (m, k) == ("faq", "card")]
        assert len({a.label for a in card_answers}) == 1
        for model, kind in keys:
            wait_cached(client, model, TEMPLATES[kind].format(planted(kind, 10_000, rng)))
        assert client.stats().store.entries == len(keys)
        secret = "my card 4539 1488 0343 6467 expired, call +44 20 7946 0958"
        for _ in range(2):  # no_store: answered every time, never cached, never looked up
            assert client.infer("minilm-no-store", secret).source == "MISS"
        assert not is_cached(client, "minilm-no-store", secret)
        assert client.stats().frontend.counters["frontend.pii_not_stored"] >= 3
        clean = "how long does a transfer take"
        client.infer("minilm-no-store", clean)
        wait_cached(client, "minilm-no-store", clean)
    assert private_server.stop() == 0  # the worker writes its semantic snapshots on the way out

    files = [p for p in private_server.cache_dir.rglob("*") if p.is_file()]
    assert any(p.suffix == ".hnsw" for p in files), "no semantic snapshot was written"
    haystacks = {p: p.read_bytes() for p in files}
    haystacks[private_server.log_path] = private_server.log_path.read_bytes()
    needles = set().union(*(traces(value) for _, _, value in jobs), traces("4539 1488 0343 6467"),
                          traces("+44 20 7946 0958"))
    found = [(needle, path.name) for needle in needles for path, data in haystacks.items() if needle in data]
    assert not found, found[:10]
    # The search reads what is stored: the answers' labels are there in clear (no encryption here).
    assert card_answers[0].label.encode() in haystacks[private_server.cache_dir / "data.mdb"]


def test_the_frontend_keeps_no_raw_request_of_a_model_with_a_pii_setting(tmp_path):
    """Frontends keep serialized requests that repeat (Planner.prepared: their plan and key), but
    never those of a model whose privacy.pii is set: the bytes hold the text as sent."""
    from collections import Counter

    from server import config as settings
    from server.frontend.core import FrontendCore
    from server.shared.models import ModelRepository

    root = tmp_path / "models"
    link_model(root, "redacting", MINILM_CONFIG + REDACT, {"1": MODEL_VERSION_DIR})
    link_model(root, "plain", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    config = settings.load(None, {}, {"cache.dir": str(tmp_path / "cache"), "server.models_dir": str(root)})
    core = FrontendCore(config, ModelRepository(root), None, Counter())
    text = "my card 4111 1111 1111 1111 was declined"
    for model in ("redacting", "plain"):
        raw = pb.InferRequest(model=model, text=text).SerializeToString()
        plan, (normalized, _, _) = core.planner.prepared(raw)
        assert plan.served.spec.name == model
        assert ("4111" in normalized) == (model == "plain")  # redacted before keying
        assert (raw in core.planner._prepared) == (model == "plain")


def test_a_kept_plan_follows_the_semantic_overrides_and_holds_no_request(tmp_path):
    """Plans are kept per (model, version, tenant, mode, semantic overrides): requests that differ only in
    their overrides get their own, identical ones share one, and a kept plan holds a copy of the
    overrides, not the request they came with (whose text would stay in memory)."""
    from collections import Counter

    from server import config as settings
    from server.frontend.core import FrontendCore
    from server.shared.models import ModelRepository

    root = tmp_path / "models"
    link_model(root, "plain", MINILM_CONFIG, {"1": MODEL_VERSION_DIR})
    config = settings.load(None, {}, {"cache.dir": str(tmp_path / "cache"), "server.models_dir": str(root)})
    core = FrontendCore(config, ModelRepository(root), None, Counter())

    def plan(**semantic):
        request = pb.InferRequest(model="plain", text="a private question",
                                  semantic=pb.SemanticPolicy(**semantic) if semantic else None)
        return core.planner.prepare(request)[0], request

    none, _ = plan()
    off, request = plan(enabled=False)
    strict, _ = plan(min_similarity=0.95)
    assert none.semantic is None and off.semantic.enabled is False and strict.semantic.min_similarity == pytest.approx(0.95)
    assert plan(enabled=False)[0] is off and plan()[0] is none and plan(min_similarity=0.95)[0] is strict
    request.semantic.enabled = True  # the request changed after its plan was kept: the plan did not
    assert off.semantic.HasField("enabled") and off.semantic.enabled is False
    assert not strict.semantic.HasField("enabled")
    # A field the schema does not know (here 1 MB of it) neither makes a plan of its own nor is kept.
    padded = pb.InferRequest.FromString(pb.InferRequest(model="plain", text="a private question").SerializeToString()
                                        + b"\x32" + _length_delimited(b"\xa2\x06" + _length_delimited(b"x" * (1 << 20))))
    assert padded.HasField("semantic") and padded.semantic.ByteSize() > 1 << 20
    kept = core.planner.prepare(padded)[0]
    assert kept is core.planner.prepare(pb.InferRequest(model="plain", text="a", semantic=pb.SemanticPolicy()))[0]
    assert kept.semantic.ByteSize() == 0


def _length_delimited(data: bytes) -> bytes:
    from cachestore.wire import varint

    return varint(len(data)) + data

