"""The torch side of a job on an NVIDIA GPU (`resources.device: cuda`), checked and timed on the
device. Prints one JSON document; exits 1 when a check fails.

    python -m rldock_benchmarks.gpu_checks                  # on a machine with a CUDA device
    .venv/bin/python -m rldock_benchmarks.gpu_checks --device cpu --layers 2   # the same code, CPU
    .venv/bin/python -m rldock_benchmarks.gpu_checks --device cpu --layers 1 --vocab 2048  # as the unit tests

What needs no Ray and no vLLM runs here, through the product's own functions, on a model of
SmolLM2-135M-Instruct's architecture with random weights (seed 0; the weights do not travel, the
shapes are what the memory and time depend on). Each check runs in a process of its own, so its
device context, allocator peak and collective group are its own:

  seam       `detect_device("cuda")` -> cuda:0 and NCCL; the product's `init_process_group` over
             NCCL (one rank: one GPU), then one AdamW step of the same causal-LM loss through the
             plain model, `wrap_ddp` and `apply_fsdp`: the weights after the step, and FSDP's
             `full_state_dict` gathered on the device, against the plain step's.
  passes     the policy's logprobs (`response_logprobs_and_entropy`) in packed passes and in
             padded rows on the same batch (update_cost's `smollm2` shape: G8 x N4, prompts 40-60
             and responses 12-64 tokens): their largest difference; then the update (AdamW over
             the trainable parameters, embeddings frozen, the clipped GRPO loss) timed in each
             layout, and its allocator peak against the memory planner's update phase for the
             example's config (`examples/grpo-smollm2-math.yaml` with `resources.device: cuda`).
  compiled   the same update eager and with the model's forward compiled (`torch.compile`,
             inductor, dynamic shapes, as update_cost's `compiled` step): seconds per update, the
             compile (the first update's extra) and the updates it takes to earn it back, and the
             compiled passes' logprobs against the model's. On the CPU the compile takes minutes.
  swap       allgather-swap's swap on the device: the training state (params, grads, AdamW
             moments) swapped to pinned host memory, the allocator's bytes before and during, and
             the side-stream swap-in (`SwapIn`) restoring the same tensors and values; D2H and H2D
             times against a plain copy of the same bytes between a device buffer and a pinned one.
  processes  issue 38's cost on a device: an actor (policy + AdamW) and a reference model on one
             GPU, in one process and in two. Each iteration the reference scores the batch, its
             logprobs go through host memory (the dock's path in both layouts), and the actor
             updates on them. Reported: seconds per iteration, the device memory in use (the
             driver's count, contexts included) and what the allocators hold.
  moe        a tiny Qwen3-MoE (8 experts, top-2, float32) on the device: Hugging Face's default experts
             kernel (grouped GEMM) and its eager loop score the same logprobs; the expert-parallel
             experts (`engines/expert_parallel.py`: sort by expert, all_to_all_single over the device's
             backend, local experts, all-to-all back) in a group of one give the eager model's
             logprobs and gradients, and the router's load-balancing loss trains the routers.
             (EP over several devices needs several GPUs; the CPU and npu twin tests run it.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

CHECKS = ("seam", "passes", "compiled", "swap", "processes", "moe")
VOCAB = 49152
# SmolLM2-135M-Instruct's config.json (the shapes; weights are random).
SMOLLM2 = dict(
    vocab_size=VOCAB,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_theta": 100000.0, "rope_type": "default"},
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
# float32 on both sides, one step: the layouts and wrappers may reorder sums, nothing more.
WEIGHT_ATOL = 1e-5
LOGPROB_ATOL = 1e-3  # packed vs padded passes: the attention kernels sum in different orders


def hf_config(layers: int, vocab: int = VOCAB) -> dict:
    return {**SMOLLM2, "num_hidden_layers": layers, "vocab_size": vocab, "model_type": "llama"}


def build_model(device: str, layers: int, *, vocab: int = VOCAB, seed: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in hf_config(layers, vocab).items() if k != "model_type"})
    config._attn_implementation = "sdpa"  # as from_pretrained picks where torch has it
    with torch.random.fork_rng(devices=[]):  # seeded weights, the caller's generator left as it was
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.to(device)  # type: ignore[arg-type]  # transformers' `to` wrapper


def synchronized(device: str):
    import torch

    def wait() -> None:
        if device != "cpu":
            torch.cuda.synchronize()

    return wait


def timed(fn, wait) -> float:
    wait()
    start = time.perf_counter()
    fn()
    wait()
    return time.perf_counter() - start


def lm_batch(device: str, *, rows: int = 4, length: int = 128, vocab: int = VOCAB):
    import torch

    generator = torch.Generator().manual_seed(1)
    return torch.randint(3, vocab, (rows, length), generator=generator).to(device)


def lm_step(model, optimizer, tokens) -> float:
    loss = model(input_ids=tokens, labels=tokens, use_cache=False).loss
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def check_seam(args) -> dict:
    import torch
    import torch.distributed as dist

    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.fsdp_sharding import apply_fsdp, full_state_dict
    from rldock.runtime.engines.process_group import Rendezvous, destroy_process_group, init_process_group, wrap_ddp
    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh

    info = detect_device(args.device)
    # open_rendezvous asks Ray for the node's address; one rank on this machine listens on loopback.
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    init_process_group(info, rank=0, world_size=1, rendezvous=Rendezvous("127.0.0.1", store.port), store=store)
    try:  # the group goes whatever happens: the CPU test runs this in the suite's process
        tokens = lm_batch(info.torch_device, vocab=args.vocab)
        after, losses = {}, {}
        for wrapper in ("plain", "ddp", "fsdp"):
            model = build_model(info.torch_device, args.layers, vocab=args.vocab)
            trained: torch.nn.Module
            if wrapper == "ddp":
                trained = wrap_ddp(model, info)
            elif wrapper == "fsdp":
                trained = apply_fsdp(model, info, ParallelMesh(MeshShape(dp=1), torch.device(info.torch_device).type))
            else:
                trained = model
            optimizer = torch.optim.AdamW(trained.parameters(), lr=1e-4)
            losses[wrapper] = lm_step(trained, optimizer, tokens)
            weights = full_state_dict(model) if wrapper == "fsdp" else model.state_dict().items()
            after[wrapper] = {name: value.detach().clone() for name, value in weights}
            del trained, model, optimizer
        backend = dist.get_backend()
    finally:
        destroy_process_group()
    plain = after["plain"]
    differences = {
        wrapper: max(float((after[wrapper][name] - value).abs().max()) for name, value in plain.items())
        for wrapper in ("ddp", "fsdp")
    }
    devices = sorted({str(value.device) for value in after["fsdp"].values()})
    ok = (
        info.kind == args.device
        and all(diff <= WEIGHT_ATOL for diff in differences.values())
        and devices == [str(torch.device(info.torch_device))]
    )
    return {
        "device": info.torch_device,
        "backend": backend,
        "losses": losses,
        "max_weight_difference_after_one_step": differences,
        "fsdp_full_state_dict_devices": devices,
        "ok": ok,
    }


MOE_ATOL = 1e-4  # float32, the same math grouped differently (kernels sum in other orders)


def check_moe(args) -> dict:
    import copy

    import torch
    import torch.distributed as dist

    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.expert_parallel import apply_expert_parallel
    from rldock.runtime.engines.process_group import Rendezvous, destroy_process_group, init_process_group
    from rldock.runtime.models.moe import load_balancing_loss, record_routing, routers
    from rldock.runtime.resharding.parallel_mesh import ExpertSharding
    from rldock_e2e.moe_fixture import moe_model, token_logprobs, whole_batch

    info = detect_device(args.device)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60), wait_for_workers=False)
    init_process_group(info, rank=0, world_size=1, rendezvous=Rendezvous("127.0.0.1", store.port), store=store)
    try:
        device = info.torch_device
        eager = moe_model().to(device=device, dtype=torch.float32)
        grouped = copy.deepcopy(eager)
        grouped.config._experts_implementation = "grouped_mm"  # transformers' default kernel
        parallel = copy.deepcopy(eager)
        apply_expert_parallel(parallel, ExpertSharding(group=dist.group.WORLD, rank=0, size=1))
        tokens = whole_batch(2).to(device)
        scores = {}
        for name, model in (("eager", eager), ("grouped_mm", grouped), ("expert_parallel", parallel)):
            with record_routing(model) as record:
                scores[name] = token_logprobs(model, tokens)
            aux = load_balancing_loss(record, num_experts=8, top_k=2)
            (-scores[name].mean() + 0.01 * aux).backward()
        grads = {n: p.grad for n, p in eager.named_parameters()}
        grad_gap = max(float((p.grad - grads[n]).abs().max()) for n, p in parallel.named_parameters())
        router_grads = all(float(gate.weight.grad.abs().sum()) > 0 for gate in routers(parallel))
        backend = dist.get_backend()
    finally:
        destroy_process_group()
    gaps = {
        name: float((scores[name] - scores["eager"]).detach().abs().max()) for name in ("grouped_mm", "expert_parallel")
    }
    return {
        "device": info.torch_device,
        "backend": backend,
        "max_logprob_difference_from_eager": gaps,
        "max_gradient_difference_expert_parallel": grad_gap,
        "routers_trained_by_aux_loss": router_grads,
        "ok": all(gap <= MOE_ATOL for gap in gaps.values()) and grad_gap <= MOE_ATOL and router_grads,
    }


def passes_config(args):
    from pathlib import Path

    import yaml

    from rldock.config import parse_job_config

    example = yaml.safe_load((Path(__file__).parents[3] / "examples" / "grpo-smollm2-math.yaml").read_text())
    example["model"]["path"] = "unused"  # planned, never loaded
    example["resources"] = {"device": args.device, "devices_per_node": 1}
    return parse_job_config(example)


def smollm2_batch(device: str, vocab: int = VOCAB):
    """update_cost's `smollm2` batch (G8 x N4, prompts 40-60 and responses 12-64 tokens) on `device`."""
    from rldock_benchmarks.update_cost import SHAPES, make_batch

    return make_batch(SHAPES["smollm2"], vocab_size=vocab).to(device)


def batch_logprobs(model, batch, *, micro_batch_size: int, grad: bool = False):
    """The response logprobs (B, SL) of `batch` under `model`, in the product's passes."""
    import torch

    from rldock.runtime.engines.policy import response_logprobs_and_entropy

    with torch.set_grad_enabled(grad):
        return response_logprobs_and_entropy(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            micro_batch_size=micro_batch_size,
            trim=True,
            attention_mask=batch["response_attention_mask"],
        ).logprobs


class PolicyUpdate:
    """The actor's update on `smollm2_batch`, through the product's passes: a model of SmolLM2's
    architecture with its embeddings frozen, AdamW's state already made (zero gradients, one
    step), `micro_batch_size` rows a pass, the clipped GRPO loss."""

    def __init__(self, device: str, layers: int, micro_batch_size: int, *, vocab: int = VOCAB):
        import torch

        from rldock.runtime.algorithms import get_policy_loss
        from rldock.runtime.models.freezing import freeze_embeddings, trainable
        from rldock_benchmarks.update_cost import SHAPES

        self.shape = SHAPES["smollm2"]
        self.micro_batch_size = micro_batch_size
        self.model = build_model(device, layers, vocab=vocab)
        self.forward = self.model  # what the update's passes call: the model, or it compiled
        freeze_embeddings(self.model)
        self.batch = smollm2_batch(device, vocab)
        self.optimizer = torch.optim.AdamW(trainable(self.model.parameters()), lr=1e-6)
        for p in trainable(self.model.parameters()):
            p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.policy_loss = get_policy_loss("clipped")

    @property
    def tokens(self) -> int:
        return int(self.batch["prompt_mask"].sum() + self.batch["response_attention_mask"].sum())

    def logprobs(self, model, rows=None, *, grad: bool = False):
        batch = self.batch if rows is None else self.batch[rows]
        return batch_logprobs(model, batch, micro_batch_size=self.micro_batch_size, grad=grad)

    def step(self, old_logprobs=None) -> None:
        """One update: micro-batches as the actor groups them, the clipped loss against
        `old_logprobs` (B, SL; default the policy's own, detached), one AdamW step."""
        from rldock.runtime.engines import policy
        from rldock_benchmarks.update_cost import micro_loss

        batch, micro_batch_size = self.batch, self.micro_batch_size
        total_tokens = int(batch["response_mask"].sum())
        self.optimizer.zero_grad(set_to_none=True)
        packing = policy.packing_prompts(
            self.model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_attention_mask"],
            trim=True,
            micro_batch_size=micro_batch_size,
        )
        groups = policy.micro_batch_rows(
            batch["prompt_mask"],
            batch["response_attention_mask"],
            trim=True,
            micro_batch_size=micro_batch_size,
            prompt_ids=packing,
        )
        for rows in groups:
            logprobs = self.logprobs(self.forward, rows, grad=True)
            old = logprobs.detach() if old_logprobs is None else old_logprobs[rows]
            micro_loss(self.policy_loss, logprobs, old, batch[rows], self.shape, total_tokens).backward()
        self.optimizer.step()


@contextmanager
def row_passes(enabled: bool) -> Iterator[None]:
    """Within: passes of padded rows where `enabled`, else the product's choice (packed where it
    pays); the product's choice again after."""
    from rldock.runtime.engines import policy

    product = policy.packs_sequences
    if enabled:
        policy.packs_sequences = lambda model: False
    try:
        yield
    finally:
        policy.packs_sequences = product


def check_passes(args) -> dict:
    from rldock.runtime.planning.memory import plan_memory
    from rldock.runtime.planning.shapes import shape_from_hf_config

    device, wait = args.device, synchronized(args.device)
    cfg = passes_config(args)
    update = PolicyUpdate(device, args.layers, cfg.training.micro_batch_size, vocab=args.vocab)
    mask = update.batch["response_mask"].bool()
    logprobs = {}
    for rows in (False, True):
        with row_passes(rows):
            logprobs[rows] = update.logprobs(update.model)
    difference = float((logprobs[True] - logprobs[False])[mask].abs().max())
    layouts: dict[str, dict[str, Any]] = {}
    for name, rows in (("packed", False), ("rows", True)):
        with row_passes(rows):
            update.step()  # warm-up: kernels chosen, the allocator's pool grown
            state_bytes = memory_allocated(device)
            reset_peak(device)
            seconds = [timed(update.step, wait) for _ in range(args.repeats)]
        median = statistics.median(seconds)
        layouts[name] = {
            "seconds_per_update": round(median, 4),
            "seconds": [round(s, 4) for s in seconds],
            "tokens_per_s": round(update.tokens / median),
            "training_state_bytes": state_bytes,
            "update_peak_bytes": max_allocated(device),
        }
    beyond_tensors = workspace_bytes(device)
    plan = plan_memory(cfg, shape_from_hf_config(hf_config(args.layers, args.vocab), name="smollm2-shaped"))
    planned = plan.update.training_state + plan.update.activations
    measured = layouts["rows"]["update_peak_bytes"]
    on_device = device != "cpu"
    return {
        "shape": "smollm2 (update_cost): G8 x N4, prompts 40-60, responses 12-64 tokens",
        "micro_batch_size": cfg.training.micro_batch_size,
        "max_logprob_difference_packed_vs_rows": difference,
        "layouts": layouts,
        "packed_over_rows_seconds": round(
            layouts["packed"]["seconds_per_update"] / layouts["rows"]["seconds_per_update"], 3
        ),
        "planner": {
            "training_state_bytes": plan.update.training_state,
            "activation_bytes": plan.update.activations,
            "update_bytes": planned,
            "measured_peak_rows_over_planned": round(measured / planned, 3) if on_device else None,
            "measured_state_over_planned": round(
                layouts["rows"]["training_state_bytes"] / plan.update.training_state, 3
            )
            if on_device
            else None,
            "cublas_workspace_bytes": beyond_tensors,
        },
        # the planner's figures are measured against, not asserted: the check is the passes' agreement
        "ok": difference <= LOGPROB_ATOL,
    }


def check_compiled(args) -> dict:
    """The update eager and with the model's forward compiled (inductor, dynamic shapes, as
    update_cost's `compiled` step), on the same batch: seconds per update after the first, and
    the first update's extra (the compile) counted against the iterations it takes to pay back."""
    import torch

    device, wait = args.device, synchronized(args.device)
    micro_batch_size = passes_config(args).training.micro_batch_size
    found: dict[str, dict[str, Any]] = {}
    difference = 0.0
    for name in ("eager", "compiled"):
        torch.compiler.reset()
        update = PolicyUpdate(device, args.layers, micro_batch_size, vocab=args.vocab)
        if name == "compiled":
            update.forward = torch.compile(update.model, dynamic=True)
        first = timed(update.step, wait)
        if name == "compiled":  # the compiled passes score as the model does
            mask = update.batch["response_mask"].bool()
            gap = update.logprobs(update.forward) - update.logprobs(update.model)
            difference = float(gap[mask].abs().max())
        seconds = [timed(update.step, wait) for _ in range(args.repeats)]
        median = statistics.median(seconds)
        found[name] = {
            "first_update_s": round(first, 3),
            "seconds_per_update": round(median, 4),
            "seconds": [round(s, 4) for s in seconds],
        }
        del update
    eager, compiled = found["eager"], found["compiled"]
    compile_s = compiled["first_update_s"] - eager["first_update_s"]
    saved = eager["seconds_per_update"] - compiled["seconds_per_update"]
    return found | {
        "compile_s": round(compile_s, 1),
        "compiled_over_eager_seconds": round(compiled["seconds_per_update"] / eager["seconds_per_update"], 3),
        # updates after which the compile has paid for itself (None: it never does)
        "updates_to_pay_back": round(compile_s / saved, 1) if saved > 0 else None,
        "max_logprob_difference_compiled_vs_eager": difference,
        # whether it pays is the finding, not a check; the check is that it computes the same
        "ok": difference <= LOGPROB_ATOL,
    }


def workspace_bytes(device: str) -> int | None:
    """What the allocator holds for cuBLAS's workspaces (allocated through it, beside the tensors):
    the drop when they are freed."""
    import torch

    if device == "cpu" or not hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        return None
    before = torch.cuda.memory_allocated()
    torch._C._cuda_clearCublasWorkspaces()
    return int(before - torch.cuda.memory_allocated())


def memory_allocated(device: str) -> int:
    import torch

    return int(torch.cuda.memory_allocated()) if device != "cpu" else 0


def max_allocated(device: str) -> int:
    import torch

    return int(torch.cuda.max_memory_allocated()) if device != "cpu" else 0


def reset_peak(device: str) -> None:
    import torch

    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()


def check_swap(args) -> dict:
    import torch

    from rldock.runtime.resharding.ledger import ledger_entry
    from rldock.runtime.resharding.swap import (
        TRAIN_STATE_CATEGORIES,
        SwapIn,
        TensorSwapper,
        make_storages_resizable,
        training_state,
    )

    device, wait = args.device, synchronized(args.device)
    on_device = device != "cpu"
    model = build_model(device, args.layers, vocab=args.vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lm_step(model, optimizer, lm_batch(device, vocab=args.vocab))  # AdamW's moments exist, the gradients are held
    make_storages_resizable(model)

    def state_objects() -> list:
        """The training state's own tensor objects: parameters, their gradients, AdamW's moments."""
        params = list(model.parameters())
        moments = [value for per_param in optimizer.state.values() for value in per_param.values()]
        return params + [p.grad for p in params] + [m for m in moments if m.device == params[0].device]

    objects = state_objects()
    # copies on the host (not counted on the device; on the CPU a copy, not a view the swap empties)
    values = [tensor.detach().to("cpu", copy=True) for tensor in objects]
    resident = memory_allocated(device)
    swapper = TensorSwapper(pin_memory=on_device)
    d2h, h2d, during, moved, restored = [], [], [], 0, True
    for _ in range(args.repeats):
        state = training_state(model, optimizer)
        wait()
        start = time.perf_counter()
        moved = swapper.swap_out(state)
        wait()
        d2h.append(time.perf_counter() - start)
        during.append(ledger_entry("generate", {}, device=torch.device(device), host_swap_bytes=moved)["allocator"])
        start = time.perf_counter()
        SwapIn(swapper, TRAIN_STATE_CATEGORIES, device=torch.device(device)).wait()
        wait()
        h2d.append(time.perf_counter() - start)
        # params, grads and AdamW's moments: the same tensor objects with the same values
        restored = restored and all(now is then for now, then in zip(state_objects(), objects, strict=True))
        restored = restored and all(torch.equal(t.detach().cpu(), v) for t, v in zip(objects, values))
    del values
    workspace = workspace_bytes(device)
    device_side = torch.ones(moved, dtype=torch.uint8, device=device)
    host_side = torch.ones(moved, dtype=torch.uint8, pin_memory=on_device)
    plain_d2h = statistics.median(timed(lambda: host_side.copy_(device_side), wait) for _ in range(args.repeats))
    plain_h2d = statistics.median(timed(lambda: device_side.copy_(host_side), wait) for _ in range(args.repeats))
    d2h_s, h2d_s = statistics.median(d2h), statistics.median(h2d)
    return {
        "training_state_bytes": moved,
        "allocated_before": resident,
        "allocated_during_generation": during,
        "host_buffer_pinned": swapper.host.is_pinned(),
        "restored_same_tensors_and_values": restored,
        "d2h_s": round(d2h_s, 5),
        "h2d_s": round(h2d_s, 5),
        "plain_copy_d2h_s": round(plain_d2h, 5),
        "plain_copy_h2d_s": round(plain_h2d, 5),
        "d2h_vs_plain": round(d2h_s / plain_d2h, 3),
        "h2d_vs_plain": round(h2d_s / plain_h2d, 3),
        "d2h_gb_per_s": round(moved / d2h_s / 1e9, 2),
        "h2d_gb_per_s": round(moved / h2d_s / 1e9, 2),
        "cublas_workspace_bytes": workspace,
        # In generation the allocator keeps what is not training state (buffers, the batch, cuBLAS's
        # workspaces) and none of the state: at most `resident - moved`, less where the state's
        # blocks held more than their bytes (the allocator does not split a block for a remainder
        # under 1 MiB).
        "ok": restored and (not on_device or (max(during) <= resident - moved and swapper.host.is_pinned())),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument(
        "--layers", type=int, default=SMOLLM2["num_hidden_layers"], help="decoder layers (30: SmolLM2's)"
    )
    parser.add_argument(
        "--vocab",
        type=int,
        default=VOCAB,
        help="vocabulary size (49152: SmolLM2's); the CPU tests take a small one, as the LM head is most of "
        "a one-layer model's compute",
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement, after a warm-up")
    parser.add_argument("--rounds", type=int, default=3, help="processes: runs of each layout, alternating")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a check may take; then it fails")
    parser.add_argument("--one", choices=CHECKS, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args(argv)
    if args.one:
        from rldock_benchmarks import gpu_processes

        run = {
            "seam": check_seam,
            "passes": check_passes,
            "compiled": check_compiled,
            "swap": check_swap,
            "processes": gpu_processes.compare,
            "moe": check_moe,
        }
        print(json.dumps(run[args.one](args)))
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device: run with --device cpu for the same code on the CPU")
    results = {}
    for check in args.checks:
        try:
            child = subprocess.run(
                [sys.executable, "-m", "rldock_benchmarks.gpu_checks", "--one", check]
                + ["--device", args.device, "--layers", str(args.layers), "--vocab", str(args.vocab)]
                + ["--repeats", str(args.repeats), "--rounds", str(args.rounds)],
                capture_output=True,
                text=True,
                timeout=args.timeout,  # the child is killed then
            )
        except subprocess.TimeoutExpired:
            results[check] = {"ok": False, "error": [f"did not finish in --timeout {args.timeout:g} s"]}
        else:
            if child.returncode == 0:
                results[check] = json.loads(child.stdout.splitlines()[-1])
            else:  # reported, not hidden
                results[check] = {"ok": False, "error": child.stderr.strip().splitlines()[-12:]}
        print(json.dumps({check: results[check]}), file=sys.stderr, flush=True)
    print(
        json.dumps(
            {
                "benchmark": "gpu_checks",
                "machine": machine(args.device),
                "layers": args.layers,
                "vocab": args.vocab,
                "results": results,
            },
            indent=2,
        )
    )
    sys.exit(0 if all(result.get("ok") for result in results.values()) else 1)


def machine(device: str) -> dict:
    import torch
    import transformers

    found = {"cpus": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__}
    found["device"] = device
    if device == "cuda":
        from rldock_benchmarks.gpu_processes import nvidia_smi

        found |= {
            "gpu": torch.cuda.get_device_name(),
            "driver": nvidia_smi("driver_version"),
            "cuda": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        }
    return found


if __name__ == "__main__":
    main()
