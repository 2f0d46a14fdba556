#!/usr/bin/env bash
# Builds what a run of bench/device.sh carries to the lent GPU machine (no network there), from the
# repository root after `make setup`:
#   .whl/              wheels for the device's Python (3.12, x86_64) of what its image lacks, and the hnswlib
#                      source distribution (built there)
#   .devcarry/minilm-fp16  all-MiniLM-L6-v2 with its weights in fp16 (the fp32 file is over the carry limit)
#   .devcarry/minilm-shape its config and tokenizer alone (DEVICE_MINILM=random: random weights made there,
#                      where the carry has no room for the weights: the peers section's infinity part)
#   .peerwhl/          infinity's wheels (bench/peer_envs.py installs them there without resolving)
#   infercache/v1, infercache/kserve   the generated stubs (make stubs)
# Then call the device tool with carry [".whl", ".devcarry", "infercache/v1", "infercache/kserve"] and the command
#   BENCH_COMMIT=$(git rev-parse --short HEAD) bash bench/device.sh --sections gpu ...
# (the peers section's infinity part: carry .peerwhl and .devcarry/minilm-shape instead of .devcarry, and
# DEVICE_MINILM=random; bench/device.sh says how)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${DEVICE_PYTHON:-3.12}
rm -rf .whl && mkdir -p .whl
echo "wheels for Python $PYVER ..."
"$PY" -m pip download -q --disable-pip-version-check --dest .whl --only-binary=:all: --no-deps \
    --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 \
    lmdb==3.0.0 xxhash==3.6.0 grpcio==1.85.3 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 protobuf==7.36.2 \
    cryptography==50.0.2 cffi pycparser pyyaml==6.0.4 httptools==0.9.0 orjson==3.13.0
# (the sdist's metadata is prepared here without build isolation: with this venv's numpy and pybind11)
"$PY" -m pip install -q --disable-pip-version-check pybind11
"$PY" -m pip download -q --disable-pip-version-check --dest .whl --no-binary=:all: --no-deps --no-build-isolation \
    hnswlib==0.8.0
echo "infinity's wheels (the peers section's infinity part; installed there without resolving, over the image's torch and numpy) ..."
rm -rf .peerwhl && mkdir -p .peerwhl
"$PY" -m pip download -q --disable-pip-version-check --dest .peerwhl --only-binary=:all: --no-deps \
    --python-version "$PYVER" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    infinity-emb==0.0.78 sentence-transformers==3.4.1 transformers==4.57.1 tokenizers==0.22.2 \
    huggingface-hub==0.36.2 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 annotated-doc==0.0.7 typing-inspection==0.4.5 uvicorn==0.32.1 orjson==3.13.0 \
    prometheus-fastapi-instrumentator==8.1.0 posthog==7.91.1 backoff==2.2.1 distro==1.9.0 typer==0.12.5 \
    click==8.1.8 rich==13.9.4 python-dotenv==1.2.4 httptools==0.9.0 websockets==17.4 watchfiles==1.3.0 \
    opentelemetry-api==1.45.3
echo "all-MiniLM-L6-v2's shape (config and tokenizer: DEVICE_MINILM=random makes weights there) ..."
rm -rf .devcarry/minilm-shape && mkdir -p .devcarry/minilm-shape
HF_HUB_OFFLINE=1 "$PY" - <<'PY'
import shutil
from pathlib import Path

from server.tools.export_model import default_encoder_dir

source = default_encoder_dir()
for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
    if (source / name).is_file():
        shutil.copy(source / name, Path(".devcarry/minilm-shape") / name)
PY
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
du -sh .whl .peerwhl .devcarry/* infercache/v1 infercache/kserve
