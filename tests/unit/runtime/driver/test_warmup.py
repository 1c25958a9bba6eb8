"""Tests of the supervised warm-up: on answers, and on tool-use demonstrations (the model's turns learnt)."""

import json
import string
from pathlib import Path

import pytest
import torch
import yaml

from rldock.config.data import DataSpec, GeneratorSpec
from rldock.config.job import WarmupSpec
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.data import PromptDataset, Row, columns_of, load_rows, tokenizer_corpus
from rldock.runtime.data.addition import generate_addition
from rldock.runtime.driver.warmup import (
    accumulate_answer_loss,
    answer_loss,
    demonstration_targets,
    demonstration_tokens,
    run_warmup,
)
from rldock.runtime.models import load_causal_lm, load_tokenizer, pad_prompts
from rldock.runtime.models.loading import TokenBatch
from rldock.runtime.models.tiny import build_tiny_model

ROWS = [
    Row(r["prompt"], r["answer"], r["data_source"])
    for r in generate_addition(GeneratorSpec(name="addition", max_operand=5, num_prompts=100), seed=0).train
]


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matmuls gain nothing from threads, and on a shared 2-core machine oversubscribed
    # threads made this test 15x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("base"), texts=tokenizer_corpus(ROWS), seed=0)


@pytest.fixture(scope="module")
def dataset(base_dir):
    return PromptDataset(
        ROWS, tokenizer=load_tokenizer(base_dir), spec=DataSpec(chat_template="none"), max_prompt_length=8
    )


def test_warmup_reduces_loss_and_saves_a_loadable_model(base_dir, dataset, tmp_path):
    spec = WarmupSpec(steps=20, learning_rate=1e-3, batch_size=32)
    metrics = run_warmup(base_dir, tmp_path / "warm", dataset=dataset, spec=spec, seed=0)
    losses = metrics["loss"]
    assert len(losses) == metrics["steps"] == 20
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3
    assert metrics["seconds"] > 0
    assert load_tokenizer(tmp_path / "warm").get_vocab() == load_tokenizer(base_dir).get_vocab()
    warm, base = load_causal_lm(tmp_path / "warm"), load_causal_lm(base_dir)
    assert not all(torch.equal(a, b) for a, b in zip(warm.parameters(), base.parameters()))


def test_warmup_is_deterministic_given_the_seed(base_dir, dataset, tmp_path):
    spec = WarmupSpec(steps=3, learning_rate=1e-3, batch_size=8)
    first = run_warmup(base_dir, tmp_path / "a", dataset=dataset, spec=spec, seed=5)["loss"]
    second = run_warmup(base_dir, tmp_path / "b", dataset=dataset, spec=spec, seed=5)["loss"]
    assert first == second


def test_the_warmup_in_another_thread_writes_the_same_weights(base_dir, dataset, tmp_path):
    """The driver warms up in a thread of its own while Ray starts (driver/inputs.py): the weights are
    those of the main thread's warm-up, bit for bit, with intra-op threads too (the pool a new thread
    uses is the one torch.set_num_threads set)."""
    from rldock.runtime.driver.inputs import beside_another_thread

    torch.set_num_threads(2)  # the one_thread fixture restores it
    spec = WarmupSpec(steps=3, learning_rate=1e-3, batch_size=8)
    run_warmup(base_dir, tmp_path / "main", dataset=dataset, spec=spec, seed=5)
    beside_another_thread(
        lambda: run_warmup(base_dir, tmp_path / "thread", dataset=dataset, spec=spec, seed=5), lambda: None
    )
    main, thread = load_causal_lm(tmp_path / "main"), load_causal_lm(tmp_path / "thread")
    assert all(torch.equal(a, b) for a, b in zip(main.state_dict().values(), thread.state_dict().values()))


def test_zero_steps_copies_the_model(base_dir, dataset, tmp_path):
    metrics = run_warmup(base_dir, tmp_path / "same", dataset=dataset, spec=WarmupSpec(steps=0), seed=0)
    assert metrics["loss"] == []
    for a, b in zip(load_causal_lm(tmp_path / "same").parameters(), load_causal_lm(base_dir).parameters()):
        assert torch.equal(a, b)


def test_answer_loss_ignores_padding_columns(base_dir):
    model, tokenizer = load_causal_lm(base_dir), load_tokenizer(base_dir)
    prompt_ids = torch.tensor([tokenizer("3+4=")["input_ids"]])  # (1, 5)
    prompts = TokenBatch(prompt_ids, torch.ones_like(prompt_ids))
    target = tokenizer("7", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    tight = TokenBatch(torch.tensor([target]), torch.ones(1, 2, dtype=torch.int64))
    padded = TokenBatch(torch.tensor([target + [tokenizer.pad_token_id] * 2]), torch.tensor([[1, 1, 0, 0]]))
    with torch.no_grad():
        assert answer_loss(model, prompts, tight).item() == pytest.approx(
            answer_loss(model, prompts, padded).item(), abs=1e-6
        )


@pytest.mark.parametrize("micro_batch_size,max_tokens", [(1, None), (3, None), (8, 12)])
def test_passes_accumulate_the_whole_batch_gradient(base_dir, micro_batch_size, max_tokens):
    model, tokenizer = load_causal_lm(base_dir), load_tokenizer(base_dir)
    texts = [("1+2=", "3"), ("4+4=", "8"), ("12+30=", "42"), ("5+0=", "5"), ("9+9=", "18")]
    rows = [tokenizer(p)["input_ids"] for p, _ in texts]
    prompts = pad_prompts(rows, max(map(len, rows)), tokenizer.pad_token_id)
    answers = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for _, a in texts]
    targets, _ = demonstration_targets([(ids, [1] * len(ids)) for ids in answers], tokenizer.pad_token_id)
    whole = answer_loss(model, prompts, targets)
    whole.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = accumulate_answer_loss(model, prompts, targets, micro_batch_size=micro_batch_size, max_tokens=max_tokens)
    assert loss == pytest.approx(whole.item(), rel=1e-5)
    for got, expected in zip((p.grad for p in model.parameters()), want):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


# Tool-use demonstrations: the tiny model with its chat template, the python tool described to it.
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "runs a Python program and returns its stdout",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
    },
}
DEMO_ROWS = [
    Row(r["prompt"], r["answer"], r["data_source"], demonstration=r["demonstration"])
    for r in generate_addition(
        GeneratorSpec(name="addition", max_operand=5, num_prompts=60, tool_demonstrations="python"), seed=0
    ).train
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    texts = [*tokenizer_corpus(DEMO_ROWS), string.printable]
    return build_tiny_model(tmp_path_factory.mktemp("chat"), texts=texts, seed=0, max_position_embeddings=256)


@pytest.fixture(scope="module")
def renderer(chat_dir):
    return ChatRenderer(load_tokenizer(chat_dir), tools=[PYTHON_TOOL])


@pytest.fixture(scope="module")
def demo_dataset(chat_dir, renderer):
    return PromptDataset(
        DEMO_ROWS,
        tokenizer=load_tokenizer(chat_dir),
        spec=DataSpec(chat_template="model"),
        max_prompt_length=64,
        conversation=renderer,
    )


def _runs(ids: list[int], flags: list[int], tokenizer) -> list[tuple[int, str]]:
    """Consecutive tokens with the same flag, decoded with special tokens: [(flag, text), ...]."""
    runs: list[tuple[int, list[int]]] = []
    for token, flag in zip(ids, flags):
        if runs and runs[-1][0] == flag:
            runs[-1][1].append(token)
        else:
            runs.append((flag, [token]))
    return [(flag, tokenizer.decode(tokens)) for flag, tokens in runs]


def test_the_loss_mask_covers_exactly_the_assistant_turns_token_by_token(chat_dir, renderer, demo_dataset):
    tokenizer = load_tokenizer(chat_dir)
    first, second = DEMO_ROWS[0].demonstration, DEMO_ROWS[1].demonstration
    rows = [demonstration_tokens(renderer, first), demonstration_tokens(renderer, second)]
    targets, loss_mask = demonstration_targets(rows, tokenizer.pad_token_id)
    for i, demo in enumerate([first, second]):
        spans = renderer.demonstration(demo)
        expected_ids = [token for span in spans for token in span.ids]
        expected_model = [int(span.model) for span in spans for _ in span.ids]
        n = len(expected_ids)
        assert targets.ids[i, :n].tolist() == expected_ids
        assert loss_mask[i, :n].tolist() == expected_model
        assert targets.mask[i, :n].tolist() == [1] * n
        assert targets.ids[i, n:].tolist() == [tokenizer.pad_token_id] * (targets.ids.shape[1] - n)
        assert loss_mask[i, n:].sum() == 0 and targets.mask[i, n:].sum() == 0
        # The learnt runs are the assistant's two turns with their EOS; the tool's message is context.
        call, reply, final = (message["content"] for message in demo)
        assert _runs(expected_ids, expected_model, tokenizer) == [
            (1, call + "<eos>"),
            (0, f"<tool>{reply}<eos><assistant>"),
            (1, final + "<eos>"),
        ]
    # The prompt the warm-up trains after and the demonstration are the conversation as the template
    # renders it, token for token.
    messages = [{"role": "user", "content": DEMO_ROWS[0].prompt}, *first]
    rendered = tokenizer.apply_chat_template(
        renderer.with_tools(messages), tools=[PYTHON_TOOL], tokenize=False, add_generation_prompt=False
    )
    (prompt_ids,) = demo_dataset.prompt_ids([0])
    assert prompt_ids + rows[0][0] == tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_answer_loss_with_a_loss_mask_averages_over_the_masked_tokens_only(chat_dir, renderer, demo_dataset):
    model = load_causal_lm(chat_dir)
    (prompt_ids,) = demo_dataset.prompt_ids([0])
    prompts = TokenBatch(torch.tensor([prompt_ids]), torch.ones(1, len(prompt_ids), dtype=torch.int64))
    targets, loss_mask = demonstration_targets([demonstration_tokens(renderer, DEMO_ROWS[0].demonstration)], 0)
    with torch.no_grad():
        logits = model(input_ids=torch.cat([prompts.ids, targets.ids], dim=1)).logits[0]  # (PL+T, V)
        token_loss = torch.nn.functional.cross_entropy(
            logits[len(prompt_ids) - 1 : -1], targets.ids[0], reduction="none"
        )  # (T,)
        expected = token_loss[loss_mask[0].bool()].mean()
        assert answer_loss(model, prompts, targets, loss_mask).item() == pytest.approx(expected.item(), rel=1e-5)
        # Every target token (the tool's message too) would give a different mean.
        assert answer_loss(model, prompts, targets).item() == pytest.approx(token_loss.mean().item(), rel=1e-5)
        assert token_loss.mean().item() != pytest.approx(expected.item(), rel=1e-3)


def test_warmup_on_demonstrations_reduces_the_loss(chat_dir, renderer, demo_dataset, tmp_path):
    spec = WarmupSpec(steps=20, learning_rate=3e-3, batch_size=16)
    losses = run_warmup(chat_dir, tmp_path / "warm", dataset=demo_dataset, spec=spec, seed=0, conversation=renderer)[
        "loss"
    ]
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.7 * sum(losses[:3]) / 3


def test_a_demonstration_longer_than_a_response_is_refused_naming_the_row(chat_dir, renderer, demo_dataset, tmp_path):
    lengths = [len(demonstration_tokens(renderer, row.demonstration)[0]) for row in DEMO_ROWS]
    spec = WarmupSpec(steps=1, batch_size=len(demo_dataset))
    with pytest.raises(ValueError, match=r"demonstration of train row \d+ is \d+ tokens.*max_response_length=\d+"):
        run_warmup(
            chat_dir,
            tmp_path / "w",
            dataset=demo_dataset,
            spec=spec,
            seed=0,
            conversation=renderer,
            max_response_length=min(lengths) - 1,
        )
    run_warmup(
        chat_dir,
        tmp_path / "fits",
        dataset=demo_dataset,
        spec=spec,
        seed=0,
        conversation=renderer,
        max_response_length=max(lengths),
    )


OWN_PYTHON_TOOL = """
from rldock.runtime.agent.interfaces import Tool, ToolResult


class Python(Tool):
    name, description = "python", "runs a Python program and returns its stdout"
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}}

    async def call(self, arguments):
        return ToolResult("")
"""


def test_the_trainer_warms_an_agent_job_up_on_its_demonstrations(chat_dir, tmp_path):
    """prepare_initial_policy hands the job's renderer to the warm-up (without it demonstrations are refused)."""
    from rldock.config import parse_job_config
    from rldock.runtime.agent.builders import job_conversation
    from rldock.runtime.driver.inputs import prepare_initial_policy

    (tmp_path / "own_tools.py").write_text(OWN_PYTHON_TOOL)
    train = tmp_path / "train.jsonl"
    train.write_text(
        "".join(
            json.dumps({"prompt": r.prompt, "answer": r.ground_truth, "demo": r.demonstration}) + "\n"
            for r in DEMO_ROWS
        )
    )
    data = yaml.safe_load((Path(__file__).parents[4] / "examples" / "grpo-tiny.yaml").read_text())
    data["data"] = {"train_files": [str(train)], "demonstration_key": "demo", "chat_template": "model"}
    data["algorithm"]["max_response_length"] = 512
    data["agent"] = {"tools": [{"name": f"{tmp_path / 'own_tools.py'}:Python"}]}
    data["warmup"] = {"steps": 2, "batch_size": 4}
    cfg = parse_job_config(data)
    tokenizer = load_tokenizer(chat_dir)
    rows = load_rows([train], columns_of(cfg.data))
    conversation = job_conversation(cfg, tokenizer)
    dataset = PromptDataset(rows, tokenizer=tokenizer, spec=cfg.data, max_prompt_length=64, conversation=conversation)
    warm = prepare_initial_policy(cfg, tmp_path / "out", chat_dir, dataset, conversation=conversation)
    assert warm == tmp_path / "out" / "warmup"
    assert not all(
        torch.equal(a, b) for a, b in zip(load_causal_lm(warm).parameters(), load_causal_lm(chat_dir).parameters())
    )
