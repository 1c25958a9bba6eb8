"""The training backend is chosen once from `training` and applied to the plain model: the strategy
table, and each backend built on a one-rank gloo group with the model it trains."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from tiny_models import tiny_qwen2  # tests/tiny_models.py
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from rldock.config.job import JobConfig
from rldock.runtime.device import detect_device
from rldock.runtime.training.checksum import weights_sum
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.training.fsdp import FsdpBackend
from rldock.runtime.training.strategies import BACKENDS, build_backend, data_parallel_strategy_of, strategy_of
from rldock.runtime.training.tensor_parallel import TensorParallelBackend


def _cfg(**training) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": "/nonexistent"},
        training=training,
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-3,
        },
    )


@pytest.mark.parametrize(
    ("training", "strategy"),
    [
        ({}, "ddp"),
        ({"strategy": "fsdp"}, "fsdp"),
        ({"strategy": "fsdp", "resharding": "allgather_swap"}, "fsdp"),  # FSDP swaps its own shards
        ({"resharding": "allgather_swap"}, "tensor_parallel"),
        ({"tensor_parallel_size": 2}, "tensor_parallel"),
        ({"tensor_parallel_size": 2, "resharding": "allgather_swap"}, "tensor_parallel"),
    ],
)
def test_strategy_of_the_training_config(training, strategy):
    assert strategy_of(_cfg(**training)) == strategy


@pytest.mark.parametrize(
    ("training", "strategy"),
    [
        ({}, "ddp"),
        ({"strategy": "fsdp"}, "fsdp"),
        ({"resharding": "allgather_swap"}, "ddp"),  # no engine to reshard into
        ({"tensor_parallel_size": 2}, "ddp"),  # the policy's TP: a value model is not split
        ({"strategy": "fsdp", "resharding": "allgather_swap"}, "fsdp"),
    ],
)
def test_data_parallel_strategy_of_the_training_config(training, strategy):
    assert data_parallel_strategy_of(_cfg(**training)) == strategy


def _tiny_model():
    torch.manual_seed(0)
    return tiny_qwen2()


def test_each_strategy_builds_its_backend_around_the_same_model(tmp_path):
    """On a one-rank group: the backend keeps the actor's model object (wrapped or sharded in place),
    its optimizer holds the parameters as the layout has them, and the update's share is the
    iteration's samples over the DP ranks."""
    cases = {
        "ddp": ({}, DdpBackend),
        "fsdp": ({"strategy": "fsdp"}, FsdpBackend),
        "tensor_parallel": ({"resharding": "allgather_swap"}, TensorParallelBackend),
    }
    assert cases.keys() == BACKENDS.keys()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for name, (training, backend_class) in cases.items():
            cfg = _cfg(**training)
            model = _tiny_model()
            backend = build_backend(
                cfg,
                model=model,
                make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                device=detect_device("cpu"),
                rank=0,
                world_size=1,
            )
            assert type(backend) is backend_class, name
            held = [p for group in backend.optimizer.param_groups for p in group["params"]]
            assert [id(p) for p in held] == [id(p) for p in model.parameters()], name
            assert backend.update_share == cfg.num_samples_per_iteration, name
            assert backend.counts_passes and backend.writes_results, name  # a one-rank group: its passes are its own
            module = backend.training_module()
            if name == "ddp":
                assert isinstance(module, DistributedDataParallel) and module.module is model
            else:
                assert module is model, name
    finally:
        dist.destroy_process_group()


def test_weights_sum_is_the_whole_models_sum_whatever_the_layout(tmp_path):
    """A bare model sums its own tensors; FSDP's shards (DTensors, on a one-rank gloo group) sum to
    the same whole-model figure, and a critic-like `data_parallel_only` build of a TP config is DDP."""
    expected = math.fsum(float(p.detach().double().sum()) for p in _tiny_model().parameters())
    assert weights_sum(_tiny_model()) == expected
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        sharded = build_backend(
            _cfg(strategy="fsdp"),
            model=_tiny_model(),
            make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            device=detect_device("cpu"),
            rank=0,
            world_size=1,
        )
        assert all(isinstance(p, DTensor) for p in sharded.model.parameters())
        assert weights_sum(sharded.model) == pytest.approx(expected, rel=1e-12)
        replicas = build_backend(
            _cfg(tensor_parallel_size=2),
            model=_tiny_model(),
            make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
            device=detect_device("cpu"),
            rank=0,
            world_size=1,
            data_parallel_only=True,
        )
        assert type(replicas) is DdpBackend
    finally:
        dist.destroy_process_group()


def test_a_tensor_parallel_peer_reports_no_passes_of_its_own():
    """TP peers run their leader's batches through their slice of the model (run_training_stage):
    only the leaders' passes count toward a stage's FLOPs, so each pass counts once (the strategy
    test above checks that a one-rank backend of each kind counts its own)."""
    from rldock.runtime.resharding.parallel_layout import ParallelLayout

    layout = ParallelLayout(tp_size=2, dp_size=2)
    counting = []
    for rank in range(layout.world_size):
        backend = TensorParallelBackend.__new__(TensorParallelBackend)  # the layout only, no process group
        backend.rank, backend.train, backend._leader = rank, layout, layout.tp_group_ranks(rank)[0]
        if backend.counts_passes:
            counting.append(rank)
    assert counting == sorted({layout.tp_group_ranks(rank)[0] for rank in range(layout.world_size)})
    assert len(counting) == layout.dp_size


@pytest.mark.parametrize(
    "training", [{"resharding": "allgather_swap"}, {"strategy": "fsdp", "resharding": "allgather_swap"}]
)
def test_an_update_right_after_an_export_brings_its_training_state_back(tmp_path, training):
    """The run-ahead schedule (training.mode async) runs an iteration's old-logprob pass before the previous
    update, whose export swaps the training state out again; the last iteration's update then follows that
    export with no pass between. `before_update` brings back whatever is on the host, so the update runs on
    the weights it had before the export (a TP backend that trusted an earlier pass to have done it met
    empty storages)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        backend = build_backend(
            _cfg(**training),
            model=_tiny_model(),
            make_optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            device=detect_device("cpu"),
            rank=0,
            world_size=1,
        )
        input_ids = torch.arange(8).reshape(2, 4)  # (B, T)

        def update() -> float:
            backend.before_update()
            loss = backend.training_module()(input_ids=input_ids).logits.pow(2).mean()
            loss.backward()
            backend.step(1.0)
            return float(loss.detach())

        update()  # grads and AdamW's state exist from here on
        with torch.no_grad():
            before = float(backend.training_module()(input_ids=input_ids).logits.pow(2).mean())
        metrics = backend.export_weights(lambda weights: [w for _, w in weights], lambda: iter(()))
        assert metrics["ledger"]["memory/rank0/generation/host_swap"] > 0  # the export swapped the state out
        assert update() == before  # the same weights, back on the device
    finally:
        dist.destroy_process_group()
