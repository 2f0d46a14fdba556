"""A model computed by another server (`runtime: upstream` and the config.yaml `upstream:` section): where
its misses go and how they are called. Both sides read it: a frontend sends such a model's misses as text
(it has no tokenizer of the model), a worker calls the upstream (server/worker/upstream/).

The credential is named here (an environment variable or a file), never held: the worker reads it once at
start (server/worker/upstream/credentials.py), so no config, spec, log line or error holds its value."""

from __future__ import annotations

from dataclasses import dataclass, fields
from urllib.parse import urlsplit

from server.shared.generation_spec import GenerationSpec, generation_from_config

KINDS = ("openai", "infercache", "kserve")
# key: by rendezvous hashing of the call's key (a generation's: its conversation's start), so a server keeps
# what it cached for it; round_robin: in turn, for servers that cache nothing worth returning to.
ROUTINGS = ("key", "round_robin")
# What each kind computes here: OpenAI's embeddings and (chat) completions routes; infercache's InferBatch
# and Generate; KServe v2's inference calls.
KIND_TASKS = {"openai": ("embedding", "generate"), "infercache": ("embedding", "generate"), "kserve": ("embedding",)}
# The generate settings of an upstream generative model: a request's defaults and limits, and its queue.
# (The context, the streams in a batch and the decoder are the upstream's.)
UPSTREAM_GENERATE_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "normalize", "max_waiting"})


@dataclass(frozen=True)
class UpstreamSpec:
    kind: str = ""                   # KINDS
    urls: tuple[str, ...] = ()       # one or more: a key's misses go to the first healthy one by rendezvous hashing
    model: str = ""                  # the upstream's name of the model; "" = this model's own name
    credential_env: str = ""         # an environment variable holding the bearer token (or API key)
    credential_file: str = ""        # or a file holding it (surrounding whitespace dropped)
    timeout_s: float = 30.0          # one upstream call and its retries, at most
    max_in_flight: int = 16          # upstream calls in flight at once, from each worker
    max_batch_texts: int = 64        # most texts in one upstream call (the batcher's batch)
    max_delay_ms: float = 0.0        # how long a batch may wait to fill before it is sent (0: at once when a
                                     # call slot is free; misses that come while every slot is busy join the next)
    retries: int = 2                 # more tries of a call that failed for a reason worth retrying
    retry_backoff_ms: float = 50.0   # before a retry: this, doubled each time, with full jitter
    breaker_failures: int = 5        # failed calls in a row that take an upstream out of rotation
    breaker_open_s: float = 5.0      # for this long; then one call tries it again
    output: str = ""                 # kserve: the upstream's output tensor that holds the embedding ("" = the first)
    routing: str = "key"             # ROUTINGS: which server a call goes to first
    input_cost_per_mtok: float = 0.0   # a generative model's price per million prompt tokens (what hits save)
    output_cost_per_mtok: float = 0.0  # and per million answer tokens

    def check(self, task: str) -> None:
        """ValueError naming the first setting out of range."""
        if self.kind not in KINDS:
            raise ValueError(f"upstream.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if task not in KIND_TASKS[self.kind]:
            raise ValueError(f"upstream.kind {self.kind} computes {', '.join(KIND_TASKS[self.kind])} models here, "
                             f"not task {task}")
        if not self.urls:
            raise ValueError("upstream.urls: name at least one URL of the upstream server")
        for url in self.urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"upstream.urls: {url!r} is not an http:// or https:// URL")
            if parts.query or parts.fragment:
                raise ValueError(f"upstream.urls: {url!r}: a query or fragment is not sent; name the base URL alone")
            if parts.username or parts.password:
                raise ValueError("upstream.urls: credentials do not belong in a URL; use upstream.credential_env "
                                 "or upstream.credential_file")
            if self.kind != "openai" and parts.path not in ("", "/"):
                raise ValueError(f"upstream.urls: a {self.kind} upstream is a gRPC address (http://host:port), got "
                                 f"{url!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"upstream.routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.credential_env and self.credential_file:
            raise ValueError("upstream: set credential_env or credential_file, not both")
        if not (self.timeout_s > 0 and self.max_in_flight >= 1 and self.max_batch_texts >= 1 and self.retries >= 0
                and self.max_delay_ms >= 0 and self.retry_backoff_ms >= 0 and self.breaker_failures >= 1
                and self.breaker_open_s > 0 and self.input_cost_per_mtok >= 0 and self.output_cost_per_mtok >= 0):
            raise ValueError("upstream: timeout_s and breaker_open_s > 0; max_in_flight, max_batch_texts and "
                             "breaker_failures >= 1; retries, max_delay_ms, retry_backoff_ms and the costs >= 0")

    def upstream_model(self, name: str) -> str:
        return self.model or name


UPSTREAM_KEYS = frozenset(f.name for f in fields(UpstreamSpec))


def upstream_from_config(section) -> UpstreamSpec:
    """The `upstream:` section as an UpstreamSpec (not yet checked against the model's task)."""
    if not isinstance(section, dict):
        raise ValueError(f"upstream: expected a mapping of settings, got {section!r}")
    values = dict(section)
    urls = values.pop("urls", None)
    if isinstance(urls, str):
        urls = [urls]
    if not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
        raise ValueError("upstream.urls must be a URL or a list of URLs")
    typed = {}
    for name, value in values.items():
        kind = type(getattr(UpstreamSpec, name))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"upstream.{name} must be {'a number' if kind is float else kind.__name__}, got {value!r}")
        typed[name] = value
    return UpstreamSpec(urls=tuple(u.rstrip("/") for u in urls), **typed)


def upstream_generation(section) -> GenerationSpec:
    """The `generate:` section of an upstream generative model: UPSTREAM_GENERATE_KEYS only. Its context
    is the upstream's: none is checked here (a prompt too long for it is the upstream's 400)."""
    section = dict(section or {})
    if stray := sorted(set(section) - UPSTREAM_GENERATE_KEYS):
        raise ValueError(f"generate.{stray[0]}: not a setting of an upstream model (its settings there: "
                         f"{', '.join(sorted(UPSTREAM_GENERATE_KEYS))})")
    limit = section.get("max_new_tokens", GenerationSpec.max_new_tokens)
    return generation_from_config({**section, "context_length": max(GenerationSpec.context_length, limit + 1)
                                   if isinstance(limit, int) else GenerationSpec.context_length})
