"""The fleet tier: results shared by every pod through Redis or a Redis Cluster (`fleet.redis`).

Lookup order: L1 (the host's LMDB) -> fleet -> semantic -> compute. A frontend looks in L1 and then in
the fleet itself, and answers a fleet hit at once (its worker copies the record into L1); the worker
looks in L1 again, coalesces, takes the key's lease across pods, computes and writes the result to the
fleet behind the reply.

- link.py: the client (one Redis or a cluster), each call within a time budget, a circuit breaker.
- generations.py: namespace generations (what fleet-wide invalidation increments) and fleet key names.
- tier.py: lookups, write-behind of computed results, leases across pods, invalidation and its
  broadcast, and the subscription that keeps each pod's generations current.

This package imports redis-py only when the tier is configured: a server without `fleet.redis` never
loads it.
"""
