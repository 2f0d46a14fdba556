"""What /metrics costs on the exact-hit path (part of `make bench ARGS="--sections serving"`).

Two servers with the same weights and the same Banking77 hits, one with `server.metrics_port` set and a
real Prometheus scraping it every second (every request then records its source, code, latency and
hot key; every process publishes its figures each second; the supervisor serves the scrapes), one with
metrics off (hot keys stay on in both: they are not part of /metrics). As in bench/security.py, one
frontend each, a fresh pair per round, the order alternating, and the target's figure the median of each
round's on / off ratio (both measured back to back). Then each one's frontend CPU per hit. On a host of
8 CPUs or more, the load generator runs on cores of its own (bench/cores.py). Those figures scatter by
10-20% between rounds on shared machines, so the recording's own cost is also measured in one process on
the last round's store: the frontend's hit path with the /metrics wrapper against without, alternating.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
import urllib.request
from pathlib import Path

from bench import cores
from bench.load import minilm_only, run_load, warm
from bench.security import HITS, frontend_cpu_us_per_hit
from bench.sections import Run
from harness import prometheus_server
from harness.servers import ServerProcess, free_port
from infercache.v1 import infercache_pb2 as pb


class _Scraper:
    """A real Prometheus scraping every second where it is installed, else a thread that GETs /metrics
    every second (the server's side of a scrape is the same)."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.prometheus = None
        self._stop = threading.Event()
        if prometheus_server.available() is None:
            self.prometheus = prometheus_server.PrometheusProcess(workdir, [f"127.0.0.1:{port}"])
            self.kind = "prometheus"
        else:
            self.kind = "thread"
            threading.Thread(target=self._loop, args=(port,), daemon=True).start()

    def _loop(self, port: int) -> None:
        while not self._stop.wait(1.0):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
            except OSError:
                pass

    def scraped(self) -> int:
        """How many scrapes succeeded (Prometheus' own count; the thread's are not counted)."""
        if self.prometheus is None:
            return -1
        found = self.prometheus.query('count_over_time(up{job="infercache"}[10m])')
        return int(float(found[0]["value"][1])) if found else 0

    def stop(self) -> None:
        self._stop.set()
        if self.prometheus is not None:
            self.prometheus.stop()


def bench_metrics_cost(workdir: Path, texts: list[str], rounds: int, scale: float, frontends: int = 1) -> dict:
    workdir.mkdir(parents=True)
    requests = [pb.InferRequest(model="minilm", text=t) for t in texts[:HITS]]
    plan = {1: int(3000 * scale), 32: int(20000 * scale)}
    runs: dict[str, dict[int, list[dict]]] = {name: {1: [], 32: []} for name in ("off", "on")}
    cpu: dict[str, list[float]] = {"off": [], "on": []}
    scrapes, kind = [], ""
    placement = cores.split()
    for round_ in range(rounds):
        port = free_port()
        servers = {}
        with cores.affinity(placement and placement.servers):  # (Prometheus too)
            for name, settings in (("off", ()), ("on", (f"server.metrics_port={port}",))):
                (workdir / f"{name}{round_}").mkdir()
                servers[name] = ServerProcess(
                    workdir / f"{name}{round_}", minilm_only(workdir / f"models-{name}{round_}"), frontends=frontends,
                    engines_dir=workdir / "engines", settings=("engines.runtime=onnxruntime", *settings))
            scraper = _Scraper(workdir / f"prometheus{round_}", port)
        kind = scraper.kind
        try:
            with cores.affinity(placement and placement.load):
                for server in servers.values():
                    warm(server.address, requests)
                order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
                for name in order:
                    server = servers[name]
                    for concurrency, total in plan.items():
                        asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total // 10))
                        result = asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total))
                        assert result.errors == 0 and result.sources == {"RESULT_EXACT": result.requests}, \
                            result.sources
                        runs[name][concurrency].append(result.summary())
                    cpu[name].append(frontend_cpu_us_per_hit(server, requests, plan[32], None))
            scrapes.append(scraper.scraped())
        finally:
            scraper.stop()
            for server in servers.values():
                assert server.stop() == 0
    # The last round's stores are full of these hits: the recording's own cost, measured in process.
    recording = in_process_cost(servers["off"].cache_dir, workdir / f"models-off{rounds - 1}", texts[:HITS],
                                hits=max(200, int(20000 * min(1.0, 5 * scale))))
    out: dict = {"frontends": frontends, "rounds": rounds, "scraper": kind, "scrapes_per_round": scrapes,
                 "placement": placement.describe() if placement else "scheduler (fewer than 8 CPUs)"}
    for concurrency in plan:
        on, off = runs["on"][concurrency], runs["off"][concurrency]
        row: dict = {name: {k: statistics.median(s[k] for s in runs[name][concurrency])
                            for k in ("p50_ms", "p99_ms", "throughput_rps")} for name in runs}
        row["p50_ratio_paired"] = round(statistics.median(a["p50_ms"] / b["p50_ms"] for a, b in zip(on, off)), 3)
        row["throughput_ratio_paired"] = round(statistics.median(
            a["throughput_rps"] / b["throughput_rps"] for a, b in zip(on, off)), 3)
        row["p50_ratios_by_round"] = [round(a["p50_ms"] / b["p50_ms"], 3) for a, b in zip(on, off)]
        row["throughput_ratios_by_round"] = [round(a["throughput_rps"] / b["throughput_rps"], 3)
                                             for a, b in zip(on, off)]
        row["runs"] = {name: runs[name][concurrency] for name in runs}
        out[f"concurrency_{concurrency}"] = row
    out["frontend_cpu_us_per_hit"] = {name: statistics.median(values) for name, values in cpu.items()}
    out["frontend_cpu_us_per_hit"]["ratio"] = round(out["frontend_cpu_us_per_hit"]["on"]
                                                    / out["frontend_cpu_us_per_hit"]["off"], 3)
    out["frontend_cpu_us_per_hit_by_round"] = cpu
    out["recording_in_process"] = recording
    return out


def _no_deadline() -> None:
    return None


def in_process_cost(cache_dir: Path, models: Path, texts: list[str], rounds: int = 10, hits: int = 20000) -> dict:
    """The hit path's CPU in one process, without gRPC or another process to disturb it: FrontendCore
    on a filled store, through the doors' /metrics wrapper (server/frontend/tally.py's measured: on) or the
    plain call (off), blocks alternating. The figure the scheduler's noise cannot move: what recording costs per hit."""
    from collections import Counter

    from server import config as config_mod
    from server.frontend.core import FrontendCore
    from server.frontend.metrics import FrontendMetrics
    from server.frontend.tally import measured
    from server.frontend.hot_keys import HotKeys
    from server.shared.models import ModelRepository

    config = config_mod.load(None, {}, {"cache.dir": str(cache_dir), "server.models_dir": str(models)})
    repository = ModelRepository(models, 0)

    async def run() -> dict:
        off = FrontendCore(config, repository, None, Counter(), None, None, HotKeys(256))
        on = FrontendCore(config, repository, None, Counter(), None, FrontendMetrics(repository.models), HotKeys(256))
        on._l1 = off._l1  # one LMDB environment per process
        requests = [pb.InferRequest(model="minilm", text=t) for t in texts]

        async def block(core: FrontendCore, n: int) -> float:
            started = time.process_time()
            for i in range(n):
                if core is on:
                    await measured(core, core.infer, requests[i % len(requests)], 1, _no_deadline)
                else:
                    await core.infer(requests[i % len(requests)], None)
            return (time.process_time() - started) / n * 1e6

        await block(on, hits // 10)
        await block(off, hits // 10)
        runs: dict[str, list[float]] = {"on": [], "off": []}
        for n in range(rounds):
            for name, core in ((("on", on), ("off", off)) if n % 2 == 0 else (("off", off), ("on", on))):
                runs[name].append(round(await block(core, hits), 2))
        return runs

    runs = asyncio.run(run())
    on, off = statistics.median(runs["on"]), statistics.median(runs["off"])
    return {"us_per_hit_on": on, "us_per_hit_off": off, "added_us_per_hit": round(on - off, 2),
            "ratio_paired": round(statistics.median(a / b for a, b in zip(runs["on"], runs["off"])), 3),
            "runs": runs}


def print_metrics_cost(report: dict) -> None:
    print(f"\nexact hits, /metrics on (scraped each second by a {report['scraper']}) vs off "
          f"({report['frontends']} frontend; median of {report['rounds']} rounds)")
    print("                              p50 ms    p99 ms    req/s")
    for key in ("concurrency_1", "concurrency_32"):
        row = report[key]
        for name in ("off", "on"):
            r = row[name]
            print(f"  {key:<16} {name:<9} {r['p50_ms']:8.3f}  {r['p99_ms']:8.3f}  {r['throughput_rps']:7.0f}")
        print(f"  {key:<16} on / off p50 {row['p50_ratio_paired']:.3f}x, throughput {row['throughput_ratio_paired']:.3f}x "
              "by round (target: p50 <= 1.05x, throughput >= 0.95x)")
    cpu = report["frontend_cpu_us_per_hit"]
    print(f"  frontend CPU per hit: off {cpu['off']} us, on {cpu['on']} us = {cpu['ratio']}x")
    rec = report["recording_in_process"]
    print(f"  the hit path in one process (no gRPC): off {rec['us_per_hit_off']} us, on {rec['us_per_hit_on']} us: "
          f"recording adds {rec['added_us_per_hit']} us per hit")


def section(run: Run) -> None:
    print("benchmarking /metrics on vs off on exact hits ...", flush=True)
    run.report["metrics_cost"] = bench_metrics_cost(run.workdir / "metrics", run.texts, run.rounds, run.scale)
    print_metrics_cost(run.report["metrics_cost"])
