"""`make bench`: latency, throughput and start-up figures against baselines measured in the same run."""

import os
from pathlib import Path

from tests.servers import REPO

# The Banking77 train split (bench/data/banking77/: its licence and source beside it). BENCH_BANKING77 names
# another copy (not an INFERCACHE_ variable: the server reads those as settings).
BANKING77 = Path(os.environ.get("BENCH_BANKING77", REPO / "bench" / "data" / "banking77" / "train.csv"))
RESULTS = REPO / "bench" / "results"
