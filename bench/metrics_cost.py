"""What /metrics costs on the exact-hit path (part of `make bench ARGS="--sections serving"`).

Two servers with the same weights and the same Banking77 hits, one with `server.metrics_port` set and a
real Prometheus scraping it every second (every request then records its source, code, latency and
hot key; every process publishes its figures each second; the supervisor serves the scrapes), one with
metrics off (hot keys stay on in both: they are not part of /metrics). As in bench/security.py, one
frontend each, a fresh pair per round, the order alternating, and the target's figure the median of each
round's on / off ratio (both measured back to back). Then each one's frontend CPU per hit.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import urllib.request
from pathlib import Path

from bench.load import minilm_only, run_load, warm
from bench.security import HITS, frontend_cpu_us_per_hit
from infercache import testing_prometheus
from infercache.testing import ServerProcess, free_port
from infercache.v1 import infercache_pb2 as pb


class _Scraper:
    """A real Prometheus scraping every second where it is installed, else a thread that GETs /metrics
    every second (the server's side of a scrape is the same)."""

    def __init__(self, workdir: Path, port: int) -> None:
        self.prometheus = None
        self._stop = threading.Event()
        if testing_prometheus.available() is None:
            self.prometheus = testing_prometheus.PrometheusProcess(workdir, [f"127.0.0.1:{port}"])
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
    for round_ in range(rounds):
        port = free_port()
        servers = {}
        for name, settings in (("off", ()), ("on", (f"server.metrics_port={port}",))):
            (workdir / f"{name}{round_}").mkdir()
            servers[name] = ServerProcess(workdir / f"{name}{round_}", minilm_only(workdir / f"models-{name}{round_}"),
                                          frontends=frontends, engines_dir=workdir / "engines",
                                          settings=("engines.runtime=onnxruntime", *settings))
        scraper = _Scraper(workdir / f"prometheus{round_}", port)
        kind = scraper.kind
        try:
            for server in servers.values():
                warm(server.address, requests)
            order = ("off", "on") if round_ % 2 == 0 else ("on", "off")
            for name in order:
                server = servers[name]
                for concurrency, total in plan.items():
                    asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total // 10))
                    result = asyncio.run(run_load(server.address, requests, concurrency=concurrency, total=total))
                    assert result.errors == 0 and result.sources == {"RESULT_EXACT": result.requests}, result.sources
                    runs[name][concurrency].append(result.summary())
                cpu[name].append(frontend_cpu_us_per_hit(server, requests, plan[32], None))
            scrapes.append(scraper.scraped())
        finally:
            scraper.stop()
            for server in servers.values():
                assert server.stop() == 0
    out: dict = {"frontends": frontends, "rounds": rounds, "scraper": kind, "scrapes_per_round": scrapes}
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
    return out


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
