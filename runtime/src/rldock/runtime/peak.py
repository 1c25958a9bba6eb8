"""A device's peak matmul FLOP/s and memory bandwidth, measured once per machine and cached: the
denominators of the `mfu/<stage>` and `mbu/rollout` metrics (driver/utilisation.py) when the config sets
none (resources.peak_tflops, resources.memory_bandwidth_gbps), and what `rldock bench peak` prints.

The peak is the best of timed square matmuls in the dtype (what a dense model's FLOPs run as), the
bandwidth the best of timed copies of a 256 MiB tensor (a read and a write per byte). On a CPU both
use every core this process may run on, whatever thread budget it runs under, since the `mfu/`
metrics of a CPU job compare each stage with the whole CPU. The cache, one JSON file per (device
name and kind, dtype, torch version, CPU cores) under `default_cache_dir()`, keeps a job from measuring
again: no host name in the key, so every pod of a node pool shares a measurement baked into an image
or a volume. A measurement records the load average it ran under and warns when the machine was
busy (above one runnable process per core), since a busy machine's figures are cached as they are.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from rldock.runtime.device import DeviceInfo
from rldock.runtime.models.loading import DTYPES

logger = logging.getLogger(__name__)

MATMUL_SIZE = 2048  # 17 GFLOP a matmul: long enough to time on a CPU, short on an accelerator
COPY_BYTES = 256 << 20
MEASURE_SECONDS = 1.0  # per rate, after one warm-up


def _processor() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


class PeakUnavailable(Exception):
    """The device cannot be measured here (no name to key the cache by)."""


def _device_name(device: DeviceInfo) -> str:
    if device.kind == "cpu":
        return _processor()
    get_name = getattr(getattr(torch, device.kind, None), "get_device_name", None)
    if get_name is None:  # a backend without one (the NPU twin's torch.npu)
        raise PeakUnavailable(f"torch.{device.kind} has no get_device_name to key the peak cache by")
    return str(get_name(torch.device(device.torch_device)))


def default_cache_dir() -> Path:
    """$RLDOCK_PEAK_CACHE, else ${RLDOCK_CACHE:-~/.cache/rldock}/peak (the repo's other caches' root;
    the tests point RLDOCK_PEAK_CACHE alone elsewhere, which leaves the shared build caches be)."""
    if os.environ.get("RLDOCK_PEAK_CACHE"):
        return Path(os.environ["RLDOCK_PEAK_CACHE"])
    return Path(os.environ.get("RLDOCK_CACHE", Path.home() / ".cache" / "rldock")) / "peak"


def _cores() -> int:
    """The cores this process may run on (its CPU affinity: a container's cpuset), not the machine's."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cache_key(device: DeviceInfo, dtype: str) -> dict[str, str | int]:
    """What a measurement holds for: the device's name and kind, the dtype, torch's version and (CPU)
    the cores it used."""
    return {
        "device": _device_name(device),
        "device_kind": device.kind,
        "dtype": dtype,
        "torch": torch.__version__,
        "threads": _cores() if device.kind == "cpu" else 0,
    }


def cache_file(key: dict[str, str | int], cache_dir: Path | None = None) -> Path:
    """The cache's file for `key` under `cache_dir` (default `default_cache_dir()`)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (cache_dir or default_cache_dir()).expanduser() / f"{key['device_kind']}-{key['dtype']}-{digest}.json"


@contextlib.contextmanager
def _all_cores(device: DeviceInfo) -> Iterator[None]:
    """Every core for the measurement on a CPU, the process's own thread count restored after."""
    threads = torch.get_num_threads()
    if device.kind == "cpu":
        torch.set_num_threads(_cores())
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _best_seconds(run: Callable[[], object], sync: Callable[[], None], budget_s: float) -> float:
    """The shortest time of `run` over repeats within `budget_s` (at least 3), after a warm-up."""
    run()
    sync()
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < 3 or spent < budget_s:
        start = time.perf_counter()
        run()
        sync()
        took = time.perf_counter() - start
        best, spent, repeats = min(best, took), spent + took, repeats + 1
    return best


def _matmul_seconds(
    on: torch.device, dtype: torch.dtype, size: int, sync: Callable[[], None], budget_s: float
) -> float:
    # A private generator: measuring (only when the cache has no figures) must not move the caller's
    # stream, the actor rank's that its checkpoint saves (rng.pt), or a cold cache changes a job's draws.
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(on, dtype)  # (size, size)
    b = torch.randn(size, size, generator=generator).to(on, dtype)
    out = torch.empty_like(a)
    return _best_seconds(lambda: torch.mm(a, b, out=out), sync, budget_s)


def _copy_seconds(on: torch.device, num_bytes: int, sync: Callable[[], None], budget_s: float) -> float:
    source = torch.empty(num_bytes, dtype=torch.uint8, device=on).fill_(1)
    target = torch.empty_like(source)
    return _best_seconds(lambda: target.copy_(source), sync, budget_s)


def measure_rates(
    device: DeviceInfo,
    dtype: str,
    *,
    seconds: float = MEASURE_SECONDS,
    size: int = MATMUL_SIZE,
    copy_bytes: int = COPY_BYTES,
) -> dict[str, float]:
    """`peak_flops` (FLOP/s of a `size` square matmul in `dtype`) and `bandwidth` (bytes/s of
    copying `copy_bytes`) on `device`, each the best over about `seconds`."""
    on = torch.device(device.torch_device)
    sync = (lambda: None) if device.kind == "cpu" else torch.accelerator.synchronize
    with _all_cores(device), torch.no_grad():
        matmul_s = _matmul_seconds(on, DTYPES[dtype], size, sync, seconds)
        copy_s = _copy_seconds(on, copy_bytes, sync, seconds)
    return {"peak_flops": 2.0 * size**3 / matmul_s, "bandwidth": 2.0 * copy_bytes / copy_s}


def device_rates(
    device: DeviceInfo,
    *,
    dtype: str,
    cache_dir: Path | None = None,
    measure: Callable[[DeviceInfo, str], dict[str, float]] | None = None,
) -> dict:
    """The cached measurement of `device` in `dtype` (its `cache_key` fields, `peak_flops`,
    `bandwidth`, `measured_at`, `cached`), measured (default `measure_rates`) and written to the
    cache (default `default_cache_dir()`) when there is none, with the load average it ran under
    (`loadavg`: 1, 5 and 15 minutes)."""
    key = cache_key(device, dtype)
    path = cache_file(key, cache_dir)
    if path.is_file():
        return {**json.loads(path.read_text()), "cached": True}
    logger.info("measuring the peak matmul FLOP/s and memory bandwidth of %s (%s)", key["device"], dtype)
    load = os.getloadavg()  # before: the measurement's own load is not the machine's
    rates = (measure or measure_rates)(device, dtype)
    if load[0] > _cores():
        logger.warning(
            "the machine was busy while measuring its peak (load average %.1f over %d cores): the cached "
            "figures in %s are low; rerun `rldock bench peak --remeasure` on an idle machine",
            load[0],
            _cores(),
            path,
        )
    record = {
        **key,
        **rates,
        "loadavg": list(load),
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as error:  # a read-only home (a pod's): the job goes on with this measurement
        logger.warning("could not cache the measurement in %s (%s); the next job measures again", path, error)
    return {**record, "cached": False}
