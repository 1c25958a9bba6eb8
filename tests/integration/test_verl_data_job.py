"""verl's preprocessed parquet trains unchanged: chat-message prompts, the answer under
`reward_model.ground_truth`, `data_source` and a nested `extra_info`, read with dotted keys.

A user's reward function scores 1 only when it receives the nested ground truth, the row's data
source and its extra info, so `reward/function` at 1.0 in every iteration shows each key reached
the reward worker as verl's own reward functions would see it. It sits beside two rule terms, each
weighted: every term has its metric (the function's extra key too) and the reward is their
weighted sum.

The same run corrects the train-inference mismatch with TRL's default (algorithm.rollout_correction
preset `trl`, docs/algorithms/rollout-correction.md): its old-logprob pass meets the engine's logprobs
and every record carries the `mismatch/` metrics. It holds the gap to a budget of 1e-20 with action
`correct`: the correction weighs nothing in iteration 1 and is switched on once an iteration passes
the budget, which a float32 engine's kernels against the trainer's pass (measured here: a k3 of
1.5e-14 from logprobs ~1e-7 apart; 0 would need every logprob bit-equal across two kernels)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import jobs  # tests/jobs.py
import pytest

pytestmark = pytest.mark.integration

CHECK_REWARD = textwrap.dedent("""
    def sees_verl_fields(data_source, solution_str, ground_truth, extra_info):
        ok = data_source == "openai/gsm8k" and ground_truth == extra_info["answer"] and extra_info["split"] == "train"
        return {"score": float(ok), "chars": len(solution_str)}
""")
FUNCTION_WEIGHT, FORMAT_WEIGHT = 0.5, 0.25


def _verl_rows(count: int) -> list[dict]:
    """Rows in the layout of verl's examples/data_preprocess/gsm8k.py output."""
    rows = []
    for index in range(count):
        a, b = index % 10, (index * 7) % 10
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{a}+{b}="}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": str(a + b)},
                "extra_info": {"split": "train", "index": index, "answer": str(a + b)},
            }
        )
    return rows


def _chat_tiny_model(path: Path, rows: list[dict]) -> None:
    """The tiny model with a chat template (its builder makes none): the messages' contents joined."""
    from transformers import AutoTokenizer

    from rldock.runtime.data import ALPHABET
    from rldock.runtime.models.tiny import build_tiny_model

    build_tiny_model(path, texts=[ALPHABET] + [row["prompt"][0]["content"] for row in rows], seed=5)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    tokenizer.save_pretrained(path)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> jobs.Run:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp_path = tmp_path_factory.mktemp("verl-data")
    rows = _verl_rows(32)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "train.parquet")
    _chat_tiny_model(tmp_path / "model", rows)
    (tmp_path / "check_reward.py").write_text(CHECK_REWARD)
    config = {
        "name": "it-verl-data",
        "seed": 5,
        "iterations": 2,
        "model": {"path": str(tmp_path / "model")},
        "data": {
            "train_files": [str(tmp_path / "train.parquet")],
            "prompt_key": "prompt",
            "answer_key": "reward_model.ground_truth",
            "data_source_key": "data_source",
            "extra_info_key": "extra_info",
            "chat_template": "model",
        },
        "reward": {
            "terms": [
                {"name": "digit_match"},
                {
                    "name": "function",
                    "function": f"{tmp_path}/check_reward.py:sees_verl_fields",
                    "weight": FUNCTION_WEIGHT,
                },
                {"name": "format", "pattern": r"\d+", "weight": FORMAT_WEIGHT},
            ]
        },
        "algorithm": {
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 4,
            "max_prompt_length": 8,
            "max_response_length": 4,
            "learning_rate": 1e-4,
            "rollout_correction": {"preset": "trl"},
        },
        "training": {"data_parallel_size": 1, "micro_batch_size": 8},
        "dock": {"timeout_s": 120},
        "checkpoint": {"interval": 2},
        "monitoring": {"mismatch": {"max_kl": 1e-20, "action": "correct"}},
    }
    return jobs.run(config, tmp_path / "run", max_restarts=None)


def test_every_term_has_its_metric_and_the_reward_is_their_weighted_sum(run):
    records = run.records
    assert len(records) == 2
    for record in records:
        weighted = (
            record["reward/digit_match"]
            + FUNCTION_WEIGHT * record["reward/function"]
            + FORMAT_WEIGHT * record["reward/format"]
        )
        assert record["reward_mean"] == pytest.approx(weighted, abs=1e-5)
        assert record["reward/function/chars"] >= 0 and record["reward/errors"] == 0


def test_a_verl_layout_parquet_trains_with_dotted_keys(run):
    records = run.records
    assert [record["iteration"] for record in records] == [1, 2]
    assert [record["reward/function"] for record in records] == [1.0, 1.0]
    for record in records:
        gap = {key: value for key, value in record.items() if key.startswith("mismatch/")}
        assert set(gap) == {
            f"mismatch/{key}"
            for key in ("kl", "kl_seq", "abs_diff_mean", "abs_diff_max", "seq_ratio_p50", "seq_ratio_p99")
            + ("tokens_weighed_down", "tokens_dropped", "sequences_dropped", "correcting", "tokens")
        }, record
        jobs.check_float32_gap(record)  # a float32 engine and a float32 trainer: their kernels' gap alone
        assert 0 <= gap["mismatch/tokens_dropped"] <= 1 and 0 <= gap["mismatch/sequences_dropped"] <= 1
    # monitoring.mismatch action `correct`: off until an iteration passes the budget, on after it
    assert records[0]["mismatch/kl"] > 1e-20, records[0]
    assert [record["mismatch/correcting"] for record in records] == [0.0, 1.0]
    assert "algorithm.rollout_correction on from iteration 2" in run.stdout + run.stderr
