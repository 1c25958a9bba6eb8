"""Fixtures shared by every test against the local Kubernetes control plane (e2e/controlplane).

`control_plane` is ONE ControlPlane for the whole session, used by tests/e2e and
tests/integration/test_operator.py alike; it starts on first use, so a unit-test run never pays
for it. Tests isolate themselves with the `namespace` fixture and their own uniquely named nodes,
which they delete again (`emulated_nodes`): nodes are cluster-scoped, and a node left behind would
let the scheduler place a later test's pods where nothing runs them. On a machine without the
cached binaries the first use builds them (~12 minutes cold); set RLDOCK_E2E_BUILD=0 to skip
instead.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# OpenMP threads that sleep while they wait instead of spinning, in this process and the processes it
# starts with os.environ (`rldock train`, its local Ray workers; not the e2e pods, which get their image's
# environment as a container would). Set here, before anything imports torch, because libgomp reads it
# once, when torch loads it. torch's two threads spin at each parallel region's barrier; on two cores that
# another process keeps busy, each barrier then waits for a thread the kernel has descheduled (e2e/README.md,
# "Test tiers", gives what it cost). A value the caller set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Ray's raylet starts every worker at niceness 15 (so that it and the GCS win the CPU over them): with any
# other process busy on the machine, a job's workers then get about 1/28 of a core against each process at
# niceness 0 (CFS weights 36 and 1024), and a test waits on them. The suite's Ray clusters (the integration
# tier's shared head, the local ones of the unit tests and of `rldock train`) inherit this instead. A value
# the caller set wins; e2e pods get their image's environment.
os.environ.setdefault("RAY_worker_niceness", "0")

from rldock_e2e.controlplane import (
    BinariesUnavailable,
    ControlPlane,
    find_binaries,
    pid_alive,
)
from rldock_e2e.controlplane.crds import KUBERAY_CRD_DIR
from rldock_e2e.repo import REPO_ROOT, require_kuberay_crds

RLJOB_CRD = REPO_ROOT / "crds" / "rljobs.rldock.io.yaml"


# What every test job reads as the CPU's peak in each dtype (runtime/peak.py's cache, seeded below):
# fixed figures, so no job measures the machine the suite is loading, and the user's own cache
# (~/.cache/rldock/peak) is never written. The peak tests measure in tmp folders of their own.
TEST_PEAK_FLOPS = 1.0e11
TEST_BANDWIDTH = 1.0e10
_PEAK_CACHE = pytest.StashKey[tuple[Path, pytest.MonkeyPatch]]()


def _seed_peak_cache(config: pytest.Config) -> None:
    """RLDOCK_PEAK_CACHE at a folder of this run holding the CPU's fixed rates, set in os.environ so
    the `rldock train` subprocesses and the Ray workers they start inherit it. Set at configure time,
    not by a fixture: the integration tier's shared Ray head starts in a hook before any fixture of
    its first test, and its workers keep the environment the head started with (a session fixture
    came too late when that tier ran first, and its jobs measured the machine into ~/.cache). Only
    the peak cache moves: RLDOCK_CACHE, the root of the shared build caches, stays as it is."""
    from rldock.runtime.device import detect_device
    from rldock.runtime.peak import device_rates

    folder = Path(tempfile.mkdtemp(prefix="rldock-peak-cache-"))
    cpu = detect_device("cpu")
    for dtype in ("float32", "bfloat16", "float16"):
        device_rates(
            cpu,
            dtype=dtype,
            cache_dir=folder,
            measure=lambda device, dtype: {"peak_flops": TEST_PEAK_FLOPS, "bandwidth": TEST_BANDWIDTH},
        )
    environment = pytest.MonkeyPatch()
    environment.setenv("RLDOCK_PEAK_CACHE", str(folder))
    config.stash[_PEAK_CACHE] = (folder, environment)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _PEAK_CACHE in config.stash:
        folder, environment = config.stash[_PEAK_CACHE]
        environment.undo()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def seeded_peak_cache(pytestconfig: pytest.Config) -> Path:
    """The folder RLDOCK_PEAK_CACHE names for the whole run (`_seed_peak_cache`)."""
    return pytestconfig.stash[_PEAK_CACHE][0]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: against a real local Kubernetes control plane (built once, ~12 min cold)")
    # The kubeconfig skips TLS verification of the throwaway self-signed serving certificate.
    config.addinivalue_line("filterwarnings", "ignore::urllib3.exceptions.InsecureRequestWarning")
    _seed_peak_cache(config)


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """A running control plane; its logs stay in pytest's tmp folder (controlplane*/logs)."""
    try:
        find_binaries(build=os.environ.get("RLDOCK_E2E_BUILD", "1") != "0")
    except BinariesUnavailable as error:
        pytest.skip(f"no Kubernetes control-plane binaries and they cannot be built here: {error}")
    plane = ControlPlane(workdir=tmp_path_factory.mktemp("controlplane"))
    with plane:
        pids = plane.pids
        yield plane
    left = {name: pid for name, pid in pids.items() if pid_alive(pid)}
    assert not left, f"control-plane processes still running after stop: {left}"


@pytest.fixture(scope="session")
def kuberay_crds(control_plane: ControlPlane) -> list[str]:
    """KubeRay's real RayCluster/RayJob CRDs from ../shared/kuberay, installed once."""
    require_kuberay_crds(KUBERAY_CRD_DIR)
    return control_plane.install_kuberay_crds(KUBERAY_CRD_DIR)


@pytest.fixture(scope="session")
def rljob_crd(control_plane: ControlPlane) -> list[str]:
    """The project's generated RLJob CRD, installed once."""
    return control_plane.install_crd(RLJOB_CRD)


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace, ready for pods; deleted afterwards without waiting."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    control_plane.create_namespace(name)
    yield name
    # No kubelet confirms graceful deletion of bound pods, so they are removed forcibly.
    control_plane.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", check=False)
    control_plane.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def emulated_nodes(control_plane: ControlPlane) -> Iterator[Callable[..., dict]]:
    """`make(name, **create_node_kwargs)`: an emulated node that is deleted after the test."""
    made: list[str] = []

    def make(name: str, **kwargs) -> dict:
        made.append(name)
        return control_plane.create_node(name, **kwargs)

    yield make
    if made:
        control_plane.kubectl("delete", "nodes", *made, "--wait=false", check=False)


TWIN_TESTS = "tests/unit/runtime/twin/"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The npu twin's unit tests run in a pytest process of their own (`make test` starts one): torch's
    autograd engine sizes its per-device queues once per process, at the first backward, from the
    devices registered then, so after an earlier test's CPU backward a backward on npu:N trips an
    internal assert; and the twin, once installed, stays for the rest of the process."""
    twin = [item for item in items if item.nodeid.startswith(TWIN_TESTS)]
    if not twin or len(twin) == len(items):
        return
    skip = pytest.mark.skip(
        reason=f"the npu twin's tests run in a process of their own: "
        f"`python -m pytest {TWIN_TESTS}` (as `make test` does)"
    )
    for item in twin:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def npu_twin():
    """`torch.npu`, the npu twin's (docs/accelerators.md): built once per machine into the cache
    (about 30 s of CPU time cold), installed once per test process; skips with the reason only
    where no compiler can build it. It stays registered for the rest of the process, where
    `resources.device: auto` still resolves to the CPU (the twin answers only an explicit `npu`)."""
    from rldock_e2e.doubles.npu_twin import TwinUnavailable, activate

    try:
        activate()
    except TwinUnavailable as error:
        pytest.skip(str(error))
    import torch

    return torch.npu
