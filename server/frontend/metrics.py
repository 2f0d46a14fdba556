"""A frontend's Prometheus figures (server/shared/telemetry.py): calls, miss reasons, model time saved.

Only made when /metrics is on (server.metrics_port); with it off, calls record none of this.

Model time saved: each answer the model did not compute counts the engine time it spared, at its
models' recent mean engine time per text for the input's sequence-length bucket, which the workers
publish: an exact, fleet or coalesced hit the model's own; a semantic hit the model's less its
embedder's (which ran, to search); a FEATURE answer its encoder's (only the head ran). A hit is never
tokenized (that would cost more than the rest of the hit), so its bucket is estimated from the
normalized text's length: for the misses it tokenizes, the frontend counts which bucket the texts of
each length class (powers of two of characters) fell in, and a hit of that class counts the mean of
those buckets' times weighted by those counts. Hits wait (counted per class) until the times they need
are known, then are converted at each publish.
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict

from infercache.v1 import infercache_pb2 as pb
from server.shared.telemetry import LATENCY_BOUNDS, Recorder

Source = pb.CacheInfo.Source
# As plain ints: an attribute of a protobuf enum wrapper costs about a microsecond, on every hit.
MISS, RESULT_EXACT, RESULT_SEMANTIC, FEATURE, COALESCED, RESULT_FLEET = (
    int(Source.Value(name)) for name in ("MISS", "RESULT_EXACT", "RESULT_SEMANTIC", "FEATURE", "COALESCED",
                                         "RESULT_FLEET"))
SOURCE_NAMES = {value: name.lower() for name, value in Source.items()}
# A batch call is labelled with its costliest text's source.
COST_ORDER = {RESULT_EXACT: 0, RESULT_FLEET: 1, RESULT_SEMANTIC: 2, FEATURE: 3, COALESCED: 4, MISS: 5}
SAVING = frozenset({RESULT_EXACT, RESULT_FLEET, RESULT_SEMANTIC, COALESCED, FEATURE})
UNKNOWN_MODEL = "unknown"  # a name the server does not serve: clients must not be able to mint series


def length_class(chars: int) -> int:
    return chars.bit_length()


class FrontendMetrics:
    """Written by the frontend's event loop only."""

    def __init__(self, served_models) -> None:
        self.recorder = Recorder()
        self._served = served_models              # a container of the model names served
        # (model, version, length class, spared, spent) -> hits not yet converted to seconds (see hit)
        self._pending: dict[tuple, int] = {}
        self._buckets: defaultdict[tuple[str, str, int], Counter[int]] = defaultdict(Counter)
        self._series_of: dict[tuple[str, int], tuple[tuple, list]] = {}  # see _series

    def model_label(self, model: str) -> str:
        return model if model in self._served else UNKNOWN_MODEL

    def _series(self, model: str, source: int) -> tuple[tuple, list]:
        """(requests_total key, the request_duration histogram's own list) of an OK text of this model
        and source: made once, since this runs on every hit."""
        found = self._series_of.get((model, source))
        if found is None:
            name = SOURCE_NAMES[source]
            duration = ("infercache_request_duration_seconds", model, name)
            self.recorder.observe(duration, 0.0, count=0)  # its list exists from here on
            found = self._series_of[(model, source)] = (("infercache_requests_total", model, name, "OK"),
                                                        self.recorder.histograms[duration])
        return found

    def answered(self, model: str, sources: list[int], seconds: float) -> None:
        """An OK call: one count per text by its source, and the call's latency."""
        counters = self.recorder.counters
        if len(sources) == 1:
            key, histogram = self._series(model, sources[0])
            counters[key] = counters.get(key, 0) + 1
        else:
            for source in sources:
                key = self._series(model, source)[0]
                counters[key] = counters.get(key, 0) + 1
            histogram = self._series(model, max(sources, key=COST_ORDER.__getitem__))[1]
        histogram[bisect.bisect_left(LATENCY_BOUNDS, seconds)] += 1
        histogram[-1] += seconds

    def failed(self, model: str, texts: int, code: str, seconds: float) -> None:
        self.recorder.inc(("infercache_requests_total", model, "none", code), texts)
        self.recorder.observe(("infercache_request_duration_seconds", model, "none"), seconds)

    def generated(self, model: str, source: int, first_s: float, total_s: float, tokens: int) -> None:
        """A Generate call answered: its time to first token and to the end, and the tokens it got (for a
        hit, tokens the model did not have to generate)."""
        name = SOURCE_NAMES[source]
        self.recorder.observe(("infercache_generate_ttft_seconds", model, name), first_s)
        self.recorder.observe(("infercache_generate_duration_seconds", model, name), total_s)
        self.recorder.inc(("infercache_generated_tokens_total", model, name), tokens)

    def upstream_saved(self, model: str, upstream, prompt_tokens: int, completion_tokens: int) -> None:
        """A generation of a model computed upstream (its UpstreamSpec) that the upstream was not asked for."""
        self.recorder.inc(("infercache_upstream_tokens_saved_total", model, "input"), prompt_tokens)
        self.recorder.inc(("infercache_upstream_tokens_saved_total", model, "output"), completion_tokens)
        cost = (prompt_tokens * upstream.input_cost_per_mtok + completion_tokens * upstream.output_cost_per_mtok) / 1e6
        self.recorder.inc(("infercache_upstream_cost_saved_total", model), cost)

    def inter_token(self, model: str, gap_s: float, tokens: int) -> None:
        """`tokens` tokens of a streamed answer reached its caller `gap_s` after the previous ones."""
        if tokens:
            self.recorder.observe(("infercache_generate_inter_token_seconds", model), gap_s / tokens, tokens)

    def missed(self, model: str, reason: str) -> None:
        self.recorder.inc(("infercache_misses_total", model, reason))

    def hit(self, model: str, version: str, chars: int, spared: tuple[str, str] | None = None,
            spent: tuple[str, str] | None = None) -> None:
        """An answer the model did not compute: it spared the engine time of `spared` (default the
        model version itself), less that of `spent` (a model that ran for it anyway), if given."""
        key = (model, version, chars.bit_length(), spared, spent)  # (bit_length: the length class)
        self._pending[key] = self._pending.get(key, 0) + 1

    def tokenized(self, model: str, version: str, chars: int, bucket: int) -> None:
        self._buckets[(model, version, length_class(chars))][bucket] += 1

    def settle(self, means: dict[tuple[str, str], dict[int, float]]) -> None:
        """Pending hits into seconds saved, where the workers have published the times they need."""
        for key, hits in list(self._pending.items()):
            model, version, cls, spared, spent = key
            gained, lost = means.get(spared or (model, version)), means.get(spent) if spent is not None else {}
            if not gained or (spent is not None and not lost):
                continue
            seconds = self._expected(model, version, cls, gained)
            if spent is not None:
                seconds = max(0.0, seconds - self._expected(model, version, cls, lost))
            del self._pending[key]
            self.recorder.inc(("infercache_compute_seconds_saved_total", model), hits * seconds)

    def _expected(self, model: str, version: str, cls: int, times: dict[int, float]) -> float:
        """Mean engine seconds (`times`: per bucket) of a text of this length class of this model
        version: its buckets weighted by how often its misses of the class fell in each; without such
        misses yet, the nearest class that has some, else the mean over the known buckets."""
        classes = sorted(c for (m, v, c), seen in self._buckets.items() if m == model and v == version and seen)
        if classes:
            at = bisect.bisect_left(classes, cls)
            nearest = min(classes[max(0, at - 1):at + 1], key=lambda c: abs(c - cls))
            seen = self._buckets[(model, version, nearest)]
            known = {bucket: n for bucket, n in seen.items() if bucket in times}
            if known:
                return sum(times[b] * n for b, n in known.items()) / sum(known.values())
        return sum(times.values()) / len(times)
