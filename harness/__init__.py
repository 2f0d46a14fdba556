"""The processes the tests and the benchmarks start and inspect: a real infercache server (servers), a real
Redis and Redis Cluster (redis_servers), a real Prometheus (prometheus_server)."""
