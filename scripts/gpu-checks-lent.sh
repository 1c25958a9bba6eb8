#!/bin/bash
# The GPU checks (benchmarks/src/rldock_benchmarks/gpu_checks.py) on a lent machine that has a CUDA torch
# and transformers but no network and none of rldock's other imports (docs/accelerators.md, "What ran
# on an H100").
#
#   scripts/gpu-checks-lent.sh wheels                 # here: the wheels it lacks, at the lock's versions
#   scripts/gpu-checks-lent.sh run [gpu_checks args]  # there, with runs/gpu-wheels carried beside the tree
#
# `run` installs the wheels into a folder of its own (no pip index, no dependency resolution: the machine's
# torch stays), then writes gpu_checks' JSON, its stderr and the machine's versions into $OUT.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=runs/gpu-wheels
PACKAGES=(pydantic pydantic_core annotated-types typing-inspection typing_extensions tensordict orjson cloudpickle pyvers)

pinned() { grep -i "^${1//[-_]/[-_]}==" requirements/cpu.lock; }

case "${1:-}" in
wheels)
    mkdir -p "$WHEELS"
    for package in "${PACKAGES[@]}"; do
        # A compiled wheel for each Python a lent machine may have (a pure one is the same file each time).
        for python in 310 311 312 313; do
            .venv/bin/pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
                --python-version "$python" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
                --platform manylinux_2_28_x86_64 -d "$WHEELS" "$(pinned "$package")"
        done
    done
    du -sh "$WHEELS"
    ;;
run)
    shift
    OUT=${OUT:-/tmp/gpu-checks}
    mkdir -p "$OUT"
    PY=${PY:-$(command -v python3 || command -v python)}
    {
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
        "$PY" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
        "$PY" -c "import transformers, numpy, yaml; print('transformers', transformers.__version__, 'numpy', numpy.__version__)"
    } > "$OUT/env.txt" 2>&1
    deps=$(mktemp -d)
    "$PY" -m pip install --quiet --no-index --no-deps --find-links "$WHEELS" --target "$deps" "${PACKAGES[@]}" >> "$OUT/env.txt" 2>&1
    export PYTHONPATH=$deps:$PWD/api/src:$PWD/runtime/src:$PWD/benchmarks/src:$PWD/operator/src:$PWD/e2e/src
    start=$(date +%s)
    rc=0
    "$PY" -m rldock_benchmarks.gpu_checks "$@" > "$OUT/gpu_checks.json" 2> "$OUT/gpu_checks.err" || rc=$?
    echo "exit $rc after $(($(date +%s) - start)) s" >> "$OUT/env.txt"
    cat "$OUT/env.txt"
    tail -c 2500 "$OUT/gpu_checks.err"
    "$PY" -c "import json, sys; print(json.dumps({k: v.get('ok') for k, v in (json.load(open(sys.argv[1])).get('results') or {}).items()}))" "$OUT/gpu_checks.json"
    exit "$rc"
    ;;
*)
    sed -n '2,10p' "$0"
    exit 2
    ;;
esac
