"""What an actor rank's engine runs for a job with an `agent` section: multi-turn episodes for the
rollout and for held-out evaluation, built once per actor from the job config.

The rollout's episodes become the dock's rows here (`trajectory_of`, written by rollout/trajectory_rows.py
as a harness's are): `response_ids` (every token after the prompt, right-padded), `response_mask` (1 on the
tokens the model sampled: what the old-logprob, reference and update passes score and train on),
`response_attention_mask` (1 on every token of the trajectory: what those passes attend to), the
trajectory's counts and the environment's per-step rewards for the reward (rldock.runtime.flow.columns).

Here, beside the folders it joins, because it needs both the agent (environments, tools, the loop:
rldock.runtime.agent) and the job's data (an episode's environment checks answers against its sample's train
row, `Row`, which the rollouts read from the dock: rldock.runtime.data), and the data's generators and prompt
rendering import the agent's formats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.agent.builders import build_environment, build_parser, build_tools
from rldock.runtime.agent.episode_loop import AgentLoop, Episode, Rollout
from rldock.runtime.agent.episode_metrics import Sums, episode_sums
from rldock.runtime.agent.interfaces import EpisodeContext
from rldock.runtime.agent.trajectory import final_turn_span
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.data import Row
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.rollout.trajectory_rows import SAMPLED_LOGPROBS, Trajectory, trajectory_columns


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
    """The dock's response columns of `episodes`, one row each (rollout/trajectory_rows.py's writer), with
    those of each token's version and sampling logprob named in `engine_columns` (AGENT_PARTIAL_ROLLOUT)."""
    return trajectory_columns(
        [trajectory_of(episode) for episode in episodes],
        max_response_length=max_response_length,
        max_turns=max_turns,
        pad_token_id=pad_token_id,
        policy_version=policy_version,
        engine_columns=engine_columns,
    )


def trajectory_of(episode: Episode) -> Trajectory:
    """A native-loop episode as its dock row (the driver's prompt)."""
    return Trajectory(
        response=episode.response,
        model_mask=episode.model_mask,
        turn_index=episode.turn_index,
        turn_rewards=episode.turn_rewards,
        rewards=episode.rewards,
        num_turns=episode.turns,
        num_tool_calls=episode.num_tool_calls,
        num_tool_errors=episode.num_tool_errors,
        versions=episode.token_version,
        logprobs=episode.logprobs,
    )
