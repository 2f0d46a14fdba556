"""`make bench`: latency, throughput and start-up figures against baselines measured in the same run."""

from infercache.testing import REPO

BANKING77 = REPO.parent / "shared" / "data" / "banking77" / "train.csv"
RESULTS = REPO / "bench" / "results"
