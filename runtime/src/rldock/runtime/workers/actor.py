"""The actor worker state: one Ray actor per actor rank, holding the trainable policy and, on the
first rank of each generation replica (`rollout.tensor_parallel_size` consecutive ranks), the
replica's rollout engine on the same devices (generation, old-logprob inference and the update).
With generation TP 1 every rank holds its own engine; with TP g one engine of vLLM TP g serves g
ranks, generating the whole replica's share of the prompts, and the other ranks hold none.

After each update the rank pushes its weights straight into its engine in memory; DDP keeps every
rank's weights identical, so no cross-rank transfer is needed. With `training.tensor_parallel_size`
> 1 or `training.resharding: allgather_swap` the ranks train in a TP x DP layout instead and reshard
into their engines (`actor_resharding.ShardedTraining`, docs/resharding.md). With
`training.strategy: fsdp` the ranks shard the model with FSDP2 and push the gathered weights
(`actor_fsdp.FsdpTraining`, docs/scaling.md).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.config.job import generation_dtype
from rldock.runtime.algorithms import get_policy_loss, kl_penalty, masked_mean
from rldock.runtime.algorithms.aggregation import additive_units, aggregate, aggregation_units
from rldock.runtime.algorithms.kl import kl_clamp_fraction
from rldock.runtime.algorithms.dpo import dpo_loss, sequence_logprobs
from rldock.runtime.algorithms.recipes import job_recipe
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.engines.distributed import Rendezvous, init_process_group, open_rendezvous, wrap_ddp
from rldock.runtime.engines.policy import (ResponseScores, response_logprobs, response_logprobs_and_entropy,
                                           sort_by_tokens)
from rldock.runtime.engines.generation_memory import kv_bytes_per_token, kv_cache_budget, tensor_bytes
from rldock.runtime.engines.replica_devices import RankDevice, seat_of_this_actor
from rldock.runtime.engines.vllm_rollout import VllmRolloutEngine
from rldock.runtime.models.freezing import freeze_embeddings, trainable
from rldock.runtime.models.layers import enable_activation_checkpointing
from rldock.runtime.models.loading import load_causal_lm, load_tokenizer
from rldock.runtime.models.lora import add_lora, adapters_off, merged_weights
from rldock.runtime.resharding.parallel_layout import ParallelLayout
from rldock.runtime.threads import apply_thread_budget
from rldock.runtime.turns import TakesTurns, in_turn
from rldock.runtime.workers.actor_fsdp import FsdpTraining
from rldock.runtime.workers.actor_resharding import ShardedTraining, uses_sharded_training
from rldock.runtime.workers.partial_rollout import PartialRollout, behaviour_logprobs
from rldock.runtime.workers.stage_loop import run_stage

logger = logging.getLogger(__name__)

ADAPTER_DIR = "adapter"  # a LoRA checkpoint's trained adapters (peft format), beside `policy`


class ActorWorker(TakesTurns):
    def __init__(self, cfg: JobConfig, *, rank: int, world_size: int, policy_dir: str,
                 banks: DockBanks, adapter_dir: str | None = None, policy_version: int = 0):
        self.cfg, self.rank, self.world_size, self.banks = cfg, rank, world_size, banks
        self._group_store = None  # rank 0's listening store, from pick_rendezvous
        # Weight updates behind the weights this rank holds (the checkpoint's iteration on resume):
        # the version the rollout tags its samples with and the update measures staleness against.
        self.policy_version = policy_version
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, device_kind=self.device.kind, role=f"actor rank {rank}")
        torch.manual_seed(cfg.seed + rank)
        self.tokenizer = load_tokenizer(policy_dir)
        self.model = load_causal_lm(policy_dir, dtype=cfg.model.dtype, device=self.device.torch_device)
        if cfg.training.freeze_embeddings:
            freeze_embeddings(self.model)
        if cfg.training.lora is not None:  # policy_dir is the base model; adapter_dir the trained adapters
            self.model = add_lora(self.model, cfg.training.lora, adapter_dir=adapter_dir)
        if cfg.training.gradient_checkpointing:  # before any wrapper (FSDP's hooks sit outside)
            enable_activation_checkpointing(self.model)
        self.ddp_model = None  # set by init_distributed
        self.fsdp: FsdpTraining | None = None  # strategy fsdp, set by join_group
        self.sharded: ShardedTraining | None = None  # TP x DP layout and resharding, set by join_group
        algo = cfg.algorithm
        self.optimizer = self._make_optimizer(self.model.parameters())
        self.policy_dir = policy_dir
        self.recipe = job_recipe(cfg)
        self.policy_loss = get_policy_loss(self.recipe.policy_loss) if self.recipe.policy_loss else None
        self.policy_loss_kwargs = self.recipe.policy_loss_kwargs(algo)
        self.kl_estimator = algo.kl_estimator
        self.engine: VllmRolloutEngine | None = None  # started by join_group on a replica's first rank
        # Generation replicas of consecutive actor ranks; the first rank of each holds the engine.
        self.generation = ParallelLayout.over(world_size, tp_size=cfg.rollout.tensor_parallel_size,
                                              field="rollout.tensor_parallel_size")
        self.holds_engine = self.generation.tp_rank(rank) == 0
        # rollout.partial_rollout: generations run ahead of an update are cut, completed after it
        self.partial = None if cfg.rollout.partial_rollout == "off" else PartialRollout(
            mode=cfg.rollout.partial_rollout, num_responses=algo.num_responses_per_prompt,
            max_response_length=algo.max_response_length, eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id, num_prompts_per_iteration=algo.num_prompts_per_iteration)

    # --- set-up -------------------------------------------------------------------------------

    def pick_rendezvous(self) -> Rendezvous:
        """On rank 0: open the group's store here; every rank's `join_group` gets its address."""
        rendezvous, self._group_store = open_rendezvous(self.world_size)
        return rendezvous

    def device_seat(self) -> RankDevice:
        """Where Ray put this rank: the trainer hands each replica's devices to its engine rank."""
        return seat_of_this_actor(accelerator_resource=self.cfg.resources.accelerator_resource,
                                  device_kind=self.device.kind)

    def join_group(self, rendezvous: Rendezvous, engine_env: dict[str, str] | None = None) -> None:
        """Form the trainers' process group, then start the engine (called on all ranks at once).

        The order matters: an in-process vLLM engine adopts the default process group if one
        exists and otherwise creates a world of one that no later group could replace.
        `engine_env`: on an engine rank at generation TP > 1 on an accelerator, its replica's visible
        devices (rldock.runtime.engines.replica_devices), set before the engine spawns its TP workers.
        """
        init_process_group(self.device, rank=self.rank, world_size=self.world_size, rendezvous=rendezvous,
                           store=self._group_store)
        if uses_sharded_training(self.cfg):  # the mesh's sub-groups form before vLLM adopts the world
            self.sharded = ShardedTraining(self.cfg, model=self.model, make_optimizer=self._make_optimizer,
                                           rank=self.rank, device_type=torch.device(self.device.torch_device).type)
            self.optimizer = self.sharded.optimizer
        elif self.cfg.training.strategy == "fsdp":
            self.fsdp = FsdpTraining(self.cfg, model=self.model, make_optimizer=self._make_optimizer,
                                     device=self.device, rank=self.rank)
            self.optimizer = self.fsdp.optimizer
        else:
            self.ddp_model = wrap_ddp(self.model, self.device)
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
                self.policy_dir, rollout=self.cfg.rollout, dtype=self.cfg.model.dtype,
                seed=self.cfg.seed, max_model_len=max_model_len, device=self.device,
                kv_cache_bytes=self._kv_cache_bytes(max_model_len))
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        if self.sharded is not None:
            self.sharded.attach_engine(self.engine.update_weights)
        else:  # rollout.sleep_level 2 discards the engine's weights: push ours again
            self.engine.memory.reload = lambda: self.engine.update_weights(self._generation_weights())
        if self.cfg.training.lora is not None:  # the engine started from the base; the policy has adapters
            self.engine.update_weights(self._generation_weights())

    def _make_optimizer(self, params) -> torch.optim.Optimizer:
        algo = self.cfg.algorithm
        return torch.optim.AdamW(trainable(params), lr=algo.learning_rate, weight_decay=algo.weight_decay)

    def load_optimizer(self, path: str) -> None:
        if self.sharded is not None:  # this TP rank's shard (see ShardedTraining.optimizer_path)
            self.sharded.load_optimizer_state(torch.load(self.sharded.optimizer_path(Path(path)),
                                                         map_location=self.device.torch_device))
            return
        if self.fsdp is not None:
            self.fsdp.load_optimizer_state(Path(path))
            return
        self.optimizer.load_state_dict(torch.load(path, map_location=self.device.torch_device))

    def get_rng_state(self) -> torch.Tensor:
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        torch.set_rng_state(state)

    # --- stages -------------------------------------------------------------------------------

    @in_turn("rollout")
    def generate(self, iteration: int, sampling_round: int = 0, round_tokens: int | None = None) -> dict:
        """Rollout: whole prompt groups in, N responses per prompt out. `sampling_round` counts
        the rounds of dynamic sampling (DAPO) within the iteration: each round's groups get
        their own sampling seeds. `round_tokens` (partial rollout, a weight update follows): cut
        responses there and complete them in `finish_rollout`."""
        if self.partial is not None:
            timing = self.partial.first_round(
                self.engine, self.banks.bank(iteration), iteration=iteration, sampling_round=sampling_round,
                columns=self.recipe.consumes["rollout"], rank=self.rank, batch_size=self._samples_per_rank(),
                policy_version=self.policy_version, round_tokens=round_tokens)
            self.engine.sleep()
            return timing
        algo = self.cfg.algorithm
        group = algo.num_responses_per_prompt
        eos = self.tokenizer.eos_token_id
        response_lengths: list[int] = []

        dock = self.banks.bank(iteration)
        stream_groups = self.cfg.rollout.stream_groups
        streamed_s = 0.0  # seconds spent writing finished groups from inside the rollout

        def responses_of(per_prompt: list[list[list[int]]]) -> TensorDict:
            """(responses, mask, policy version) columns of whole groups, N rows per prompt."""
            responses = torch.full((len(per_prompt) * group, algo.max_response_length), self.tokenizer.pad_token_id,
                                   dtype=torch.int64)  # (B, SL)
            mask = torch.zeros_like(responses)
            versions = torch.full((len(responses),), self.policy_version, dtype=torch.int64)  # (B,)
            for i, tokens in enumerate(r for group_responses in per_prompt for r in group_responses):
                responses[i, :len(tokens)] = torch.tensor(tokens, dtype=torch.int64)
                mask[i, :len(tokens)] = 1
                response_lengths.append(len(tokens))
            return TensorDict({"response_ids": responses, "response_mask": mask, "policy_version": versions},
                              batch_size=[len(responses)])

        def rollout(indices: torch.Tensor, batch: TensorDict) -> TensorDict | None:
            nonlocal streamed_s
            # The dock holds the prompt once per sample; one engine request per group.
            prompt_ids, prompt_mask = batch["prompt_ids"][::group], batch["prompt_mask"][::group]
            prompts = [ids[mask.bool()].tolist() for ids, mask in zip(prompt_ids, prompt_mask)]
            # Seeded by (job seed, iteration, round, group index): a resumed run, or the same group
            # landing on another rank, samples the same responses.
            keys = indices[::group] // group + sampling_round * algo.num_prompts_per_iteration
            request = dict(n=group, max_tokens=algo.max_response_length, eos_token_id=eos, seed=iteration,
                           prompt_keys=keys.tolist())
            if stream_groups == 0:
                return responses_of(self.engine.generate(prompts, **request))
            # Finer streaming: groups go to the dock as they finish, stream_groups at a time.
            finished: list[tuple[int, list[list[int]]]] = []
            written = 0  # groups of this batch already in the dock
            for position, group_responses in self.engine.stream(prompts, **request):
                finished.append((position, group_responses))
                if len(finished) == stream_groups or written + len(finished) == len(prompts):
                    written += len(finished)
                    rows = torch.cat([indices[p * group:(p + 1) * group] for p, _ in finished])  # (k*N,)
                    out = responses_of([r for _, r in finished])
                    started = time.perf_counter()
                    dock.put(rows, out, policy_version=self.policy_version)
                    streamed_s += time.perf_counter() - started
                    finished = []
            return None  # every group was written above

        # The engine holds the weights of `policy_version` updates: the responses' policy version
        # (iteration - 1 in sync mode, iteration - 2 when the async pipeline runs ahead).
        # The replica's share: this rank's and its generation TP peers' (they hold no engine).
        timing = run_stage(dock, "rollout", self.recipe.consumes["rollout"], rollout, rank=self.rank,
                           batch_size=self._samples_per_rank() * self.generation.tp_size, whole_groups=True,
                           policy_version=self.policy_version)
        timing.compute_s -= streamed_s  # the streamed writes are data movement, not generation
        timing.dispatch_s += streamed_s
        self.engine.sleep()  # the device is the trainer's until the next generation
        timing.extra["response_lengths"] = response_lengths
        return timing.as_dict()

    def finish_rollout(self, iteration: int) -> dict:
        """Partial rollout's second round, after the weight update that cut `iteration`'s generation."""
        timing = self.partial.finish(self.engine, self.banks.bank(iteration), iteration=iteration,
                                     policy_version=self.policy_version)
        self.engine.sleep()
        return timing

    def evaluate(self, prompts: list[list[int]], *, num_samples: int, greedy: bool, max_tokens: int,
                 seed: int, prompt_keys: list[int]) -> list[list[list[int]]]:
        """Held-out responses from this rank's engine (the current policy), per prompt
        `num_samples` token id lists, EOS included when generated. Not a dock stage: evaluation
        samples never enter the dock (rldock.runtime.evaluation). Only ranks holding an engine."""
        if self.engine is None:
            raise RuntimeError(f"actor rank {self.rank} holds no engine (rollout.tensor_parallel_size "
                               f"{self.generation.tp_size}): evaluate on ranks {self.generation.leaders()}")
        completions = self.engine.sample(prompts, n=num_samples, max_tokens=max_tokens,
                                         eos_token_id=self.tokenizer.eos_token_id, seed=seed, greedy=greedy,
                                         prompt_keys=prompt_keys)
        self.engine.sleep()
        return [[c.token_ids for c in group] for group in completions]

    @in_turn("reference")
    def compute_ref_logprobs(self, iteration: int) -> dict:
        """The reference state, run by the actor ranks under LoRA: the reference policy is the base
        model, i.e. this rank's model with its adapters off (no reference ranks, no second copy)."""
        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            with torch.no_grad(), adapters_off(self.model):
                logprobs = self._logprobs(batch.to(self.device.torch_device))
            return TensorDict({"ref_logprobs": logprobs.cpu()}, batch_size=[len(indices)])

        return run_stage(self.banks.bank(iteration), "reference", self.recipe.consumes["reference"], infer,
                         rank=self.rank, batch_size=self.cfg.training.micro_batch_size).as_dict()

    @in_turn("actor_inference")
    def compute_old_logprobs(self, iteration: int) -> dict:
        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            batch = batch.to(self.device.torch_device)  # the dock hands out host tensors
            with torch.no_grad():
                logprobs = self._logprobs(batch)
            if self.partial is not None:  # tokens an older version sampled keep that version's logprob
                logprobs = behaviour_logprobs(logprobs, batch["sampled_logprobs"], batch["policy_version"],
                                              batch["prefix_length"], current_version=self.policy_version)
            return TensorDict({"old_logprobs": logprobs.cpu()}, batch_size=[len(indices)])

        dock = self.banks.bank(iteration)
        if self.sharded is not None:  # the TP group computes together; its params come back first
            self.sharded.begin_inference()
            return self.sharded.run_training_stage(
                dock, "actor_inference", self.recipe.consumes["actor_inference"], infer,
                batch_size=self.cfg.training.micro_batch_size).as_dict()
        if self.fsdp is not None:  # FSDP's forward is collective: every rank runs its share in as many passes
            self.fsdp.to_training()
            return run_stage(dock, "actor_inference", self.recipe.consumes["actor_inference"], infer,
                             rank=self.rank, batch_size=self._samples_per_rank(), balance_ranks=self.world_size,
                             max_batches=1).as_dict()
        return run_stage(dock, "actor_inference", self.recipe.consumes["actor_inference"], infer,
                         rank=self.rank, batch_size=self.cfg.training.micro_batch_size).as_dict()

    @in_turn("update")
    def update(self, iteration: int) -> dict:
        """Take exactly this rank's share of the batch (token-balanced across ranks), step the
        optimizer, refresh the engine."""
        algo = self.cfg.algorithm
        losses: list[dict] = []
        staleness: list[torch.Tensor] = []

        def train(indices: torch.Tensor, batch: TensorDict) -> None:
            # How many updates behind the policy now training each sample's generating policy is.
            staleness.append(self.policy_version - batch["policy_version"])  # (B,)
            for mini_batch in batch.split(len(batch) // algo.num_updates_per_iteration):
                losses.append(self._optimizer_step(mini_batch))

        if self.sharded is not None:
            return {**self._sharded_update(iteration, train, losses), **_staleness_metrics(staleness)}
        if self.fsdp is not None:
            self.fsdp.to_training()
        timing = run_stage(self.banks.bank(iteration), "update", self.recipe.consumes["update"], train, rank=self.rank,
                           batch_size=self._samples_per_rank(), balance_ranks=self.world_size, max_batches=1)
        assert timing.num_samples == self._samples_per_rank(), "update got a partial share"
        summary = {key: sum(step[key] for step in losses) / len(losses) for key in losses[0]}
        self.policy_version += 1
        if self.fsdp is not None:
            self.fsdp.to_generation(self._push_weights)  # collective: every rank gathers
            return {**timing.as_dict(), **summary, **self.fsdp.drain_metrics(), **_staleness_metrics(staleness)}
        self._push_weights(self._generation_weights())
        return {**timing.as_dict(), **summary, **_staleness_metrics(staleness)}

    def _sharded_update(self, iteration: int, train, losses: list[dict]) -> dict:
        """`update` in the TP x DP layout: the grads and optimizer state come back first, each TP
        group trains on its DP share, then the weights are resharded into the engine (and the
        training state swapped out in allgather_swap mode). The ledger rows go with the metrics."""
        sharded = self.sharded
        if "actor_inference" not in self.recipe.consumes:  # no old-logprob pass brought the params back
            sharded.begin_inference()
        sharded.before_update()
        share = self.cfg.num_samples_per_iteration // sharded.dp_size
        timing = sharded.run_training_stage(self.banks.bank(iteration), "update", self.recipe.consumes["update"], train,
                                            batch_size=share, balance=True, max_batches=1)
        assert timing.num_samples == share, "update got a partial share"
        sharded.to_generation()
        self.policy_version += 1
        summary = {key: sum(step[key] for step in losses) / len(losses) for key in losses[0]}
        return {**timing.as_dict(), **summary, **sharded.drain_metrics()}

    @in_turn("preference_update")
    def preference_update(self, iteration: int) -> dict:
        """DPO: take this rank's share of whole chosen/rejected pairs and step on the DPO loss."""
        algo = self.cfg.algorithm
        steps: list[dict] = []

        def train(indices: torch.Tensor, batch: TensorDict) -> None:
            for mini_batch in batch.split(len(batch) // algo.num_updates_per_iteration):
                steps.append(self._preference_step(mini_batch))

        timing = run_stage(self.banks.bank(iteration), "preference_update", self.banks.states["preference_update"], train,
                           rank=self.rank, batch_size=self._samples_per_rank(), whole_groups=True,
                           balance_ranks=self.world_size, max_batches=1)
        assert timing.num_samples == self._samples_per_rank(), "preference_update got a partial share"
        summary = {key: sum(step[key] for step in steps) / len(steps) for key in steps[0]}
        return {**timing.as_dict(), **summary}

    # --- checkpoint ---------------------------------------------------------------------------

    def save(self, staging_dir: str) -> None:
        """Rank 0 writes the policy (HF format, loadable by the engine) and the optimizer."""
        if self.sharded is not None:
            self._save_sharded(Path(staging_dir))
            return
        if self.fsdp is not None:
            self._save_fsdp(Path(staging_dir))
            return
        if self.rank != 0:
            return
        staging = Path(staging_dir)
        if self.cfg.training.lora is not None:  # the merged policy for readers, the adapters to resume
            self.model.get_base_model().save_pretrained(staging / "policy", state_dict=dict(self._generation_weights()))
            self.model.save_pretrained(staging / ADAPTER_DIR)
        else:
            self.model.save_pretrained(staging / "policy")
        self.tokenizer.save_pretrained(staging / "policy")
        torch.save(self.optimizer.state_dict(), staging / "optimizer.pt")

    def _save_sharded(self, staging: Path) -> None:
        """Collective: the full weights are gathered over TP; every rank of DP replica 0 writes its
        optimizer shard. The training state is swapped in for the save and out again after."""
        sharded = self.sharded
        with sharded.resident():
            weights = sharded.full_state_dict()
            if sharded.dp_rank == 0:
                torch.save(sharded.optimizer_state(), sharded.optimizer_path(staging / "optimizer.pt"))
            if self.rank == 0:
                self.model.save_pretrained(staging / "policy", state_dict=weights)
                self.tokenizer.save_pretrained(staging / "policy")

    def _save_fsdp(self, staging: Path) -> None:
        """Collective: the weights and the optimizer state are gathered whole; rank 0 writes them,
        so the checkpoint has the same files as a DDP run's. The files are written before the state
        is swapped out again: on CPU the gathered optimizer state can share the swapped tensors."""
        with self.fsdp.resident():
            weights = self.fsdp.full_weights()
            optimizer = self.fsdp.full_optimizer_state()
            if self.rank == 0:
                self.model.save_pretrained(staging / "policy", state_dict=weights)
                self.tokenizer.save_pretrained(staging / "policy")
                torch.save(optimizer, staging / "optimizer.pt")

    # --- helpers ------------------------------------------------------------------------------

    def _kv_cache_bytes(self, max_model_len: int) -> int | None:
        """The engine's KV cache on an accelerator: its share of the device less its weights and the
        training state left there while generating (none when allgather_swap swaps it out). None for
        a CPU engine (the npu twin's too), where rollout.cpu_kv_cache_gib sizes it."""
        if self.device.engine_kind == "cpu":
            return None
        params = list(self.model.parameters())
        weight_bytes = tensor_bytes(params)
        # The engine holds the weights (and its KV cache) in its own dtype, rollout.dtype when set.
        engine_element_size = getattr(torch, generation_dtype(
            model_dtype=self.cfg.model.dtype, rollout_dtype=self.cfg.rollout.dtype, on_cpu=False)).itemsize
        engine_weight_bytes = (weight_bytes // params[0].element_size() * engine_element_size
                               // self.generation.tp_size)  # per device: vLLM splits them
        trainable_bytes = tensor_bytes(p for p in params if p.requires_grad)
        # grads plus AdamW's two moments, one of each per trainable parameter
        resident = 0 if self.cfg.training.resharding == "allgather_swap" else weight_bytes + 3 * trainable_bytes
        config = self.model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        device_type = torch.device(self.device.torch_device).type
        budget = kv_cache_budget(
            device_bytes=torch.get_device_module(device_type).mem_get_info()[1],
            utilization=self.cfg.rollout.gpu_memory_utilization, engine_weight_bytes=engine_weight_bytes,
            resident_training_bytes=resident, min_tokens=max_model_len,
            bytes_per_token=kv_bytes_per_token(num_layers=config.num_hidden_layers,
                                               num_kv_heads=config.num_key_value_heads // self.generation.tp_size,
                                               head_dim=head_dim,
                                               dtype_bytes=engine_element_size))
        logger.info("actor rank %d: KV cache %.2f GiB (engine weights %.2f GiB, training state resident while "
                    "generating %.2f GiB)", self.rank, budget / 2**30, engine_weight_bytes / 2**30, resident / 2**30)
        return budget

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
        if self.cfg.training.lora is not None:
            return merged_weights(self.model)
        return self.model.state_dict().items()

    def _samples_per_rank(self) -> int:
        return self.cfg.num_samples_per_iteration // self.world_size

    def _logprobs(self, batch: TensorDict) -> torch.Tensor:
        """Logprobs for inference (old logprobs): the bare model, no DDP hooks."""
        return response_logprobs(self.model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                                 batch["response_mask"], micro_batch_size=self.cfg.training.micro_batch_size,
                                 trim=self.cfg.training.trim_padding)

    def _scores(self, batch: TensorDict) -> ResponseScores:
        """Logprobs (with gradients) and the policy's entropy of the response tokens, one forward pass."""
        model = self.ddp_model if self.ddp_model is not None else self.model
        return response_logprobs_and_entropy(model, batch["prompt_ids"], batch["prompt_mask"], batch["response_ids"],
                                             batch["response_mask"], micro_batch_size=self.cfg.training.micro_batch_size,
                                             trim=self.cfg.training.trim_padding)

    def _optimizer_step(self, mini_batch: TensorDict) -> dict:
        """One optimizer step over a mini-batch, accumulating micro-batches; the loss aggregated over
        the whole mini-batch by algorithm.loss_aggregation (the token mean by default)."""
        algo = self.cfg.algorithm
        device = self.device.torch_device
        mini_batch = mini_batch.to(device)
        local_tokens = mini_batch["response_mask"].sum().float().clamp(min=1)  # this rank's metrics' weights
        # The aggregate over the whole mini-batch across ranks: each micro-batch's aggregate is scaled
        # by its units (tokens, responses, or the constant length) over the mean units per rank, and
        # DDP averages gradients over ranks. The update is then the same however the dock split the
        # samples between ranks and micro-batches.
        aggregation = {"mode": algo.loss_aggregation, "norm_length": algo.max_response_length}
        global_units = aggregation_units(mini_batch["response_mask"], row_weights=self._row_weights(mini_batch),
                                         **aggregation)
        if self.world_size > 1 and additive_units(algo.loss_aggregation):
            torch.distributed.all_reduce(global_units)
        units_per_rank = global_units.clamp(min=torch.finfo(global_units.dtype).tiny) / self.world_size
        if self.cfg.training.trim_padding:  # similar lengths per micro-batch, so trimming cuts more
            mini_batch = mini_batch[sort_by_tokens(mini_batch)]
        micro_batches = mini_batch.split(self.cfg.training.micro_batch_size)
        self.optimizer.zero_grad(set_to_none=True)
        # clip_fraction, dual_clip_fraction, log_ratio_clamp_fraction, kl_clamp_fraction: the share
        # of tokens each bound touched (the ratio clip, dual-clip, the log ratio's before exp(), k3's)
        clip_keys = ("clip_fraction", "dual_clip_fraction", "log_ratio_clamp_fraction")
        stats = {"loss": 0.0, "policy_loss": 0.0, "kl": 0.0, **dict.fromkeys(clip_keys, 0.0),
                 "kl_clamp_fraction": 0.0, "entropy": 0.0}
        for i, micro in enumerate(micro_batches):
            mask = micro["response_mask"].float()  # (b, SL)
            row_weights = self._row_weights(micro)  # (b,) or None
            weight = aggregation_units(mask, row_weights=row_weights, **aggregation) / units_per_rank
            last = i == len(micro_batches) - 1
            context = torch.enable_grad() if last or self.ddp_model is None else self.ddp_model.no_sync()
            with context:
                scores = self._scores(micro)
                logprobs = scores.logprobs  # (b, SL)
                policy = self.policy_loss(logprobs, self._old_logprobs(micro, logprobs), micro["advantage"], mask,
                                          aggregation=algo.loss_aggregation, row_weights=row_weights,
                                          norm_length=algo.max_response_length, **self.policy_loss_kwargs)
                kl, kl_clamped = torch.zeros(()), torch.zeros(())  # no reference with kl_coef 0
                if self._update_reads("ref_logprobs"):
                    kl_tokens = kl_penalty(logprobs, micro["ref_logprobs"], estimator=self.kl_estimator,
                                           max_kl=algo.kl_clamp)  # (b, SL)
                    kl = aggregate(kl_tokens, mask, row_weights=row_weights, **aggregation)
                    kl_clamped = kl_clamp_fraction(kl_tokens, mask, algo.kl_clamp)
                loss = policy.loss + algo.kl_coef * kl
                (loss * weight).backward()
            w = (mask.sum() / local_tokens).item()  # this rank's metrics: its own token mean
            stats["loss"] += loss.item() * w
            stats["policy_loss"] += policy.loss.item() * w
            stats["kl"] += kl.item() * w
            for key in clip_keys:
                stats[key] += getattr(policy, key).item() * w
            stats["kl_clamp_fraction"] += kl_clamped.item() * w
            stats["entropy"] += masked_mean(scores.entropy, mask).item() * w  # token mean, nats
        if self.sharded is not None:  # no DDP here: average over DP and clip over the TP-split model
            stats["grad_norm"] = self.sharded.apply_gradients(algo.max_grad_norm)
            return stats
        stats["grad_norm"] = self._clip_gradients(algo.max_grad_norm)
        self.optimizer.step()
        return stats

    def _clip_gradients(self, max_norm: float) -> float:
        if self.fsdp is not None:  # the norm over every rank's shards
            return self.fsdp.clip_gradients(max_norm)
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def _old_logprobs(self, micro: TensorDict, logprobs: torch.Tensor) -> torch.Tensor:
        """The sampling policy's logprobs (b, SL): the dock's `old_logprobs` when the flow computes
        them, else this forward pass's own, detached (job_recipe drops the pass only when the
        sampling policy is the one training, so the ratio is exactly 1)."""
        return micro["old_logprobs"] if self._update_reads("old_logprobs") else logprobs.detach()

    def _row_weights(self, batch: TensorDict) -> torch.Tensor | None:
        """Each response's weight in the loss aggregation (b,): PF-PPO's filtration weights; None
        (every response 1) where the flow carries none."""
        return batch["loss_weight"] if self._update_reads("loss_weight") else None

    def _update_reads(self, column: str) -> bool:
        return column in self.recipe.consumes[self.recipe.update_state]

    def _preference_step(self, mini_batch: TensorDict) -> dict:
        """One optimizer step on the DPO loss over a mini-batch of whole pairs (rows 2i chosen,
        2i+1 rejected), accumulating micro-batches of whole pairs. The loss is a mean over pairs;
        every rank holds as many pairs, so DDP's mean over ranks is the global pair mean."""
        algo = self.cfg.algorithm
        mini_batch = mini_batch.to(self.device.torch_device)
        micro_batches = mini_batch.split(self.cfg.training.micro_batch_size)  # an even size (problems.py)
        self.optimizer.zero_grad(set_to_none=True)
        stats = dict.fromkeys(("loss", "policy_loss", "kl", "entropy", "preference_accuracy", "reward_margin",
                               "policy_preference_accuracy"), 0.0)
        for i, micro in enumerate(micro_batches):
            mask = micro["response_mask"].float()  # (b, SL)
            weight = len(micro) / len(mini_batch)  # this micro-batch's share of the pairs
            last = i == len(micro_batches) - 1
            context = torch.enable_grad() if last or self.ddp_model is None else self.ddp_model.no_sync()
            with context:
                scores = self._scores(micro)
                logprobs = scores.logprobs  # (b, SL)
                out = dpo_loss(sequence_logprobs(logprobs, mask), sequence_logprobs(micro["ref_logprobs"], mask),
                               beta=algo.dpo.beta, label_smoothing=algo.dpo.label_smoothing)
                (out.loss * weight).backward()
            with torch.no_grad():  # logged only: how far the policy drifted from the reference
                kl = masked_mean(kl_penalty(logprobs.detach(), micro["ref_logprobs"], estimator=self.kl_estimator,
                                            max_kl=algo.kl_clamp), mask)
            for key, value in {"loss": out.loss.item(), "policy_loss": out.loss.item(), "kl": kl.item(),
                               "entropy": masked_mean(scores.entropy, mask).item(), **out.metrics}.items():
                stats[key] += value * weight
        stats["grad_norm"] = self._clip_gradients(algo.max_grad_norm)
        self.optimizer.step()
        return stats


def _staleness_metrics(staleness: list[torch.Tensor]) -> dict:
    """`staleness_mean` / `staleness_max`: policy versions between the samples an update trained on
    and the policy it started from (0 on-policy, 1 for the async pipeline's samples)."""
    values = torch.cat(staleness).float()  # (B,)
    return {"staleness_mean": float(values.mean()), "staleness_max": float(values.max())}
