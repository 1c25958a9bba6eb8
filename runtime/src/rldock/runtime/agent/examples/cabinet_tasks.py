"""The `cabinet` rows: tasks of the cabinet environment (cabinet.py beside this), each solved over several
turns in its demonstration.

A row is the task's prompt (what the model may run, then the question), its answer (a 4-digit code),
`extra_info` with what the environment rebuilds the task's files from (`task_seed`, `num_files`,
`num_lines`), and a demonstration: `ls`, the listing, `cat <the file>`, its lines, `#### <code>`. The
observations in it are what the environment answers those commands (computed by the same function),
so the warm-up shows the model exactly what a rollout will show it. Rows are a pure function of the
seed; the validation rows' task seeds are none of the train rows'.

This is not a `data.generator`: its rows are only useful with their environment
(`agent.environment`), so they live beside it and are written as files for `data.train_files` by
`rldock data generate cabinet` (data/ never imports agent/: tests/unit/test_import_layers.py).
"""

from __future__ import annotations

import numpy as np

from rldock.runtime.agent.examples.cabinet import NUM_FILES, NUM_LINES, Task, build_cabinet, run
from rldock.runtime.data.rows import GeneratedRows

DATA_SOURCE = "cabinet"
SEED_SPACE = 2**31  # task seeds are drawn below this


def demonstration(task: Task) -> list[dict]:
    """The messages after the prompt that solve `task`: list, read the right file, answer."""
    messages: list[dict] = []
    for command in ("ls", f"cat {task.file}"):
        observation = run(task, command)
        assert observation.message is not None and not observation.done, "a command's output goes on"
        messages += [{"role": "assistant", "content": command}, {"role": "user", "content": observation.message}]
    return [*messages, {"role": "assistant", "content": f"#### {task.answer}"}]


def cabinet_row(task_seed: int, *, num_files: int, num_lines: int) -> dict:
    """One row with the logical keys `prompt`, `answer`, `data_source`, `extra_info`, `demonstration`."""
    task = build_cabinet(task_seed, num_files=num_files, num_lines=num_lines)
    return {
        "prompt": task.prompt,
        "answer": task.answer,
        "data_source": DATA_SOURCE,
        "extra_info": {"task_seed": task_seed, "num_files": num_files, "num_lines": num_lines},
        "demonstration": demonstration(task),
    }


def generate_cabinet(
    *, num_train: int, num_val: int, seed: int, num_files: int = NUM_FILES, num_lines: int = NUM_LINES
) -> GeneratedRows:
    """`num_train` and `num_val` rows of distinct tasks; a ValueError names a shape the environment cannot
    build (before any row is made)."""
    build_cabinet(0, num_files=num_files, num_lines=num_lines)  # checks the shape
    seeds = _distinct_seeds(np.random.default_rng([seed, 0]), num_train, exclude=set())
    val_seeds = _distinct_seeds(np.random.default_rng([seed, 1]), num_val, exclude=set(seeds))
    return GeneratedRows(
        train=[cabinet_row(s, num_files=num_files, num_lines=num_lines) for s in seeds],
        val=[cabinet_row(s, num_files=num_files, num_lines=num_lines) for s in val_seeds],
    )


def _distinct_seeds(rng: np.random.Generator, count: int, *, exclude: set[int]) -> list[int]:
    seeds: list[int] = []
    seen = set(exclude)
    while len(seeds) < count:
        candidate = int(rng.integers(SEED_SPACE))
        if candidate not in seen:
            seen.add(candidate)
            seeds.append(candidate)
    return seeds
