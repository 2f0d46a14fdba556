"""Small helpers for tests that talk to a real server."""

from __future__ import annotations

import time
import uuid
import zlib
from pathlib import Path

import grpc

from cachestore import records
from harness.servers import UpstreamServer, link_model
from infercache.client import Client, Result


def running(pid: int) -> bool:
    """The process exists and has not exited (a zombie that nobody has reaped yet has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def unique(text: str) -> str:
    """The text plus a random word, so tests sharing a server never share entries."""
    return f"{text} {uuid.uuid4().hex[:12]}"


def wait_cached(client: Client, model: str, text: str, timeout: float = 10.0, **kwargs) -> Result:
    """Polls with ONLY_IF_CACHED until the write-behind has committed the entry."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.infer(model, text, mode="ONLY_IF_CACHED", **kwargs)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
                raise
        time.sleep(0.02)


def is_cached(client: Client, model: str, text: str, **kwargs) -> bool:
    try:
        client.infer(model, text, mode="ONLY_IF_CACHED", **kwargs)
        return True
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.FAILED_PRECONDITION, exc
        return False


def reseal_crc(raw: bytes) -> bytes:
    """The record with its header checksum made valid again (so only the GCM tag can catch a change)."""
    version, flags, kid, _, created, expires = records.HEADER.unpack_from(raw)
    payload = raw[records.HEADER.size:]
    return records.HEADER.pack(version, flags, kid, zlib.crc32(payload), created, expires) + payload


def serving_upstream(tmp_path_factory, engines_dir: Path, token: str, model: str, config: str, version_dir: Path):
    """A test module's upstream infercache serving `model` (harness/servers.py UpstreamServer), started, then
    stopped once the module is done: a module fixture's body (`yield from`)."""
    models = tmp_path_factory.mktemp("upstream-models")
    link_model(models, model, config, {"1": version_dir})
    upstream = UpstreamServer(tmp_path_factory.mktemp("upstream"), models, engines_dir, token)
    upstream.start()
    yield upstream
    if upstream.server is not None:
        upstream.server.stop()






def wait_for(predicate, timeout: float, what: str, poll_s: float = 0.05):
    """predicate()'s first truthy value, polled every poll_s; AssertionError naming `what` after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")
