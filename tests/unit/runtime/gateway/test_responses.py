"""The Responses API on the gateway (gateway/responses.py): a stock `openai.AsyncOpenAI` harness calling
`client.responses.create` as the OpenAI Agents SDK's default model does (a model name of its own, the whole
input list each request, or only the new items after previous_response_id, or a stream) trains on exactly
the ids the engine sampled, as a chat harness does; its input items become the chat messages the session
renders; each request it cannot serve is a 400 naming the field.

The engine is the scripted test double (rldock_e2e.doubles.scripted_engine); the HTTP server, the client,
the sessions, the parsers and the chat template are the real ones.
"""

from __future__ import annotations

import pytest
from test_gateway import CALL, USER, episodes, post, seen, served, tasks_of, tokenizer  # noqa: F401 - the fixtures

from rldock.runtime.gateway.answers import RequestError
from rldock.runtime.gateway.responses import input_messages, responses_request
from rldock_e2e.doubles.scripted_engine import ScriptedEngine


@pytest.mark.parametrize("mode", ["responses", "responses_chained"])
def test_a_responses_harness_of_tool_calls_trains_on_exactly_the_sampled_ids(episodes, tokenizer, tmp_path, mode):  # noqa: F811
    runner = episodes()
    tasks, out = tasks_of(tmp_path, mode)
    (result,) = runner.run(ScriptedEngine(tokenizer, {7: [CALL, "5"]}), tasks=tasks, prompts=[[1, 2]], keys=[7], seed=3)
    assert result.ended == "harness_done" and result.turns == 2 and result.tool_calls == 1
    assert result.rewards == [1.0] and result.segments == ["start"] and result.exact
    first, second = seen(out)[mode]
    (call,) = first["output"]  # the call parsed into a function_call item; no text beside it
    assert call["type"] == "function_call" and (call["name"], call["arguments"]) == ("add", '{"a": 2, "b": 3}')
    assert first["status"] == "completed" and first["model"] == "policy"
    assert first["token_ids"] == [*tokenizer(CALL, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    assert first["usage"]["output_tokens"] == len(first["token_ids"])
    # the second turn continued the first exactly: its prompt is the first's, its sampled ids, then the tool's
    assert second["prompt_token_ids"][: len(first["prompt_token_ids"])] == first["prompt_token_ids"]
    after = second["prompt_token_ids"][len(first["prompt_token_ids"]) :]
    assert after[: len(first["token_ids"])] == first["token_ids"]
    assert tokenizer.decode(after[len(first["token_ids"]) :]) == "<tool>5<eos><assistant>"
    assert [item["type"] for item in second["output"]] == ["message"] and second["output"][0]["content"][0][
        "text"
    ] == "5"
    # the function tool reached the template as a chat tool; the instructions are the system message
    prompt = "<tools>add</tools><system>Use the tool.<eos><user>2+3?<eos><assistant>"
    assert tokenizer.decode(first["prompt_token_ids"]) == prompt
    row = result.row
    assert row.ids == [*second["prompt_token_ids"], *second["token_ids"]]


def test_the_whole_input_list_and_previous_response_id_give_the_same_rows(episodes, tokenizer, tmp_path):  # noqa: F811
    rows = {}
    for mode in ("responses", "responses_chained"):
        runner = episodes()
        tasks, _ = tasks_of(tmp_path / mode, mode)
        (tmp_path / mode).mkdir()
        (result,) = runner.run(
            ScriptedEngine(tokenizer, {7: [CALL, "5"]}), tasks=tasks, prompts=[[1, 2]], keys=[7], seed=3
        )
        rows[mode] = (result.row.ids, result.row.model_mask)
    assert rows["responses"] == rows["responses_chained"]


def test_a_responses_stream_carries_the_same_answer(episodes, tokenizer, tmp_path):  # noqa: F811
    runner = episodes()
    tasks, out = tasks_of(tmp_path, "responses_stream")
    (result,) = runner.run(
        ScriptedEngine(tokenizer, {1: ["the sum is 5"]}), tasks=tasks, prompts=[[1]], keys=[1], seed=0
    )
    assert seen(out)["responses_stream"] == [["the sum is 5", "the sum is 5"]] and result.ended == "harness_done"


def test_input_items_become_the_chat_messages_of_the_conversation():
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "2+"}, {"type": "input_text", "text": "3?"}],
        },
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "add them"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"a": 0, "b": 0}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "0"}]},
        {"type": "function_call", "call_id": "c3", "name": "add", "arguments": "{}"},
    ]
    call = lambda i, arguments: {"id": f"c{i}", "type": "function", "function": {"name": "add", "arguments": arguments}}  # noqa: E731
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "Let me add.",
            "reasoning_content": "add them",
            "tool_calls": [call(1, '{"a": 2, "b": 3}'), call(2, '{"a": 0, "b": 0}')],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": "0"},
        {"role": "assistant", "content": None, "tool_calls": [call(3, "{}")]},  # a turn of calls alone
    ]


def test_previous_response_id_continues_that_conversation_and_instructions_do_not_carry_over():
    held = {"resp-1": [{"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "5"}]}
    body = {"previous_response_id": "resp-1", "input": "Sure?", "instructions": "Check."}
    request = responses_request(body, served=(), previous=held.get)
    assert request.chat.messages == [
        {"role": "system", "content": "Check."},
        *held["resp-1"],
        {"role": "user", "content": "Sure?"},
    ]
    assert request.conversation == request.chat.messages[1:]  # what the next previous_response_id continues
    with pytest.raises(RequestError) as refused:
        responses_request({**body, "previous_response_id": "resp-9"}, served=(), previous=held.get)
    assert refused.value.param == "previous_response_id"


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "2+3?", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools are served"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
            "text parts only",
        ),
        ({"input": [{"type": "computer_call"}]}, "input[0].type", "'computer_call' is not served"),
        ({"input": "2+3?", "text": {"format": {"type": "json_schema"}}}, "text.format", "guided decoding"),
        ({"input": "2+3?", "tool_choice": "required"}, "tool_choice", "guided decoding"),
        ({"input": "2+3?", "max_output_tokens": 0}, "max_output_tokens", "positive integer"),
        ({"input": []}, "input", "non-empty"),
        ({"input": [{"role": "tool", "content": "5"}]}, "input[0].role", "not one of"),
    ],
)
def test_a_responses_request_the_gateway_cannot_serve_is_a_400_naming_the_field(served, body, param, words):  # noqa: F811
    url, key, engine, _, _ = served
    answer = post(f"{url}/responses", key, {"model": "gpt-4o-mini", **body})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert engine.submitted == 0


def test_a_responses_answer_cut_by_its_limit_is_incomplete(served):  # noqa: F811
    url, key, engine, _, _ = served
    answer = post(f"{url}/responses", key, {"input": USER, "max_output_tokens": 1})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["status"] == "incomplete" and body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert len(body["token_ids"]) == 1 and body["object"] == "response"


def test_an_episode_keeps_its_latest_responses_for_previous_response_id(served, monkeypatch):  # noqa: F811
    from rldock.runtime.gateway import server

    monkeypatch.setattr(server, "RESPONSES_KEPT", 2)
    url, key, engine, _, _ = served
    ids, previous = [], None
    for _ in range(3):  # a chain of three turns, each continuing the one before
        body = {"input": "Sure?", **({"previous_response_id": previous} if previous else {})}
        answer = post(f"{url}/responses", key, body)
        assert answer.status_code == 200, answer.text
        previous = answer.json()["id"]
        ids.append(previous)
    refused = post(f"{url}/responses", key, {"input": "Again?", "previous_response_id": ids[0]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "previous_response_id"
    assert post(f"{url}/responses", key, {"input": "Again?", "previous_response_id": ids[2]}).status_code == 200
