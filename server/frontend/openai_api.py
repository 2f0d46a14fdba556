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
from dataclasses import dataclass

import numpy as np
import orjson

from infercache.v1 import infercache_pb2 as pb
from server.frontend.core import TOKENIZE_INLINE_MAX, FrontendCore
from server.frontend.http1 import Request, Response, Stream
from server.frontend.openai_chat import ChatRoutes
from server.frontend.openai_wire import (KEPT, KEPT_MAX_BYTES, cache_headers, error_body, body_field, json_object,
                                         model_named, policy_of, tenant_of)
from server.frontend.plan import keep
from server.frontend.tally import NO_TALLY, measured
from server.shared.auth import CLIENT, Gate, Grant
from server.shared.errors import InvalidArgument, http_status_of, quoted, status_of

RENDERED_KEPT = 1024  # exact hits' embedding objects kept (see OpenAIDoor._exact_hit); past it, start over


def _no_deadline() -> None:
    """An HTTP call's time remaining: it carries no deadline (server.worker_timeout_s bounds its wait)."""
    return None


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
        self.chat = ChatRoutes(core)
        # exact hits' embedding objects by format (base64 or not), by (key, creation time): _exact_hit
        self._rendered: dict[bool, dict[tuple[bytes, int], list]] = {False: {}, True: {}}
        self.routes = {(b"POST", b"/v1/embeddings"): self.embeddings,
                       (b"POST", b"/v1/chat/completions"): self.chat.chat_completions,
                       (b"POST", b"/v1/completions"): self.chat.completions,
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
    def _embed_call(self, request: Request, grant: Grant) -> _Embed:
        headers = request.headers
        key = (request.body, grant.tenant, headers.get(b"x-infercache-tenant"), headers.get(b"x-infercache-mode"),
               headers.get(b"x-infercache-max-age"))
        found = self._embeds.get(key)
        if found is not None:
            return found
        body = json_object(request.body)
        model = body_field(body, "model", str, what="a model name")
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
        encoding = body_field(body, "encoding_format", str, "float")
        if encoding not in ("float", "base64"):
            raise InvalidArgument(f"encoding_format must be float or base64, got {quoted(encoding)}")
        dimensions = body_field(body, "dimensions", int, what="a whole number")
        spec = self.core.repository.get(model)
        if spec.task != "embedding":
            use = ("/v1/chat/completions or /v1/completions" if spec.task == "generate"
                   else "the KServe v2 door or Infer")
            raise InvalidArgument(f"model {spec.name!r} is a {spec.task} model; /v1/embeddings serves embedding "
                                  f"models (use {use})")
        tenant, policy = tenant_of(grant, headers), policy_of(headers)
        one = pb.InferRequest(model=model, tenant=tenant, cache=policy)
        requests = []
        for text in inputs:
            one.text = text
            requests.append(one.SerializeToString())
        batch = (pb.InferBatchRequest(model=model, tenant=tenant, texts=inputs, cache=policy)
                 if len(inputs) > 1 else None)
        # A model computed upstream counts no tokens: this server has not its tokenizer.
        tokens = 0 if spec.upstream is not None else None
        found = _Embed(model, orjson.dumps(model), requests, batch, encoding == "base64", dimensions, tokens)
        if len(request.body) <= KEPT_MAX_BYTES and spec.pii == "off":
            keep(self._embeds, key, found, KEPT)
        return found

    def _texts(self, call: _Embed) -> tuple:
        """The texts of `call` as the model reads them, and its encoder (a local model's: an upstream
        model's call has its tokens, none, from _embed_call)."""
        planner = self.core.planner
        first = pb.InferRequest.FromString(call.requests[0])
        served = planner.plan(first).served
        return [planner.keyed(first.tenant, served, pb.InferRequest.FromString(raw).text).text
                for raw in call.requests], served.encoder

    async def _prompt_tokens(self, call: _Embed) -> int:
        """What the texts of `call` are to the model, in tokens (usage), counted once: a hit never
        tokenizes otherwise. Many texts are tokenized off the event loop, as the core's misses are."""
        if len(call.requests) <= TOKENIZE_INLINE_MAX:
            return self._tokens_inline(call)
        texts, encoder = self._texts(call)
        call.prompt_tokens = sum(map(len, await asyncio.to_thread(encoder.encode_batch, texts)))
        return call.prompt_tokens

    def _tokens_inline(self, call: _Embed) -> int:
        """_prompt_tokens of a call of a few texts (one input's), on the event loop: nothing awaited."""
        texts, encoder = self._texts(call)
        call.prompt_tokens = sum(len(encoder.encode(text)) for text in texts)
        return call.prompt_tokens

    async def embeddings(self, request: Request, grant: Grant) -> Response:
        core = self.core
        try:
            call = self._embed_call(request, grant)
        except Exception as exc:
            if core.metrics is not None:  # counted as the native door counts a call it refuses
                core.metrics.failed(core.metrics.model_label(model_named(request.body)), 1, status_of(exc)[0].name,
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
