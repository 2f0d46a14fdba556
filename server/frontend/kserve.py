"""The KServe v2 ("Open Inference") gRPC door: inference.GRPCInferenceService
(protos/infercache/kserve/grpc_service.proto) on the frontends' gRPC port, beside the native service
(server.kserve). Triton's and KServe's clients call it unchanged.

ModelInfer takes one BYTES input of texts (any name; shape [N] or [N, 1], the batch dimension N) and
answers the model's outputs as typed tensors with the batch dimension first (an embedding model's
`embedding` FP32 [N, D]; a classifier's `scores` FP32 [N, C], `label` BYTES [N], `probability` FP32 [N]).
One text goes through Infer's path, several through InferBatch's: the same tokens, tenants, admission,
tiers and /metrics. Request parameters: `tenant` (a string), `cache_mode` (a string: DEFAULT, BYPASS,
NO_STORE, ONLY_IF_CACHED), `max_age_s` (a whole number of seconds: an integer, a whole double or digits);
one of another type is INVALID_ARGUMENT. Response parameters, one value per text, comma-separated:
`cache_source`, `cache_age_s`, `cache_key`, `cache_similarity` where a text was answered semantically, and
`cache_stale` where an expired entry answered (cache.stale_if_error_s). Errors are the native status codes
(server/shared/errors.py)."""

from __future__ import annotations

import functools
import struct
from importlib import metadata

import grpc
import numpy as np

from infercache.kserve import grpc_service_pb2 as kpb
from infercache.v1 import infercache_pb2 as pb
from server.frontend.core import FrontendCore
from server.frontend.parameters import whole_seconds
from server.frontend.plan import keep
from server.frontend.tally import measured
from server.shared.auth import CLIENT, Gate, bind_tenant
from server.shared.errors import InvalidArgument, ModelNotFound, grpc_errors, lenient, parsed

SERVICE = kpb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
SERVICE_NAME = SERVICE.full_name
DATATYPES = {"float32": "FP32", "float16": "FP16", "float64": "FP64", "int64": "INT64", "int32": "INT32",
             "int16": "INT16", "int8": "INT8", "uint8": "UINT8", "bool": "BOOL"}
SOURCE_NAMES = {value: name for name, value in pb.CacheInfo.Source.items()}
Mode = pb.CachePolicy.Mode
_LENGTH = struct.Struct("<I")
RENDERED_KEPT = 1024  # exact hits' answers kept (see KServeServicer._exact_hit); past it, start over
try:
    VERSION = metadata.version("infercache")
except metadata.PackageNotFoundError:  # (a checkout that is not installed)
    VERSION = "unknown"


def texts_of(request: kpb.ModelInferRequest) -> list[str]:
    """The request's texts: its one BYTES input, from raw_input_contents (each element a 4-byte
    little-endian length and its bytes) or from contents.bytes_contents."""
    if len(request.inputs) != 1 or request.inputs[0].datatype != "BYTES":
        raise InvalidArgument("ModelInfer takes one BYTES input: the texts, shape [N] or [N, 1]")
    tensor = request.inputs[0]
    shape = list(tensor.shape)
    if not (len(shape) == 1 or (len(shape) == 2 and shape[1] == 1)) or shape[0] < 1:
        raise InvalidArgument(f"input {tensor.name!r} has shape {shape}; send [N] or [N, 1] texts")
    if request.raw_input_contents:
        raw, elements, at = request.raw_input_contents[0], [], 0
        while at < len(raw):
            if at + 4 > len(raw) or at + 4 + (size := _LENGTH.unpack_from(raw, at)[0]) > len(raw):
                raise InvalidArgument(f"input {tensor.name!r}: raw contents are not length-prefixed BYTES elements")
            elements.append(raw[at + 4:at + 4 + size])
            at += 4 + size
    else:
        elements = list(tensor.contents.bytes_contents)
    if len(elements) != shape[0]:
        raise InvalidArgument(f"input {tensor.name!r} has shape {shape} but {len(elements)} elements")
    try:
        return [element.decode() for element in elements]
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"input {tensor.name!r}: an element is not UTF-8 text ({exc.reason})") from None


def _string(parameters, name: str) -> str | None:
    """A string parameter's value (None: absent); one of another type is INVALID_ARGUMENT, never a default."""
    if name not in parameters:
        return None
    parameter = parameters[name]
    if parameter.WhichOneof("parameter_choice") != "string_param":
        raise InvalidArgument(f"parameter {name} must be a string, got {parameter.WhichOneof('parameter_choice')}")
    return parameter.string_param


def _policy(parameters) -> pb.CachePolicy | None:
    mode = _string(parameters, "cache_mode")
    max_age = parameters["max_age_s"] if "max_age_s" in parameters else None
    if mode is None and max_age is None:
        return None
    policy = pb.CachePolicy()
    if mode is not None:
        name = mode.upper()
        if name not in Mode.keys():
            raise InvalidArgument(f"parameter cache_mode must be one of {', '.join(Mode.keys())} (a string)")
        policy.mode = Mode.Value(name)
    if max_age is not None:  # a string, a whole number or a whole double (tritonclient's 60.0)
        kind = max_age.WhichOneof("parameter_choice")
        policy.max_age_s = whole_seconds(getattr(max_age, kind) if kind else None, "parameter max_age_s")
    return policy


def _bytes_tensor(values: list[str]) -> bytes:
    return b"".join(_LENGTH.pack(len(v)) + v for v in (value.encode() for value in values))


class KServeServicer:
    def __init__(self, core: FrontendCore, gate: Gate) -> None:
        self.core = core
        self.gate = gate
        self.calls = 0  # calls begun (a drain waits until it stops moving)
        self._rendered: dict[tuple[bytes, int], bytes] = {}  # exact hits' answers: _exact_hit

    def _ready(self) -> bool:
        return any(link.up for link in self.core.workers.links)

    async def ServerLive(self, request, context):  # open, as health checks are: probes carry no token
        return kpb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return kpb.ServerReadyResponse(ready=self._ready())

    @grpc_errors
    async def ModelReady(self, request, context):
        self.gate.admit(context, CLIENT)
        try:
            self.core.repository.get(parsed(request).name).resolve_version(request.version)
        except ModelNotFound:
            return kpb.ModelReadyResponse(ready=False)
        return kpb.ModelReadyResponse(ready=self._ready())

    @grpc_errors
    async def ServerMetadata(self, request, context):
        self.gate.admit(context, CLIENT)
        return kpb.ServerMetadataResponse(name="infercache", version=VERSION)

    @grpc_errors
    async def ModelMetadata(self, request, context):
        self.gate.admit(context, CLIENT)
        spec = self.core.repository.get(parsed(request).name)
        spec.resolve_version(request.version)
        Tensor = kpb.ModelMetadataResponse.TensorMetadata
        if spec.task == "generate":
            outputs = [Tensor(name="text", datatype="BYTES", shape=[-1])]
        else:
            outputs = [Tensor(name=name, datatype="FP32", shape=[-1, -1]) for name in spec.outputs]
            if spec.task == "classification":
                outputs += [Tensor(name="label", datatype="BYTES", shape=[-1]),
                            Tensor(name="probability", datatype="FP32", shape=[-1])]
        return kpb.ModelMetadataResponse(name=spec.name, versions=spec.versions, platform=f"infercache-{spec.task}",
                                         inputs=[Tensor(name="text", datatype="BYTES", shape=[-1])], outputs=outputs)

    @grpc_errors
    async def ModelInfer(self, request, context):
        self.calls += 1
        grant = self.gate.admit(context, CLIENT)
        request = parsed(request)
        core = self.core
        spec = core.repository.get(request.model_name)
        if spec.task == "generate":
            raise InvalidArgument(f"model {spec.name!r} generates text: use Generate or the OpenAI door's "
                                  "/v1/chat/completions; ModelInfer serves embedding and classification models")
        texts = texts_of(request)
        tenant = _string(request.parameters, "tenant") or ""
        policy = _policy(request.parameters)
        if len(texts) == 1:
            one = pb.InferRequest(model=request.model_name, version=request.model_version, tenant=tenant,
                                  text=texts[0], cache=policy)
            bind_tenant(grant, one)
            raw = one.SerializeToString()
            if request.outputs:  # an answer of some outputs: made each time
                call = core.infer
            else:  # an exact hit comes back as FrontendCore.exact's entry, for _exact_hit
                call = functools.partial(core.infer_entry, kept=self._rendered)
            answer = (await call(raw, context.time_remaining()) if core.metrics is None else
                      await measured(core, call, raw, 1, context.time_remaining))
            if type(answer) is tuple:
                return self._exact_hit(request, spec, answer)
            answers = [pb.InferResponse.FromString(answer)]
        else:
            batch = pb.InferBatchRequest(model=request.model_name, version=request.model_version, tenant=tenant,
                                         texts=texts, cache=policy)
            bind_tenant(grant, batch)
            answer = (await core.infer_batch(batch, context.time_remaining()) if core.metrics is None else
                      await measured(core, core.infer_batch, batch, len(texts), context.time_remaining))
            answers = list(pb.InferBatchResponse.FromString(answer).results)
        response = self._response(request, spec, answers)
        response.id = request.id
        response.parameters["cache_age_s"].string_param = ",".join(f"{one.cache.age_s:.3f}" for one in answers)
        return response.SerializeToString()

    def _exact_hit(self, request: kpb.ModelInferRequest, spec, entry: tuple[bytes | None, bytes, int, float]) -> bytes:
        """The serialized answer of one text's exact hit (FrontendCore.exact's entry) for all the model's
        outputs: made once per entry, kept by (key, creation time) while among the last RENDERED_KEPT (the
        entry's stored bytes are then not read again), and followed by the call's id and the entry's age
        (protobuf merges a later id and map entry into the message they follow: cachestore/wire.py)."""
        stored, key, created_us, age_s = entry
        made = self._rendered.get((key, created_us)) if stored is None else None
        if made is None:
            answer = pb.InferResponse.FromString(stored)
            answer.cache.source = pb.CacheInfo.RESULT_EXACT  # (a stored answer carries no source)
            made = self._response(request, spec, [answer]).SerializeToString()
            keep(self._rendered, (key, created_us), made, RENDERED_KEPT)
        call = kpb.ModelInferResponse(id=request.id)
        call.parameters["cache_age_s"].string_param = f"{age_s:.3f}"
        return made + call.SerializeToString()

    @staticmethod
    def _response(request: kpb.ModelInferRequest, spec, answers: list[pb.InferResponse]) -> kpb.ModelInferResponse:
        """The answer to `request` from `answers`, less what is the call's own: its id and the age."""
        rows = len(answers)
        response = kpb.ModelInferResponse(model_name=spec.name, model_version=answers[0].cache.model_version)
        tensors: list[tuple[str, str, list[int], bytes]] = []
        for n, tensor in enumerate(answers[0].outputs):
            datatype = DATATYPES.get(tensor.dtype)
            if datatype is None:
                raise InvalidArgument(f"output {tensor.name!r} has dtype {tensor.dtype}, which KServe v2 cannot carry")
            data = b"".join(answer.outputs[n].data for answer in answers)
            tensors.append((tensor.name, datatype, [rows, *tensor.shape], data))
        if spec.task == "classification":
            labels = [answer.classification.label for answer in answers]
            probabilities = np.array([answer.classification.probability for answer in answers], "<f4")
            tensors += [("label", "BYTES", [rows], _bytes_tensor(labels)),
                        ("probability", "FP32", [rows], probabilities.tobytes())]
        wanted = [output.name for output in request.outputs]
        known = {name for name, *_ in tensors}
        if unknown := [name for name in wanted if name not in known]:
            raise InvalidArgument(f"model {spec.name!r} has no output {unknown[0]!r} (outputs: {', '.join(sorted(known))})")
        for name, datatype, shape, data in tensors:
            if not wanted or name in wanted:
                response.outputs.add(name=name, datatype=datatype, shape=shape)
                response.raw_output_contents.append(data)
        infos = [answer.cache for answer in answers]
        parameters = response.parameters
        parameters["cache_source"].string_param = ",".join(SOURCE_NAMES.get(i.source, "") for i in infos)
        parameters["cache_key"].string_param = ",".join(i.key for i in infos)
        if any(i.source == pb.CacheInfo.RESULT_SEMANTIC for i in infos):
            parameters["cache_similarity"].string_param = ",".join(f"{i.similarity:.4f}" for i in infos)
        if any(i.stale for i in infos):
            parameters["cache_stale"].string_param = ",".join("1" if i.stale else "0" for i in infos)
        return response


PASS_THROUGH = ("ModelInfer",)  # handlers that return their answers serialized


def add_kserve(servicer: KServeServicer, server: grpc.aio.Server, max_request_bytes: int) -> None:
    """The service's handlers; requests that do not parse, or are over server.max_request_bytes, reach
    them as Malformed (INVALID_ARGUMENT), as the native service's do. ModelInfer's answers go out as the
    bytes it composes (PASS_THROUGH)."""
    handlers = {}
    for method in SERVICE.methods:
        request = lenient(getattr(kpb, method.input_type.name), max_request_bytes)
        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            getattr(servicer, method.name), request_deserializer=request,
            response_serializer=None if method.name in PASS_THROUGH else
            getattr(kpb, method.output_type.name).SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
