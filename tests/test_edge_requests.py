"""Requests at the edges of the API, through a real server: bytes that are no message of an RPC that takes
an empty one, selectors of models the server does not serve, a hot-key call without a model, requests
over the size limit. Each answer is one a client can act on, and the one the README's status table names."""

from __future__ import annotations

import grpc
import pytest

from infercache.v1 import infercache_pb2 as pb
from harness.servers import ServerProcess

LIMIT = 64 * 1024  # server.max_request_bytes of the small-limit server


@pytest.fixture(scope="module")
def small_limit(tmp_path_factory, models_dir, engines_dir):
    srv = ServerProcess(tmp_path_factory.mktemp("small-limit"), models_dir, engines_dir=engines_dir, frontends=1,
                        settings=(f"server.max_request_bytes={LIMIT}",))
    yield srv
    assert srv.stop() == 0


def _raw(server: ServerProcess, method: str, payload: bytes) -> grpc.RpcError | bytes:
    with grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", -1)]) as channel:
        call = channel.unary_unary(f"/infercache.v1.InferenceCache/{method}", request_serializer=None,
                                   response_deserializer=None)
        try:
            return call(payload, timeout=30)
        except grpc.RpcError as exc:
            return exc


@pytest.mark.parametrize("method", ["GetStats", "ListModels", "GetHotKeys", "Invalidate", "InferBatch", "Infer"])
@pytest.mark.parametrize("payload", [b"\x00\x00", b"\x02\x00", b"\x05\x00\x00\x00\x00", b"\x03\x04"],
                         ids=["varint", "length", "fixed32", "group"])
def test_a_field_number_0_is_invalid_argument_on_every_rpc(server, method, payload):
    """upb parses a message without fields (GetStatsRequest, ListModelsRequest) leniently: field number 0,
    which the others refuse, parsed there, and GetStats and ListModels answered OK."""
    answer = _raw(server, method, payload)
    assert isinstance(answer, grpc.RpcError), f"{method} accepted {payload!r}"
    assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT, answer
    assert "is not a valid" in answer.details()


def test_well_formed_unknown_fields_of_an_empty_request_are_still_accepted(server):
    """Forward compatibility: a newer client's field (number 1, any wire type) is no error."""
    for payload in (b"\x08\x01", b"\x0a\x02ab", b"\x0d\x01\x02\x03\x04"):
        assert isinstance(_raw(server, "GetStats", payload), bytes)
        assert isinstance(_raw(server, "ListModels", payload), bytes)


def test_invalidating_a_model_or_version_the_server_does_not_serve_is_not_found(server):
    with server.client() as client:
        with pytest.raises(grpc.RpcError) as unknown:
            client.invalidate(model="no-such-model")
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert "no-such-model" in unknown.value.details() and "minilm" in unknown.value.details()
        with pytest.raises(grpc.RpcError) as version:
            client.invalidate(model="minilm", version="99")
        assert version.value.code() == grpc.StatusCode.NOT_FOUND and "99" in version.value.details()
        assert client.invalidate(model="minilm", tenant="nobody-here") == 0  # a served model: its count


def test_hot_keys_without_a_model_is_invalid_argument(server):
    _, stub = server.stub()
    with pytest.raises(grpc.RpcError) as missing:
        stub.GetHotKeys(pb.GetHotKeysRequest(), timeout=30)
    assert missing.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "model is required" in missing.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        stub.GetHotKeys(pb.GetHotKeysRequest(model="no-such-model"), timeout=30)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def _batch_of(size: int) -> bytes:
    texts = ["x" * 1000] * (size // 1003 + 1)
    return pb.InferBatchRequest(model="minilm", texts=texts).SerializeToString()


def test_a_request_over_the_default_limit_is_invalid_argument_naming_the_limit(server):
    """Over gRPC's default 4 MiB, the call was RESOURCE_EXHAUSTED, which clients (and `cache warm`) retry
    as load shedding: an oversized request fails the same way every time."""
    for method, payload in (("InferBatch", _batch_of(5 << 20)),
                            ("Infer", pb.InferRequest(model="minilm", text="y" * (5 << 20)).SerializeToString())):
        answer = _raw(server, method, payload)
        assert isinstance(answer, grpc.RpcError)
        assert answer.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, answer)
        assert "4194304" in answer.details() and "server.max_request_bytes" in answer.details()


def test_the_request_limit_is_a_setting(small_limit):
    assert isinstance(_raw(small_limit, "Infer", pb.InferRequest(model="minilm", text="fits").SerializeToString()),
                      bytes)
    over = _raw(small_limit, "InferBatch", _batch_of(LIMIT + 1000))
    assert over.code() == grpc.StatusCode.INVALID_ARGUMENT and str(LIMIT) in over.details()
    admin = _raw(small_limit, "Invalidate", pb.InvalidateRequest(model="minilm", tenant="t" * (LIMIT + 10))
                 .SerializeToString())
    assert admin.code() == grpc.StatusCode.INVALID_ARGUMENT and str(LIMIT) in admin.details()
    # Far past it (over MESSAGE_GUARD times the limit) gRPC refuses the bytes before reading them, with
    # its own code; its message names the size it allows.
    far = _raw(small_limit, "InferBatch", _batch_of(3 * LIMIT))
    assert far.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(2 * LIMIT) in far.details()
