"""Models computed by another server (`runtime: upstream`): the worker batches their misses as it batches an
engine's and sends each batch to an upstream server (an OpenAI-compatible API, a KServe v2 server, another
infercache), chosen by the keys' rendezvous hash among the healthy ones. Everything in front of the call
(L1, the fleet tier, coalescing, admission, the write-behind) is the same as for a local model.

credentials (the token, read once) · http (a small HTTP/1.1 JSON client) · clients (one per kind) ·
pool (rendezvous routing, retries, the circuit breakers) · runtime (the model's batcher and answers)."""
