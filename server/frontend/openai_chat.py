"""The HTTP door's generation routes: POST /v1/chat/completions (messages) and /v1/completions (a raw
prompt), streamed as server-sent events or whole, through the frontend's generation calls
(server/frontend/generation.py). A repeated request body is worked out once."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import orjson

from infercache.v1 import infercache_pb2 as pb
from server.frontend.core import FrontendCore
from server.frontend.http1 import Request, Response, Stream
from server.frontend.openai_wire import (DONE, KEPT, KEPT_MAX_BYTES, body_field, cache_headers, cache_json, error_json,
                                         json_object, policy_of, refuse_unsupported, tenant_of)
from server.frontend.plan import keep
from server.frontend.prompts import ROLES
from server.shared.auth import Grant
from server.shared.errors import InvalidArgument, http_status_of, quoted
from server.shared.generated import FINISH_NAMES


@dataclass(slots=True)
class _Generate:
    """What one /v1/chat/completions or /v1/completions body asks, worked out once."""

    model: str
    request: bytes       # the serialized GenerateRequest
    stream: bool
    usage_chunk: bool    # stream_options.include_usage


class ChatRoutes:
    """The generation routes of one frontend's HTTP door. Event loop only."""

    def __init__(self, core: FrontendCore) -> None:
        self.core = core
        self._calls: dict[tuple, _Generate] = {}

    def _call(self, request: Request, grant: Grant, chat: bool) -> _Generate:
        headers = request.headers
        key = (chat, request.body, grant.tenant, headers.get(b"x-infercache-tenant"),
               headers.get(b"x-infercache-mode"), headers.get(b"x-infercache-max-age"))
        found = self._calls.get(key)
        if found is not None:
            return found
        body = json_object(request.body)
        refuse_unsupported(body)
        model = body_field(body, "model", str, what="a model name")
        if not model:
            raise InvalidArgument("model is required; GET /v1/models lists the served models")
        spec = self.core.repository.get(model)
        if spec.task != "generate":
            raise InvalidArgument(f"model {spec.name!r} is an {spec.task} model; this route serves generative "
                                  "models (task: generate): use /v1/embeddings or the KServe v2 door")
        generate = pb.GenerateRequest(model=model, tenant=tenant_of(grant, headers), cache=policy_of(headers))
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
            value = body_field(body, name, (int, float), what="a number")
            if value is not None:
                setattr(generate, name, float(value))
        seed = body_field(body, "seed", int, what="a whole number")
        if seed is not None:
            if not 0 <= seed < 1 << 64:
                raise InvalidArgument("seed must be within 0..2**64-1")
            generate.seed = seed
        stream = body_field(body, "stream", bool, False, "true or false")
        options = body_field(body, "stream_options", dict, {}, "an object")
        found = _Generate(model, generate.SerializeToString(), stream, bool(options.get("include_usage")))
        if len(request.body) <= KEPT_MAX_BYTES and spec.pii == "off":
            keep(self._calls, key, found, KEPT)
        return found

    async def chat_completions(self, request: Request, grant: Grant) -> Response | Stream:
        return await self._generation(self._call(request, grant, chat=True), chat=True)

    async def completions(self, request: Request, grant: Grant) -> Response | Stream:
        return await self._generation(self._call(request, grant, chat=False), chat=False)

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
        yield b"data: " + error_json(kind, message) + b"\n\n"
        yield DONE
        return
    end = answer.end
    yield shape.event(None, FINISH_NAMES.get(end.finish_reason), infercache=cache_json(end.cache))
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
