"""The reward-model worker: decodes prompt + response with the policy's tokenizer, scores the text
with the reward model's own tokenizer and classifier, and writes rm_score (B,) to the dock."""

from __future__ import annotations

import torch
from dock_doubles import OneBatchDock
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import StageCall
from rldock.runtime.models.loading import encode_prompts
from rldock.runtime.models.reward_classifier import load_reward_model
from rldock.runtime.models.tiny import train_char_tokenizer
from rldock.runtime.workers.reward_model import RewardModelWorker, sample_texts

TEXTS = ["3+4=", "12+30=", "7", "42", "abc"]


def _batch(tokenizer) -> TensorDict:
    prompts = encode_prompts(tokenizer, ["3+4=", "12+30="], max_length=8)  # BOS + text, left-padded
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    seven, four, two = (tokenizer.convert_tokens_to_ids(c) for c in "742")
    response_ids = torch.tensor([[seven, eos, pad], [four, two, eos]])  # (B, SL), right-padded
    response_mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    return TensorDict(
        {
            "prompt_ids": prompts.ids,
            "prompt_mask": prompts.mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
        },
        batch_size=[2],
    )


def test_the_reward_model_sees_prompt_text_then_response_text(tmp_path):
    tokenizer = train_char_tokenizer(TEXTS)
    assert sample_texts(tokenizer, _batch(tokenizer)) == ["3+4=7", "12+30=42"]


def test_the_worker_writes_the_reward_models_score_of_each_sample(tmp_path, tiny_reward_model):
    policy_dir = tmp_path / "policy"
    policy_tokenizer = train_char_tokenizer(TEXTS)
    policy_tokenizer.save_pretrained(policy_dir)
    # Another vocabulary than the policy's (more characters, other ids): the text is re-tokenized.
    rm_dir = tiny_reward_model(tmp_path / "rm", texts=["zyx 0987654321=+ more"])
    cfg = JobConfig(
        iterations=1,
        model={"path": str(policy_dir)},
        resources={"device": "cpu"},
        reward={"terms": [{"name": "digit_match"}, {"name": "model", "path": str(rm_dir)}]},
        algorithm={
            "num_prompts_per_iteration": 1,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 8,
            "max_response_length": 3,
            "learning_rate": 0.0,
        },
    )
    dock = OneBatchDock(_batch(policy_tokenizer))
    worker = RewardModelWorker(cfg, recipe=job_recipe(cfg), tokenizer_dir=str(policy_dir), banks=dock)
    result = worker.compute_scores(StageCall(1))
    assert result.num_samples == 2 and set(dock.written.keys()) == {"rm_score"}
    expected = load_reward_model(rm_dir, dtype="float32", device="cpu", field="f").score(["3+4=7", "12+30=42"])
    assert dock.written["rm_score"].dtype == torch.float32
    torch.testing.assert_close(dock.written["rm_score"], expected)
