"""The supervised warm-up: a short phase of next-token training on the train prompts' reference
answers (the ground truth text), or on their tool-use demonstrations, before RL starts.

Why it exists: RL only learns from differences in reward inside a group of sampled responses. A
freshly initialised tiny model almost never samples a partly right answer, so GRPO's advantages
are mostly zero and it learns very slowly (0.05 -> 0.14 reward in 200 steps in our TRL probe). A
few hundred supervised steps teach the output format (digits, then EOS) and some arithmetic, which
brings the sampled reward into the range where a group's responses differ and RL can improve it.
Real checkpoints that already follow the format leave `warmup.steps` at 0. An instruct model that
never calls a tool on its own is in the same place for an agent job: its rows' demonstrations
(`data.demonstration_key`) show the call, and the warm-up trains on them.

Each example is laid out exactly as in RL (docs/architecture.md): the prompt's tokens as the
prompt set holds them (rendered, with BOS where one is added) left-padded to the longest prompt, then answer + EOS
right-padded, `position_ids = cumsum(mask) - 1`. The loss is
cross-entropy on the answer and EOS tokens only, averaged over those tokens. In a job with an
environment the prompts end before the generation prompt, which opens every response (agent/episode_loop.py):
it precedes each answer as context, outside the loss.

With demonstrations the target is the demonstration's tokens exactly as a multi-turn rollout lays
them after the prompt (ChatRenderer.demonstration: each model turn's tokens and EOS, the tool
messages' tokens between turns), and the loss is on the model's turns only, averaged over their
tokens: the tool messages are context, as in RL, where the model never writes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from rldock.config.job import WarmupSpec
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.data import PromptDataset, PromptSampler
from rldock.runtime.engines.policy import micro_batch_rows, packing_prompts, response_logprobs
from rldock.runtime.models import TokenBatch, load_causal_lm, load_tokenizer, max_token_length, pad_prompts

logger = logging.getLogger(__name__)


def _answer_targets(tokenizer, answers: list[str], length: int) -> TokenBatch:
    """Answer tokens + EOS, right-padded to `length`: (B, T) ids and mask."""
    rows = [row + [tokenizer.eos_token_id] for row in tokenizer(answers, add_special_tokens=False)["input_ids"]]
    return _right_padded(rows, length, tokenizer.pad_token_id)


def _right_padded(rows: Sequence[Sequence[int]], length: int, value: int) -> TokenBatch:
    """`rows` right-padded with `value` to `length`: (B, T) ids and the mask of the rows' own entries."""
    ids = torch.full((len(rows), length), value, dtype=torch.int64)  # (B, T)
    mask = torch.zeros((len(rows), length), dtype=torch.int64)  # (B, T)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        mask[i, : len(row)] = 1
    return TokenBatch(ids, mask)


def demonstration_tokens(renderer: ChatRenderer, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """A demonstration's token ids after the prompt and, per token, 1 where the model writes it (its
    turns and their EOS) and 0 where a tool or the environment does."""
    ids: list[int] = []
    model: list[int] = []
    for span in renderer.demonstration(messages):
        ids += span.ids
        model += [int(span.model)] * len(span.ids)
    return ids, model


def demonstration_targets(rows: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[TokenBatch, torch.Tensor]:
    """Demonstrations' tokens (`demonstration_tokens`) right-padded to the longest: (B, T) ids and
    mask (every token the model attends to), and the (B, T) loss mask (1 on the model's own tokens)."""
    length = max(len(ids) for ids, _ in rows)
    targets = _right_padded([ids for ids, _ in rows], length, pad_id)
    loss_mask = _right_padded([model for _, model in rows], length, 0).ids  # (B, T)
    return targets, loss_mask


def answer_loss(model, prompts: TokenBatch, targets: TokenBatch, loss_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean cross-entropy of `targets` (B, T) given `prompts` (B, PL), over the target tokens where
    `loss_mask` (B, T) is 1 (default `targets.mask`: every target token); a scalar. The logprobs of
    the policy passes: the LM head runs where the loss counts a token, on its longest sequence."""
    mask = targets.mask if loss_mask is None else loss_mask  # (B, T)
    logprobs = response_logprobs(
        model,
        prompts.ids,
        prompts.mask,
        targets.ids,
        mask,
        micro_batch_size=len(targets.ids),
        trim=True,
        attention_mask=targets.mask,
    )  # (B, T), 0 where mask is 0
    return -logprobs.sum() / mask.sum().clamp(min=1)


def accumulate_answer_loss(
    model,
    prompts: TokenBatch,
    targets: TokenBatch,
    loss_mask: torch.Tensor | None = None,
    *,
    micro_batch_size: int,
    max_tokens: int | None = None,
) -> float:
    """Backward `answer_loss` of the whole batch in passes of at most `micro_batch_size` rows (within
    `max_tokens`, `micro_batch_rows`): each pass adds its tokens' share of the batch's mean, so the
    gradients are the whole batch's while a pass holds only its own activations. Returns the loss."""
    mask = targets.mask if loss_mask is None else loss_mask  # (B, T)
    total = mask.sum().clamp(min=1)
    loss = 0.0
    for rows in micro_batch_rows(
        prompts.mask,
        targets.mask,
        micro_batch_size=micro_batch_size,
        trim=True,
        max_tokens=max_tokens,
        prompt_ids=packing_prompts(
            model,
            prompts.ids,
            prompts.mask,
            targets.mask,
            trim=True,
            micro_batch_size=micro_batch_size,
            max_tokens=max_tokens,
        ),
    ):
        rows = rows.to(mask.device)
        part = answer_loss(
            model,
            TokenBatch(prompts.ids[rows], prompts.mask[rows]),
            TokenBatch(targets.ids[rows], targets.mask[rows]),
            mask[rows],
        ) * (mask[rows].sum().clamp(min=1) / total)
        part.backward()
        loss += part.item()
    return loss


class _Demonstrations:
    """The prompt set's demonstrations as warm-up targets, each laid out once (by position) and checked to
    fit in a rollout's response."""

    def __init__(self, dataset: PromptDataset, conversation: ChatRenderer, *, pad_id: int, max_length: int | None):
        self.dataset, self.conversation, self.pad_id, self.max_length = dataset, conversation, pad_id, max_length
        self.laid_out: dict[int, tuple[list[int], list[int]]] = {}  # position -> demonstration_tokens

    def targets(self, positions: Sequence[int]) -> tuple[TokenBatch, torch.Tensor]:
        for position, messages in zip(positions, self.dataset.demonstrations(positions)):
            if position not in self.laid_out:
                assert messages is not None, "the loader reads a demonstration in every row or in none"
                self.laid_out[position] = tokens = demonstration_tokens(self.conversation, messages)
                if self.max_length is not None and len(tokens[0]) > self.max_length:
                    raise ValueError(
                        f"warmup: the demonstration of train row {self.dataset.prompt_index(position)} is "
                        f"{len(tokens[0])} tokens after the prompt, more than algorithm.max_response_length="
                        f"{self.max_length}, which a whole episode (the model's and the tools' tokens) fits in; "
                        "raise it or shorten the demonstrations"
                    )
        return demonstration_targets([self.laid_out[position] for position in positions], self.pad_id)


def _answer_batch(
    dataset: PromptDataset, positions: Sequence[int], tokenizer, opening: Sequence[int] = ()
) -> tuple[TokenBatch, torch.Tensor | None]:
    """The reference answers as targets and their loss mask; `opening` (an environment job's generation
    prompt, which its prompts end before) precedes each answer as context, as in its rollout."""
    answer_texts = [ex.ground_truth for ex in dataset.examples(positions)]
    if not opening:
        target_len = max_token_length(tokenizer, answer_texts, add_special_tokens=False) + 1  # + EOS
        return _answer_targets(tokenizer, answer_texts, target_len), None
    answers = [row + [tokenizer.eos_token_id] for row in tokenizer(answer_texts, add_special_tokens=False)["input_ids"]]
    return demonstration_targets(
        [([*opening, *row], [0] * len(opening) + [1] * len(row)) for row in answers], tokenizer.pad_token_id
    )


def run_warmup(
    model_dir_in: str | Path,
    model_dir_out: str | Path,
    *,
    dataset: PromptDataset,
    spec: WarmupSpec,
    seed: int,
    device: str | torch.device = "cpu",
    conversation: ChatRenderer | None = None,
    max_response_length: int | None = None,
    micro_batch_size: int | None = None,
    micro_batch_tokens: int | None = None,
) -> dict:
    """Train the model at `model_dir_in` for `spec.steps` AdamW steps on the prompt set's prompts
    and ground truths, or their demonstrations where the rows carry them (`dataset` was tokenized
    with this model's tokenizer; `conversation`, the agent job's renderer, lays the demonstrations
    out, and each must fit in `max_response_length` tokens); save model and tokenizer to `model_dir_out`.
    Each step accumulates passes of at most `micro_batch_size` rows and `micro_batch_tokens` tokens
    (the job's training.micro_batch_size and micro_batch_tokens; None: the whole batch in one pass).

    Trains in float32 whatever the job's model.dtype, since the phase is short and its output is
    also the reference policy. With `spec.steps == 0` the model is copied unchanged. Deterministic
    given `seed` (the data order and the torch RNG are seeded from it). Returns metrics: `loss`
    (one float per step), `steps`, `seconds`.
    """
    start = time.perf_counter()
    tokenizer = load_tokenizer(model_dir_in)
    model = load_causal_lm(model_dir_in, dtype="float32", device=device)
    model.train()
    demonstrations = None
    # The loader reads a demonstration column in every row or in none.
    if dataset.demonstrations([0])[0] is not None:
        # rows carry demonstrations only when the config names them, and its data checks refuse them without
        # an agent (whose renderer `conversation` is)
        assert conversation is not None, "demonstrations are laid out with the agent's chat renderer"
        demonstrations = _Demonstrations(
            dataset, conversation, pad_id=tokenizer.pad_token_id, max_length=max_response_length
        )
    # An environment job's prompts end before the generation prompt, which opens each response.
    opening = conversation.opening([]) if conversation is not None and conversation.opens_with_environment else []
    sampler = PromptSampler(len(dataset), seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.0)
    losses: list[float] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for step in range(spec.steps):
            positions = sampler.next_batch(spec.batch_size)
            prompt_rows = dataset.prompt_ids(positions)
            prompts = pad_prompts(prompt_rows, max(map(len, prompt_rows)), tokenizer.pad_token_id)
            loss_mask: torch.Tensor | None
            if demonstrations is not None:
                targets, loss_mask = demonstrations.targets(positions)
            else:
                targets, loss_mask = _answer_batch(dataset, positions, tokenizer, opening)
            optimizer.zero_grad(set_to_none=True)
            losses.append(
                accumulate_answer_loss(
                    model,
                    TokenBatch(prompts.ids.to(device), prompts.mask.to(device)),
                    TokenBatch(targets.ids.to(device), targets.mask.to(device)),
                    None if loss_mask is None else loss_mask.to(device),
                    micro_batch_size=micro_batch_size or len(positions),
                    max_tokens=micro_batch_tokens,
                )
            )
            optimizer.step()
            if step % 50 == 0 or step == spec.steps - 1:
                logger.info("warmup step %d/%d loss %.4f", step + 1, spec.steps, losses[-1])
    model.eval()
    Path(model_dir_out).mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir_out)
    tokenizer.save_pretrained(model_dir_out)
    seconds = time.perf_counter() - start
    logger.info(
        "warmup finished: %d steps in %.1f s, final loss %s",
        spec.steps,
        seconds,
        f"{losses[-1]:.4f}" if losses else "n/a",
    )
    return {"loss": losses, "steps": spec.steps, "seconds": seconds}
