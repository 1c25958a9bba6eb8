"""The rule-reward worker state: decodes responses and scores them against reference answers."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.algorithms.recipes import get_recipe
from rldock.runtime.dock import TransferDock
from rldock.runtime.models.loading import decode_responses, load_tokenizer
from rldock.runtime.rewards import get_reward_fn
from rldock.runtime.workers.stage_loop import run_stage


class RewardWorker:
    def __init__(self, cfg: JobConfig, *, tokenizer_dir: str, dock: TransferDock):
        self.cfg, self.dock = cfg, dock
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.reward_fn = get_reward_fn(cfg.reward.name)
        recipe = get_recipe(cfg.algorithm.name)
        self.shaping = recipe.reward_shaping
        self.consumes = recipe.consumes["reward"]  # dock columns it reads
        self.produces = recipe.produces["reward"]  # "reward" (shaped), and "score" where a filter needs it

    def compute_rewards(self, iteration: int) -> dict:
        rewards: list[float] = []

        def score(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            responses = decode_responses(self.tokenizer, batch["response_ids"], batch["response_mask"])
            answers = decode_responses(self.tokenizer, batch["answer_ids"], batch["answer_mask"])
            values = [self.reward_fn(r, a) for r, a in zip(responses, answers)]
            rewards.extend(values)  # the rule reward, unshaped: what the learning curve shows
            score = torch.tensor(values, dtype=torch.float32)  # (B,) unshaped
            shaped = self.shaping(score, batch["response_mask"].sum(dim=1), self.cfg.algorithm)  # (B,)
            columns = {"reward": shaped, "score": score}
            return TensorDict({name: columns[name] for name in self.produces}, batch_size=[len(indices)])

        timing = run_stage(self.dock, "reward", self.consumes, score, rank=0,
                           batch_size=self.cfg.training.micro_batch_size)
        timing.extra["rewards"] = rewards
        return timing.as_dict()
