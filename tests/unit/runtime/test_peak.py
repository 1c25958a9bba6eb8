"""`rldock bench peak`'s measurement and its cache (runtime/peak.py)."""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rldock.runtime import peak
from rldock.runtime.device import detect_device


def test_a_second_call_reads_the_cache(tmp_path):
    calls = []

    def measure(device, dtype):
        calls.append(dtype)
        return {"peak_flops": 1.0e11, "bandwidth": 2.0e10}

    cpu = detect_device("cpu")
    first = peak.device_rates(cpu, dtype="float32", cache_dir=tmp_path, measure=measure)
    second = peak.device_rates(cpu, dtype="float32", cache_dir=tmp_path, measure=measure)
    assert calls == ["float32"] and (first["cached"], second["cached"]) == (False, True)
    assert {k: v for k, v in first.items() if k != "cached"} == {k: v for k, v in second.items() if k != "cached"}
    assert first["device_kind"] == "cpu" and first["torch"] == torch.__version__ and first["peak_flops"] == 1.0e11
    peak.device_rates(cpu, dtype="bfloat16", cache_dir=tmp_path, measure=measure)  # another key: measured
    assert calls == ["float32", "bfloat16"]
    (cached,) = [p for p in tmp_path.iterdir() if p.name.startswith("cpu-float32-")]
    assert json.loads(cached.read_text())["dtype"] == "float32"


def test_measure_rates_times_a_matmul_and_a_copy_and_keeps_the_thread_count_and_the_rng():
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    rates = peak.measure_rates(detect_device("cpu"), "float32", seconds=0.01, size=64, copy_bytes=1 << 20)
    assert torch.get_num_threads() == threads
    # A cold cache measures in the actor rank: the stream its checkpoint saves (rng.pt) stays as it was.
    assert torch.equal(torch.get_rng_state(), rng)
    # any CPU: more than a megaflop and a megabyte a second, less than a petaflop and a petabyte
    assert 1e6 < rates["peak_flops"] < 1e15 and 1e6 < rates["bandwidth"] < 1e15


def test_bench_peak_prints_the_cached_figures(tmp_path, monkeypatch, capsys):
    from rldock.runtime import cli

    monkeypatch.setenv("RLDOCK_PEAK_CACHE", str(tmp_path))
    monkeypatch.setattr(peak, "measure_rates", lambda device, dtype: {"peak_flops": 3.0, "bandwidth": 4.0})
    assert cli.main(["bench", "peak", "--device", "cpu"]) == 0
    assert cli.main(["bench", "peak", "--device", "cpu"]) == 0
    first, second = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    assert (first["cached"], second["cached"], second["peak_flops"]) == (False, True, 3.0)


def test_an_unwritable_cache_still_gives_the_measurement(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache directory would have to be under a file
    rates = peak.device_rates(
        detect_device("cpu"),
        dtype="float32",
        cache_dir=blocked / "peak",
        measure=lambda device, dtype: {"peak_flops": 1.0, "bandwidth": 2.0},
    )
    assert (rates["peak_flops"], rates["cached"]) == (1.0, False)


def test_the_key_holds_for_any_host_of_the_same_device(tmp_path, monkeypatch):
    """No host name in the key (a pod's is its own): another pod on the same CPU model reads the
    first one's measurement; the CPU's cores are those this process may run on."""
    calls = []

    def measure(device, dtype):
        calls.append(dtype)
        return {"peak_flops": 1.0e11, "bandwidth": 2.0e10}

    cpu = detect_device("cpu")
    monkeypatch.setattr(platform, "node", lambda: "trainer-pod-a")
    peak.device_rates(cpu, dtype="float32", cache_dir=tmp_path, measure=measure)
    monkeypatch.setattr(platform, "node", lambda: "trainer-pod-b")
    assert peak.device_rates(cpu, dtype="float32", cache_dir=tmp_path, measure=measure)["cached"]
    assert calls == ["float32"]
    key = peak.cache_key(cpu, "float32")
    assert set(key) == {"device", "device_kind", "dtype", "torch", "threads"}
    assert key["threads"] == len(os.sched_getaffinity(0))


def test_a_measurement_records_its_load_and_warns_on_a_busy_machine(tmp_path, monkeypatch, caplog):
    cpu = detect_device("cpu")
    cores = len(os.sched_getaffinity(0))
    measure = lambda device, dtype: {"peak_flops": 1.0, "bandwidth": 2.0}  # noqa: E731
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5 * cores, 0.25, 0.125))
    with caplog.at_level(logging.WARNING, logger=peak.__name__):
        quiet = peak.device_rates(cpu, dtype="float32", cache_dir=tmp_path / "quiet", measure=measure)
    assert quiet["loadavg"] == [0.5 * cores, 0.25, 0.125] and not caplog.records
    monkeypatch.setattr(os, "getloadavg", lambda: (cores + 1.0, 1.0, 1.0))
    with caplog.at_level(logging.WARNING, logger=peak.__name__):
        busy = peak.device_rates(cpu, dtype="float32", cache_dir=tmp_path / "busy", measure=measure)
    assert busy["loadavg"][0] == cores + 1.0
    assert len(caplog.records) == 1 and "busy" in caplog.records[0].getMessage()


def test_the_cache_folder_follows_rldock_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("RLDOCK_PEAK_CACHE", raising=False)
    monkeypatch.setenv("RLDOCK_CACHE", str(tmp_path / "cache"))
    assert peak.default_cache_dir() == tmp_path / "cache" / "peak"
    monkeypatch.setenv("RLDOCK_PEAK_CACHE", str(tmp_path / "peak"))
    assert peak.default_cache_dir() == tmp_path / "peak"
    monkeypatch.delenv("RLDOCK_PEAK_CACHE")
    monkeypatch.delenv("RLDOCK_CACHE")
    assert peak.default_cache_dir() == Path.home() / ".cache" / "rldock" / "peak"


def test_test_jobs_read_the_seeded_rates_and_never_measure(seeded_peak_cache):
    """tests/conftest.py's session cache: the CPU's fixed rates in every dtype, in os.environ so a
    subprocess (`rldock train`, the Ray workers it starts) finds them too."""

    def measure(device, dtype):
        raise AssertionError("a test job measured the machine")

    assert peak.default_cache_dir() == seeded_peak_cache != Path.home() / ".cache" / "rldock" / "peak"
    for dtype in ("float32", "bfloat16", "float16"):
        rates = peak.device_rates(detect_device("cpu"), dtype=dtype, measure=measure)
        assert rates["cached"] and rates["peak_flops"] > 0, dtype
    child = subprocess.run(
        [sys.executable, "-c", "from rldock.runtime.peak import default_cache_dir; print(default_cache_dir())"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout.strip() == str(seeded_peak_cache)


def test_a_device_without_a_name_is_unavailable_and_the_actor_says_why(tmp_path, monkeypatch):
    """A backend module without get_device_name (the NPU twin's) cannot key the cache: PeakUnavailable,
    which actor rank 0 hands back as `unavailable` (the trainer then leaves the mfu/ metrics off)."""
    import types

    from rldock.runtime.device import DeviceInfo
    from rldock.runtime.workers.actor import ActorWorker

    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(), raising=False)  # no get_device_name
    npu = DeviceInfo(kind="npu", torch_device="npu:0", backend="hccl")
    with pytest.raises(peak.PeakUnavailable, match="get_device_name"):
        peak.device_rates(npu, dtype="float32", cache_dir=tmp_path)
    actor = ActorWorker.__new__(ActorWorker)
    actor.device = npu
    found = actor.device_rates(["float32"])
    assert found["device_kind"] == "npu" and "get_device_name" in found["unavailable"]
    assert "measured" not in found


def test_bench_peak_on_a_missing_device_names_the_flag(monkeypatch, capsys):
    """One line naming --device and exit 2, no traceback, when the machine lacks the device."""
    from rldock.runtime import cli, device

    monkeypatch.setitem(device._PROBES, "cuda", lambda: False)
    assert cli.main(["bench", "peak", "--device", "cuda"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("error: --device cuda: not available here") and "Traceback" not in captured.err
