#!/usr/bin/env bash
# Runs on the lent GPU machine (no network there), from the repository root, through the device tool,
# carrying .whl (wheels the image lacks, and the hnswlib sdist, built there), .devcarry (all-MiniLM-L6-v2
# in fp16: the fp32 file is over the carry limit; exported back to the fp32 ONNX graph and the torch form
# here) and infercache/v1 and infercache/kserve (generated stubs). Banking77 travels with the tree (bench/data/banking77/).
#   BENCH_COMMIT=<commit> bash bench/device.sh --sections gpu   # GPU tests, then `python -m bench` with these arguments
#   DEVICE_TESTS=0 BENCH_LIMIT_S=170 bash bench/device.sh --sections gpu --gpu-parts minilm,null   # short lease
#   DEVICE_TESTS=0 bash bench/device.sh --sections workers   # nvidia-h200-x2: one worker per GPU vs one
#   DEVICE_TESTS=tests/test_decoder_engine.py DEVICE_MINILM=0 bash bench/device.sh --sections generate
#   DEVICE_TESTS=0 DEVICE_MINILM=random bash bench/device.sh --sections peers --peers-parts infinity
#     (carry [".whl", ".peerwhl", ".devcarry/minilm-shape", "infercache/v1", "infercache/kserve"])
#     (DEVICE_TESTS: 0, or the test files to run instead of the GPU ones; DEVICE_MINILM=0: MiniLM is not
#     exported, for sections and tests that do not serve it; random: random weights of its shape)
# Each step has a time limit, so one call (10 minutes at most) always returns what was measured.
# Result files go to $OUT, named as at home (gpu-h200.json, ...), recording this command, the machine, the
# commit (BENCH_COMMIT: the device's copy of the tree carries no reliable git metadata) and the date; copy
# them into bench/results/ and the figures into docs/benchmarks.md. The GPU tests' log: $OUT/device-tests.txt.
set -euo pipefail
OUT=${OUT:-bench/results}
TEST_LIMIT_S=${TEST_LIMIT_S:-150}
BENCH_LIMIT_S=${BENCH_LIMIT_S:-380}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
    .whl/hnswlib-*.tar.gz
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 BENCH_RESULTS=$OUT \
    BENCH_COMMIT="${BENCH_COMMIT:-unknown (BENCH_COMMIT not set)}"
# The command as run, with the settings of this script that change what it measures.
limits="TEST_LIMIT_S BENCH_LIMIT_S"
[ "${DEVICE_TESTS:-1}" != 0 ] || limits=BENCH_LIMIT_S  # (no tests: their limit changed nothing)
settings=$(for name in DEVICE_TESTS DEVICE_MINILM $limits; do
    [ -z "${!name:-}" ] || printf '%s=%q ' "$name" "${!name}"; done)
export BENCH_COMMAND="${settings}bash bench/device.sh $*"
# DEVICE_MINILM=random: MiniLM's shape with random fp16 weights (carried: .devcarry/minilm-shape), for runs
# whose carry has no room for the weights; said so in their results.
[ "${DEVICE_MINILM:-1}" != random ] || python3 - <<'PY'
import shutil
from pathlib import Path
from transformers import BertConfig, BertModel
shape, target = Path(".devcarry/minilm-shape"), Path(".devcarry/minilm-fp16")
BertModel(BertConfig.from_pretrained(str(shape))).half().save_pretrained(str(target))
for name in shape.iterdir():
    if name.name != "config.json":
        shutil.copy(name, target / name.name)
print("MiniLM: random fp16 weights of its shape")
PY
[ "${DEVICE_MINILM:-1}" = 0 ] || python3 - <<'PY'
from pathlib import Path
from server.tools.export_model import export_sentence_encoder
export_sentence_encoder(Path(".devcarry/minilm-fp16"), Path("models/minilm/1"), 256)
PY
[ ! -d .peerwhl ] || export PEER_WHEELS=$PWD/.peerwhl  # bench/peer_envs.py: infinity from these
echo "cores: $(nproc)"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
TESTS="tests/test_torch_cuda.py tests/test_torch_bert.py tests/test_cuda.py tests/test_features.py tests/test_decoder_engine.py"
[ "${DEVICE_TESTS:-1}" = 1 ] || TESTS=${DEVICE_TESTS}
[ "$TESTS" = 0 ] || timeout "$TEST_LIMIT_S" python3 -m pytest -q -rs -p no:cacheprovider $TESTS 2>&1 \
    | tee "$OUT/device-tests.txt" || true
timeout "$BENCH_LIMIT_S" python3 -m bench "$@" 2>&1 | tee "$OUT/bench-device.txt"
