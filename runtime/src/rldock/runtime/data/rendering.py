"""Turns a row's prompt into the model's input: its text after the chat template, and its tokens.

With `data.chat_template: model` the tokenizer's chat template renders the messages (a string
prompt becomes one user message, `data.system_prompt` a system message before it) with the
generation prompt, and the text is tokenized WITHOUT special tokens: the template already wrote
BOS where the model wants one, and a second BOS would be out of distribution. With `none` the
prompt string is used as is (after `system_prompt`) and tokenized WITH special tokens, so a
tokenizer that adds BOS adds it, as the tiny demo was trained.
"""

from __future__ import annotations

from collections.abc import Sequence

import jinja2

from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.data.rows import RawPrompt


def chat_template_problem(prompt: RawPrompt, chat_template: str) -> str | None:
    """Why `prompt` cannot be rendered with `chat_template`, or None: chat messages need a template.
    The loader's check (render_prompt) and `rldock validate`'s (data/probe.py, on each file's first row)."""
    if chat_template == "none" and not isinstance(prompt, str):
        return (
            "a prompt of chat messages needs a chat template, but data.chat_template is none; set "
            "data.chat_template to model or store the prompt (the data.prompt_key column) as text"
        )
    return None


def render_prompt(
    prompt: RawPrompt,
    *,
    tokenizer,
    chat_template: str,
    system_prompt: str | None,
    where: str,
    conversation: ChatRenderer | None = None,
) -> str:
    """The input text for `prompt`; `where` (file, row) is named in errors. `conversation`: a job
    with an agent section renders through it, so the prompt describes the tools."""
    problem = chat_template_problem(prompt, chat_template)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    if isinstance(prompt, str) and chat_template == "none":
        return (system_prompt or "") + prompt
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "data.chat_template is model, but the model's tokenizer has no chat template; "
            "use a chat (instruct) model or set data.chat_template to none"
        )
    messages = prompt_messages(prompt, system_prompt=system_prompt, conversation=conversation)
    try:
        if conversation is not None:
            return conversation.prompt_text(messages)
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except jinja2.TemplateError as error:
        raise ValueError(
            f"{where}: the tokenizer's chat template failed on this prompt ({error}); "
            "check the prompt's roles or set data.chat_template to none"
        ) from error


def prompt_messages(
    prompt: RawPrompt, *, system_prompt: str | None, conversation: ChatRenderer | None = None
) -> list[dict]:
    """The chat messages a row's prompt is rendered from: `data.system_prompt`'s system message, or a harness's
    captured messages (`conversation.preamble`, agent.harness_request), then the prompt's."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if conversation is not None and conversation.preamble is not None:
        return [*conversation.preamble, *messages]
    if system_prompt is not None:
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def tokenize_prompts(tokenizer, texts: Sequence[str], *, chat_template: str) -> list[list[int]]:
    """Token ids of rendered prompts: special tokens only where no template placed them."""
    if not texts:
        return []
    return tokenizer(list(texts), add_special_tokens=chat_template == "none")["input_ids"]
