"""The reward worker writes what its recipe produces: the shaped reward, and for DAPO also the
unshaped score that dynamic sampling filters on."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.runtime.algorithms.recipes import get_recipe
from rldock.runtime.rewards import get_reward_fn
from rldock.runtime.workers.reward import RewardWorker

EOS, PAD = 1, 0


class DigitTokenizer:
    """Test double: ids 3-12 are the digits 0-9, 1 is EOS."""

    eos_token_id, pad_token_id = EOS, PAD

    def decode(self, tokens, skip_special_tokens=True):
        return "".join(str(t - 3) for t in tokens if t >= 3)


class OneBatchDock:
    """Test double of TransferDock: hands the whole batch out once, records what is put."""

    def __init__(self, batch: TensorDict):
        self.batch, self.given, self.waited_s, self.written = batch, False, 0.0, None
        self.drained = False  # never says so: the consumer asks until it hears None

    def get(self, state, columns, **kwargs):
        if self.given:
            return None
        self.given = True
        return torch.arange(len(self.batch)), self.batch.select(*columns)

    def put(self, indices, out, *, policy_version=None):
        self.written = out


def _worker(name: str, dock) -> RewardWorker:
    cfg = JobConfig(iterations=1, model={"path": "/nonexistent"}, reward={"name": "exact_match"},
                    algorithm={"name": name, "num_prompts_per_iteration": 1, "num_responses_per_prompt": 2,
                               "max_prompt_length": 2, "max_response_length": 4, "learning_rate": 0.0,
                               "dapo": {"overlong_buffer_length": 2, "overlong_penalty_factor": 1.0}})
    recipe = get_recipe(name)
    worker = RewardWorker.__new__(RewardWorker)  # no tokenizer files: a test double instead
    worker.cfg, worker.dock, worker.tokenizer = cfg, dock, DigitTokenizer()
    worker.reward_fn, worker.shaping = get_reward_fn("exact_match"), recipe.reward_shaping
    worker.consumes, worker.produces = recipe.consumes["reward"], recipe.produces["reward"]
    return worker


@pytest.mark.parametrize("name, columns", [("dapo", {"reward", "score"}), ("grpo", {"reward"})])
def test_reward_worker_writes_the_shaped_reward_and_where_needed_the_score(name, columns):
    # Two correct answers "77": one of 2 tokens, one of 3 (with EOS), 1 token into the overlong buffer.
    response_ids = torch.tensor([[10, 10, PAD, PAD], [10, 10, EOS, PAD]])  # (B, SL)
    response_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])
    batch = TensorDict({"response_ids": response_ids, "response_mask": response_mask,
                        "answer_ids": torch.tensor([[10, 10], [10, 10]]),
                        "answer_mask": torch.tensor([[1, 1], [1, 1]])}, batch_size=[2])
    dock = OneBatchDock(batch)
    _worker(name, dock).compute_rewards(iteration=1)
    assert set(dock.written.keys()) == columns
    if name == "dapo":
        assert dock.written["score"].tolist() == [1.0, 1.0]  # equally correct: not informative
        assert dock.written["reward"].tolist() == [1.0, 0.5]  # shaped: they differ
