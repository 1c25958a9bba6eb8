"""`evaluation`: held-out evaluation of the policy (docs/evaluation.md), and its checks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from rldock.config.problem import Problem
from rldock.config.section import Spec
from rldock.contract.algorithms import needs_rollout

if TYPE_CHECKING:  # the section's checks read the whole config, which composes this section
    from rldock.config.job import JobConfig


class EvaluationSpec(Spec):
    """Held-out evaluation of the current policy: greedy (or sampled) responses to validation
    prompts, scored by the job's reward and logged as `val/...` metrics (docs/evaluation.md)."""

    interval: int = Field(
        default=0,
        ge=0,
        description="Evaluate every this many iterations (and always after the last one); 0 disables.",
    )
    at_start: bool = Field(
        default=True,
        description="Also evaluate the initial policy before iteration 1 (logged as iteration 0): the "
        "baseline the later evaluations compare with. Ignored when `interval` is 0.",
    )
    max_prompts: int | None = Field(
        default=None,
        ge=1,
        le=10**6,
        description="Evaluate only the first this many held-out prompts; unset uses all of them.",
    )
    num_samples: int = Field(default=1, ge=1, le=1024, description="Responses generated per held-out prompt.")
    greedy: bool = Field(
        default=True,
        description="Generate with temperature 0 (deterministic; needs `num_samples` 1); false samples with "
        "`rollout.temperature` and `rollout.top_p`.",
    )
    correct_threshold: float = Field(
        default=1.0,
        ge=-1e6,
        le=1e6,
        description="A response counts as correct when its reward is at least this; `val/accuracy` is the "
        "share of correct responses.",
    )


def problems(cfg: JobConfig) -> list[Problem]:
    evaluation = cfg.evaluation
    found: list[Problem] = []
    if evaluation.greedy and evaluation.num_samples > 1:
        found.append(
            Problem(
                "evaluation.num_samples",
                f"greedy evaluation (evaluation.greedy true) gives every prompt the same response, so "
                f"{evaluation.num_samples} samples would repeat it; set evaluation.num_samples to 1 or "
                "evaluation.greedy to false",
            )
        )
    generated_val = cfg.data.generator is not None and cfg.data.generator.num_val_prompts > 0
    if evaluation.interval > 0 and not (cfg.data.val_files or generated_val):
        found.append(
            Problem(
                "evaluation.interval",
                "evaluation needs held-out prompts: list them in data.val_files (or, with data.generator, set "
                "data.generator.num_val_prompts), or set evaluation.interval to 0",
            )
        )
    # The other way round: held-out files listed while evaluation is off would never be read, and no
    # val/ metric would ever appear; refused rather than warned, since the default interval is 0 and
    # listing the files is the user's statement that they want the evaluation.
    if evaluation.interval == 0 and cfg.data.val_files and cfg.data.generator is None:
        found.append(
            Problem(
                "evaluation.interval",
                f"data.val_files lists {len(cfg.data.val_files)} held-out file(s), but evaluation.interval is 0 "
                "(the default), so they would never be read and no val/ metric would appear; set "
                "evaluation.interval (e.g. 20: every 20 iterations and after the last) or remove data.val_files",
            )
        )
    # Held-out responses are scored in the driver, which holds no reward model (docs/rewards.md).
    if evaluation.interval > 0 and all(term.name == "model" for term in cfg.reward.terms):
        found.append(
            Problem(
                "evaluation.interval",
                "held-out evaluation scores with the reward terms other than `model`, and this job has none; add "
                "one (weight 0 counts it for evaluation only, e.g. {name: math_verify, weight: 0}) or set "
                "evaluation.interval to 0",
            )
        )
    if evaluation.interval > 0 and not needs_rollout(cfg.algorithm.name):
        found.append(
            Problem(
                "evaluation.interval",
                f"algorithm.name {cfg.algorithm.name} runs no rollout engine to generate held-out responses "
                "with; set evaluation.interval to 0",
            )
        )
    return found
