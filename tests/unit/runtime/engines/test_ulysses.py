"""Ulysses' single-process parts (engines/ulysses.py): the 4D mask a CP pass gives the model equals
what Hugging Face builds from the 2D mask on every real token, and the positions added to make the
sequence divide by cp stay out of every real token's attention. The ranks themselves run in
tests/ranks/test_context_parallel_ranks.py."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen2  # tests/tiny_models.py

from rldock.runtime.engines.context_attention import apply_context_attention
from rldock.runtime.engines.ulysses import four_d_mask, pad_mask, padded_length, pass_mask


def _model(implementation: str):
    torch.manual_seed(0)
    model = tiny_qwen2(
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32768,  # Qwen2Config's default, which this model always had
        attn_implementation=implementation,
    )
    return model.double().eval()


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


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo group (a file rendezvous in a fresh directory): Ulysses' all-to-alls over it
    are the identity, so a single process runs the Ulysses attention itself."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_an_additive_mask_in_float32_reaches_a_bfloat16_sdpa_in_bfloat16(one_rank_group, monkeypatch):
    """Under FSDP mixed precision the stored parameters are float32 (the dtype `context_mask` builds an
    additive mask in) while the attention computes in bfloat16. SDPA's CUDA kernels refuse an additive
    mask whose dtype is not the queries' (the CPU's promote it, so this records the mask SDPA gets, and
    passes it on), so Ulysses gives SDPA the mask in the queries' dtype."""
    from rldock.runtime.engines import ulysses

    masks: list[tuple[torch.dtype, torch.dtype]] = []  # (query, mask) per attention call
    real_sdpa = ulysses.sdpa_attention_forward

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):  # a spy around the real one
        masks.append((query.dtype, attention_mask.dtype))
        return real_sdpa(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(ulysses, "sdpa_attention_forward", recording_sdpa)
    model = apply_context_attention(_model("eager").to(torch.bfloat16), one_rank_group, "ulysses")
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]])
    ids = torch.randint(4, 32, mask.shape, generator=torch.Generator().manual_seed(1))
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    additive = four_d_mask(mask, kind="additive", dtype=torch.float32)
    got = model(input_ids=ids, attention_mask=additive, position_ids=positions).logits
    # the same mask built in bfloat16 in the first place: the conversion keeps which positions attend
    expected = model(
        input_ids=ids, attention_mask=four_d_mask(mask, kind="additive", dtype=torch.bfloat16), position_ids=positions
    ).logits
    assert got.dtype == torch.bfloat16
    assert masks == [(torch.bfloat16, torch.bfloat16)] * 2  # one layer, two passes
    assert torch.equal(got, expected)


def test_an_additive_mask_keeps_what_attends_in_the_compute_dtype():
    from rldock.runtime.engines.ulysses import in_compute_dtype

    additive = four_d_mask(torch.tensor([[0, 1, 1, 1]]), kind="additive", dtype=torch.float32)
    converted = in_compute_dtype(additive, torch.bfloat16)
    assert converted is not None and converted.dtype == torch.bfloat16
    assert torch.equal(converted == 0, additive == 0)
    assert bool((converted[additive < 0] == torch.finfo(torch.bfloat16).min).all())  # finite: no -inf row
    boolean = four_d_mask(torch.tensor([[0, 1, 1, 1]]), kind="boolean", dtype=torch.float32)
    assert in_compute_dtype(boolean, torch.bfloat16) is boolean and in_compute_dtype(None, torch.bfloat16) is None


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_a_one_rank_cp_model_gives_the_models_logits_in_either_mode(one_rank_group, implementation, mode):
    """Over one rank both modes' attention is the model's own (an all-to-all of one, a ring of one
    block), on padded rows (the 4D mask of the implementation's kind) and on full rows (none: causal);
    float64, so only summation order differs (1e-12)."""
    from rldock.runtime.engines.ulysses import context_mask

    plain, model = _model("sdpa"), apply_context_attention(_model(implementation), one_rank_group, mode)
    kind, dtype = context_mask(model)
    assert kind == {"sdpa": "boolean", "eager": "additive"}[implementation] and dtype == torch.float64
    for mask in (torch.tensor([[0, 0, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1, 1]]), torch.ones(2, 7, dtype=torch.int64)):
        ids = torch.randint(4, 32, mask.shape, generator=torch.Generator().manual_seed(1))
        positions = (mask.cumsum(1) - 1).clamp(min=0)
        expected = plain(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        four_d = pass_mask(mask, kind=kind, dtype=dtype)
        got = model(input_ids=ids, attention_mask=four_d, position_ids=positions).logits
        real = mask.bool()
        torch.testing.assert_close(got[real], expected[real], rtol=1e-12, atol=1e-12)
