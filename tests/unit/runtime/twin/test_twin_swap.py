"""The resharding swap on the npu twin, measured by the twin's allocator (not computed): during
generation the training state's bytes on the device go to zero, its copy sits in pinned host
memory, and the background swap-in on a side stream brings back the same tensors and values."""

from __future__ import annotations

import torch

from rldock.runtime.resharding.ledger import ledger_entry
from rldock.runtime.resharding.swap import TRAIN_STATE_CATEGORIES, SwapIn, TensorSwapper, training_state

DEVICE = "npu:3"  # a device nothing else in this test process uses (a string: "npu" parses only once the twin is in)


def _trained_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8)).to(DEVICE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 64, device=DEVICE)).square().mean().backward()
    optimizer.step()  # creates exp_avg / exp_avg_sq on the device
    return model, optimizer


def test_swap_out_frees_the_training_state_on_the_device_and_swap_in_restores_it(npu_twin):
    model, optimizer = _trained_model()
    state = training_state(model, optimizer)
    resident = npu_twin.memory_allocated(DEVICE)
    params = sum(p.numel() for p in model.parameters()) * 4
    assert resident == 4 * params  # params, grads, exp_avg, exp_avg_sq: all of it training state
    values = [p.detach().cpu().clone() for p in model.parameters()]
    pinned_before = npu_twin.pinned_memory_bytes()

    swapper = TensorSwapper(pin_memory=True)
    moved = swapper.swap_out(state)

    assert moved == resident
    assert npu_twin.memory_allocated(DEVICE) == 0  # measured: the device holds nothing of it
    assert swapper.host.is_pinned() and npu_twin.pinned_memory_bytes() - pinned_before >= moved
    generation = ledger_entry("generate", {}, device=torch.device(DEVICE), host_swap_bytes=swapper.swapped_bytes)
    assert generation["allocator"] == 0 and generation["host_swap"] == moved
    assert all(p.untyped_storage().nbytes() == 0 for p in model.parameters())

    tensors_before = [id(p) for p in model.parameters()]
    swap_in = SwapIn(swapper, TRAIN_STATE_CATEGORIES, device=torch.device(DEVICE))  # side stream, then wait
    assert swap_in.wait() == moved

    assert npu_twin.memory_allocated(DEVICE) == resident
    assert [id(p) for p in model.parameters()] == tensors_before
    for param, value in zip(model.parameters(), values):
        assert param.device == torch.device(DEVICE) and torch.equal(param.detach().cpu(), value)
    model(torch.randn(4, 64, device=DEVICE)).sum().backward()  # and the model trains on as before
    optimizer.step()


def test_peak_counter_sees_the_swap_buffer_never_on_the_device(npu_twin):
    model, optimizer = _trained_model()
    npu_twin.reset_peak_memory_stats(DEVICE)
    peak_start = npu_twin.max_memory_allocated(DEVICE)
    swapper = TensorSwapper(pin_memory=True)
    swapper.swap_out(training_state(model, optimizer))
    swapper.swap_in()
    assert npu_twin.max_memory_allocated(DEVICE) == peak_start  # the staging buffer lives on the host
