"""`make bench`: latency, throughput and start-up figures against baselines measured in the same run."""

import os
from pathlib import Path

from tests.servers import REPO

# The device machine has no shared/ beside the checkout: bench/device.sh points this at a carried copy
# (not an INFERCACHE_ variable: the server reads those as settings).
BANKING77 = Path(os.environ.get("BENCH_BANKING77", REPO.parent / "shared" / "data" / "banking77" / "train.csv"))
RESULTS = REPO / "bench" / "results"
