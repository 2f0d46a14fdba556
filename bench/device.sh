#!/usr/bin/env bash
# `make bench` on the lent H200 machine (no network there). Run from the repository root through the
# device tool, carrying .whl (wheels the image lacks), .devcarry (fp16 weights: the fp32 file is over
# the carry limit; exported back to an fp32 ONNX graph here) and infercache/v1 (generated stubs).
# Notes of each run: bench/DEVICE_NOTES.md.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python3 - <<'PY'
from pathlib import Path
from server.export_model import export_sentence_encoder
export_sentence_encoder(Path(".devcarry/minilm-fp16"), Path("models/minilm/1"), 256)
PY
echo "cores: $(nproc)"; nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -m bench --out "${OUT:-bench/results}/foundation-device.json" "$@"
