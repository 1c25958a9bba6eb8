"""The actor worker state: one Ray actor per actor rank, holding the trainable policy and, on the
first rank of each generation replica (`rollout.tensor_parallel_size` consecutive ranks), the
replica's rollout engine on the same devices (generation, old-logprob inference and the update).
With generation TP 1 every rank holds its own engine; with TP g one engine of vLLM TP g serves g
ranks, generating the whole replica's share of the prompts, and the other ranks hold none.

How the engine samples is the job's rollout mode (rldock.runtime.rollout: plain, streamed, agent
episodes or partial rollout), built once in the constructor; the rollout, partial rollout's second
round, the old-logprob pass (tokens an older version sampled) and the held-out evaluation ask it.

How the ranks train together is the job's training backend (rldock.runtime.training), applied
to the loaded model once, in `join_group`: DDP replicas that each push their own weights into their
engine in memory (`training/ddp.py`), FSDP2 shards that push the gathered weights
(`training/fsdp.py`, docs/scaling.md), or a TP x DP layout that reshards into the engines
(`training/tensor_parallel.py`, docs/resharding.md). The stages below are written once for all
three: the update and the preference step share one accumulation loop (`training/accumulation.py`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from peft import PeftModel
from tensordict import TensorDict
from torch.distributed import TCPStore
from transformers import PreTrainedModel

from rldock.config import JobConfig
from rldock.runtime.agent.base import EpisodeContext
from rldock.runtime.algorithms.aggregation import additive_units
from rldock.runtime.algorithms.dpo import PreferenceObjective
from rldock.runtime.algorithms.policy_objective import job_objective
from rldock.runtime.algorithms.recipes import job_recipe
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageTiming, run_stage
from rldock.runtime.engines.distributed import Rendezvous, init_process_group, open_rendezvous
from rldock.runtime.engines.generation_memory import engine_kv_cache_bytes
from rldock.runtime.engines.policy import (
    ResponseScores,
    micro_batch_rows,
    response_attention,
    response_logprobs,
    response_logprobs_and_entropy,
)
from rldock.runtime.engines.replica_devices import RankDevice, seat_of_this_actor
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.models.freezing import freeze_embeddings, trainable
from rldock.runtime.models.layers import enable_activation_checkpointing
from rldock.runtime.models.loading import load_causal_lm, load_tokenizer
from rldock.runtime.models.lora import adapters_off, add_lora, merged_weights
from rldock.runtime.resharding.parallel_layout import ParallelLayout
from rldock.runtime.rollout.base import HeldOutRequest, RolloutMode, RolloutRequest
from rldock.runtime.rollout.modes import build_rollout
from rldock.runtime.threads import apply_thread_budget
from rldock.runtime.training.accumulation import accumulate, train_share
from rldock.runtime.training.backend import TrainingBackend
from rldock.runtime.training.ddp import DdpBackend
from rldock.runtime.training.strategies import build_backend
from rldock.runtime.turns import TakesTurns, in_turn

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # a LoRA checkpoint's trained adapters (peft format), beside `policy`


class ActorWorker(TakesTurns):
    def __init__(
        self,
        cfg: JobConfig,
        *,
        rank: int,
        world_size: int,
        policy_dir: str,
        banks: DockBanks,
        adapter_dir: str | None = None,
        policy_version: int = 0,
        train_files: Sequence[str] = (),
        environment_urls: Mapping[str, Sequence[str]] | None = None,
    ):
        self.cfg, self.rank, self.world_size, self.banks = cfg, rank, world_size, banks
        self._group_store: TCPStore | None = None  # rank 0's listening store, from pick_rendezvous
        # Weight updates behind the weights this rank holds (the checkpoint's iteration on resume):
        # the version the rollout tags its samples with and the update measures staleness against.
        self.policy_version = policy_version
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, device_kind=self.device.kind, role=f"actor rank {rank}")
        torch.manual_seed(cfg.seed + rank)
        self.tokenizer = load_tokenizer(policy_dir)
        self.model: PreTrainedModel | PeftModel = load_causal_lm(
            policy_dir, dtype=cfg.model.dtype, device=self.device.torch_device
        )
        if cfg.training.freeze_embeddings:
            freeze_embeddings(self.model)
        if cfg.training.lora is not None:  # policy_dir is the base model; adapter_dir the trained adapters
            self.model = add_lora(self.model, cfg.training.lora, adapter_dir=adapter_dir)
        if cfg.training.gradient_checkpointing:  # before any wrapper (FSDP's hooks sit outside)
            enable_activation_checkpointing(self.model)
        # A world of one running the bare model until join_group applies the job's strategy.
        self.backend: TrainingBackend = DdpBackend(
            cfg,
            model=self.model,
            optimizer=self._make_optimizer(self.model.parameters()),
            rank=rank,
            world_size=world_size,
        )
        self.policy_dir = policy_dir
        self.recipe = job_recipe(cfg)
        self.objective = job_objective(cfg, self.recipe)  # the update's loss; None under DPO
        self.engine: VllmRolloutEngine | None = None  # started by join_group on a replica's first rank
        # Generation replicas of consecutive actor ranks; the first rank of each holds the engine.
        self.generation = ParallelLayout.over(
            world_size, tp_size=cfg.rollout.tensor_parallel_size, field="rollout.tensor_parallel_size"
        )
        self.holds_engine = self.generation.tp_rank(rank) == 0
        # How the engine's responses are sampled (plain, streamed, agent episodes, partial rollout),
        # chosen once; the engine rank generates its replica's share, its TP peers hold none. An agent
        # reads train_files for an environment and the URLs of the servers the trainer started. DPO
        # generates nothing, so its mode is never asked.
        self.rollout: RolloutMode = build_rollout(
            cfg,
            tokenizer=self.tokenizer,
            rank=rank,
            batch_size=cfg.num_samples_per_iteration // world_size * self.generation.tp_size,
            columns=self.recipe.consumes.get("rollout", ()),
            train_files=train_files,
            environment_urls=environment_urls,
        )

    # --- set-up -------------------------------------------------------------------------------

    def pick_rendezvous(self) -> Rendezvous:
        """On rank 0: open the group's store here; every rank's `join_group` gets its address."""
        rendezvous, self._group_store = open_rendezvous(self.world_size)
        return rendezvous

    def device_seat(self) -> RankDevice:
        """Where Ray put this rank: the trainer hands each replica's devices to its engine rank."""
        return seat_of_this_actor(
            accelerator_resource=self.cfg.resources.accelerator_resource, device_kind=self.device.kind
        )

    def join_group(self, rendezvous: Rendezvous, engine_env: dict[str, str] | None = None) -> None:
        """Form the trainers' process group, then start the engine (called on all ranks at once).

        The order matters: an in-process vLLM engine adopts the default process group if one
        exists and otherwise creates a world of one that no later group could replace.
        `engine_env`: on an engine rank at generation TP > 1 on an accelerator, its replica's visible
        devices (rldock.runtime.engines.replica_devices), set before the engine spawns its TP workers.
        """
        init_process_group(
            self.device, rank=self.rank, world_size=self.world_size, rendezvous=rendezvous, store=self._group_store
        )
        # Collective (a TP mesh's sub-groups, FSDP's mesh), so before vLLM adopts the world.
        self.backend = build_backend(
            self.cfg,
            model=self.model,
            make_optimizer=self._make_optimizer,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
        )
        if not self.recipe.needs_rollout_engine or not self.holds_engine:  # DPO trains on given responses;
            return  # a replica's other ranks lend their devices to its first rank's engine
        algo = self.cfg.algorithm
        max_model_len = algo.max_prompt_length + algo.max_response_length
        # The engine's TP workers inherit the replica's list when they are spawned (in the engine's
        # constructor); the rank's own device stays index 0. Put back after, so that nothing this
        # process starts later sees its peers' devices.
        saved = {name: os.environ.get(name) for name in (engine_env or {})}
        os.environ.update(engine_env or {})
        try:
            self.engine = VllmRolloutEngine(
                self.policy_dir,
                rollout=self.cfg.rollout,
                dtype=self.cfg.model.dtype,
                seed=self.cfg.seed,
                max_model_len=max_model_len,
                device=self.device,
                kv_cache_bytes=engine_kv_cache_bytes(
                    self.cfg,
                    self.model,
                    device=self.device,
                    generation_tp=self.generation.tp_size,
                    max_model_len=max_model_len,
                ),
            )
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        self.backend.attach_engine(self.engine, self._generation_weights)
        if self.cfg.training.lora is not None:  # the engine started from the base; the policy has adapters
            self.engine.update_weights(self._generation_weights())

    def _make_optimizer(self, params) -> torch.optim.Optimizer:
        algo = self.cfg.algorithm
        return torch.optim.AdamW(trainable(params), lr=algo.learning_rate, weight_decay=algo.weight_decay)

    def load_optimizer(self, path: str) -> None:
        self.backend.load_optimizer(Path(path), map_location=self.device.torch_device)

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    # --- stages -------------------------------------------------------------------------------

    @in_turn("rollout")
    def generate(self, iteration: int, sampling_round: int = 0, round_tokens: int | None = None) -> dict:
        """Rollout: whole prompt groups in, N responses per prompt out, sampled as the job's rollout
        mode does (rldock.runtime.rollout). `sampling_round` counts the rounds of dynamic sampling
        (DAPO) within the iteration: each round's groups get their own sampling seeds. `round_tokens`
        (partial rollout, a weight update follows): cut responses there and complete them in
        `finish_rollout`."""
        engine = self._held_engine()
        # The engine holds the weights of `policy_version` updates: the responses' policy version
        # (iteration - 1 in sync mode, iteration - 2 when the async pipeline runs ahead).
        request = RolloutRequest(
            iteration=iteration,
            policy_version=self.policy_version,
            sampling_round=sampling_round,
            round_tokens=round_tokens,
        )
        metrics = self.rollout.generate(engine, self.banks.bank(iteration), request)
        engine.sleep()  # the device is the trainer's until the next generation
        return metrics

    def finish_rollout(self, iteration: int) -> dict:
        """Partial rollout's second round, after the weight update that cut `iteration`'s generation
        (the trainer calls this only with rollout.partial_rollout on; other modes refuse it)."""
        engine = self._held_engine()
        metrics = self.rollout.finish(
            engine, self.banks.bank(iteration), iteration=iteration, policy_version=self.policy_version
        )
        engine.sleep()
        return metrics

    def evaluate(
        self,
        prompts: list[list[int]],
        *,
        num_samples: int,
        greedy: bool,
        max_tokens: int,
        seed: int,
        prompt_keys: list[int],
        contexts: list[EpisodeContext | None] | None = None,
    ) -> dict:
        """Held-out responses from this rank's engine (the current policy): `responses`, per prompt
        `num_samples` token id lists, EOS included when generated (an agent's: each episode's final
        turn, with `agent` its metric sums and `environment_rewards` each episode's per step; `contexts`
        are the prompts' rows an environment checks against).
        Not a dock stage: evaluation samples never enter the dock (rldock.runtime.evaluation). Only
        ranks holding an engine."""
        engine = self._held_engine()
        request = HeldOutRequest(
            prompts=prompts,
            num_samples=num_samples,
            greedy=greedy,
            max_tokens=max_tokens,
            seed=seed,
            prompt_keys=prompt_keys,
            contexts=contexts,
        )
        out = self.rollout.evaluate(engine, request)
        engine.sleep()
        return out

    def _held_engine(self) -> VllmRolloutEngine:
        """This rank's engine; only the first rank of a generation replica holds one."""
        if self.engine is None:
            raise RuntimeError(
                f"actor rank {self.rank} holds no engine (rollout.tensor_parallel_size "
                f"{self.generation.tp_size}): generate and evaluate on ranks {self.generation.leaders()}"
            )
        return self.engine

    @in_turn("reference")
    def compute_ref_logprobs(self, iteration: int) -> dict:
        """The reference state, run by the actor ranks under LoRA: the reference policy is the base
        model, i.e. this rank's model with its adapters off (no reference ranks, no second copy)."""
        model = self.model
        assert isinstance(model, PeftModel), "the actors run the reference state only under training.lora"

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            with torch.no_grad(), adapters_off(model):
                logprobs = self._logprobs(batch.to(self.device.torch_device))
            return TensorDict({"ref_logprobs": logprobs.cpu()}, batch_size=[len(indices)])

        return run_stage(
            self.banks.bank(iteration),
            "reference",
            self.recipe.consumes["reference"],
            infer,
            rank=self.rank,
            batch_size=self.cfg.training.micro_batch_size,
        ).as_dict()

    @in_turn("actor_inference")
    def compute_old_logprobs(self, iteration: int) -> dict:
        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            batch = batch.to(self.device.torch_device)  # the dock hands out host tensors
            with torch.no_grad():
                logprobs = self._logprobs(batch)
            # each token's logprob under the weights that sampled it (partial rollout's older prefixes)
            logprobs = self.rollout.sampling_logprobs(logprobs, batch, policy_version=self.policy_version)
            return TensorDict({"old_logprobs": logprobs.cpu()}, batch_size=[len(indices)])

        return self.backend.run_inference_stage(
            self.banks.bank(iteration), "actor_inference", self.recipe.consumes["actor_inference"], infer
        ).as_dict()

    @in_turn("update")
    def update(self, iteration: int) -> dict:
        """Take exactly this rank's share of the batch (token-balanced across its DP peers), step
        the optimizer, export the weights to the engine. The backend's metrics (ledger and
        resharding rows) go with the losses."""
        staleness: list[torch.Tensor] = []

        def track(batch: TensorDict) -> None:
            # How many updates behind the policy now training each sample's generating policy is.
            staleness.append(self.policy_version - batch["policy_version"])  # (B,)

        timing, summary = self._train_share(
            iteration, "update", self.recipe.consumes["update"], self._optimizer_step, track=track
        )
        self.policy_version += 1
        exported = self.backend.export_weights(self._push_weights, self._generation_weights)
        return {**timing.as_dict(), **summary, **exported, **_staleness_metrics(staleness)}

    @in_turn("preference_update")
    def preference_update(self, iteration: int) -> dict:
        """DPO: take this rank's share of whole chosen/rejected pairs and step on the DPO loss."""
        timing, summary = self._train_share(
            iteration,
            "preference_update",
            self.banks.states["preference_update"],
            self._preference_step,
            whole_groups=True,
        )
        return {**timing.as_dict(), **summary}

    def _train_share(
        self, iteration: int, state: str, columns: tuple[str, ...], step: Callable[[TensorDict], dict], **share: Any
    ) -> tuple[StageTiming, dict[str, float]]:
        """This rank's share of `state`, `step` on each of its algorithm.num_updates_per_iteration
        mini-batches (training/accumulation.py's train_share); the training state comes back first
        (TP: parameters too, when no old-logprob pass brought them)."""
        return train_share(
            self.backend,
            self.banks.bank(iteration),
            state,
            columns,
            step,
            num_mini_batches=self.cfg.algorithm.num_updates_per_iteration,
            after_inference="actor_inference" in self.recipe.consumes,
            **share,
        )

    # --- checkpoint ---------------------------------------------------------------------------

    def save(self, staging_dir: str) -> None:
        """Rank 0 writes the policy (HF format, loadable by the engine); the optimizer state goes
        where the backend keeps it (one file, or TP shards beside it). Collective under FSDP and TP
        (gathers), with the training state swapped in for the save and out again after."""
        staging = Path(staging_dir)
        with self.backend.resident():
            weights = self.backend.full_weights()
            self.backend.save_optimizer(staging / "optimizer.pt")
            if self.rank != 0:
                return
            if isinstance(self.model, PeftModel):  # training.lora: the merged policy, the adapters to resume
                base = cast(PreTrainedModel, self.model.get_base_model())  # peft types it nn.Module
                base.save_pretrained(staging / "policy", state_dict=dict(self._generation_weights()))
                self.model.save_pretrained(str(staging / ADAPTER_DIR))
            elif weights is not None:  # gathered from the shards
                self.model.save_pretrained(staging / "policy", state_dict=weights)
            else:
                self.model.save_pretrained(staging / "policy")
            self.tokenizer.save_pretrained(staging / "policy")

    # --- helpers ------------------------------------------------------------------------------

    def _push_weights(self, named_tensors) -> None:
        """The new weights into this rank's engine; a rank without one (a generation TP peer) has
        nothing to load, its replica's first rank pushes the same full weights. It still runs the
        iterator to the end: under FSDP each tensor is gathered from every rank as it is drawn."""
        if self.engine is not None:
            self.engine.update_weights(named_tensors)
            return
        for _ in named_tensors:
            pass

    def _generation_weights(self):
        """(HF name, tensor) pairs of the policy as the engine loads it: the adapters merged in on
        the fly under LoRA (the trained adapters stay as they are)."""
        if isinstance(self.model, PeftModel):  # training.lora
            return merged_weights(self.model)
        return self.model.state_dict().items()

    def _logprobs(self, batch: TensorDict) -> torch.Tensor:
        """Logprobs for inference (old logprobs): the bare model, no DDP hooks."""
        return response_logprobs(
            self.model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            micro_batch_size=self.cfg.training.micro_batch_size,
            max_tokens=self.cfg.training.micro_batch_tokens,
            trim=self.cfg.training.trim_padding,
            attention_mask=response_attention(batch),
        )

    def _scores(self, batch: TensorDict) -> ResponseScores:
        """Logprobs (with gradients) and the policy's entropy of a micro-batch's response tokens, one
        forward pass."""
        return response_logprobs_and_entropy(
            self.backend.training_module(),
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["response_ids"],
            batch["response_mask"],
            micro_batch_size=len(batch),
            trim=self.cfg.training.trim_padding,
            attention_mask=response_attention(batch),
        )

    def _optimizer_step(self, mini_batch: TensorDict) -> dict:
        """One optimizer step over a mini-batch, accumulating micro-batches (training.micro_batch_size
        rows, within training.micro_batch_tokens when set); the loss aggregated over the whole
        mini-batch by algorithm.loss_aggregation (the token mean by default), algorithms/policy_objective.py."""
        objective = self.objective
        assert objective is not None, f"recipe {self.recipe.name!r} has no policy loss"
        mini_batch = mini_batch.to(self.device.torch_device)
        rank_tokens = mini_batch["response_mask"].sum().float().clamp(min=1)  # this rank's metrics' weights
        global_units = objective.units(mini_batch)
        if self.world_size > 1 and additive_units(objective.aggregation):
            torch.distributed.all_reduce(global_units)
        units_per_rank = global_units.clamp(min=torch.finfo(global_units.dtype).tiny) / self.world_size

        def micro_loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
            scores = self._scores(micro)
            return objective(
                scores.logprobs, scores.entropy, micro, units_per_rank=units_per_rank, rank_tokens=rank_tokens
            )

        training = self.cfg.training
        rows = micro_batch_rows(
            mini_batch["prompt_mask"],
            response_attention(mini_batch),
            micro_batch_size=training.micro_batch_size,
            trim=training.trim_padding,  # sorted by length: trimming cuts more
            max_tokens=training.micro_batch_tokens,
        )
        return accumulate(
            self.backend, [mini_batch[r] for r in rows], micro_loss, max_grad_norm=self.cfg.algorithm.max_grad_norm
        )

    def _preference_step(self, mini_batch: TensorDict) -> dict:
        """One optimizer step on the DPO loss over a mini-batch of whole pairs, accumulating
        micro-batches of whole pairs (an even micro_batch_size, problems.py). The loss is a mean
        over pairs; every rank holds as many pairs, so DDP's mean over ranks is the global pair mean."""
        algo = self.cfg.algorithm
        objective = PreferenceObjective(
            beta=algo.dpo.beta,
            label_smoothing=algo.dpo.label_smoothing,
            kl_estimator=algo.kl_estimator,
            kl_clamp=algo.kl_clamp,
        )
        mini_batch = mini_batch.to(self.device.torch_device)

        def micro_loss(micro: TensorDict) -> tuple[torch.Tensor, dict[str, float]]:
            scores = self._scores(micro)
            return objective(scores.logprobs, scores.entropy, micro, share=len(micro) / len(mini_batch))

        micro_batches = mini_batch.split(self.cfg.training.micro_batch_size)
        return accumulate(self.backend, micro_batches, micro_loss, max_grad_norm=algo.max_grad_norm)


def _staleness_metrics(staleness: list[torch.Tensor]) -> dict:
    """`staleness_mean` / `staleness_max`: policy versions between the samples an update trained on
    and the policy it started from (0 on-policy, 1 for the async pipeline's samples)."""
    values = torch.cat(staleness).float()  # (B,)
    return {"staleness_mean": float(values.mean()), "staleness_max": float(values.max())}
