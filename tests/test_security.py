"""Security and privacy through the real server: tokens and roles on every RPC, tenant binding, TLS and
mutual TLS handshakes, AES-256-GCM at rest (tampering, moving, rotation), retention, file permissions."""

from __future__ import annotations

import base64
import os
import signal
import stat
import time
from pathlib import Path

import grpc
import lmdb
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cachestore import records
from cachestore.env import DB_RESULTS
from cachestore.keys import parse_hex_key
from cachestore.sealing import key_id
from infercache.client import Client
from harness.servers import ServerProcess
from infercache.v1 import infercache_pb2 as pb
from server import config as config_mod
from server.shared.auth import TokenFileError, read_tokens
from tests import certs
from tests.helpers import is_cached, reseal_crc, unique, wait_cached, wait_for

TOKENS = {role: f"{role}-{os.urandom(16).hex()}" for role in ("admin", "client", "acme")}


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.fixture(scope="module")
def secured(tmp_path_factory, models_dir, engines_dir):
    """A server with a token file: an admin, an unbound client and a client bound to tenant acme."""
    work = tmp_path_factory.mktemp("secured")
    tokens = work / "tokens.yaml"
    tokens.write_text(yaml.safe_dump([
        {"token": TOKENS["admin"], "role": "admin"},
        {"token": TOKENS["client"], "role": "client"},
        {"token": TOKENS["acme"], "role": "client", "tenant": "acme"},
    ]))
    srv = ServerProcess(work, models_dir, engines_dir=engines_dir, frontends=1,
                        settings=(f"security.tokens_file={tokens}",), client_options={"token": TOKENS["admin"]})
    yield srv
    assert srv.stop() == 0


RPCS = {
    "Infer": lambda stub, md: stub.Infer(pb.InferRequest(model="minilm", text=unique("roles")), metadata=md,
                                         timeout=30),
    "InferBatch": lambda stub, md: stub.InferBatch(pb.InferBatchRequest(model="minilm", texts=[unique("roles")]),
                                                   metadata=md, timeout=30),
    "Invalidate": lambda stub, md: stub.Invalidate(pb.InvalidateRequest(model="minilm", tenant="nobody"),
                                                   metadata=md, timeout=30),
    "GetStats": lambda stub, md: stub.GetStats(pb.GetStatsRequest(), metadata=md, timeout=30),
    "ListModels": lambda stub, md: stub.ListModels(pb.ListModelsRequest(), metadata=md, timeout=30),
}
CALLERS = {
    "none": None,
    "not bearer": (("authorization", f"Basic {TOKENS['admin']}"),),
    "unknown": bearer("x" * 40),
    "client": bearer(TOKENS["client"]),
    "tenant client": bearer(TOKENS["acme"]),
    "admin": bearer(TOKENS["admin"]),
}
OK = grpc.StatusCode.OK


def expected(rpc: str, caller: str) -> grpc.StatusCode:
    if caller in ("none", "not bearer", "unknown"):
        return grpc.StatusCode.UNAUTHENTICATED
    if rpc == "Invalidate" and caller != "admin":
        return grpc.StatusCode.PERMISSION_DENIED
    return OK


@pytest.mark.parametrize("caller", CALLERS)
@pytest.mark.parametrize("rpc", RPCS)
def test_each_rpc_answers_each_kind_of_token_with_its_code(secured, rpc, caller):
    channel, stub = secured.stub()
    with channel:
        try:
            RPCS[rpc](stub, CALLERS[caller])
            code = OK
        except grpc.RpcError as exc:
            code = exc.code()
    assert code == expected(rpc, caller)


def test_an_unauthenticated_caller_learns_nothing_of_its_request_and_probes_need_no_token(secured):
    channel, _ = secured.stub()
    with channel:
        raw = channel.unary_unary("/infercache.v1.InferenceCache/Infer")
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff", timeout=10)  # bytes that do not parse: still UNAUTHENTICATED first
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_a_tenant_token_acts_as_its_tenant_only(secured):
    text = unique("tenant binding")
    with secured.client(token=TOKENS["acme"]) as acme, secured.client() as admin:
        assert acme.infer("minilm", text).source == "MISS"  # tenant filled in from the token
        with pytest.raises(grpc.RpcError) as caught:
            acme.infer("minilm", text, tenant="globex")
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as caught:
            acme.infer_batch("minilm", [text], tenant="globex")
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        wait_cached(admin, "minilm", text, tenant="acme")
        assert acme.infer("minilm", text, tenant="acme").source == "RESULT_EXACT"
        assert not is_cached(admin, "minilm", text)  # nothing under the empty tenant


def test_a_client_sees_its_own_frontend_counters_and_an_admin_everything(secured):
    with secured.client(token=TOKENS["client"]) as client, secured.client() as admin:
        partial, full = client.stats(), admin.stats()
    assert partial.frontend.pid and not partial.workers and not partial.HasField("store")
    assert full.workers and full.HasField("store")


def test_tokens_never_reach_the_log(secured):
    with secured.client(token="y" * 40) as stranger:
        with pytest.raises(grpc.RpcError):
            stranger.models()
    log = secured.log_text()
    assert not any(token in log for token in [*TOKENS.values(), "y" * 40])


def test_token_file_and_exposure_errors_are_clear(tmp_path):
    tokens = tmp_path / "tokens.yaml"
    for content, why in (("[]", "list of"), ("- {token: short, role: admin}", "at least 24"),
                         (f"- {{token: {'z' * 30}, role: root}}", "client or admin"),
                         (f"- {{token: {'z' * 30}, role: admin}}\n- {{token: {'z' * 30}, role: client}}", "twice")):
        tokens.write_text(content)
        with pytest.raises(TokenFileError, match=why):
            read_tokens(str(tokens))
    with pytest.raises(config_mod.ConfigError, match="tokens_file"):
        config_mod.load(None, {}, {"server.host": "0.0.0.0"})
    assert config_mod.load(None, {}, {"server.host": "0.0.0.0", "security.allow_anonymous": "true"})
    assert config_mod.load(None, {}, {"server.host": "::1"}).secrets.tokens is None
    with pytest.raises(config_mod.ConfigError, match="tls_key_file"):
        config_mod.load(None, {}, {"security.tls_cert_file": str(tokens)})
    assert "secrets" not in repr(config_mod.load(None, {}, {}))


# ---- TLS ------------------------------------------------------------------------------------------

def refused(client: Client) -> grpc.StatusCode:
    with client:
        with pytest.raises(grpc.RpcError) as caught:
            client.models()
    return caught.value.code()


def test_tls_and_mutual_tls_refuse_plaintext_and_untrusted_peers(start_server, tmp_path):
    ca, stranger_ca = certs.authority("infercache test CA"), certs.authority("stranger CA")
    cert, key = certs.write(tmp_path, "server", certs.issue(ca, "infercache", server=True))
    (tmp_path / "ca.crt").write_bytes(ca[0].cert)
    tls = (f"security.tls_cert_file={cert}", f"security.tls_key_file={key}")
    srv = start_server(frontends=1, settings=tls, client_options={"ca": ca[0].cert})
    with srv.client() as client:
        assert [m.name for m in client.models()]
    assert refused(Client(srv.address, timeout_s=5)) == grpc.StatusCode.UNAVAILABLE            # plaintext
    assert refused(srv.client(ca=stranger_ca[0].cert, timeout_s=5)) == grpc.StatusCode.UNAVAILABLE  # wrong CA
    srv.stop()

    member, outsider = certs.issue(ca, "backend"), certs.issue(stranger_ca, "backend")
    mtls = start_server(frontends=1, settings=(*tls, f"security.tls_client_ca_file={tmp_path / 'ca.crt'}"),
                        client_options={"ca": ca[0].cert, "cert": member.cert, "key": member.key})
    with mtls.client() as client:
        assert client.infer("minilm", unique("over mutual TLS")).source == "MISS"
    assert refused(mtls.client(cert=None, key=None, timeout_s=5)) == grpc.StatusCode.UNAVAILABLE
    assert refused(mtls.client(cert=outsider.cert, key=outsider.key, timeout_s=5)) == grpc.StatusCode.UNAVAILABLE


# ---- encryption at rest, retention, permissions ----------------------------------------------------

def raw_record(cache_dir, key: bytes) -> bytes:
    env = lmdb.open(str(cache_dir), readonly=True, max_dbs=16, lock=False)
    try:
        with env.begin() as txn:
            return bytes(txn.get(key, db=env.open_db(DB_RESULTS, txn=txn)))
    finally:
        env.close()


def test_encrypted_store_holds_no_plaintext_tampering_is_a_miss_and_keys_rotate(start_server, tmp_path):
    k1, k2 = os.urandom(32), os.urandom(32)
    key_file = tmp_path / "keys"
    key_file.write_text(base64.b64encode(k1).decode() + "\n")
    sealed = (f"cache.encryption_key_file={key_file}",)
    srv = start_server(frontends=1, settings=sealed)
    texts = {name: unique(f"sealed entry {name}") for name in "abcd"}
    with srv.client() as client:
        answers = {name: client.infer("minilm", texts[name]) for name in "abc"}
        for name in "abc":
            wait_cached(client, "minilm", texts[name])
    assert srv.stop() == 0
    data = (srv.cache_dir / "data.mdb").read_bytes()
    for answer in answers.values():  # what a clear store holds: the answer's floats and its key's hex
        assert answer.outputs["embedding"].tobytes() not in data and answer.key.encode() not in data
    keys = {name: parse_hex_key(answer.key) for name, answer in answers.items()}

    env = lmdb.open(str(srv.cache_dir), max_dbs=16, map_size=2048 << 20)
    with env.begin(write=True) as txn:
        db = env.open_db(DB_RESULTS, txn=txn)
        flipped = bytearray(txn.get(keys["a"], db=db))
        flipped[records.HEADER.size + 30] ^= 0x40
        txn.put(keys["a"], reseal_crc(bytes(flipped)), db=db)
        txn.put(keys["c"], txn.get(keys["b"], db=db), db=db)  # b's record copied under c's key
    env.close()

    key_file.write_text(f"{base64.b64encode(k2).decode()}\n{base64.b64encode(k1).decode()}\n")  # k2 rolled in
    srv = start_server(frontends=1, settings=sealed, cache_dir=srv.cache_dir)
    with srv.client() as client:
        assert not is_cached(client, "minilm", texts["a"]) and not is_cached(client, "minilm", texts["c"])
        kept = client.infer("minilm", texts["b"], mode="ONLY_IF_CACHED")  # sealed with k1, still readable
        assert kept.outputs["embedding"].tobytes() == answers["b"].outputs["embedding"].tobytes()
        assert client.stats().frontend.counters["l1.records_unsealable"] >= 2
        new = client.infer("minilm", texts["d"])
        wait_cached(client, "minilm", texts["d"])
    assert srv.stop() == 0
    assert records.HEADER.unpack_from(raw_record(srv.cache_dir, parse_hex_key(new.key)))[2] == key_id(k2)

    key_file.write_text(base64.b64encode(k2).decode() + "\n")  # k1 retired: its records are misses
    srv = start_server(frontends=1, settings=sealed, cache_dir=srv.cache_dir)
    with srv.client() as client:
        assert not is_cached(client, "minilm", texts["b"]) and is_cached(client, "minilm", texts["d"])


def test_max_ttl_caps_entries_stored_before_and_after(start_server):
    srv = start_server(frontends=1)
    old = unique("stored before the cap")
    with srv.client() as client:
        client.infer("minilm", old)
        wait_cached(client, "minilm", old)
    assert srv.stop() == 0
    time.sleep(1.5)
    srv = start_server(frontends=1, cache_dir=srv.cache_dir, settings=("cache.max_ttl_s=1",))
    with srv.client() as client:
        assert {m.name: m.ttl_s for m in client.models()}["minilm"] == 1
        assert not is_cached(client, "minilm", old)
        deadline = time.monotonic() + 15
        while client.stats().store.entries:  # the sweep deletes it from the disk too
            assert time.monotonic() < deadline, "the entry outlived cache.max_ttl_s on disk"
            time.sleep(0.1)
        fresh = unique("stored under the cap")
        client.infer("minilm", fresh)
        wait_cached(client, "minilm", fresh)
        time.sleep(1.2)
        assert not is_cached(client, "minilm", fresh)


def test_store_and_sockets_are_private_and_names_never_become_paths(start_server, tmp_path):
    cache_dir = tmp_path / "loose-cache"
    cache_dir.mkdir(mode=0o755)
    (cache_dir / "stray").write_text("left by hand")
    os.chmod(cache_dir, 0o755)
    srv = start_server(frontends=1, cache_dir=cache_dir)
    figures = srv.workdir / "run" / "metrics"  # rewritten every second by design (server/shared/telemetry.py)

    def paths() -> list[Path]:
        return sorted(p.relative_to(srv.workdir) for p in srv.workdir.rglob("*")
                      if p.name != "server.log" and figures not in p.parents)
    before = paths()
    channel, stub = srv.stub()
    with channel:
        for model, version, tenant in (("../../../etc/passwd", "", ""), ("minilm", "../1", ""),
                                       ("minilm", "", "../../x"), ("minilm", "", "/tmp/evil")):
            try:
                stub.Infer(pb.InferRequest(model=model, version=version, tenant=tenant, text="a path"), timeout=30)
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.NOT_FOUND
    assert paths() == before
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (cache_dir, *cache_dir.iterdir())}
    assert modes == {"loose-cache": 0o700, "stray": 0o600, "data.mdb": 0o600, "lock.mdb": 0o600}
    run = srv.workdir / "run"
    assert stat.S_IMODE(run.stat().st_mode) == 0o700
    with srv.client() as client:  # a hot key, so the frontend publishes a figures file (within a second)
        client.infer("minilm", "a path")
    deadline = time.monotonic() + 10
    while not any(p.is_file() for p in figures.rglob("*")):
        assert time.monotonic() < deadline, "no figures file was published"
        time.sleep(0.05)
    assert {stat.S_IMODE(p.stat().st_mode) for p in run.rglob("*") if p.is_file()} == {0o600}
    assert {stat.S_IMODE(p.stat().st_mode) for p in run.rglob("*") if p.is_dir()} == {0o700}  # the figures


def test_sighup_reloads_the_token_file_and_a_broken_one_keeps_the_tokens_in_force(start_server, tmp_path):
    tokens = tmp_path / "tokens.yaml"
    old, new = TOKENS["admin"], f"rotated-{os.urandom(16).hex()}"
    tokens.write_text(yaml.safe_dump([{"token": old, "role": "admin"}]))
    srv = start_server(frontends=2, settings=(f"security.tokens_file={tokens}",))

    def code(token: str) -> grpc.StatusCode:
        try:
            with srv.client(token=token) as client:  # a fresh connection: either frontend
                client.models()
            return OK
        except grpc.RpcError as exc:
            return exc.code()

    def settle(expect: dict[str, grpc.StatusCode]) -> None:
        deadline = time.monotonic() + 10
        while any(code(token) != wanted for token, wanted in expect.items() for _ in range(4)):
            assert time.monotonic() < deadline, {token[:8]: code(token) for token in expect}
            time.sleep(0.1)

    assert code(old) == OK and code(new) == grpc.StatusCode.UNAUTHENTICATED
    tokens.write_text(yaml.safe_dump([{"token": new, "role": "admin"}]))
    srv.proc.send_signal(signal.SIGHUP)
    settle({new: OK, old: grpc.StatusCode.UNAUTHENTICATED})
    tokens.write_text("- {token: short, role: admin}\n")
    srv.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 10
    while "previous tokens stay in force" not in srv.log_text():  # said once, by the supervisor
        assert time.monotonic() < deadline, srv.log_text()[-2000:]
        time.sleep(0.1)
    settle({new: OK})
    assert srv.stop() == 0


def test_a_restarted_frontend_serves_the_tokens_in_force_not_the_revoked_ones(start_server, tmp_path):
    """Revoke by SIGHUP, kill -9 a frontend: its replacement refuses the revoked tokens (an admin among
    them) and takes the current one, like the frontend that lived on."""
    tokens = tmp_path / "tokens.yaml"
    old_admin, old_client = TOKENS["admin"], TOKENS["client"]
    new = f"rotated-{os.urandom(16).hex()}"
    tokens.write_text(yaml.safe_dump([{"token": old_admin, "role": "admin"}, {"token": old_client, "role": "client"}]))
    srv = start_server(frontends=2, settings=(f"security.tokens_file={tokens}",))

    def answer(token: str) -> grpc.StatusCode | int:
        """The pid of the frontend a fresh connection reached, or the status code it refused with."""
        try:
            with srv.client(token=token) as client:
                return client.stats().frontend.pid
        except grpc.RpcError as exc:
            return exc.code()

    tokens.write_text(yaml.safe_dump([{"token": new, "role": "admin"}]))
    srv.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: all(answer(old_admin) == grpc.StatusCode.UNAUTHENTICATED for _ in range(8)), 10, "revocation")
    before = {answer(new) for _ in range(16)}
    assert len(before) == 2 and all(isinstance(pid, int) for pid in before), before
    victim = min(before)
    os.kill(victim, signal.SIGKILL)

    def replacement() -> int | None:
        fresh = {pid for pid in (answer(new) for _ in range(16)) if isinstance(pid, int)} - before
        return fresh.pop() if fresh else None  # (UNAVAILABLE meanwhile: the port it held is closing)

    reborn = wait_for(replacement, 60, "a replacement frontend that takes the current token")
    # Fresh connections reach either frontend (SO_REUSEPORT): 24 of them all miss one with odds 2**-23.
    for token in (old_admin, old_client):
        assert {answer(token) for _ in range(24)} == {grpc.StatusCode.UNAUTHENTICATED}
    assert {answer(new) for _ in range(24)} == {reborn, max(before)}
    assert srv.stop() == 0
