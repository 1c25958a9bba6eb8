"""Both reward forms through the reward worker's code path (rows read by the loader, responses
decoded from the dock's token ids, the scorer, the dock write): a TRL-form function gets TRL's
keywords and scores as the same rule in verl's form."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from dock_doubles import EOS, PAD, OneBatchDock, reward_worker_without_files, with_prompt_rows
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.runtime.data import Columns, load_rows
from rldock.runtime.flow.states import StageCall
from rldock.runtime.rewards import RewardError
from rldock.runtime.rewards.function import load_function
from rldock.runtime.workers.reward import RewardWorker

USER_FILE = textwrap.dedent("""
    seen = {}

    def verl_digits(data_source, solution_str, ground_truth, extra_info):
        return float(solution_str.strip() == ground_truth)

    def trl_digits(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, **kwargs)
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [float(text.strip() == str(truth)) for text, truth in zip(texts, answer)]

    def trl_none(completions, **kwargs):
        return [None if c == "77" else 1.0 for c in completions]

    def trl_scalar(completions, **kwargs):
        return 1.0

    def trl_needs(completions, solution):
        return [1.0] * len(completions)

""")


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(USER_FILE)
    return path


def _worker(reference: str, *, on_error: str = "fail") -> RewardWorker:
    cfg = JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        reward={"terms": [{"name": "function", "function": reference}], "on_error": on_error},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 2,
            "max_response_length": 4,
            "learning_rate": 0.0,
        },
    ).with_ablations(fuse_reward_advantage=False)
    return reward_worker_without_files(cfg, rows=[])


def _rows(tmp_path: Path, *, chat: bool):
    train = tmp_path / "train.jsonl"
    prompt = '[{"role": "user", "content": "3+4="}]' if chat else '"3+4="'
    train.write_text(
        f'{{"prompt": {prompt}, "answer": 77, "level": 1}}\n{{"prompt": {prompt}, "answer": 12, "level": 2}}\n'
    )
    return load_rows([train], Columns(prompt="prompt", answer="answer"))


def _rewards(worker: RewardWorker, rows) -> tuple[list[float], dict]:
    """The worker's rewards for four responses "77", "77", "12", "13" to rows 0, 1, 1, 1."""
    response_ids = torch.tensor([[10, 10, EOS], [10, 10, PAD], [4, 5, EOS], [4, 6, EOS]])  # (B, SL)
    response_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    batch = TensorDict(
        {"response_ids": response_ids, "response_mask": response_mask, "prompt_index": torch.tensor([0, 1, 1, 1])},
        batch_size=[4],
    )
    worker.banks = OneBatchDock(with_prompt_rows(batch, rows))
    worker.compute_rewards(StageCall(1))
    return worker.banks.written["score"].tolist(), worker.banks.written


@pytest.mark.parametrize("chat", [False, True])
def test_a_trl_function_scores_as_the_same_rule_in_verls_form_through_the_reward_worker(user_file, tmp_path, chat):
    rows = _rows(tmp_path, chat=chat)
    verl, verl_written = _rewards(_worker(f"{user_file}:verl_digits"), rows)
    trl, trl_written = _rewards(_worker(f"{user_file}:trl_digits"), rows)
    assert verl == trl == [1.0, 0.0, 1.0, 0.0]
    assert torch.equal(verl_written["reward"], trl_written["reward"])
    seen = load_function(f"{user_file}:trl_digits", "test").__globals__["seen"]  # the module the worker imported
    # TRL's keywords: the prompts as stored, the completions (chat prompts: assistant messages), the
    # token ids without padding, every other column of the rows as a list.
    stored = [{"role": "user", "content": "3+4="}] if chat else "3+4="
    assert seen["prompts"] == [stored] * 4
    assert seen["completions"][0] == ([{"role": "assistant", "content": "77"}] if chat else "77")
    assert seen["completion_ids"] == [[10, 10, EOS], [10, 10], [4, 5, EOS], [4, 6, EOS]]
    assert seen["answer"] == [77, 12, 12, 12] and seen["level"] == [1, 2, 2, 2]


def test_a_trl_none_counts_zero_as_in_trls_nansum(user_file, tmp_path):
    rewards, _ = _rewards(_worker(f"{user_file}:trl_none"), _rows(tmp_path, chat=False))
    assert rewards == [0.0, 0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    "name, says",
    [
        ("trl_scalar", "has TRL's form and returned float 1.0; it must return a list"),
        ("trl_needs", "takes ['solution'], which the data rows have no column of (they have: ['answer', 'level'])"),
    ],
)
def test_a_trl_function_that_cannot_fit_the_batch_fails_whatever_on_error_says(user_file, tmp_path, name, says):
    with pytest.raises(RewardError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        _rewards(_worker(f"{user_file}:{name}", on_error="zero"), _rows(tmp_path, chat=False))
