"""Packed passes (engines/packing.py): prompt groups, runs under a budget, the packed sequence laid out
by hand, and the policy's numbers and gradients equal to passes of padded rows."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.runtime.engines.packing import (
    contiguous_responses,
    pack_pass,
    packed_length,
    packed_runs,
    packing_pays,
    packs_sequences,
    prompt_groups,
)
from rldock.runtime.engines.policy import micro_batch_rows, packing_prompts, response_logprobs_and_entropy


def _left_padded(prompts: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _right_padded(responses: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([r + [0] * (width - len(r)) for r in responses])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in responses])
    return ids, mask


def test_rows_with_the_same_prompt_share_a_group_in_order_of_first_appearance():
    ids, mask = _left_padded([[5, 6], [7], [5, 6], [7], [6]], 3)
    ids[1, 0] = 9  # a pad's id does not make another prompt
    assert prompt_groups(ids, mask).tolist() == [0, 1, 0, 1, 2]


def test_runs_keep_groups_together_and_count_each_prompt_once():
    # two groups of three rows: prompts of 4 and 2 tokens, responses of 1-3 tokens
    prompt_ids, prompt_mask = _left_padded([[1, 2, 3, 4], [8, 9], [1, 2, 3, 4], [8, 9], [1, 2, 3, 4], [8, 9]], 4)
    _, attention = _right_padded([[1], [1, 1], [1, 1, 1], [1], [1, 1], [1, 1, 1]], 3)
    unbounded = packed_runs(prompt_ids, prompt_mask, attention, micro_batch_size=8, max_tokens=None)
    assert [r.tolist() for r in unbounded] == [[0, 2, 4, 1, 3, 5]]
    by_rows = packed_runs(prompt_ids, prompt_mask, attention, micro_batch_size=3, max_tokens=None)
    assert [r.tolist() for r in by_rows] == [[0, 2, 4], [1, 3, 5]]
    # group 0 packs 4 + 1 + 3 + 2 = 10 tokens; row 1 would add its prompt and response, 2 + 2
    budget = packed_runs(prompt_ids, prompt_mask, attention, micro_batch_size=8, max_tokens=12)
    assert [r.tolist() for r in budget] == [[0, 2, 4], [1, 3, 5]]
    # whole groups first: row 1 (2 + 2 tokens) would fit beside group 0 within 15, its group does not
    whole = packed_runs(prompt_ids, prompt_mask, attention, micro_batch_size=8, max_tokens=15)
    assert [r.tolist() for r in whole] == [[0, 2, 4], [1, 3, 5]]
    both = packed_runs(prompt_ids, prompt_mask, attention, micro_batch_size=8, max_tokens=18)
    assert [r.tolist() for r in both] == [[0, 2, 4, 1, 3, 5]]
    # a group over the row limit is cut, each part computing its prompt; the next group starts anew
    cut = packed_runs(prompt_ids, prompt_mask, attention, micro_batch_size=2, max_tokens=100)
    assert [r.tolist() for r in cut] == [[0, 2], [4], [1, 3], [5]]
    alone = packed_runs(prompt_ids, prompt_mask, attention, micro_batch_size=8, max_tokens=3)
    assert sorted(int(r) for run in alone for r in run) == list(range(6)) and all(len(run) == 1 for run in alone)


def test_a_pass_lays_each_prompt_once_then_its_responses():
    prompt_ids, prompt_mask = _left_padded([[1, 2], [7], [1, 2]], 2)
    response_ids, attention = _right_padded([[3, 4], [8, 9, 10], [5]], 3)
    packed = pack_pass(
        prompt_ids, prompt_mask, response_ids, attention, response_end=3, mask_kind="boolean", dtype=torch.float32
    )
    # group 0: prompt [1, 2], row 0 [3, 4], row 2 [5]; group 1: prompt [7], row 1 [8, 9, 10]
    assert packed.input_ids.tolist() == [[1, 2, 3, 4, 5, 7, 8, 9, 10]]
    assert packed_length(prompt_ids, prompt_mask, attention) == 9
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3]]
    # response token 0 is scored by its prompt's last token, token t by its own token t - 1
    assert packed.predictors.tolist() == [[1, 2, 0], [5, 6, 7], [1, 0, 0]]
    attends = packed.attention_mask[0, 0].int().tolist()
    assert attends == [
        [1, 0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 0, 0, 0, 0],  # row 2's token sees its prompt, not row 0's response
        [0, 0, 0, 0, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1, 1, 1, 1],
    ]
    additive = pack_pass(
        prompt_ids, prompt_mask, response_ids, attention, response_end=3, mask_kind="additive", dtype=torch.float16
    ).attention_mask[0, 0]
    assert additive.dtype == torch.float16
    assert ((additive == 0) == packed.attention_mask[0, 0]).all()
    assert (additive[~packed.attention_mask[0, 0]] == torch.finfo(torch.float16).min).all()


def _model(attn_implementation: str = "sdpa", **config):
    torch.manual_seed(0)
    return tiny_qwen2(
        vocab_size=40,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=attn_implementation,
        **config,
    )


def test_only_attention_that_takes_a_4d_mask_without_a_window_packs():
    assert packs_sequences(_model("sdpa")) and packs_sequences(_model("eager"))
    model = _model("sdpa")
    model.config._attn_implementation = "flash_attention_2"  # not installable here; the check reads the name
    assert not packs_sequences(model)
    assert not packs_sequences(_model("sdpa", use_sliding_window=True, sliding_window=4, max_window_layers=0))


def test_a_response_with_an_unattended_hole_keeps_the_row_layout():
    _, attention = _right_padded([[1, 1], [1]], 3)
    assert contiguous_responses(attention)
    attention[0, 1], attention[0, 2] = 0, 1
    assert not contiguous_responses(attention)
    prompt_ids, prompt_mask = _left_padded([[1, 2, 3]] * 2, 3)
    passes = {"micro_batch_size": 2, "max_tokens": None}
    assert packing_prompts(_model(), prompt_ids, prompt_mask, attention, trim=True, **passes) is None
    assert packing_prompts(_model(), prompt_ids, prompt_mask, attention[[1, 1]], trim=True, **passes) is not None
    assert packing_prompts(_model(), prompt_ids, prompt_mask, attention[[1, 1]], trim=False, **passes) is None


def test_packing_only_where_it_costs_fewer_flops():
    model = _model()  # hidden 32, 4 heads of 8, MLP 64: 18,432 FLOPs a token and 128 a pair per layer
    # a long prompt and short answers: shared prompt tokens save more than the longer attention adds
    prompt_ids, prompt_mask = _left_padded([list(range(1, 21))] * 4, 20)
    _, short = _right_padded([[1] * 4] * 4, 40)
    assert packing_pays(model, prompt_ids, prompt_mask, short, micro_batch_size=4, max_tokens=None)
    # a short prompt and long answers: one sequence of 4 + 4 x 40 tokens attends 26,896 pairs against
    # 4 x 44^2 = 7,744 in rows, more than its 12 saved tokens pay for
    prompt_ids, prompt_mask = _left_padded([[1, 2, 3, 4]] * 4, 4)
    _, long = _right_padded([[1] * 40] * 4, 40)
    assert not packing_pays(model, prompt_ids, prompt_mask, long, micro_batch_size=4, max_tokens=None)
    assert packing_pays(model, prompt_ids, prompt_mask, long, micro_batch_size=1, max_tokens=None) is False  # a tie


def _group_batch(num_groups: int = 3, group_size: int = 4, seed: int = 1):
    """Interleaved GRPO groups: row r answers prompt r % num_groups; a tool reply (columns 2-3) is
    attended to and not scored."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 40, (int(n),), generator=generator).tolist() for n in (3, 7, 5)[:num_groups]]
    rows = num_groups * group_size
    prompt_ids, prompt_mask = _left_padded([prompts[r % num_groups] for r in range(rows)], 8)
    lengths = torch.randint(1, 7, (rows,), generator=generator).tolist()
    response_ids, attention = _right_padded(
        [torch.randint(1, 40, (n,), generator=generator).tolist() for n in lengths], 6
    )
    response_mask = attention.clone()
    response_mask[:, 2:4] = 0
    return prompt_ids, prompt_mask, response_ids, response_mask, attention


@pytest.mark.parametrize("attn_implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("max_tokens", [None, 24])
def test_packed_scores_and_gradients_equal_padded_rows(attn_implementation, max_tokens):
    model = _model(attn_implementation)
    prompt_ids, prompt_mask, response_ids, response_mask, attention = _group_batch()

    def scores(trim: bool):
        model.zero_grad()
        result = response_logprobs_and_entropy(
            model,
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            micro_batch_size=5,
            max_tokens=max_tokens if trim else None,
            trim=trim,
            attention_mask=attention,
        )
        (result.logprobs * torch.linspace(0.5, 1.5, result.logprobs.numel()).view_as(result.logprobs)).sum().backward()
        return result, [p.grad.clone() for p in model.parameters()]

    passes = {"micro_batch_size": 5, "max_tokens": max_tokens}
    assert packing_prompts(model, prompt_ids, prompt_mask, attention, trim=True, **passes) is not None
    rows, row_grads = scores(trim=False)  # every pass padded rows over all PL + SL columns
    packed, packed_grads = scores(trim=True)
    assert (packed.logprobs[response_mask == 0] == 0).all()
    torch.testing.assert_close(packed.logprobs, rows.logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed.entropy, rows.entropy, rtol=1e-5, atol=1e-5)
    for packed_grad, row_grad in zip(packed_grads, row_grads):
        torch.testing.assert_close(packed_grad, row_grad, rtol=1e-4, atol=1e-6)


def test_update_micro_batches_hold_whole_groups():
    prompt_ids, prompt_mask, _, _, attention = _group_batch()
    runs = micro_batch_rows(prompt_mask, attention, micro_batch_size=4, trim=True, prompt_ids=prompt_ids)
    assert [sorted(r % 3 for r in run.tolist()) for run in runs] == [[0] * 4, [1] * 4, [2] * 4]


def test_an_updates_micro_batches_hold_a_groups_rows_when_passes_pack():
    from tensordict import TensorDict

    from rldock.config.training import TrainingSpec
    from rldock.runtime.engines.policy_passes import update_micro_batches

    prompt_ids, prompt_mask, response_ids, response_mask, attention = _group_batch()
    mini_batch = TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "response_attention_mask": attention,
        },
        batch_size=[len(prompt_ids)],
    )
    training = TrainingSpec(micro_batch_size=4)
    runs = update_micro_batches(_model(), mini_batch, training)
    assert [sorted(r % 3 for r in run.tolist()) for run in runs] == [[0] * 4, [1] * 4, [2] * 4]
    windowed = _model("sdpa", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    by_length = update_micro_batches(windowed, mini_batch, training)  # the row layout: sorted by tokens
    tokens = (prompt_mask.sum(1) + attention.sum(1)).tolist()
    order = [tokens[r] for run in by_length for r in run.tolist()]
    assert order == sorted(order)


def test_the_tally_counts_each_prompt_once_per_packed_pass_and_once_per_row_otherwise():
    from rldock.runtime.engines.policy import PassTally

    model = _model()
    prompt_ids, prompt_mask, response_ids, response_mask, attention = _group_batch()
    prompts, responses = prompt_mask.sum(1), attention.sum(1)  # (B,) real tokens
    tallies = {}
    for trim in (True, False):  # packed passes of whole groups (micro-batch 4), or padded rows
        tallies[trim] = PassTally()
        with torch.no_grad():
            response_logprobs_and_entropy(
                model,
                prompt_ids,
                prompt_mask,
                response_ids,
                response_mask,
                micro_batch_size=4,
                trim=trim,
                attention_mask=attention,
                tally=tallies[trim],
            )
    distinct_prompts = sum(int(prompts[g]) for g in range(3))  # rows 0, 1, 2 hold the three prompts
    assert tallies[True].tokens == distinct_prompts + int(responses.sum())
    assert tallies[False].tokens == int((prompts + responses).sum())  # padding left out
    assert tallies[True].head_positions == tallies[False].head_positions == int(response_mask.sum())
    assert tallies[True].pairs < tallies[False].pairs
