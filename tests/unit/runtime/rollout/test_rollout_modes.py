"""The rollout modes (rldock.runtime.rollout): which config selects which mode, what the factory
refuses as the config check does, and what each one-round mode writes to the dock and asks the
engine over test doubles: the plain and streamed modes write the same columns with the same seeds,
the agent's episodes are keyed per sample and round, partial rollout keeps older tokens' logprobs."""

from __future__ import annotations

import string
from dataclasses import replace

import pytest
import torch
from rollout_doubles import EOS, PAD, AnsweringEngine, EngineDouble, RecordingDock, prompts_of
from tensordict import TensorDict

from rldock.config import find_problems
from rldock.config.job import JobConfig
from rldock.runtime.flow.states import ROLLOUT
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer
from rldock.runtime.rollout.agent import AgentRollout
from rldock.runtime.rollout.agent_carry import METRIC_KEYS as CARRY_KEYS
from rldock.runtime.rollout.agent_carry import CarriedAgentRollout
from rldock.runtime.rollout.episode_rounds import token_older_than
from rldock.runtime.rollout.harness import HarnessRollout
from rldock.runtime.rollout.modes import POLICIES, ROLLOUTS, SOURCES, build_rollout, counters_of, rollout_pair
from rldock.runtime.rollout.partial import CUT_POLICIES, PartialRollout
from rldock.runtime.rollout.partial import METRIC_KEYS as PARTIAL_KEYS
from rldock.runtime.rollout.plain import PlainRollout
from rldock.runtime.rollout.protocol import HeldOutRequest, RolloutRequest, RolloutSetup, sampling_logprobs
from rldock.runtime.rollout.streamed import StreamedRollout
from rldock_e2e.doubles.scripted_engine import ScriptedEngine

G, N, SL = 2, 3, 6
COLUMNS = ("prompt_ids", "prompt_mask")
# what an agent's rollout reads besides: each sample's train row, by number and whole (the driver puts both)
AGENT_COLUMNS = (*COLUMNS, "prompt_index", "prompt_row")
AGENT = {"tools": [{"name": "calculator"}]}
PARTIAL = {"partial_rollout": "resume", "max_tokens_per_round": 2}
AHEAD = {"max_staleness": 1}  # partial rollout's generation runs ahead of an update
CARRY = {"partial_rollout": "carry", "importance_correction": "behaviour"}


def job(**sections) -> JobConfig:
    """A job config built directly, as the actor gets it: the config check (find_problems) not run."""
    algorithm = {
        "name": "grpo",
        "num_prompts_per_iteration": G,
        "num_responses_per_prompt": N,
        "max_prompt_length": 4,
        "max_response_length": SL,
        "learning_rate": 1e-3,
    }
    return JobConfig(iterations=1, model={"path": "unused"}, algorithm=algorithm, **sections)


def rollout_spec(cfg: JobConfig, columns: tuple[str, ...]):
    """The job recipe's rollout state for `cfg` (what it writes: partial rollout's and the mismatch's
    columns among them), reading `columns`."""
    from rldock.runtime.flow.job_recipe import job_recipe

    return replace(job_recipe(cfg).spec(ROLLOUT.name), consumes=columns)


class TokenIds:
    """Test double of a tokenizer: only the special ids a one-turn mode reads."""

    eos_token_id, pad_token_id = EOS, PAD


def chat_tokenizer():
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def setup(batch_size: int = G * N, columns: tuple[str, ...] = COLUMNS) -> RolloutSetup:
    return RolloutSetup(
        rank=0,
        batch_size=batch_size,
        spec=replace(ROLLOUT, consumes=columns),
        num_responses=N,
        max_response_length=SL,
        eos_token_id=EOS,
        pad_token_id=PAD,
        num_prompts_per_iteration=G,
    )


@pytest.mark.parametrize(
    ("sections", "pair", "built"),
    [
        ({}, ("engine", "complete"), PlainRollout),
        ({"rollout": {"stream_groups": 2}}, ("engine", "complete"), StreamedRollout),
        ({"rollout": PARTIAL}, ("engine", "resume"), PartialRollout),
        ({"rollout": {**PARTIAL, "partial_rollout": "drop"}}, ("engine", "drop"), PartialRollout),
        # partial rollout writes its uncut groups when the batch ends: stream_groups is not read
        ({"rollout": {**PARTIAL, "stream_groups": 2}}, ("engine", "resume"), PartialRollout),
        ({"agent": AGENT}, ("agent", "complete"), AgentRollout),
        ({"agent": AGENT, "rollout": PARTIAL, "dock": AHEAD}, ("agent", "resume"), AgentRollout),
        ({"agent": AGENT, "rollout": CARRY, "dock": {"max_staleness": 1}}, ("agent", "carry"), CarriedAgentRollout),
    ],
)
def test_each_config_selects_its_source_and_round_policy(sections, pair, built):
    cfg = job(**sections)
    assert rollout_pair(cfg) == pair and pair in ROLLOUTS
    tokenizer = chat_tokenizer() if pair[0] == "agent" else TokenIds()
    rollout = build_rollout(cfg, tokenizer=tokenizer, rank=1, batch_size=12, spec=replace(ROLLOUT, consumes=COLUMNS))
    assert type(rollout) is built
    assert (rollout.setup.rank, rollout.setup.batch_size, rollout.setup.spec.consumes) == (1, 12, COLUMNS)
    assert (rollout.setup.num_responses, rollout.setup.num_samples_per_iteration) == (N, G * N)
    if isinstance(rollout, PartialRollout):  # the policy of a cut response is the config's
        assert rollout.policy.name == pair[1]
    counters = {"complete": (), "resume": PARTIAL_KEYS, "drop": PARTIAL_KEYS, "carry": CARRY_KEYS}[pair[1]]
    assert counters_of(cfg) == counters


@pytest.mark.parametrize(
    ("rollout", "field"),
    [({"partial_rollout": "drop"}, "rollout.partial_rollout"), ({"stream_groups": 2}, "rollout.stream_groups")],
)
def test_the_config_refuses_an_agent_with_partial_rollout_or_streaming(rollout, field):
    # rollout_pair asserts what the config's checks refuse
    cfg = job(agent=AGENT, rollout=rollout)
    assert [p for p in find_problems(cfg) if p.path == field and "with agent" in p.message]


SOURCE_SECTIONS = {"engine": {}, "agent": {"agent": AGENT}, "harness": {"agent": {"harness": "my_agent:run"}}}
POLICY_SECTIONS = {
    "complete": {},
    # a weight update cuts a generation only where it runs ahead (async); carried episodes are sync's
    "resume": {"rollout": PARTIAL, "dock": AHEAD, "training": {"mode": "async"}},
    "drop": {"rollout": {**PARTIAL, "partial_rollout": "drop"}, "dock": AHEAD, "training": {"mode": "async"}},
    "carry": {"rollout": CARRY, "dock": AHEAD},
}


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("policy", POLICIES)
def test_every_source_and_round_policy_is_built_or_refused_with_its_reason(source, policy):
    """The matrix: each pair ROLLOUTS has is a job the config accepts, and each it lacks the config's checks
    refuse on rollout.partial_rollout (the reason docs/agentic.md gives)."""
    cfg = job(**SOURCE_SECTIONS[source], **POLICY_SECTIONS[policy])
    refused = [p for p in find_problems(cfg) if p.path == "rollout.partial_rollout"]
    if (source, policy) in ROLLOUTS:
        assert refused == [] and rollout_pair(cfg) == (source, policy)
    else:
        assert refused, f"{source} x {policy} is neither built nor refused"


def test_the_config_refuses_carry_without_an_agent():
    cfg = job(rollout=CARRY, dock={"max_staleness": 1})
    assert [p for p in find_problems(cfg) if p.path == "rollout.partial_rollout" and "agent section" in p.message]


def test_the_plain_mode_writes_whole_groups_seeded_per_group_and_round():
    engine, dock = EngineDouble(), RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    metrics = PlainRollout(setup()).generate(
        engine, dock, RolloutRequest(iteration=5, policy_version=2, sampling_round=1)
    )
    (call,) = engine.calls
    assert call.prompts == [[9, 9], [8, 8]] and (call.n, call.max_tokens, call.seed) == (N, SL, 5)
    assert call.prompt_keys == [0 + G, 1 + G]  # group index, offset by the round
    assert dock.gets[0] == ("rollout", list(COLUMNS), G * N)
    ((indices, out, version),) = dock.puts
    assert indices == list(range(G * N)) and version == 2
    assert out["response_ids"][:N].tolist() == [
        [7, EOS, PAD, PAD, PAD, PAD],
        [7, 7, EOS, PAD, PAD, PAD],
        [7, 7, 7, EOS, PAD, PAD],
    ]
    assert out["response_mask"].sum(-1).tolist() == [2, 3, 4] * G
    assert out["response_length"].tolist() == [2, 3, 4] * G  # in the dock, where the driver reads it
    assert out["policy_version"].tolist() == [2] * (G * N)
    assert metrics.metrics["decode_steps"] == 3 and metrics.num_samples == G * N  # the longest response, less 1
    assert set(metrics.metrics) == {"decode_steps"}  # no per-sample list: the lengths are in the dock


def test_the_plain_mode_writes_the_engines_logprobs_where_its_state_does():
    """rollout.return_logprobs: the job recipe's rollout state writes `sampled_logprobs`, and the plain mode
    samples with logprobs and writes them (the double's are -(version + 1) on every sampled token)."""
    from rldock.runtime.flow.job_recipe import job_recipe

    cfg = job(rollout={"return_logprobs": True})
    spec = job_recipe(cfg).spec(ROLLOUT.name)
    assert "sampled_logprobs" in spec.produces and "sampled_logprobs" in job_recipe(cfg).consumes["update"]
    engine, dock = EngineDouble(), RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    engine.version = 1
    rollout = build_rollout(cfg, tokenizer=TokenIds(), rank=0, batch_size=G * N, spec=replace(spec, consumes=COLUMNS))
    rollout.generate(engine, dock, RolloutRequest(iteration=5, policy_version=2))
    ((_, out, _),) = dock.puts
    assert torch.equal(out["sampled_logprobs"], -2.0 * out["response_mask"].float())
    plain_dock = RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    PlainRollout(setup()).generate(EngineDouble(), plain_dock, RolloutRequest(iteration=5, policy_version=2))
    assert "sampled_logprobs" not in plain_dock.puts[0][1].keys()  # off by default


@pytest.mark.parametrize("stream_groups", [1, 2, 5])
def test_the_streamed_mode_writes_what_the_plain_one_does_a_few_groups_at_a_time(stream_groups):
    plain_engine, plain_dock = EngineDouble(), RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    PlainRollout(setup()).generate(
        plain_engine, plain_dock, RolloutRequest(iteration=5, policy_version=2, sampling_round=1)
    )
    engine, dock = EngineDouble(), RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    metrics = StreamedRollout(setup(), stream_groups=stream_groups).generate(
        engine, dock, RolloutRequest(iteration=5, policy_version=2, sampling_round=1)
    )
    assert engine.calls == plain_engine.calls  # the same requests, hence the same seeds
    # the double finishes the second group first: its rows are written first
    assert [indices for indices, _, _ in dock.puts] == (
        [[3, 4, 5], [0, 1, 2]] if stream_groups == 1 else [[3, 4, 5, 0, 1, 2]]
    )
    assert all(version == 2 for _, _, version in dock.puts)
    assert (dock.written() == plain_dock.written()).all()
    assert metrics.metrics["decode_steps"] == 3 and metrics.num_samples == G * N


@pytest.mark.parametrize("stream_groups", [1, 2])
def test_the_streamed_mode_writes_the_engines_logprobs_where_its_state_does(stream_groups):
    """monitoring.mismatch: the job recipe's rollout state writes `sampled_logprobs`, and the streamed mode
    writes each finished group's with it (the double's are -(version + 1) on every sampled token)."""
    cfg = job(rollout={"stream_groups": stream_groups}, monitoring={"mismatch": {"max_kl": 0.1}})
    rollout = build_rollout(cfg, tokenizer=TokenIds(), rank=0, batch_size=G * N, spec=rollout_spec(cfg, COLUMNS))
    assert type(rollout) is StreamedRollout
    engine, dock = EngineDouble(), RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    engine.version = 1
    rollout.generate(engine, dock, RolloutRequest(iteration=5, policy_version=2))
    assert len(dock.puts) == G // stream_groups
    for _, out, _ in dock.puts:
        assert torch.equal(out["sampled_logprobs"], -2.0 * out["response_mask"].float())
    unmeasured = RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    StreamedRollout(setup(), stream_groups=stream_groups).generate(
        EngineDouble(), unmeasured, RolloutRequest(iteration=5, policy_version=2)
    )
    assert all("sampled_logprobs" not in out.keys() for _, out, _ in unmeasured.puts)  # off by default


def test_an_agent_measuring_the_gap_writes_each_model_tokens_engine_logprob():
    """monitoring.mismatch on an agent job: its episodes keep each sampled token's logprob (the double's,
    -(weights + 1) / 100) and write them, without partial rollout's per-token versions (one version per
    episode); the tool's and padding tokens get 0, outside the response mask the gap is measured on."""
    tokenizer = chat_tokenizer()
    cfg = job(agent=AGENT, data={"chat_template": "model"}, monitoring={"mismatch": {"max_kl": 0.1}})
    rollout = build_rollout(cfg, tokenizer=tokenizer, rank=0, batch_size=G * N, spec=rollout_spec(cfg, AGENT_COLUMNS))
    assert type(rollout) is AgentRollout
    engine = AnsweringEngine(tokenizer("4", add_special_tokens=False)["input_ids"])
    engine.weights = 4
    prompt = tokenizer("2+2=", add_special_tokens=False)["input_ids"][:3]
    dock = RecordingDock(prompts_of(prompt, prompt, group=N), first_index=0)
    rollout.generate(engine, dock, RolloutRequest(iteration=3, policy_version=4))
    ((_, out, _),) = dock.puts
    assert "token_policy_version" not in out.keys()
    assert torch.equal(out["sampled_logprobs"], -0.05 * out["response_mask"].float())
    computed = torch.full((G * N, SL), -9.0)  # (B, SL): the old-logprob pass
    assert torch.equal(sampling_logprobs(computed, out, rollout.older_tokens(out, policy_version=4)), computed)


def test_one_round_modes_have_no_second_round_and_keep_the_passes_logprobs():
    computed = torch.randn(2, SL)  # (B, SL)
    batch = TensorDict({}, batch_size=[2])
    for rollout in (PlainRollout(setup()), StreamedRollout(setup(), stream_groups=1)):
        with pytest.raises(RuntimeError, match="no second round"):
            rollout.finish(EngineDouble(), RecordingDock(batch), iteration=1, policy_version=1)
        assert sampling_logprobs(computed, batch, rollout.older_tokens(batch, policy_version=1)) is computed
        assert rollout.older_tokens(batch, policy_version=1) is None  # the gap is measured on every token


def test_partial_rollout_keeps_the_older_versions_logprobs_for_the_prefix():
    computed = torch.full((2, 4), -5.0)  # (B, SL) by the weights of version 2
    batch = TensorDict(
        {
            "sampled_logprobs": torch.full((2, 4), -1.0),
            "policy_version": torch.tensor([1, 2]),
            "prefix_length": torch.tensor([2, 4]),
        },
        batch_size=[2],
    )
    rollout = PartialRollout(setup(), policy=CUT_POLICIES["resume"])
    old = sampling_logprobs(computed, batch, rollout.older_tokens(batch, policy_version=2))
    assert old.tolist() == [[-1.0, -1.0, -5.0, -5.0], [-5.0] * 4]
    # the mismatch/ metrics leave the older version's tokens out (the workers' actor: `older_tokens`)
    older = rollout.older_tokens(batch, policy_version=2)
    assert older.tolist() == [[True, True, False, False], [False] * 4]
    # a response version 1 sampled whole, met by the weights of version 2: all older
    assert rollout.older_tokens(batch, policy_version=3)[1].tolist() == [True] * 4


def test_the_plain_evaluation_asks_the_engine_once_per_prompt():
    engine = EngineDouble()
    request = HeldOutRequest(prompts=[[9, 9]], num_samples=2, greedy=True, max_tokens=3, seed=7, prompt_keys=[4])
    out = PlainRollout(setup()).evaluate(engine, request)
    assert out == {"responses": [[[7, EOS], [7, 7, EOS]]]}
    assert engine.calls[0].greedy and engine.calls[0].prompt_keys == [4] and engine.calls[0].max_tokens == 3


def agent_rollout(tokenizer) -> AgentRollout:
    cfg = job(agent=AGENT, data={"chat_template": "model"})
    columns = AGENT_COLUMNS
    rollout = build_rollout(cfg, tokenizer=tokenizer, rank=0, batch_size=G * N, spec=replace(ROLLOUT, consumes=columns))
    assert isinstance(rollout, AgentRollout)
    return rollout


def test_the_agent_runs_one_episode_per_sample_keyed_by_sample_and_round():
    tokenizer = chat_tokenizer()
    rollout = agent_rollout(tokenizer)
    answer = tokenizer("4", add_special_tokens=False)["input_ids"]
    engine = AnsweringEngine(answer)
    prompt = tokenizer("2+2=", add_special_tokens=False)["input_ids"][:3]
    dock = RecordingDock(prompts_of(prompt, prompt, group=N), first_index=0)
    metrics = rollout.generate(engine, dock, RolloutRequest(iteration=3, policy_version=4, sampling_round=1))
    # one request per sample (its first turn), seeded by the iteration, keyed past round 0's samples
    assert engine.requests == [(3, (i + G * N, 0)) for i in range(G * N)]
    ((indices, out, version),) = dock.puts
    assert indices == list(range(G * N)) and version == 4
    assert out["num_turns"].tolist() == [1] * (G * N)
    assert out["response_ids"][0, : len(answer) + 1].tolist() == [*answer, tokenizer.eos_token_id]
    assert out["response_length"].tolist() == [len(answer) + 1] * (G * N) and "agent" in metrics.metrics
    assert metrics.metrics["decode_steps"] == len(answer)


def test_the_agents_evaluation_answers_with_each_episodes_final_turn():
    tokenizer = chat_tokenizer()
    answer = tokenizer("4", add_special_tokens=False)["input_ids"]
    engine = AnsweringEngine(answer)
    prompt = tokenizer("2+2=", add_special_tokens=False)["input_ids"]
    request = HeldOutRequest(
        prompts=[prompt, prompt], num_samples=2, greedy=True, max_tokens=1, seed=7, prompt_keys=[4, 5]
    )
    out = agent_rollout(tokenizer).evaluate(engine, request)
    # sample j of prompt key k is episode k * num_samples + j
    assert engine.requests == [(7, (key, 0)) for key in (8, 9, 10, 11)]
    assert out["responses"] == [[[*answer, tokenizer.eos_token_id]] * 2] * 2
    assert out["environment_rewards"] == [[[], []], [[], []]] and "agent" in out


def test_an_agent_with_a_harness_selects_the_harness_mode():
    cfg = job(agent={"harness": "my_agent:run"}, data={"answer_key": "answer"})
    assert rollout_pair(cfg) == ("harness", "complete")
    rollout = build_rollout(
        cfg, tokenizer=chat_tokenizer(), rank=0, batch_size=6, spec=replace(ROLLOUT, consumes=AGENT_COLUMNS)
    )
    assert type(rollout) is HarnessRollout


def test_an_agents_turns_cut_at_the_round_budget_end_on_the_new_weights_none_dropped():
    """Partial rollout of agent episodes: the first round (before a weight update) stops every episode
    after rollout.max_tokens_per_round tokens, in the middle of its turn; `finish`, after the update, samples
    the rest of each turn on the new weights. Every episode is written, each row tagged with the first
    round's version and each token with its own; the old-logprob pass keeps the engine's logprob for the
    tokens the older version sampled."""
    tokenizer = chat_tokenizer()
    cfg = job(agent=AGENT, data={"chat_template": "model"}, rollout=PARTIAL, dock=AHEAD)  # 2 tokens a round
    assert rollout_pair(cfg) == ("agent", "resume")
    columns = AGENT_COLUMNS
    rollout = build_rollout(cfg, tokenizer=tokenizer, rank=0, batch_size=G * N, spec=rollout_spec(cfg, columns))
    answer = tokenizer("42", add_special_tokens=False)["input_ids"]
    turn = [*answer, tokenizer.eos_token_id]  # 3 tokens: cut after 2
    engine = AnsweringEngine(answer)
    engine.weights = 4
    prompt = tokenizer("2+2=", add_special_tokens=False)["input_ids"][:3]
    dock = RecordingDock(prompts_of(prompt, prompt, group=N), first_index=0)
    first = rollout.generate(engine, dock, RolloutRequest(iteration=3, policy_version=4, round_tokens=2))
    assert dock.puts == [] and first.metrics["partial_cut"] == G * N
    engine.weights = 5  # the weight update
    second = rollout.finish(engine, dock, iteration=3, policy_version=5)
    # each cut turn is resumed from its 2 sampled tokens, keyed (sample, turn, tokens sampled)
    assert engine.requests[G * N :] == [(3, (i, 0, 2)) for i in range(G * N)]
    ((indices, out, version),) = dock.puts
    assert indices == list(range(G * N)) and version == 4
    counts = (second.num_samples, second.metrics["partial_resumed"], second.metrics["partial_carried_tokens"])
    assert counts == (G * N, G * N, 2 * G * N)
    assert out["response_ids"][:, :3].tolist() == [turn] * (G * N) and out["num_turns"].tolist() == [1] * (G * N)
    assert out["response_mask"].sum(-1).tolist() == [3] * (G * N)
    assert out["response_length"].tolist() == [3] * (G * N) and second.metrics["decode_steps"] == 2
    assert out["token_policy_version"].tolist() == [[4, 4, 5] + [-1] * (SL - 3)] * (G * N)
    assert out["sampled_logprobs"][0, :3].tolist() == pytest.approx([-0.05, -0.05, -0.06])
    computed = torch.full((G * N, SL), -9.0)  # (B, SL): the pass under version 5
    old = sampling_logprobs(computed, out, rollout.older_tokens(out, policy_version=5))
    assert old[0, :3].tolist() == pytest.approx([-0.05, -0.05, -9.0])
    assert rollout.finish(engine, dock, iteration=3, policy_version=5).num_samples == 0  # nothing left


def test_an_agents_episodes_within_the_round_budget_are_written_at_once():
    tokenizer = chat_tokenizer()
    cfg = job(agent=AGENT, data={"chat_template": "model"}, rollout={**PARTIAL, "max_tokens_per_round": 5}, dock=AHEAD)
    rollout = build_rollout(cfg, tokenizer=tokenizer, rank=0, batch_size=G * N, spec=rollout_spec(cfg, AGENT_COLUMNS))
    engine = AnsweringEngine(tokenizer("42", add_special_tokens=False)["input_ids"])
    prompt = tokenizer("2+2=", add_special_tokens=False)["input_ids"][:3]
    dock = RecordingDock(prompts_of(prompt, prompt, group=N), first_index=0)
    first = rollout.generate(engine, dock, RolloutRequest(iteration=3, policy_version=4, round_tokens=5))
    ((_, out, version),) = dock.puts
    assert first.metrics["partial_cut"] == 0 and version == 4
    assert out["token_policy_version"][:, :3].tolist() == [[4, 4, 4]] * (G * N)
    assert rollout.finish(engine, dock, iteration=3, policy_version=5).num_samples == 0


def test_the_token_versions_choose_which_logprob_the_update_compares_against():
    computed = torch.full((2, 5), -5.0)  # (B, SL) by the weights of version 2
    sampled = torch.tensor([[-1.0, -1.5, -2.0, -2.5, -3.0], [-1.0] * 5])  # (B, SL)
    versions = torch.tensor([[1, 1, -1, 2, -1], [0, 2, 1, -1, -1]])  # (B, SL): -1 where the model sampled nothing
    # What the old-logprob pass does with an episode source's answer (EpisodeRounds.older_tokens).
    older = token_older_than(versions, current_version=2)
    old = sampling_logprobs(computed, TensorDict({"sampled_logprobs": sampled}, batch_size=[2]), older)
    assert old.tolist() == [[-1.0, -1.5, -5.0, -5.0, -5.0], [-1.0, -5.0, -1.0, -5.0, -5.0]]


ONE_TURN_HARNESS = """
async def run(task, client):
    messages = [{"role": "user", "content": task["prompt"]}]
    answer = await client.chat.completions.create(model="policy", messages=messages)
    return 1.0 if answer.choices[0].message.content == task["ground_truth"] else 0.0
"""


def harness_rollout(tmp_path, tokenizer, **sections):
    """The harness mode of a job running ONE_TURN_HARNESS on G prompts "2+2=", `sections` added."""
    (tmp_path / "harness.py").write_text(ONE_TURN_HARNESS)
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "2+2=", "answer": "42"}\n' * G)
    cfg = job(
        agent={"harness": f"{tmp_path / 'harness.py'}:run", "max_segments": 1},
        data={"train_files": [str(train)], "answer_key": "answer", "chat_template": "model"},
        **sections,
    )
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"max_response_length": 64})})
    assert rollout_pair(cfg)[0] == "harness"
    spec = rollout_spec(cfg, AGENT_COLUMNS)
    return build_rollout(cfg, tokenizer=tokenizer, rank=0, batch_size=G * N, spec=spec)


def test_a_harness_turn_cut_at_the_round_budget_ends_on_the_new_weights_none_dropped(tmp_path):
    """Partial rollout of a harness's episodes: the first round stops every episode's turn after 2 tokens
    (its request to the gateway left open); `finish`, after the update, samples each turn's rest on the new
    weights. Every episode is written, its row tagged with the first round's version and each token with its
    own, and the old-logprob pass keeps the engine's logprob for the tokens the older version sampled."""
    tokenizer = chat_tokenizer()
    rollout = harness_rollout(tmp_path, tokenizer, rollout=PARTIAL, dock=AHEAD)  # 2 tokens a round
    turn = [*tokenizer("42", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]  # 3 tokens: cut after 2
    engine = ScriptedEngine(tokenizer, {key: ["42"] for key in range(G * N)})
    engine.version = 4
    dock = RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    try:
        first = rollout.generate(engine, dock, RolloutRequest(iteration=3, policy_version=4, round_tokens=2))
        assert dock.puts == [] and first.metrics["partial_cut"] == G * N
        engine.version = 5  # the weight update
        second = rollout.finish(engine, dock, iteration=3, policy_version=5)
        assert rollout.finish(engine, dock, iteration=3, policy_version=5).num_samples == 0  # nothing left
    finally:
        rollout.close()
    # each cut turn resumed from its 2 sampled tokens, keyed (sample, request, tokens sampled)
    assert all(engine.prompts[(key, 1, 2)] == [*engine.prompts[(key, 1)], *turn[:2]] for key in range(G * N))
    ((indices, out, version),) = dock.puts
    assert indices == list(range(G * N)) and version == 4
    counts = [
        second.num_samples,
        *(second.metrics[f"partial_{k}"] for k in ("resumed", "carried_tokens", "newer_tokens")),
    ]
    assert counts == [G * N, G * N, 2 * G * N, G * N]
    trained = out["response_mask"].bool()  # (B, SL): the model's tokens, after the prompt's spill
    assert out["response_ids"][trained].view(G * N, 3).tolist() == [turn] * (G * N)
    assert out["environment_rewards"][:, 0].tolist() == [1.0] * (G * N)  # each harness got "42" whole
    assert out["token_policy_version"][trained].view(G * N, 3).tolist() == [[4, 4, 5]] * (G * N)
    assert (out["token_policy_version"][~trained] == -1).all()
    assert out["sampled_logprobs"][trained].view(G * N, 3)[0].tolist() == [-5.0, -5.0, -6.0]
    computed = torch.full(out["response_ids"].shape, -9.0)  # (B, SL): the pass under version 5
    old = sampling_logprobs(computed, out, rollout.older_tokens(out, policy_version=5))
    assert old[trained].view(G * N, 3)[0].tolist() == [-5.0, -5.0, -9.0]


def test_a_harness_measuring_the_gap_writes_each_model_tokens_engine_logprob(tmp_path):
    """monitoring.mismatch on a harness's job: the gateway asks the engine for every sampled token's logprob
    (the harness asks for none) and the rows carry them on the model's tokens, 0 elsewhere, without partial
    rollout's per-token versions."""
    tokenizer = chat_tokenizer()
    rollout = harness_rollout(tmp_path, tokenizer, monitoring={"mismatch": {"max_kl": 0.1}})
    engine = ScriptedEngine(tokenizer, {key: ["42"] for key in range(G * N)})
    engine.version = 4
    dock = RecordingDock(prompts_of([9, 9], [8, 8], group=N))
    try:
        rollout.generate(engine, dock, RolloutRequest(iteration=3, policy_version=4))
    finally:
        rollout.close()
    ((_, out, _),) = dock.puts
    assert "token_policy_version" not in out.keys()
    trained = out["response_mask"].bool()  # (B, SL): the model's tokens
    assert trained.sum() == 3 * G * N  # "42" and EOS in each episode
    assert (out["sampled_logprobs"][trained] == -5.0).all() and (out["sampled_logprobs"][~trained] == 0).all()
