"""What an actor rank's engine runs for a job with an `agent` section: multi-turn episodes for the
rollout and for held-out evaluation, built once per actor from the job config.

The rollout's episodes become the dock's columns here: `response_ids` (every token after the prompt,
right-padded), `response_mask` (1 on the tokens the model sampled: what the old-logprob, reference
and update passes score and train on), `response_attention_mask` (1 on every token of the trajectory:
what those passes attend to), the trajectory's counts and the environment's per-step rewards for the
reward (rldock.runtime.flow.columns).

Here, beside the folders it joins, because it needs both the agent (environments, tools, the loop:
rldock.runtime.agent) and the job's data (the train rows an environment checks answers against, which
come from the dock with each sample: rldock.runtime.data), and the data's generators and prompt rendering
import the agent's formats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.agent.builders import build_environment, build_parser, build_tools
from rldock.runtime.agent.episode_loop import AgentLoop, Episode, Rollout
from rldock.runtime.agent.episode_metrics import Sums, episode_sums
from rldock.runtime.agent.interfaces import EpisodeContext
from rldock.runtime.agent.trajectory import final_turn_span, turn_columns
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.data import Row
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.flow.columns import AGENT_PARTIAL_ROLLOUT

SAMPLED_LOGPROBS, TOKEN_POLICY_VERSION = AGENT_PARTIAL_ROLLOUT


class AgentSampler:
    def __init__(
        self,
        cfg: JobConfig,
        *,
        tokenizer,
        environment_urls: Mapping[str, Sequence[str]] | None = None,
        engine_columns: Sequence[str] = (),
    ):
        """`engine_columns`: which of AGENT_PARTIAL_ROLLOUT the job recipe's rollout state writes (both under
        partial rollout, the logprobs alone where the old-logprob pass measures the mismatch): the episodes
        keep each sampled token's logprob when it is among them."""
        assert cfg.agent is not None, "AgentSampler is for jobs with an agent section"
        self.cfg, self.spec, self.tokenizer = cfg, cfg.agent, tokenizer
        urls = environment_urls or {}
        self.tools = build_tools(cfg.agent, sandbox_urls=urls.get("agent.sandbox", ()))
        self.environment = build_environment(cfg.agent, replica_urls=urls.get("agent.environment", ()))
        self.parser = build_parser(cfg.agent)
        self.renderer = ChatRenderer(
            tokenizer,
            tools=[tool.schema() for tool in self.tools.values()],
            opens_with_environment=self.environment is not None,
        )
        self._loop: AgentLoop | None = None
        self.engine_columns = tuple(engine_columns)

    def loop_on(self, engine: VllmRolloutEngine) -> AgentLoop:
        if self._loop is None or self._loop.engine is not engine:
            self._loop = AgentLoop(
                engine=engine,
                tokenizer=self.tokenizer,
                renderer=self.renderer,
                tools=self.tools,
                environment=self.environment,
                parser=self.parser,
                spec=self.spec,
                max_response_length=self.cfg.algorithm.max_response_length,
            )
        return self._loop

    def context(self, row: Row) -> EpisodeContext | None:
        """What an environment checks an episode's answers against: its sample's train-file row (the dock's
        `prompt_row`, as the reward reads it)."""
        if self.environment is None:
            return None
        return EpisodeContext(row.ground_truth, row.data_source, row.extra_info or {})

    def rollout(
        self,
        engine: VllmRolloutEngine,
        prompts: Sequence[list[int]],
        *,
        keys: Sequence[int],
        rows: Sequence[Row],
        seed: int,
        policy_version: int,
    ) -> tuple[TensorDict, Sums, list[int]]:
        """One episode per prompt row: the dock's columns (B rows), the episodes' metric sums and
        their response lengths (every token after the prompt)."""
        rollout = self.start(engine, prompts, rows=rows, keys=keys, seed=seed)
        self.advance(engine, rollout, policy_version=policy_version)
        return self.columns(engine, rollout, policy_version=policy_version)

    def start(
        self,
        engine: VllmRolloutEngine,
        prompts: Sequence[list[int]],
        *,
        keys: Sequence[int],
        rows: Sequence[Row],
        seed: int,
    ) -> Rollout:
        """One episode per prompt row, their sessions opening; `advance` runs them."""
        contexts = [self.context(row) for row in rows]
        return self.loop_on(engine).start(prompts, keys, contexts, seed=seed)

    def advance(
        self, engine: VllmRolloutEngine, rollout: Rollout, *, policy_version: int, round_tokens: int | None = None
    ) -> None:
        """One round of `rollout` on the weights of `policy_version` (AgentLoop.advance), each sampled token's
        logprob kept where the rollout writes them (`engine_columns`)."""
        self.loop_on(engine).advance(
            rollout,
            round_tokens=round_tokens,
            policy_version=policy_version,
            logprobs=SAMPLED_LOGPROBS in self.engine_columns,
        )

    def columns(
        self, engine: VllmRolloutEngine, rollout: Rollout, *, policy_version: int
    ) -> tuple[TensorDict, Sums, list[int]]:
        """A finished rollout's dock columns (each row's `policy_version` the oldest that sampled it),
        metric sums and response lengths."""
        assert rollout.done, "a rollout's columns are written once every episode has ended"
        episodes = rollout.episodes
        return (
            episode_columns(
                episodes,
                max_response_length=self.cfg.algorithm.max_response_length,
                max_turns=self.spec.max_turns,
                pad_token_id=self.tokenizer.pad_token_id,
                policy_version=policy_version,
                engine_columns=self.engine_columns,
            ),
            episode_sums(episodes, self.loop_on(engine)),
            [len(e.response) for e in episodes],
        )

    def evaluate(
        self,
        engine: VllmRolloutEngine,
        prompts: Sequence[list[int]],
        *,
        keys: Sequence[int],
        contexts: Sequence[EpisodeContext | None],
        seed: int,
        greedy: bool,
    ) -> tuple[list[list[int]], Sums, list[list[float]]]:
        """Held-out episodes: each one's final turn (the answer the reward scores), the metric sums and
        each one's environment rewards per step (what an `environment` reward term scores)."""
        loop = self.loop_on(engine)
        episodes = loop.run(prompts, keys, contexts, seed=seed, greedy=greedy)
        return [final_turn(e) for e in episodes], episode_sums(episodes, loop), [e.rewards for e in episodes]

    def close(self) -> None:
        if self._loop is not None:
            self._loop.close()


def final_turn(episode: Episode) -> list[int]:
    """The tokens of the episode's last model turn (its answer, EOS included when sampled)."""
    return episode.response[final_turn_span(episode.model_mask)]


def episode_columns(
    episodes: Sequence[Episode],
    *,
    max_response_length: int,
    max_turns: int,
    pad_token_id: int,
    policy_version: int,
    engine_columns: Sequence[str] = (),
) -> TensorDict:
    """The dock's response columns of `episodes`, one row each, with those of each token's version and
    sampling logprob named in `engine_columns` (rldock.runtime.flow.columns.AGENT_PARTIAL_ROLLOUT)."""
    rows = len(episodes)
    rewards = torch.zeros((rows, max_turns), dtype=torch.float32)  # (B, max_turns): the environment's per step
    for row, episode in enumerate(episodes):
        rewards[row, : len(episode.rewards)] = torch.tensor(episode.rewards, dtype=torch.float32)
    response_ids = torch.full((rows, max_response_length), pad_token_id, dtype=torch.int64)  # (B, SL)
    model_mask = torch.zeros((rows, max_response_length), dtype=torch.int64)  # (B, SL)
    attention = torch.zeros((rows, max_response_length), dtype=torch.int64)  # (B, SL)
    for row, episode in enumerate(episodes):
        length = len(episode.response)
        response_ids[row, :length] = torch.tensor(episode.response, dtype=torch.int64)
        model_mask[row, :length] = torch.tensor(episode.model_mask, dtype=torch.int64)
        attention[row, :length] = 1
    columns = TensorDict(
        {
            "response_ids": response_ids,
            "response_mask": model_mask,
            "response_attention_mask": attention,
            "response_length": torch.tensor([len(e.response) for e in episodes], dtype=torch.int64),  # (B,)
            "policy_version": torch.full((rows,), policy_version, dtype=torch.int64),
            "num_turns": torch.tensor([e.turns for e in episodes], dtype=torch.int64),
            "num_tool_calls": torch.tensor([e.num_tool_calls for e in episodes], dtype=torch.int64),
            "num_tool_errors": torch.tensor([e.num_tool_errors for e in episodes], dtype=torch.int64),
            "environment_rewards": rewards,
            "num_environment_steps": torch.tensor([len(e.rewards) for e in episodes], dtype=torch.int64),
            **turn_columns(
                [e.turn_index for e in episodes],
                [e.turn_rewards for e in episodes],
                max_response_length=max_response_length,
                max_turns=max_turns,
            ),
        },
        batch_size=[rows],
    )
    if engine_columns:
        per_token = version_columns(
            [e.token_version for e in episodes], [e.logprobs for e in episodes], max_response_length=max_response_length
        )
        columns.update({name: per_token[name] for name in engine_columns})
    return columns


def version_columns(
    versions: Sequence[Sequence[int]], logprobs: Sequence[Sequence[float]], *, max_response_length: int
) -> dict[str, torch.Tensor]:
    """Per row, from each response token's version (-1 where the model did not sample it) and logprob:
    `token_policy_version` (B, SL) int64: the policy version that sampled each response token, -1 on the
    tools', the environment's, the context's and padding tokens; `sampled_logprobs` (B, SL) float32: each
    model token's logprob under the weights that sampled it, 0 elsewhere."""
    rows = len(versions)
    token_versions = torch.full((rows, max_response_length), -1, dtype=torch.int64)  # (B, SL)
    sampled = torch.zeros((rows, max_response_length), dtype=torch.float32)  # (B, SL)
    for row, (row_versions, row_logprobs) in enumerate(zip(versions, logprobs)):
        token_versions[row, : len(row_versions)] = torch.tensor(row_versions, dtype=torch.int64)
        sampled[row, : len(row_logprobs)] = torch.tensor(row_logprobs, dtype=torch.float32)
    return {TOKEN_POLICY_VERSION: token_versions, SAMPLED_LOGPROBS: sampled}
