"""Tool use is learned: examples/agent-smollm2-python.yaml (SmolLM2-135M-Instruct with the python tool on
3-digit sums and products, after a 3-step warm-up on tool-use demonstrations) raises its held-out greedy
accuracy by more than the learning-rate-0 control, and ends above the same job without tools. Runs
benchmarks/src/rldock_benchmarks/agent_learning.py (three jobs one after the other: 47 minutes on 2 cores at load
average 7-12).

Margins, against what was measured once (docs/results.md, "Tool use: SmolLM2-135M-Instruct with the
python tool"): the tools arm rose 0.55 -> 0.80 on 100 held-out prompts, the control 0.55 -> 0.55
(margin 0.25; asserted 0.1), and the job without tools ended at 0.00 (margin 0.80; asserted 0.4). The
asserted margins are well under the measured ones because another CPU or thread count samples other
episodes from the same seed; no bound depends on timing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

GAIN_MARGIN = 0.1  # tools gain - learning-rate-0 gain, held-out accuracy
FINAL_MARGIN = 0.4  # tools final - no-tools final
ROOT = Path(__file__).resolve().parents[2]


def test_rl_with_the_python_tool_beats_the_learning_rate_0_control_and_the_job_without_tools(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "rldock_benchmarks.agent_learning", "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=5400,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    tools, control, no_tools = report["tools"], report["learning_rate_0"], report["no_tools"]
    assert tools["iterations"] == control["iterations"] == no_tools["iterations"] == 6
    assert tools["val_num_prompts"] == 100
    # The warm-up taught the call: every held-out episode calls the tool before RL starts.
    assert tools["val_tool_calls_start"] >= 0.9, report
    # The control's weights do not move: greedy evaluation of the same model gives the same answers.
    assert abs(control["val_accuracy_gain"]) <= 0.02, report
    assert report["gain_margin_vs_learning_rate_0"] >= GAIN_MARGIN, report
    assert report["final_margin_vs_no_tools"] >= FINAL_MARGIN, report
