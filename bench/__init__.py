"""`make bench`: latency, throughput and start-up figures against baselines measured in the same run."""
