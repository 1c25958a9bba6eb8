"""FSDP2 on real gloo ranks (torch.multiprocessing, CPU): the actor's FsdpBackend trains, pushes the
gathered weights and swaps its shards out and back; and, on a ~110M-parameter model, the memory
planner's training-state bytes per rank match what the ranks measure, FSDP holds about half of
DDP's, and both strategies give the same losses (rldock_benchmarks.fsdp_vs_ddp)."""

from __future__ import annotations

import json
import math
import socket
import string
from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist
from dock_double_base import PutThenGet  # tests/dock_double_base.py

pytestmark = pytest.mark.ranks

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    tie_word_embeddings=True,
    max_position_embeddings=64,
)
WORLD = 2


class RecordingEngine:
    """Test double of the vLLM engine's `update_weights`: keeps what it is given (vLLM cannot join
    these bare gloo ranks; tests/integration/test_resharding_vllm.py covers the real load)."""

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}

    def update_weights(self, named_tensors) -> float:
        self.weights = {name: tensor.detach().clone() for name, tensor in named_tensors}
        return 0.0


def _adamw(params) -> torch.optim.Optimizer:
    """AdamW whose first step is well conditioned in the gradient. Its step is lr * g / (|g| + eps):
    with the usual eps 1e-8 a gradient element near 0 moves its weight by up to lr / eps = 1e6 times
    its rounding error, so FSDP's sum of two halves and one process's sum over the whole batch
    (equal up to float rounding, which depends on the CPU's kernels) could differ by more than the
    comparison's tolerance in one element of 10^4 (seen on one AMD EPYC machine: 1.2e-5 in one
    v_proj weight). With eps 1e-3 that factor is at most lr / eps = 10."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def _tiny_model(checkpointing: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rldock.runtime.models.layers import enable_activation_checkpointing

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    if checkpointing:
        enable_activation_checkpointing(model)
    return model


def _batch() -> torch.Tensor:
    return torch.randint(0, TINY["vocab_size"], (2 * WORLD, 16), generator=torch.Generator().manual_seed(1))


def _cfg(*, devices: int = WORLD, **training):
    """A job config of `devices` FSDP actor ranks (data_parallel_size `devices` unless `training` says),
    a prompt group each."""
    from rldock.config import parse_job_config

    return parse_job_config(
        {
            "iterations": 1,
            "model": {"path": "unused"},
            "checkpoint": {"interval": 1},
            # Never trained as a job: no prompts or rewards are read, but a model of one's own must name them.
            "data": {"generator": {"name": "addition"}},
            "reward": {"terms": [{"name": "digit_match"}]},
            "algorithm": {
                "name": "grpo",
                "num_prompts_per_iteration": devices,
                "num_responses_per_prompt": 2,
                "max_prompt_length": 8,
                "max_response_length": 8,
                "learning_rate": 1e-2,
            },
            "training": {"strategy": "fsdp", "data_parallel_size": devices, **training},
            "resources": {"device": "cpu", "devices_per_node": devices},
        }
    )


def _fsdp_rank(rank: int, port: int, out_dir: str, trainings: dict[str, dict]) -> None:
    """Each of `trainings` (name -> training fields) in turn on the same two gloo ranks: a step, the
    weights pushed, the shards swapped out and back; its files <name>/rank<r>.pt."""
    from rldock.runtime.device import detect_device
    from rldock.runtime.training.fsdp import FsdpBackend

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    for name, training in trainings.items():
        cfg = _cfg(**training)
        model = _tiny_model(cfg.training.gradient_checkpointing)
        fsdp = FsdpBackend(cfg, model=model, make_optimizer=_adamw, device=detect_device("cpu"), rank=rank)
        mine = _batch()[rank * 2 : (rank + 1) * 2]
        fsdp.model(input_ids=mine, labels=mine).loss.backward()
        grad_norm = fsdp.clip_gradients(1e9)
        fsdp.optimizer.step()
        engine = RecordingEngine()
        fsdp.to_generation(engine.update_weights)
        metrics = fsdp.drain_metrics()["ledger"]
        fsdp.to_training()  # the next iteration's pass: everything back, training goes on
        loss = float(fsdp.model(input_ids=mine, labels=mine).loss)
        (Path(out_dir) / name).mkdir(exist_ok=True)
        torch.save(
            {"weights": engine.weights, "ledger": metrics, "grad_norm": grad_norm, "loss": loss},
            Path(out_dir) / name / f"rank{rank}.pt",
        )
    # Every rank's last collective has arrived before any rank tears the group down: a rank that
    # exits while its peer's gloo thread still talks to it aborts ("terminate called without an
    # active exception", SIGABRT, seen once in a CI run).
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _single_process_step(checkpointing: bool) -> tuple[dict[str, torch.Tensor], float]:
    """The same step on one process over the whole batch: what FSDP's ranks must reproduce."""
    model = _tiny_model(checkpointing)
    optimizer = _adamw(model.parameters())
    batch = _batch()
    model(input_ids=batch, labels=batch).loss.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9))
    optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}, norm


TRAININGS = {
    "swap": {"resharding": "allgather_swap"},
    "swap+checkpointing": {"resharding": "allgather_swap", "gradient_checkpointing": True},
    "cpu_offload": {"fsdp_cpu_offload": True},
}


@pytest.fixture(scope="module")
def fsdp_ranks(tmp_path_factory) -> Path:
    """Every one of TRAININGS on one spawn of the two ranks (one start of the processes, not three)."""
    out_dir = tmp_path_factory.mktemp("fsdp-ranks")
    rank_processes.spawn(_fsdp_rank, args=(_free_port(), str(out_dir), TRAININGS), nprocs=WORLD)
    return out_dir


@pytest.mark.parametrize("name", list(TRAININGS))
def test_fsdp_step_push_and_swap_on_gloo_ranks(fsdp_ranks, name):
    training = TRAININGS[name]
    ranks = [torch.load(fsdp_ranks / name / f"rank{r}.pt") for r in range(WORLD)]
    expected, norm = _single_process_step(training.get("gradient_checkpointing", False))
    for rank, got in enumerate(ranks):
        # The engine got every weight whole, equal to one process stepping on the whole batch.
        assert got["weights"].keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(got["weights"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        assert got["grad_norm"] == pytest.approx(norm, rel=1e-4)
        assert torch.isfinite(torch.tensor(got["loss"]))
        ledger = got["ledger"]
        prefix = f"memory/rank{rank}"
        state_before = sum(ledger[f"{prefix}/after_update/{c}"] for c in ("train_params", "grads", "optimizer_state"))
        state_during = sum(ledger[f"{prefix}/generation/{c}"] for c in ("train_params", "grads", "optimizer_state"))
        if training.get("resharding") == "allgather_swap":  # nothing of the training state stays during generation
            assert state_before > 0 and state_during == 0
            assert ledger[f"{prefix}/generation/host_swap"] == state_before
        else:
            assert state_during == state_before and ledger[f"{prefix}/generation/host_swap"] == 0
    # Each rank holds about half the parameters: the shards of both ranks add up to the model.
    full_bytes = sum(t.numel() * t.element_size() for t in expected.values())
    shards = [r["ledger"][f"memory/rank{i}/after_update/train_params"] for i, r in enumerate(ranks)]
    assert sum(shards) == pytest.approx(full_bytes, rel=0.05) and max(shards) <= 0.55 * full_bytes


def _planner_check(argv: list[str]) -> None:
    """Planner within 10% of the training-state bytes each rank measures; FSDP <= 0.55x DDP; equal losses."""
    from rldock_benchmarks.fsdp_vs_ddp import parse_args, run_strategy, summarize

    args = parse_args(argv)
    report = summarize(args, {strategy: run_strategy(args, strategy) for strategy in ("ddp", "fsdp")})
    for strategy in ("ddp", "fsdp"):
        planned = report[strategy]["planned_state_bytes_per_rank"]
        for measured in report[strategy]["state_bytes_per_rank"]:
            assert abs(planned - measured) <= 0.10 * measured, json.dumps(report[strategy])
    assert report["state_ratio_fsdp_over_ddp"] <= 0.55
    assert report["losses_equal"], report["max_loss_rel_diff"]


def test_planner_matches_fsdp_ranks_and_fsdp_halves_ddp_on_a_small_llama(tmp_path):
    """The issue's check at CI size: a ~9M-parameter Llama saved and loaded through the real loading
    code (the ~110M run below is the same check, opt-in: `make test-slow`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=8000,
            hidden_size=384,
            num_hidden_layers=4,
            num_attention_heads=6,
            num_key_value_heads=2,
            intermediate_size=1024,
            tie_word_embeddings=True,
            max_position_embeddings=512,
        )
    ).save_pretrained(tmp_path / "llama")
    _planner_check(["--model-dir", str(tmp_path / "llama"), "--steps", "2", "--threads", "1"])


@pytest.mark.slow
def test_planner_matches_100m_fsdp_ranks_and_fsdp_halves_ddp():
    """The issue's check: ~110M parameters on 2 FSDP ranks. About 5-10 minutes here (opt-in:
    `make test-slow`)."""
    _planner_check(["--steps", "2", "--threads", "1"])


# --- the PPO critic on FSDP ranks -------------------------------------------------------------

CRITIC_SAMPLES = 8


class RankShareDock(PutThenGet):
    """Test double of the transfer dock for one critic rank: hands `critic_update` this rank's rows
    once (the real dock's token-balanced share), as DockBanks would for any iteration."""

    def __init__(self, batch, rank: int):
        share = CRITIC_SAMPLES // WORLD
        self.rows = torch.arange(rank * share, (rank + 1) * share)
        self.batch, self.given, self.waited_s, self.drained = batch, False, 0.0, False

    def bank(self, iteration):
        return self

    def get(self, state, columns, **kwargs):
        if self.given:
            return None
        self.given = True
        return self.rows, self.batch[self.rows].select(*columns)

    def put(self, indices, out, *, policy_version=None):
        raise AssertionError("critic_update writes nothing")


def _critic_cfg(policy_dir: str, data_parallel_size: int):
    from rldock.config.job import JobConfig

    return JobConfig(
        iterations=1,
        model={"path": policy_dir},
        resources={"device": "cpu", "devices_per_node": WORLD},
        # two micro-batches per rank: FSDP accumulates them before its one reduce-scatter
        training={
            "strategy": "fsdp",
            "data_parallel_size": data_parallel_size,
            "micro_batch_size": 2,
            "num_threads": 0,
        },
        algorithm={
            "name": "ppo",
            "num_prompts_per_iteration": 2,
            "num_responses_per_prompt": CRITIC_SAMPLES // 2,
            "max_prompt_length": 3,
            "max_response_length": 3,
            "learning_rate": 1e-3,
            "ppo": {"critic_learning_rate": 1e-2},
        },
    )


def _critic_batch(seed: int):
    """Value targets for 8 responses: old values 0.5 off on every other token (past the clip)."""
    from tensordict import TensorDict

    generator = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(2, 32, (CRITIC_SAMPLES, 3), generator=generator)  # (B, PL)
    response_ids = torch.randint(2, 32, (CRITIC_SAMPLES, 3), generator=generator)  # (B, SL)
    response_mask = torch.ones_like(response_ids)
    response_mask[::3, 2] = 0  # responses of different lengths
    targets = torch.randn((CRITIC_SAMPLES, 3), generator=generator)  # (B, SL)
    return TensorDict(
        {
            "prompt_ids": prompt_ids,
            "prompt_mask": torch.ones_like(prompt_ids),
            "response_ids": response_ids,
            "response_mask": response_mask,
            "values": (targets + 0.5 * (torch.arange(targets.numel()).reshape(targets.shape) % 2)) * response_mask,
            "returns": targets * response_mask,
            "value_mask": response_mask.clone(),  # GAE by token: every model token's value trains
        },
        batch_size=[CRITIC_SAMPLES],
    )


def _critic(policy_dir: str, *, rank: int, world_size: int, banks):
    from rldock.runtime.flow.job_recipe import job_recipe
    from rldock.runtime.workers.critic import CriticWorker

    cfg = _critic_cfg(policy_dir, world_size)
    critic = CriticWorker(
        cfg, recipe=job_recipe(cfg), policy_dir=policy_dir, banks=banks, rank=rank, world_size=world_size
    )
    # `_adamw`'s well-conditioned first step, for the comparison with one process; join_group builds
    # it on the layout's parameters, a lone rank keeps the one built here.
    critic._make_optimizer = _adamw
    critic.backend.optimizer = _adamw(critic.model.parameters())
    with torch.no_grad():  # a head that predicts something (the new one predicts 0), alike on every rank
        critic.model.head.weight.copy_(
            torch.linspace(-1, 1, critic.model.head.weight.numel()).view_as(critic.model.head.weight)
        )
    return critic


def _critic_rank(rank: int, ports: tuple[int, int], policy_dir: str, out_dir: str) -> None:
    """Two updates on FSDP critic ranks, a checkpoint between them; then a fresh group of fresh
    critics loads the checkpoint and runs the second update again."""
    from rldock.runtime.engines.process_group import Rendezvous, destroy_process_group
    from rldock.runtime.flow.states import StageCall

    torch.set_num_threads(1)
    first, second = _critic_batch(1), _critic_batch(2)
    critic = _critic(policy_dir, rank=rank, world_size=WORLD, banks=RankShareDock(first, rank))
    critic.join_group(Rendezvous("127.0.0.1", ports[0]))
    stats = critic.update(StageCall(1))
    stepped = critic.backend.full_weights()
    critic.save(out_dir)
    critic.banks = RankShareDock(second, rank)
    kept = critic.update(StageCall(2))
    kept_weights = critic.backend.full_weights()
    dist.barrier()  # every rank's last collective has arrived before the group goes (see _fsdp_rank)
    destroy_process_group()

    resumed = _critic(policy_dir, rank=rank, world_size=WORLD, banks=RankShareDock(second, rank))
    resumed.join_group(Rendezvous("127.0.0.1", ports[1]))
    resumed.restore(str(out_dir))
    loaded = resumed.backend.full_weights()
    again = resumed.update(StageCall(2))
    torch.save(  # stage results as plain dicts: the test loads with torch.load's weights_only default
        {
            "stats": _plain(stats),
            "stepped": stepped,
            "kept": _plain(kept),
            "kept_weights": kept_weights,
            "loaded": loaded,
            "again": _plain(again),
            "again_weights": resumed.backend.full_weights(),
        },
        Path(out_dir) / f"critic-rank{rank}.pt",
    )
    dist.barrier()
    destroy_process_group()


def _plain(result) -> dict:
    """A stage's result (StageResult) as the dict the assertions read: its metrics and sample count."""
    return {**result.metrics, "num_samples": result.num_samples}


def test_fsdp_critic_ranks_step_like_one_process_and_resume_from_their_checkpoint(tmp_path):
    from rldock.runtime.flow.states import StageCall
    from rldock.runtime.models.tiny import build_tiny_model
    from rldock.runtime.training.fsdp import FsdpBackend

    # 40 tokens (36 characters and 4 special ones): the batches' ids stay below 32
    texts = [string.ascii_lowercase + string.digits]
    policy_dir = build_tiny_model(tmp_path / "policy", texts=texts, seed=0, hidden_size=64, num_heads=2, num_kv_heads=1)
    rank_processes.spawn(
        _critic_rank, args=((_free_port(), _free_port()), str(policy_dir), str(tmp_path)), nprocs=WORLD
    )
    ranks = [torch.load(tmp_path / f"critic-rank{r}.pt") for r in range(WORLD)]
    # One process over the whole batch (the lone rank's step, which equals the hand-computed one:
    # tests/unit/runtime/workers/test_critic_update.py).
    whole = _critic(str(policy_dir), rank=0, world_size=1, banks=RankShareDock(_critic_batch(1), 0))
    whole.banks.rows = torch.arange(CRITIC_SAMPLES)
    assert type(whole.backend) is not FsdpBackend
    expected = _plain(whole.update(StageCall(1)))
    for got in ranks:
        for name, tensor in whole.model.state_dict().items():
            torch.testing.assert_close(got["stepped"][name], tensor, rtol=1e-4, atol=1e-5, msg=name)
        assert got["stats"]["value_grad_norm"] == pytest.approx(expected["value_grad_norm"], rel=1e-4)
        assert got["stats"]["num_samples"] == CRITIC_SAMPLES // WORLD
        # The whole model's sum, added up from the shards, the same on every rank.
        whole_sum = math.fsum(float(t.double().sum()) for t in got["stepped"].values())
        assert got["stats"]["weights_sum"] == pytest.approx(whole_sum, rel=1e-12)
        assert got["stats"]["weights_sum"] == ranks[0]["stats"]["weights_sum"]
        # The checkpoint gave the fresh ranks the weights and AdamW state: the second update is the same.
        for name, tensor in got["stepped"].items():
            assert torch.equal(got["loaded"][name], tensor), name
        for name, tensor in got["kept_weights"].items():
            assert torch.equal(got["again_weights"][name], tensor), name
        assert got["again"]["value_loss"] == got["kept"]["value_loss"]
        assert got["again"]["weights_sum"] == got["kept"]["weights_sum"]
