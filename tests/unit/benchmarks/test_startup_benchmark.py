"""rldock_benchmarks.startup's measure: processes classified by kind from their titles, a process
tree's CPU sampled from outside, medians per variant. (The whole benchmark starts real jobs: its
figures are in docs/results.md, "Starting a job".)"""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from rldock_benchmarks.startup import IDLE_WORKERS, RAY_SYSTEM, TreeSampler, process_kind, summary


@pytest.mark.parametrize(
    ("cmdline", "is_driver", "kind"),
    [
        (["python", "-m", "rldock.runtime.cli", "train"], True, "driver"),
        (["ray::DeviceWorker.call"], False, "DeviceWorker"),
        (["ray::RewardWorker"], False, "RewardWorker"),
        (["ray::IDLE"], False, IDLE_WORKERS),
        (["/venv/lib/python3.11/site-packages/ray/core/src/ray/gcs/gcs_server", "--port=0"], False, RAY_SYSTEM),
        ([], False, RAY_SYSTEM),
    ],
)
def test_a_process_counts_under_its_kind(cmdline, is_driver, kind):
    assert process_kind(cmdline, is_driver=is_driver) == kind


def test_the_sampler_counts_a_tree_s_cpu_dead_children_included():
    """A child that spins for 0.3 s of CPU and exits still counts with what it used when last seen."""
    spin = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\ntime.sleep(0.3)"
    parent = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {spin!r}])"]
    )
    sampler = TreeSampler(psutil.Process(parent.pid))
    while parent.poll() is None:
        sampler.sample()
        time.sleep(0.05)
    kinds = sampler.by_kind()
    assert kinds["driver"]["processes"] == 1 and kinds[RAY_SYSTEM]["processes"] == 1  # the child is no Ray actor
    assert kinds[RAY_SYSTEM]["cpu_s"] >= 0.25


def test_medians_per_variant():
    runs = [
        {"first_record_s": s, "cpu_s": c, "kinds": {"driver": {"processes": 1, "cpu_s": d}}, "timing_startup": None}
        for s, c, d in [(30.0, 50.0, 10.0), (20.0, 40.0, 8.0), (25.0, 60.0, 9.0)]
    ]
    report = summary(runs)
    assert report["first_record_s"] == 25.0 and report["cpu_s"] == 50.0
    assert report["cpu_s_by_kind"] == {"driver": 9.0} and report["processes_by_kind"] == {"driver": 1}
