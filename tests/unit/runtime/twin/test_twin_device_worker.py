"""The integrated device worker on the npu twin: actor rank 0 and reference rank 0 of a colocated
GRPO job as role objects of one DeviceWorker, one process on npu:0, one allocator.

The job's plan gives one process per device. An iteration's old-logprob, reference and update
stages run through the worker's calls (each seat in its own call order); the update's weights go
to the engine (a weight sink double: generation on the twin is vLLM's CPU engine) and, with
`training.resharding: allgather_swap`, the actor's training state goes to host memory. In
generation the ledger shows 0 train-state bytes on the device, as with the actor in a process of
its own (test_twin_fsdp.py, test_twin_swap.py), and the twin's allocator, which now counts both
seats, holds exactly the tensors the seats keep there: the reference model and the actor's
buffers, none of the actor's parameters, gradients or optimizer state.
"""

from __future__ import annotations

import torch
from twin_doubles import ColumnDock, WeightSinkEngine, rollout_batch

from rldock.config.job import JobConfig
from rldock.runtime.engines.process_group import Rendezvous, destroy_process_group, init_process_group
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.states import StageCall, placement_plan
from rldock.runtime.resharding.ledger import TRAIN_STATE, resident_bytes
from rldock.runtime.training.strategies import build_backend
from rldock.runtime.workers.actor import ActorWorker
from rldock.runtime.workers.device_worker import DeviceWorker, Role, seat_processes
from rldock.runtime.workers.reference import ReferenceWorker

G, N = 2, 2


def _cfg(model_dir) -> JobConfig:
    return JobConfig(
        iterations=1,
        model={"path": str(model_dir)},
        resources={"device": "npu", "placement": "colocated"},
        training={"micro_batch_size": 2, "resharding": "allgather_swap"},
        algorithm={
            "name": "grpo",
            "num_prompts_per_iteration": G,
            "num_responses_per_prompt": N,
            "max_prompt_length": 4,
            "max_response_length": 3,
            "learning_rate": 1e-3,
            "kl_coef": 0.01,
            "recompute_old_logprobs": "always",
        },
    )


def test_actor_and_reference_share_one_process_and_generation_holds_no_training_state(npu_twin, twin_model_dir):
    cfg = _cfg(twin_model_dir)
    recipe = job_recipe(cfg)
    plan = placement_plan(cfg, recipe.specs)
    [process] = seat_processes(plan, collective={"actor"})
    assert process.names == ("actor 0", "reference 0")  # one process for the device

    dock = ColumnDock(rollout_batch(), states={})
    worker = DeviceWorker(
        [
            Role.of(
                "actor 0",
                ActorWorker,
                {
                    "cfg": cfg,
                    "recipe": recipe,
                    "rank": 0,
                    "world_size": 1,
                    "policy_dir": str(twin_model_dir),
                    "banks": dock,
                },
            ),
            Role.of(
                "reference 0",
                ReferenceWorker,
                {"cfg": cfg, "recipe": recipe, "rank": 0, "reference_dir": str(twin_model_dir), "banks": dock},
            ),
        ]
    )
    actor, reference = worker.roles["actor 0"], worker.roles["reference 0"]
    assert actor.device.torch_device == reference.device.torch_device == "npu:0"
    # What join_group does, without starting vLLM: the group, the job's backend, the engine.
    init_process_group(actor.device, rank=0, world_size=1, rendezvous=Rendezvous(address="127.0.0.1", port=0))
    try:
        actor.backend = build_backend(
            cfg, model=actor.model, make_optimizer=actor._make_optimizer, device=actor.device, rank=0, world_size=1
        )
        actor.generation.engine = WeightSinkEngine()
        actor.backend.attach_engine(actor.generation.engine, actor.generation.weights)

        worker.call("actor 0", 0, "compute_old_logprobs", StageCall(1))
        worker.call("reference 0", 0, "compute_ref_logprobs", StageCall(1))
        dock.batch["advantage"] = torch.tensor([1.0, -1.0, 0.5, -0.5])
        stats = worker.call("actor 0", 1, "update", StageCall(1))
    finally:
        destroy_process_group()

    ledger = stats.metrics["ledger"]
    assert actor.generation.engine.devices == {torch.device("npu:0")}  # the engine got the device's weights
    assert sum(ledger[f"memory/rank0/update_end/{category}"] for category in TRAIN_STATE) > 0
    assert sum(ledger[f"memory/rank0/generation/{category}"] for category in TRAIN_STATE) == 0
    assert ledger["memory/rank0/generation/host_swap"] == sum(
        ledger[f"memory/rank0/update_end/{category}"] for category in TRAIN_STATE
    )
    # Measured: the device holds the reference model and the actor's buffers, nothing else.
    kept = [*reference.model.parameters(), *reference.model.buffers(), *actor.model.buffers()]
    assert ledger["memory/rank0/generation/allocator"] == resident_bytes(kept, device_type="npu") > 0
    assert npu_twin.memory_allocated("npu:0") == ledger["memory/rank0/generation/allocator"]
