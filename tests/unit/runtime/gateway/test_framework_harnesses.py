"""A LangGraph agent, written as for any OpenAI endpoint, runs an episode through the gateway: its tool call
answered in OpenAI's shape, its echoed history recognised (one segment, not re-rendered), the row exactly the
sampled ids. The engine is the scripted test double (rldock_e2e.doubles.scripted_engine); LangGraph,
langchain-openai, the HTTP server and the chat template are real."""

from __future__ import annotations

import importlib.util
import string

from test_gateway import REPO, job

from rldock.runtime.gateway.episodes import GatewayEpisodes
from rldock.runtime.models.tiny import CHAT_TEMPLATE, train_char_tokenizer
from rldock_e2e.doubles.scripted_engine import ScriptedEngine

EXAMPLE = REPO / "examples" / "harnesses" / "langgraph_agent.py"  # the user's program, outside the product
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def test_a_langgraph_react_agent_trains_one_exact_segment(tmp_path):
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    cfg = job(harness=f"{EXAMPLE}:run")
    episodes = GatewayEpisodes(cfg, tokenizer=tokenizer, prompt_capacity=64)
    try:
        engine = ScriptedEngine(tokenizer, {0: [CALL, "The sum is 5"]})
        task = {"prompt": "What is 2 + 3?", "ground_truth": "5"}
        (result,) = episodes.run(engine, tasks=[task], prompts=[[1]], keys=[0], seed=0)
    finally:
        episodes.close()
    assert result.ended == "harness_done" and result.rewards == [1.0]
    assert result.turns == 2 and result.tool_calls == 1
    assert result.segments == ["start"] and result.exact
    # the second turn's prompt held the first turn as sampled, then LangGraph's tool result (add's 5.0)
    second_prompt = engine.prompts[(0, 2)]
    first_turn = tokenizer(CALL, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert second_prompt[: len(engine.prompts[(0, 1)])] == engine.prompts[(0, 1)]
    assert second_prompt[len(engine.prompts[(0, 1)]) :][: len(first_turn)] == first_turn
    assert (
        tokenizer.decode(second_prompt[len(engine.prompts[(0, 1)]) + len(first_turn) :]) == "<tool>5.0<eos><assistant>"
    )


def test_the_example_harness_is_the_users_program_not_a_module_of_the_product():
    assert importlib.util.find_spec("rldock.runtime.gateway.examples") is None
    assert EXAMPLE.is_file()


CABINET = REPO / "examples" / "harnesses" / "langgraph_cabinet.py"


def test_a_langgraph_graph_solves_a_cabinet_task_in_three_exact_turns():
    from rldock.runtime.agent.examples.cabinet import build_cabinet
    from rldock.runtime.agent.examples.cabinet_tasks import cabinet_row

    row = cabinet_row(7, num_files=4, num_lines=3)
    cabinet = build_cabinet(7, num_files=4, num_lines=3)
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    episodes = GatewayEpisodes(job(harness=f"{CABINET}:run"), tokenizer=tokenizer, prompt_capacity=256)
    turns = ["ls", f"cat {cabinet.file}", f"#### {cabinet.answer}"]
    try:
        engine = ScriptedEngine(tokenizer, {0: turns})
        task = {"prompt": row["prompt"], "ground_truth": row["answer"], "extra_info": row["extra_info"]}
        (result,) = episodes.run(engine, tasks=[task], prompts=[[1]], keys=[0], seed=0)
    finally:
        episodes.close()
    assert result.ended == "harness_done" and result.rewards == [1.0]
    assert result.turns == 3 and result.segments == ["start"] and result.exact
    # the shell's answers reached the model as user turns: the listing before `cat`, the file before the answer
    assert cabinet.listing() in tokenizer.decode(engine.prompts[(0, 2)])
    assert cabinet.files[cabinet.file] in tokenizer.decode(engine.prompts[(0, 3)])


def test_a_wrong_code_scores_0_and_a_graph_that_never_answers_stops_at_four_turns():
    from rldock.runtime.agent.examples.cabinet_tasks import cabinet_row

    row = cabinet_row(7, num_files=4, num_lines=3)
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    episodes = GatewayEpisodes(job(harness=f"{CABINET}:run"), tokenizer=tokenizer, prompt_capacity=256)
    task = {"prompt": row["prompt"], "ground_truth": row["answer"], "extra_info": row["extra_info"]}
    try:
        wrong = ScriptedEngine(tokenizer, {0: ["#### 0000"]})
        (answered,) = episodes.run(wrong, tasks=[task], prompts=[[1]], keys=[0], seed=0)
        looping = ScriptedEngine(tokenizer, {0: ["ls"] * 6})
        (unanswered,) = episodes.run(looping, tasks=[task], prompts=[[1]], keys=[0], seed=0)
    finally:
        episodes.close()
    assert answered.rewards == [0.0] and answered.turns == 1
    assert unanswered.rewards == [0.0] and unanswered.turns == 4
