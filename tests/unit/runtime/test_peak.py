"""`rldock bench peak`'s measurement and its cache (runtime/peak.py)."""

from __future__ import annotations

import json

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


def test_measure_rates_times_a_matmul_and_a_copy_and_keeps_the_thread_count():
    threads = torch.get_num_threads()
    rates = peak.measure_rates(detect_device("cpu"), "float32", seconds=0.01, size=64, copy_bytes=1 << 20)
    assert torch.get_num_threads() == threads
    # any CPU: more than a megaflop and a megabyte a second, less than a petaflop and a petabyte
    assert 1e6 < rates["peak_flops"] < 1e15 and 1e6 < rates["bandwidth"] < 1e15


def test_bench_peak_prints_the_cached_figures(tmp_path, monkeypatch, capsys):
    from rldock.runtime import cli

    monkeypatch.setattr(peak, "CACHE_DIR", tmp_path)
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
