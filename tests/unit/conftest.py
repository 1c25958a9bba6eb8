"""Fixtures shared by the unit tier, and its `ray` mark: every test that starts a Ray cluster of its own
is marked (those using `start_local_ray` here, the multi-node modules by their own `pytestmark`), so
that `make test` runs them after the job tiers and not beside them (scripts/test-tiers.sh). A raylet
that does not register with its GCS within Ray's fixed 30 s fails the cluster's start, which a
machine loaded by the job tiers' processes beside it made happen. Run with `-m "not ray"`, a test
that starts Ray in this process without the mark fails saying so."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "start_local_ray" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


def pytest_configure(config: pytest.Config) -> None:
    if "not ray" in (config.getoption("markexpr") or ""):
        import ray

        def unmarked(*args: object, **kwargs: object) -> None:
            raise RuntimeError(
                "this test starts Ray but is not marked `ray`: use the start_local_ray fixture "
                "(tests/unit/conftest.py) or add pytestmark = pytest.mark.ray to its module"
            )

        ray.init = unmarked  # this run's process only: the tests that ask for Ray run in another


@contextlib.contextmanager
def _local_ray(num_cpus: int, resources: dict[str, float] | None = None) -> Iterator[None]:
    import ray

    ray.init(address="local", num_cpus=num_cpus, resources=resources, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def start_local_ray() -> Callable[..., AbstractContextManager[None]]:
    """`with start_local_ray(num_cpus, resources=None):` a fresh one-node Ray of this process, shut
    down on leaving. Each test module that needs Ray enters it from a module-scoped fixture of its
    own, with its own CPUs and custom resources (and whatever it registers around it, such as
    cloudpickle by value).

    address="local" always starts a new cluster: a bare `ray.init()` first joins any cluster whose
    address RAY_ADDRESS or /tmp/ray/ray_current_cluster names, such as the integration tier's
    shared head or a developer's own, where a unit test would see that cluster's CPUs, resources
    and actors instead of its own. Module scope, not function: starting Ray costs seconds, so a
    module's tests share one cluster, and each module still gets its own, with the CPUs and
    resources it asks for, shut down before the next module starts one (one Ray per process)."""
    return _local_ray
