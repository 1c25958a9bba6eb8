# syntax=docker/dockerfile:1
# The operator image (ghcr.io/rldock/rldock-operator): the job API and the operator only, i.e.
# `pip install .[operator]` (pydantic, kopf, the Kubernetes client); no torch, Ray or vLLM, which the
# operator never imports (tests/unit/operator/test_imports.py). About 150 MB.
# Build from the repository root: images/build.sh operator
# BASE_IMAGE: any Debian bookworm with python3.11 and venv; images/build.sh --local-base passes a
# local debootstrap one (images/local-base.sh) where no registry is reachable.
ARG BASE_IMAGE=python:3.11.7-slim-bookworm
FROM ${BASE_IMAGE}

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/rldock \
    PATH=/opt/rldock/bin:$PATH

# A venv: Debian's own python3 refuses pip installs outside one (externally managed).
RUN python3 -m venv /opt/rldock

WORKDIR /src
COPY pyproject.toml README.md ./
COPY requirements/cpu.lock requirements/cpu.lock
# The job API and the operator's source trees only: the runtime's (runtime/src) stays out.
COPY api/src/ api/src/
COPY operator/src/ operator/src/
# Every version comes from the lock: the resolver picks only what `.[operator]` needs, each at the
# version the tests ran with. setuptools (the build backend) is pinned the same way.
RUN pip install --constraint requirements/cpu.lock setuptools \
    && pip install --no-build-isolation --constraint requirements/cpu.lock ".[operator]" \
    && rm -rf /src

# A numeric non-root user, so that the chart's runAsNonRoot can be checked by the kubelet.
RUN useradd --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin rldock
USER 10001:10001
WORKDIR /
ENTRYPOINT ["python", "-m", "rldock.operator"]
