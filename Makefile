# The two README commands. Both set up the pinned CPU environment first (scripts/setup.sh; a few
# minutes once, then skipped while requirements/cpu.lock is unchanged).
OUTPUT ?= runs/demo
PYTEST_ARGS ?=

.PHONY: setup demo test test-slow crd e2e images test-containers
setup:
	./scripts/setup.sh

# GRPO on the tiny addition model, local Ray with 8 emulated NPUs. Re-running continues an
# interrupted demo from its last checkpoint (and does nothing once it has finished).
demo: setup
	.venv/bin/rldock train examples/grpo-tiny.yaml --output $(OUTPUT) --resume

# The linters first (pyproject.toml configures both), then the tests: the job tiers and, beside
# them, the unit tier, then the npu twin's unit tests in a pytest process of their own; then the unit
# tests that start a Ray of their own (scripts/test-tiers.sh says why). PYTEST_ARGS: pytest options for every run, not paths.
test: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/mypy
	scripts/test-tiers.sh $(PYTEST_ARGS)

# The opt-in slow tests (README.md, the "slow" paragraph): each example's learning against its
# learning-rate-0 control, the examples run as their headers say that `make test` leaves out, the
# planner check at ~110M parameters, and job variants whose path `make test` already runs. About 60 minutes here.
test-slow: setup
	.venv/bin/python -m pytest -m slow $(PYTEST_ARGS)

# Regenerate the RLJob CRD from the operator's models, with the Helm chart's copy of it, the
# RLJob reference and the config reference (tests fail while any of them is stale).
crd: setup
	.venv/bin/python -m rldock.operator.crd > crds/rljobs.rldock.io.yaml
	cp crds/rljobs.rldock.io.yaml helm/rldock/files/rljobs.rldock.io.yaml
	.venv/bin/python -m rldock.operator.rljob_reference > docs/rljob-reference.md
	.venv/bin/python -m rldock.config.config_reference > docs/config-reference.md

# The end-to-end suite alone (also part of `make test`): a real Kubernetes 1.20 control plane built
# once into ~/.cache/rldock (about 12 minutes the first time), emulated Ascend nodes whose pods run
# as local processes, the operator, and real Ray/vLLM jobs; and kind-style nodes (real kubelets and
# containerd in podman containers) running the images below, with the chart installed as a Helm
# release (the kubelet and the images are built on first use, cached). Needs root; see e2e/README.md.
e2e: setup
	.venv/bin/python -m pytest -m e2e tests/e2e $(PYTEST_ARGS)

# The operator and CPU runtime images with podman on a local Debian base (no registry needed),
# cached in ~/.cache/rldock/images by a hash of their inputs (images/README.md). The e2e builds
# them itself when missing.
images:
	images/build.sh --local-base operator runtime-cpu

# The kind-style node tests (real kubelets, containerd, the images above, the chart as a Helm
# release; the happy path, a lost worker pod, an operator restart and suspend/resume in real
# containers). Opt-in: `make test` skips them, since their cold builds add about 45 minutes here
# under load (a fresh machine's run, with its packages (podman, buildah, runc, debootstrap)
# installed by the tests: about 31 minutes at a light load; e2e/README.md, "Real nodes").
test-containers: setup
	RLDOCK_E2E_CONTAINERS=1 .venv/bin/python -m pytest tests/e2e/test_kind_nodes.py tests/e2e/test_helm_release.py tests/e2e/test_kind_scenarios.py $(PYTEST_ARGS)
