"""Fixtures shared by the unit tier."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest


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
