"""The multi-turn loop's bookkeeping on a scripted engine: masks token by token, budgets, turn limits,
bad calls, the environment, and that generation goes on while a tool is out.

The engine here is a test double (tests/README: the real vLLM engine runs these episodes in
tests/integration/test_agent_job.py); it returns scripted turns per (sample, turn) key and records
the order of its steps, which is what the loop's scheduling is judged by.
"""

from __future__ import annotations

import asyncio
import string
from collections.abc import Mapping

import pytest

from rldock.config.job import AgentSpec
from rldock.runtime.agent.base import Environment, EnvironmentReply, EpisodeContext, Tool, ToolResult
from rldock.runtime.agent.conversation import ChatRenderer
from rldock.runtime.agent.metrics import agent_metrics, episode_sums
from rldock.runtime.agent.parsers import HermesParser
from rldock.runtime.agent.rollout import AgentLoop
from rldock.runtime.agent.sampler import episode_columns, final_turn
from rldock.runtime.engines.vllm_rollout import Completion
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


class ScriptedEngine:
    """Answers turn t of sample k with `script[k][t]` (text; EOS appended unless it ends in '…'),
    one request per step, oldest first, so every step is visible in `log`."""

    def __init__(self, tokenizer, script: Mapping[int, list[str]]):
        self.tokenizer, self.script = tokenizer, script
        self.queue: list[tuple[str, list[int], int, tuple[int, int]]] = []
        self.log: list[tuple[int, int]] = []  # (sample, turn) of each step
        self.prompts: dict[tuple[int, int], list[int]] = {}
        self._ids = 0

    def submit(self, prompts, *, max_tokens, eos_token_id, seed, request_keys, greedy=False):
        ids = []
        for prompt, limit, key in zip(prompts, max_tokens, request_keys):
            self._ids += 1
            ids.append(str(self._ids))
            self.queue.append((str(self._ids), list(prompt), limit, tuple(key)))
        return ids

    def has_unfinished(self) -> bool:
        return bool(self.queue)

    def step(self, eos_token_id):
        request_id, prompt, limit, (sample, turn) = self.queue.pop(0)
        self.log.append((sample, turn))
        self.prompts[(sample, turn)] = prompt
        text = self.script[sample][turn]
        tokens = self.tokenizer(text.removesuffix("…"), add_special_tokens=False)["input_ids"]
        if not text.endswith("…"):
            tokens.append(eos_token_id)
        tokens = tokens[:limit]
        return [(request_id, Completion(tokens, None, bool(tokens) and tokens[-1] == eos_token_id))]


class Adder(Tool):
    name, description = "add", "adds two numbers"
    parameters = {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}

    def __init__(self, gate: asyncio.Event | None = None):
        self.gate = gate

    async def call(self, arguments):
        if self.gate is not None:
            await self.gate.wait()
        return ToolResult(str(arguments["a"] + arguments["b"]))


class Broken(Tool):
    name, description, parameters = "broken", "always raises", {"type": "object"}

    async def call(self, arguments):
        raise ZeroDivisionError("oops")


def call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def make_loop(tokenizer, engine, tools, *, environment=None, max_response_length=200, **spec) -> AgentLoop:
    return AgentLoop(
        engine=engine,
        tokenizer=tokenizer,
        renderer=ChatRenderer(tokenizer, tools=[t.schema() for t in tools]),
        tools={t.name: t for t in tools},
        environment=environment,
        parser=HermesParser(),
        spec=AgentSpec(**spec),
        max_response_length=max_response_length,
    )


def run(loop: AgentLoop, tokenizer, n: int, contexts=None):
    prompt = tokenizer("<user>1+2<eos><assistant>", add_special_tokens=False)["input_ids"]
    try:
        return loop.run([prompt] * n, list(range(n)), contexts or [None] * n, seed=0)
    finally:
        loop.close()


def test_masks_match_the_rendered_conversation_token_by_token(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: [call("add", a=1, b=2), "3"]})
    renderer = ChatRenderer(tokenizer, tools=[Adder().schema()])
    (episode,) = run(make_loop(tokenizer, engine, [Adder()]), tokenizer, 1)
    assert episode.turns == 2 and episode.ended == "answer" and episode.tool_calls == {"add": 1}
    # The conversation the trajectory stands for, rendered by the template after the prompt.
    spans = renderer.demonstration(
        [
            {"role": "assistant", "content": call("add", a=1, b=2)},
            {"role": "tool", "content": "3"},
            {"role": "assistant", "content": "3"},
        ]
    )
    assert episode.response == [t for span in spans for t in span.ids]
    assert episode.model_mask == [int(span.model) for span in spans for _ in span.ids]
    text = tokenizer.decode(episode.response, skip_special_tokens=False)
    assert text == call("add", a=1, b=2) + "<eos><tool>3<eos><assistant>3<eos>"
    # The engine saw the trajectory so far as the second turn's prompt.
    assert engine.prompts[(0, 1)][-len(spans[0].ids) - len(spans[1].ids) :] == spans[0].ids + spans[1].ids
    assert tokenizer.decode(final_turn(episode)) == "3<eos>"


def test_dock_columns_carry_both_masks(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: [call("add", a=1, b=2), "3"], 1: ["4"]})
    episodes = run(make_loop(tokenizer, engine, [Adder()]), tokenizer, 2)
    columns = episode_columns(episodes, max_response_length=200, pad_token_id=0, policy_version=7)
    for row, episode in enumerate(episodes):
        length = len(episode.response)
        assert columns["response_attention_mask"][row].sum() == length
        assert columns["response_mask"][row, :length].tolist() == episode.model_mask
        assert columns["response_mask"][row, length:].sum() == 0
    assert columns["num_tool_calls"].tolist() == [1, 0] and columns["num_turns"].tolist() == [2, 1]
    assert columns["policy_version"].tolist() == [7, 7]


def test_the_engine_generates_for_others_while_a_tool_is_out(tokenizer):
    # Sample 0 calls a tool that answers only once sample 1 has finished all three of its turns.
    loop_holder = {}

    class Gate(Tool):
        name, description, parameters = "wait", "waits", {"type": "object"}

        async def call(self, arguments):
            while (1, 2) not in loop_holder["engine"].log:
                await asyncio.sleep(0.001)  # polls the state it waits for, never a guessed delay
            return ToolResult("done")

    engine = ScriptedEngine(
        tokenizer, {0: [call("wait"), "ok"], 1: [call("add", a=1, b=1), call("add", a=2, b=2), "4"]}
    )
    loop_holder["engine"] = engine
    episodes = run(make_loop(tokenizer, engine, [Gate(), Adder()]), tokenizer, 2)
    assert [e.ended for e in episodes] == ["answer", "answer"]
    assert engine.log.index((1, 2)) < engine.log.index((0, 1))  # sample 1 went on while 0 waited


def test_bad_calls_are_answered_and_counted(tokenizer):
    engine = ScriptedEngine(
        tokenizer,
        {0: ["<tool_call>{not json</tool_call>", call("nope"), call("broken"), "done"]},
    )
    loop = make_loop(tokenizer, engine, [Adder(), Broken()], max_turns=8, max_response_length=2000)
    (episode,) = run(loop, tokenizer, 1)
    assert episode.ended == "answer" and episode.turns == 4
    assert episode.tool_errors == {"malformed": 1, "unknown": 1, "broken": 1}
    text = tokenizer.decode(episode.response, skip_special_tokens=False)
    assert "there is no tool 'nope'" in text and "ZeroDivisionError: oops" in text
    metrics = agent_metrics([episode_sums([episode])])["agent"]
    assert metrics["errors/broken"] == 1 and metrics["tool_errors_mean"] == 3


def test_a_hanging_tool_is_stopped_at_its_limit(tokenizer):
    class Hangs(Tool):
        name, description, parameters = "hang", "never returns", {"type": "object"}

        async def call(self, arguments):
            await asyncio.Event().wait()

    engine = ScriptedEngine(tokenizer, {0: [call("hang"), "gave up"]})
    (episode,) = run(make_loop(tokenizer, engine, [Hangs()], tool_timeout_s=0.05), tokenizer, 1)
    assert episode.tool_errors == {"hang": 1} and episode.ended == "answer"
    assert "took longer than 0.05 s" in tokenizer.decode(episode.response, skip_special_tokens=False)


def test_max_turns_and_the_length_budget_end_episodes(tokenizer):
    engine = ScriptedEngine(tokenizer, {0: [call("add", a=1, b=2)] * 5, 1: ["x" * 500 + "…"]})
    episodes = run(make_loop(tokenizer, engine, [Adder()], max_turns=3, max_response_length=400), tokenizer, 2)
    assert (episodes[0].turns, episodes[0].ended) == (3, "max_turns")
    assert episodes[0].model_mask[-1] == 1  # no tool answer is added after the last turn
    assert (episodes[1].ended, len(episodes[1].response)) == ("length", 400)
    # A tool answer that would leave the model no token is not added.
    engine = ScriptedEngine(tokenizer, {0: [call("add", a=1, b=2), "3"]})
    first_turn = len(tokenizer(call("add", a=1, b=2), add_special_tokens=False)["input_ids"]) + 1
    (episode,) = run(make_loop(tokenizer, engine, [Adder()], max_response_length=first_turn + 5), tokenizer, 1)
    assert episode.ended == "length" and len(episode.response) == first_turn


def test_long_tool_output_is_cut(tokenizer):
    class Chatty(Tool):
        name, description, parameters = "chatty", "talks", {"type": "object"}

        async def call(self, arguments):
            return ToolResult("y" * 100)

    engine = ScriptedEngine(tokenizer, {0: [call("chatty"), "ok"]})
    (episode,) = run(make_loop(tokenizer, engine, [Chatty()], max_tool_response_tokens=10), tokenizer, 1)
    text = tokenizer.decode(episode.response, skip_special_tokens=False)
    assert "<tool>" + "y" * 10 + "\n[90 more tokens cut]<eos>" in text


def test_an_environment_answers_between_turns(tokenizer):
    class Checker(Environment):
        async def respond(self, final_text, *, turn, context):
            if final_text.strip() == context.ground_truth:
                return EnvironmentReply(done=True)
            return EnvironmentReply(done=False, message="wrong, again")

    engine = ScriptedEngine(tokenizer, {0: ["4", "3"], 1: ["5", "6", "7"]})
    context = EpisodeContext("3", "test")
    episodes = run(
        make_loop(tokenizer, engine, [], environment=Checker(), max_turns=3), tokenizer, 2, contexts=[context] * 2
    )
    assert [(e.turns, e.ended) for e in episodes] == [(2, "answer"), (3, "max_turns")]
    text = tokenizer.decode(episodes[0].response, skip_special_tokens=False)
    assert text == "4<eos><user>wrong, again<eos><assistant>3<eos>"
    assert episodes[0].model_mask == [1, 1] + [0] * (len(episodes[0].response) - 4) + [1, 1]


def test_an_environment_that_does_not_answer_in_time_ends_the_episode(tokenizer):
    class Stuck(Environment):
        async def respond(self, final_text, *, turn, context):
            await asyncio.Event().wait()

    engine = ScriptedEngine(tokenizer, {0: ["4"]})
    loop = make_loop(tokenizer, engine, [], environment=Stuck(), tool_timeout_s=0.05)
    (episode,) = run(loop, tokenizer, 1, contexts=[EpisodeContext("3", "test")])
    assert (episode.turns, episode.ended) == (1, "environment_timeout")


def test_an_engine_that_drops_a_request_fails_the_rollout_instead_of_hanging(tokenizer):
    class Dropping(ScriptedEngine):
        def has_unfinished(self) -> bool:
            return False  # as if the engine had aborted every queued request

    loop = make_loop(tokenizer, Dropping(tokenizer, {0: ["4"]}), [])
    with pytest.raises(RuntimeError, match="without answering 1 turn request"):
        run(loop, tokenizer, 1)
