"""The reward-model worker state (`reward_model`): a learned reward model's score for every sample,
written to the dock as `rm_score` for the reward state's `model` term (classic RLHF).

It runs only in a job with a `model` reward term (job_recipe adds the state), on one device share
like a reference rank. What the reward model sees is text, not the policy's tokens (its vocabulary
may differ): the policy's prompt, decoded from the dock's prompt ids without special tokens (so
after the policy's chat template or data.system_prompt, as the policy saw it), followed directly
by the response text (up to the first EOS, without special tokens), re-tokenized with the reward
model's own tokenizer. No chat template of the reward model is applied: train or pick a reward
model on the same text layout.
"""

from __future__ import annotations

import torch
from tensordict import TensorDict

from rldock.config import JobConfig
from rldock.runtime.agent.trajectory import final_texts, is_trajectory
from rldock.runtime.device import detect_device
from rldock.runtime.dock.banks import DockBanks
from rldock.runtime.dock.stage_loop import StageResult, run_stage
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import REWARD_MODEL, StageCall
from rldock.runtime.models.loading import decode_responses, load_tokenizer
from rldock.runtime.models.reward_classifier import load_reward_model
from rldock.runtime.workers.phase_keeper import TakesTurns, in_turn
from rldock.runtime.workers.threads import apply_thread_budget


def sample_texts(tokenizer, batch: TensorDict) -> list[str]:
    """Prompt text + response text of each sample, decoded with the policy's `tokenizer`."""
    prompts = tokenizer.batch_decode(
        [ids[mask.bool()] for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])], skip_special_tokens=True
    )
    if is_trajectory(batch):  # multi-turn: the final turn is the answer the model scores, as the rules do
        responses = final_texts(tokenizer, batch)
    else:
        responses = decode_responses(tokenizer, batch["response_ids"], batch["response_mask"])
    return [prompt + response for prompt, response in zip(prompts, responses)]


class RewardModelWorker(TakesTurns):
    def __init__(self, cfg: JobConfig, *, recipe: Recipe, tokenizer_dir: str, banks: DockBanks):
        self.cfg, self.banks = cfg, banks
        self.spec = recipe.spec(REWARD_MODEL.name)  # the dock columns it reads, as the job runs it
        self.device = detect_device(cfg.resources.device)
        apply_thread_budget(cfg, recipe, device_kind=self.device.kind, role="reward model")
        self.tokenizer = load_tokenizer(tokenizer_dir)  # the policy's, to decode the dock's ids
        index = cfg.reward.model_term_index
        # job_recipe seats this worker only for a `model` term, whose `path` config/problems.py requires.
        assert index is not None, "no `model` reward term"
        path = cfg.reward.terms[index].path
        assert path is not None, f"reward.terms[{index}].path is unset"
        self.reward_model = load_reward_model(
            path,
            dtype=cfg.model.dtype,
            device=self.device.torch_device,
            field=f"reward.terms[{index}].path",
        )

    @in_turn(REWARD_MODEL)
    def compute_scores(self, call: StageCall) -> StageResult:
        def infer(indices: torch.Tensor, batch: TensorDict) -> TensorDict:
            scores = self.reward_model.score(sample_texts(self.tokenizer, batch))  # (B,)
            return TensorDict({"rm_score": scores}, batch_size=[len(indices)])

        return run_stage(
            self.banks.bank(call.iteration),
            self.spec,
            infer,
            rank=0,
            batch_size=self.cfg.training.micro_batch_size,
        )
