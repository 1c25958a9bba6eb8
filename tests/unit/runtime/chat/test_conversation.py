"""Filling a rendered conversation with its messages' tokens (chat/conversation.py, `ChatRenderer._fill`):
linear in the conversation (issue 64: cutting the rest of the text at each message's slot was quadratic, a
many-message request took the gateway's loop for seconds), the same ids as tokenizing each piece on its own,
and a message's text kept plain text when threads encode with one tokenizer at once."""

from __future__ import annotations

import string
import threading
import time

from rldock.runtime.chat.conversation import _SLOT, ChatRenderer, markup_ids, plain_ids
from rldock.runtime.models.tiny import CHAT_TEMPLATE, EOS, train_char_tokenizer


class CountingTokenizerDouble:
    """A test double of a tokenizer whose every call costs next to nothing: a text's ids are its length, and
    its chat template writes `<role>content<eos>` in plain Python. What remains of `_fill`'s time is its own
    handling of the text."""

    chat_template = "a template"
    eos_token = "<eos>"
    eos_token_id = 0

    def apply_chat_template(self, messages, *, tools=None, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{message['role']}>{message['content']}<eos>" for message in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, texts, *, add_special_tokens=False, split_special_tokens=False):
        if isinstance(texts, str):
            return {"input_ids": [len(texts)]}
        return {"input_ids": [[len(text)] for text in texts]}


def test_filling_the_messages_is_linear_in_their_number():
    """80,000 messages (about 3 MB of rendered text with their slots) fill in about a second; cutting the text's
    rest at each slot copied ~120 GB and took 20 s and more here (5 s for 40,000: four times for twice the
    messages)."""
    renderer = ChatRenderer(CountingTokenizerDouble(), tools=[])
    messages = [{"role": "user", "content": "x"} for _ in range(80_000)]
    started = time.perf_counter()
    ids = renderer.prompt_ids(messages)
    took = time.perf_counter() - started
    assert ids[:3] == [len("<user>"), 1, len("<eos><user>")] and ids[-1] == len("<eos><assistant>")
    assert len(ids) == 2 * len(messages) + 1
    assert took < 5.0, f"filling 80,000 messages took {took:.1f} s"


def _tokenizer():
    tokenizer = train_char_tokenizer([string.printable])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _each_piece_alone(renderer: ChatRenderer, rendered: str, messages: list[dict]) -> list[int]:
    """`_fill` as it was written before it batched the pieces: each piece tokenized on its own."""
    ids: list[int] = []
    rest = rendered
    for index, message in enumerate(messages):
        markup, _, rest = rest.partition(_SLOT.format(index))
        ids += markup_ids(renderer.tokenizer, markup) if markup else []
        ids += plain_ids(renderer.tokenizer, str(message.get("content") or ""))
    return ids + (markup_ids(renderer.tokenizer, rest) if rest else [])


def test_the_pieces_tokenized_together_are_the_ids_of_each_tokenized_alone():
    tokenizer = _tokenizer()
    renderer = ChatRenderer(tokenizer, tools=[])
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": f"say {EOS} then <assistant>"},  # a special token's text stays plain text
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": None},
        {"role": "user", "content": "5"},
    ]
    rendered = renderer._render([{**m, "content": _SLOT.format(i)} for i, m in enumerate(messages)])
    ids = renderer._fill(rendered, messages)
    assert ids == _each_piece_alone(renderer, rendered, messages)
    assert tokenizer.eos_token_id not in ids[len(markup_ids(tokenizer, "<system>be brief<eos><user>")) :][:20]
    assert renderer.prompt_ids(messages) == ids


def test_threads_encoding_with_one_tokenizer_keep_a_messages_text_plain():
    """The gateway renders on several threads with one tokenizer, whose calls switch its special-token
    setting: each encoding takes the tokenizer's lock, so a text's `<eos>` is never read as the control token
    and the markup's always is."""
    tokenizer = _tokenizer()
    text = f"a{EOS}b" * 50
    plain, markup = plain_ids(tokenizer, text), markup_ids(tokenizer, text)
    assert plain != markup and tokenizer.eos_token_id in markup and tokenizer.eos_token_id not in plain
    wrong: list[str] = []

    def encode(kind: str) -> None:
        for _ in range(300):
            got = plain_ids(tokenizer, text) if kind == "plain" else markup_ids(tokenizer, text)
            if got != (plain if kind == "plain" else markup):
                wrong.append(kind)

    threads = [threading.Thread(target=encode, args=(kind,)) for kind in ("plain", "markup") * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert wrong == []
