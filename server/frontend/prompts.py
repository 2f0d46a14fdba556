"""A Generate call's plan in a frontend: the model version (a generative one), its prompt rendered with the
model's chat template and tokenized with the caller's text kept data (server/frontend/prompt_ids.py; with
`privacy.pii: redact`, PII replaced by placeholders first, as for Infer; with `no_store`, a prompt holding
PII is answered but never looked up or stored), the generation settings with the model's defaults filled
in, and the cache key, which covers the namespace, the prompt as the model sees it and every setting
that changes the answer. With the model's `generate.normalize: text`, each turn's text is normalized as
Infer's texts are before it is rendered (FAQ-style traffic: case, punctuation and spacing do not split
keys, and the model answers the normalized question, so an answer is a function of its key alone). For a
model with semantic answers (server/shared/answer_match.py), the plan also holds the request's question:
its last user turn, keyed in the namespace of everything else that shapes the answer, its ids for the
embedder and its guard marks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from cachestore.keys import Namespace, entry_key, namespace_id
from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import worker_pb2
from server.frontend.plan import check_identifiers, keep, key_route
from server.frontend.prompt_ids import PromptRenderer
from server.shared import pii
from server.shared import question_guards as guards
from server.shared.answer_match import namespace_material
from server.shared.errors import InvalidArgument, ModelNotFound, lenient, parsed
from server.shared.generation_spec import PromptFormat
from server.shared.models import TOKENIZER_FILE, ModelRepository, ModelSpec
from server.shared.normalize import REDACTING_ONLY, Normalizer, holds_pii, nfkc
from server.shared.tokenization import TextEncoder

log = logging.getLogger("infercache.prompts")

Mode = pb.CachePolicy.Mode
# A turn's role as the caller names it -> as the template knows it: OpenAI's "developer" is its newer name of
# "system" (every door takes it: openai_api reads its roles from here).
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_STOPS, MAX_STOP_CHARS = 4, 64
MAX_MESSAGES = 256
PREPARED_KEPT = 1024        # serialized requests whose plan is kept (see Prompts.prepared); past it, start over
PREPARED_MAX_BYTES = 4096   # longer requests are planned anew each time
# Prompts longer than this (in characters) are tokenized on a thread, off the event loop: a 4,160-word
# prompt took about 10 ms of the loop on an H100 host (2 ms on a 2-core one), while other calls waited behind it.
TOKENIZE_INLINE_CHARS = 8192

GENERATE_REQUEST = lenient(pb.GenerateRequest)  # Generate's requests arrive serialized (server/frontend/servicer.py)


@dataclass(slots=True)
class GenerativeModel:
    """What a frontend needs of one generative model version."""

    spec: ModelSpec
    version: str
    renderer: PromptRenderer | None  # its chat template and tokenizer (None: an upstream's; turns go as they are)
    normalize: Normalizer | None  # each turn's text before rendering (generate.normalize, privacy.pii)
    public: dict[str, list[int]]  # a public system prompt's text (as normalized) -> its tokens rendered alone
    # semantic answers (spec.answer_match): the question's normalizer and the embedder's tokenizer
    question_normalize: Normalizer | None = None
    embed_encoder: TextEncoder | None = None

    def route(self, key: bytes) -> int:
        return key_route(key)


@dataclass(slots=True)
class GeneratePlan:
    model: GenerativeModel
    tenant: str
    ids: list[int]               # the prompt's token ids
    params: worker_pb2.GenerateParams
    key: bytes
    cached_ok: bool              # a stored answer may answer (deterministic, not BYPASS, TTL > 0)
    store: bool                  # the answer is stored
    only_if_cached: bool
    max_age_us: int
    ns: Namespace
    ttl_class: str               # the TTL class of what it stores (server/shared/ttl_classes.py)
    public_prefix: int = 0       # leading prompt tokens of a public system prompt (ComputeItem.public_prefix)
    question: Question | None = None  # semantic answers: the request's question (None: not matched)
    text: str = ""               # an upstream model's: its messages or prompt, as JSON (ComputeItem.text)


@dataclass(slots=True)
class Question:
    """A request's last user turn for semantic answers (server/shared/answer_match.py)."""

    key: bytes                   # in the namespace of everything else that shapes the answer
    embed_ids: list[int]         # the normalized question's ids for the embedder
    marks: str                   # its guard marks, one a line (server/shared/question_guards.py)


def _template(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(source)


class Prompts:
    """Generate plans; the models' tokenizers and templates, made once per version. Event loop only."""

    def __init__(self, repository: ModelRepository) -> None:
        self.repository = repository
        self._models: dict[tuple[str, str], GenerativeModel] = {}
        self._prepared: dict[bytes, GeneratePlan] = {}  # see prepared

    def model(self, spec: ModelSpec, version: str) -> GenerativeModel:
        found = self._models.get((spec.name, version))
        if found is None and spec.upstream is not None:  # no tokenizer or template here: the upstream's
            found = self._models[(spec.name, version)] = GenerativeModel(spec, version, None, _turn_normalizer(spec),
                                                                         {}, *self._question_tools(spec))
        if found is None:
            directory = spec.version_dir(version)
            try:
                tokenizer = Tokenizer.from_file(str(directory / TOKENIZER_FILE))
                template = _template(PromptFormat.read(directory).chat_template)
            except Exception as exc:  # (tokenizers raises a bare Exception for a file it cannot read)
                raise ModelNotFound(f"model {spec.name!r} version {version!r} cannot be served here: {exc}") from None
            tokenizer.no_truncation()
            tokenizer.no_padding()
            normalize = _turn_normalizer(spec)
            renderer = PromptRenderer(tokenizer, template, spec.name)
            public = {}
            for _, text in spec.prefix.public_prompts:
                text = normalize(text) if normalize else text
                public[text] = renderer.ids(renderer.chat([{"role": "system", "content": text}], False))
            found = self._models[(spec.name, version)] = GenerativeModel(spec, version, renderer, normalize, public,
                                                                         *self._question_tools(spec))
        return found

    def _question_tools(self, spec: ModelSpec) -> tuple[Normalizer | None, TextEncoder | None]:
        """Semantic answers: the question's normalizer (Infer's, whatever generate.normalize says: the
        embedding is of the normalized question) and the embedder's tokenizer; none where the model has
        no semantic answers or its embedder is not served (the worker then has no tier either)."""
        policy = spec.answer_match
        if policy is None or policy.rule.embedder not in self.repository.models:
            return None, None
        embedder = self.repository.get(policy.rule.embedder)
        try:
            encoder = TextEncoder(embedder.version_dir(embedder.serving_version) / TOKENIZER_FILE, embedder.max_tokens)
        except Exception as exc:  # noqa: BLE001 (its tokenizer does not load: exact answers only)
            log.error("%s: no semantic answers: the embedder %r's tokenizer does not load: %s", spec.name,
                      policy.rule.embedder, exc)
            return None, None
        return Normalizer.of(spec), encoder

    def prepare_models(self) -> None:
        """Tokenizers and templates of every served generative version, before the frontend listens."""
        for spec in self.repository.servable():
            if spec.task == "generate":
                for version in spec.versions:
                    try:
                        self.model(spec, version)
                    except ModelNotFound:
                        pass  # left to its requests, which say why

    async def prepared(self, raw: bytes) -> GeneratePlan:
        """plan() of a serialized GenerateRequest. A request that repeats byte for byte (a question asked
        again: the traffic a cache is for) reuses its plan: no parsing, rendering, tokenizing or hashing on
        the hit path. Requests with max_age_s are planned each time (their plan holds that age)."""
        found = self._prepared.get(raw)
        if found is None:
            request = parsed(GENERATE_REQUEST(raw))
            found = await self.plan(request)
            # (not for a privacy.pii model: the bytes would keep the raw text in memory)
            if (len(raw) <= PREPARED_MAX_BYTES and not request.cache.HasField("max_age_s")
                    and found.model.spec.pii == "off"):
                keep(self._prepared, raw, found, PREPARED_KEPT)
        return found

    async def plan(self, request: pb.GenerateRequest) -> GeneratePlan:
        check_identifiers(request)
        if not request.model:
            raise InvalidArgument("model is required; ListModels shows the served models")
        spec = self.repository.get(request.model)
        if spec.task != "generate":
            raise InvalidArgument(f"model {spec.name!r} is an {spec.task} model; Generate needs a generative one "
                                  "(task: generate); use Infer")
        version = spec.resolve_version(request.version)
        model = self.model(spec, version)
        generation = spec.generation
        prompt, turns = _asked(model, request)
        if model.renderer is None:  # an upstream's: keyed and sent as asked (normalized), never tokenized here
            ids, text = [], json.dumps({"messages": turns} if turns is not None else {"prompt": prompt},
                                       ensure_ascii=False, separators=(",", ":"))
            if len(text) > spec.max_text_chars:
                raise InvalidArgument(f"the messages take {len(text)} characters; this model accepts at most "
                                      f"{spec.max_text_chars} (input.max_text_chars)")
            keyed: str | list[int] = text
        else:
            rendered = model.renderer.raw(prompt) if turns is None else model.renderer.chat(turns)
            text = rendered.text
            if len(text) > spec.max_text_chars:
                raise InvalidArgument(f"the prompt has {len(text)} characters; this model accepts at most {spec.max_text_chars}")
            ids = (model.renderer.ids(rendered) if len(text) <= TOKENIZE_INLINE_CHARS else
                   await asyncio.to_thread(model.renderer.ids, rendered))
            if not ids:
                raise InvalidArgument("the prompt is empty; send messages or a prompt")
            if len(ids) >= generation.context_length:
                raise InvalidArgument(f"the prompt has {len(ids)} tokens; this model's context is {generation.context_length} "
                                      f"tokens (prompt and answer), so a prompt may have at most {generation.context_length - 1}")
            keyed = ids if rendered.holds_control else text
        params = _params(request, generation)
        private = spec.pii == "no_store" and self._holds_pii(request)
        mode = request.cache.mode
        if mode not in Mode.values():
            raise InvalidArgument(f"cache.mode {mode} is not one of {sorted(Mode.keys())}")
        deterministic = params.temperature == 0 or params.HasField("seed")
        ttl_class, ttl_s = spec.ttl_classes.resolve(request.cache.ttl_class, spec.name)
        cached_at_all = ttl_s > 0 and deterministic and not private  # privacy.pii no_store: never kept
        max_age_us = ttl_s * 1_000_000
        if request.cache.HasField("max_age_s"):
            max_age_us = min(max_age_us, request.cache.max_age_s * 1_000_000)
        cached_ok, store = cached_at_all and mode != Mode.BYPASS, cached_at_all and mode != Mode.NO_STORE
        return GeneratePlan(
            model=model, tenant=request.tenant, ids=ids, params=params,
            key=entry_key(namespace_id(request.tenant, spec.name, version, spec.key_variant), _canonical(keyed, params)),
            question=_question(model, request, turns, params) if cached_ok or store else None,
            cached_ok=cached_ok, store=store,
            only_if_cached=mode == Mode.ONLY_IF_CACHED, max_age_us=max_age_us,
            ns=Namespace(request.tenant, spec.name, version), ttl_class=ttl_class,
            public_prefix=_public_prefix(model, request, ids), text=text if model.renderer is None else "")

    @staticmethod
    def _holds_pii(request: pb.GenerateRequest) -> bool:
        return holds_pii(request.prompt) or any(holds_pii(m.content) for m in request.messages)


def _turn_normalizer(spec: ModelSpec) -> Normalizer | None:
    """What each turn's text goes through before it is rendered or sent: Infer's normalization where
    generate.normalize says text; else as sent, but PII replaced by placeholders where the model says redact."""
    if spec.generation.normalize == "text":
        return Normalizer.of(spec)
    return Normalizer(REDACTING_ONLY) if spec.pii == "redact" else None


def _asked(model: GenerativeModel, request: pb.GenerateRequest) -> tuple[str | None, list[dict] | None]:
    """What the request asks, normalized: its raw prompt (caller text throughout: a control token's text in
    it is text), or its turns with their roles as the template knows them; the other one None."""
    if bool(request.messages) == bool(request.prompt):
        raise InvalidArgument("set exactly one of messages and prompt")
    normalize = model.normalize or (lambda text: text)
    if request.prompt:
        return normalize(request.prompt), None
    if len(request.messages) > MAX_MESSAGES:
        raise InvalidArgument(f"messages has {len(request.messages)} turns; at most {MAX_MESSAGES}")
    turns = []
    for n, message in enumerate(request.messages):
        role = ROLES.get(message.role)
        if role is None:
            raise InvalidArgument(f"messages[{n}].role must be one of {', '.join(ROLES)}, got {message.role!r}")
        turns.append({"role": role, "content": normalize(message.content)})
    if turns[-1]["role"] == "assistant":
        raise InvalidArgument("the last message is the assistant's; end with a user (or system) message")
    return None, turns


def _question(model: GenerativeModel, request: pb.GenerateRequest, turns: list[dict] | None,
              params: worker_pb2.GenerateParams) -> Question | None:
    """The request's question for semantic answers: its last turn, a user's, normalized as Infer's texts
    are, keyed in the namespace of every other turn the model's `semantic.context` counts and the
    settings; None where the model has no semantic answers or the request ends otherwise."""
    spec = model.spec
    policy = spec.answer_match
    if policy is None or model.embed_encoder is None or not turns or turns[-1]["role"] != "user":
        return None
    asked = request.messages[-1].content
    question = model.question_normalize(asked)
    if not question:
        return None
    material = namespace_material(policy, turns, _settings(params))
    ns_id = namespace_id(request.tenant, spec.name, model.version, spec.key_variant + material)
    redacted = pii.redact(nfkc(asked)) if spec.pii == "redact" else asked
    return Question(entry_key(ns_id, question), model.embed_encoder.encode(question), guards.encode(guards.marks(redacted)))


def _public_prefix(model: GenerativeModel, request: pb.GenerateRequest, ids: list[int]) -> int:
    """How many of the prompt's first tokens a public system prompt made: the tokens it shares with that
    prompt rendered alone (the conversation's first turn is that system prompt, word for word)."""
    if not model.public or not request.messages or request.messages[0].role != "system":
        return 0
    content = request.messages[0].content
    public = model.public.get(model.normalize(content) if model.normalize else content)
    if public is None:
        return 0
    shared = 0
    for mine, theirs in zip(ids, public):
        if mine != theirs:
            break
        shared += 1
    return shared


def _params(request: pb.GenerateRequest, generation) -> worker_pb2.GenerateParams:
    """The request's settings with the model's defaults filled in, checked."""
    if request.max_new_tokens > generation.max_new_tokens:
        raise InvalidArgument(f"max_new_tokens is {request.max_new_tokens}; this model allows at most "
                              f"{generation.max_new_tokens}")
    if len(request.stop) > MAX_STOPS or any(not s or len(s) > MAX_STOP_CHARS for s in request.stop):
        raise InvalidArgument(f"stop: at most {MAX_STOPS} strings of 1 to {MAX_STOP_CHARS} characters")
    temperature = request.temperature if request.HasField("temperature") else generation.temperature
    top_p = request.top_p if request.HasField("top_p") else generation.top_p
    top_k = request.top_k if request.HasField("top_k") else generation.top_k
    if not (0 <= temperature < math.inf and 0 < top_p <= 1):
        raise InvalidArgument("temperature must be a finite number >= 0 and top_p within (0, 1]")
    params = worker_pb2.GenerateParams(max_new_tokens=request.max_new_tokens or generation.max_new_tokens,
                                       stop=list(request.stop), temperature=temperature)
    if temperature > 0:  # greedy: the rest does not change the answer, so it does not split keys
        params.top_p, params.top_k = top_p, top_k
        if request.HasField("seed"):
            params.seed = request.seed
    return params


def _settings(params: worker_pb2.GenerateParams) -> list:
    """Every setting that changes the answer."""
    return [params.max_new_tokens, list(params.stop), round(params.temperature, 6), round(params.top_p, 6),
            params.top_k, params.seed if params.HasField("seed") else None]


def _canonical(prompt: str | list[int], params: worker_pb2.GenerateParams) -> str:
    """What the key hashes beside the namespace: the prompt and every setting that changes the answer.
    The prompt is its text, or its token ids where the caller's text holds a control token's text (the
    text alone would not tell that from the template's own control tokens, a list of ids cannot be
    mistaken for a text)."""
    return json.dumps([prompt, *_settings(params)], ensure_ascii=False, separators=(",", ":"))
