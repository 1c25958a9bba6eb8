"""Prompts rendered with the tokenizer's chat template (one BOS, system prompt, generation prompt)
or used as is (`chat_template: none`), and the prompt set that drops over-long prompts."""

import pytest

from rldock.config.data import DataSpec
from rldock.runtime.data import PromptDataset, Row, render_prompt, tokenize_prompts
from rldock.runtime.models.tiny import BOS, train_char_tokenizer

# A chat template in the shape real ones have: BOS, role-tagged turns, the assistant tag last.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% endif %}"
)
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A tiny char tokenizer that adds BOS when asked to, with a chat template set."""
    tokenizer = train_char_tokenizer(["abcdefghijklmnopqrstuvwxyz []0123456789+=?"])
    tokenizer.chat_template = TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def plain_tokenizer():
    return train_char_tokenizer(["abcdefghijklmnopqrstuvwxyz []0123456789+=?"])


def test_model_template_renders_a_string_prompt_as_a_user_turn_with_the_generation_prompt(chat_tokenizer):
    text = render_prompt("2+3=", tokenizer=chat_tokenizer, chat_template="model", system_prompt=None, where="f row 0")
    assert text == f"{BOS}[user]2+3=[assistant]"


def test_system_prompt_becomes_a_system_message_before_the_messages(chat_tokenizer):
    text = render_prompt(
        CHAT, tokenizer=chat_tokenizer, chat_template="model", system_prompt="be brief", where="f row 0"
    )
    assert text == f"{BOS}[system]be brief[user]hi[assistant]"


def test_templated_prompts_get_exactly_one_bos(chat_tokenizer):
    text = render_prompt("hi", tokenizer=chat_tokenizer, chat_template="model", system_prompt=None, where="")
    (ids,) = tokenize_prompts(chat_tokenizer, [text], chat_template="model")
    assert ids.count(chat_tokenizer.bos_token_id) == 1 and ids[0] == chat_tokenizer.bos_token_id
    # What the template would give if special tokens were added again: the second BOS we avoid.
    assert chat_tokenizer(text)["input_ids"].count(chat_tokenizer.bos_token_id) == 2


def test_none_uses_the_prompt_as_is_after_the_system_text_and_adds_bos(plain_tokenizer):
    text = render_prompt("2+3=", tokenizer=plain_tokenizer, chat_template="none", system_prompt="add ", where="")
    assert text == "add 2+3="
    (ids,) = tokenize_prompts(plain_tokenizer, [text], chat_template="none")
    assert ids[0] == plain_tokenizer.bos_token_id and len(ids) == 1 + len(text)


def test_template_errors_name_the_field_and_the_row(plain_tokenizer, chat_tokenizer):
    with pytest.raises(
        ValueError, match=r"data.chat_template is model, but the model's tokenizer has no chat template"
    ):
        render_prompt("2+3=", tokenizer=plain_tokenizer, chat_template="model", system_prompt=None, where="f row 0")
    with pytest.raises(ValueError, match=r"train.jsonl row 4: a prompt of chat messages needs a chat template"):
        render_prompt(
            CHAT, tokenizer=plain_tokenizer, chat_template="none", system_prompt=None, where="train.jsonl row 4"
        )
    strict = train_char_tokenizer(["abc"])
    strict.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    with pytest.raises(ValueError, match=r"train.jsonl row 2: the tokenizer's chat template failed.*user first"):
        render_prompt(
            [{"role": "assistant", "content": "a"}],
            tokenizer=strict,
            chat_template="model",
            system_prompt=None,
            where="train.jsonl row 2",
        )


def _rows(*prompts):
    return [Row(prompt, str(i), "src", file="train.jsonl", line=i) for i, prompt in enumerate(prompts)]


def test_prompts_longer_than_max_prompt_length_are_dropped_and_counted(plain_tokenizer, caplog):
    rows = _rows("1+1=", "12345+67890=", "2+2=", "123+456=")  # 5, 13, 5 and 9 tokens with BOS
    dataset = PromptDataset(rows, tokenizer=plain_tokenizer, spec=DataSpec(chat_template="none"), max_prompt_length=9)
    assert len(dataset) == 3 and dataset.num_dropped == 1 and dataset.num_rows == 4
    # Positions among kept prompts map back to the rows of the train files.
    assert [dataset.prompt_index(p) for p in range(3)] == [0, 2, 3]
    examples = dataset.examples([2, 0])
    assert [(e.prompt, e.ground_truth, e.prompt_index) for e in examples] == [("123+456=", "3", 3), ("1+1=", "0", 0)]
    assert [len(ids) for ids in dataset.prompt_ids([0, 2])] == [5, 9]
    assert "dropped 1 of 4 prompts longer than algorithm.max_prompt_length=9" in caplog.text


def test_every_prompt_too_long_names_the_file_and_the_field(plain_tokenizer):
    with pytest.raises(
        ValueError,
        match=r"all 2 prompts of \['train.jsonl'\] are longer than "
        r"algorithm.max_prompt_length=3 tokens after the chat template \(the shortest has 5\)",
    ):
        PromptDataset(
            _rows("1+1=", "2+2="), tokenizer=plain_tokenizer, spec=DataSpec(chat_template="none"), max_prompt_length=3
        )


def test_the_length_check_counts_the_chat_template(chat_tokenizer):
    spec = DataSpec()  # chat_template: model
    dataset = PromptDataset(_rows("1+1=", "hi"), tokenizer=chat_tokenizer, spec=spec, max_prompt_length=20)
    # BOS + "[user]" + prompt + "[assistant]": 22 tokens for "1+1=" (dropped), 20 for "hi" (kept).
    assert len(dataset) == 1 and dataset.num_dropped == 1
    assert dataset.examples([0])[0].prompt == f"{BOS}[user]hi[assistant]"
    assert len(dataset.prompt_ids([0])[0]) == 20


def test_preference_pairs_need_the_pair_columns(plain_tokenizer):
    rows = [Row("1+1=", "2", "s", chosen="2", rejected="3"), Row("2+2=", "4", "s", file="f.jsonl", line=1)]
    dataset = PromptDataset(rows, tokenizer=plain_tokenizer, spec=DataSpec(chat_template="none"), max_prompt_length=9)
    assert [tuple(p) for p in dataset.preference_pairs([0])] == [(0, "2", "3")]
    with pytest.raises(ValueError, match=r"f.jsonl row 1 has no preference pair; dpo needs data.chosen_key"):
        dataset.preference_pairs([1])


def test_the_dock_carries_each_kept_row_as_wide_as_the_longest_and_a_long_one_is_named(plain_tokenizer, caplog):
    rows = [*_rows("1+1=", "2+2="), Row("3+3=", "6", "src", {"tests": "x" * (70 << 10)}, file="train.jsonl", line=2)]
    dataset = PromptDataset(rows, tokenizer=plain_tokenizer, spec=DataSpec(chat_template="none"), max_prompt_length=9)
    encoded = dataset.encoded_rows([1, 2])
    assert dataset.row_width == len(encoded[1]) > (70 << 10) and len(encoded[0]) < 300
    assert "the longest train row (train.jsonl row 2) is 70 KiB" in caplog.text
