"""The one micro-batch accumulation loop: k micro-batches, each loss scaled by its share, give the
gradient, step and grad norm of the whole mini-batch in one piece; gradient synchronisation is
deferred to the last micro-batch; the metrics are summed over the micro-batches."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

from rldock.config.job import JobConfig
from rldock.runtime.device import detect_device
from rldock.runtime.engines.process_group import wrap_ddp
from rldock.runtime.training.accumulation import accumulate
from rldock.runtime.training.ddp import DdpBackend

ROWS = 6


def _cfg() -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 3,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-3,
        },
    )


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    # float64: the split and whole sums differ only by rounding far below the tolerance on any CPU
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).double()


def _batch() -> TensorDict:
    generator = torch.Generator().manual_seed(1)
    return TensorDict(
        {
            "x": torch.randn(ROWS, 4, generator=generator, dtype=torch.float64),
            "y": torch.randn(ROWS, 1, generator=generator, dtype=torch.float64),
        },
        batch_size=[ROWS],
    )


def _micro_loss(module: torch.nn.Module):
    def micro_loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
        share = len(micro) / ROWS  # this micro-batch's share of the mean over the mini-batch
        loss = (module(micro["x"]) - micro["y"]).square().mean()
        return loss * share, {"loss": loss.item() * share, "rows": float(len(micro))}

    return micro_loss


def _whole_batch_step(max_grad_norm: float) -> tuple[torch.nn.Module, float, float]:
    model = _model()
    batch = _batch()
    loss = (model(batch["x"]) - batch["y"]).square().mean()
    loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    return model, norm, loss.item()


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4, ROWS])
@pytest.mark.parametrize("max_grad_norm", [1e9, 0.05], ids=["unclipped", "clipped"])
def test_k_micro_batches_step_like_the_whole_batch(micro_batch_size, max_grad_norm):
    expected, expected_norm, expected_loss = _whole_batch_step(max_grad_norm)
    model = _model()
    model[0].weight.grad = torch.ones_like(model[0].weight)  # a stale gradient the step must not keep
    backend = DdpBackend(
        _cfg(), model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), rank=0, world_size=1
    )

    stats = accumulate(
        backend, _batch().split(micro_batch_size), _micro_loss(backend.training_module()), max_grad_norm=max_grad_norm
    )

    assert stats["grad_norm"] == pytest.approx(expected_norm, rel=1e-9)
    assert stats["loss"] == pytest.approx(expected_loss, rel=1e-9)
    assert stats["rows"] == ROWS
    assert list(stats) == ["loss", "rows", "grad_norm"]
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)


def test_ddp_accumulates_under_no_sync_and_matches_the_whole_batch(tmp_path):
    """Through a real DDP wrapper (one gloo rank): the same step as the whole batch, with the
    non-last micro-batches' backward run under `no_sync`."""
    expected, expected_norm, _ = _whole_batch_step(1e9)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = _model()
        ddp = wrap_ddp(model, detect_device("cpu"))
        backend = DdpBackend(
            _cfg(),
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            rank=0,
            world_size=1,
            ddp_model=ddp,
        )
        contexts = []
        accumulating = backend.accumulating

        def recorded(*, last: bool):
            context = accumulating(last=last)
            contexts.append((last, type(context).__name__))
            return context

        backend.accumulating = recorded
        stats = accumulate(backend, _batch().split(2), _micro_loss(backend.training_module()), max_grad_norm=1e9)
    finally:
        dist.destroy_process_group()
    assert [last for last, _ in contexts] == [False, False, True]
    assert all(name != "enable_grad" for last, name in contexts if not last)  # DDP's no_sync
    assert stats["grad_norm"] == pytest.approx(expected_norm, rel=1e-9)
    for (name, got), want in zip(model.named_parameters(), expected.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12, msg=name)


class _RecordingBackend:
    """A test double of the backend's step half: records the loop's calls."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        self.calls: list[str] = []

    def accumulating(self, *, last: bool):
        self.calls.append(f"micro(last={last})")
        return nullcontext()

    def step(self, max_grad_norm: float) -> float:
        self.calls.append(f"step({max_grad_norm})")
        return 0.5


def test_the_loop_steps_once_after_every_micro_batch():
    model = _model()
    backend = _RecordingBackend(model)
    stats = accumulate(backend, _batch().split(4), _micro_loss(model), max_grad_norm=2.0)
    assert backend.calls == ["micro(last=False)", "micro(last=True)", "step(2.0)"]
    assert stats["grad_norm"] == 0.5


def test_ratio_spread_of_the_sampled_tokens():
    import math

    from rldock.runtime.training.policy_steps import ratio_spread

    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, 0.0, 0.0]])
    old = torch.tensor([[-1.0, -2.5, -9.0], [-1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])  # (-3 vs -9) is padding: left out
    # this micro-batch's 3 tokens of a mini-batch of 6: its part of the mean
    spread = ratio_spread(logprobs, old, mask, rank_tokens=6.0)
    deviations = [0.0, math.expm1(0.5), math.expm1(0.5)]
    assert spread["ratio_sq_dev_mean"] == pytest.approx(sum(d * d for d in deviations) / 6)
    assert spread["logprob_abs_diff_mean"] == pytest.approx(1.0 / 6)
    assert spread["ratio_abs_dev_max"] == pytest.approx(math.expm1(0.5))


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
@pytest.mark.parametrize(("dp", "cp"), [(1, 1), (2, 1), (1, 2), (2, 2), (3, 4)])
def test_rank_units_give_the_whole_batch_aggregate_under_context_parallelism(mode, dp, cp):
    """Every rank of a CP group holds its data-parallel group's rows and scales them by
    rank_units; the gradient reduction sums over each CP group (the group's shares of one
    numerator) and divides by dp (training/context_parallel.py). That must give the whole
    batch's aggregate for every loss_aggregation: a non-additive mode's constant divided by
    the world instead of dp would scale the step cp times (Dr. GRPO's seq_mean_token_sum_norm).
    The ranks of a TP group hold the same rows too and each computes the group's one loss: the same
    sums with cp standing for the cp x tp ranks that share a data-parallel rank's rows."""
    from rldock.runtime.algorithms.aggregation import additive_units, aggregate, aggregation_units
    from rldock.runtime.training.policy_steps import rank_units

    generator = torch.Generator().manual_seed(7)
    values = torch.rand(4 * dp, 5, generator=generator, dtype=torch.float64)  # (rows, T)
    mask = (torch.rand(4 * dp, 5, generator=generator) > 0.3).to(torch.float64)
    mask[:, 0] = 1.0  # no empty row
    shape = {"norm_length": 5}
    groups = list(zip(values.chunk(dp), mask.chunk(dp), strict=True))  # each DP group's rows
    additive = additive_units(mode)
    # every rank's units, all-reduced over the dp x cp ranks where additive (policy_step)
    group_units = [aggregation_units(m, mode, **shape) for _, m in groups]
    summed = sum(u for u in group_units for _ in range(cp)) if additive else group_units[0]
    units = rank_units(summed, additive=additive, world_size=dp * cp, rows_shared_by=cp)
    # a group's cp ranks' shares of its numerator sum to the group's numerator; then / dp
    reduced = sum(aggregate(v, m, mode, **shape) * aggregation_units(m, mode, **shape) / units for v, m in groups) / dp
    whole = float(aggregate(values, mask, mode, **shape))
    assert float(reduced) == pytest.approx(whole, rel=1e-5)  # aggregation_units counts in float32
