"""Learning is real: the demo config raises the reward by >= 0.2, the same config with learning
rate 0 does not. Runs benchmarks/learning.py (both jobs, about 4 minutes on 2 cores)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_demo_learns_and_the_learning_rate_0_control_does_not(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "learning.py"), str(ROOT / "examples" / "grpo-tiny.yaml"),
         "--output", str(tmp_path)],
        capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    trained, control = report["trained"], report["learning_rate_0"]
    assert trained["iterations"] == control["iterations"] == 40
    assert trained["rise"] >= 0.2, report
    assert abs(control["rise"]) < 0.1, report
