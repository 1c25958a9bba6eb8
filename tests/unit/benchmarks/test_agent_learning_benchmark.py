"""The tool-use learning benchmark without running jobs: each arm's overrides make the example a valid job
(the no-tools arm without the agent and the demonstrations), the data it prepares is the example header's,
and the summary reads tool calls, the warm-up's seconds and the margins."""

from __future__ import annotations

from pathlib import Path

import pytest

from rldock.config.loading import load_job_config
from rldock_benchmarks.agent_learning import ARMS, DATA_ARGS, EXAMPLE, arm_overrides, margins, tool_use, warmup_seconds
from rldock_benchmarks.smollm2_learning import job_overrides, report

DATA = {"train": ["/d/train.jsonl"], "val": ["/d/val.jsonl"]}


def _config(arm: str):
    overrides = dict(o.split("=", 1) for o in [*job_overrides(Path("/m/smol"), DATA, iterations=3), *ARMS[arm]])
    # --set reads each value as YAML; these are the only non-strings the arms set.
    parsed = {key: {"null": None, "0": 0, "3": 3}.get(value, value) for key, value in overrides.items()}
    parsed["data.train_files"], parsed["data.val_files"] = DATA["train"], DATA["val"]
    return load_job_config(EXAMPLE, overrides=parsed, check_local=False)


def test_each_arm_is_the_example_with_one_change():
    tools, control, no_tools = _config("tools"), _config("learning_rate_0"), _config("no_tools")
    assert [t.name for t in tools.agent.tools] == ["python"] and tools.data.demonstration_key == "demonstration"
    assert tools.warmup.steps > 0 and tools.algorithm.learning_rate > 0 and tools.evaluation.at_start
    assert control.algorithm.learning_rate == 0 and control.agent == tools.agent
    assert no_tools.agent is None and no_tools.data.demonstration_key is None
    assert no_tools.warmup == tools.warmup and no_tools.algorithm == tools.algorithm
    assert tools.iterations == tools.evaluation.interval == 3


def test_the_benchmark_prepares_the_data_the_example_header_documents():
    header_words = " ".join(EXAMPLE.read_text().replace("\\\n#", " ").split())
    assert f"rldock data generate {' '.join(DATA_ARGS)}" in header_words


def _records(calls: tuple[float, float] | None) -> list[dict]:
    start, end = ({"val/agent/tool_calls_mean": c} if calls else {} for c in (calls or (0, 0)))
    trained = [
        {"iteration": i, "timing": {}, **({"agent": {"tool_calls_mean": i / 4}} if calls else {})} for i in (1, 2)
    ]
    return [{"iteration": 0, "val/accuracy": 0.1, **start}, *trained, {"iteration": 2, "val/accuracy": 0.5, **end}]


def test_tool_use_reads_held_out_and_sampled_calls_and_zeros_without_tools():
    assert tool_use(_records((0.25, 1.0))) == {
        "val_tool_calls_start": 0.25,
        "val_tool_calls_end": 1.0,
        "train_tool_calls_first": 0.25,
        "train_tool_calls_last": 0.5,
    }
    assert set(tool_use(_records(None)).values()) == {0.0}


def test_margins_and_the_warmup_seconds(tmp_path):
    arms = {
        "tools": {"val_accuracy_gain": 0.3, "val_accuracy_end": 0.7},
        "learning_rate_0": {"val_accuracy_gain": 0.0, "val_accuracy_end": 0.4},
        "no_tools": {"val_accuracy_gain": 0.1, "val_accuracy_end": 0.05},
    }
    assert margins(arms) == pytest.approx({"gain_margin_vs_learning_rate_0": 0.3, "final_margin_vs_no_tools": 0.65})
    (tmp_path / "train.log").write_text(
        "x INFO rldock.runtime.driver.warmup: warmup finished: 20 steps in 81.5 s, final loss 0.1\n"
    )
    assert warmup_seconds(tmp_path) == 81.5
    (tmp_path / "train.log").write_text("no warm-up\n")
    assert warmup_seconds(tmp_path) is None


def test_the_control_starts_from_the_tools_arms_warmup_once_that_arm_has_run():
    assert arm_overrides("learning_rate_0", Path("/o"), {}) == ARMS["learning_rate_0"]
    assert arm_overrides("learning_rate_0", Path("/o"), {"tools": {}}) == [
        *ARMS["learning_rate_0"],
        "model.path=/o/tools/warmup",
        "warmup.steps=0",
    ]
    assert arm_overrides("no_tools", Path("/o"), {"tools": {}}) == ARMS["no_tools"]


def test_the_report_names_what_ran_beside_the_results():
    document = report(EXAMPLE, Path("/m"), DATA, ["x=1"], 0.0, {"tools": {"a": 1}, "final_margin_vs_no_tools": 0.5})
    assert document["config"] == str(EXAMPLE) and document["model"] == "/m" and document["overrides"] == ["x=1"]
    assert document["tools"] == {"a": 1} and document["final_margin_vs_no_tools"] == 0.5 and document["seconds"] > 0
