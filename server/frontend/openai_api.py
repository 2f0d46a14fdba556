"""The OpenAI-compatible HTTP door (server.http_port), served by each frontend over
server/frontend/http1.py through the same transport-free cores as gRPC (core.py, generation.py): the same
tokens, tenants, admission, normalization, tiers and /metrics.

    POST /v1/embeddings         embedding models: input a string or a list of them; encoding_format float
                                or base64; dimensions only where it is the model's own size
    POST /v1/chat/completions   generative models: messages, streamed (server-sent events) or whole
    POST /v1/completions        generative models: a raw prompt, streamed or whole
    GET  /v1/models, /v1/models/{id}

Request headers: `authorization: Bearer <token>`, `x-infercache-tenant`, `x-infercache-mode` (default,
bypass, no-store, only-if-cached), `x-infercache-max-age` (seconds). Response headers:
`x-infercache-source`, `-age`, `-model-version`, `-key` (`-similarity` for semantic answers), one value per
input, comma-separated. Errors are OpenAI's error object with the status of server/shared/errors.py
HTTP_STATUS. What a repeated request body asks is worked out once (parsing, validation, the token count
its usage reports), as the gRPC door does for repeated request bytes."""

from __future__ import annotations

import asyncio
import base64
import functools
import os
import time
from dataclasses import dataclass

import numpy as np
import orjson

from infercache.v1 import infercache_pb2 as pb
from server.frontend.core import TOKENIZE_INLINE_MAX, FrontendCore
from server.frontend.http1 import Request, Response, Stream
from server.frontend.parameters import whole_seconds
from server.frontend.plan import keep
from server.frontend.prompts import ROLES
from server.frontend.tally import NO_TALLY, measured
from server.shared.auth import CLIENT, Gate, Grant, bind_tenant
from server.shared.errors import InvalidArgument, http_status_of, quoted, status_of
from server.shared.generated import FINISH_NAMES

Mode = pb.CachePolicy.Mode
MODES = {b"default": Mode.DEFAULT, b"bypass": Mode.BYPASS, b"no-store": Mode.NO_STORE,
         b"only-if-cached": Mode.ONLY_IF_CACHED}
SOURCES = {value: name.encode() for name, value in pb.CacheInfo.Source.items()}
# Parameters of OpenAI's API this server cannot honour: refused, never silently ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "audio", "modalities", "prediction", "echo", "suffix", "best_of")
# Headers whose repetition would make a call ambiguous (which token, which tenant): refused (400), as gRPC
# refuses a repeated authorization (server/shared/auth.py).
SINGLE_HEADERS = frozenset({b"authorization", b"x-infercache-tenant", b"x-infercache-mode", b"x-infercache-max-age",
                            b"content-type"})
KEPT = 4096  # request bodies whose worked-out call is kept (per route); past it, start over
KEPT_MAX_BYTES = 4096  # longer bodies are worked out each time
RENDERED_KEPT = 1024  # exact hits' embedding objects kept (see OpenAIDoor._exact_hit); past it, start over
DONE = b"data: [DONE]\n\n"


def _no_deadline() -> None:
    """An HTTP call's time remaining: it carries no deadline (server.worker_timeout_s bounds its wait)."""
    return None


def _error(kind: str, message: str) -> bytes:
    """OpenAI's error object."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


def error_body(status: int, kind: str, message: str) -> Response:
    return Response(status, _error(kind, message))


def _json(body: bytes) -> dict:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return value


def _get(body: dict, name: str, kinds: type | tuple, default=None, what: str = ""):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool):
        raise InvalidArgument(f"{name} must be {what or getattr(kinds, '__name__', kinds)}, got {quoted(str(value))}")
    return value


def _model_named(body: bytes) -> str:
    """The model a body names, where it names one (a /metrics label of a refused call)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else ""


def _refuse_unsupported(body: dict) -> None:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], ""):
            raise InvalidArgument(f"{name} is not supported by this server; leave it out")
    if body.get("n") not in (None, 1):
        raise InvalidArgument("n: this server returns one choice; leave n out or send 1")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise InvalidArgument("response_format: only {\"type\": \"text\"} is supported")


def _policy(headers: dict[bytes, bytes]) -> pb.CachePolicy | None:
    mode, max_age = headers.get(b"x-infercache-mode"), headers.get(b"x-infercache-max-age")
    if mode is None and max_age is None:
        return None
    policy = pb.CachePolicy()
    if mode is not None:
        found = MODES.get(mode.strip().lower().replace(b"_", b"-"))
        if found is None:
            raise InvalidArgument(f"x-infercache-mode must be one of {', '.join(m.decode() for m in MODES)}, got "
                                  f"{quoted(mode.decode(errors='replace'))}")
        policy.mode = found
    if max_age is not None:
        policy.max_age_s = whole_seconds(max_age, "x-infercache-max-age")
    return policy


def cache_headers(infos: list[pb.CacheInfo]) -> list[tuple[bytes, bytes]]:
    """x-infercache-* headers of the answers' CacheInfo, one value per answer, comma-separated."""
    headers = [(b"x-infercache-source", b",".join(SOURCES.get(i.source, b"") for i in infos)),
               (b"x-infercache-age", b",".join(b"%.3f" % i.age_s for i in infos)),
               (b"x-infercache-model-version", b",".join(i.model_version.encode() for i in infos)),
               (b"x-infercache-key", b",".join(i.key.encode() for i in infos))]
    if any(i.source == pb.CacheInfo.RESULT_SEMANTIC for i in infos):
        headers.append((b"x-infercache-similarity", b",".join(b"%.4f" % i.similarity for i in infos)))
    if any(i.stale for i in infos):  # expired entries that answered for a model that could not (stale_if_error_s)
        headers.append((b"x-infercache-stale", b",".join(b"1" if i.stale else b"0" for i in infos)))
    return headers


def _cache_json(info: pb.CacheInfo) -> dict:
    return {"source": SOURCES.get(info.source, b"").decode(), "age_s": round(info.age_s, 3),
            "model_version": info.model_version, "key": info.key}


@dataclass(slots=True)
class _Embed:
    """What one /v1/embeddings body asks, worked out once."""

    model: str
    model_json: bytes
    requests: list[bytes]                  # a serialized InferRequest per input
    batch: pb.InferBatchRequest | None     # all of them as one InferBatch call (more than one input)
    base64: bool
    dimensions: int | None
    prompt_tokens: int | None  # usage: counted once the texts were answered (so they are valid)


@dataclass(slots=True)
class _Generate:
    """What one /v1/chat/completions or /v1/completions body asks, worked out once."""

    model: str
    request: bytes       # the serialized GenerateRequest
    stream: bool
    usage_chunk: bool    # stream_options.include_usage


def _check_dimensions(call: _Embed, size: int) -> None:
    """`dimensions` is honoured where it is the model's own size: no model here can shorten its embeddings."""
    if call.dimensions is not None and call.dimensions != size:
        raise InvalidArgument(f"model {call.model!r} returns {size}-dimensional embeddings and cannot shorten "
                              f"them; leave dimensions out (or send {size})")


class OpenAIDoor:
    """Routes of the HTTP door; a Request in, a Response or a Stream out. Event loop only."""

    def __init__(self, core: FrontendCore, gate: Gate) -> None:
        self.core = core
        self.gate = gate
        self.max_batch_texts = core.config.server.max_batch_texts
        self._embeds: dict[tuple, _Embed] = {}
        self._generates: dict[tuple, _Generate] = {}
        # exact hits' embedding objects by format (base64 or not), by (key, creation time): _exact_hit
        self._rendered: dict[bool, dict[tuple[bytes, int], list]] = {False: {}, True: {}}
        self.routes = {(b"POST", b"/v1/embeddings"): self.embeddings,
                       (b"POST", b"/v1/chat/completions"): self.chat_completions,
                       (b"POST", b"/v1/completions"): self.completions,
                       (b"GET", b"/v1/models"): self.models}

    async def handle(self, request: Request) -> Response | Stream:
        route = self.routes.get((request.method, request.path))
        if route is None:
            if request.method != b"GET" or not request.path.startswith(b"/v1/models/"):
                return self._no_route(request)
            route = self.model
        try:
            auth = request.headers.get(b"authorization")
            grant = self.gate.admit_bearer(None if auth is None else auth.decode("latin-1"), CLIENT)
            return await route(request, grant)
        except Exception as exc:  # noqa: BLE001 (domain errors answer with their status; the rest 500, logged)
            status, kind, message, retry_after = http_status_of(exc, request.path.decode("latin-1")[:100])
            response = error_body(status, kind, message)
            if retry_after is not None:
                response.headers.append((b"retry-after", b"%d" % retry_after))
            return response

    def _no_route(self, request: Request) -> Response:
        if any(path == request.path for _, path in self.routes):
            return error_body(405, "invalid_request_error", f"{request.method.decode()} is not served on "
                              f"{request.path.decode('latin-1')}")
        return error_body(404, "not_found_error", f"no route {request.path.decode('latin-1')[:200]}: this server "
                          "serves /v1/embeddings, /v1/chat/completions, /v1/completions and /v1/models")

    async def model(self, request: Request, grant: Grant) -> Response:
        spec = self.core.repository.get(request.path[len(b"/v1/models/"):].decode("utf-8", "replace"))
        return Response(200, orjson.dumps(self._model_entry(spec)))

    @staticmethod
    def _model_entry(spec) -> dict:
        return {"id": spec.name, "object": "model", "created": 0, "owned_by": "infercache",
                "infercache": {"task": spec.task, "serving_version": spec.serving_version}}

    async def models(self, request: Request, grant: Grant) -> Response:
        return Response(200, orjson.dumps({"object": "list", "data": [
            self._model_entry(spec) for spec in self.core.repository.servable()]}))

    # --- embeddings -----------------------------------------------------------------------------------
    def _tenant(self, grant: Grant, headers: dict[bytes, bytes]) -> str:
        try:  # (strict: tenants of invalid UTF-8 would all be one tenant, U+FFFD)
            tenant = headers.get(b"x-infercache-tenant", b"").decode()
        except UnicodeDecodeError:
            raise InvalidArgument("x-infercache-tenant must be UTF-8 text") from None
        holder = pb.InferRequest(tenant=tenant)
        bind_tenant(grant, holder)
        return holder.tenant

    def _embed_call(self, request: Request, grant: Grant) -> _Embed:
        headers = request.headers
        key = (request.body, grant.tenant, headers.get(b"x-infercache-tenant"), headers.get(b"x-infercache-mode"),
               headers.get(b"x-infercache-max-age"))
        found = self._embeds.get(key)
        if found is not None:
            return found
        body = _json(request.body)
        model = _get(body, "model", str, what="a model name")
        if not model:
            raise InvalidArgument("model is required; GET /v1/models lists the served models")
        inputs = body.get("input")
        if isinstance(inputs, str):
            inputs = [inputs]
        elif not (isinstance(inputs, list) and inputs and all(isinstance(one, str) for one in inputs)):
            raise InvalidArgument("input must be a string or a non-empty list of strings (token ids are not "
                                  "accepted: send the text)")
        if len(inputs) > self.max_batch_texts:
            raise InvalidArgument(f"input has {len(inputs)} items; at most {self.max_batch_texts} per call "
                                  "(server.max_batch_texts)")
        encoding = _get(body, "encoding_format", str, "float")
        if encoding not in ("float", "base64"):
            raise InvalidArgument(f"encoding_format must be float or base64, got {quoted(encoding)}")
        dimensions = _get(body, "dimensions", int, what="a whole number")
        spec = self.core.repository.get(model)
        if spec.task != "embedding":
            use = ("/v1/chat/completions or /v1/completions" if spec.task == "generate"
                   else "the KServe v2 door or Infer")
            raise InvalidArgument(f"model {spec.name!r} is a {spec.task} model; /v1/embeddings serves embedding "
                                  f"models (use {use})")
        tenant, policy = self._tenant(grant, headers), _policy(headers)
        one = pb.InferRequest(model=model, tenant=tenant, cache=policy)
        requests = []
        for text in inputs:
            one.text = text
            requests.append(one.SerializeToString())
        batch = (pb.InferBatchRequest(model=model, tenant=tenant, texts=inputs, cache=policy)
                 if len(inputs) > 1 else None)
        found = _Embed(model, orjson.dumps(model), requests, batch, encoding == "base64", dimensions, None)
        if len(request.body) <= KEPT_MAX_BYTES and spec.pii == "off":
            keep(self._embeds, key, found, KEPT)
        return found

    def _texts(self, call: _Embed) -> tuple:
        """The texts of `call` as the model reads them, and its encoder."""
        planner = self.core.planner
        first = pb.InferRequest.FromString(call.requests[0])
        served = planner.plan(first).served
        return [planner.keyed(first.tenant, served, pb.InferRequest.FromString(raw).text).text
                for raw in call.requests], served.encoder

    async def _prompt_tokens(self, call: _Embed) -> int:
        """What the texts of `call` are to the model, in tokens (usage), counted once: a hit never
        tokenizes otherwise. Many texts are tokenized off the event loop, as the core's misses are. A
        model computed upstream counts none: this server has not its tokenizer."""
        if len(call.requests) <= TOKENIZE_INLINE_MAX:
            return self._tokens_inline(call)
        texts, encoder = self._texts(call)
        if encoder is None:
            call.prompt_tokens = 0
            return 0
        call.prompt_tokens = sum(map(len, await asyncio.to_thread(encoder.encode_batch, texts)))
        return call.prompt_tokens

    def _tokens_inline(self, call: _Embed) -> int:
        """_prompt_tokens of a call of a few texts (one input's), on the event loop: nothing awaited."""
        texts, encoder = self._texts(call)
        call.prompt_tokens = 0 if encoder is None else sum(len(encoder.encode(text)) for text in texts)
        return call.prompt_tokens

    async def embeddings(self, request: Request, grant: Grant) -> Response:
        core = self.core
        try:
            call = self._embed_call(request, grant)
        except Exception as exc:
            if core.metrics is not None:  # counted as the native door counts a call it refuses
                core.metrics.failed(core.metrics.model_label(_model_named(request.body)), 1, status_of(exc)[0].name,
                                    0.0)
            raise
        if call.batch is None:
            raw = call.requests[0]
            kept = self._rendered[call.base64]
            if core.metrics is None:  # (core.infer_entry's steps, without a coroutine of their own)
                plan, keyed = core.planner.prepared(raw)
                answer = core.exact(plan, keyed, NO_TALLY, kept) or await core.after_l1(plan, keyed, None)
            else:
                answer = await measured(core, functools.partial(core.infer_entry, kept=kept), raw, 1, _no_deadline)
            if type(answer) is tuple:  # an exact hit, the traffic a cache is for: its JSON made once per entry
                if call.prompt_tokens is None:  # (nothing awaited between the read and _exact_hit)
                    self._tokens_inline(call)
                return self._exact_hit(call, answer)
            answers = [pb.InferResponse.FromString(answer)]
        else:
            raw = (await core.infer_batch(call.batch, None) if core.metrics is None else
                   await measured(core, core.infer_batch, call.batch, len(call.requests), _no_deadline))
            answers = list(pb.InferBatchResponse.FromString(raw).results)
        items = []
        for index, answer in enumerate(answers):
            item, size = self._item(answer, index, call.base64)
            _check_dimensions(call, size)
            items.append(item)
        return await self._embeddings_response(call, items, cache_headers([answer.cache for answer in answers]))

    async def _embeddings_response(self, call: _Embed, items: list[bytes], headers: list) -> Response:
        if call.prompt_tokens is None:
            await self._prompt_tokens(call)
        return self._embeddings_body(call, items, headers)

    @staticmethod
    def _embeddings_body(call: _Embed, items: list[bytes], headers: list) -> Response:
        """The answer of a call whose texts were answered and counted (call.prompt_tokens)."""
        tokens = call.prompt_tokens
        body = b'{"object":"list","data":[%s],"model":%s,"usage":{"prompt_tokens":%d,"total_tokens":%d}}' % (
            b",".join(items), call.model_json, tokens, tokens)
        return Response(200, body, headers)

    @staticmethod
    def _item(answer: pb.InferResponse, index: int, as_base64: bool) -> tuple[bytes, int]:
        """One input's embedding object, and the embedding's size."""
        data = answer.outputs[0].data
        if as_base64:
            vector = b'"%s"' % base64.b64encode(data)
        else:
            vector = orjson.dumps(np.frombuffer(data, "<f4"), option=orjson.OPT_SERIALIZE_NUMPY)
        return b'{"object":"embedding","index":%d,"embedding":%s}' % (index, vector), len(data) // 4

    def _exact_hit(self, call: _Embed, entry: tuple[bytes | None, bytes, int, float]) -> Response:
        """An exact hit of one input (FrontendCore.exact's entry) whose tokens were counted: its embedding
        object and fixed headers are made once per entry and format, kept by (key, creation time) while
        among the last RENDERED_KEPT (the entry's stored bytes are then not read again), with the last
        body made of them (reused while calls name the model alike); its age is set per call."""
        stored, key, created_us, age_s = entry
        kept = self._rendered[call.base64]
        found = kept.get((key, created_us)) if stored is None else None
        if found is None:
            answer = pb.InferResponse.FromString(stored)
            item, size = self._item(answer, 0, call.base64)
            found = [item, size, [(b"x-infercache-model-version", answer.cache.model_version.encode()),
                                  (b"x-infercache-key", answer.cache.key.encode())], None]
            keep(kept, (key, created_us), found, RENDERED_KEPT)
        item, size, fixed, made = found
        _check_dimensions(call, size)
        headers = [(b"x-infercache-source", b"RESULT_EXACT"), (b"x-infercache-age", b"%.3f" % age_s), *fixed]
        if made is not None and made[0] == call.model_json and made[1] == call.prompt_tokens:
            return Response(200, made[2], headers)
        response = self._embeddings_body(call, [item], headers)
        found[3] = (call.model_json, call.prompt_tokens, response.body)
        return response

    # --- generation -------------------------------------------------------------------------------------
    def _generate_call(self, request: Request, grant: Grant, chat: bool) -> _Generate:
        headers = request.headers
        key = (chat, request.body, grant.tenant, headers.get(b"x-infercache-tenant"),
               headers.get(b"x-infercache-mode"), headers.get(b"x-infercache-max-age"))
        found = self._generates.get(key)
        if found is not None:
            return found
        body = _json(request.body)
        _refuse_unsupported(body)
        model = _get(body, "model", str, what="a model name")
        if not model:
            raise InvalidArgument("model is required; GET /v1/models lists the served models")
        spec = self.core.repository.get(model)
        if spec.task != "generate":
            raise InvalidArgument(f"model {spec.name!r} is an {spec.task} model; this route serves generative "
                                  "models (task: generate): use /v1/embeddings or the KServe v2 door")
        generate = pb.GenerateRequest(model=model, tenant=self._tenant(grant, headers), cache=_policy(headers))
        if chat:
            generate.messages.extend(_messages(body.get("messages")))
        else:
            generate.prompt = _prompt(body.get("prompt"))
        limit = body.get("max_completion_tokens", body.get("max_tokens"))
        if limit is not None:
            if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit < 1 << 32:
                raise InvalidArgument("max_tokens must be a positive whole number")
            generate.max_new_tokens = limit
        stop = body.get("stop")
        if stop is not None:
            stops = [stop] if isinstance(stop, str) else stop
            if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
                raise InvalidArgument("stop must be a string or a list of strings")
            generate.stop.extend(stops)
        for name in ("temperature", "top_p"):
            value = _get(body, name, (int, float), what="a number")
            if value is not None:
                setattr(generate, name, float(value))
        seed = _get(body, "seed", int, what="a whole number")
        if seed is not None:
            if not 0 <= seed < 1 << 64:
                raise InvalidArgument("seed must be within 0..2**64-1")
            generate.seed = seed
        stream = _get(body, "stream", bool, False, "true or false")
        options = _get(body, "stream_options", dict, {}, "an object")
        found = _Generate(model, generate.SerializeToString(), stream, bool(options.get("include_usage")))
        if len(request.body) <= KEPT_MAX_BYTES and spec.pii == "off":
            keep(self._generates, key, found, KEPT)
        return found

    async def chat_completions(self, request: Request, grant: Grant) -> Response | Stream:
        return await self._generation(self._generate_call(request, grant, chat=True), chat=True)

    async def completions(self, request: Request, grant: Grant) -> Response | Stream:
        return await self._generation(self._generate_call(request, grant, chat=False), chat=False)

    async def _generation(self, call: _Generate, chat: bool) -> Response | Stream:
        calls = self.core.generation
        plan = await calls.plan(call.request)
        hit = calls.hit(plan)
        messages = None
        if hit is None:
            messages = calls.generate(plan, None)
            first = await anext(messages)  # errors before the first message answer with their status
        shape = _Shape(call.model, chat)
        if call.stream:
            headers = cache_headers([pb.GenerateResponse.FromString(hit).end.cache]) if hit is not None else []
            return Stream(_events(shape, call, hit, first if hit is None else None, messages), headers)
        if hit is not None:
            answer = pb.GenerateResponse.FromString(hit)
            return shape.whole(answer.text, answer.end)
        parts = [pb.GenerateResponse.FromString(first)]
        async for message in messages:
            parts.append(pb.GenerateResponse.FromString(message))
        return shape.whole("".join(part.text for part in parts), parts[-1].end)


class _Shape:
    """The JSON of one generation's answer: chat.completion(.chunk) or text_completion."""

    def __init__(self, model: str, chat: bool) -> None:
        self.model, self.chat = model, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + os.urandom(12).hex()
        self.created = int(time.time())

    def _envelope(self, choice: dict, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}

    def _choice(self, text: str | None, finish: str | None, chunk: bool, first: bool = False) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        if chunk:
            delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}

    @staticmethod
    def usage(end: pb.GenerationEnd) -> dict:
        return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
                "total_tokens": end.prompt_tokens + end.completion_tokens}

    def whole(self, text: str, end: pb.GenerationEnd) -> Response:
        body = self._envelope(self._choice(text, FINISH_NAMES.get(end.finish_reason), False), False)
        body["usage"] = self.usage(end)
        return Response(200, orjson.dumps(body), cache_headers([end.cache]))

    def event(self, text: str | None, finish: str | None = None, first: bool = False, **extra) -> bytes:
        body = self._envelope(self._choice(text, finish, True, first), True)
        body.update(extra)
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def usage_event(self, end: pb.GenerationEnd) -> bytes:
        body = self._envelope({}, True)
        body["choices"], body["usage"] = [], self.usage(end)
        return b"data: " + orjson.dumps(body) + b"\n\n"


async def _events(shape: _Shape, call: _Generate, hit: bytes | None, first: bytes | None, messages):
    """A streamed answer as server-sent events: the role, the text as it comes, the finish reason with the
    answer's cache information (`infercache`), the usage where asked, then [DONE]. An error after the
    first event is an error event (the status went out already)."""
    if shape.chat:
        yield shape.event("", first=True)
    try:
        if hit is not None:
            answer = pb.GenerateResponse.FromString(hit)
            if answer.text:
                yield shape.event(answer.text)
        else:
            answer = pb.GenerateResponse.FromString(first)
            if answer.text:
                yield shape.event(answer.text)
            async for message in messages:
                answer = pb.GenerateResponse.FromString(message)
                if answer.text:
                    yield shape.event(answer.text)
    except Exception as exc:  # noqa: BLE001 (its status as an error event: the stream's head went out)
        _, kind, message, _ = http_status_of(exc, "stream")
        yield b"data: " + _error(kind, message) + b"\n\n"
        yield DONE
        return
    end = answer.end
    yield shape.event(None, FINISH_NAMES.get(end.finish_reason), infercache=_cache_json(end.cache))
    if call.usage_chunk:
        yield shape.usage_event(end)
    yield DONE


def _messages(messages) -> list[pb.ChatMessage]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list of {role, content}")
    out = []
    for n, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidArgument(f"messages[{n}] must be an object with role and content")
        role = message.get("role")
        role = ROLES.get(role) if isinstance(role, str) else None
        if role is None:
            raise InvalidArgument(f"messages[{n}].role must be one of {', '.join(ROLES)}, got "
                                  f"{quoted(str(message.get('role')))}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise InvalidArgument(f"messages[{n}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise InvalidArgument(f"messages[{n}].content must be a string or a list of text parts")
        out.append(pb.ChatMessage(role=role, content=content))
    return out


def _prompt(prompt) -> str:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise InvalidArgument("prompt must be a non-empty string (one prompt per call)")
    return prompt
