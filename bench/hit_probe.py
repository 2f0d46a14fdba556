"""Where an exact hit's time goes inside a frontend, hot and after idle gaps (`python -m bench.hit_probe`).

Runs the frontend's hit path (plan, key, L1 lookup) in this process against a real store filled by a
real server, with no gRPC: back to back, then with 0.5 ms and 2 ms of sleep between calls, as a
frontend sees at one caller. Prints the median microseconds of each step.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from harness.servers import REPO, ServerProcess
from infercache.v1 import infercache_pb2 as pb
from server import config as settings
from server.frontend.core import FrontendCore
from server.shared.models import ModelRepository

TEXT = "how do I top up my card?"


async def _probe(cache_dir: Path, calls: int) -> None:
    config = settings.load(None, {}, {"cache.dir": str(cache_dir), "server.models_dir": str(REPO / "models")})
    core = FrontendCore(config, ModelRepository(REPO / "models"), None, Counter())
    request = pb.InferRequest(model="minilm", text=TEXT)
    assert pb.InferResponse.FromString(await core.infer(request, None)).cache.source == pb.CacheInfo.RESULT_EXACT
    cache = core.l1()
    for gap in (0.0, 0.0005, 0.002):
        steps: dict[str, list[float]] = {"plan": [], "key": [], "lookup": [], "total": []}
        for _ in range(calls):
            if gap:
                time.sleep(gap)
            t0 = time.perf_counter()
            plan = core.planner.plan(request)
            t1 = time.perf_counter()
            _, key, _ = core.planner.keyed(request.tenant, plan.served, request.text)
            t2 = time.perf_counter()
            cache.lookup(key, None)
            t3 = time.perf_counter()
            for name, seconds in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                steps[name].append(seconds * 1e6)
        print(f"idle gap {gap * 1000:.1f} ms: " + ", ".join(f"{k} {statistics.median(v):.1f} us" for k, v in steps.items()))


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="infercache-probe-") as tmp:
        with ServerProcess(Path(tmp), REPO / "models", frontends=1) as server:
            with server.client() as client:
                client.infer("minilm", TEXT)
            time.sleep(1.0)  # the write-behind commits the entry
            asyncio.run(_probe(server.cache_dir, 2000))


if __name__ == "__main__":
    main()
