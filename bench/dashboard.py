"""The README's dashboard picture from a real run: `python -m bench.dashboard [--seconds 240]`.

Starts a server (minilm; faq, a head on it with semantic matching, trained here from
examples/faq.csv; smollm2, the generative model) with /metrics on, and a real Prometheus scraping it every second; sends mixed
traffic for a while (Banking77 texts, a hot set asked again and again and a long tail of new ones, some
in InferBatch calls, some BYPASS; FAQ questions reworded, for semantic hits; streamed generations, most
of them questions asked before); kills the worker with
SIGKILL once (a restart), sends one burst of misses past the queue (RESOURCE_EXHAUSTED); then draws every
panel of deploy/grafana/infercache.json against that Prometheus into deploy/grafana/dashboard.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from bench import BANKING77, banking77_missing
from bench.load import minilm_only
from harness.servers import REPO, ServerProcess, free_port, link_model
from harness.prometheus_server import PrometheusProcess

sys.path.insert(0, str(REPO / "deploy" / "grafana"))
from render import render  # noqa: E402

DASHBOARD = REPO / "deploy" / "grafana" / "infercache.json"
FAQ = REPO / "examples" / "faq.csv"


def _models(root: Path) -> Path:
    minilm_only(root)
    link_model(root, "smollm2", (REPO / "models" / "smollm2" / "config.yaml").read_text(),
               {"1": REPO / "models" / "smollm2" / "1"})
    trained = subprocess.run([sys.executable, "-m", "server", "train-head", str(FAQ), "--name", "faq",
                              "--label-column", "intent", "--models-dir", str(root)],
                             cwd=REPO, capture_output=True, text=True, timeout=900)
    if trained.returncode != 0:
        raise SystemExit(trained.stdout + trained.stderr)
    return root


def _texts() -> tuple[list[str], list[str]]:
    with open(BANKING77, newline="") as f:
        banking = [row["text"] for row in csv.DictReader(f)]
    with open(FAQ, newline="") as f:
        faq = [row["text"] for row in csv.DictReader(f)]
    return banking, faq


def _traffic(server: ServerProcess, banking: list[str], faq: list[str], until: float, seed: int) -> None:
    rng = random.Random(seed)
    hot = banking[:150]
    with server.client(timeout_s=5.0) as client:
        while time.monotonic() < until:
            roll = rng.random()
            try:
                if roll < 0.55:
                    client.infer("minilm", rng.choice(hot))
                elif roll < 0.70:
                    client.infer("minilm", rng.choice(banking))
                elif roll < 0.78:
                    client.infer_batch("minilm", rng.sample(hot, 6) + rng.sample(banking, 2))
                elif roll < 0.80:
                    client.infer("minilm", rng.choice(hot), mode="BYPASS")
                else:
                    question = rng.choice(faq)
                    client.infer("faq", question if rng.random() < 0.5 else f"{question} please")
            except grpc.RpcError:
                pass  # the worker restart and the burst refuse some calls: that is what is drawn
            time.sleep(rng.uniform(0.0, 0.02))


def _generations(server: ServerProcess, faq: list[str], until: float, seed: int) -> None:
    """Streamed answers of 16 tokens: four in five to questions asked before (hits once stored), the rest new."""
    rng = random.Random(seed)
    asked = faq[:8]
    with server.client(timeout_s=30.0) as client:
        while time.monotonic() < until:
            question = rng.choice(asked) if rng.random() < 0.8 else f"{rng.choice(faq)} ({rng.randrange(10**6)})"
            try:
                for _ in client.generate_stream("smollm2", question, max_new_tokens=16):
                    pass
            except grpc.RpcError:
                pass
            time.sleep(rng.uniform(0.0, 0.2))


def _burst(server: ServerProcess, banking: list[str]) -> None:
    """Distinct misses at once with a short deadline: the queue refuses what cannot finish in time."""
    texts = [f"{t} burst {n}" for n, t in enumerate(random.Random(1).sample(banking, 400))]

    def one(text: str) -> None:
        try:
            with server.client(timeout_s=0.3) as client:
                client.infer("minilm", text)
        except grpc.RpcError:
            pass
    with ThreadPoolExecutor(64) as pool:
        list(pool.map(one, texts))


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.dashboard")
    parser.add_argument("--seconds", type=float, default=240.0)
    parser.add_argument("--out", default=str(REPO / "deploy" / "grafana" / "dashboard.png"))
    args = parser.parse_args()
    if banking77_missing():
        raise SystemExit(f"bench.dashboard: no traffic to send: {banking77_missing()}")
    banking, faq = _texts()
    with tempfile.TemporaryDirectory(prefix="infercache-dashboard-") as tmp:
        workdir = Path(tmp)
        print("training the faq head ...", flush=True)
        models = _models(workdir / "models")
        port = free_port()
        (workdir / "server").mkdir()
        server = ServerProcess(workdir / "server", models, settings=(f"server.metrics_port={port}",
                                                                      "server.max_queue=64"))
        prometheus = PrometheusProcess(workdir, [f"127.0.0.1:{port}"],
                                       rule_files=[REPO / "deploy" / "prometheus" / "alerts.yml"])
        try:
            prometheus.wait_for('up{job="infercache"}', lambda r: bool(r) and r[0]["value"][1] == "1", timeout=30)
            started = time.time()
            until = time.monotonic() + args.seconds
            print(f"traffic for {args.seconds:.0f} s ...", flush=True)
            senders = [threading.Thread(target=_traffic, args=(server, banking, faq, until, n)) for n in range(4)]
            senders.append(threading.Thread(target=_generations, args=(server, faq, until, 7)))
            for sender in senders:
                sender.start()
            time.sleep(0.4 * args.seconds)
            print("kill -9 of the worker ...", flush=True)
            os.kill(server.stats().worker.pid, signal.SIGKILL)
            time.sleep(0.2 * args.seconds)
            print("a burst of misses past the queue ...", flush=True)
            _burst(server, banking)
            for sender in senders:
                sender.join()
            time.sleep(3)
            out = render(prometheus.query_range, json.loads(DASHBOARD.read_text()), started, time.time(),
                         Path(args.out))
            totals = prometheus.query("sum by (source, code) (infercache_requests_total)")
            print(f"wrote {out}; requests: " + ", ".join(
                f"{s['metric'].get('source')}/{s['metric'].get('code')}={float(s['value'][1]):.0f}" for s in totals))
        finally:
            prometheus.stop()
            server.stop()


if __name__ == "__main__":
    main()
