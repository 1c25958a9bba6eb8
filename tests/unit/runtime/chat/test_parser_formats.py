"""The tool-call formats beside hermes (Qwen3-Coder XML, Llama-3 JSON) and the reasoning formats: calls in
order, each wrong call a message for the model, the text without its calls as the answer's content."""

import pytest

from rldock.runtime.chat.parsers import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    HermesParser,
    Llama3JsonParser,
    NoReasoning,
    ParsedTurn,
    Qwen3CoderParser,
    ThinkReasoning,
    ToolCall,
)


def test_each_format_is_registered_by_its_config_name():
    assert TOOL_CALL_PARSERS.get("qwen3_coder") is Qwen3CoderParser
    assert TOOL_CALL_PARSERS.get("llama3_json") is Llama3JsonParser
    assert REASONING_PARSERS.get("think") is ThinkReasoning and REASONING_PARSERS.get("none") is NoReasoning
    with pytest.raises(ValueError, match="agent.reasoning_format"):
        REASONING_PARSERS.get("harmony")


QWEN3_CODER_TURN = (
    "Let me look.\n<tool_call>\n<function=search>\n<parameter=query>\nrldock gateway\n</parameter>\n"
    "<parameter=limit>\n3\n</parameter>\n</function>\n</tool_call>\n"
    "<tool_call>\n<function=python>\n<parameter=code>\nprint(1)\nprint(2)\n</parameter>\n</function>\n</tool_call>"
)


def test_qwen3_coder_calls_with_typed_and_multiline_values():
    parsed = Qwen3CoderParser().parse(QWEN3_CODER_TURN)
    assert parsed.calls == (
        ToolCall("search", {"query": "rldock gateway", "limit": 3}),
        ToolCall("python", {"code": "print(1)\nprint(2)"}),
    )
    assert Qwen3CoderParser().content(QWEN3_CODER_TURN) == "Let me look."


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("<tool_call>\n<function=search>\n<parameter=q>\nx\n</parameter>\n</function>", "no closing"),
        ("<tool_call>\nsearch(q=x)\n</tool_call>", "<function=NAME>"),
    ],
)
def test_qwen3_coder_wrong_calls_are_messages(text, says):
    parsed = Qwen3CoderParser().parse(text)
    assert parsed.calls == () and len(parsed.malformed) == 1 and says in parsed.malformed[0]


def test_llama3_json_calls_after_the_python_tag_and_joined_by_semicolons():
    text = '<|python_tag|>{"name": "search", "parameters": {"query": "a;b"}}; {"name": "calc", "parameters": {}}'
    parsed = Llama3JsonParser().parse(text)
    assert parsed.calls == (ToolCall("search", {"query": "a;b"}), ToolCall("calc", {}))
    assert Llama3JsonParser().content(text) == ""


def test_llama3_json_text_is_a_final_answer_and_a_wrong_object_a_message():
    assert Llama3JsonParser().parse("The answer is 4.") == ParsedTurn()
    assert Llama3JsonParser().content("The answer is 4.") == "The answer is 4."
    parsed = Llama3JsonParser().parse('{"parameters": {}}')
    assert parsed.calls == () and 'no "name"' in parsed.malformed[0]
    assert "not valid JSON" in Llama3JsonParser().parse('{"name": "x", ').malformed[0]


def test_hermes_content_is_the_text_around_the_calls():
    text = 'Computing.\n<tool_call>{"name": "calc", "arguments": {}}</tool_call>'
    assert HermesParser().content(text) == "Computing."


@pytest.mark.parametrize(
    ("text", "reasoning", "answer"),
    [
        ("<think>\nadd 2 and 3\n</think>\n\n5", "add 2 and 3", "5"),
        ("add 2 and 3</think>5", "add 2 and 3", "5"),  # the template's generation prompt opened <think>
        ("<think>still going", "still going", ""),  # cut by the length limit
        ("5", None, "5"),
    ],
)
def test_think_reasoning_is_split_from_the_answer(text, reasoning, answer):
    assert ThinkReasoning().split(text) == (reasoning, answer)
    assert NoReasoning().split(text) == (None, text)
