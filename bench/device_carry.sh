#!/usr/bin/env bash
# Builds what a run of bench/device.sh carries to the lent GPU machine (no network there), from the
# repository root after `make setup`:
#   .whl/              wheels for the device's Python (3.12, x86_64) of what its image lacks, and the hnswlib
#                      source distribution (built there)
#   .devcarry/minilm-fp16  all-MiniLM-L6-v2 with its weights in fp16 (the fp32 file is over the carry limit)
#   infercache/v1, infercache/kserve   the generated stubs (make stubs)
# Then call the device tool with carry [".whl", ".devcarry", "infercache/v1", "infercache/kserve"] and the command
#   BENCH_COMMIT=$(git rev-parse --short HEAD) bash bench/device.sh --sections gpu ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${DEVICE_PYTHON:-3.12}
rm -rf .whl && mkdir -p .whl
echo "wheels for Python $PYVER ..."
"$PY" -m pip download -q --disable-pip-version-check --dest .whl --only-binary=:all: --no-deps \
    --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 \
    lmdb==3.0.0 xxhash==3.6.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
    cryptography==50.0.2 cffi pycparser pyyaml==6.0.4
# (the sdist's metadata is prepared here without build isolation: with this venv's numpy and pybind11)
"$PY" -m pip install -q --disable-pip-version-check pybind11
"$PY" -m pip download -q --disable-pip-version-check --dest .whl --no-binary=:all: --no-deps --no-build-isolation \
    hnswlib==0.8.0
echo "all-MiniLM-L6-v2 in fp16 ..."
rm -rf .devcarry/minilm-fp16 && mkdir -p .devcarry
HF_HUB_OFFLINE=1 "$PY" - <<'PY'
from pathlib import Path
import shutil

from transformers import AutoModel

from server.tools.export_model import default_encoder_dir

source, target = default_encoder_dir(), Path(".devcarry/minilm-fp16")
AutoModel.from_pretrained(str(source)).half().save_pretrained(str(target))
for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
    if (source / name).is_file():
        shutil.copy(source / name, target / name)
PY
make -s stubs
du -sh .whl .devcarry infercache/v1 infercache/kserve
