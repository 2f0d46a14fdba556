"""One upstream server of a model, by kind: each embeds a list of texts in one call and answers one float32
vector per text, or streams a generation (openai, infercache), or raises Failure. Embedding calls are
awaited on the worker's event loop (openai's run on it; the gRPC kinds' blocking calls in threads of
their own, one per call in flight); a generation streams in a thread of its own.

- openai: POST {url}/embeddings, {url}/chat/completions and {url}/completions (OpenAI's API; url as OpenAI
  clients take it, e.g. http://host:8000/v1);
- infercache: InferBatch and Generate of another infercache's native gRPC API (url http://host:port), the
  caller's tenant passed on, so the upstream's tiers keep tenants apart too;
- kserve: KServe v2 ModelInfer over gRPC (Triton, KServe; url http://host:port): one BYTES input of the texts,
  shape [N, 1], the embedding an FP32 [N, D] output."""

from __future__ import annotations

import asyncio
import base64
import functools
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol
from urllib.parse import urlsplit

import grpc
import numpy as np

from infercache.v1 import infercache_pb2 as pb
from server.shared.generated import FINISH_NAMES
from server.shared.upstream_spec import UpstreamSpec
from server.worker.upstream.credentials import Credential
from server.worker.upstream.errors import Failure
from server.worker.upstream.http import JsonEndpoint

_LENGTH = struct.Struct("<I")
# gRPC status codes an upstream answers, as the HTTP statuses Failure knows (retries, breaker, domain error)
_GRPC_AS_HTTP = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.NOT_FOUND: 404,
                 grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAUTHENTICATED: 401,
                 grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.UNAVAILABLE: 503,
                 grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNKNOWN: 500,
                 grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNIMPLEMENTED: 501}


class Client(Protocol):
    url: str

    async def embed(self, texts: list[str], tenant: str, timeout_s: float) -> list[np.ndarray]:
        """One vector per text, in order; Failure otherwise."""

    def generate(self, request: dict, tenant: str, on_piece, timeout_s: float) -> tuple[str, dict]:
        """A streamed generation (kind openai): its text to on_piece piece by piece; (finish reason, usage)."""

    def close(self) -> None: ...


def _vectors(rows, count: int) -> list[np.ndarray]:
    """float32 vectors of one dimension from `rows` (lists of numbers), `count` of them; Failure otherwise."""
    if len(rows) != count:
        raise Failure("malformed", f"answered {len(rows)} embeddings for {count} texts")
    try:
        matrix = np.asarray(rows, dtype=np.float32)
    except (TypeError, ValueError):
        raise Failure("malformed", "answered embeddings that are not lists of numbers of one length") from None
    if matrix.ndim != 2 or matrix.shape[1] == 0 or not np.isfinite(matrix).all():
        raise Failure("malformed", f"answered embeddings of shape {matrix.shape}, or not finite")
    return list(matrix)


def _embeddings(answer: dict, count: int) -> list[np.ndarray]:
    """The vectors of an OpenAI embeddings answer, in input order."""
    data = answer.get("data")
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise Failure("malformed", "answered no data list")
    try:
        ordered = sorted(data, key=lambda d: d.get("index", 0))
        return _vectors([_decoded(d["embedding"]) for d in ordered], count)
    except (KeyError, TypeError):
        raise Failure("malformed", "answered data items without an embedding") from None


def _decoded(embedding):
    """An embedding as OpenAI answers it: base64 of float32 little-endian, or a list of numbers."""
    if not isinstance(embedding, str):
        return embedding
    try:
        raw = base64.b64decode(embedding, validate=True)
    except ValueError:
        raise Failure("malformed", "answered an embedding that is neither numbers nor base64") from None
    if len(raw) % 4:
        raise Failure("malformed", f"answered a base64 embedding of {len(raw)} bytes, not float32 values")
    return np.frombuffer(raw, dtype="<f4")


class OpenAIClient:
    def __init__(self, url: str, model: str, credential: Credential | None, timeout_s: float) -> None:
        self.url = url
        self.model = model
        headers = {"authorization": credential.header()} if credential is not None else {}
        self.endpoint = JsonEndpoint(url, headers, timeout_s)

    async def embed(self, texts: list[str], tenant: str, timeout_s: float) -> list[np.ndarray]:
        """Asks for base64 (float32 little-endian: a tenth of the parsing of JSON numbers); a server that
        answers numbers anyway is read as well."""
        return await self.endpoint.post_async(
            "/embeddings", {"model": self.model, "input": texts, "encoding_format": "base64"}, timeout_s,
            read=functools.partial(_embeddings, count=len(texts)))

    def generate(self, request: dict, tenant: str, on_piece, timeout_s: float) -> tuple[str, dict]:
        """request: messages (chat completions) or prompt (completions), and the settings, as OpenAI names
        them. Each piece awaited for at most timeout_s."""
        chat = "messages" in request
        body = {"model": self.model, **request, "stream": True, "stream_options": {"include_usage": True}}
        finish, usage = None, {}
        for event in self.endpoint.events("/chat/completions" if chat else "/completions", body, timeout_s):
            if isinstance(event.get("error"), dict):  # an error in the stream (its status was 200)
                raise Failure("cut", f"the upstream's stream ended in an error: {event['error'].get('message')!r:.300}")
            for choice in event.get("choices") or ():
                if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                    continue
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if isinstance(piece, str) and piece:
                    on_piece(piece)
                if isinstance(choice.get("finish_reason"), str):
                    finish = choice["finish_reason"]
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
        if finish is None:
            raise Failure("cut", "the stream ended without a finish_reason")
        return finish, usage

    def close(self) -> None:
        self.endpoint.close()


class _GrpcClient:
    """A channel to host:port (TLS for https://), the credential as call metadata, and the one method it calls."""

    def __init__(self, url: str, model: str, output: str, credential: Credential | None, calls: int) -> None:
        parts = urlsplit(url)
        self.url = url
        self.model = model
        self.output = output
        target = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
        self.channel = (grpc.secure_channel(target, grpc.ssl_channel_credentials(), options)
                        if parts.scheme == "https" else grpc.insecure_channel(target, options))
        self.metadata = (("authorization", credential.header()),) if credential is not None else ()
        path, request, response = self.method_of()
        self.method = self.channel.unary_unary(path, request_serializer=request.SerializeToString,
                                               response_deserializer=response.FromString)
        self._threads = ThreadPoolExecutor(calls, thread_name_prefix="upstream")  # (upstream.max_in_flight)

    def _call(self, request, timeout_s: float):
        try:
            return self.method(request, timeout=timeout_s, metadata=self.metadata)
        except grpc.RpcError as exc:
            raise _failure(exc, timeout_s) from None

    async def embed(self, texts: list[str], tenant: str, timeout_s: float) -> list[np.ndarray]:
        return await asyncio.get_running_loop().run_in_executor(self._threads, self.embed_blocking, texts, tenant,
                                                                timeout_s)

    def embed_blocking(self, texts: list[str], tenant: str, timeout_s: float) -> list[np.ndarray]:
        raise NotImplementedError

    def close(self) -> None:
        self._threads.shutdown(wait=False)
        self.channel.close()

    @staticmethod
    def method_of() -> tuple[str, type, type]:
        """(path, request message, response message) of the one method the kind calls."""
        raise NotImplementedError


def _failure(exc: grpc.RpcError, timeout_s: float) -> Failure:
    code = exc.code()
    if code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED):  # (cancelled: a piece's timer)
        return Failure("timeout", f"no answer within {timeout_s:.1f} s")
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in (exc.details() or "").lower():
        return Failure("connect", f"cannot reach it: {exc.details()[:200]}")
    return Failure.of_status(_GRPC_AS_HTTP.get(code, 500), f"{code.name}: {(exc.details() or '')[:300]}")


class _Watchdog:
    """Calls `expire` once `timeout_s` pass without a feed(): one thread for a whole stream, however many
    messages it brings."""

    def __init__(self, timeout_s: float, expire) -> None:
        self._timeout_s = timeout_s
        self._due = time.monotonic() + timeout_s
        self._expire = expire
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="upstream-watchdog", daemon=True).start()

    def feed(self) -> None:
        self._due = time.monotonic() + self._timeout_s

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        while not self._stopped.wait(max(0.0, self._due - time.monotonic())):
            if time.monotonic() >= self._due:
                self._expire()
                return


class InfercacheClient(_GrpcClient):
    def __init__(self, url: str, model: str, output: str, credential: Credential | None, calls: int) -> None:
        super().__init__(url, model, output, credential, calls)
        self._generate = self.channel.unary_stream("/infercache.v1.InferenceCache/Generate",
                                                   request_serializer=pb.GenerateRequest.SerializeToString,
                                                   response_deserializer=pb.GenerateResponse.FromString)

    @staticmethod
    def method_of() -> tuple[str, type, type]:
        return "/infercache.v1.InferenceCache/InferBatch", pb.InferBatchRequest, pb.InferBatchResponse

    def generate(self, request: dict, tenant: str, on_piece, timeout_s: float) -> tuple[str, dict]:
        """Generate of the upstream, the caller's tenant passed on; each message awaited for at most
        timeout_s (a timer cancels the call past it)."""
        message = pb.GenerateRequest(model=self.model, tenant=tenant, max_new_tokens=request["max_tokens"],
                                     temperature=request["temperature"], stop=request.get("stop", []))
        if "messages" in request:
            message.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in request["messages"])
        else:
            message.prompt = request["prompt"]
        for name in ("top_p", "top_k", "seed"):
            if name in request:
                setattr(message, name, request[name])
        call = self._generate(message, metadata=self.metadata)
        started = False
        watchdog = _Watchdog(timeout_s, call.cancel)
        try:
            for answer in call:
                watchdog.feed()
                if answer.text:
                    started = True
                    on_piece(answer.text)
                if answer.HasField("end"):
                    end = answer.end
                    return FINISH_NAMES.get(end.finish_reason, "stop"), {"prompt_tokens": end.prompt_tokens,
                                                                        "completion_tokens": end.completion_tokens}
        except grpc.RpcError as exc:
            failure = _failure(exc, timeout_s)
            raise Failure("cut", f"the stream broke off: {failure}") if started else failure from None
        finally:
            watchdog.stop()
            call.cancel()  # (a stream left early: its call ends here, not when collected)
        raise Failure("cut" if started else "malformed", "the stream ended without its last message")

    def embed_blocking(self, texts: list[str], tenant: str, timeout_s: float) -> list[np.ndarray]:
        answer = self._call(pb.InferBatchRequest(model=self.model, tenant=tenant, texts=texts), timeout_s)
        rows = []
        for result in answer.results:
            tensor = next((t for t in result.outputs if t.name == self.output), None)
            if tensor is None or tensor.dtype != "float32":
                raise Failure("malformed", f"answered no float32 output {self.output!r}")
            rows.append(np.frombuffer(tensor.data, dtype="<f4"))
        return _vectors(rows, len(texts))


def _kserve():
    """KServe v2's messages, imported with the first such client: their proto package (inference) is also
    tritonclient's, and one process may hold only one of the two."""
    from infercache.kserve import grpc_service_pb2

    return grpc_service_pb2


class KServeClient(_GrpcClient):
    @staticmethod
    def method_of() -> tuple[str, type, type]:
        kpb = _kserve()
        return "/inference.GRPCInferenceService/ModelInfer", kpb.ModelInferRequest, kpb.ModelInferResponse

    def embed_blocking(self, texts: list[str], tenant: str, timeout_s: float) -> list[np.ndarray]:
        request = _kserve().ModelInferRequest(model_name=self.model)
        request.inputs.add(name="text", datatype="BYTES", shape=[len(texts), 1])
        request.raw_input_contents.append(b"".join(_LENGTH.pack(len(t)) + t for t in (x.encode() for x in texts)))
        answer = self._call(request, timeout_s)
        names = [o.name for o in answer.outputs]
        at = names.index(self.output) if self.output in names else (0 if names and not self.output else -1)
        if at < 0:
            raise Failure("malformed", f"answered no output {self.output!r} (outputs: {', '.join(names)})")
        tensor = answer.outputs[at]
        if tensor.datatype != "FP32" or len(tensor.shape) != 2 or tensor.shape[0] != len(texts):
            raise Failure("malformed", f"output {tensor.name!r} is {tensor.datatype} {list(tensor.shape)}, not "
                                       f"FP32 [{len(texts)}, D]")
        if len(answer.raw_output_contents) > at:
            data = np.frombuffer(answer.raw_output_contents[at], dtype="<f4")
        else:
            data = np.asarray(tensor.contents.fp32_contents, dtype=np.float32)
        if data.size != len(texts) * tensor.shape[1]:
            raise Failure("malformed", f"output {tensor.name!r} holds {data.size} values for shape {list(tensor.shape)}")
        return _vectors(data.reshape(len(texts), tensor.shape[1]), len(texts))


def client_for(spec: UpstreamSpec, url: str, model: str, output: str, credential: Credential | None) -> Client:
    if spec.kind == "openai":
        return OpenAIClient(url, spec.upstream_model(model), credential, spec.timeout_s)
    if spec.kind == "infercache":
        return InfercacheClient(url, spec.upstream_model(model), spec.output or output, credential, spec.max_in_flight)
    return KServeClient(url, spec.upstream_model(model), spec.output, credential, spec.max_in_flight)
