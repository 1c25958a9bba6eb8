"""What a job prepares once, before any attempt starts workers: its data files and prompt set, the
tokenizer, the base model (built when `model.builder` asks) and the initial policy (after the
supervised warm-up when one is configured: the reference and where RL starts), the feed the driver
draws each iteration's prompts from, and the held-out evaluator. An attempt (attempt.py) and the
trainer's loop read them; nothing here holds a Ray actor, so a restarted attempt finds them as they
were (the feed's position aside, which the checkpoint restores).

The driver starts Ray's processes while its inputs are prepared (`prepare_inputs(beside=...)`): on
the 2-core machine the local Ray's start takes about 4 s of wall time that the data, the tokenizer
and the warm-up (one core's Python) leave the other core free for (docs/results.md, "Starting a job").
"""

from __future__ import annotations

import logging
import os
import shutil
import string
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from rldock.config import JobConfig
from rldock.contract.layout import JobLayout
from rldock.runtime.agent.builders import job_conversation
from rldock.runtime.chat.conversation import ChatRenderer
from rldock.runtime.checkpoint import measure_write_rate
from rldock.runtime.data import (
    DataFiles,
    PromptDataset,
    PromptSampler,
    Row,
    columns_of,
    load_rows,
    prepare_data_files,
    tokenizer_corpus,
    val_columns,
)
from rldock.runtime.driver.evaluation import EvalExample, Evaluator
from rldock.runtime.driver.feed import Feed
from rldock.runtime.flow.job_recipe import job_recipe
from rldock.runtime.flow.recipe import Recipe
from rldock.runtime.flow.states import REWARD_STATE, states_layout
from rldock.runtime.models import MODEL_BUILDERS
from rldock.runtime.models.loading import load_tokenizer
from rldock.runtime.planning.checkpoint_size import checkpoint_bytes, save_seconds
from rldock.runtime.planning.shapes import load_shape
from rldock.runtime.rewards import RewardScorer, column_lists
from rldock.runtime.startup import DriverClock, collections_paused

logger = logging.getLogger(__name__)

WARMUP_DIR = "warmup"

T = TypeVar("T")


@dataclass(frozen=True)
class JobInputs:
    """A job's inputs, prepared once (`prepare_inputs`) and read by every attempt."""

    recipe: Recipe  # the flow the config runs (job_recipe), handed to every worker
    layout: JobLayout  # ranks, replicas and devices of the recipe's worker groups
    data_files: DataFiles  # the train (and val) files the prompts come from
    tokenizer: object  # the policy's
    dataset: PromptDataset  # the train prompts, rendered and tokenized
    feed: Feed  # what the driver puts each iteration, and the sampler's position
    reference_dir: Path  # the initial policy: the reference, where RL starts, the critic's body
    evaluator: Evaluator | None  # held-out evaluation; None when evaluation.interval is 0
    startup_clock: DriverClock  # the driver's start-up until its inputs were ready (timing/startup)
    checkpoint_estimate_s: float | None = None  # a save's seconds before one was measured (estimate_checkpoint_save)


def prepare_inputs(cfg: JobConfig, output_dir: Path, *, beside: Callable[[], object] | None = None) -> JobInputs:
    """The job's inputs: checks the reward terms first (before any model work), then the data, the
    base model, the tokenizer, the prompt set, the warm-up and the evaluator, in that order.

    `beside` (the driver's Ray start) runs in this thread once the reward terms are checked, while
    the rest is prepared in another (`beside_another_thread`)."""
    startup_clock = DriverClock.start()  # the driver's imports are behind it, its inputs ahead
    recipe = job_recipe(cfg)  # less the passes this config makes redundant
    if REWARD_STATE.name in recipe.states:
        RewardScorer(cfg.reward)  # fail fast (RewardError naming the term) before any model work
    with collections_paused():  # models loaded, Ray started (rldock.runtime.startup)
        if beside is None:
            return _prepare(cfg, output_dir, recipe, startup_clock)
        return beside_another_thread(lambda: _prepare(cfg, output_dir, recipe, startup_clock), beside)


def beside_another_thread(work: Callable[[], T], beside: Callable[[], object]) -> T:
    """`work`'s result, computed in a daemon thread while `beside` runs in this one. `beside`'s error
    is raised at once (not waiting for `work`: the daemon thread does not hold the process up),
    then `work`'s."""
    done: Future[T] = Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as error:  # handed to the caller's thread, which raises it
            done.set_exception(error)

    threading.Thread(target=run, name="job-inputs", daemon=True).start()
    beside()
    return done.result()


def _prepare(cfg: JobConfig, output_dir: Path, recipe: Recipe, startup_clock: DriverClock) -> JobInputs:
    data_files, rows = load_prompt_set(cfg, output_dir)
    base = prepare_base_model(cfg, rows)
    tokenizer = load_tokenizer(base)  # the warm-up saves the same tokenizer again
    conversation = job_conversation(cfg, tokenizer)  # an agent job's prompts describe its tools
    dataset = prompt_dataset(cfg, rows, tokenizer, conversation=conversation)
    logger.info(
        "prompt set: %d prompts from %s (%d dropped as longer than algorithm.max_prompt_length)",
        len(dataset),
        data_files.train,
        dataset.num_dropped,
    )
    shuffle_seed = cfg.seed if cfg.data.shuffle_seed is None else cfg.data.shuffle_seed
    feed = Feed(
        dataset,
        PromptSampler(len(dataset), seed=shuffle_seed),
        tokenizer,
        cfg.algorithm,
        recipe.driver_batch,
        rows_per_episode=cfg.rows_per_episode,
    )
    reference_dir = prepare_initial_policy(cfg, output_dir, base, dataset, conversation=conversation)
    evaluator = heldout_evaluation(cfg, tokenizer, data_files.val, conversation=conversation)
    checkpoint_estimate_s = estimate_checkpoint_save(cfg, reference_dir, output_dir)
    startup_clock.inputs_ready()
    return JobInputs(
        recipe=recipe,
        layout=states_layout(cfg, recipe.specs),
        data_files=data_files,
        tokenizer=tokenizer,
        dataset=dataset,
        feed=feed,
        reference_dir=reference_dir,
        evaluator=evaluator,
        startup_clock=startup_clock,
        checkpoint_estimate_s=checkpoint_estimate_s,
    )


def estimate_checkpoint_save(cfg: JobConfig, policy_dir: Path, output_dir: Path) -> float | None:
    """The seconds a checkpoint's save should take: the bytes it writes (rldock.runtime.planning.checkpoint_size,
    from the policy's config.json) at the write rate measured in the output folder. The progress lines carry it
    until a checkpoint's own seconds replace it, so that the operator holds the preemption grace period to a
    stop's figures from the first iteration on. None (logged) for a model the planner cannot read."""
    try:
        shape = load_shape(preset=None, model_path=str(policy_dir))
    except (ValueError, KeyError, TypeError) as error:
        logger.info("no checkpoint save estimate for %s: %s", policy_dir, error)
        return None
    size, rate = checkpoint_bytes(cfg, shape), measure_write_rate(output_dir)
    seconds = save_seconds(size, write_rate=rate)
    logger.info(
        "a checkpoint writes %.3f GiB: about %.2f s at the %.0f MiB/s measured in %s",
        size.total / 1024**3,
        seconds,
        rate / 1024**2,
        output_dir,
    )
    return seconds


def prepare_base_model(cfg: JobConfig, rows: list[Row]) -> Path:
    """The base model's directory, after building the tiny model there (with a tokenizer trained on
    the train rows) when `model.builder` asks for it and none exists yet."""
    base = Path(cfg.model.path)
    builder = cfg.model.builder
    if builder and not (base / "config.json").is_file():
        logger.info("building tiny model %s at %s", builder, base)
        texts = tokenizer_corpus(rows, cfg.data.system_prompt)
        if cfg.data.chat_template == "model":  # the template's, the tools' and their calls' characters
            texts.append(string.printable)
        # Room for a job's whole sequence (multi-turn trajectories are long); 64 for the demo's.
        positions = max(64, 1 << (cfg.algorithm.max_prompt_length + cfg.algorithm.max_response_length - 1).bit_length())
        _write_atomically(
            base,
            lambda tmp: MODEL_BUILDERS.get(builder)(tmp, texts=texts, seed=cfg.seed, max_position_embeddings=positions),
        )
    return base


def prepare_initial_policy(
    cfg: JobConfig, output_dir: Path, base: Path, dataset: PromptDataset, *, conversation: ChatRenderer | None = None
) -> Path:
    """Model dir the RL phase starts from (and the reference policy): the base model, after the
    supervised warm-up when one is configured (skipped when its output exists). `conversation`: an
    agent job's renderer, which lays its demonstrations out."""
    if cfg.warmup.steps == 0:
        return base
    warm = output_dir / WARMUP_DIR
    if not (warm / "config.json").is_file():
        # Imported when a warm-up runs: it trains a model, and model code costs the driver ~3 s of CPU
        # that a job without one (or resuming after it) does not spend.
        from rldock.runtime.driver.warmup import run_warmup

        logger.info("supervised warm-up: %d steps", cfg.warmup.steps)
        _write_atomically(
            warm,
            lambda tmp: run_warmup(
                base,
                tmp,
                dataset=dataset,
                spec=cfg.warmup,
                seed=cfg.seed,
                conversation=conversation,
                max_response_length=cfg.algorithm.max_response_length,
                micro_batch_size=cfg.training.micro_batch_size,
                micro_batch_tokens=cfg.training.micro_batch_tokens,
            ),
        )
    return warm


def prompt_dataset(cfg: JobConfig, rows: list[Row], tokenizer, *, conversation: ChatRenderer | None) -> PromptDataset:
    """`rows` rendered (data.chat_template, an agent job's `conversation`), tokenized and
    length-checked against algorithm.max_prompt_length: the train and the held-out prompts alike."""
    return PromptDataset(
        rows,
        tokenizer=tokenizer,
        spec=cfg.data,
        max_prompt_length=cfg.algorithm.max_prompt_length,
        conversation=conversation,
    )


def load_prompt_set(cfg: JobConfig, output_dir: Path) -> tuple[DataFiles, list[Row]]:
    """The job's data files (generated first if configured) and their train rows."""
    files = prepare_data_files(cfg.data, output_dir, seed=cfg.seed)
    return files, load_rows(files.train, columns_of(cfg.data))


def _write_atomically(final: Path, write) -> None:
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    write(tmp)
    if final.exists():  # another process finished the same build first
        shutil.rmtree(tmp)
    else:
        os.replace(tmp, final)


def heldout_evaluation(
    cfg: JobConfig, tokenizer, val_files: Sequence[str], *, conversation: ChatRenderer | None = None
) -> Evaluator | None:
    """The evaluator of a job: its held-out prompts (`val_files`: data.val_files, or the generator's
    val split), rendered, tokenized and length-checked exactly like the train prompts, and the job's
    reward terms to score them; None when evaluation is off. `conversation`: an agent job's renderer
    (the held-out prompts describe the tools, as the train prompts do)."""
    if cfg.evaluation.interval == 0:
        return None
    rows = load_rows(val_files, val_columns(cfg.data), field="data.val_files")
    dataset = prompt_dataset(cfg, rows, tokenizer, conversation=conversation)
    positions = range(min(len(dataset), cfg.evaluation.max_prompts or len(dataset)))
    examples = [
        EvalExample(
            prompt=e.prompt,
            ground_truth=e.ground_truth,
            data_source=e.data_source,
            extra_info=e.extra_info,
            row_prompt=row.prompt,
            columns=row.columns,
        )
        for e, row in zip(dataset.examples(positions), dataset.rows(positions))
    ]
    # The driver holds no reward model: held-out responses are scored by the other terms only
    # (config/problems.py refuses evaluation in a job whose only term is `model`).
    scorer = RewardScorer(cfg.reward.model_copy(update={"terms": [t for t in cfg.reward.terms if t.name != "model"]}))

    def score(responses: list[str], scored: list[EvalExample]) -> list[float]:
        return scorer.score(
            responses,
            [e.ground_truth for e in scored],
            [e.data_source for e in scored],
            [e.extra_info for e in scored],
            prompts=[e.prompt if e.row_prompt is None else e.row_prompt for e in scored],
            columns=column_lists([e.columns for e in scored]),
        ).scores.tolist()

    return Evaluator(
        examples,
        score,
        prompt_ids=dataset.prompt_ids(positions),
        tokenizer=tokenizer,
        spec=cfg.evaluation,
        max_response_length=cfg.algorithm.max_response_length,
    )
