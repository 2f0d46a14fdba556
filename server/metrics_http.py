"""GET /metrics in the supervisor: the snapshots every process published (server/shared/telemetry.py), added up.

Counters and histograms are summed over the processes' files. Gauges are summed too: each series has one
publisher (the store's figures come from worker 0 only, an engine's from its worker, named by the
`worker` label), or adds up by nature (a model's queue depth over its workers). The supervisor adds its
own figures (restarts, live processes). The endpoint is prometheus_client's HTTP server on a thread of
its own, with a collector that reads the files on each scrape; nothing here runs on a request path.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

from server.shared.telemetry import SCHEMA, Recorder, read_snapshot

log = logging.getLogger("infercache.metrics")


def add_up(snapshots: Iterable[dict]) -> tuple[Recorder, dict[tuple, float]]:
    """(summed counters and histograms, summed gauges) of published snapshots."""
    total, gauges = Recorder(), {}
    for snapshot in snapshots:
        total.adopt(snapshot)
        for name, labels, value in snapshot.get("gauges", ()):
            if name in SCHEMA:
                key = (name, *labels)
                gauges[key] = gauges.get(key, 0) + value
    return total, gauges


def families(total: Recorder, gauges: dict[tuple, float]) -> list:
    """prometheus_client metric families of combined figures, in SCHEMA's order."""
    out = []
    for name, (kind, help_text, label_names, bounds) in SCHEMA.items():
        if kind == "counter":
            family = CounterMetricFamily(name.removesuffix("_total"), help_text, labels=label_names)
            for key, value in total.counters.items():
                if key[0] == name:
                    family.add_metric(list(key[1:]), value)
        elif kind == "gauge":
            family = GaugeMetricFamily(name, help_text, labels=label_names)
            for key, value in gauges.items():
                if key[0] == name:
                    family.add_metric(list(key[1:]), value)
        else:
            family = HistogramMetricFamily(name, help_text, labels=label_names)
            for key, values in total.histograms.items():
                if key[0] == name:
                    cumulative, buckets = 0, []
                    for bound, count in zip((*bounds, float("inf")), values[:-1]):
                        cumulative += count
                        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
                    family.add_metric(list(key[1:]), buckets, values[-1])
        out.append(family)
    return out


class _Snapshots(Collector):
    def __init__(self, directory: Path, own: Callable[[], dict]) -> None:
        self.directory = directory
        self.own = own  # the supervisor's figures, as a snapshot

    def collect(self):
        found = [read_snapshot(path) for path in sorted(self.directory.glob("*.json"))]
        total, gauges = add_up([s for s in found if s is not None] + [self.own()])
        return families(total, gauges)


def serve(host: str, port: int, directory: Path, own: Callable[[], dict]):
    """Starts the endpoint on its own thread; returns the HTTP server (shutdown() stops it)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshots(directory, own))
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    return server
