"""Ulysses' single-process parts (engines/ulysses.py): the 4D mask a CP pass gives the model equals
what Hugging Face builds from the 2D mask on every real token, and the positions added to make the
sequence divide by cp stay out of every real token's attention. The ranks themselves run in
tests/integration/test_context_parallel_ranks.py."""

from __future__ import annotations

import pytest
import torch

from rldock.runtime.engines.ulysses import four_d_mask, pad_mask, padded_length, pass_mask


def _model(implementation: str):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=implementation,
    )
    return Qwen2ForCausalLM(config).double().eval()


@pytest.mark.parametrize(("implementation", "kind"), [("sdpa", "boolean"), ("eager", "additive")])
def test_four_d_mask_gives_the_2d_masks_hidden_states_on_real_tokens(implementation, kind):
    model = _model(implementation)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])  # left pad, right pad; none
    ids = torch.randint(4, 32, mask.shape, generator=torch.Generator().manual_seed(1))
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    got = model(
        input_ids=ids, attention_mask=four_d_mask(mask, kind=kind, dtype=torch.float64), position_ids=positions
    ).logits
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", ["boolean", "additive"])
def test_padded_positions_attend_themselves_and_nothing_attends_them(kind):
    mask = four_d_mask(torch.tensor([[1, 1, 1, 0, 1]]), kind=kind, dtype=torch.float64)  # (1, 1, 5, 5)
    grown = pad_mask(mask, padded_length(5, 4), kind=kind)  # (1, 1, 8, 8)
    allowed = grown if kind == "boolean" else grown == 0
    assert grown.shape == (1, 1, 8, 8)
    assert torch.equal(allowed[..., :5, :5], mask if kind == "boolean" else mask == 0)
    assert not allowed[..., :5, 5:].any()  # no real token sees an added position
    assert torch.equal(allowed[0, 0, 5:, 5:], torch.eye(3, dtype=torch.bool))
    assert not allowed[0, 0, 5:, :5].any()


def test_a_pass_without_padding_gets_no_mask_and_a_padded_or_packed_one_keeps_its_own():
    """No mask: the model's Ulysses attention is causal over the whole sequence (no (N, N) mask held)."""
    assert pass_mask(torch.ones(2, 6, dtype=torch.int64), kind="boolean", dtype=torch.float32) is None
    padded = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert torch.equal(
        pass_mask(padded, kind="boolean", dtype=torch.float32), four_d_mask(padded, kind="boolean", dtype=torch.float32)
    )
    packed = torch.ones(1, 1, 3, 3, dtype=torch.bool).tril()
    assert pass_mask(packed, kind="boolean", dtype=torch.float32) is packed
