"""Context parallelism in both modes, Ulysses and ring attention, on real gloo ranks
(torch.multiprocessing, CPU): CP 2 and CP 4 give one process's logprobs, entropy, loss and gradients
on a packed batch, on padded rows and on rows trimmed of their padding (and the critic's values and
gradients on padded rows, the only layout its pass runs), and CP 2 inside FSDP over 4 ranks (2
data-parallel ranks of 2 CP ranks) gives one process's mean gradient over the two data-parallel
batches. Ulysses runs on a model of 8 heads and 4 KV heads; ring on one of 3 heads and 1 KV head,
which no CP size here divides.

Everything runs in float64, so the comparison measures the method, not float32 rounding: a CP rank
computes the same sums as one process, cut differently (its rows' positions through the linear layers,
its heads (Ulysses) or its keys' blocks (ring) through attention, gradients added over ranks), so
results differ by reassociation only, a few ulps of float64 (~1e-16 relative) times the depth of the
sums; 1e-9 holds on any CPU and thread count, while a wrong shard, mask or position gives differences
of order 1e-2 and up.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import rank_processes
import torch
import torch.distributed as dist

from rldock_e2e.scored_batch import LAYOUTS, scored_batch

pytestmark = pytest.mark.ranks

TINY = dict(
    vocab_size=48,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,  # grouped-query attention, divisible by CP 4
    head_dim=8,
    max_position_embeddings=64,
    attn_implementation="sdpa",
)
TOLERANCE = dict(rtol=1e-9, atol=1e-11)


# Ring attention keeps every head on every rank: 3 heads and 1 KV head, which neither CP 2 nor 4 divides.
RING_HEADS = dict(num_attention_heads=3, num_key_value_heads=1)
MODES = {"ulysses": {}, "ring": RING_HEADS}


def _model(mode: str = "ulysses"):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**{**TINY, **MODES[mode]})).double().eval()


def _batch(seed: int) -> dict[str, torch.Tensor]:
    return scored_batch(seed, vocab_size=TINY["vocab_size"])


def _scores_and_loss(model, batch, layout: str):
    """Logprobs (4, 7), entropy (4, 7) and a loss linear in the logprobs, with gradients."""
    from rldock.runtime.engines.policy import response_logprobs_and_entropy

    scores = response_logprobs_and_entropy(
        model,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["response_ids"],
        batch["response_mask"],
        **LAYOUTS[layout],
    )
    loss = (scores.logprobs * batch["weights"]).sum()
    return scores.logprobs, scores.entropy, loss


def _value_model(mode: str = "ulysses"):
    from rldock.runtime.models.value import ValueModel

    body = _model(mode).model
    value = ValueModel(body, TINY["hidden_size"]).double()
    torch.nn.init.normal_(value.head.weight, generator=torch.Generator().manual_seed(2))  # not the zero start
    return value


def _values_and_loss(model, batch):
    """The critic's values (4, 7) of the batch's padded rows and a loss linear in them."""
    from rldock.runtime.engines.values import response_values

    values = response_values(
        model,
        batch["prompt_ids"],
        batch["prompt_mask"],
        batch["response_ids"],
        batch["response_mask"],
        micro_batch_size=2,
    )
    return values, (values * batch["weights"]).sum()


def _grads(model) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):  # an FSDP shard: collective, every rank in the same order
            grad = grad.full_tensor()
        grads[name] = grad.detach().clone()
    return grads


def _rank(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    from rldock.runtime.device import detect_device
    from rldock.runtime.engines.fsdp_sharding import apply_fsdp
    from rldock.runtime.engines.policy import packing_prompts
    from rldock.runtime.resharding.parallel_mesh import MeshShape, ParallelMesh
    from rldock.runtime.training.context_parallel import apply_context_parallel, sum_over_context

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    results: dict = {}
    every_rank = ParallelMesh(MeshShape(dp=1, cp=world), "cpu")
    pairs = ParallelMesh(MeshShape(dp=2, cp=2), "cpu") if world == 4 else None
    for mode in MODES:
        # CP over every rank: each holds the whole batch and computes 1/world of each sequence.
        model = _model(mode)
        apply_context_parallel(model, every_rank, mode)
        batch = _batch(1)
        attention = batch["response_mask"]
        packing = packing_prompts(
            model, batch["prompt_ids"], batch["prompt_mask"], attention, trim=True, micro_batch_size=4
        )
        assert packing is not None  # the "packed" layout does pack
        for layout in LAYOUTS:
            model.zero_grad()
            logprobs, entropy, loss = _scores_and_loss(model, batch, layout)
            loss.backward()
            results[mode, layout] = dict(
                logprobs=logprobs.detach(), entropy=entropy, loss=float(loss.detach()), grads=_grads(model)
            )
        critic = _value_model(mode)
        apply_context_parallel(critic.body, every_rank, mode)
        values, loss = _values_and_loss(critic, batch)
        loss.backward()
        results[mode, "critic"] = dict(values=values.detach(), grads=_grads(critic))
        if world == 4:
            # CP 2 inside FSDP over the 4 ranks: data-parallel rank rank // 2 trains on its own batch.
            model = _model(mode)
            assert pairs is not None
            apply_context_parallel(model, pairs, mode)
            apply_fsdp(model, detect_device("cpu"), pairs)
            sum_over_context(model, dp=2)
            for layout in LAYOUTS:
                model.zero_grad()
                logprobs, _, loss = _scores_and_loss(model, _batch(10 + rank // 2), layout)
                loss.backward()
                results[mode, f"fsdp_{layout}"] = dict(
                    logprobs=logprobs.detach(), loss=float(loss.detach()), grads=_grads(model)
                )
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()  # no rank tears the group down while a peer's gloo thread still talks to it
    dist.destroy_process_group()


def _one_process(batch_seed: int, layout: str, mode: str) -> dict:
    model = _model(mode)
    logprobs, entropy, loss = _scores_and_loss(model, _batch(batch_seed), layout)
    loss.backward()
    return dict(logprobs=logprobs.detach(), entropy=entropy, loss=float(loss.detach()), grads=_grads(model))


@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "cp4+cp2xfsdp"])
def test_context_parallel_ranks_equal_one_process(tmp_path, world):
    """Both modes: Ulysses on the 8-head model, ring on the 3-head one that no CP size here divides."""
    # a file rendezvous in the test's own directory: a probed free port could be taken before rank 0 binds it
    rank_processes.spawn(_rank, args=(world, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=world)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for mode in MODES:
        for layout in LAYOUTS:
            expected = _one_process(1, layout, mode)
            for got in ranks:  # every CP rank holds the whole batch's scores and loss
                torch.testing.assert_close(got[mode, layout]["logprobs"], expected["logprobs"], **TOLERANCE)
                torch.testing.assert_close(got[mode, layout]["entropy"], expected["entropy"], **TOLERANCE)
                assert got[mode, layout]["loss"] == pytest.approx(expected["loss"], rel=1e-9)
            for name, grad in expected["grads"].items():  # each rank's share of the gradient, summed
                total = sum(got[mode, layout]["grads"][name] for got in ranks)
                torch.testing.assert_close(total, grad, **TOLERANCE, msg=f"{mode} {layout} {name}")
        critic = _value_model(mode)
        values, loss = _values_and_loss(critic, _batch(1))
        loss.backward()
        for got in ranks:  # the critic's pass: every rank holds all values, the gradient shares add up
            torch.testing.assert_close(got[mode, "critic"]["values"], values.detach(), **TOLERANCE)
        for name, grad in _grads(critic).items():
            total = sum(got[mode, "critic"]["grads"][name] for got in ranks)
            torch.testing.assert_close(total, grad, **TOLERANCE, msg=f"{mode} {name}")
        if world == 4:
            for layout in LAYOUTS:
                shards = [_one_process(10 + d, layout, mode) for d in range(2)]
                for rank, got in enumerate(ranks):
                    torch.testing.assert_close(
                        got[mode, f"fsdp_{layout}"]["logprobs"], shards[rank // 2]["logprobs"], **TOLERANCE
                    )
                for name in shards[0]["grads"]:  # FSDP's reduction: the sum over CP, the mean over DP
                    mean = (shards[0]["grads"][name] + shards[1]["grads"][name]) / 2
                    torch.testing.assert_close(
                        ranks[0][mode, f"fsdp_{layout}"]["grads"][name], mean, **TOLERANCE, msg=f"{mode} {name}"
                    )
