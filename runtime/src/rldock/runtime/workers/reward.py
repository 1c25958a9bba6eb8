"""The reward worker state: decodes responses and scores them with the configured reward terms.

Each sample's train-file row travels through the dock with its prompt (`prompt_row`, put by the driver,
data/row_column.py): the worker reads its ground truth, data source, extra info, prompt and columns there
and reads no train file itself. A `model` term's scores come precomputed from the reward_model state, as
the dock's `rm_score` column.

Where the recipe fuses the advantage into this state (unless JobConfig.ablations turns it off: GRPO,
DAPO), the worker takes whole prompt groups, runs the recipe's advantage stage on the rewards it
just computed and writes the advantages in the same dock write: the separate advantage state would
do the same arithmetic on the same rewards after two more Ray round trips.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.agent.trajectory import is_trajectory, reward_views
from rldock.runtime.algorithms.episode_rows import episode_heads, to_rows
from rldock.runtime.data import Row
from rldock.runtime.data.row_column import rows_from_column
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult, run_stage
from rldock.runtime.flow.columns import EPISODE, PROMPT_ROW
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import REWARD_STATE, StageCall
from rldock.runtime.models.loading import decode_responses, load_tokenizer
from rldock.runtime.rewards import RewardMetrics, RewardScorer, column_lists
from rldock.runtime.workers.advantage import advantage_batch_size, advantage_generator


class RewardWorker:
    def __init__(self, cfg: JobConfig, *, recipe: Recipe, tokenizer_dir: str, banks: DockBanks):
        self.cfg, self.banks = cfg, banks
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.scorer = RewardScorer(cfg.reward)
        self.follow(recipe)

    def follow(self, recipe: Recipe) -> None:
        """Take what this state reads, computes and writes from `recipe` (the job's, `job_recipe`)."""
        cfg = self.cfg
        self.model_term = cfg.reward.model_term_index  # its scores: the dock's rm_score column
        self.shaping = recipe.reward_shaping
        self.spec = recipe.spec(REWARD_STATE.name)  # the dock columns it reads, as the job runs it
        # "reward" (shaped) where a state reads it, "score" where a filter needs it, "advantage" when fused
        self.produces = self.spec.produces
        # With the advantage fused in: the stage, and requests of whole groups (a baseline needs all N).
        self.advantage_stage = recipe.advantage_stage if recipe.advantage_in_reward else None
        # Where an episode is several rows (`episode`: a harness's segments) it is scored once, so a
        # request holds whole episodes too.
        self.whole_groups = self.advantage_stage is not None or EPISODE[0] in self.spec.consumes
        # whole groups as many as fit a micro-batch; the whole iteration only where a fused advantage
        # needs it (scoring whole episodes does not: REINFORCE++ with segments keeps its pipelining)
        group = cfg.rows_per_group
        self.batch_size = (
            advantage_batch_size(recipe, cfg)
            if self.advantage_stage is not None
            else group * max(1, cfg.training.micro_batch_size // group)
            if self.whole_groups
            else cfg.training.micro_batch_size
        )

    def compute_rewards(self, call: StageCall) -> StageResult:
        metrics = RewardMetrics()

        def score(indices: torch.Tensor, rows_batch: TensorDict) -> TensorDict:
            # an episode of several rows is scored on its first (the segment whose final turn the reward
            # judges), and its reward written on each of its rows
            episode = rows_batch[EPISODE[0]] if EPISODE[0] in rows_batch.keys() else None
            batch = rows_batch if episode is None else rows_batch[episode_heads(episode)]
            rows: list[Row] = rows_from_column(batch[PROMPT_ROW[0]])  # ground truths, data sources, extra infos
            extra_infos = [row.extra_info for row in rows]
            if is_trajectory(batch):  # multi-turn: the final turn is the answer; the rest in extra_info
                responses, trajectories = reward_views(self.tokenizer, batch)
                extra_infos = [{**info, "trajectory": t} for info, t in zip(extra_infos, trajectories)]
            else:
                responses = decode_responses(self.tokenizer, batch["response_ids"], batch["response_mask"])
            precomputed = {} if self.model_term is None else {self.model_term: batch["rm_score"]}
            scored = self.scorer.score(
                responses,
                [row.ground_truth for row in rows],
                [row.data_source for row in rows],
                extra_infos,
                prompts=[row.prompt for row in rows],
                columns=column_lists([row.columns for row in rows]),
                completion_ids=None if is_trajectory(batch) else response_id_lists(batch),
                precomputed=precomputed,
            )
            metrics.add(scored)
            shaped = self.shaping(scored.scores, batch["response_mask"].sum(dim=1), self.cfg.algorithm)  # (B,)
            # score: unshaped, what the driver reads (sample_facts: reward_mean) and DAPO filters on
            columns = {"reward": shaped, "score": scored.scores}
            if episode is not None:
                columns = {name: to_rows(values, episode) for name, values in columns.items()}
            if self.advantage_stage is not None:  # it reads what this state read and wrote
                read: dict[str, torch.Tensor] = {str(name): rows_batch[name] for name in rows_batch.keys()}
                columns.update(
                    self.advantage_stage(
                        {**read, **columns},
                        self.cfg.algorithm,
                        advantage_generator(self.cfg.seed, call.iteration, indices),
                    )
                )
            return TensorDict({name: columns[name] for name in self.produces}, batch_size=[len(indices)])

        timing = run_stage(
            self.banks.bank(call.iteration),
            self.spec,
            score,
            rank=0,
            batch_size=self.batch_size,
            whole_groups=self.whole_groups,
        )
        return timing.with_metrics(reward_metrics=metrics.state())


def response_id_lists(batch: TensorDict) -> list[list[int]]:
    """Each response's token ids without padding."""
    return [ids[mask.bool()].tolist() for ids, mask in zip(batch["response_ids"], batch["response_mask"])]
