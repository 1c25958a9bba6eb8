"""The actor worker state: one Ray actor per actor rank, wiring the roles an actor rank holds to the
dock's stages (rollout, old logprobs, the reference under LoRA, the update or DPO's preference step)
and to the trainer's set-up and checkpoint calls. Each role is an object of its own:

- the trainable policy and its training backend (rldock.runtime.training: DDP replicas, FSDP2
  shards or a TP x DP mesh), applied to the loaded model in `join_group` through the ranks'
  `TrainingGroup`; the update and the preference step are `training/policy_steps.py`'s, over this
  rank's share (`train_share`), and the checkpoint's files `training/policy_checkpoint.py`'s;
- the generation engine (`RankEngine`, engines/rank_engine.py): on the first rank of each
  generation replica (`rollout.tensor_parallel_size` consecutive ranks) one vLLM engine on the
  replica's devices, fed the policy's weights after each update; the replica's other ranks hold none;
- the rollout mode (rldock.runtime.rollout: plain, streamed, agent episodes, carried episodes or
  partial rollout),
  built once: the rollout, partial rollout's second round, the old-logprob pass (tokens an older
  version sampled) and the held-out evaluation ask it;
- the policy's scoring passes (engines/policy_passes.py) for the inference stages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tensordict import TensorDict
from transformers import PreTrainedModel

from rldock.config import JobConfig
from rldock.runtime.algorithms.importance import IMPORTANCE_WEIGHT, truncated_importance_weight
from rldock.runtime.algorithms.rollout_correction import MISMATCH_KEY, correction_weight, mismatch_part
from rldock.runtime.checkpoint import OPTIMIZER_FILE
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult, run_stage
from rldock.runtime.engines.policy import PassTally
from rldock.runtime.engines.policy_passes import batch_logprobs
from rldock.runtime.engines.process_group import Rendezvous
from rldock.runtime.engines.rank_engine import PublishedWeights, RankEngine
from rldock.runtime.engines.replica_devices import RankDevice, seat_of_this_actor
from rldock.runtime.flow.columns import PARTIAL_ROLLOUT, ROUTED_EXPERTS
from rldock.runtime.flow.job_recipe import measures_mismatch
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import (
    ACTOR_INFERENCE,
    PREFERENCE_UPDATE,
    REFERENCE_INFERENCE,
    ROLLOUT,
    UPDATE,
    StageCall,
    WorkerState,
)
from rldock.runtime.models.freezing import freeze_embeddings, trainable
from rldock.runtime.models.layers import enable_activation_checkpointing
from rldock.runtime.models.loading import load_causal_lm, load_tokenizer
from rldock.runtime.models.lora import adapters_off, add_lora, has_adapters
from rldock.runtime.models.routing_replay import recording_routes
from rldock.runtime.peak import PeakUnavailable, device_rates
from rldock.runtime.rollout.modes import build_rollout
from rldock.runtime.rollout.protocol import HeldOutRequest, RolloutMode, request_of, sampling_logprobs
from rldock.runtime.training.accumulation import train_share
from rldock.runtime.training.backend import TrainingBackend
from rldock.runtime.training.group import TrainingGroup
from rldock.runtime.training.pipeline import rank_stage
from rldock.runtime.training.policy_checkpoint import save_policy
from rldock.runtime.training.policy_objective import job_objective
from rldock.runtime.training.policy_steps import policy_step, preference_step, staleness_metrics
from rldock.runtime.workers.phase_keeper import TakesTurns, in_turn
from rldock.runtime.workers.threads import apply_thread_budget

if TYPE_CHECKING:
    from peft import PeftModel

SAMPLED_LOGPROBS, _ = PARTIAL_ROLLOUT  # the engine's logprob of each sampled token


class ActorWorker(TakesTurns):
    def __init__(
        self,
        cfg: JobConfig,
        *,
        recipe: Recipe,
        rank: int,
        world_size: int,
        policy_dir: str,
        banks: DockBanks,
        adapter_dir: str | None = None,
        policy_version: int = 0,
        environment_urls: Mapping[str, Sequence[str]] | None = None,
    ):
        self.cfg, self.rank, self.world_size, self.banks = cfg, rank, world_size, banks
        # Weight updates behind the weights this rank holds (the checkpoint's iteration on resume):
        # the version the rollout tags its samples with and the update measures staleness against.
        self.policy_version = policy_version
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, recipe, device_kind=self.device.kind, role=f"actor rank {rank}")
        torch.manual_seed(cfg.seed + rank)
        self.tokenizer = load_tokenizer(policy_dir)
        # Under PP a rank reads only its stage's weights (join_group's split_stage links the cut stage).
        self.model: PreTrainedModel | PeftModel = load_causal_lm(
            policy_dir,
            dtype=cfg.model.dtype,
            device=self.device.torch_device,
            stage=rank_stage(cfg.training, rank=rank, world_size=world_size),
        )
        if cfg.training.freeze_embeddings:
            freeze_embeddings(self.model)
        if cfg.training.lora is not None:  # policy_dir is the base model; adapter_dir the trained adapters
            self.model = add_lora(self.model, cfg.training.lora, adapter_dir=adapter_dir)
        if cfg.training.gradient_checkpointing:  # before any wrapper (FSDP's hooks sit outside)
            enable_activation_checkpointing(self.model)
        self.group = TrainingGroup(cfg, device=self.device, rank=rank, world_size=world_size)
        self.backend: TrainingBackend = self.group.alone(self.model, self._make_optimizer)  # until join_group
        self.recipe = recipe  # the job's (job_recipe), built once by the driver
        self.objective = job_objective(cfg, self.recipe)  # the update's loss; None under DPO
        # DPO trains on given responses: no engine, and its rollout mode is never asked.
        self.generation = RankEngine(
            cfg,
            model=self.model,
            policy_dir=policy_dir,
            device=self.device,
            rank=rank,
            world_size=world_size,
            needed=self.recipe.needs_rollout_engine,
        )
        # Whether algorithm.rollout_correction's weights weigh the update: from the start, except under
        # monitoring.mismatch's action `correct`, which switches them on once a budget is passed
        # (`apply_rollout_correction`); until then they are computed for the mismatch/ metrics only.
        budget = cfg.monitoring.mismatch
        self.applies_correction = budget is None or budget.action != "correct"
        # An agent's episodes run on the environment servers the trainer started.
        self.rollout: RolloutMode = build_rollout(
            cfg,
            tokenizer=self.tokenizer,
            rank=rank,
            batch_size=self.generation.replica_samples,
            spec=recipe.spec(ROLLOUT.name) if recipe.needs_rollout_engine else ROLLOUT,
            environment_urls=environment_urls,
        )

    # --- set-up -------------------------------------------------------------------------------

    def pick_rendezvous(self) -> Rendezvous:
        """On rank 0: open the group's store here; every rank's `join_group` gets its address."""
        return self.group.pick_rendezvous()

    def device_seat(self) -> RankDevice:
        """Where Ray put this rank: the trainer hands each replica's devices to its engine rank."""
        return seat_of_this_actor(
            accelerator_resource=self.cfg.resources.accelerator_resource, device_kind=self.device.kind
        )

    def join_group(self, rendezvous: Rendezvous, engine_env: dict[str, str] | None = None) -> None:
        """Form the trainers' process group and apply the job's backend, then start the engine (called
        on all ranks at once; in this order, since vLLM adopts the default group). `engine_env`: an
        engine rank's replica devices at generation TP > 1 (RankEngine.start)."""
        self.backend = self.group.join(rendezvous, self.model, self._make_optimizer)
        self.generation.start(engine_env, attach=self.backend.attach_engine)

    def _make_optimizer(self, params) -> torch.optim.Optimizer:
        algo = self.cfg.algorithm
        return torch.optim.AdamW(trainable(params), lr=algo.learning_rate, weight_decay=algo.weight_decay)

    def device_rates(self, dtypes: Sequence[str]) -> dict:
        """This rank's `device_kind` and its device's peak FLOP/s and memory bandwidth in each of
        `dtypes` as `rldock bench peak` measures them (runtime/peak.py: its cache, else measured now),
        by dtype under `measured`; why not under `unavailable` where the device cannot be measured
        (no name to key the cache by, out of memory, a dtype its matmul lacks): the `mfu/` metrics'
        denominators, which a job goes on without."""
        try:
            measured = {dtype: device_rates(self.device, dtype=dtype) for dtype in dtypes}
        except (PeakUnavailable, RuntimeError) as error:  # torch's device errors (OOM among them)
            return {"device_kind": self.device.kind, "unavailable": f"{type(error).__name__}: {error}"}
        return {"device_kind": self.device.kind, "measured": measured}

    def apply_rollout_correction(self) -> None:
        """monitoring.mismatch action `correct`: the next old-logprob pass on, the correction's weights
        weigh the update (the driver calls this between iterations, after one passed the budget)."""
        self.applies_correction = True

    # --- stages -------------------------------------------------------------------------------

    @in_turn(ROLLOUT)
    def generate(self, call: StageCall) -> StageResult:
        """Rollout: whole prompt groups in, N responses per prompt out, sampled as the job's rollout
        mode does (rldock.runtime.rollout). The call's `sampling_round` counts the rounds of dynamic
        sampling (DAPO) within the iteration: each round's groups get their own sampling seeds. Its
        `round_tokens` (partial rollout, a weight update follows): cut responses there and complete
        them in `finish_rollout`."""
        # The engine holds the weights of `policy_version` updates: the responses' policy version
        # (iteration - 1 in sync mode, iteration - 2 when the async pipeline runs ahead).
        request = request_of(call, policy_version=self.policy_version)
        with self.generation.lent() as engine:
            return self.rollout.generate(engine, self.banks.bank(call.iteration), request)

    def finish_rollout(self, call: StageCall) -> StageResult:
        """Partial rollout's second round, after the weight update that cut `iteration`'s generation
        (the trainer calls this only with rollout.partial_rollout on; other modes refuse it)."""
        with self.generation.lent() as engine:
            return self.rollout.finish(
                engine, self.banks.bank(call.iteration), iteration=call.iteration, policy_version=self.policy_version
            )

    def evaluate(self, request: HeldOutRequest) -> dict:
        """Held-out responses from this rank's engine (the current policy), as the rollout mode's
        `evaluate` returns them. Not a dock stage: evaluation samples never enter the dock
        (rldock.runtime.driver.evaluation). Only ranks holding an engine."""
        with self.generation.lent() as engine:
            return self.rollout.evaluate(engine, request)

    @in_turn(REFERENCE_INFERENCE)
    def compute_ref_logprobs(self, call: StageCall) -> StageResult:
        """The reference state, run by the actor ranks under LoRA: the reference policy is the base
        model, i.e. this rank's model with its adapters off (no reference ranks, no second copy)."""
        model = self.model
        assert has_adapters(model), "the actors run the reference state only under training.lora"
        tally = PassTally()

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            with torch.no_grad(), adapters_off(model):
                logprobs = batch_logprobs(model, batch.to(self.device.torch_device), self.cfg.training, tally=tally)
            return TensorDict({"ref_logprobs": logprobs.cpu()}, batch_size=[len(indices)])

        timing = run_stage(
            self.banks.bank(call.iteration),
            self.recipe.spec(REFERENCE_INFERENCE.name),
            infer,
            rank=self.rank,
            batch_size=self.cfg.training.micro_batch_size,
        )
        return timing.with_metrics(rank=self.rank, computed=tally.as_dict())

    @in_turn(ACTOR_INFERENCE)
    def compute_old_logprobs(self, call: StageCall) -> StageResult:
        """The old logprobs and, under algorithm.routing_replay `reference`, the routing they were
        computed with (`routed_experts`, which the update replays)."""
        tally = PassTally()
        records_routing = ROUTED_EXPERTS[0] in self.recipe.spec(ACTOR_INFERENCE.name).produces
        correction, measures = self.cfg.algorithm.rollout_correction, measures_mismatch(self.cfg)
        gaps: list[dict] = []  # each batch's mismatch_part (algorithm.rollout_correction, monitoring.mismatch)

        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            batch = batch.to(self.device.torch_device)  # the dock hands out host tensors
            width = batch["prompt_ids"].shape[1] + batch["response_ids"].shape[1]  # the token grid's PL + SL
            recording = (
                recording_routes(self.model, num_rows=len(batch), row_width=width) if records_routing else nullcontext()
            )
            with torch.no_grad(), recording as routes:  # the bare model, no DDP hooks
                logprobs = batch_logprobs(self.model, batch, self.cfg.training, tally=tally, routes=routes)
            # each token's logprob under the weights that sampled it (partial rollout's older prefixes)
            older = self.rollout.older_tokens(batch, policy_version=self.policy_version)
            sampled = sampling_logprobs(logprobs, batch, older)
            rollout = self.cfg.rollout
            # the gap on the host: float64 there (its sums), which not every accelerator has
            trainer, mask = logprobs.cpu(), batch["response_mask"].cpu()
            weight = None  # the rollout correction's, which the mismatch/ metrics count the drops of
            if correction is not None:  # the ratio against these weights, the engine's logprobs in the weight
                # (never beside partial rollout's own correction: the config refuses it)
                weight = correction_weight(trainer, batch[SAMPLED_LOGPROBS].cpu(), mask, **correction.arguments())
                # 1 on every response token while `correct` waits for the budget
                columns = {
                    "old_logprobs": trainer,
                    IMPORTANCE_WEIGHT: weight if self.applies_correction else mask.to(weight.dtype),
                }
            elif rollout.importance_correction != "decoupled":
                columns = {"old_logprobs": sampled.cpu()}
            else:  # decoupled: the ratio against these weights, the sampling policy in the importance weight
                decoupled = truncated_importance_weight(logprobs, sampled, cap=rollout.importance_cap)
                columns = {"old_logprobs": trainer, IMPORTANCE_WEIGHT: decoupled.cpu()}
            if measures and self.backend.writes_results:
                # on the tokens these weights sampled (an older version's differ by the update too), by the
                # rank that writes them (a pipeline's earlier stages hold zeros; a CP or TP peer, the same)
                measured = mask if older is None else mask * ~older.cpu()
                gaps.append(mismatch_part(trainer, batch[SAMPLED_LOGPROBS].cpu(), measured, weight))
            if routes is not None:
                columns[ROUTED_EXPERTS[0]] = routes.routed_experts()
            return TensorDict(columns, batch_size=[len(indices)])

        timing = self.backend.run_inference_stage(
            self.banks.bank(call.iteration), self.recipe.spec(ACTOR_INFERENCE.name), infer
        )
        return timing.with_metrics(computed=self._computed(tally), **({MISMATCH_KEY: gaps} if gaps else {}))

    @in_turn(UPDATE)
    def update(self, call: StageCall) -> StageResult:
        """Take exactly this rank's share of the batch (token-balanced across its DP peers), step
        the optimizer, export the weights to the engine. The backend's metrics (ledger and
        resharding rows) go with the losses."""
        staleness: list[torch.Tensor] = []
        tally = PassTally()

        def track(batch: TensorDict) -> None:
            # How many updates behind the policy now training each sample's generating policy is.
            staleness.append(self.policy_version - batch["policy_version"])  # (B,)

        timing, summary = self._train_share(
            call,
            UPDATE,
            lambda mini_batch: self._optimizer_step(mini_batch, tally),
            track=track,
        )
        self.policy_version += 1
        exported = self.backend.export_weights(self.generation.push, self.generation.weights)
        return timing.with_metrics(
            **summary, **exported, **staleness_metrics(staleness), computed=self._computed(tally)
        )

    def published_weights(self) -> PublishedWeights:
        """The policy version the last update pushed, as the rollout pool's engines load it (rank 0 of a job
        with rollout.pool). The driver queues this call after that update and hands its answer to the pool's
        engines through Ray's object store, not through the driver (driver/rollout_pool.py)."""
        published = self.generation.take_published(self.policy_version)
        if published is None:
            raise RuntimeError(f"actor rank {self.rank} has no weights an update pushed since it last published")
        return published

    @in_turn(PREFERENCE_UPDATE)
    def preference_update(self, call: StageCall) -> StageResult:
        """DPO: take this rank's share of whole chosen/rejected pairs and step on the DPO loss."""
        tally = PassTally()
        timing, summary = self._train_share(
            call,
            PREFERENCE_UPDATE,
            lambda mini_batch: self._preference_step(mini_batch, tally),
            whole_groups=True,
        )
        return timing.with_metrics(**summary, computed=self._computed(tally))

    def _computed(self, tally: PassTally) -> dict[str, int]:
        """What a stage the backend ran computed on this rank: `tally`, or nothing on a TP peer (its
        passes repeat its leader's batches), so the stage's FLOPs count each pass once."""
        return tally.as_dict(counts=self.backend.counts_passes)

    def _train_share(
        self, call: StageCall, state: WorkerState, step: Callable[[TensorDict], dict], **share: Any
    ) -> tuple[StageResult, dict[str, float]]:
        """This rank's share of `state` (as the job's recipe runs it), `step` on each of its
        algorithm.num_updates_per_iteration mini-batches (training/accumulation.py's train_share);
        the training state comes back first (the backend's before_update)."""
        return train_share(
            self.backend,
            self.banks.bank(call.iteration),
            self.recipe.spec(state.name),
            step,
            num_mini_batches=self.cfg.algorithm.num_updates_per_iteration,
            **share,
        )

    def _optimizer_step(self, mini_batch: TensorDict, tally: PassTally | None = None) -> dict[str, float]:
        """One policy-gradient step on a mini-batch (training/policy_steps.py)."""
        assert self.objective is not None, f"recipe {self.recipe.name!r} has no policy loss"
        batch = mini_batch.to(self.device.torch_device)
        return policy_step(self.backend, batch, self.objective, cfg=self.cfg, world_size=self.world_size, tally=tally)

    def _preference_step(self, mini_batch: TensorDict, tally: PassTally | None = None) -> dict[str, float]:
        """One DPO step on a mini-batch of whole pairs (training/policy_steps.py)."""
        return preference_step(self.backend, mini_batch.to(self.device.torch_device), cfg=self.cfg, tally=tally)

    # --- checkpoint ---------------------------------------------------------------------------

    def save(self, staging_dir: str) -> torch.Tensor:
        """This rank's part of the actor's checkpoint state (flow/states.py: ACTOR.checkpoint): the policy
        and the optimizer (training/policy_checkpoint.py; collective where sharded); returns this rank's
        torch RNG state, which the driver keeps with the other ranks' (rng.pt)."""
        save_policy(
            Path(staging_dir),
            backend=self.backend,
            model=self.model,
            tokenizer=self.tokenizer,
            rank=self.rank,
            generation_weights=self.generation.weights,
        )
        return torch.get_rng_state()

    def restore(self, checkpoint_dir: str, rank_state: torch.Tensor) -> None:
        """The optimizer state (this rank's, as the backend keeps it) and the RNG state `save` returned; the
        policy this rank loaded as it started (policy_dir: the checkpoint's)."""
        optimizer = Path(checkpoint_dir) / OPTIMIZER_FILE
        self.backend.load_optimizer(optimizer, map_location=self.device.torch_device)
        torch.set_rng_state(rank_state)
