"""Soak and fault suite (`make soak`; not part of `make test`).

A real server (two workers, one frontend per CPU) takes a fixed number of mixed requests from one
closed-loop load process while a kill -9 of a random child (frontend, worker, or a worker's store writer
process) lands every `--kill-every` seconds. The mix: exact hits on a hot set, fresh misses (each stored), earlier misses
asked for again, fuzz (garbage bytes, oversized identifiers, bad modes, empty texts, unknown models) and
key invalidations of a set kept apart from everything else. Reported:
- answers by status code: none may be INTERNAL or UNKNOWN (the fuzz gets INVALID_ARGUMENT or NOT_FOUND,
  or UNAVAILABLE from a killed frontend);
- p99 per window;
- every child's RSS and its anonymous part (its heap) each `--rss-every` seconds: the rest of RSS is
  mostly LMDB's file pages, shared and growing with the store, not with a leak;
- entries lost: every key seen answered RESULT_EXACT (so committed) is asked for again at the end with
  ONLY_IF_CACHED (the hot set, and earlier misses asked for again); each one missing is a lost entry
  (must be 0; nothing is evicted or expires in a run);
- acknowledged answers missing: every fresh miss answered OK is asked for again the same way. A kill -9
  of a worker loses the puts it had in flight (answered, not yet committed by its writer): a missing
  answer acknowledged within IN_FLIGHT_S before a worker kill is counted as one of those, with the
  writer's backlog sampled just before each kill; any other missing answer is one lost beyond the puts
  in flight (must be 0: a writer's death loses none, the new writer is handed them).
Writes bench/results/soak-<machine>.json (`--out` names another file).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import grpc

from bench import default_out, recorded
from bench.fixtures import load_texts
from bench.load import INFER
from bench.probes import server_roles
from bench.load import warm
from harness.servers import REPO, ServerProcess
from infercache.v1 import infercache_pb2 as pb

INVALIDATE = "/infercache.v1.InferenceCache/Invalidate"
MIX = (("hit", 0.82), ("miss", 0.04), ("repeat", 0.03), ("fuzz", 0.08), ("invalidate", 0.03))
# A worker's puts in flight at its kill: answered (acknowledged once the reply arrives) and not yet
# committed by its writer (group commit: cache.group_commit_ms, 50 ms), so acknowledged at most this
# long before the kill (and a moment after: a reply already on its way).
IN_FLIGHT_S = (1.0, 0.5)
SERVER_FAULTS = {"INTERNAL", "UNKNOWN", "DATA_LOSS"}  # codes no request may ever get


def _fuzz(rng: random.Random) -> bytes:
    kind = rng.randrange(6)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 200))
    if kind == 1:
        return pb.InferRequest(model="minilm", text="hello", tenant="t" * rng.randrange(300, 5000)).SerializeToString()
    if kind == 2:
        return pb.InferRequest(model="minilm", text="hello", cache=pb.CachePolicy(mode=rng.randrange(9, 99))).SerializeToString()
    if kind == 3:
        return pb.InferRequest(model="minilm", text=" ?! ").SerializeToString()
    if kind == 4:
        return pb.InferRequest(model=f"no-such-model-{rng.randrange(10**6)}", text="hi").SerializeToString()
    return pb.InferRequest(model="minilm", text="x" * 100_000).SerializeToString()


class _Run:
    """What the load process saw; one event loop writes it."""

    def __init__(self, window_s: float) -> None:
        self.codes: dict[str, Counter] = {kind: Counter() for kind, _ in MIX}
        self.window_s = window_s
        self.windows: dict[int, list[float]] = {}
        self.committed: set[str] = set()   # texts answered RESULT_EXACT at least once
        self.missed: list[str] = []        # texts sent as misses (a repeat asks for one again)
        self.acked: dict[str, float] = {}  # fresh misses answered OK -> when (seconds since start)
        self.sent = 0


async def _load(address: str, hot: list[str], victims: list[str], total: int, concurrency: int, seed: int,
                started: float, run: _Run) -> None:
    rng = random.Random(seed)
    channels = [grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(8)]
    infers = [c.unary_unary(INFER, request_serializer=None, response_deserializer=None) for c in channels]
    invalidates = [c.unary_unary(INVALIDATE, request_serializer=None, response_deserializer=None) for c in channels]
    kinds, weights = zip(*MIX)
    fresh = iter(range(10**9))

    async def caller(n: int) -> None:
        while run.sent < total:
            run.sent += 1
            kind = rng.choices(kinds, weights)[0]
            text = None
            if kind == "hit":
                text = rng.choice(hot)
                payload, call = pb.InferRequest(model="minilm", text=text).SerializeToString(), infers[n % 8]
            elif kind == "miss" or (kind == "repeat" and not run.missed):
                text = f"soak miss {seed}-{next(fresh)}: {rng.choice(hot)}"
                run.missed.append(text)
                payload, call = pb.InferRequest(model="minilm", text=text).SerializeToString(), infers[n % 8]
            elif kind == "repeat":  # an earlier miss: RESULT_EXACT once its write was committed
                text = rng.choice(run.missed)
                payload, call = pb.InferRequest(model="minilm", text=text).SerializeToString(), infers[n % 8]
            elif kind == "fuzz":
                payload, call = _fuzz(rng), infers[n % 8]
            else:
                victim = rng.choice(victims)
                payload = pb.InvalidateRequest(model="minilm", text=victim).SerializeToString()
                call = invalidates[n % 8]
            t0 = time.perf_counter()
            try:
                raw = await call(payload, timeout=10)
                code = "OK"
            except grpc.aio.AioRpcError as exc:
                code = exc.code().name
                raw = None
            latency = time.perf_counter() - t0
            run.codes[kind][code] += 1
            run.windows.setdefault(int((time.monotonic() - started) // run.window_s), []).append(latency * 1000)
            if raw is not None and text is not None and kind != "invalidate":
                source = pb.InferResponse.FromString(raw).cache.source
                if source == pb.CacheInfo.RESULT_EXACT:
                    run.committed.add(text)
                elif kind == "miss" and source == pb.CacheInfo.MISS:
                    run.acked[text] = time.monotonic() - started

    await asyncio.gather(*(caller(n) for n in range(concurrency)))
    for channel in channels:
        await channel.close()


def _memory_mb(pid: int) -> dict[str, float] | None:
    """RSS, and its anonymous part (the process's own heap). The rest is mostly the LMDB map's pages: file
    pages shared with every process and the page cache, which grow with the store, not with a leak."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "anon_mb": int(fields["RssAnon"].split()[0]) / 1024}
    except (OSError, KeyError, ValueError):
        return None


def _roles(server: ServerProcess) -> dict[int, str]:
    """pid -> 'worker-N' / 'writer-N' (worker N's store writer) / 'frontend' for the server's live
    frontends, workers and writers (bench.probes.server_roles; what the soak samples and kills)."""
    try:
        workers = {w.pid: f"worker-{w.index}" for w in server.stats().workers}
    except grpc.RpcError:
        workers = {}
    roles = {}
    for pid, role in server_roles(server, set(workers)).items():
        if role == "writer":
            roles[pid] = f"writer-{workers.get(_parent(pid), 'worker-?').split('-', 1)[1]}"
        elif role in ("frontend", "worker"):
            roles[pid] = workers.get(pid, role)
    return roles


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _backlogs(server: ServerProcess) -> dict[str, int]:
    """'worker-N' -> puts its result store writer had not committed (GetStats), just before a kill."""
    try:
        return {f"worker-{w.index}": int(w.counters.get("writer.backlog", 0)) for w in server.stats().workers}
    except grpc.RpcError:
        return {}


def _chaos(server: ServerProcess, stop: threading.Event, kill_every: float, rss_every: float, started: float,
           out: dict) -> None:
    rng = random.Random(7)
    next_kill, next_rss = time.monotonic() + kill_every, time.monotonic()
    while not stop.wait(0.2):
        now = time.monotonic()
        if now >= next_rss:
            sample = {str(pid): {"role": role, **(_memory_mb(pid) or {})} for pid, role in _roles(server).items()}
            out["rss"].append({"t_s": round(now - started, 1), "processes": sample})
            next_rss = now + rss_every
        if kill_every > 0 and now >= next_kill:
            roles = _roles(server)
            if roles:
                pid = rng.choice(sorted(roles))
                backlog = _backlogs(server).get(roles[pid].replace("writer-", "worker-"))
                try:
                    os.kill(pid, signal.SIGKILL)
                    out["kills"].append({"t_s": round(time.monotonic() - started, 3), "role": roles[pid], "pid": pid,
                                         "writer_backlog_before": backlog})
                except ProcessLookupError:
                    pass
            next_kill = now + kill_every


def _lost(address: str, texts: set[str]) -> list[str]:
    lost = []
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(INFER, request_serializer=None, response_deserializer=None)
        for text in sorted(texts):
            request = pb.InferRequest(model="minilm", text=text, cache=pb.CachePolicy(mode=pb.CachePolicy.ONLY_IF_CACHED))
            for attempt in range(20):
                try:
                    call(request.SerializeToString(), timeout=10)
                    break
                except grpc.RpcError as exc:
                    if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                        lost.append(text)
                        break
                    time.sleep(0.5)  # a frontend restarting: ask again
    return lost


def _rss_growth(samples: list[dict], warmup_s: float) -> dict:
    """Per process (role and pid; a restarted child is a new pid and warms up again): RSS at its first
    sample after warm-up and at its last, with the ratio; processes sampled fewer than twice are left out."""
    out = {}
    for pid in sorted({pid for s in samples for pid in s["processes"]}, key=int):
        seen = [(s["t_s"], s["processes"][pid]) for s in samples if pid in s["processes"]]
        warm_from = max(warmup_s, seen[0][0] + warmup_s)  # a restarted child warms up again
        mine = [(t, p) for t, p in seen if t >= warm_from]
        mine = [(t, p) for t, p in mine if p.get("rss_mb")]
        if len(mine) >= 2:
            (t0, first), (t1, last) = mine[0], mine[-1]
            out[f"{first['role']} {pid}"] = {
                "rss_from_mb": round(first["rss_mb"], 1), "rss_to_mb": round(last["rss_mb"], 1),
                "anon_from_mb": round(first["anon_mb"], 1), "anon_to_mb": round(last["anon_mb"], 1),
                "anon_ratio": round(last["anon_mb"] / first["anon_mb"], 3), "span_s": round(t1 - t0)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.soak")
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--kill-every", type=float, default=30.0,
                        help="seconds between kill -9 of a random child (0: none, to watch RSS over a long life)")
    parser.add_argument("--rss-every", type=float, default=60.0)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per p99 window")
    parser.add_argument("--warmup", type=float, default=120.0, help="seconds before RSS must be flat")
    parser.add_argument("--out", default=str(default_out("soak")))
    args = parser.parse_args()
    texts = load_texts()
    hot, victims = texts[:500], texts[500:520]
    report: dict = {"recorded": recorded("bench.soak"), "requests": args.requests, "concurrency": args.concurrency,
                    "kill_every_s": args.kill_every, "mix": dict(MIX), "cpus": os.cpu_count(), "kills": [], "rss": []}
    with tempfile.TemporaryDirectory(prefix="infercache-soak-") as tmp:
        server = ServerProcess(Path(tmp), REPO / "models", frontends=os.cpu_count() or 2,
                               settings=("server.workers=2", "cache.sync=false"))
        try:
            print(f"soak: warming {len(hot) + len(victims)} texts ...", flush=True)
            warm(server.address, [pb.InferRequest(model="minilm", text=t) for t in hot + victims])
            run = _Run(args.window)
            started = time.monotonic()
            stop = threading.Event()
            chaos = threading.Thread(target=_chaos, args=(server, stop, args.kill_every, args.rss_every, started,
                                                          report), daemon=True)
            chaos.start()
            progress = threading.Thread(target=_progress, args=(run, args.requests, stop), daemon=True)
            progress.start()
            asyncio.run(_load(server.address, hot, victims, args.requests, args.concurrency, 1, started, run))
            stop.set()
            chaos.join()
            report["seconds"] = round(time.monotonic() - started, 1)
            print(f"soak: {args.requests} requests in {report['seconds']} s; checking {len(run.committed)} "
                  "committed entries ...", flush=True)
            time.sleep(2.0)  # restarts after the last kill
            lost = _lost(server.address, run.committed - set(victims))
            missing = _lost(server.address, set(run.acked))
            report["acknowledged"] = _acknowledged(run.acked, missing, report["kills"])
            # (from the log: a worker killed since took its writer's counters with it)
            report["writer_restarts"] = server.log_text().count("writer process is back")
            report["codes"] = {kind: dict(c) for kind, c in run.codes.items()}
            report["p99_ms_by_window"] = {f"{k * args.window:.0f}s": round(statistics.quantiles(v, n=100)[98], 2)
                                          for k, v in sorted(run.windows.items()) if len(v) >= 100}
            report["committed_checked"] = len(run.committed - set(victims))
            report["entries_lost"] = len(lost)
            report["lost_examples"] = lost[:5]
            report["rss_growth_after_warmup"] = _rss_growth(report["rss"], args.warmup)
            report["server_faults"] = sum(c[code] for c in run.codes.values() for code in SERVER_FAULTS)
        finally:
            server.stop()
    Path(args.out).write_text(json.dumps(report, indent=2))
    _print(report)
    print(f"wrote {args.out}")


def _acknowledged(acked: dict[str, float], missing: list[str], kills: list[dict]) -> dict:
    """Acknowledged fresh misses, those missing from the store, and of these the ones answered in the
    moments before a worker's kill (its puts in flight); the rest are lost beyond them (must be 0)."""
    before, after = IN_FLIGHT_S
    worker_kills = [k["t_s"] for k in kills if k["role"].startswith("worker")]
    in_flight = [t for t in missing if any(k - before <= acked[t] <= k + after for k in worker_kills)]
    beyond = sorted(set(missing) - set(in_flight))
    return {"answers": len(acked), "missing": len(missing), "missing_in_flight_at_a_worker_kill": len(in_flight),
            "missing_beyond_in_flight": len(beyond), "beyond_examples": beyond[:5],
            "worker_backlog_at_kills": sum(k.get("writer_backlog_before") or 0 for k in kills
                                           if k["role"].startswith("worker")),
            "kills_by_role": dict(Counter(k["role"].split("-")[0] for k in kills))}


def _progress(run: _Run, total: int, stop: threading.Event) -> None:
    while not stop.wait(30):
        print(f"soak: {run.sent}/{total} sent", flush=True)


def _print(report: dict) -> None:
    print(f"\nsoak: {report['requests']} requests, {report['seconds']} s, {len(report['kills'])} kill -9 "
          f"({Counter(k['role'].split('-')[0] for k in report['kills'])})")
    for kind, codes in report["codes"].items():
        print(f"  {kind:<10} {codes}")
    print(f"  answers with {sorted(SERVER_FAULTS)} (must be 0): {report['server_faults']}")
    print(f"  p99 by window (ms): {report['p99_ms_by_window']}")
    print(f"  entries lost: {report['entries_lost']} of {report['committed_checked']} committed")
    acked = report["acknowledged"]
    print(f"  acknowledged misses: {acked['answers']}; missing from the store: {acked['missing']}, of them "
          f"{acked['missing_in_flight_at_a_worker_kill']} in flight at a worker kill (backlogs summed over "
          f"worker kills: {acked['worker_backlog_at_kills']}); lost beyond the puts in flight (must be 0): "
          f"{acked['missing_beyond_in_flight']}; writer restarts: {report['writer_restarts']}")
    for name, row in report["rss_growth_after_warmup"].items():
        print(f"  memory {name:<16} RSS {row['rss_from_mb']} -> {row['rss_to_mb']} MB, of it anonymous "
              f"{row['anon_from_mb']} -> {row['anon_to_mb']} MB ({row['anon_ratio']}x over {row['span_s']} s)")


if __name__ == "__main__":
    main()
