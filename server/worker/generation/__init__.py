"""Generations in a worker: one flight per deterministic key (identical generations in flight run once;
a caller that joins late gets the text so far, then the rest), answered by whatever computes the model:

- request.py: a generation's flight (its callers, the text sent so far, its whole answer) and a local
  decoder's state of it;
- scheduler.py: a local model version's scheduler, one task that owns the running batch (continuous
  batching) over its decoder;
- generations.py: the flights by key, the late hit from L1, semantic answers, and the answers into L1;
- an upstream model's streams (server/worker/upstream/generative.py) take a scheduler's place.
"""
