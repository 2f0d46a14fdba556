"""The public gRPC service of a frontend: each call is authenticated (server/shared/auth.py) before its
request is looked at, then handed to the transport-free core (server/frontend/core.py, admin.py);
errors become status codes in one place (server/shared/errors.py grpc_errors). Infer's request arrives
as bytes and Infer's and InferBatch's answers leave as bytes (add_servicer)."""

from __future__ import annotations

import grpc

from infercache.v1 import infercache_pb2 as pb
from infercache.v1 import infercache_pb2_grpc
from server.frontend.admin import AdminCalls
from server.frontend.core import FrontendCore
from server.frontend.plan import INFER_REQUEST
from server.frontend.prompts import GENERATE_REQUEST
from server.frontend.tally import measured
from server.shared.auth import ADMIN, CLIENT, Gate, Grant, bind_tenant
from server.shared.errors import InvalidArgument, grpc_errors, grpc_stream_errors, lenient, parsed, too_large

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["InferenceCache"].full_name


class FrontendServicer(infercache_pb2_grpc.InferenceCacheServicer):
    def __init__(self, core: FrontendCore, gate: Gate) -> None:
        self.core = core
        self.admin = AdminCalls(core)
        self.gate = gate
        self.max_request_bytes = core.config.server.max_request_bytes
        self.calls = 0  # calls begun: a drain waits until it stops moving (server/frontend/process.py)

    def _admit(self, request, context, role: str) -> Grant:
        """The caller's grant for a call that needs `role`; then the request must have parsed, and a
        tenant-bound token's tenant is filled in (or another tenant refused)."""
        grant = self._grant(context, role)
        self._bind(grant, request)
        return grant

    def _grant(self, context, role: str) -> Grant:
        self.calls += 1
        return self.gate.admit(context, role)

    @staticmethod
    def _bind(grant: Grant, request) -> None:
        parsed(request)
        if grant.tenant is not None and hasattr(request, "tenant"):
            bind_tenant(grant, request)

    def _admit_raw(self, request: bytes, context, parse):
        """_admit for a request that arrives serialized (RAW_REQUESTS): refused when over
        server.max_request_bytes (the other RPCs' deserializers check that: add_servicer); parsed here
        only for a tenant-bound token, whose tenant it binds (else the core parses it, if it must)."""
        grant = self._grant(context, CLIENT)
        if len(request) > self.max_request_bytes:
            raise InvalidArgument(too_large(len(request), self.max_request_bytes))
        if grant.tenant is not None:
            request = parse(request)
            self._bind(grant, request)
        return request

    @grpc_errors
    async def Infer(self, request: bytes, context):
        """`request` arrives serialized (add_servicer): Planner.prepared parses it, unless it repeats a
        request already seen. A tenant-bound token's request is parsed here, to bind its tenant."""
        request = self._admit_raw(request, context, INFER_REQUEST)
        if self.core.metrics is None:
            return await self.core.infer(request, context.time_remaining())
        return await measured(self.core, self.core.infer, request, 1, context.time_remaining)

    @grpc_errors
    async def InferBatch(self, request, context):
        self._admit(request, context, CLIENT)
        if self.core.metrics is None:
            return await self.core.infer_batch(request, context.time_remaining())
        return await measured(self.core, self.core.infer_batch, request, len(request.texts), context.time_remaining)

    @grpc_stream_errors
    async def Generate(self, request: bytes, context):
        """`request` arrives serialized, as Infer's (Prompts.prepared)."""
        request = self._admit_raw(request, context, GENERATE_REQUEST)
        calls = self.core.generation
        plan = await calls.plan(request)
        if (hit := calls.hit(plan)) is not None:
            yield hit
            return
        async for message in calls.generate(plan, context.time_remaining()):
            yield message

    @grpc_errors
    async def Invalidate(self, request, context):
        self._admit(request, context, ADMIN)
        return await self.admin.invalidate(request, context.time_remaining())

    @grpc_errors
    async def GetStats(self, request, context):
        grant = self._admit(request, context, CLIENT)
        return await self.admin.stats(full=grant.role == ADMIN)

    @grpc_errors
    async def ListModels(self, request, context):
        self._admit(request, context, CLIENT)
        return await self.admin.list_models()

    @grpc_errors
    async def GetHotKeys(self, request, context):
        self._admit(request, context, ADMIN)
        return await self.admin.hot_keys(request)


PASS_THROUGH = ("Infer", "InferBatch", "Generate")  # handlers that return (or yield) their answers serialized
RAW_REQUESTS = ("Infer", "Generate")  # handlers that take their request serialized (Planner / Prompts.prepared)


def add_servicer(servicer: FrontendServicer, server: grpc.aio.Server) -> None:
    """The generated registration, except that Infer and InferBatch answers go out as the bytes their
    handlers compose (no response serializer: the hit path never builds a message), that Infer takes
    its request as bytes (a repeated request is never parsed), and that request bytes that do not parse
    reach the handler as Malformed (INVALID_ARGUMENT, see server/shared/errors.py), as do those over
    server.max_request_bytes."""
    service = pb.DESCRIPTOR.services_by_name["InferenceCache"]
    handlers = {}
    for method in service.methods:
        response = getattr(pb, method.output_type.name)
        request = None if method.name in RAW_REQUESTS else lenient(getattr(pb, method.input_type.name),
                                                                    servicer.max_request_bytes)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(
            getattr(servicer, method.name), request_deserializer=request,
            response_serializer=None if method.name in PASS_THROUGH else response.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)
