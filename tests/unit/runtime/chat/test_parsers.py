"""The `hermes` tool-call parser: calls found in order, every wrong call a message for the model, never a raise."""

import pytest

from rldock.runtime.chat.parsers import TOOL_CALL_PARSERS, HermesParser, ParsedTurn, ToolCall


def parse(text: str) -> ParsedTurn:
    return HermesParser().parse(text)


def test_hermes_is_the_registered_parser_of_its_format():
    assert TOOL_CALL_PARSERS.get("hermes") is HermesParser


def test_text_without_tags_is_a_final_answer():
    parsed = parse("The sum is 12.\n#### 12<|im_end|>")
    assert parsed == ParsedTurn() and not parsed.wants_tools


def test_one_call_with_the_text_around_it():
    parsed = parse('Let me compute.\n<tool_call>{"name": "calculator", "arguments": {"expression": "3*4"}}</tool_call>')
    assert parsed == ParsedTurn(calls=(ToolCall("calculator", {"expression": "3*4"}),))


def test_two_calls_in_one_turn_keep_their_order():
    text = (
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>\n'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call>'
    )
    assert [call.name for call in parse(text).calls] == ["python", "calculator"]


def test_whitespace_and_newlines_inside_the_tags_as_qwen_writes_them():
    text = '<tool_call>\n  {"name": "python",\n   "arguments": {"code": "x = 1\\nprint(x)"}}\n</tool_call><|im_end|>'
    assert parse(text).calls == (ToolCall("python", {"code": "x = 1\nprint(x)"}),)


def test_arguments_written_as_a_json_string_holding_an_object():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    assert parse(text).calls == (ToolCall("calculator", {"expression": "1+1"}),)


@pytest.mark.parametrize(
    "body, words",
    [
        ('{"name": "python", "arguments": {"code": "1"}', "is not valid JSON: Expecting"),
        ('["python", {}]', "is a JSON array, not an object"),
        ('{"arguments": {}}', 'has no "name"'),
        ('{"name": 3, "arguments": {}}', 'has no "name"'),
        ('{"name": "python"}', 'has no "arguments"'),
        ('{"name": "python", "arguments": [1]}', '"arguments" that are not a JSON object'),
        ('{"name": "python", "arguments": "not json"}', '"arguments" that are not a JSON object'),
        ('{"name": "python", "arguments": "[1]"}', '"arguments" that are not a JSON object'),
        ("[" * 100_000, "is not valid JSON"),  # nesting deeper than the stack
    ],
)
def test_a_wrong_call_is_a_message_that_says_what_is_wrong_and_how_to_write_one(body, words):
    parsed = parse(f"<tool_call>{body}</tool_call>")
    assert parsed.calls == () and len(parsed.malformed) == 1 and parsed.wants_tools
    message = parsed.malformed[0]
    assert message.startswith("tool call 1 ") and words in message
    assert message.endswith('write <tool_call>{"name": "...", "arguments": {...}}</tool_call>')


def test_an_opening_tag_without_a_closing_one():
    parsed = parse('<tool_call>{"name": "python", "arguments": {}}')
    assert parsed.calls == () and parsed.malformed[0].startswith("tool call 1 has no closing </tool_call>")


def test_an_unclosed_call_before_a_good_one_is_counted_and_the_good_one_kept():
    parsed = parse('<tool_call>{"name": "a"\n<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    assert parsed.calls == (ToolCall("b", {}),)
    assert len(parsed.malformed) == 1 and parsed.malformed[0].startswith("tool call 1 has no closing")


def test_good_and_bad_calls_are_numbered_in_the_order_written():
    parsed = parse('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>oops</tool_call>')
    assert parsed.calls == (ToolCall("a", {}),)
    assert parsed.malformed[0].startswith("tool call 2 is not valid JSON")


def test_a_closing_tag_alone_is_text():
    assert parse("done </tool_call> #### 3") == ParsedTurn()
