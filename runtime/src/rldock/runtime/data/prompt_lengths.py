"""`rldock validate`'s run of the trainer's prompt sets: every row read by the loader, rendered and
tokenized with the model's tokenizer by `PromptDataset`, as `rldock train` does once its models are
loaded, so what would stop the run there (a row the loader refuses, a prompt the template cannot
render, no prompt within `algorithm.max_prompt_length`) stops `validate` instead.

Only where the prompts can be built before the run: a model of your own (a `model.builder`
model's tokenizer is trained on the data at start) read from files (a generator writes its files
at start), without an agent section (its prompts describe the tools, which are built at start).
Reading a large file costs seconds: the loader's and the tokenizer's time.
"""

from __future__ import annotations

from rldock.config import JobConfig, Problem
from rldock.runtime.data.dataset import PromptDataset, PromptsTooLong
from rldock.runtime.data.files import columns_of, load_rows, val_columns


def prompt_set_problems(cfg: JobConfig) -> list[Problem]:
    """What building the train prompt set (and, with evaluation on, the held-out one) would refuse."""
    if cfg.model.builder is not None or cfg.data.generator is not None or cfg.agent is not None:
        return []
    from rldock.runtime.models.loading import load_tokenizer  # imports transformers: only here

    tokenizer = load_tokenizer(cfg.model.path)
    sets = [("data.train_files", cfg.data.train_files, columns_of(cfg.data))]
    if cfg.evaluation.interval > 0:
        sets.append(("data.val_files", cfg.data.val_files, val_columns(cfg.data)))
    problems = []
    for field, files, columns in sets:
        try:
            rows = load_rows(files, columns, field=field)
            PromptDataset(rows, tokenizer=tokenizer, spec=cfg.data, max_prompt_length=cfg.algorithm.max_prompt_length)
        except PromptsTooLong as error:
            problems.append(Problem("algorithm.max_prompt_length", str(error)))
        except ValueError as error:  # the loader's and the renderer's refusals, which name the file and row
            problems.append(Problem(field, str(error)))
    return problems
