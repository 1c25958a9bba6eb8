"""The harness rollout (a job with `agent.harness` or `agent.harness_command`): the user's agent runs each
episode against the rank's gateway (rldock.runtime.gateway), and each episode's last segment becomes its
sample, written when the rank's batch has ended. Held-out evaluation runs the same harness on the held-out
prompts, sampled as the evaluation asks (greedy by default), and answers with each episode's final turn and
its rewards, as the agent rollout's evaluation does.

A sample's row is exactly the ids the engine continued: the segment's prompt in the prompt columns (a
prompt longer than the dock's prompt width continues in the response as context), the sampled turns
trained (`response_mask`), everything else attended only (`response_attention_mask`). Its rewards are
the `environment_rewards` an `environment` reward term aggregates. An episode that opened several segments
(a compacted context, a sub-agent) trains on its last one, whose final turn the reward judges; the others
are counted (`agent/gateway/segments_untrained`), since the dock holds one row per episode.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.agent.episode_metrics import Sums
from rldock.runtime.agent.trajectory import turn_columns, turn_index_from_mask
from rldock.runtime.data import Row, columns_of, load_rows
from rldock.runtime.dock import TransferDock
from rldock.runtime.dock.stage_loop import StageResult
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.gateway.episodes import EpisodeResult, GatewayEpisodes
from rldock.runtime.rollout.agent import episode_keys, episode_stage
from rldock.runtime.rollout.protocol import (
    HeldOutRequest,
    RolloutMode,
    RolloutRequest,
    RolloutSetup,
    unpadded,
)


def task_of(row: Row, prompt_index: int) -> dict:
    """What a harness gets of its episode's data row."""
    return {
        "prompt": row.prompt,
        "ground_truth": row.ground_truth,
        "data_source": row.data_source,
        "extra_info": row.extra_info,
        "prompt_index": prompt_index,
    }


class HarnessRollout(RolloutMode):
    def __init__(self, setup: RolloutSetup, cfg: JobConfig, *, tokenizer, train_files: Sequence[str]):
        self.setup, self.cfg, self.tokenizer = setup, cfg, tokenizer
        self.rows = load_rows(train_files, columns_of(cfg.data))
        self.max_turns = cfg.agent.max_turns if cfg.agent is not None else 1
        self._episodes: GatewayEpisodes | None = None

    def episodes(self, prompt_capacity: int) -> GatewayEpisodes:
        if self._episodes is None:
            self._episodes = GatewayEpisodes(self.cfg, tokenizer=self.tokenizer, prompt_capacity=prompt_capacity)
        return self._episodes

    def generate(self, engine: VllmRolloutEngine, dock: TransferDock, request: RolloutRequest) -> StageResult:
        lengths: list[int] = []
        sums: list[Sums] = []

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            capacity = batch["prompt_ids"].shape[1]
            episodes = self.episodes(capacity)
            indices_list = batch["prompt_index"].tolist()
            results = episodes.run(
                engine,
                tasks=[task_of(self.rows[i], i) for i in indices_list],
                prompts=unpadded(batch["prompt_ids"], batch["prompt_mask"]),
                keys=episode_keys(self.setup, indices, request),
                seed=request.iteration,
            )
            sums.append(result_sums(results, engine_s=episodes.engine_s, wall_s=episodes.wall_s))
            lengths.extend(len(r.row.ids) - r.row.prompt_length for r in results)
            return harness_columns(
                results,
                prompt_capacity=capacity,
                response_capacity=self.setup.max_response_length,
                max_steps=self.max_turns,
                pad_token_id=self.setup.pad_token_id,
                policy_version=request.policy_version,
            )

        return episode_stage(dock, self.setup, rollout, request=request, lengths=lengths, sums=sums)

    def evaluate(self, engine: VllmRolloutEngine, request: HeldOutRequest) -> dict:
        """`num_samples` harness episodes per held-out prompt: `responses` their final turns, `environment_rewards`
        their rewards (what an `environment` term scores), `agent` their metric sums."""
        assert request.tasks is not None, "the evaluator sends each held-out prompt's task"
        k = request.num_samples
        episodes = self.episodes(self.cfg.algorithm.max_prompt_length)
        results = episodes.run(
            engine,
            tasks=[task for task in request.tasks for _ in range(k)],
            prompts=[prompt for prompt in request.prompts for _ in range(k)],
            keys=[key * k + j for key in request.prompt_keys for j in range(k)],
            seed=request.seed,
            greedy=request.greedy,
        )
        finals = [r.final_turn for r in results]
        rewards = [r.rewards for r in results]
        return {
            "responses": [finals[i : i + k] for i in range(0, len(finals), k)],
            "environment_rewards": [rewards[i : i + k] for i in range(0, len(rewards), k)],
            "agent": result_sums(results, engine_s=episodes.engine_s, wall_s=episodes.wall_s),
        }

    def close(self) -> None:
        if self._episodes is not None:
            self._episodes.close()


def result_sums(results: Sequence[EpisodeResult], *, engine_s: float, wall_s: float) -> Sums:
    """The episodes' additive figures (agent/episode_metrics.py's keys; the gateway's own under `counts/gateway/`,
    which the metrics show as `agent/gateway/...`)."""
    sums: dict[str, float | list[float]] = {
        "episodes": float(len(results)),
        "turns": float(sum(r.turns for r in results)),
        "model_tokens": float(sum(sum(r.row.model_mask) for r in results)),
        "response_tokens": float(sum(len(r.row.model_mask) for r in results)),
        "counts/gateway/tool_calls": float(sum(r.tool_calls for r in results)),
        "counts/gateway/segments": float(sum(len(r.segments) for r in results)),
        "counts/gateway/segments_untrained": float(sum(len(r.segments) - 1 for r in results)),
        "counts/gateway/exact_episodes": float(sum(r.exact for r in results)),
        "counts/gateway/inexact_episodes": float(sum(not r.exact for r in results)),
        "counts/gateway/resends": float(sum(r.resends for r in results)),
        "counts/gateway/rerender_drifted": float(sum(bool(r.drift_tokens) for r in results)),
        "counts/gateway/rerender_drift_tokens": float(sum(r.drift_tokens or 0 for r in results)),
        "counts/gateway/engine_s": engine_s,
        "counts/gateway/wall_s": wall_s,
    }
    for result in results:
        sums[f"ended/{result.ended}"] = float(sums.get(f"ended/{result.ended}", 0.0)) + 1  # type: ignore[arg-type]
        for reason in result.segments[1:]:
            key = f"counts/gateway/segment/{reason}"
            sums[key] = float(sums.get(key, 0.0)) + 1  # type: ignore[arg-type]
    return sums


def harness_columns(
    results: Sequence[EpisodeResult],
    *,
    prompt_capacity: int,
    response_capacity: int,
    max_steps: int,
    pad_token_id: int,
    policy_version: int,
) -> TensorDict:
    """The dock's columns of the episodes' rows: the prompt columns too (each row's own prompt, left-padded)."""
    rows = len(results)
    prompt_ids = torch.full((rows, prompt_capacity), pad_token_id, dtype=torch.int64)  # (B, PL)
    prompt_mask = torch.zeros_like(prompt_ids)
    response_ids = torch.full((rows, response_capacity), pad_token_id, dtype=torch.int64)  # (B, SL)
    model_mask = torch.zeros((rows, response_capacity), dtype=torch.int64)  # (B, SL)
    attention = torch.zeros((rows, response_capacity), dtype=torch.int64)  # (B, SL)
    rewards = torch.zeros((rows, max_steps), dtype=torch.float32)  # (B, max_turns)
    steps = torch.zeros((rows,), dtype=torch.int64)
    for i, result in enumerate(results):
        row = result.row
        prompt, response = row.ids[: row.prompt_length], row.ids[row.prompt_length :]
        assert len(response) <= response_capacity, "the gateway bounds each turn by the row's response width"
        if prompt:
            prompt_ids[i, -len(prompt) :] = torch.tensor(prompt, dtype=torch.int64)
            prompt_mask[i, -len(prompt) :] = 1
        response_ids[i, : len(response)] = torch.tensor(response, dtype=torch.int64)
        model_mask[i, : len(response)] = torch.tensor(row.model_mask, dtype=torch.int64)
        attention[i, : len(response)] = 1
        kept = result.rewards[-max_steps:]  # the latest steps where a harness posted more than max_turns
        rewards[i, : len(kept)] = torch.tensor(kept, dtype=torch.float32)
        steps[i] = len(kept)
    return TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": model_mask,
            "response_attention_mask": attention,
            "response_length": attention.sum(dim=1),  # (B,) every token after the prompt
            "policy_version": torch.full((rows,), policy_version, dtype=torch.int64),
            "num_turns": torch.tensor([r.turns for r in results], dtype=torch.int64),
            "num_tool_calls": torch.tensor([r.tool_calls for r in results], dtype=torch.int64),
            "num_tool_errors": torch.zeros((rows,), dtype=torch.int64),
            "environment_rewards": rewards,
            "num_environment_steps": steps,
            # a harness's rewards are the episode's, not a turn's: turn-level credit needs agent.environment
            **turn_columns(
                [turn_index_from_mask(r.row.model_mask) for r in results],
                [[] for _ in results],
                max_response_length=response_capacity,
                max_turns=max_steps,
            ),
        },
        batch_size=[rows],
    )
