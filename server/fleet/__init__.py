"""The fleet tier: results shared by every pod through Redis or a Redis Cluster (`fleet.redis`).

Lookup order on a worker: L1 (the host's LMDB, looked up by the frontend and again by the worker) ->
fleet -> semantic -> compute. Only inference workers talk to Redis; frontends are unchanged.

- link.py: the client (one Redis or a cluster), each call within a time budget, a circuit breaker.
- generations.py: namespace generations (what fleet-wide invalidation increments) and fleet key names.
- tier.py: lookups, write-behind of computed results, leases across pods, invalidation and its
  broadcast, and the subscription that keeps each pod's generations current.

This package imports redis-py only when the tier is configured: a server without `fleet.redis` never
loads it.
"""
