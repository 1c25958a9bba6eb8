"""A multi-turn conversation as the policy sees it: token ids, and which of them are the model's own.

The trajectory is built from pieces, never re-tokenized as a whole: the rendered prompt, then for each
turn the tokens the engine sampled (EOS included) and, between turns, the tokens of the tool or
environment messages as the chat template writes them after an assistant turn, up to and including
the next generation prompt. The trainer scores exactly the ids the engine sampled, and a tokenizer
that would merge characters across a turn boundary cannot shift a mask.

The template's text for the messages between turns is found by difference: a fixed conversation
ending in an assistant turn is rendered with and without the new messages (and the generation
prompt); the new messages' text is what follows that assistant turn's end-of-turn token. Templates
that write each message on its own (ChatML and its relatives: SmolLM2, Qwen2.5, Qwen3, Hermes)
render it the same whatever came before.

A template that ignores `tools=` (SmolLM2's, the tiny demo's has its own) gets the tools described
in a system message in the Hermes format instead, so the model is always told what it can call and
how to write a call.

With an environment (`opens_with_environment`) the prompt ends before the generation prompt: the
response opens with the environment's reset message, if any, as a `user` message, then the generation
prompt (`opening`), found by difference after a fixed user message as the messages between turns are.

A tool's or an environment's text is data, never markup: the messages between turns are rendered with a
placeholder for each message's text, the template's own text tokenized as usual (its special tokens are
control tokens) and each message's text tokenized with special tokens as plain text (`plain_ids`), so an
observation that writes `<|im_end|>` or `<eos>` cannot end a turn or forge one in the token ids. The text
goes in verbatim where the placeholder was: a template that changes a message's text (a `trim`) is not
applied to it.

Cost: linear in the rendered text. The slots are found in one pass (`_fill`), and the pieces are tokenized in
two calls of the tokenizer, the template's text and the messages' texts, not two per message.

Threads: encoding takes the tokenizer's lock (`encode_lock`). A Hugging Face fast tokenizer sets a flag of
its Rust tokenizer on each call (`split_special_tokens`), so two threads encoding at once, one a message's
text as plain text and one the template's markup, could each encode under the other's setting: a message's
`<|im_end|>` read as the control token. The gateway renders on a pool of threads (gateway/server.py).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

_PROBE_SYSTEM, _PROBE_USER, _PROBE_ANSWER = "S", "U", "A"
# Stands for the i-th message's text while the template renders: characters no template writes itself.
_SLOT = "\ue000rldock-message-{}\ue001"


_ENCODE_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_ENCODE_LOCKS_LOCK = threading.Lock()


def encode_lock(tokenizer) -> threading.Lock:
    """The lock every encoding with `tokenizer` takes here (one per tokenizer object; see the module's
    docstring, "Threads")."""
    with _ENCODE_LOCKS_LOCK:
        lock = _ENCODE_LOCKS.get(tokenizer)
        if lock is None:
            lock = _ENCODE_LOCKS[tokenizer] = threading.Lock()
        return lock


def encode(tokenizer, texts: Sequence[str], *, plain: bool) -> list[list[int]]:
    """Token ids of each of `texts`, in one call of the tokenizer, no special tokens added: with `plain`,
    any special token's text in them as ordinary characters (a Hugging Face tokenizer's
    `split_special_tokens`: text that came from outside the model), else as the control tokens (the
    template's markup)."""
    if not texts:
        return []
    options = {"split_special_tokens": True} if plain else {}
    with encode_lock(tokenizer):
        return tokenizer(list(texts), add_special_tokens=False, **options)["input_ids"]


def plain_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text` with any special token's text in it tokenized as ordinary characters: text that
    came from outside the model."""
    return encode(tokenizer, [text], plain=True)[0]


def markup_ids(tokenizer, text: str) -> list[int]:
    """Token ids of `text`, the template's own text, its special tokens' text the control tokens."""
    return encode(tokenizer, [text], plain=False)[0]


def tools_system_text(tools: Sequence[dict]) -> str:
    """The Hermes-format description of `tools` for a template that does not render them itself."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        "You can call functions to help with the user's request. Their signatures are in <tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n"
        "To call one, write a JSON object with its name and arguments inside <tool_call></tool_call> tags, "
        'like <tool_call>{"name": "<function-name>", "arguments": {<arguments>}}</tool_call>, and end your '
        "turn. Its result comes back in the next message. When you know the answer, write it without a call."
    )


@dataclass(frozen=True)
class TokenSpan:
    """Tokens appended to a trajectory and whether the model wrote them (trained on) or not."""

    ids: list[int]
    model: bool


class ChatRenderer:
    """Renders prompts with the tools, and the messages between turns, with the tokenizer's chat template.

    `preamble`: a job's renderer of a harness's captured first request (chat/harness_request.py): the messages
    a data row's prompt follows there; with it the job's prompts are rendered and tokenized as the gateway
    renders a request (`prompt_ids`). The gateway's renderers have none: a request carries its own messages."""

    def __init__(
        self,
        tokenizer,
        *,
        tools: Sequence[dict],
        opens_with_environment: bool = False,
        preamble: Sequence[dict] | None = None,
    ):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "agent: the model's tokenizer has no chat template, which multi-turn rollouts render the "
                "tools and the turns with; use a chat (instruct) model"
            )
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.opens_with_environment = opens_with_environment
        self.preamble = None if preamble is None else [dict(message) for message in preamble]
        self.eos_text: str = tokenizer.eos_token
        # Tools in the template's own words where it renders them, else in a system message of ours.
        probe = [{"role": "user", "content": _PROBE_USER}]
        renders_tools = bool(self.tools) and self._render(probe, tools=self.tools) != self._render(probe)
        self._template_tools = self.tools if renders_tools else None
        self._system_tools = tools_system_text(self.tools) if self.tools and not renders_tools else None

    def _render(self, messages: Sequence[dict], *, tools: Sequence[dict] | None = None, generation: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            list(messages), tools=tools or None, add_generation_prompt=generation, tokenize=False
        )

    def with_tools(self, messages: Sequence[dict]) -> list[dict]:
        """`messages` with our tools message first where the template does not render the tools: into
        the conversation's own system message when it has one."""
        if self._system_tools is None:
            return list(messages)
        if messages and messages[0]["role"] == "system":
            first = {**messages[0], "content": f"{messages[0]['content']}\n\n{self._system_tools}"}
            return [first, *messages[1:]]
        return [{"role": "system", "content": self._system_tools}, *messages]

    def prompt_text(self, messages: Sequence[dict]) -> str:
        """The rendered prompt (tools included), ending in the generation prompt unless the response
        opens with an environment's reset (`opening`)."""
        return self._render(
            self.with_tools(messages), tools=self._template_tools, generation=not self.opens_with_environment
        )

    def prompt_ids(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of `prompt_text(messages)` with each message's text as plain text (`_fill`): a prompt
        whose messages came from outside (a harness's, with tool results in it)."""
        generation = not self.opens_with_environment
        rendered = self._render(self.with_tools(_slotted(messages)), tools=self._template_tools, generation=generation)
        return self._fill(rendered, messages)

    def opening(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of `messages` (an environment's reset message; none is fine) as they follow the
        prompt's last message, through the generation prompt: how a response opens with an environment."""
        base = [{"role": "system", "content": _PROBE_SYSTEM}, {"role": "user", "content": _PROBE_USER}]
        before = self._render(base, generation=False)
        slotted = _slotted(messages)
        after = self._render([*base, *slotted])
        if not after.startswith(before):
            raise ValueError(
                "agent: the chat template renders earlier messages differently once more follow; an environment's "
                "rollout needs a template that writes each message on its own (ChatML and its relatives)"
            )
        return self._fill(after[len(before) :], messages)

    def between_turns(self, messages: Sequence[dict]) -> list[int]:
        """Token ids of `messages` (tool results, an environment's reply) as they follow an assistant
        turn's end-of-turn token, through the next generation prompt."""
        base = [
            {"role": "system", "content": _PROBE_SYSTEM},
            {"role": "user", "content": _PROBE_USER},
            {"role": "assistant", "content": _PROBE_ANSWER},
        ]
        before = self._render(base, generation=False)
        after = self._render([*base, *_slotted(messages)])
        end_of_answer = before.find(_PROBE_ANSWER + self.eos_text)
        if end_of_answer < 0 or not after.startswith(before[: end_of_answer + len(_PROBE_ANSWER + self.eos_text)]):
            raise ValueError(
                "agent: the chat template does not end an assistant turn with the tokenizer's EOS "
                f"({self.eos_text!r}) or renders earlier turns differently once more follow; multi-turn rollouts "
                "need a template that writes each message on its own (ChatML and its relatives)"
            )
        delta = after[end_of_answer + len(_PROBE_ANSWER + self.eos_text) :]
        return self._fill(delta, messages)

    def _fill(self, rendered: str, messages: Sequence[dict]) -> list[int]:
        """Token ids of `rendered` (with _SLOT for each message's text): the template's text as markup, each
        message's text as plain text in its slot. One pass over `rendered` (each slot searched from the last
        one's end), then one tokenizer call for the markup and one for the texts: linear in the text, where
        cutting the rest of the text at each slot was quadratic in the messages."""
        markups: list[str] = []  # the template's text before each slot, then after the last
        start = 0
        for index, message in enumerate(messages):
            slot = _SLOT.format(index)
            found = rendered.find(slot, start)
            if found < 0:
                raise ValueError(
                    f"agent: the chat template does not write a {message['role']} message's text where the "
                    "message is rendered; multi-turn rollouts need a template that writes each message's content"
                )
            markups.append(rendered[start:found])
            start = found + len(slot)
        markups.append(rendered[start:])
        written = [index for index, markup in enumerate(markups) if markup]  # an empty piece is no tokens
        markup_pieces = dict(zip(written, encode(self.tokenizer, [markups[i] for i in written], plain=False)))
        texts = encode(self.tokenizer, [str(message.get("content") or "") for message in messages], plain=True)
        ids: list[int] = []
        for index, text in enumerate(texts):
            ids += markup_pieces.get(index, [])
            ids += text
        return ids + markup_pieces.get(len(messages), [])

    def model_turn(self, content: str) -> list[int]:
        """A turn's tokens as the model would sample them: the content, then EOS (demonstrations)."""
        return [*markup_ids(self.tokenizer, content), self.tokenizer.eos_token_id]

    def demonstration(self, messages: Sequence[dict]) -> list[TokenSpan]:
        """The spans after the prompt of a conversation's later messages (assistant turns the model's,
        the rest between turns), as the rollout would have built them: for supervised warm-up on
        tool-use demonstrations and for checking masks."""
        spans: list[TokenSpan] = []
        pending: list[dict] = []
        for message in messages:
            if message["role"] == "assistant":
                if not spans and self.opens_with_environment:  # the reset's message, if any, and the generation prompt
                    spans.append(TokenSpan(self.opening(pending), model=False))
                    pending = []
                elif pending:
                    spans.append(TokenSpan(self.between_turns(pending), model=False))
                    pending = []
                spans.append(TokenSpan(self.model_turn(message["content"]), model=True))
            else:
                pending.append(message)
        if pending:
            raise ValueError(
                "a demonstration ends with the assistant's turn, not a " + pending[-1]["role"] + " message"
            )
        return spans


def _slotted(messages: Sequence[dict]) -> list[dict]:
    """`messages` with each one's text replaced by its _SLOT."""
    return [{**message, "content": _SLOT.format(index)} for index, message in enumerate(messages)]
