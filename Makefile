# infercache: every target sets itself up (virtualenv, dependencies, stubs, default model).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard protos/infercache/v1/*.proto)
STUBS  := infercache/v1/infercache_pb2.py
MODEL  := models/minilm/1/model.onnx
ARGS   ?=

.PHONY: setup stubs model run test bench clean soak

setup: $(STAMP) $(STUBS) $(MODEL)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[build,prepare,test,tensorrt,eval]'
	touch $@

$(STUBS): $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

stubs: $(STUBS)

$(MODEL): $(STAMP) models/minilm/config.yaml
	HF_HUB_OFFLINE=1 $(VENV)/bin/infercache prepare-model --models-dir models
	touch $@

model: $(MODEL)

run: setup
	$(VENV)/bin/infercache serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(ARGS)

bench: setup
	$(PY) -m bench $(ARGS)

soak: setup
	$(PY) -m bench.soak $(ARGS)

clean:
	rm -rf $(VENV) var build infercache/v1/*_pb2*.py infercache/v1/*_pb2*.pyi models/minilm/1
