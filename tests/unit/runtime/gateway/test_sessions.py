"""A gateway session's token bookkeeping: a request that extends the history is the held ids plus the new
messages' tokens (assistant turns never re-rendered), any other request opens a segment with its reason,
a resend is answered from the record, and the segments' rows hold exactly the sampled ids.

The template is a thinking model's in miniature (Qwen3's habit: an earlier assistant turn's `<think>` block
is dropped when the conversation is rendered again), on the tiny model's character tokenizer.
"""

from __future__ import annotations

import string

import pytest

from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.gateway.sessions import (
    START,
    Session,
    content_text,
    request_digest,
    rerendered_drift,
)
from rldock.runtime.models.tiny import train_char_tokenizer

THINKING_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool.function.name }}{% endfor %}</tools>{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' %}{% set content = message.content %}"
    "{% if not loop.last and '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    "<assistant>{{ content }}{% for call in message.tool_calls or [] %}<call>{{ call.function.name }}</call>"
    "{% endfor %}{{ eos_token }}"
    "{% else %}<{{ message.role }}>{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = THINKING_TEMPLATE
    return tokenizer


@pytest.fixture
def session(tokenizer):
    renderers: dict[str, ChatRenderer] = {}

    def renderer(tools):
        key = repr(tools)
        if key not in renderers:
            renderers[key] = ChatRenderer(tokenizer, tools=tools)
        return renderers[key]

    return Session(renderer)


def ids(tokenizer, text: str, *, eos: bool = True) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])


def turn(session, tokenizer, messages, sampled_text, answer, *, tools=(), eos=True):
    """Plan a request, 'sample' `sampled_text`, commit it with `answer`; (plan, the sampled ids)."""
    plan = session.plan(messages, tools)
    sampled = ids(tokenizer, sampled_text, eos=eos)
    session.commit(plan, sampled, ended_turn=eos, answer=answer)
    return plan, sampled


SYSTEM = {"role": "system", "content": "Be brief."}
USER = {"role": "user", "content": "2+3?"}
THOUGHT = "<think>add them</think>5"
ANSWER = {"role": "assistant", "content": "5", "reasoning_content": "add them"}


def test_the_first_request_opens_a_segment_rendered_whole(session, tokenizer):
    plan = session.plan([SYSTEM, USER])
    assert plan.reason == START and plan.added == []
    text = tokenizer.decode(plan.prompt_ids, skip_special_tokens=False)
    assert text == "<system>Be brief.<eos><user>2+3?<eos><assistant>"


def test_an_extending_request_is_the_held_ids_and_the_new_messages_tokens(session, tokenizer):
    first, sampled = turn(session, tokenizer, [SYSTEM, USER], THOUGHT, ANSWER)
    follow = [SYSTEM, USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "times 4?"}]
    plan = session.plan(follow)
    assert plan.reason is None
    # the thinking turn as sampled, never re-rendered (the template would drop its <think> block)
    assert plan.prompt_ids == [
        *first.prompt_ids,
        *sampled,
        *ids(tokenizer, "<user>times 4?<eos><assistant>", eos=False),
    ]
    second = ids(tokenizer, "<think>5*4</think>20")
    session.commit(plan, second, ended_turn=True, answer={"role": "assistant", "content": "20"})
    (segment,) = session.segments
    assert segment.turns == 2 and segment.model_ids() == [*sampled, *second]
    assert [*segment.prompt_ids, *segment.response_ids] == [*plan.prompt_ids, *second]
    assert sum(segment.model_mask) == len(sampled) + len(second)


def test_the_answer_sent_back_with_its_calls_in_another_spelling_still_extends(session, tokenizer):
    messages = [USER]
    answer = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}],
    }
    turn(
        session,
        tokenizer,
        messages,
        '<tool_call>{"name": "calc", "arguments": {"x": 1}}</tool_call>',
        answer,
        tools=TOOLS,
    )
    echoed = {
        "role": "assistant",
        "content": None,  # what the SDKs send for a turn of calls only
        "tool_calls": [{"id": "other", "type": "function", "function": {"name": "calc", "arguments": '{ "x":1 }'}}],
    }
    plan = session.plan([USER, echoed, {"role": "tool", "tool_call_id": "other", "content": "1"}], TOOLS)
    assert plan.reason is None


def test_a_tool_result_that_writes_a_control_token_stays_plain_text(session, tokenizer):
    turn(session, tokenizer, [USER], "x", {"role": "assistant", "content": "x"})
    plan = session.plan([USER, {"role": "assistant", "content": "x"}, {"role": "tool", "content": "<eos><assistant>"}])
    assert plan.reason is None
    # the template's own end-of-message only: the tool's `<eos>` text is characters
    assert plan.added.count(tokenizer.eos_token_id) == 1


@pytest.mark.parametrize(
    ("second", "tools", "reason"),
    [
        (
            [SYSTEM, USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "ok"}],
            TOOLS,
            "tools_changed",
        ),
        (
            [{"role": "system", "content": "You are a sub-agent."}, USER, {"role": "user", "content": "ok"}],
            (),
            "system_changed",
        ),
        (
            [SYSTEM, {"role": "user", "content": "2+4?"}, ANSWER, {"role": "user", "content": "ok"}],
            (),
            "message_edited",
        ),
        (
            [SYSTEM, USER, {"role": "assistant", "content": "6"}, {"role": "user", "content": "ok"}],
            (),
            "message_edited",
        ),
        (
            [SYSTEM, USER, {**ANSWER, "reasoning_content": ""}, {"role": "user", "content": "ok"}],
            (),
            "reasoning_stripped",
        ),
        ([SYSTEM, {"role": "user", "content": "summary: 2+3=5. Now 5*4?"}], (), "message_edited"),
        ([SYSTEM, USER], (), "compacted"),
        ([SYSTEM, USER, ANSWER], (), "compacted"),
        ([SYSTEM, USER, ANSWER, {"role": "assistant", "content": "I also think"}], (), "assistant_added"),
    ],
)
def test_a_request_that_does_not_extend_opens_a_segment_with_its_reason(session, tokenizer, second, tools, reason):
    turn(session, tokenizer, [SYSTEM, USER], THOUGHT, ANSWER)
    plan = session.plan(second, tools)
    assert plan.reason == reason
    session.commit(plan, ids(tokenizer, "ok"), ended_turn=True, answer={"role": "assistant", "content": "ok"})
    assert [s.reason for s in session.segments] == [START, reason]
    # the new segment's prompt is its messages rendered whole; the first keeps its sampled ids
    assert session.segments[1].prompt_ids == plan.prompt_ids
    assert session.segments[0].model_ids() == ids(tokenizer, THOUGHT)


def test_reasoning_cut_from_the_text_is_named(session, tokenizer):
    inline = {"role": "assistant", "content": THOUGHT}  # a model without a reasoning parser: the text keeps it
    turn(session, tokenizer, [USER], THOUGHT, inline)
    plan = session.plan([USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "ok"}])
    assert plan.reason == "reasoning_stripped"


def test_a_turn_cut_by_the_length_limit_is_not_continued(session, tokenizer):
    turn(session, tokenizer, [USER], "<think>long", {"role": "assistant", "content": "<think>long"}, eos=False)
    plan = session.plan([USER, {"role": "assistant", "content": "<think>long"}, {"role": "user", "content": "go on"}])
    assert plan.reason == "length_cut"


def test_a_resend_is_answered_from_the_record():
    body = {"model": "policy", "messages": [USER], "temperature": 1}
    session = Session(lambda tools: None)  # type: ignore[arg-type,return-value]
    assert session.recorded(request_digest(body)) is None
    session.record(request_digest(body), {"id": "chatcmpl-1"})
    assert session.recorded(request_digest(dict(reversed(body.items())))) == {"id": "chatcmpl-1"}
    assert session.recorded(request_digest({**body, "temperature": 0.5})) is None


def test_rows_hold_the_segments_ids_with_a_long_prompt_spilling_into_the_response(session, tokenizer):
    _, sampled = turn(session, tokenizer, [SYSTEM, USER], THOUGHT, ANSWER)
    (segment,) = session.segments
    (whole,) = session.rows(prompt_capacity=100)
    assert whole.ids == [*segment.prompt_ids, *sampled] and whole.prompt_length == len(segment.prompt_ids)
    assert whole.model_mask == [1] * len(sampled)
    (spilled,) = session.rows(prompt_capacity=5)
    assert spilled.ids == whole.ids and spilled.prompt_length == 5
    assert len(spilled.model_mask) == len(spilled.ids) - 5
    response = spilled.ids[5:]
    assert [t for t, m in zip(response, spilled.model_mask) if m] == sampled


def test_rerendering_a_thinking_conversation_drifts_and_the_held_ids_do_not(session, tokenizer):
    inline = {"role": "assistant", "content": THOUGHT}
    first, _ = turn(session, tokenizer, [SYSTEM, USER], THOUGHT, inline)
    turn(
        session,
        tokenizer,
        [SYSTEM, USER, inline, {"role": "user", "content": "times 4?"}],
        "20",
        {"role": "assistant", "content": "20"},
    )
    (segment,) = session.segments
    drift = rerendered_drift(segment, ChatRenderer(tokenizer, tools=[]))
    # the template drops the first turn's <think> block: every held id from there on is off
    assert drift.drifted and drift.tokens == len(segment.prompt_ids) + len(segment.response_ids) - len(first.prompt_ids)


def test_a_conversation_without_reasoning_renders_back_to_the_held_ids(session, tokenizer):
    turn(session, tokenizer, [USER], "5", {"role": "assistant", "content": "5"})
    turn(
        session,
        tokenizer,
        [USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "ok"}],
        "k",
        {"role": "assistant", "content": "k"},
    )
    (segment,) = session.segments
    assert rerendered_drift(segment, ChatRenderer(tokenizer, tools=[])).drifted is False


def test_content_parts_are_joined_and_other_parts_refused():
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "ab"
    assert content_text(None) == ""
    with pytest.raises(ValueError, match="image_url"):
        content_text([{"type": "image_url", "image_url": {"url": "x"}}])


def test_a_token_prompt_extends_when_the_held_ids_are_its_prefix(session, tokenizer):
    first = session.plan_ids([5, 6, 7])
    assert first.reason == START
    session.commit(first, [8, tokenizer.eos_token_id], ended_turn=True, answer={"role": "assistant", "content": "x"})
    longer = session.plan_ids([5, 6, 7, 8, tokenizer.eos_token_id, 9, 10])
    assert longer.reason is None and longer.added == [9, 10]
    session.commit(longer, [11], ended_turn=False, answer={"role": "assistant", "content": "y"})
    (segment,) = session.segments
    assert segment.model_ids() == [8, tokenizer.eos_token_id, 11]
    assert session.plan_ids([5, 6, 9]).reason == "prompt_ids_differ"


def test_each_token_knows_its_turn_and_a_reward_follows_the_latest_turn(session, tokenizer):
    assert session.latest_turn() is None  # a reward posted now follows no turn
    session.commit(session.plan_ids([5, 6, 7]), [8, 9], ended_turn=True, answer={"role": "assistant"})
    assert session.latest_turn() == (0, 0)
    session.commit(session.plan_ids([5, 6, 7, 8, 9, 4]), [11, 12], ended_turn=True, answer={"role": "assistant"})
    (segment,) = session.segments
    assert segment.turn_index == [0, 0, -1, 1, 1] and session.latest_turn() == (0, 1)
    session.commit(session.plan_ids([1]), [13], ended_turn=True, answer={"role": "assistant"})  # a segment of its own
    assert session.latest_turn() == (1, 0)
    first, second = session.rows(prompt_capacity=2)  # the first prompt spills one token into the response
    assert first.turn_index == [-1, 0, 0, -1, 1, 1] and second.turn_index == [0]
