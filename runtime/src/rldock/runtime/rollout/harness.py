"""The harness rollout (a job with `agent.harness` or `agent.harness_command`): the user's agent runs each
episode against the rank's gateway (rldock.runtime.gateway), and each episode's last segment becomes its
sample, written when the rank's batch has ended. Held-out evaluation runs the same harness on the held-out
prompts, sampled as the evaluation asks (greedy by default), and answers with each episode's final turn and
its rewards, as the agent rollout's evaluation does.

An episode is S = agent.max_segments consecutive dock rows (JobConfig.rows_per_episode), one per segment
(a compacted context, a sub-agent's prompt, ...: gateway/sessions.py): its last segment first (the one whose
final turn the reward judges; the reward scores that row and writes its reward on every row of the
episode), then its earlier segments in order, then empty rows. A segment's row is exactly the ids the
engine continued: its prompt in the prompt columns (a prompt longer than the dock's prompt width continues
in the response as context), the sampled turns trained (`response_mask`), everything else attended only
(`response_attention_mask`). Every row carries the episode's rewards, the `environment_rewards` an
`environment` reward term aggregates. An episode with more than S segments keeps its last and its first
S - 1 (`agent/gateway/segments_dropped`, by reason under `agent/gateway/segment_dropped/`). An empty row
holds the last segment's prompt and no response: no token of it trains or counts (algorithms/episode_rows.py).

With partial rollout (rollout.partial_rollout resume) the generation that runs ahead of a weight update is the
episodes' first round: each episode samples at most rollout.max_tokens_per_round tokens in it, the turn being
sampled then cut and kept while its harness's request stays open; `finish`, after the update, resumes the cut
turns from their tokens on the new weights and serves every turn to the episodes' ends (gateway/server.py,
"Rounds": the native loop's cut and resume, chat/cut_turns.py). A batch with an episode left running is written
once all have ended, each row tagged with the version of the first round and each token with its own
(`token_policy_version`), with its sampling logprob (`sampled_logprobs`), so the update's importance
correction reads them as it reads the native loop's. Nothing is dropped and the second round starts no
episode.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.agent.episode_metrics import Sums
from rldock.runtime.data import Row
from rldock.runtime.data.row_column import rows_from_column
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.flow.columns import PROMPT_ROW
from rldock.runtime.gateway.episodes import EpisodeResult, GatewayEpisodes, HarnessBatch
from rldock.runtime.gateway.sessions import SegmentRow
from rldock.runtime.rollout.episode_rounds import EpisodeRounds, Written, episode_keys
from rldock.runtime.rollout.protocol import (
    HeldOutRequest,
    RolloutRequest,
    RolloutSetup,
    unpadded,
)
from rldock.runtime.rollout.trajectory_rows import Trajectory, trajectory_columns


def task_of(row: Row, prompt_index: int) -> dict:
    """What a harness gets of its episode's data row."""
    return {
        "prompt": row.prompt,
        "ground_truth": row.ground_truth,
        "data_source": row.data_source,
        "extra_info": row.extra_info,
        "prompt_index": prompt_index,
    }


@dataclass
class RunningHarnesses:
    """A dock batch's harness episodes across rounds, with the dock's prompt width their rows are cut to."""

    batch: HarnessBatch
    prompt_capacity: int


class HarnessRollout(EpisodeRounds):
    """A user's harness through the gateway as an episode source (rollout/episode_rounds.py holds the rounds)."""

    def __init__(self, setup: RolloutSetup, cfg: JobConfig, *, tokenizer):
        super().__init__(setup)
        self.cfg, self.tokenizer = cfg, tokenizer
        self.max_turns = cfg.agent.max_turns if cfg.agent is not None else 1
        self.engine_columns = setup.engine_columns
        self._episodes: GatewayEpisodes | None = None

    def episodes(self, prompt_capacity: int) -> GatewayEpisodes:
        if self._episodes is None:
            self._episodes = GatewayEpisodes(
                self.cfg,
                tokenizer=self.tokenizer,
                prompt_capacity=prompt_capacity,
                keep_logprobs=self.setup.keeps_logprobs,
            )
        return self._episodes

    def start(
        self, engine: VllmRolloutEngine, indices: torch.Tensor, batch: TensorDict, request: RolloutRequest
    ) -> RunningHarnesses:
        capacity = batch["prompt_ids"].shape[1]
        per_episode = self.setup.rows_per_episode  # an episode's rows, consecutive: its first stands for it
        firsts = batch[::per_episode]
        running = self.episodes(capacity).start(
            tasks=[
                task_of(row, index)
                for row, index in zip(rows_from_column(firsts[PROMPT_ROW[0]]), firsts["prompt_index"].tolist())
            ],
            prompts=unpadded(firsts["prompt_ids"], firsts["prompt_mask"]),
            keys=episode_keys(self.setup, indices[::per_episode] // per_episode, request),
            seed=request.iteration,
        )
        return RunningHarnesses(running, capacity)

    def advance(
        self,
        engine: VllmRolloutEngine,
        episodes: RunningHarnesses,
        *,
        policy_version: int,
        round_tokens: int | None = None,
    ) -> bool:
        """A round's turns served (cut turns resumed from their tokens) until every episode ended or sampled
        `round_tokens`."""
        return self.episodes(episodes.prompt_capacity).advance(
            engine, episodes.batch, policy_version=policy_version, round_tokens=round_tokens
        )

    def running(self, episodes: RunningHarnesses) -> Collection[int]:
        return episodes.batch.unfinished

    def sampled_tokens(self, episodes: RunningHarnesses, keys: Collection[int]) -> int:
        return sum(budget.sampled.get(key, 0) for budget in episodes.batch.rounds for key in keys)

    def columns(self, engine: VllmRolloutEngine, episodes: RunningHarnesses, *, policy_version: int) -> Written:
        """An ended batch's dock columns (each row's `policy_version` the oldest that sampled it), metric sums
        and response lengths (every token after each episode's last segment's prompt)."""
        gateway = self.episodes(episodes.prompt_capacity)
        per_episode = self.setup.rows_per_episode
        results = gateway.results(engine, episodes.batch)
        sums = result_sums(results, engine_s=gateway.engine_s, wall_s=gateway.wall_s, rows_per_episode=per_episode)
        columns = harness_columns(
            results,
            rows_per_episode=per_episode,
            prompt_capacity=episodes.prompt_capacity,
            response_capacity=self.setup.max_response_length,
            max_steps=self.max_turns,
            pad_token_id=self.setup.pad_token_id,
            policy_version=policy_version,
            engine_columns=self.engine_columns,
        )
        return columns, sums, [len(r.row.ids) - r.row.prompt_length for r in results]

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


def kept_segments(result: EpisodeResult, rows_per_episode: int) -> tuple[list[int], list[int]]:
    """(the episode's segments for the dock, at most `rows_per_episode`: its last, then its earliest ones in
    order; the segments past that bound), as indices of `result.rows`."""
    earlier = list(range(len(result.rows) - 1))
    return [len(result.rows) - 1, *earlier[: rows_per_episode - 1]], earlier[rows_per_episode - 1 :]


def segment_turn_columns(result: EpisodeResult, segment: int, *, max_steps: int) -> tuple[list[int], list[float]]:
    """A segment's turn columns (rldock.runtime.agent.trajectory.turn_columns): per response token its model
    turn, and per turn the rewards the harness posted after it, of the latest `max_steps` rewards that the
    episode keeps (`environment_rewards`). A segment's turns past `max_steps` count as its last column's."""
    last = max_steps - 1
    turn_index = [min(turn, last) for turn in result.rows[segment].turn_index]
    per_turn = [0.0] * (max(turn_index, default=-1) + 1)
    for reward, place in list(zip(result.rewards, result.reward_turns))[-max_steps:]:
        if place is not None and place[0] == segment:
            per_turn[min(place[1], last)] += reward
    return turn_index, per_turn


def result_sums(
    results: Sequence[EpisodeResult], *, engine_s: float, wall_s: float, rows_per_episode: int | None = None
) -> Sums:
    """The episodes' additive figures (agent/episode_metrics.py's keys; the gateway's own under `counts/gateway/`,
    which the metrics show as `agent/gateway/...`); with `rows_per_episode` (a rollout's, not an evaluation's)
    the segments it leaves out of the dock, in all and by reason."""
    sums: dict[str, float | list[float]] = {
        "episodes": float(len(results)),
        "turns": float(sum(r.turns for r in results)),
        "model_tokens": float(sum(sum(row.model_mask) for r in results for row in r.rows)),
        "response_tokens": float(sum(len(row.model_mask) for r in results for row in r.rows)),
        "counts/gateway/tool_calls": float(sum(r.tool_calls for r in results)),
        "counts/gateway/segments": float(sum(len(r.segments) for r in results)),
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
    if rows_per_episode is not None:
        dropped = [
            result.rows[segment].reason for result in results for segment in kept_segments(result, rows_per_episode)[1]
        ]
        sums["counts/gateway/segments_dropped"] = float(len(dropped))
        for reason in dropped:
            key = f"counts/gateway/segment_dropped/{reason}"
            sums[key] = float(sums.get(key, 0.0)) + 1  # type: ignore[arg-type]
    return sums


def harness_columns(
    results: Sequence[EpisodeResult],
    *,
    rows_per_episode: int = 1,
    prompt_capacity: int,
    response_capacity: int,
    max_steps: int,
    pad_token_id: int,
    policy_version: int,
    engine_columns: Sequence[str] = (),
) -> TensorDict:
    """The dock's columns of the episodes' rows, `rows_per_episode` per episode (module docstring;
    rollout/trajectory_rows.py's writer): the prompt columns too (each row's own prompt, left-padded); every
    row carries its episode's counts and rewards. With those of each token's version and sampling logprob
    named in `engine_columns` (AGENT_PARTIAL_ROLLOUT)."""
    return trajectory_columns(
        [row for result in results for row in segment_trajectories(result, rows_per_episode, max_steps=max_steps)],
        max_response_length=response_capacity,
        max_turns=max_steps,
        pad_token_id=pad_token_id,
        policy_version=policy_version,
        engine_columns=engine_columns,
        prompt_capacity=prompt_capacity,
    )


def segment_trajectories(result: EpisodeResult, rows_per_episode: int, *, max_steps: int) -> list[Trajectory]:
    """An episode's `rows_per_episode` dock rows (module docstring): its kept segments, then empty rows that
    hold the last segment's prompt; each with the episode's counts and its latest `max_steps` rewards."""
    kept, _ = kept_segments(result, rows_per_episode)
    kept_rewards = result.rewards[-max_steps:]  # the latest steps where a harness posted more than max_turns
    rows = []
    for j in range(rows_per_episode):
        if j < len(kept):
            row = result.rows[kept[j]]
            turns, per_turn = segment_turn_columns(result, kept[j], max_steps=max_steps)
        else:
            row = SegmentRow(
                result.row.ids[: result.row.prompt_length], result.row.prompt_length, [], "empty", [], [], []
            )
            turns, per_turn = [], []
        rows.append(
            Trajectory(
                response=row.ids[row.prompt_length :],
                model_mask=row.model_mask,
                turn_index=turns,
                turn_rewards=per_turn,
                rewards=kept_rewards,
                num_turns=result.turns,
                num_tool_calls=result.tool_calls,
                versions=row.versions,
                logprobs=row.logprobs,
                prompt=row.ids[: row.prompt_length],
            )
        )
    return rows
