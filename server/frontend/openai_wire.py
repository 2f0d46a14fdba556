"""The OpenAI API's wire shapes that the HTTP door's routes share (server/frontend/openai_api.py for
embeddings and models, server/frontend/openai_chat.py for generation): request fields checked, the
x-infercache-* headers read and written, OpenAI's error object."""

from __future__ import annotations

import orjson

from infercache.v1 import infercache_pb2 as pb
from server.frontend.http1 import Response
from server.frontend.parameters import whole_seconds
from server.shared.auth import Grant, bind_tenant
from server.shared.errors import InvalidArgument, quoted

Mode = pb.CachePolicy.Mode
MODES = {b"default": Mode.DEFAULT, b"bypass": Mode.BYPASS, b"no-store": Mode.NO_STORE,
         b"only-if-cached": Mode.ONLY_IF_CACHED}
SOURCES = {value: name.encode() for name, value in pb.CacheInfo.Source.items()}
# Parameters of OpenAI's API this server cannot honour: refused, never silently ignored.
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logprobs", "top_logprobs", "logit_bias",
               "audio", "modalities", "prediction", "echo", "suffix", "best_of")
KEPT = 4096  # request bodies whose worked-out call is kept (per route); past it, start over
KEPT_MAX_BYTES = 4096  # longer bodies are worked out each time
DONE = b"data: [DONE]\n\n"
# Headers whose repetition would make a call ambiguous (which token, which tenant): refused (400), as gRPC
# refuses a repeated authorization (server/shared/auth.py).
SINGLE_HEADERS = frozenset({b"authorization", b"x-infercache-tenant", b"x-infercache-mode", b"x-infercache-max-age",
                            b"content-type"})


def error_json(kind: str, message: str) -> bytes:
    """OpenAI's error object."""
    return orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": None}})


def error_body(status: int, kind: str, message: str) -> Response:
    return Response(status, error_json(kind, message))


def json_object(body: bytes) -> dict:
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return value


def body_field(body: dict, name: str, kinds: type | tuple, default=None, what: str = ""):
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kinds) or (isinstance(value, bool) and kinds is not bool):
        raise InvalidArgument(f"{name} must be {what or getattr(kinds, '__name__', kinds)}, got {quoted(str(value))}")
    return value


def model_named(body: bytes) -> str:
    """The model a body names, where it names one (a /metrics label of a refused call)."""
    try:
        value = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else ""


def refuse_unsupported(body: dict) -> None:
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False, 0, [], ""):
            raise InvalidArgument(f"{name} is not supported by this server; leave it out")
    if body.get("n") not in (None, 1):
        raise InvalidArgument("n: this server returns one choice; leave n out or send 1")
    response_format = body.get("response_format")
    if response_format is not None and (not isinstance(response_format, dict) or response_format.get("type") != "text"):
        raise InvalidArgument("response_format: only {\"type\": \"text\"} is supported")


def policy_of(headers: dict[bytes, bytes]) -> pb.CachePolicy | None:
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


def cache_json(info: pb.CacheInfo) -> dict:
    return {"source": SOURCES.get(info.source, b"").decode(), "age_s": round(info.age_s, 3),
            "model_version": info.model_version, "key": info.key}


def tenant_of(grant: Grant, headers: dict[bytes, bytes]) -> str:
    try:  # (strict: tenants of invalid UTF-8 would all be one tenant, U+FFFD)
        tenant = headers.get(b"x-infercache-tenant", b"").decode()
    except UnicodeDecodeError:
        raise InvalidArgument("x-infercache-tenant must be UTF-8 text") from None
    holder = pb.InferRequest(tenant=tenant)
    bind_tenant(grant, holder)
    return holder.tenant
