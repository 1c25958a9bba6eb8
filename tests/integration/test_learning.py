"""Learning is real: each algorithm's demo config raises the reward by at least its stated margin,
the same config with learning rate 0 does not. Runs benchmarks/src/rldock_benchmarks/learning.py (both jobs, about 4
minutes per config on 2 cores when the machine is otherwise idle).

Margins, against what was measured once each (docs/algorithms/, docs/results.md): GRPO rose
+0.423 (margin 0.2); PPO +0.461 (margin 0.25); PF-PPO (best_worst) +0.327 (margin 0.15). The
learning-rate-0 control rose +0.042 for GRPO, PPO and PF-PPO alike: with the policy frozen they
sample the same responses. DAPO rose +0.427 (margin 0.2; its control -0.008). DPO's metric is the
policy's preference accuracy on each iteration's fresh pairs (benchmarks/src/rldock_benchmarks/learning.py picks it):
+0.375 (margin 0.2), its control -0.063 (the base model ranking the same pairs). RLOO rose +0.446,
REINFORCE++ +0.449, REINFORCE++-baseline +0.416, GSPO +0.412 (margin 0.2 each; their controls
+0.042, GRPO's: the frozen policy samples the same responses).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("example", "margin"),
    [
        ("grpo-tiny.yaml", 0.2),
        ("ppo-tiny.yaml", 0.25),
        ("pf-ppo-tiny.yaml", 0.15),
        ("dapo-tiny.yaml", 0.2),
        ("dpo-tiny.yaml", 0.2),
        ("rloo-tiny.yaml", 0.2),
        ("reinforce-plus-plus-tiny.yaml", 0.2),
        ("reinforce-plus-plus-baseline-tiny.yaml", 0.2),
        ("gspo-tiny.yaml", 0.2),
    ],
)
def test_demo_learns_and_the_learning_rate_0_control_does_not(tmp_path, example, margin):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rldock_benchmarks.learning",
            str(ROOT / "examples" / example),
            "--output",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    trained, control = report["trained"], report["learning_rate_0"]
    assert trained["iterations"] == control["iterations"] == 40
    assert trained["rise"] >= margin, report
    assert abs(control["rise"]) < 0.1, report
